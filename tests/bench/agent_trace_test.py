#!/usr/bin/env python3
"""The agent-trace benchmark's own logic, without a daemon: the generator is deterministic and
follows the published shape it claims, the oracle equals a brute-force longest shared prefix,
the block-hash reader keeps the trace's sharing structure, and the plot is a valid PNG.

  tests/bench/agent_trace_test.py BENCH_DIR
"""
import json
import os
import random
import struct
import subprocess
import sys
import tempfile
import zlib

bench = os.path.abspath(sys.argv[1])
sys.path.insert(0, bench)
import cctraces  # noqa: E402
import plot  # noqa: E402
import replay  # noqa: E402


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print("ok:", what)


work = tempfile.mkdtemp()

# The generator: same seed, same bytes; another seed, another trace.
a, b, c = (os.path.join(work, n) for n in ("a.jsonl", "b.jsonl", "c.jsonl"))
for path, seed in ((a, 5), (b, 5), (c, 6)):
    subprocess.run([sys.executable, os.path.join(bench, "generate.py"), path, "--seed", str(seed),
                    "--sessions", "6", "--scale", "0.05"], check=True, stdout=subprocess.DEVNULL)
check(open(a, "rb").read() == open(b, "rb").read(), "a seed gives the same trace")
check(open(a, "rb").read() != open(c, "rb").read(), "another seed gives another trace")

meta, reqs = replay.load(a)
bodies = [r for r in reqs if "body" in r]
restarts = [r for r in reqs if r.get("event") == "restart"]
check(meta["requests"] == len(bodies), "the meta line counts the requests")
check(len(restarts) == 1 and 0 < reqs.index(restarts[0]) < len(reqs) - 1,
      "one restart, inside the trace")
check(all(x["t"] <= y["t"] for x, y in zip(reqs, reqs[1:])), "lines in arrival order")
roots = {}
for r in bodies:
    if "-sub" not in r["session"]:
        # A compaction's summary request comes on top of the session's own.
        own = "This session continues" not in json.dumps(r["body"]["messages" if "messages" in
                                                                 r["body"] else "input"][-1:])
        roots[r["session"]] = roots.get(r["session"], 0) + own
check(all(20 <= n <= 150 for n in roots.values()),
      "every session has 20-150 requests besides compactions: %s" % sorted(roots.values()))
check({r["api"] for r in bodies} <= {"messages", "responses", "chat.completions"},
      "three client shapes on their APIs")
check(any("-sub" in r["session"] for r in bodies), "subagents appear")
subs = [r for r in bodies if "-sub" in r["session"]]
parent = {r["session"]: r for r in bodies if "-sub" not in r["session"]}
check(all(json.dumps(r["body"].get("tools")) == json.dumps(parent[r["session"].split("-sub")[0]]
                                                           ["body"].get("tools")) for r in subs),
      "a subagent has its parent's tools")
compacted = [r for r in bodies if "This session continues" in json.dumps(r["body"])]
check(compacted, "compaction rewrites a session's history")
# Sessions of one client version share the system prompt and tools exactly.
by_client = {}
for r in bodies:
    body = r["body"]
    key = json.dumps([body.get("tools"), body.get("instructions")])
    by_client.setdefault(r["client"], set()).add(key)
check(all(len(v) == 1 for v in by_client.values()), "one system prompt and tool set per client")
# Claude Code requests carry a billing header that changes per request, and the volatile list
# names every such string so a replayer can blank it.
cc = [r for r in bodies if r["api"] == "messages"]
if cc:
    headers = {r["body"]["system"][0]["text"] for r in cc}
    check(len(headers) == len(cc), "a new billing header on every Claude Code request")
    check(all(r["body"]["system"][0]["text"] in r["volatile"] for r in cc),
          "the volatile list names the billing header")
# Tool results pair with earlier calls (the APIs refuse orphans).
for r in bodies:
    if r["api"] == "chat.completions":
        ids = set()
        for m in r["body"]["messages"]:
            for call in m.get("tool_calls", []):
                ids.add(call["id"])
            if m["role"] == "tool":
                assert m["tool_call_id"] in ids, "a tool message without its call"
check(True, "every chat tool result follows its call")

# The oracle against brute force on random prompts with shared prefixes.
rng = random.Random(3)
prompts = []
for i in range(120):
    if prompts and rng.random() < 0.7:
        base = rng.choice(prompts)[1]
        cut = rng.randint(0, len(base))
        p = base[:cut] + [rng.randint(0, 9) for _ in range(rng.randint(1, 200))]
    else:
        p = [rng.randint(0, 9) for _ in range(rng.randint(1, 300))]
    prompts.append((rng.choice(["t1", "t2"]), p))
oracle = replay.Oracle(16)
mismatch = 0
for k, (tenant, p) in enumerate(prompts):
    best = 0
    for t2, q in prompts[:k]:
        if t2 != tenant:
            continue
        n = 0
        while n < len(p) and n < len(q) and p[n] == q[n]:
            n += 1
        best = max(best, n)
    want = min(best, max(0, len(p) - 1))
    mismatch += oracle.hit(tenant, p) != want
    oracle.add(tenant, p)
check(mismatch == 0, "the oracle equals the brute-force longest shared prefix (120 prompts)")

# The block-hash reader: equal hash ids give equal blocks, different ones different blocks, and
# the last block is cut to the prompt's length.
src = os.path.join(work, "cc.jsonl")
with open(src, "w") as f:
    f.write(json.dumps({"timestamp": 2000, "input_length": 150, "output_length": 30,
                        "hash_ids": [1, 2, 3], "session_id": "x"}) + "\n")
    f.write(json.dumps({"timestamp": 1000, "input_length": 140, "output_length": 5,
                        "hash_ids": [1, 2, 9]}) + "\n")
lines = [json.loads(l) for l in open(src)]
out = cctraces.convert(lines, 64, 0, "tenant")
check([r["t"] for r in out] == [1.0, 2.0], "converted requests in arrival order")
p1, p2 = out[1]["body"]["prompt"], out[0]["body"]["prompt"]
check(len(p1) == 150 and len(p2) == 140, "prompt lengths follow input_length")
check(p1[:128] == p2[:128] and p1[128:140] != p2[128:140], "shared hash ids, shared blocks")
check(all(1000 <= t < 100000 for t in p1), "ordinary token ids only")

# The plot: a PNG whose chunks check out.
rows = [{"index": i, "prompt": 100, "cached": min(90, i), "oracle": 95} for i in range(80)]
png = os.path.join(work, "p.png")
plot.hit_rate_png(png, rows, [40], "flashd", [("lru", rows)])
data = open(png, "rb").read()
check(data[:8] == b"\x89PNG\r\n\x1a\n", "PNG signature")
pos, kinds, idat = 8, [], b""
while pos < len(data):
    n = struct.unpack(">I", data[pos:pos + 4])[0]
    kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
    crc = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])[0]
    assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, "bad chunk CRC"
    kinds.append(kind)
    if kind == b"IDAT":
        idat += body
    pos += 12 + n
check(kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and b"IDAT" in kinds, "PNG chunks valid")
w, h = struct.unpack(">II", data[16:24])
raw = zlib.decompress(idat)
check(len(raw) == h * (1 + 3 * w), "the image data fills %dx%d RGB" % (w, h))
check(bytes((220, 60, 40)) in raw and bytes((40, 40, 40)) in raw, "both lines drawn")
print("all agent-trace checks passed")
