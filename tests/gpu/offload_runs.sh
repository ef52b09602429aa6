#!/usr/bin/env bash
# The offload measurements still owed on a GPU machine, a stage per device call (not run by CI):
#
#   bash tests/gpu/offload_runs.sh OUT_DIR decode|prefill|prefill16k|bench|row|long|bench8k|ttft|ttftbench|memory|sweep|gluon|gluontiles|nvfp4profile|census|hostreads|hybrid|splits
#
#   decode   the 16-layer cut, batch 1: host_reads.FUSED_ROUTE on and off in turn, after the
#            defaults' row warms the cache (decode_variants.py), bf16 under 40 GiB, then NVFP4
#            under 16 GiB (about two thirds resident), where a launch is a larger share (~5 min)
#   prefill  the 16-layer cut's 8k prefill profiled (TIMELINE: why each large gap of the link):
#            the defaults (compiling), the hits before the first group staged ahead
#            (FT_MOE_HITS_AFTER_AHEAD=0, the default until 2026-12-03), a third staging buffer
#            (FT_MOE_STAGING_BUFFERS=3), the defaults again (~8 min)
#   prefill16k  the same cut at the full model's residency (0.81) with one 16k chunk: the
#            defaults and the calls gathering their tokens (FT_MOE_DIRECT_TERMS=0), twice each
#            (the first of each compiles); each prints the kernels' busy time beside the link's.
#            2026-12-03 (b051b4f): 227.6 and 252.6 ms, kernels 92-95% busy, link 72-80% (~8 min)
#   bench    the full Qwen3-Next-80B-A3B in bf16, uniform routing: batch 1, 8k and 32k prefill
#            with the chunk the engine now picks (16384), each prefill's share of the link
#            (~6 min: 215 s of it loading). --max-running-requests 8 as in the earlier rows: each
#            request slot and prefix snapshot holds a GDN state (~76 MB for this model), so the
#            default 64 of each take ~8 GiB from the expert cache (365 instead of 393 resident)
#   row      issue 8's bf16 row as docs/benchmarks.md reports it (2026-12-03 23:42): the full model at
#            --memory-ratio 0.94, batch 1 and 8, TTFT after 1 s idle, 8k and 32k prefill, three
#            prompts of each (--prefill-runs 3: the 32k share spread 81-86% between loads, 2026-12-04;
#            ~7 min)
#   long     TTFT of a 262,143-token prompt (the headline command's context) on the full bf16 80B
#            offloaded at --memory-ratio 0.94, --num-tokens 262144; 2026-12-05: 24.60 s (~4.5 min)
#   bench8k  the same 32k prefill in chunks of 8192 (the control; ~5 min)
#   ttft     the full model in bf16 at --memory-ratio 0.94, TTFT of a 1k prompt after a second
#            idle, pre-staging off, on, off, on (ROUNDS) from one load (ttft_idle.py: each prompt's
#            step, the idle hook's host time and when its copies landed; ~5 min). 2026-12-03: 558 ->
#            448 ms
#   ttftbench  the same through ft bench offline --ttft-idle-s, pre-staging on then off (~6.5 min)
#   memory   the full model in bf16 at --memory-ratio 0.94, the device's memory after the load and
#            after prompts of 1k to 32k tokens (memory_plan.py), with the allocator's segments as
#            they are and expandable (FT_EXPANDABLE_SEGMENTS=1): on 2026-12-03 the 16k chunk's
#            tensors peaked 2.2 GiB above the load, the allocator's reservation 10.6 GiB (~6 min)
#   sweep    the grouped GEMMs' prefill tiles at the calls of an 8k and a 16k chunk, bf16 then NVFP4
#            (config_sweep.py grouped / grouped_w4a16), and the extend attention's at an 8k prompt
#            and at a 32k prompt's second 16k chunk: a 16k offloaded chunk of the bf16 80B is
#            bound by its compute (issue 8's 32k row at 80% of the link, target 85%; 2026-12-03),
#            most of it these GEMMs and that attention. Then `FT_MOE_PREFILL=UP/DOWN
#            FT_ATTN_EXTEND_TILES=BM,BN,W,S bash ... row` with the bests (~9 min)
#   gluon    the Gluon W4A16 kernel (triton_w4a16.GLUON, off; a warp-specialised one measured 26-48%
#            slower on 2026-12-04 18:08 and one with the decoded weights as the wgmma's register
#            operand slower on 2026-12-05, both removed): its GPU tests (against the Triton kernel
#            and the reference, and through Into), each launch beside the Triton kernel's at the
#            same tiles (gluon_w4a16_check.py), then the MoE call at 1k to 16k tokens off and on
#            (w4a16_timings.py; ~2 min). 2026-12-04, the one-partition kernel: 6 passed, bit for
#            bit, 2-5% faster
#   gluontiles  the Gluon W4A16 kernel's prefill tiles at 8k and 16k (config_sweep.py
#            grouped_w4a16_gluon): tiles of fewer registers fit two or three programs an SM, one's
#            decode beside another's wgmmas (the shipped 128 x 128 runs one, ~3 min). If one wins:
#            FT_W4A16_GLUON=1 FT_W4A16_GLUON_TILES=UP/DOWN on issue 5's 8k / 16k prefill row
#   nvfp4profile  where a batch-1 decode step of the NVFP4 80B under --max-gpu-memory 48GiB goes
#            (profile_offload_decode.py, all 48 layers, host reads and staging as the defaults):
#            the row sits at 71-73% of its PCIe floor (target 80%), ~144 us a layer against ~76 of
#            link and ~62 of resident compute. 2026-12-05 11:10: step 6.78 ms, the prefetch's copy
#            kernel 2.92 ms and staging's 1.45 a step; from then on also the link's time beside the
#            compute and the kernels that run while it idles (profiling.link_timeline; ~5 min)
#   census   the full model with NVFP4 experts resident (issue 5's row) with --census: the kernels
#            of a batch-1 decode step, what stands between it and its roofline (~2 min)
#   hostreads  the MoE GEMV with h of its 10 experts read from the host, bf16 then NVFP4
#            (host_read_timings.py): each kernel alone beside the link, which of gate/up and
#            down reads its host rows slower than the link; bf16 again with gate/up at one loop
#            stage and at two tilings that fit one wave (~5 min)
#   hybrid   the host CPU's rate on one expert (cpu_expert_rate.py, ~30 s), then the same model
#            with --moe-backend hybrid, batch 1 and 8 (~5 min); HYBRID_CPU=1 gives the host CPU a
#            share of each prefill layer's streamed experts (FT_MOE_HYBRID_PREFILL_CPU, off by
#            default since it measured slower: hybrid.py)
#   splits   long-context decode by KV split cap (triton_paged.MAX_SPLITS: 128 from 2026-12-05, timed
#            by kernel only): the split-count GPU tests, then the 80B with NVFP4 experts resident
#            decoding after a 1,024- and a 131,072-token prompt at 128 (the defaults' row), 32, 64
#            and 256, from one load (decode_variants.py --prompt; ~5-6 min, its own call: 90 + 480 s
#            of timeouts). Not yet run
#
# Logs go to OUT_DIR; the last lines printed are the figures, for docs/benchmarks.md.
set -uo pipefail
out=${1:?OUT_DIR}
stage=${2:?stage}
mkdir -p "$out"
next=configs/qwen3_next_80b_a3b.json
bench=(python3 -m ft bench offline --config "$next" --load-format dummy --device cuda)
case $stage in
decode)
  fused=ft.moe.backends.host_reads:FUSED_ROUTE
  timeout 280 python3 tests/gpu/decode_variants.py "$next" "$out/decode.log" --layers=16 --max-gpu-memory=40GiB \
    $fused $fused=0 $fused $fused=0 >"$out/decode.out" 2>&1
  timeout 280 python3 tests/gpu/decode_variants.py "$next" "$out/decode_nvfp4.log" --layers=16 --nvfp4 \
    --max-gpu-memory=16GiB $fused $fused=0 $fused $fused=0 >"$out/decode_nvfp4.out" 2>&1
  grep -hE "tok/s" "$out/decode.log" "$out/decode_nvfp4.log" | cut -c1-200
  ;;
