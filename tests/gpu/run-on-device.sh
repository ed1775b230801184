#!/usr/bin/env bash
# Runs flashd's GPU tests and benchmarks on a machine with a device, from binaries gathered
# beforehand by tests/gpu/prepare-device-run.sh. Needs no network, no compiler and none of the
# project's libraries. The forward pass's tests run on the CUDA backend against the golden model
# of the repository this folder sits in (backend_equivalence_test includes the layer split with
# the CPU as the second backend), and the daemon serves it on the device (cache_e2e_test);
# gpu_bench measures the kernels at the released model's
# dimensions; engine_bench the golden model's decode (also behind a 64K-token context) and
# prefill on the GPU (also with each kernel starting when the one ahead has finished, with every
# copy to the device waited for, as before they were queued, and with the matrix GEMMs) and on
# the CPU.
#
# The whole run keeps to a deadline (FLASHD_DEVICE_DEADLINE_S, default 420 s): the steps run in
# the order of what matters most, each within its own limit and what is left of the deadline,
# and a step with too little time left is listed as not run. Results go to OUT (default: $OUT,
# else ./device-out) as a few files, rewritten after every step so that a run cut short still
# leaves them: summary.txt, device.txt, gpu_bench.txt, engine_bench.txt, profile.txt (where the
# machine has nsys) and logs.tar.gz (every test's log).
#
# Usage (on the device machine, from the repository root): build-device/run-on-device.sh [OUT]
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-${OUT:-./device-out}}
deadline=${FLASHD_DEVICE_DEADLINE_S:-420}
mkdir -p "$out"
logs=$(mktemp -d)
begin=$(date +%s)
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export FLASHD_TEST_BACKEND=cuda FLASHD_TEST_GOLDEN_DIR="$here/../tests/golden"
export FLASHD_TEST_DSPARK_GOLDEN_DIR="$here/golden-dspark"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.sm,temperature.gpu,power.draw \
    --format=csv 2>&1 || echo "nvidia-smi not available"
  echo "cores: $(nproc)"
  ldd --version 2>&1 | head -1
} > "$out/device.txt"
# The binaries were linked against this project's build machine's C library; where the device's
# is older, start each through the loader and C library carried beside them.
loader=()
if ! probe=$("$here/bin/gpu_scale_add_cuda_test" --list_content 2>&1 >/dev/null) &&
   grep -q "GLIBC" <<< "$probe"; then
  loader=("$here/glibc/ld-linux-x86-64.so.2" --library-path "$here/glibc:$LD_LIBRARY_PATH")
  echo "the device's C library is older than the build's: binaries started through glibc/" \
    >> "$out/device.txt"
