"""Tile-config sweeps for the Triton kernels a decode step and a prefill launch most (not a test):

    python tests/gpu/config_sweep.py [gemv] [split_k] [router] [moe_gemv] [moe_gemv_kernels]
        [moe_gemv_planes] [moe_gemv_shared] [moe_gemv_unroll] [grouped] [grouped_w4a16]
        [grouped_w4a16_gluon] [conv] [extend]

(all sections when none is named). Shapes are Qwen3-Next's unless told: FT_SWEEP_GEMV=qwen3_30b,
FT_SWEEP_MOE=E,I,H,k (Qwen3-30B: 128,768,2048,8; also the router section's E, H, k),
FT_SWEEP_ATTN=Hq,Hkv,d (Qwen3-30B: 32,4,128), FT_SWEEP_EXTEND=1024,16384+16384 the extend
chunks (T, or T queries after C cached tokens); FT_SWEEP_GROUPED_T=1024,8192 times the grouped GEMM
at prefill sizes; FT_SWEEP_SPLITS=1,2,4,8 the K splits the split-K GEMV and fused router sections try.

Each section sets its kernel's module constants to every config of a small grid, times each shape
with ``kernel_timings.bench_series`` (a CUDA graph of calls back to back over distinct weights or
routings, per call: a decode step's conditions), checks the output against the shipped config's,
and prints per shape the shipped config's time, the best config and its time, and the config best
summed over the shapes: what to write into the module. The attention sweep of 2026-11-30 (a 4.6x
faster prefill from a tile change, docs/benchmarks.md) was this kind of table.

``--dry-run`` runs the GEMV sections once on tiny shapes on the CPU under ``TRITON_INTERPRET=1``
(one config each, a wall-clock timer; the sections whose wrappers need CUDA say so): it checks
the script, not the kernels' speed.
"""

from __future__ import annotations

import functools
import itertools
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from ft.forward_context import ForwardBatch  # noqa: E402
from ft.gdn import triton_conv  # noqa: E402
from ft.layers import triton_gemv  # noqa: E402
from ft.moe.kernels import triton_moe, triton_moe_gemv, triton_router, triton_router_gemv, triton_w4a16  # noqa: E402
from tests.gpu.kernel_timings import bench_series, routings, series_copies  # noqa: E402
from tests.nvfp4.test_w4a16_gpu import random_bank  # noqa: E402
from tests.test_moe_fusions_interp import exact_router_operands  # noqa: E402

DRY = "--dry-run" in sys.argv
DEV = "cpu" if DRY else "cuda"
DTYPE = torch.float16 if DRY else torch.bfloat16  # the interpreter's bf16 tl.dot (dense GEMV) is not exact
P = functools.partial


def timer(calls: list[Callable]) -> float:
    """Microseconds per call."""
    if DRY:
        t0 = time.perf_counter()
        for fn in calls:
            fn()
        return (time.perf_counter() - t0) / len(calls) * 1e6
    return bench_series(calls) * 1e3


def copies(nbytes: int) -> int:
    return 2 if DRY else series_copies(nbytes)


def grid(*axes) -> list[tuple]:
    combos = list(itertools.product(*axes))
    return combos[:1] if DRY else combos


def report(title: str, shipped, rows: dict[str, dict]) -> None:
    """rows: shape -> {config tuple: us, or None when it failed or disagreed; a name: us of a
    reference path (cuBLAS, the MMA path), shown beside the configs but not competing}. shipped:
    the module's config, or shape -> config where the module picks one per shape."""
    per_shape = shipped if isinstance(shipped, dict) else dict.fromkeys(rows, shipped)
    print(f"== {title} (shipped {sorted(set(per_shape.values()))})", flush=True)
    totals: dict = {}
    for shape, times in rows.items():
        ok = {c: t for c, t in times.items() if isinstance(c, tuple) and t is not None}
        refs = "".join(f" | {c} {t:.1f} us" for c, t in times.items() if isinstance(c, str) and t)
        for c, t in ok.items():
            totals[c] = totals.get(c, 0.0) + t
        best = min(ok, key=ok.get) if ok else None
        bad = sum(1 for c, t in times.items() if isinstance(c, tuple) and t is None)
        print(
            f"  {shape:44s} shipped {times.get(per_shape[shape]) or float('nan'):7.1f} us | best {best} "
            f"{ok.get(best, float('nan')):7.1f} us{refs}"
            + (f" | {bad} configs failed or disagreed" if bad else ""),
            flush=True,
        )
    full = [c for c in totals if all(rows[s].get(c) is not None for s in rows)]
    if full:
        best = min(full, key=totals.get)
        was = sum(rows[s].get(per_shape[s]) or float("nan") for s in rows)
        print(f"  best over all shapes: {best} {totals[best]:.1f} us (shipped {was:.1f})")


