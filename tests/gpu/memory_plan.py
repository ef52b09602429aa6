"""Where an offloaded model's device memory goes against its plan (not a test):

    python tests/gpu/memory_plan.py CONFIG [RATIO] [OUT.log]
    FT_EXPANDABLE_SEGMENTS=1 python tests/gpu/memory_plan.py ...   # with expandable segments

Loads CONFIG (dummy weights, the offload backend at ``--memory-ratio`` RATIO, default 0.94, 8
request slots, 40k KV tokens) and runs prompts of 32, 1,024, 8,000, 16,384 and 32,768 tokens in
turn. After the load and after each prompt it prints torch's live and reserved bytes, their peaks
since the load, and the device's used memory against the plan (the cap x ratio): whether the
activation reserve (``sizing.reserve_bytes``) holds the prefill chunks, and how much of it the
allocator's cache takes beyond the live tensors (``ft.engine.allocator``)."""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from ft.config import EngineConfig  # noqa: E402
from ft.engine import allocator  # noqa: E402
from ft.engine.engine import LLMEngine  # noqa: E402
from ft.moe.backends.sizing import GiB, device_cap, plan_bytes, reserve_bytes  # noqa: E402
from ft.sampling_params import SamplingParams  # noqa: E402
from tests.gpu.profiling import logger  # noqa: E402

PROMPTS = ((32, 4), (1024, 8), (8000, 1), (16384, 1), (32768, 1))  # (prompt tokens, tokens generated)


def main() -> None:
    src = sys.argv[1]
    ratio = float(sys.argv[2]) if len(sys.argv) > 2 else 0.94
    log = logger(sys.argv[3] if len(sys.argv) > 3 else None)
    t0 = time.perf_counter()
    longest = max(n + out for n, out in PROMPTS)
    cfg = EngineConfig(
        config_file=src, load_format="dummy", device="cuda", moe_backend="offload", memory_ratio=ratio,
        max_running_requests=8, num_tokens=40000, max_model_len=longest, progress=False,
    )  # fmt: skip
    engine = LLMEngine(cfg)
    cap, plan = device_cap(cfg, torch.device("cuda")), plan_bytes(cfg, torch.device("cuda"))
    log(f"loaded in {time.perf_counter() - t0:.0f} s; plan {plan / GiB:.2f} GiB (cap x {ratio}), "
        f"activation reserve {reserve_bytes(cap) / GiB:.2f} GiB, prefill chunk {engine.plan.prefill_chunk}, "
        f"expandable segments {'on' if allocator.EXPANDABLE else 'off'}")  # fmt: skip

    def snapshot(tag: str) -> None:
        free, total = torch.cuda.mem_get_info()
        c = torch.cuda
        log(f"{tag:20s} live {c.memory_allocated() / GiB:7.2f}  reserved {c.memory_reserved() / GiB:7.2f}  "
            f"peak live {c.max_memory_allocated() / GiB:7.2f}  "
            f"peak reserved {c.max_memory_reserved() / GiB:7.2f}  "
            f"device used {(total - free) / GiB:7.2f} GiB")  # fmt: skip

    snapshot("after the load")
    torch.cuda.reset_peak_memory_stats()
    vocab = engine.model_config.vocab_size
    for n, out in PROMPTS:
        engine.add_request(
            [(i * 31 + n) % vocab for i in range(n)],
            SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True),
        )
        while engine.has_unfinished_requests():
            engine.step()
        torch.cuda.synchronize()
        snapshot(f"after {n} + {out}")
    engine.shutdown()


if __name__ == "__main__":
    main()
