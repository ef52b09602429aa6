#!/usr/bin/env bash
# Issue 7's runs on a machine of 2, 4 or 8 H200s (not run by CI; nvidia-h200-x2 / -x4 / -x8), a
# stage per device call:
#
#   bash tests/gpu/tp_runs.sh OUT_DIR tests|bf16|nvfp4 TP
#
#   tests  the tensor-parallel GPU tests at TP: greedy tokens and log-probs against one GPU
#          (tests/gpu/test_tp_gpus.py at 4 and 8, test_engine_cuda.py -k tp2 at 2; ~3 min)
#   bf16   the full Qwen3-Next-80B-A3B, bf16, dummy weights, at TP: single-stream decode, TTFT of a
#          1k prompt, aggregate at 16 and 64 concurrent, a 32k prefill, and the census of a batch-1
#          decode step (its all-reduces timed inside a graph: the step's time in all-reduce) (~6 min)
#   nvfp4  the same with NVFP4 experts (--quantize-experts nvfp4; experts at I=128 a rank at TP=4,
#          64 at TP=8) (~6 min)
#
# Logs go to OUT_DIR; the last lines printed are the figures, for docs/benchmarks.md beside the
# TP=1 and TP=2 rows (issue 7 asks the scaling ratios).
set -uo pipefail
out=${1:?OUT_DIR}
stage=${2:?stage}
tp=${3:?TP}
mkdir -p "$out"
have=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$have" -lt "$tp" ]; then
  echo "TP=$tp needs $tp GPUs, this machine has $have" >&2
  exit 2
fi
bench=(python3 -m ft bench offline --config configs/qwen3_next_80b_a3b.json --load-format dummy --device cuda
  --tp-size "$tp" --batch-sizes 1,16,64 --max-running-requests 64 --input-len 1024 --output-len 128
  --prefill-lens 32000 --num-tokens 100000 --census)
case $stage in
tests)
  if [ "$tp" -eq 2 ]; then
    timeout 400 python3 -m pytest -q -m gpu -p no:xdist tests/gpu/test_engine_cuda.py -k tp2 >"$out/tp_tests_$tp.log" 2>&1
  else
    timeout 400 python3 -m pytest -q -m gpu -p no:xdist tests/gpu/test_tp_gpus.py -k "$tp" >"$out/tp_tests_$tp.log" 2>&1
  fi
  tail -n 3 "$out/tp_tests_$tp.log"
  ;;
bf16 | nvfp4)
  quant=()
  if [ "$stage" = nvfp4 ]; then quant=(--quantize-experts nvfp4); fi
  timeout 590 "${bench[@]}" "${quant[@]}" --output-json "$out/tp${tp}_$stage.json" >"$out/tp${tp}_$stage.log" 2>&1
  grep -E "^(single-stream|TTFT|prefill| +[0-9]+ |census|all-reduce)" "$out/tp${tp}_$stage.log" | cut -c1-220
  ;;
*)
  echo "unknown stage $stage" >&2
  exit 2
  ;;
esac
