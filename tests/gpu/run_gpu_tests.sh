#!/usr/bin/env bash
# Every `gpu`-marked test on a machine with a GPU, in the least wall time (not run by CI):
#
#   bash tests/gpu/run_gpu_tests.sh [OUT_DIR]
#
# Kernel tests run in parallel (pytest-xdist, 12 workers: compiling the Triton kernels is most of
# their time, and each worker's problems are small). Engine tests run one after another: each
# engine sizes its KV pool and expert cache from the GPU's free memory, so engines started side by
# side by xdist fail against each other. Two-GPU tests skip on one GPU. Logs go to OUT_DIR.
set -uo pipefail
out=${1:-/tmp/ft_gpu_tests}
mkdir -p "$out"
kernels=(tests/gpu/test_kernels.py tests/gpu/test_fused_layers.py tests/gpu/test_gemv.py tests/gpu/test_moe_gemv.py
         tests/gpu/test_moe_fusions.py tests/gpu/test_router_fold.py tests/gpu/test_gdn_decode.py
         tests/nvfp4/test_w4a16_gpu.py)
engines=(tests/gpu/test_engine_cuda.py tests/offload/test_offload_gpu.py tests/gpu/test_symm_all_reduce.py)
python3 -m pytest -q -m gpu -n 12 -p no:cacheprovider --timeout 300 "${kernels[@]}" >"$out/kernels.log" 2>&1
k=$?
python3 -m pytest -q -m gpu -p no:cacheprovider -p no:xdist --timeout 300 --tb=short -rf "${engines[@]}" \
  >"$out/engines.log" 2>&1
e=$?
for log in "$out/kernels.log" "$out/engines.log"; do
  echo "$log: $(grep -E '^(FAILED|ERROR)|[0-9]+ (passed|failed)' "$log" | tail -n 20)"
done
exit $((k || e))