prefill)
  # the first run compiles (a cold machine's passed 170 s on 2026-12-02); the last is the warm control
  i=0
  for variant in defaults hits_first buffers3 defaults; do
    i=$((i + 1))
    case $variant in
    defaults) flags=(STREAM_AHEAD=1) ;;
    hits_first) flags=(FT_MOE_HITS_AFTER_AHEAD=0) ;;
    buffers3) flags=(FT_MOE_STAGING_BUFFERS=3) ;;
    esac
    env "${flags[@]}" TIMELINE=1 timeout 200 \
      python3 tests/gpu/profile_offload_prefill.py "$next" 16 0.6 8000 "$out/prefill_${i}_$variant.log" \
      >"$out/prefill_${i}_$variant.out" 2>&1
    echo "$variant: $(grep -E '^== prefill' "$out/prefill_${i}_$variant.log")"
    grep -E "^  link idle" "$out/prefill_${i}_$variant.log" | head -3
  done
  ;;
prefill16k)
  i=0
  for variant in defaults gathered defaults gathered; do
    i=$((i + 1))
    flags=(STREAM_AHEAD=1) limit=120
    [[ $i -le 2 ]] && limit=200 # each compiles the 16k chunk's kernels once
    [[ $variant == gathered ]] && flags=(FT_MOE_DIRECT_TERMS=0)
    env "${flags[@]}" TIMELINE=1 timeout $limit \
      python3 tests/gpu/profile_offload_prefill.py "$next" 16 0.81 16000 "$out/prefill16k_${i}_$variant.log" \
      >"$out/prefill16k_${i}_$variant.out" 2>&1
    echo "$variant: $(grep -E '^== prefill' "$out/prefill16k_${i}_$variant.log")"
    grep -E "^  (kernels running|activations)" "$out/prefill16k_${i}_$variant.log"
  done
  ;;
