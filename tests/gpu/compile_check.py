"""Compile Triton kernels for an H200 (sm_90) on a machine without a GPU (not a test):

    PYTHONPATH=/path/to/triton-site python tests/gpu/compile_check.py [PART_OF_LABELS]

Triton compiles for a target named by hand (``GPUTarget("cuda", 90, 32)``) and its bundled
ptxas reports registers and spills, so a kernel variant written away from a device can at least
be shown to compile, and to fit, before a device run is spent on it. Each entry below names a
kernel, its pointer types and representative constexprs (the shapes the engine launches for
Qwen3-Next); other integer arguments compile as i32, float ones as fp32. It does not check values
(the interpreter checks in tests/ do) nor speed. Exits 1 if any kernel fails to compile.
First run (2026-11-30): every kernel compiles; only the attention extend kernel at heads of 256
(128 x 64 tiles, 8 warps) spills (88 bytes at 255 registers).
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from ft.attention import triton_kernels  # noqa: E402
from ft.gdn import triton_conv, triton_conv_proj, triton_decode  # noqa: E402
from ft.layers import triton_gemv, triton_norm, triton_rope  # noqa: E402
from ft.moe.backends import host_stage  # noqa: E402
from ft.moe.kernels import (  # noqa: E402
    moe_gemv_down,
    moe_gemv_kernels,
    triton_combine,
    triton_moe,
    triton_moe_gemv,
    triton_moe_kernel,
    triton_router,
    triton_router_gemv,
    triton_w4a16,
    triton_w4a16_kernel,
    w4a16_dequantize,
)

TARGET = GPUTarget("cuda", 90, 32)
FLOATS = {"eps", "qk_scale", "scale", "unfold"}
BF, I32, I64, F32, U8 = "*bf16", "*i32", "*i64", "*fp32", "*u8"


def build(fn, ptrs: dict, consts: dict, warps: int = 4, stages: int = 3) -> str:
    # a constexpr left out takes its default, as a launch that does not pass it does
    consts = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **consts}
    sig = {
        a: "constexpr" if a in consts else ptrs.get(a, "fp32" if a in FLOATS else "i32") for a in fn.arg_names
    }
    # what a real launch tells Triton: pointers from torch are 16-byte aligned, and the row strides
    # and widths of these models' tensors are multiples of 16 (so loads vectorise as they will)
    aligned = [
        i for i, a in enumerate(fn.arg_names) if a in ptrs or a.startswith("s_") or a in ("K", "K_SPLIT")
    ]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned if sig[fn.arg_names[i]] != "constexpr"}
    source = GluonASTSource if getattr(fn, "is_gluon", lambda: False)() else ASTSource
    kernel = triton.compile(
        source(fn=fn, signature=sig, constexprs=consts, attrs=attrs), target=TARGET,
        options={"num_warps": warps, "num_stages": stages},
    )  # fmt: skip
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(kernel.asm["ptx"])
        f.flush()
        log = subprocess.run(
            [ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True
        )
    regs = re.findall(r"Used (\d+) registers", log.stderr)
    spills = re.findall(r"(\d+) bytes spill stores", log.stderr)
    regs, spills = regs[0] if regs else "?", spills[0] if spills else "?"
    return f"{regs} registers, {spills} B spilled, {kernel.metadata.shared} B shared"


def entries():
    moe = {"x": BF, "xq": BF, "xf": BF, "b": BF, "b_scale": BF, "b_global": BF, "shared_b": BF, "act": BF,
           "topk_ids": I64,
           "shared_logit": BF, "out": BF, "topk_w": F32, "host_b": BF, "host_scale": BF,
           "host_global": BF}  # fmt: skip
    fp4 = {**moe, "b": U8, "b_scale": U8, "b_global": F32, "host_b": U8, "host_scale": U8, "host_global": F32}
    stage = {"rows": I64, "staged": I64, "src_block": I64, "dst_block": I64}
    yield "host stage (a pair's 16 KB of a host row)", host_stage._stage_kernel, stage, {
        "BLOCK_P": 32, "BLOCK": host_stage.STAGE_BLOCK}, 4, 3  # fmt: skip
    yield "conv decode, one launch", triton_conv._conv_decode_kernel, {
        "x": BF, "w": BF, "conv_state": BF, "context_lens": I32, "state_slots": I64, "out": BF,
    }, {"KC": 4, "KP": 4, "BLOCK_C": 256, "USE_PDL": 2}, 4, 3  # fmt: skip
    for name, ptrs, is4, warps in (("bf16", moe, False, 4), ("nvfp4", fp4, True, 8)):
        common = {"TOPK": 10, "SHARED": 1, "FP4": is4, "EVEN_K": True, "BLOCK_N": 8, "BLOCK_K": 512,
                  "USE_PDL": 2}  # fmt: skip
        for stages, host in ((1, False), (4, False), (4, True)):  # host: rows read from host memory
            tag = f"{name}, loop stages {stages}{', host rows' if host else ''}"
            yield f"MoE GEMV gate/up {tag}", moe_gemv_kernels._gate_up_kernel, ptrs, {
                **common, "LOOP_STAGES": stages, "HOST": host, "PLANES": False}, warps, 4  # fmt: skip
            pair = {**common, "LOOP_STAGES": stages, "HOST": host}
            ptrs_pair = {**ptrs, "ws": F32, "counters": I32}
            yield (
                f"MoE GEMV down by pair {tag}",
                moe_gemv_down._down_pair_kernel,
                ptrs_pair,
                pair,
                warps,
                4,
            )
            if is4 and stages == 4:  # codes read as words (FP4_PLANES), at their tiles, with a K tail too
                bn, bk, pw, ps = triton_moe_gemv.NVFP4_PLANES
                dn, dk, dw, ds = triton_moe_gemv.NVFP4_DOWN_PLANES
                for even in (True, False):
                    gu = {**common, "LOOP_STAGES": ps, "HOST": host, "PLANES": True, "BLOCK_N": bn,
                          "BLOCK_K": bk, "EVEN_K": even}  # fmt: skip
                    words = f"planes, even K {even}"
                    label = f"MoE GEMV gate/up {tag}, {words}"
                    yield label, moe_gemv_kernels._gate_up_kernel, ptrs, gu, pw, ps
                    # host rows may pipeline more loads at the same tiles (``NVFP4_HOST_STAGES``)
                    extra = (2, 3) if host else ()
                    ib, ik, iw, i_s = triton_moe_gemv.NVFP4_INT  # integer products too (FP4_INT_DOT)
                    int_ptrs = {**ptrs, "xq": "*i16", "xf": F32}
                    for st in (i_s, *extra):
                        consts = {**gu, "INT_DOT": True, "BLOCK_N": ib, "BLOCK_K": ik, "LOOP_STAGES": st,
                                  "SHARED_BLOCK_K": triton_moe_gemv.NVFP4_SHARED_BK,
                                  "UNROLL": triton_moe_gemv.GATE_UP_UNROLL}  # fmt: skip
                        label = f"MoE GEMV gate/up {tag}, {words}, integer products, {st} stages"
                        yield label, moe_gemv_kernels._gate_up_kernel, int_ptrs, consts, iw, st
                        if st == i_s and not host:  # the loop unrolled otherwise (``GATE_UP_UNROLL``)
                            for unroll in {1, 4} - {triton_moe_gemv.GATE_UP_UNROLL}:
                                label_u = f"{label}, unrolled {unroll}"
                                consts_u = {**consts, "UNROLL": unroll}
                                yield label_u, moe_gemv_kernels._gate_up_kernel, int_ptrs, consts_u, iw, st
                    for st in (ds, *extra):  # the down kernel on words
                        dp = {**common, "LOOP_STAGES": st, "HOST": host, "PLANES": True, "BLOCK_N": dn,
                              "BLOCK_K": dk, "EVEN_K": even}  # fmt: skip
                        label = f"MoE GEMV down by pair {tag}, {words}, {st} stages"
                        yield label, moe_gemv_down._down_pair_kernel, ptrs_pair, dp, dw, st
    rope = {"q": BF, "k": BF, "v": BF, "q_w": BF, "k_w": BF, "positions": I64, "inv_freq": F32, "q_out": BF,
            "k_out": BF, "k_cache": BF, "v_cache": BF, "slots": I64}  # fmt: skip
    for store in (False, True):
        for heads in (1, 8):
            consts = {"HQ": 16, "HKV": 2, "D": 256, "ROT": 64, "ZERO_CENTERED": True, "HEADS": heads,
                      "BLOCK_D": 256, "PAGE": 16, "STORE": store, "USE_PDL": 2}  # fmt: skip
            warps = 2 * (4 if heads > 1 else 1)
            yield (
                f"q/k norm + rope, store {store}, {heads} heads",
                triton_rope._qk_norm_rope_kernel,
                rope,
                consts,
                warps,
                3,
            )
    dec = {"q": BF, "k_cache": BF, "v_cache": BF, "block_tables": I32, "seq_lens": I32, "out": BF,
           "part_o": F32, "part_lse": F32, "gate": BF}  # fmt: skip
    for splits, gate in ((1, False), (1, True), (4, False)):
        yield f"attention decode, {splits} splits, gate {gate}", triton_kernels.decode_kernel, dec, {
            "REP": 8, "REP_P": 16, "D": 256, "PAGE": 16, "BLOCK_N": 32, "SPLITS": splits, "PREC": "tf32",
            "GATE": gate, "USE_PDL": 2}, 4, 2  # fmt: skip
    for gate, splits in itertools.product((False, True), (4, 128)):
        yield f"attention combine, {splits} splits, gate {gate}", triton_kernels.combine_kernel, {
            "part_o": F32, "part_lse": F32, "seq_lens": I32, "out": BF, "gate": BF}, {
            "HQ": 16, "D": 256, "SPLITS": splits, "BLOCK_N": 32, "GATE": gate, "CHUNK": min(splits, 32),
            "USE_PDL": 2}, 4, 3  # fmt: skip

    mma = {
        "a": BF,
        "b": BF,
        "c": BF,
        "topk_w": F32,
        "sorted_ids": I64,
        "block_expert": I64,
        "num_padded": I64,
        "a_map": I64,
        "c_map": I64,
    }
    w4 = {**mma, "b": U8, "b_scale": U8, "b_global": F32}
    grouped = (("bf16", triton_moe_kernel._grouped_gemm_kernel, mma, triton_moe.CONFIGS, {}),
               ("NVFP4", triton_w4a16_kernel._w4a16_gemm_kernel, w4, triton_w4a16.CONFIGS, {}),
               ("NVFP4 LUT", triton_w4a16_kernel._w4a16_gemm_kernel, w4, triton_w4a16.CONFIGS,
                {"LUT": True}))  # fmt: skip
    for name, kernel, ptrs, table, extra in grouped:
        for t in (64, 8192):  # the MMA path's tiles for a decode batch and a prefill chunk
            cfgs = triton_moe.pick_config(t, 512, table)
            for which, cfg, swiglu in zip(("gate/up", "down"), cfgs, (True, False)):
                bm, bn, bk, group_m, warps, stages = cfg
                consts = {"TOPK": 10, "A_PER_TOKEN": swiglu, "SWIGLU": swiglu, "MUL_W": not swiglu,
                          "EVEN_K": True, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m,
                          "USE_PDL": 2, **extra}  # fmt: skip
                yield f"{name} MMA {which}, T={t}", kernel, ptrs, consts, warps, stages
                if t > 64:  # a streamed call (``pairs.DIRECT_TERMS``): k = 1, rows through maps
                    into = {"TOPK": 1, "A_MAP": swiglu, "C_MAP": not swiglu}
                    yield f"{name} MMA {which} into rows, T={t}", kernel, ptrs, consts | into, warps, stages
    from ft.moe.kernels import gluon_w4a16, gluon_w4a16_kernel  # Gluon (its own AST source)

    kernel = gluon_w4a16_kernel._w4a16_wgmma_kernel
    rows = [(t, cfg) for t, row in ((1024, 0), (8192, -1)) for cfg in gluon_w4a16.CONFIGS["default"][row][1:]]
    for (t, cfg), which, swiglu in zip(rows, ("gate/up", "down") * 2, (True, False) * 2):
        bm, bn, bk, group_m, warps, _ = cfg
        consts = {"TOPK": 10, "A_PER_TOKEN": swiglu, "SWIGLU": swiglu, "MUL_W": not swiglu, "BLOCK_M": bm,
                  "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m, "A_MAP": False, "C_MAP": False,
                  "STAGES": gluon_w4a16.STAGES, **gluon_w4a16.layouts(bm, bn, bk, warps)}  # fmt: skip
        yield f"NVFP4 Gluon wgmma {which}, T={t}", kernel, w4, consts, warps, 1
        into = {"TOPK": 1, "A_MAP": swiglu, "C_MAP": not swiglu}
        yield f"NVFP4 Gluon wgmma {which} into rows, T={t}", kernel, w4, consts | into, warps, 1
    bank = {"codes": U8, "scales": U8, "globals_": F32, "out": BF}
    yield "NVFP4 bank dequantised to bf16", w4a16_dequantize._dequantize_kernel, bank, {
        "BLOCK_N": 64, "BLOCK_K": 256}, 4, 3  # fmt: skip
    sums = {"y": BF, "gate": BF, "shared": BF, "out": BF}
    yield "top-k sum + shared", triton_combine._sum_topk_kernel, sums, {
        "K": 10, "HAS_SHARED": True, "BLOCK_H": 1024, "USE_PDL": 2}, 4, 3  # fmt: skip
    norm = {"x": BF, "r": BF, "w": BF, "out": BF, "res_out": BF}
    yield "residual add + RMSNorm", triton_norm._rms_norm_kernel, norm, {
        "ZERO_CENTERED": True, "HAS_RES": True, "BLOCK_D": 2048, "USE_PDL": 2}, 8, 3  # fmt: skip
    yield "gated RMSNorm", triton_norm._gated_rms_norm_kernel, {"x": BF, "z": BF, "w": BF, "out": BF}, {
        "ROUND_MID": True, "ROWS": 4, "BLOCK_D": 128, "USE_PDL": 2}, 4, 3  # fmt: skip
    kv = {"k": BF, "v": BF, "k_cache": BF, "v_cache": BF, "slots": I64}
    yield "KV store", triton_kernels.store_kv_kernel, kv, {
        "HKV": 2, "D": 256, "PAGE": 16, "HP": 2, "USE_PDL": 2}, 4, 3  # fmt: skip
    ext = {"q": BF, "k_cache": BF, "v_cache": BF, "block_tables": I32, "cu_seqlens": I32, "context_lens": I32,
           "out": BF}  # fmt: skip
    yield "attention extend", triton_kernels.extend_kernel, ext, {
        "REP": 8, "D": 256, "PAGE": 16, "BLOCK_M": 128, "BLOCK_N": 64, "PREC": "tf32"}, 8, 2  # fmt: skip
    from ft.attention import gluon_extend, gluon_extend_ws  # Gluon

    for d, (bm, bn, warps) in gluon_extend.TILES.items():
        consts = {"REP": 8, "D": d, "PAGE": 16, "BLOCK_M": bm, "BLOCK_N": bn,
                  **gluon_extend.layouts(bm, bn, d, warps, torch.bfloat16)}  # fmt: skip
        kernel = gluon_extend._extend_wgmma_kernel
        yield f"attention extend Gluon, heads of {d}", kernel, ext, consts, warps, 1
        ws = consts | gluon_extend_ws.ws_layouts(bm, bn, d, torch.bfloat16)
        ws |= {"ATTEND_REGS": gluon_extend_ws.ATTEND_REGS, "LOAD_REGS": gluon_extend_ws.LOAD_REGS}
        kernel = gluon_extend_ws._extend_ws_kernel
        yield f"attention extend Gluon warp-specialised, heads of {d}", kernel, ext, ws, 4, 1
    gdn = {"mixed": BF, "b": BF, "a": BF, "A_log": F32, "dt_bias": F32, "state": F32, "cu_seqlens": I32,
           "context_lens": I32, "state_slots": I64, "o": BF}  # fmt: skip
    heads = {"HK": 16, "HV": 32, "DK": 128, "DV": 128, "BK": 128, "BV": 32, "VARLEN": False, "USE_PDL": 2}
    yield "GDN recurrent decode", triton_decode._recurrent_kernel, gdn, heads, 4, 3
    gemv = {"x": BF, "w": BF, "out": BF, "ws": F32, "counters": I32}
    for bn, bk, warps, stages in (triton_gemv.NARROW, triton_gemv.WIDE):  # the shipped tiles
        consts = {"M_P": 16, "BLOCK_N": bn, "BLOCK_K": bk, "EVEN_K": True, "USE_PDL": 2}
        yield f"dense GEMV {bn} x {bk}", triton_gemv._gemv_kernel, gemv, consts, warps, stages
    split = {"M_P": 16, "BLOCK_N": 16, "BLOCK_K": 256, "SPLITS": 8, "EVEN_K": True, "USE_PDL": 2}
    yield "dense GEMV split over K", triton_gemv._gemv_split_k_kernel, gemv, split, 4, 4
    conv = {
        "x": BF,
        "w": BF,
        "out": BF,
        "conv_w": BF,
        "conv_state": BF,
        "context_lens": I32,
        "state_slots": I64,
    }
    bn, bk, warps, stages = triton_gemv.WIDE
    consts = {"M_P": 16, "BLOCK_N": bn, "BLOCK_K": bk, "EVEN_K": True, "KC": 4, "KP": 4, "USE_PDL": 2}
    yield (
        "GDN in_proj + decode conv, 1 tokens",
        triton_conv_proj._proj_conv_kernel,
        conv,
        consts,
        warps,
        stages,
    )
    for keys32 in (False, True):  # int64 keys, int32 (``triton_router.KEYS32``)
        yield f"softmax top-k, int32 keys {keys32}", triton_router._softmax_topk_kernel, {
            "logits": BF, "weights": F32, "ids": I64}, {"K": 10, "K_P": 16, "E_P": 512, "RENORMALIZE": True,
            "KEYS32": keys32, "USE_PDL": 2}, 1, 3  # fmt: skip
        router = {"x": BF, "w": BF, "logits": BF, "weights": F32, "ids": I64, "ws": F32, "counters": I32,
                  "xq": "*i16", "xf": F32}  # fmt: skip
        for t_p, blocks in ((1, False), (4, False), (1, True), (2, True)):  # blocks: x's int16 blocks too
            label = f"router GEMV + top-k, {t_p} tokens, int32 keys {keys32}" + (
                ", int16 blocks" if blocks else ""
            )
            yield label, triton_router_gemv._router_topk_kernel, \
                router, {"M_P": 16, "T_P": t_p, "BLOCK_N": 16, "BLOCK_K": 256, "SPLITS": 8, "EVEN_K": True,
                         "TOP_K": 10, "TOP_K_P": 16, "E_P": 512, "RENORMALIZE": True, "KEYS32": keys32,
                         "USE_PDL": 2, "BLOCKS": blocks}, 4, 4  # fmt: skip


def main() -> None:
    failed = 0
    only = sys.argv[1] if len(sys.argv) > 1 else ""  # a part of the labels to compile (default: all)
    for label, fn, ptrs, consts, warps, stages in entries():
        if only not in label:
            continue
        try:
            print(f"{label:60} {build(fn, ptrs, consts, warps, stages)}", flush=True)
        except Exception as e:  # report every failure, then fail
            failed += 1
            print(f"{label:60} FAILED: {type(e).__name__}: {str(e)[:800]}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
