#!/usr/bin/env bash
# Runs every libFuzzer target of tests/fuzz for a bounded time against its seed corpus, with
# AddressSanitizer and UndefinedBehaviorSanitizer. New inputs the fuzzer finds go to a scratch
# corpus under the build dir (the committed seeds stay as they are); a crash or sanitizer report
# stops the run, names the target and leaves the input under BUILD/fuzz/findings.
# Usage: tests/fuzz/run.sh BUILD_DIR [SECONDS_PER_TARGET] [TARGET...]
set -euo pipefail
build="${1:?usage: run.sh BUILD_DIR [SECONDS] [TARGET...]}"
seconds="${2:-60}"
shift $(( $# >= 2 ? 2 : 1 ))
here="$(cd "$(dirname "$0")" && pwd)"
targets=("$@")
if [[ ${#targets[@]} -eq 0 ]]; then
  for c in "$here"/corpus/*/; do targets+=("$(basename "$c")"); done
fi
mkdir -p "$build/fuzz/findings"
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
failed=()
for t in "${targets[@]}"; do
  bin="$build/fuzz/$t"
  [[ -x "$bin" ]] || { echo "fuzz: $bin is missing (build the 'fuzzers' target)" >&2; exit 2; }
  work="$build/fuzz/corpus/$t"
  mkdir -p "$work"
  echo "fuzz: $t for ${seconds}s"
  if "$bin" -max_total_time="$seconds" -max_len=65536 -timeout=30 -rss_limit_mb=4096 \
      -artifact_prefix="$build/fuzz/findings/$t-" -print_final_stats=1 \
      "$work" "$here/corpus/$t" > "$build/fuzz/$t.log" 2>&1; then
    grep -E "^stat::number_of_executed_units|^stat::new_units_added" "$build/fuzz/$t.log" |
      sed "s/^/fuzz: $t /"
  else
    echo "fuzz: $t FOUND A PROBLEM; see $build/fuzz/$t.log and $build/fuzz/findings/" >&2
    tail -30 "$build/fuzz/$t.log" >&2
    failed+=("$t")
  fi
done
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "fuzz: findings in: ${failed[*]}" >&2
  exit 1
fi
echo "fuzz: ${#targets[@]} targets ran ${seconds}s each without a finding"
