#!/usr/bin/env bash
# The agent-trace benchmark at its default size, in one command:
#
#   bench/agent_trace/run.sh [BUILD_DIR] [OUT_DIR]
#
# Generates the seeded trace (generate.py), replays it against the daemon of BUILD_DIR (its
# embedded tiny model) with an unbounded cache quota, then at 25% and 10% of the working set
# (the bytes the unbounded run stored) under each eviction policy (cost, lru), and writes
# OUT_DIR/summary.md (the table docs/benchmarks.md carries) and OUT_DIR/hit-rate.png.
# Extra arguments for generate.py go in GENERATE_ARGS, for replay.py in REPLAY_ARGS.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=${1:-build}
out=${2:-agent-trace-out}
binary="$build/bin/flashd"
[[ -x "$binary" ]] || { echo "no $binary: build first (make)" >&2; exit 2; }
mkdir -p "$out"
python3 "$here/generate.py" "$out/trace.jsonl" ${GENERATE_ARGS:-}
python3 "$here/replay.py" "$binary" "$out/trace.jsonl" --out "$out/unbounded" \
  --label unbounded ${REPLAY_ARGS:-} | tail -n 3
working=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['disk_bytes'])" \
  "$out/unbounded/report.json")
for pct in 25 10; do
  quota=$((working * pct / 100))
  for policy in cost lru; do
    python3 "$here/replay.py" "$binary" "$out/trace.jsonl" --out "$out/q$pct-$policy" \
      --quota-bytes "$quota" --eviction "$policy" --check 0 --label "$pct% $policy" \
      ${REPLAY_ARGS:-} | tail -n 3 || true
  done
done
python3 "$here/summarize.py" "$out"
