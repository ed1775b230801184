#!/usr/bin/env python3
"""The agent-trace runs of one OUT_DIR (run.sh) as one table and one plot.

  bench/agent_trace/summarize.py OUT_DIR   -> OUT_DIR/summary.md, OUT_DIR/hit-rate.png
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plot  # noqa: E402


def load_rows(path):
    with open(path) as f:
        return [json.loads(l) for l in f]


def pct(x):
    return "%.1f%%" % (100 * x)


def ms(x):
    return "-" if x is None else "%.0f" % (1000 * x)


def main():
    out = sys.argv[1]
    runs = []
    for name in ("unbounded", "q25-cost", "q25-lru", "q10-cost", "q10-lru"):
        rep = os.path.join(out, name, "report.json")
        if os.path.exists(rep):
            with open(rep) as f:
                runs.append((name, json.load(f)))
    if not runs:
        sys.exit("no report.json under " + out)
    lines = ["| run | quota | hit rate | oracle | ratio | block ratio | replayed | TTFT warm p50/p95/p99 ms | "
             "TTFT cold p50/p95/p99 ms | disk MiB | evictions | misses (requests: tokens) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in runs:
        w, c = r["ttft_warm"], r["ttft_cold"]
        misses = ", ".join("%s %d: %d" % (k, v["requests"], v["tokens"])
                           for k, v in sorted(r["misses"].items())) or "none"
        quota = "unbounded" if name == "unbounded" else "%.1f MiB" % (r["quota_bytes"] / 2**20)
        lines.append("| %s | %s | %s | %s | %s | %s | %s | %s/%s/%s | %s/%s/%s | %.1f | %d | %s |" % (
            r["label"], quota, pct(r["hit_rate"]), pct(r["oracle_hit_rate"]),
            pct(r["ratio_to_oracle"]), pct(r["block_ratio_to_oracle"]),
            pct(r["replayed_fraction"]), ms(w["p50"]), ms(w["p95"]), ms(w["p99"]),
            ms(c["p50"]), ms(c["p95"]), ms(c["p99"]), (r["disk_bytes"] or 0) / 2**20,
            r["evictions"], misses))
    base = dict(runs)["unbounded"] if "unbounded" in dict(runs) else runs[0][1]
    notes = [
        "",
        "%d requests (%d prompt tokens), %s; wall %.0f s for the unbounded run; "
        "volatile strings cost the oracle itself %s of prompt tokens; errors %d; render "
        "mismatches %d; cold-daemon check %d/%d identical." % (
            base["requests"], base["prompt_tokens"], base["trace"], base["wall_seconds"],
            pct(base["volatile_oracle_fraction"]), base["error_count"],
            len(base["render_mismatches"]), base["check"]["identical"],
            base["check"]["compared"]),
    ]
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("\n".join(lines + notes) + "\n")
    print("\n".join(lines + notes))
    first = runs[0]
    rows = load_rows(os.path.join(out, first[0], "requests.jsonl"))
    extra = []
    for name, r in runs[1:]:
        if name.startswith("q"):
            extra.append((r["label"].upper(), load_rows(os.path.join(out, name, "requests.jsonl"))))
    restarts = []
    prev = None
    for r in rows:
        if prev is not None and r.get("phase", 0) != prev:
            restarts.append(r["index"])
        prev = r.get("phase", 0)
    plot.hit_rate_png(os.path.join(out, "hit-rate.png"), rows, restarts, "FLASHD", extra)


if __name__ == "__main__":
    main()
