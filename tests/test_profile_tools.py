"""The analysis in tests/gpu/profile_offload_prefill.py, on hand-made traces (CPU)."""

from __future__ import annotations

from tests.gpu.profile_offload_prefill import gap_causes


def copy(ts: float, dur: float, corr: int) -> dict:
    return {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": ts, "dur": dur,
            "args": {"correlation": corr}}  # fmt: skip


def call(ts: float, corr: int) -> dict:
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": ts, "dur": 5,
            "args": {"correlation": corr}}  # fmt: skip


def test_gap_causes_tells_a_late_host_from_a_copy_waiting_on_the_device():
    events = [
        copy(0, 100, 1), call(0, 1),  # the first layer's copy (left out)
        copy(200, 100, 2), call(150, 2),
        copy(1300, 100, 3), call(1200, 3),  # a 1,000 us gap; issued 900 us in: the host was late
        copy(1900, 100, 4), call(1000, 4),  # a 500 us gap; issued 400 us before it began
        {"ph": "X", "cat": "user_annotation", "name": "ft.offload.ids_to_host", "ts": 250, "dur": 950},
        {"ph": "X", "cat": "python_function", "name": "fla/ops/chunk.py(10): forward", "ts": 290, "dur": 99},
        {"ph": "X", "cat": "python_function", "name": "ft/models/decoder.py(5): fwd", "ts": 0, "dur": 1e4},
        {"ph": "X", "cat": "cpu_op", "name": "a loader thread's op", "ts": 1390, "dur": 20, "tid": 9},
    ]  # fmt: skip
    for e in events[8:11]:
        e["tid"] = 1  # the engine's thread: the one with the ft.offload ranges
    late, waited = gap_causes(events)
    assert "link idle 1.00 ms" in late and "0.90 ms into the gap (the host was late)" in late
    assert late.endswith("fla/ops/chunk.py(10): forward")  # the innermost range at the gap's start
    assert "link idle 0.50 ms" in waited and "0.40 ms before the gap (it waited on the device)" in waited
    assert waited.endswith("ft/models/decoder.py(5): fwd")