bench)
  timeout 420 "${bench[@]}" --moe-backend offload --batch-sizes 1 --max-running-requests 8 --input-len 1024 \
    --output-len 32 --prefill-lens 8000,32768 --num-tokens 40000 --output-json "$out/bench.json" >"$out/bench.log" 2>&1
  grep -E "^(single-stream|prefill|moe)" "$out/bench.log"
  ;;
row)
  timeout 560 "${bench[@]}" --moe-backend offload --memory-ratio 0.94 --batch-sizes 1,8 --max-running-requests 8 \
    --input-len 1024 --output-len 64 --prefill-lens 8000,32000 --prefill-runs 3 --num-tokens 34000 --ttft-idle-s 1 \
    >"$out/row.log" 2>&1
  grep -E "^(single-stream|prefill|moe| +[0-9]+ )" "$out/row.log" | cut -c1-220
  ;;
long)
  # the headline command's longest prompt: the full bf16 80B offloaded at --memory-ratio 0.94 with a
  # 262,144-token pool, one 262,143-token prompt (with its one token, the whole context), warmed
  # once at the same length, then its time to first token; 16 prefix snapshots (one a 16k chunk)
  # and one running request, so the GDN state rows leave the expert cache its memory (~6 min)
  timeout 590 "${bench[@]}" --moe-backend offload --memory-ratio 0.94 --batch-sizes "" --max-running-requests 1 \
    --prefix-snapshot-slots 16 --input-len 1024 --output-len 16 --prefill-lens 262143 --num-tokens 262144 \
    >"$out/long.log" 2>&1
  grep -E "^(single-stream|TTFT|prefill|moe)" "$out/long.log" | cut -c1-220
  ;;
bench8k)
  timeout 420 "${bench[@]}" --moe-backend offload --batch-sizes 1 --max-running-requests 8 --input-len 1024 \
    --output-len 8 --prefill-lens 32768 --num-tokens 40000 --chunked-prefill-size 8192 >"$out/bench8k.log" 2>&1
  grep -E "^prefill" "$out/bench8k.log" | sed 's/^/chunks of 8192: /'
  ;;
ttft)
  timeout 420 python3 tests/gpu/ttft_idle.py "$next" 0.94 "$out/ttft_idle.log" >"$out/ttft_idle.out" 2>&1
  grep -E "^(loaded|pre-staging|==)" "$out/ttft_idle.log" | cut -c1-200
  ;;
ttftbench)
  # TTFT for a 1k prompt that finds the engine idle for a second, with and without pre-staging
  for prestage in 1 0; do
    FT_MOE_PRESTAGE=$prestage timeout 280 "${bench[@]}" --moe-backend offload --memory-ratio 0.94 --batch-sizes 1 \
      --max-running-requests 8 --input-len 1024 --output-len 8 --prefill-lens "" --num-tokens 40000 \
      --ttft-idle-s 1 >"$out/ttft_$prestage.log" 2>&1
    echo "prestage $prestage: $(grep -E '^single-stream' "$out/ttft_$prestage.log")"
    grep -E "^(pre-staged|device memory)" "$out/ttft_$prestage.log"
  done
  ;;
memory)
  # where the full model's device memory goes against its plan, the allocator's segments as they
  # are and expandable (ft.engine.allocator), each a load of ~170 s
  for expandable in ${EXPANDABLE:-0 1}; do  # EXPANDABLE=1: only the expandable row (~3 min)
    FT_EXPANDABLE_SEGMENTS=$expandable timeout 290 python3 tests/gpu/memory_plan.py "$next" 0.94 \
      "$out/memory_$expandable.log" >"$out/memory_$expandable.out" 2>&1
    grep -E "^(loaded|after)" "$out/memory_$expandable.log"
  done
  ;;
