"""The analysis in tests/gpu/profile_offload_prefill.py, on hand-made traces (CPU)."""

from __future__ import annotations

from tests.gpu.profile_offload_prefill import gap_causes, overlap


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


def test_critical_path_charges_an_early_launched_kernel_only_for_what_it_adds(tmp_path):
    """``profiling.critical_path``: a kernel started before its predecessor ended (programmatic
    dependent launch) is charged from that end; a gap on the busiest stream is idle time, named
    by its neighbours; other streams are reported apart."""
    import json

    from tests.gpu.profiling import critical_path

    def kernel(name, ts, dur, stream=7):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}

    events = [kernel("a", 0, 10), kernel("b", 2, 20), kernel("c", 30, 5), kernel("a", 35, 1000)]
    events.append(
        {"ph": "X", "cat": "gpu_memcpy", "name": "copy", "ts": 0, "dur": 400, "args": {"stream": 9}}
    )
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    lines = critical_path(str(trace), steps=1)
    assert lines[0] == "stream 7: kernels' own time 1.03 ms a step, idle between them 0.01 ms"
    assert lines[1:4] == ["    1.010 ms  a", "    0.012 ms  b", "    0.005 ms  c"]  # b: 22 - 10
    assert lines[4] == "  idle     8.0 us after b before c"
    assert lines[-1] == "stream 9: busy 0.40 ms a step"


def test_overlap_counts_the_time_two_interval_lists_share():
    link = [(0, 10), (20, 30), (40, 50)]
    kernels = [(5, 25), (28, 29), (45, 60)]
    assert overlap(link, kernels) == 5 + 5 + 1 + 5
    assert overlap(kernels, link) == 16 and overlap(link, []) == 0


def test_link_timeline_splits_a_step_into_link_and_compute_time(tmp_path):
    """``profiling.link_timeline``: by time alone, whatever the streams: the link's time beside
    compute and alone, compute alone, neither; the kernels that ran while the link idled."""
    import json

    from tests.gpu.profiling import link_timeline

    def event(name, ts, dur, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": ts}}

    events = [
        event("_copy_rows_kernel", 0, 100),  # the prefetch copy, beside the mixer
        event("mixer", 10, 40),
        event("router", 100, 20),  # link idle from 100 to 120
        event("_stage_kernel", 120, 60),  # alone
        event("gate_up", 180, 10),  # link idle: 180-184 alone, 184-190 shared with down
        event("down", 184, 20),  # then 190-204 alone
        event("Memcpy HtoD (Pinned -> Device)", 300, 50, cat="gpu_memcpy"),  # after 96 us of nothing
    ]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    lines = link_timeline(str(trace), steps=1)
    assert lines[0] == (
        "link busy 0.21 ms a step (0.04 beside compute, 0.17 alone), compute alone 0.04 ms, neither 0.10 ms"
    )
    assert lines[1:] == [
        "    0.020 ms  router (link idle)",
        "    0.017 ms  down (link idle)",  # 3 + 14
        "    0.007 ms  gate_up (link idle)",  # 4 + 3
    ]