fi
status=0
: > "$out/summary.txt"
: > "$out/engine_bench.txt"
left() { echo $((deadline - ($(date +%s) - begin))); }
# device_gaps: from nsys's cuda_gpu_trace as CSV (Start (ns), Duration (ns), ... on each line),
# the time the device was busy, the idle time in gaps under 20 us between one item's end and the
# next's start (longer ones are the host's own work between steps), and the gaps in buckets.
device_gaps() {
  awk -F, '$1 ~ /^"?[0-9]+"?$/ { gsub(/"/, "", $1); gsub(/"/, "", $2); print $1, $2 }' |
    sort -n | awk '
      { if (n > 0) {
          g = $1 - end
          if (g > 0 && g < 20000) { short += g }
          if (g > 0) { b[g < 2000 ? 0 : g < 5000 ? 1 : g < 20000 ? 2 : 3]++ }
        }
        busy += $2; if ($1 + $2 > end) end = $1 + $2; n++ }
      END { printf "items %d, busy %.3f ms, idle in gaps under 20 us %.3f ms; gaps <2 us %d, " \
                   "2-5 us %d, 5-20 us %d, >=20 us %d\n", n, busy / 1e6, short / 1e6, b[0] + 0,
                   b[1] + 0, b[2] + 0, b[3] + 0 }'
}
# step NAME LIMIT_S OUTPUT [VAR=VALUE...] BINARY [ARGS...]: one binary with its own limit, cut to
# what is left of the deadline; its output to OUTPUT (a file), a line in the summary.
step() {
  local name=$1 limit=$2 output=$3 start end rc verdict budget
  shift 3
  budget=$(( $(left) - 5 ))
  ((budget < limit)) && limit=$budget
  if ((limit < 10)); then
    echo "$name: not run ($(left) s of the deadline left)" >> "$out/summary.txt"
    status=1
    return
  fi
  local vars=()
  while [[ $1 == *=* ]]; do vars+=("$1"); shift; done
  local bin=$1
  shift
  start=$(date +%s.%N)
  env "${vars[@]}" timeout "$limit" "${loader[@]}" "$here/bin/$bin" "$@" >> "$output" 2>&1
  rc=$?
  end=$(date +%s.%N)
  case $rc in
    0) verdict=passed ;;
    77) verdict="skipped ($(grep -m1 -o "SKIP.*" "$output"))" ;;
    124) verdict="TIMED OUT after $limit s"; status=1 ;;
    *) verdict="FAILED (exit $rc)"; status=1 ;;
  esac
  awk -v n="$name" -v v="$verdict" -v a="$start" -v b="$end" \
    'BEGIN { printf "%s: %s in %.1f s\n", n, v, b - a }' >> "$out/summary.txt"
  tar czf "$out/logs.tar.gz" -C "$logs" . 2>/dev/null
}
# test NAME LIMIT_S [VAR=VALUE...] BINARY: a Boost.Test binary, its log in logs.tar.gz.
test_step() {
  local name=$1 limit=$2
  shift 2
  step "$name" "$limit" "$logs/$name.log" "$@" --log_level=test_suite --report_level=short
}
# The kernels against the CPU reference first, then the released dimensions' figures, then the
# forward pass on the device (the layer split among them), then the golden model's speed.
test_step gpu_ops_cuda_test 120 gpu_ops_cuda_test
test_step gpu_scale_add_cuda_test 30 gpu_scale_add_cuda_test
step gpu_bench 150 "$out/gpu_bench.txt" gpu_bench_cuda
test_step backend_equivalence_test 90 backend_equivalence_test
test_step golden_test 60 golden_test
test_step golden_test_matrix 60 FLASHD_TEST_GPU_GEMMS=matrix golden_test
test_step forward_equivalence_test 90 forward_equivalence_test
test_step forward_equivalence_test_matrix 90 FLASHD_TEST_GPU_GEMMS=matrix forward_equivalence_test
test_step dspark_golden_test 60 dspark_golden_test
# The daemon on the device (where the forward pass ran): the tiny model served over the API, then
# a restarted daemon resuming a prompt from the prefix cache exactly. It serves with the exact
# GEMMs, so it waits on golden_test (the forward pass on the device), not on every kernel's test
# (a matrix-core tile failing there leaves the daemon's run informative).
if grep -q "^golden_test: passed" "$out/summary.txt"; then
  test_step cache_e2e_test_cuda 120 FLASHD_BACKEND=cuda FLASHD_TEST_BINARY="$here/bin/flashd" \
    FLASHD_TEST_SOURCE_DIR="$here/.." cache_e2e_test \
    --run_test=cache_e2e/a_restarted_daemon_resumes_exactly
else
  echo "cache_e2e_test_cuda: not run (golden_test did not pass here)" >> "$out/summary.txt"
fi
for run in "cuda" "cuda --launch in-turn" "cuda --uploads waited" "cuda --gpu-gemms matrix" "cpu"; do
  echo "== engine_bench --backend $run" >> "$out/engine_bench.txt"
  # shellcheck disable=SC2086 # the words of $run are separate arguments
  step "engine_bench $run" 60 "$out/engine_bench.txt" engine_bench "$FLASHD_TEST_GOLDEN_DIR" \
    512 4096 --decode-at 65536 --backend $run
done
# Where the toolkit's profiler is on the machine and time is left: the golden model's decode (nine
# steps behind 1,024 tokens) under nsys, into profile.txt: the kernels' summary, and the device's
# time busy against idle between one kernel or copy and the next, in buckets (is a step bound by
# its kernels or by their launches?).
nsys_bin=$(command -v nsys)
for candidate in /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys; do
  [[ -z $nsys_bin && -x $candidate ]] && nsys_bin=$candidate
done
if [[ -z $nsys_bin ]]; then
  echo "profile: not run (no nsys on this machine)" >> "$out/summary.txt"
elif (($(left) < 100)); then
  echo "profile: not run ($(left) s of the deadline left)" >> "$out/summary.txt"
else
  start=$(date +%s)
  {
    timeout 60 "$nsys_bin" profile -t cuda -o "$logs/decode" --force-overwrite true \
      "${loader[@]}" "$here/bin/engine_bench" "$FLASHD_TEST_GOLDEN_DIR" --decode-at 1024 \
      --backend cuda
    echo "== kernels"
    timeout 30 "$nsys_bin" stats -q -r cuda_gpu_kern_sum "$logs/decode.nsys-rep"
    echo "== between kernels and copies"
    timeout 30 "$nsys_bin" stats -q -r cuda_gpu_trace -f csv "$logs/decode.nsys-rep" |
      device_gaps
  } >> "$out/profile.txt" 2>&1
  echo "profile: done in $(($(date +%s) - start)) s (profile.txt)" >> "$out/summary.txt"
fi
echo "total: $(($(date +%s) - begin)) s of a $deadline s deadline" >> "$out/summary.txt"
rm -rf "$logs"
cat "$out/summary.txt"
exit $status