gluon)
  timeout 300 python3 -m pytest -q -m gpu -p no:xdist tests/nvfp4/test_w4a16_gpu.py -k gluon >"$out/gluon_tests.log" 2>&1
  tail -n 3 "$out/gluon_tests.log"
  timeout 120 python3 tests/gpu/gluon_w4a16_check.py 4096 >"$out/gluon_check.log" 2>&1  # each launch apart
  grep -vE "^ft rank|[Ww]arn" "$out/gluon_check.log" | tail -n 8
  for on in 0 1; do
    FT_W4A16_GLUON=$on FT_TIMINGS_T=1024,2048,4096,8192,16384 timeout 200 python3 tests/nvfp4/w4a16_timings.py \
      >"$out/gluon_timings_$on.log" 2>&1
    echo "FT_W4A16_GLUON=$on:"
    grep -E "^T=" "$out/gluon_timings_$on.log" | cut -c1-200
  done
  ;;
gluontiles)
  FT_SWEEP_GROUPED_T=8192,16384 timeout 400 python3 tests/gpu/config_sweep.py grouped_w4a16_gluon \
    >"$out/gluontiles.log" 2>&1
  grep -E "^(==|  )" "$out/gluontiles.log" | cut -c1-220
  ;;
nvfp4profile)
  QUANT=nvfp4 timeout 400 python3 tests/gpu/profile_offload_decode.py "$next" 48 48GiB "$out/nvfp4profile.log" \
    >"$out/nvfp4profile.out" 2>&1
  grep -vE "^stream [0-9]+: busy" "$out/nvfp4profile.log" | tail -n 45 | cut -c1-200
  ;;
sweep)
  FT_SWEEP_GROUPED_T=8192,16384 timeout 330 python3 tests/gpu/config_sweep.py grouped >"$out/sweep_bf16.log" 2>&1
  FT_SWEEP_GROUPED_T=16384 timeout 200 python3 tests/gpu/config_sweep.py grouped_w4a16 >"$out/sweep_nvfp4.log" 2>&1
  FT_SWEEP_EXTEND=8000,16384+16384 timeout 240 python3 tests/gpu/config_sweep.py extend >"$out/sweep_extend.log" 2>&1
  grep -hE "^(==|  T=|  [0-9]+ tokens|  best)" "$out"/sweep_*.log | cut -c1-200
  ;;
census)
  timeout 300 "${bench[@]}" --quantize-experts nvfp4 --batch-sizes 1,16 --max-running-requests 16 --input-len 1024 \
    --output-len 128 --prefill-lens 8000 --num-tokens 60000 --census >"$out/census.log" 2>&1
  grep -vE "^ft rank" "$out/census.log" | head -60
  ;;
hostreads)
  for fmt in bf16 nvfp4; do
    timeout 150 python3 tests/gpu/host_read_timings.py $fmt >"$out/host_reads_$fmt.log" 2>&1
    grep -vE "^ft rank|[Ww]arn" "$out/host_reads_$fmt.log"
  done
  # bf16 gate/up at other tiles: one loop stage (plain loads of the host rows instead of the
  # pipeliner's copies through shared memory; triton_moe_gemv.HOST_TILES), and tiles whose ~700
  # programs of a batch-1 step fit one wave (78 and 54 registers against 128)
  for tiles in 8,512,4,1 8,256,4,2 8,128,4,4; do
    FT_MOE_GEMV_BF16=$tiles timeout 150 python3 tests/gpu/host_read_timings.py bf16 >"$out/host_reads_$tiles.log" 2>&1
    echo "bf16, gate/up at ($tiles):"
    grep -vE "^ft rank|[Ww]arn" "$out/host_reads_$tiles.log"
  done
  ;;
hybrid)
  timeout 90 python3 tests/gpu/cpu_expert_rate.py >"$out/cpu_expert_rate.log" 2>&1
  cat "$out/cpu_expert_rate.log"
  FT_MOE_HYBRID_PREFILL_CPU=${HYBRID_CPU:-0} timeout 420 "${bench[@]}" --moe-backend hybrid --batch-sizes 1,8 \
    --max-running-requests 8 --input-len 1024 --output-len 64 --prefill-lens 8000 --num-tokens 40000 \
    --output-json "$out/hybrid.json" >"$out/hybrid.log" 2>&1
  grep -E "^(single-stream|prefill|moe| +[0-9]+ )" "$out/hybrid.log"
  ;;
splits)
  timeout 90 python3 -m pytest -q -m gpu -p no:xdist tests/gpu/test_kernels.py -k "split_counts" \
    >"$out/splits_tests.log" 2>&1
  tail -n 2 "$out/splits_tests.log"
  splits=ft.attention.triton_paged:MAX_SPLITS
  timeout 480 python3 tests/gpu/decode_variants.py "$next" "$out/splits_decode.log" --nvfp4 --prompt=1024,131072 \
    "$splits=32" "$splits=64" "$splits=256" >"$out/splits_decode.out" 2>&1
  grep -E "tok/s" "$out/splits_decode.log" | cut -c1-200
  ;;
*)
  echo "unknown stage $stage" >&2
  exit 2
  ;;
esac
