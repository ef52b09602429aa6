#!/usr/bin/env bash
# Every `gpu`-marked test on a machine with a GPU, in the least wall time (not run by CI):
#
#   bash tests/gpu/run_gpu_tests.sh [OUT_DIR] [all|kernels|engines|offload]
#
# Kernel tests run in parallel (pytest-xdist, 12 workers: compiling the Triton kernels is most of
# their time, and each worker's problems are small). Engine tests run one after another: each
# engine sizes its KV pool and expert cache from the GPU's free memory, so engines started side by
# side by xdist fail against each other. Two-GPU tests skip on one GPU. Logs go to OUT_DIR. On a
# cold Triton cache (2026-12-01, one H200) the kernels took 2 min, the engine file over 8 min and
# the offload file 2.5 min (2026-12-06, 76 tests: its first 24 alone took ~250 s on a cold cache,
# after test_dequantized_cuda's 75 s): a device call is limited to 10, so give each stage its own call.
set -uo pipefail
out=${1:-/tmp/ft_gpu_tests}
stage=${2:-all}
mkdir -p "$out"
kernels=(tests/gpu/test_kernels.py tests/gpu/test_fused_layers.py tests/gpu/test_gemv.py tests/gpu/test_moe_gemv.py
         tests/gpu/test_moe_fusions.py tests/gpu/test_router_fold.py tests/gpu/test_gdn_decode.py
         tests/nvfp4/test_w4a16_gpu.py)
serial() {  # one log per stage
  python3 -m pytest -q -m gpu -p no:cacheprovider -p no:xdist --timeout 300 --tb=short -rf "${@:2}" >"$out/$1.log" 2>&1
}
rc=0
logs=()
if [[ $stage == all || $stage == kernels ]]; then
  # 12 workers on a 141 GB H200; on an 80 GB H100 twelve ran 21 tests out of memory (2026-12-05): 6
  gib=$(python3 -c "import torch; print(torch.cuda.get_device_properties(0).total_memory >> 30)")
  workers=$(( gib >= 120 ? 12 : 6 ))
  python3 -m pytest -q -m gpu -n "$workers" -p no:cacheprovider --timeout 300 "${kernels[@]}" >"$out/kernels.log" 2>&1 || rc=1
  logs+=("$out/kernels.log")
fi
if [[ $stage == all || $stage == engines ]]; then
  serial engines tests/gpu/test_engine_cuda.py tests/gpu/test_symm_all_reduce.py tests/gpu/test_dequantized_cuda.py || rc=1
  logs+=("$out/engines.log")
fi
if [[ $stage == all || $stage == offload ]]; then
  serial offload tests/offload/test_offload_gpu.py tests/gpu/test_allocator_gpu.py || rc=1
  logs+=("$out/offload.log")
fi
for log in "${logs[@]}"; do
  echo "$log: $(grep -E '^(FAILED|ERROR)|[0-9]+ (passed|failed|skipped)' "$log" | tail -n 20)"
done
exit $rc