def try_config(run: Callable[[], torch.Tensor], want: torch.Tensor, calls: list[Callable], tol: float):
    try:
        got = run()
        if not torch.allclose(got.float(), want.float(), atol=tol, rtol=tol):
            return None
        return timer(calls)
    except Exception as e:  # out of shared memory, registers: not a usable config
        print(f"    failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
        return None


# ---------------------------------------------------------------- dense GEMV (decode projections)


def sweep_gemv() -> None:
    shapes = {"in_proj 12352x2048": (12352, 2048), "attn qkv 9216x2048": (9216, 2048),
              "out_proj 2048x4096": (2048, 4096), "router 513x2048": (513, 2048),
              "shared gate_up 1024x2048": (1024, 2048), "shared down 2048x512": (2048, 512)}  # fmt: skip
    if os.environ.get("FT_SWEEP_GEMV") == "qwen3_30b":  # q 4096 + k 512 + v 512, o, router
        shapes = {"qkv 5120x2048": (5120, 2048), "o_proj 2048x4096": (2048, 4096),
                  "router 128x2048": (128, 2048)}  # fmt: skip
    if DRY:
        shapes = {"tiny 40x64": (40, 64)}
    mod = triton_gemv
    saved = mod.WIDE, mod.NARROW
    configs = grid((16, 32), (128, 256, 512), (4, 8), (3, 4))
    rows, shipped = {}, {}
    # M = 8 and 16: decode batches of 8 and 16 take cuBLAS today (GEMV_MAX_TOKENS = 4, untimed above)
    for m in [int(v) for v in os.environ.get("FT_SWEEP_GEMV_M", "1,4").split(",")]:
        for name, (n, k) in shapes.items():
            x = torch.randn(m, k, device=DEV).to(DTYPE)
            ws = [(torch.randn(n, k, device=DEV) * k**-0.5).to(DTYPE) for _ in range(copies(n * k * 2))]
            want = F.linear(x.float(), ws[0].float())
            times = {"cuBLAS": None if DRY else timer([P(F.linear, x, w) for w in ws])}
            shipped[f"M={m} {name}"] = mod.config(n)
            for cfg in dict.fromkeys([mod.config(n), *configs]):
                mod.WIDE = mod.NARROW = cfg
                calls = [P(mod.launch_gemv, x, w) for w in ws]
                times[cfg] = try_config(calls[0], want, calls, 2e-2)
                mod.WIDE, mod.NARROW = saved
            rows[f"M={m} {name}"] = times
            print(f"  M={m} {name}: cuBLAS {times['cuBLAS'] or float('nan'):.1f} us", flush=True)
            del ws
    report("dense GEMV (BLOCK_N, MAX_BLOCK_K, NUM_WARPS, NUM_STAGES)", shipped, rows)


# ---------------------------------------------------------------- split-K GEMV and the fused router

SPLITS = [int(v) for v in os.environ.get("FT_SWEEP_SPLITS", "1,2,3,4,6,8,12,16").split(",")]


def sweep_split_k() -> None:
    """``triton_gemv``'s split-K kernel (``SPLIT_K``: off until timed here) at M = 1, 2, 4 over
    FT_SWEEP_SPLITS (1: the unsplit kernel; a config is the splits ``plan`` makes of a request),
    beside cuBLAS. Shipped: what ``balanced_splits`` takes with the switch on."""
    shapes = {"out_proj 2048x4096": (2048, 4096), "router 513x2048": (513, 2048),
              "in_proj 12352x2048": (12352, 2048), "attn qkv 9216x2048": (9216, 2048)}  # fmt: skip
    if DRY:
        shapes = {"tiny 40x512": (40, 512)}
    mod = triton_gemv
    rows, shipped = {}, {}
    for m in (1, 2, 4):
        for name, (n, k) in shapes.items():
            x = torch.randn(m, k, device=DEV).to(DTYPE)
            ws = [(torch.randn(n, k, device=DEV) * k**-0.5).to(DTYPE) for _ in range(copies(n * k * 2))]
            want = F.linear(x.float(), ws[0].float())
            key = f"M={m} {name}"
            times = {"cuBLAS": None if DRY else timer([P(F.linear, x, w) for w in ws])}
            shipped[key] = (mod.plan(n, k, mod.balanced_splits(n, k, x.device)).splits,)
            for s in dict.fromkeys([shipped[key][0], *(mod.plan(n, k, s).splits for s in SPLITS)]):
                calls = [P(mod.launch_gemv, x, w, s) for w in ws]
                times[(s,)] = try_config(calls[0], want, calls, 2e-2)
            rows[key] = times
            del ws
    report("split-K GEMV (splits; 1: the unsplit kernel)", shipped, rows)


def gemv_then_topk(x, w, product, e: int, k: int):
    return triton_router.launch_softmax_topk(product(x, w)[:, :e], k, True)


def first_of(fn, *args, **kwargs):
    return fn(*args, **kwargs)[0]


def sweep_router() -> None:
    """The fused router (``triton_router_gemv``, ``FUSED_ROUTER``: off until timed here) at T = 1,
    2, 4 over FT_SWEEP_SPLITS, beside the two launches it replaces: the unsplit GEMV (``dense``'s
    path) or cuBLAS, then ``softmax_topk``. E, H, k from FT_SWEEP_MOE; the shared expert's gate
    row with 512 experts (Qwen3-Next). Each config's weights are checked on tie-free exact logits."""
    e, _, h, k = (16, 0, 64, 4) if DRY else MOE_SHAPE
    gate, n = e == 512, e + (e == 512)
    unsplit = P(triton_gemv.launch_gemv, splits=1)
    rows, shipped = {}, {}
    for t in (1, 2, 4):
        x = torch.randn(t, h, device=DEV).to(DTYPE)
        ws = [(torch.randn(n, h, device=DEV) * h**-0.5).to(DTYPE) for _ in range(copies(n * h * 2))]
        xe, we, exact = (a.to(DEV) for a in exact_router_operands(t, e, h, gate, seed=t, dtype=DTYPE))
        want = triton_router.launch_softmax_topk(exact, k, True)[0]
        key = f"T={t} E={e} k={k} H={h}"
        times = {"GEMV + softmax_topk": timer([P(gemv_then_topk, x, w, unsplit, e, k) for w in ws])}
        if not DRY:
            times["cuBLAS + softmax_topk"] = timer([P(gemv_then_topk, x, w, F.linear, e, k) for w in ws])
        shipped[key] = (triton_gemv.plan(n, h, triton_gemv.balanced_splits(n, h, x.device)).splits,)
        for s in dict.fromkeys([shipped[key][0], *(triton_gemv.plan(n, h, s).splits for s in SPLITS)]):
            fused = P(triton_router_gemv.launch_router_topk, top_k=k, renormalize=True, shared_gate=gate)
            calls = [P(fused, x, w, splits=s) for w in ws]
            times[(s,)] = try_config(P(first_of, fused, xe, we, splits=s), want, calls, 1e-5)
        rows[key] = times
        del ws
    report("fused router GEMV + top-k (splits)", shipped, rows)


# ---------------------------------------------------------------- MoE at decode sizes


# E, I, H, top-k of the MoE sections: Qwen3-Next's by default; FT_SWEEP_MOE=128,768,2048,8 for Qwen3-30B
MOE_SHAPE = tuple(int(v) for v in os.environ.get("FT_SWEEP_MOE", "512,512,2048,10").split(","))
MOE_FORMATS = os.environ.get("FT_SWEEP_FORMATS", "bf16,nvfp4").split(",")


def moe_problem(t: int):
    e, inter, h, k = (16, 32, 64, 4) if DRY else MOE_SHAPE
    gen = torch.Generator(device=DEV).manual_seed(t)
    banks = {
        "bf16": (
            (torch.randn(e, 2 * inter, h, device=DEV) * h**-0.5).to(torch.bfloat16),
            (torch.randn(e, h, inter, device=DEV) * inter**-0.5).to(torch.bfloat16),
        ),
        "nvfp4": (random_bank(e, 2 * inter, h, gen), random_bank(e, h, inter, gen)),
    }
    x = torch.randn(t, h, device=DEV).to(torch.bfloat16)
    routes = routings(t, e, k, n=2 if DRY else 8, device=DEV)
    return banks, x, routes


def shared_pair(problem) -> tuple:
    """A bf16 shared expert with the bank's I and H (gate_up [2I, H], down [H, I], logits [T, 1])."""
    banks, x, _ = problem
    _, two_i, h = banks["bf16"][0].shape
    return (
        (torch.randn(two_i, h, device=DEV) * h**-0.5).to(torch.bfloat16),
        (torch.randn(h, two_i // 2, device=DEV) * (two_i // 2) ** -0.5).to(torch.bfloat16),
        torch.randn(x.shape[0], 1, device=DEV).to(torch.bfloat16),
    )


# the MoE GEMV's loop switches, each timed on at the shipped tiles
MOE_GEMV_SWITCHES = ("PIPELINE", "FP4_PLANES")


def moe_gemv_variants(mod, fmt: str) -> list[tuple[str, ...]]:
    """The switch combinations worth timing for a bank format (FP4_PLANES only changes NVFP4)."""
    names = [n for n in MOE_GEMV_SWITCHES if fmt == "nvfp4" or n != "FP4_PLANES"]
    return [(n,) for n in names] + [tuple(names)]


def gate_up_tiles(mod, fmt: str) -> str:
    """The module constant of the tiles a bank format's gate/up kernel takes as shipped."""
    return "BF16" if fmt == "bf16" else "NVFP4_PLANES" if mod.FP4_PLANES else "NVFP4"


def sweep_moe_gemv() -> None:
    mod = triton_moe_gemv
    saved = {name: getattr(mod, name) for name in ("BF16", "NVFP4", "NVFP4_PLANES")}
    configs = grid((4, 8, 16, 32), (128, 256, 512), (4, 8), (3, 4))
    rows, shipped = {}, {}
    for t in (1, 2, 4):
        banks, x, routes = moe_problem(t)
        for fmt, (w13, w2) in banks.items():
            if fmt not in MOE_FORMATS:
                continue
            want = mod.launch_moe_gemv(x, w13, w2, *routes[0])
            times = {}
            if not DRY:  # the MMA path the switch chooses against
                mma = triton_moe.fused_moe_triton if fmt == "bf16" else triton_w4a16.fused_moe_w4a16
                switches = triton_moe.GEMV_MAX_TOKENS, triton_w4a16.GEMV_MAX_TOKENS
                triton_moe.GEMV_MAX_TOKENS = triton_w4a16.GEMV_MAX_TOKENS = 0
                times["MMA path"] = timer([P(mma, x, w13, w2, w, i) for w, i in routes])
                triton_moe.GEMV_MAX_TOKENS, triton_w4a16.GEMV_MAX_TOKENS = switches
            tiles = gate_up_tiles(mod, fmt)
            shipped[f"T={t} {fmt}"] = saved[tiles]
            for cfg in dict.fromkeys([saved[tiles], *configs]):
                setattr(mod, tiles, cfg)
                calls = [P(mod.launch_moe_gemv, x, w13, w2, w, i) for w, i in routes]
                times[cfg] = try_config(calls[0], want, calls, 2e-2)
                setattr(mod, tiles, saved[tiles])
            calls = [P(mod.launch_moe_gemv, x, w13, w2, w, i) for w, i in routes]
            for on in moe_gemv_variants(mod, fmt):
                flags = {n: getattr(mod, n) for n in MOE_GEMV_SWITCHES}
                for n in on:
                    setattr(mod, n, True)
                times["+".join(on)] = try_config(calls[0], want, calls, 2e-2)
                for n, v in flags.items():
                    setattr(mod, n, v)
            rows[f"T={t} {fmt}"] = times
            print(f"  T={t} {fmt}: MMA path {times.get('MMA path') or float('nan'):.1f} us", flush=True)
    report("MoE GEMV (BLOCK_N, MAX_BLOCK_K, NUM_WARPS, STAGES)", shipped, rows)


def timed_moe_gemv(problem, down, *, fmt: str) -> float | None:
    """us per call of the MoE GEMV with down tiles ``down`` (``PAIR_DOWN``; None: as shipped),
    checked against the shipped kernels' output."""
    mod = triton_moe_gemv
    banks, x, routes = problem
    w13, w2 = banks[fmt]
    shipped = mod.PAIR_DOWN
    want = mod.launch_moe_gemv(x, w13, w2, *routes[0])
    mod.PAIR_DOWN = down or shipped
    calls = [P(mod.launch_moe_gemv, x, w13, w2, w, i) for w, i in routes]
    try:
        return try_config(calls[0], want, calls, 2e-2)
    finally:
        mod.PAIR_DOWN = shipped


def sweep_moe_gemv_kernels() -> None:
    """The bf16 MoE GEMV's down kernel's own tiles (``PAIR_DOWN``, which NVFP4 banks take only on
    bytes: their words' tiles are ``moe_gemv_planes``'), gate/up's as shipped; at T = 1 (a batch-1
    decode step), the best then timed at T = 2. Prints the env line (``FT_MOE_GEMV_PAIR_DOWN``)."""
    mod = triton_moe_gemv
    configs = grid((4, 8, 16), (128, 256, 512), (2, 4), (1, 2))  # smaller K steps: fewer registers
    problems = {t: moe_problem(t) for t in (1, 2)}
    fmt_us = lambda v: f"{v:.1f}" if v is not None else "failed"  # noqa: E731
    for fmt in [f for f in MOE_FORMATS if f == "bf16"]:
        shipped_us = {t: timed_moe_gemv(problems[t], None, fmt=fmt) for t in (1, 2)}
        downs = {
            cfg: timed_moe_gemv(problems[1], cfg, fmt=fmt) for cfg in dict.fromkeys([mod.PAIR_DOWN, *configs])
        }
        best = min((c for c in downs if downs[c] is not None), key=downs.get, default=mod.PAIR_DOWN)
        print(f"== MoE GEMV down, {fmt}: as shipped T=1 {fmt_us(shipped_us[1])} us")
        for cfg, us in sorted(downs.items(), key=lambda kv: kv[1] or 1e9)[:5]:
            print(f"  down {cfg}: {fmt_us(us)} us")
        t1, t2 = fmt_us(downs.get(best)), fmt_us(timed_moe_gemv(problems[2], best, fmt=fmt))
        print(f"  best {best}: T=1 {t1} us, T=2 {t2} us (as shipped {fmt_us(shipped_us[2])})")
        print(f"  env FT_MOE_GEMV_PAIR_DOWN={','.join(map(str, best))}", flush=True)


def sweep_moe_gemv_planes() -> None:
    """The NVFP4 MoE GEMV's codes read as words: gate/up's tiles (``NVFP4_PLANES``) against the
    byte-wise decode at its shipped tiles, the down kernel on bytes; then the down kernel reading
    words too (``FP4_DOWN_PLANES``, tiles ``NVFP4_DOWN_PLANES``) after the best gate/up; T = 1 and 2."""
    mod = triton_moe_gemv
    names = ("NVFP4_PLANES", "FP4_PLANES", "FP4_DOWN_PLANES", "NVFP4_DOWN_PLANES", "FP4_INT_DOT")
    saved = {n: getattr(mod, n) for n in names}
    gate_up = grid((4, 8, 16), (256, 512, 1024, 2048), (4, 8), (1, 3))
    downs = grid((4, 8, 16, 32), (128, 256, 512), (1, 2, 4), (1, 2))
    problems = {t: moe_problem(t) for t in (1, 2)}
    # with the bf16 shared pair, as the engine runs them (``SHARED_AS_PAIR``): its branch sets the
    # kernels' registers (``NVFP4_SHARED_BK``, from the environment here)
    shared = {t: shared_pair(problems[t]) for t in (1, 2)}

    def timed(t: int, **values) -> float | None:
        banks, x, routes = problems[t]
        w13, w2 = banks["nvfp4"]
        calls = [P(mod.launch_moe_gemv, x, w13, w2, w, i, shared=shared[t]) for w, i in routes]
        try:
            for n in names:
                setattr(mod, n, saved[n])
            # bytes: the reference and the row to beat; the words' own products (not the integer ones)
            mod.FP4_PLANES = mod.FP4_DOWN_PLANES = mod.FP4_INT_DOT = False
            want = calls[0]()
            for n, v in values.items():
                setattr(mod, n, v)
            return try_config(calls[0], want, calls, 2e-2)
        finally:
            for n in names:
                setattr(mod, n, saved[n])

    rows: dict = {}
    for t in (1, 2):
        row = rows[f"T={t} gate/up, words"] = {"bytes, shipped tiles": timed(t)}
        for cfg in dict.fromkeys([saved["NVFP4_PLANES"], *gate_up]):
            row[cfg] = timed(t, FP4_PLANES=True, NVFP4_PLANES=cfg)
    report(
        "MoE GEMV gate/up, NVFP4 codes as words (BLOCK_N, MAX_BLOCK_K, NUM_WARPS, STAGES)",
        saved["NVFP4_PLANES"],
        rows,
    )
    # the down kernel reads words only beside gate/up's words: their best tiles at T=1
    ok = {c: us for c, us in rows["T=1 gate/up, words"].items() if us and isinstance(c, tuple)}
    best_up = min(ok, key=ok.get) if ok else saved["NVFP4_PLANES"]
    print(f"  best gate/up on words: FT_MOE_GEMV_NVFP4_PLANES={','.join(map(str, best_up))}", flush=True)
    rows = {}
    for t in (1, 2):
        up = dict(FP4_PLANES=True, NVFP4_PLANES=best_up)
        rows[f"T={t} down by pair, words"] = {"bytes, shipped tiles": timed(t, **up, FP4_DOWN_PLANES=False)}
        for cfg in dict.fromkeys([saved["NVFP4_DOWN_PLANES"], *downs]):
            rows[f"T={t} down by pair, words"][cfg] = timed(
                t, **up, FP4_DOWN_PLANES=True, NVFP4_DOWN_PLANES=cfg
            )
    report(
        "MoE GEMV down, NVFP4 words (after the best gate/up)",
        saved["NVFP4_DOWN_PLANES"],
        rows,
    )


GROUPED_T = [int(v) for v in os.environ.get("FT_SWEEP_GROUPED_T", "1,64").split(",")]  # e.g. 1024,8192


def sweep_grouped() -> None:
    """The bf16 grouped-GEMM rows of ``triton_moe.CONFIGS`` (gate/up, then down) at the token
    counts of FT_SWEEP_GROUPED_T: decode rows keep BLOCK_M 16 and sweep the rest, prefill rows
    (T > 64) sweep BLOCK_M too. Configs are (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages)."""
    decode = [(16, bn, bk, 1, w, s) for bn, bk, w, s in grid((32, 64, 128), (64, 128, 256), (4,), (3, 4))]
    tiles = grid((64, 128), (64, 128), (32, 64), (4, 8), (3, 4))
    prefill = [(bm, bn, bk, 8, w, s) for bm, bn, bk, w, s in tiles]
    grouped_rows("grouped GEMM", triton_moe.CONFIGS, triton_moe.fused_moe_triton, "bf16", decode, prefill)


def sweep_grouped_w4a16() -> None:
    """The NVFP4 (W4A16) grouped-GEMM rows of ``triton_w4a16.CONFIGS`` at the token counts of
    FT_SWEEP_GROUPED_T (e.g. 1024,4096,8192), gate/up then down. The kernel decodes each weight
    tile once per BLOCK_M rows of an expert's pairs, so prefill rows sweep BLOCK_M up to 256 (an
    8k chunk gives Qwen3-Next's experts ~160 pairs each); decode rows keep BLOCK_M 16. The best is
    benchmarked in the engine with FT_W4A16_PREFILL=up/down before it goes into the table (the
    decode as ``triton_w4a16.LUT`` says: FT_W4A16_LUT=0 sweeps the byte decode's)."""
    decode = [(16, bn, bk, 1, w, s) for bn, bk, w, s in grid((32, 64, 128), (64, 128, 256), (4, 8), (3,))]
    tiles = grid((64, 128, 256), (32, 64, 128), (64, 128), (4, 8), (3,))
    prefill = [(bm, bn, bk, 8, w, s) for bm, bn, bk, w, s in tiles if not (bm == 256 and w == 4)]
    title = "W4A16 grouped GEMM" + (", table decode" if triton_w4a16.LUT else ", byte decode")
    grouped_rows(title, triton_w4a16.CONFIGS, triton_w4a16.fused_moe_w4a16, "nvfp4", decode, prefill)


def sweep_grouped_w4a16_gluon() -> None:
    """The Gluon W4A16 kernel's prefill rows (``gluon_w4a16.CONFIGS``, run with ``triton_w4a16.GLUON``
    on) at FT_SWEEP_GROUPED_T's token counts above its ``GLUON_MIN_TOKENS``: BLOCK_M is 16 x warps,
    and tiles of fewer registers fit two or three programs an SM (compiled for sm_90, 2026-12-04:
    gate/up at 128 x 64 x 64 and 8 warps 127 registers and 96 KB of shared memory, against the
    shipped 128 x 128's 255 and 139 KB), which would overlap one program's decode with another's
    wgmmas. The best goes to FT_W4A16_GLUON_TILES=UP/DOWN for an engine run before the table."""
    if DRY:
        print("== W4A16 grouped GEMM in Gluon: needs a Hopper GPU; skipped in a dry run")
        return
    from ft.moe.kernels import gluon_w4a16

    tiles = grid((4, 8), (64, 128), (64, 128))
    prefill = [(16 * w, bn, bk, 8, w, 3) for w, bn, bk in tiles]
    saved, triton_w4a16.GLUON = triton_w4a16.GLUON, True
    try:
        _, inter, h, _ = MOE_SHAPE  # one expert of the swept banks' shape (supports reads K and strides)
        gen = torch.Generator(device=DEV).manual_seed(0)
        one = (random_bank(1, 2 * inter, h, gen), random_bank(1, h, inter, gen))
        assert gluon_w4a16.supports(*one, torch.zeros(1, h, device=DEV, dtype=torch.bfloat16)), (
            "these banks take the Triton kernel"
        )
        fused = triton_w4a16.fused_moe_w4a16
        grouped_rows("W4A16 grouped GEMM in Gluon", gluon_w4a16.CONFIGS, fused, "nvfp4", [], prefill)
    finally:
        triton_w4a16.GLUON = saved


def grouped_rows(title: str, configs: dict, fused: Callable, fmt: str, decode: list, prefill: list) -> None:
    # each FT_SWEEP_GROUPED_T's row of ``configs`` (as pick_config chooses it), gate/up then down, over
    # the decode configs (T <= 64) or the prefill ones, against the shipped row's output
    if DRY:
        print(f"== {title}: needs CUDA (the sort kernels assert it); skipped in a dry run")
        return
    table = configs["E128" if MOE_SHAPE[0] <= 128 else "default"]
    saved = list(table)
    for t in GROUPED_T:
        banks, x, routes = moe_problem(t)
        w13, w2 = banks[fmt]
        index = next(i for i, (bound, _, _) in enumerate(table) if t <= bound)
        bound, up, down = table[index]
        want = fused(x, w13, w2, *routes[0])
        for which in ("up", "down"):
            shipped, times = up if which == "up" else down, {}
            for cfg in dict.fromkeys([shipped, *(decode if t <= 64 else prefill)]):
                table[index] = (bound, cfg, down) if which == "up" else (bound, up, cfg)
                calls = [P(fused, x, w13, w2, w_, i) for w_, i in routes]
                times[cfg] = try_config(calls[0], want, calls, 2e-2)
            table[:] = saved
            report(f"{title} T={t} {which}", shipped, {f"T={t} {which}": times})


# ---------------------------------------------------------------- causal conv (prefill and decode)


def conv_batch(lens: list[int]) -> ForwardBatch:
    n = len(lens)
    cu = [0]
    for q in lens:
        cu.append(cu[-1] + q)

    def t(v, dtype=torch.int32):
        return torch.tensor(v, dtype=dtype, device=DEV)

    return ForwardBatch(
        positions=t(list(range(sum(lens))), torch.int64), cu_seqlens=t(cu), context_lens=t([5] * n),
        seq_lens=t([5 + q for q in lens]), block_tables=torch.zeros(n, 1, dtype=torch.int32, device=DEV),
        slot_mapping=t([-1] * sum(lens), torch.int64), state_slots=t(list(range(n)), torch.int64),
        prev_token_ids=torch.zeros(n, 0, dtype=torch.int64, device=DEV), block_size=16,
        query_lens_cpu=list(lens), context_lens_cpu=[5] * n,
    )  # fmt: skip


DECODE_TILES = [(1, 256), (1, 512), (2, 256), (4, 128)]
PREFILL_TILES = [(16, 128), (32, 128), (64, 128), (32, 256), (64, 64), (128, 64)]


def conv_call(x, weight, state, batch, max_q) -> torch.Tensor:
    """On a copy of the state: every config checks against the same one."""
    return triton_conv.causal_conv1d_silu(x, weight, state.clone(), batch, max_q)


def sweep_conv() -> None:
    if DRY:
        print("== causal conv: needs CUDA (its wrapper asserts it); skipped in a dry run")
        return
    mod = triton_conv
    c, width = 8192, 12352  # the conv reads a column range of in_proj's output
    cases = {"prefill 8000 x 1": [8000], "prefill 1024 x 1": [1024], "decode 1 x 64": [1] * 64}
    weight = torch.randn(c, 4, device=DEV).to(DTYPE)
    rows, shipped = {}, {}
    for name, lens in cases.items():
        decode = max(lens) == 1
        attr = "DECODE_TILE" if decode else "PREFILL_TILE"
        shipped[name] = (*getattr(mod, attr), mod.NUM_WARPS)
        tiles = DECODE_TILES if decode else PREFILL_TILES
        configs = grid(tiles, (4, 8))
        batch = conv_batch(lens)
        xs = [torch.randn(sum(lens), width, device=DEV).to(DTYPE)[:, :c] for _ in range(4)]
        state = torch.randn(len(lens), c, 3, device=DEV).to(DTYPE)
        states = [state.clone() for _ in xs]  # the timed calls update these in place
        want = conv_call(xs[0], weight, state, batch, max(lens))
        times = {}
        for cfg in dict.fromkeys([shipped[name], *((*tile, w) for tile, w in configs)]):
            setattr(mod, attr, cfg[:2])
            mod.NUM_WARPS = cfg[2]
            calls = [P(mod.causal_conv1d_silu, x, weight, st, batch, max(lens)) for x, st in zip(xs, states)]
            times[cfg] = try_config(P(conv_call, xs[0], weight, state, batch, max(lens)), want, calls, 1e-2)
        setattr(mod, attr, shipped[name][:2])
        mod.NUM_WARPS = shipped[name][2]
        rows[name] = times
    for name in rows:
        report(f"causal conv {name} (tokens, channels, warps)", shipped[name], {name: rows[name]})


# ---------------------------------------------------------------- prefill attention (extend kernel)

ATTN_HEADS = tuple(int(v) for v in os.environ.get("FT_SWEEP_ATTN", "16,2,256").split(","))  # Hq, Hkv, d


# the extend sweep's chunks: T queries, or T+C for T queries after C cached tokens (e.g. 16384+16384,
# the second chunk of a 32k prompt, checked against the shipped config's output, without SDPA)
EXTEND_SHAPES = os.environ.get("FT_SWEEP_EXTEND", "1024,8000").split(",")


def sweep_extend() -> None:
    """``triton_paged._extend_config`` for one causal prompt of 1,024 and 8,000 tokens (no
    context; FT_SWEEP_EXTEND sets the chunks), against torch's SDPA in fp32 for the check and
    beside it in bf16 for the time."""
    from ft.attention import triton_paged

    hq, hkv, d = (4, 2, 32) if DRY else ATTN_HEADS
    page, saved = 16, triton_paged._extend_config
    configs = grid((64, 128), (32, 64, 128), (4, 8), (2, 3))
    rows, shipped = {}, {}
    for shape in ("40", "40+24") if DRY else EXTEND_SHAPES:
        t, c = (int(v) for v in (shape + "+0").split("+")[:2])
        q = torch.randn(t, hq, d, device=DEV).to(DTYPE)
        k, v = (torch.randn(c + t, hkv, d, device=DEV).to(DTYPE) for _ in range(2))
        blocks = triton.cdiv(c + t, page)
        cache = torch.zeros(2, blocks, page, hkv, d, device=DEV, dtype=DTYPE)
        triton_paged.store_kv(cache, k, v, torch.arange(c + t, device=DEV))
        table = torch.arange(blocks, device=DEV, dtype=torch.int32)[None]
        cu = torch.tensor([0, t], device=DEV, dtype=torch.int32)
        ctx = torch.full((1,), c, device=DEV, dtype=torch.int32)
        call = P(triton_paged.paged_extend, q, cache, table, cu, ctx, t, d**-0.5)
        name = f"{t} tokens after {c}, {hq}/{hkv} heads of {d}"
        shipped[name] = saved(DTYPE, d, t)
        times = {}
        if c == 0:
            heads = (q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
            want = F.scaled_dot_product_attention(
                *(h.float() for h in heads), is_causal=True, enable_gqa=True
            )[0]
            want = want.transpose(0, 1)
            sdpa = P(F.scaled_dot_product_attention, *heads, is_causal=True, enable_gqa=True)
            times["SDPA bf16"] = timer([sdpa])
        else:  # too large for an fp32 reference: the shipped tiles' output
            want = call()
        for cfg in dict.fromkeys([shipped[name], *configs]):
            triton_paged._extend_config = lambda dtype, d_, m, cfg=cfg: cfg
            times[cfg] = try_config(call, want, [call], 2e-2)
            triton_paged._extend_config = saved
        rows[name] = times
    report("extend attention (BLOCK_M, BLOCK_N, warps, stages)", shipped, rows)


def nvfp4_calls_with_shared_pair(t: int) -> list[Callable]:
    """The NVFP4 MoE GEMV over ``moe_problem(t)``'s routings with a bf16 shared pair, as the engine
    runs it: one call a routing."""
    problem = moe_problem(t)
    banks, x, routes = problem
    w13, w2 = banks["nvfp4"]
    pair = shared_pair(problem)
    return [P(triton_moe_gemv.launch_moe_gemv, x, w13, w2, w, i, shared=pair) for w, i in routes]


def two_passes(combos: list, set_combo: Callable, saved: dict, calls: list[Callable], want: torch.Tensor):
    """Each combination timed twice, in two passes, the second in reverse order: ``set_combo(c)``
    sets ``triton_moe_gemv``'s attributes for it, ``saved`` (name -> value) puts them back after
    each. -> (times: combination -> the two us figures, or None where it failed or disagreed;
    the mean of those that ran both times)."""
    times: dict = {c: [] for c in combos}
    for order in (combos, combos[::-1]):
        for c in order:
            set_combo(c)
            times[c].append(try_config(calls[0], want, calls, 2e-2))
            for n, v in saved.items():
                setattr(triton_moe_gemv, n, v)
    return times, {c: sum(v) / 2 for c, v in times.items() if None not in v}


def nvfp4_two_passes(title: str, combos: list, set_combo: Callable, saved: dict, label: Callable) -> None:
    """``two_passes`` of the NVFP4 MoE GEMV with the shared pair (``nvfp4_calls_with_shared_pair``)
    at T = 1 and 2: each combination's mean and both times, fastest first, then those that failed
    or disagreed (``label(c)`` names a combination)."""
    for t in (1, 2):
        calls = nvfp4_calls_with_shared_pair(t)
        times, ok = two_passes(combos, set_combo, saved, calls, calls[0]())
        print(f"== T={t} {title} (two passes)", flush=True)
        for c in sorted(ok, key=ok.get):
            print(f"  {label(c)}: {ok[c]:7.1f} us ({times[c][0]:.1f}, {times[c][1]:.1f})", flush=True)
        for c in combos:
            if c not in ok:
                print(f"  {label(c)}: failed", flush=True)


def sweep_moe_gemv_shared() -> None:
    """The NVFP4 MoE GEMV (words, block sums, the down kernel on words) with the bf16 shared pair, as
    the engine runs it: gate/up and down tiles against the shared rows' own steps
    (``NVFP4_SHARED_BK``, ``NVFP4_SHARED_BK_DOWN``; 0: BLOCK_K), gate/up + down a call over 8
    routings; every combination timed twice, in two passes, the second in reverse order."""
    mod = triton_moe_gemv
    names = ("NVFP4_PLANES", "NVFP4_DOWN_PLANES", "NVFP4_SHARED_BK", "NVFP4_SHARED_BK_DOWN")
    saved = {n: getattr(mod, n) for n in names}
    ups, downs = [(4, 512, 4, 1), (8, 512, 8, 1)], [(8, 256, 2, 1), (8, 256, 4, 1)]
    steps = [(0, 0), (64, 0), (128, 0), (0, 64), (0, 128), (64, 64), (128, 128)]
    if DRY:
        ups, downs, steps = ups[:1], downs[:1], [(0, 0), (16, 16)]
    combos = [(u, d, s) for u in ups for d in downs for s in steps]

    def set_combo(c):
        (up, down, (step_up, step_down)) = c
        for n, v in zip(names, (up, down, step_up, step_down)):
            setattr(mod, n, v)

    def label(c) -> str:
        return f"gate/up {c[0]} down {c[1]} shared steps {c[2]}"

    title = "NVFP4 MoE GEMV with the shared pair, gate/up + down a call"
    nvfp4_two_passes(title, combos, set_combo, saved, label)


def sweep_moe_gemv_int() -> None:
    """The NVFP4 MoE GEMV's gate/up products as integer dot products (``FP4_INT_DOT``: int16
    inputs, codes to int8 by byte permutes, ``dp2a``; tiles ``NVFP4_INT``) against the shipped
    words with block sums (``NVFP4_PLANES``), each with the bf16 shared rows' step at BLOCK_K and
    at 64 (``NVFP4_SHARED_BK``: the shared branch sets the kernel's registers); the down kernel as
    shipped, the inputs' quantisation inside each call. Gate/up + down a call over 8 routings,
    every row timed twice, in two passes, the second in reverse order. The last line names the
    best integer row's settings as environment variables."""
    mod = triton_moe_gemv
    saved = {n: getattr(mod, n) for n in ("NVFP4_PLANES", "NVFP4_INT", "FP4_INT_DOT", "NVFP4_SHARED_BK")}
    ups = [(4, 512, 4, 1), (4, 1024, 4, 1), (8, 1024, 8, 1), (4, 2048, 8, 1), (2, 2048, 4, 1), (8, 512, 8, 1),
           (8, 256, 2, 1)]  # fmt: skip
    combos = [(False, saved["NVFP4_PLANES"], s) for s in (0, 64)] + [(False, u, 64) for u in ups[1:4]]
    combos += [(True, u, s) for u in ups for s in (0, 64)]
    if DRY:
        combos = combos[:1] + combos[-1:]

    def set_combo(c):
        mod.FP4_INT_DOT, tile, mod.NVFP4_SHARED_BK = c
        mod.NVFP4_INT = mod.NVFP4_PLANES = tile

    best = None
    for t in (1, 2):
        calls = nvfp4_calls_with_shared_pair(t)
        mod.FP4_INT_DOT = False
        want = calls[0]()
        times, ok = two_passes(combos, set_combo, saved, calls, want)
        print(f"== T={t} NVFP4 MoE GEMV, integer products or words, shared pair in (two passes)", flush=True)
        for c in sorted(ok, key=ok.get):
            print(f"  {'int' if c[0] else 'words'} gate/up {c[1]} shared step {c[2]}: {ok[c]:7.1f} us"
                  f" ({times[c][0]:.1f}, {times[c][1]:.1f})", flush=True)  # fmt: skip
        for c in combos:
            if c not in ok:
                print(f"  {'int' if c[0] else 'words'} gate/up {c[1]} shared step {c[2]}: failed", flush=True)
        ints = [c for c in ok if c[0]]
        if t == 1 and ints:
            best = min(ints, key=ok.get)
    if best:
        print(f"best integer row at T=1: FT_MOE_GEMV_NVFP4_INT={','.join(map(str, best[1]))} "
              f"FT_MOE_GEMV_NVFP4_SHARED_BK={best[2]}", flush=True)  # fmt: skip


def sweep_moe_gemv_stages() -> None:
    """The NVFP4 MoE GEMV as shipped (integer gate/up products, the down kernel by pair on words,
    the bf16 shared pair) with its loops' stages swept: gate/up's ``NVFP4_INT`` and the down
    kernel's ``NVFP4_DOWN_PLANES`` tiles were swept at one stage only (2026-12-01/02), where each
    program's loads wait for its last step's. Gate/up tiles with the shipped down tiles, then down
    tiles with the shipped gate/up; gate/up + down a call over 8 routings, two passes."""
    mod = triton_moe_gemv
    saved = {n: getattr(mod, n) for n in ("NVFP4_INT", "NVFP4_DOWN_PLANES")}
    ups = [(4, 512, 4, s) for s in (1, 2, 3, 4)] + [(2, 512, 2, s) for s in (1, 2, 4)]
    ups += [(4, 256, 4, s) for s in (2, 4)] + [(8, 256, 4, s) for s in (1, 2)] + [(2, 1024, 4, 2)]
    downs = [(8, 256, 2, 2), (8, 128, 2, 2), (8, 128, 2, 4), (4, 256, 2, 2), (16, 128, 4, 4)]
    combos = [(u, saved["NVFP4_DOWN_PLANES"]) for u in ups] + [(saved["NVFP4_INT"], d) for d in downs]
    if DRY:
        combos = combos[:1] + combos[-1:]

    def set_combo(c):
        mod.NVFP4_INT, mod.NVFP4_DOWN_PLANES = c

    def label(c) -> str:
        return f"gate/up {c[0]} down {c[1]}"

    nvfp4_two_passes("NVFP4 MoE GEMV, loop stages", combos, set_combo, saved, label)


def sweep_moe_gemv_unroll() -> None:
    """The NVFP4 MoE GEMV's integer gate/up loop unrolled (``GATE_UP_UNROLL``) 1, 2 and 4 times, the
    down kernel as shipped, the bf16 shared pair; gate/up + down a call over 8 routings (in a
    graph, as in a decode step), two passes. (2026-12-05 this section also timed the down kernel
    with its rows loaded before the PDL wait, at six tiles: all slower, removed.)"""
    mod = triton_moe_gemv
    saved = {"GATE_UP_UNROLL": mod.GATE_UP_UNROLL}
    combos = [1, 2, 4][: 2 if DRY else 3]

    def set_combo(c):
        mod.GATE_UP_UNROLL = c

    nvfp4_two_passes("NVFP4 MoE GEMV, the integer gate/up loop unrolled", combos, set_combo, saved,
                     lambda c: f"gate/up unrolled {c}")  # fmt: skip


SECTIONS = {"gemv": sweep_gemv, "split_k": sweep_split_k, "router": sweep_router, "moe_gemv": sweep_moe_gemv,
            "moe_gemv_kernels": sweep_moe_gemv_kernels,
            "moe_gemv_planes": sweep_moe_gemv_planes, "moe_gemv_shared": sweep_moe_gemv_shared,
            "moe_gemv_int": sweep_moe_gemv_int, "moe_gemv_stages": sweep_moe_gemv_stages,
            "moe_gemv_unroll": sweep_moe_gemv_unroll,
            "grouped": sweep_grouped, "grouped_w4a16": sweep_grouped_w4a16,
            "grouped_w4a16_gluon": sweep_grouped_w4a16_gluon, "conv": sweep_conv,
            "extend": sweep_extend}  # fmt: skip


def main() -> None:
    names = [a for a in sys.argv[1:] if a in SECTIONS] or list(SECTIONS)
    print(
        f"config sweep on {torch.cuda.get_device_name() if not DRY else 'CPU (dry run)'}: {', '.join(names)}"
    )
    torch.manual_seed(0)
    for name in names:
        SECTIONS[name]()


if __name__ == "__main__":
    main()
