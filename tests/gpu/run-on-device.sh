#!/usr/bin/env bash
# Runs flashd's GPU tests on a machine with a device, from binaries gathered beforehand by
# tests/gpu/prepare-device-run.sh, and writes every log and a summary to OUT (default: the
# $OUT directory the device machine provides, else ./device-out). Needs no network, no compiler
# and none of the project's libraries; each test gets at most 4 minutes. The forward pass's tests
# run on the CUDA backend against the golden model of the repository this folder sits in; then
# engine_bench measures that model's decode (also behind a 64K-token context) and prefill on the
# CPU and on the GPU, with the GPU's traffic and waits per step, and gpu_bench the kernels at the
# released model's dimensions (gpu_bench.txt).
#
# Usage (on the device machine, from the repository root): build-device/run-on-device.sh [OUT]
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-${OUT:-./device-out}}
mkdir -p "$out"
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export FLASHD_TEST_BACKEND=cuda FLASHD_TEST_GOLDEN_DIR="$here/../tests/golden"
export FLASHD_TEST_DSPARK_GOLDEN_DIR="$here/golden-dspark"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 ||
    echo "nvidia-smi not available"
} > "$out/device.txt"
status=0
: > "$out/summary.txt"
# run NAME [VAR=VALUE...] COMMAND...: one test binary, its log NAME.log, a line in the summary.
run() {
  local name=$1 start end rc verdict
  shift
  start=$(date +%s.%N)
  env "$@" --log_level=test_suite --report_level=short > "$out/$name.log" 2>&1
  rc=$?
  end=$(date +%s.%N)
  case $rc in
    0) verdict=passed ;;
    77) verdict="skipped ($(grep -m1 -o "SKIP.*" "$out/$name.log"))" ;;
    *) verdict="FAILED (exit $rc)"; status=1 ;;
  esac
  awk -v n="$name" -v v="$verdict" -v a="$start" -v b="$end" 'BEGIN { printf "%s: %s in %.1f s\n", n, v, b - a }' >> "$out/summary.txt"
}
for t in "$here"/bin/*_test; do
  run "$(basename "$t")" timeout 240 "$t"
done
# The forward pass's tests again with the linears on matrix cores (engine.gpu_gemms: matrix).
for t in golden_test forward_equivalence_test; do
  [ -x "$here/bin/$t" ] && run "${t}_matrix" FLASHD_TEST_GPU_GEMMS=matrix timeout 240 "$here/bin/$t"
done
timeout 240 "$here/bin/gpu_bench_cuda" > "$out/gpu_bench.txt" 2>&1 ||
  echo "gpu_bench: exit $?" >> "$out/summary.txt"
for backend in cpu cuda; do
  timeout 150 "$here/bin/engine_bench" "$FLASHD_TEST_GOLDEN_DIR" 512 4096 --decode-at 65536 \
    --backend "$backend" > "$out/engine_bench_$backend.txt" 2>&1 ||
    echo "engine_bench $backend: exit $?" >> "$out/summary.txt"
done
timeout 150 "$here/bin/engine_bench" "$FLASHD_TEST_GOLDEN_DIR" 512 4096 --backend cuda \
  --gpu-gemms matrix > "$out/engine_bench_cuda_matrix.txt" 2>&1 ||
  echo "engine_bench cuda matrix: exit $?" >> "$out/summary.txt"
cat "$out/summary.txt"
exit $status
