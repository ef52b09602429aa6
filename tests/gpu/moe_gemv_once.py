"""The shipped MoE GEMV on Qwen3-Next's bank shapes, a few calls, for a kernel profiler (not a test):

    ncu -k regex:"_gate_up_kernel|_down_pair_kernel" --launch-skip 4 --launch-count 2 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python tests/gpu/moe_gemv_once.py [bf16|nvfp4] [TOKENS] [--shared] [--host=H]

512 experts of 2 x 512 x 2048, top-10 (``config_sweep.moe_problem``; FT_SWEEP_MOE=E,I,H,k for
another shape), eight routings in turn, ten calls, the tiles and switches as shipped (or as the
``FT_MOE_GEMV_*`` variables set them); ``--shared`` adds a bf16 shared pair, as the engine runs
it. ``--host=H``: each token's first H experts read from a pinned host copy of the bank (the
offload backend's host reads), for the memory sections of a profiler. Prints the mean time a
call from CUDA events, which includes what the profiler adds when it runs under one."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from ft.moe.kernels import triton_moe_gemv  # noqa: E402
from tests.gpu.config_sweep import moe_problem, shared_pair  # noqa: E402


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    fmt = args[0] if args else "nvfp4"
    tokens = int(args[1]) if len(args) > 1 else 1
    problem = moe_problem(tokens)
    banks, x, routes = problem
    w13, w2 = banks[fmt]
    pair = shared_pair(problem) if "--shared" in sys.argv else None
    on_host = next((int(a.split("=")[1]) for a in sys.argv if a.startswith("--host=")), 0)
    host = None
    if on_host:
        from tests.gpu.host_read_timings import pinned

        host = (pinned(w13), pinned(w2))
        routes = [(w, i.clone()) for w, i in routes]
        for _, i in routes:  # ids e < 0: host row -e - 1
            i[:, :on_host] = -i[:, :on_host] - 1

    def call(w, i):
        triton_moe_gemv.fused_moe_gemv(x, w13, w2, w, i, pair, host=host)

    for w, i in routes[:2]:  # compile, warm
        call(w, i)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for c in range(10):
        call(*routes[c % len(routes)])
    end.record()
    torch.cuda.synchronize()
    where = f", {on_host} experts a token on the host" if on_host else ""
    print(f"{fmt} T={tokens}{where}: {start.elapsed_time(end) / 10 * 1e3:.1f} us a call (gate/up + down)")


if __name__ == "__main__":
    main()
