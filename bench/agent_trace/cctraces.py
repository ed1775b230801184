#!/usr/bin/env python3
"""Turns a block-hash trace (the published cc-traces / Mooncake shape) into a replayable trace.

  bench/agent_trace/cctraces.py IN.jsonl OUT.jsonl [--block-tokens 64] [--max-requests N]
                                [--tenant-key session_id]

Input: one request per line with
  timestamp       arrival, in milliseconds (or "t" in seconds)
  input_length    prompt tokens
  output_length   generated tokens
  hash_ids        one id per --block-tokens block of the prompt; equal ids mean equal blocks
                  (and, as hashes of chained blocks, equal prefixes)
  session_id      optional (also "conversation_id"), kept as the session
  tenant          optional; else --tenant-key's value, else "default"

Output: generate.py's format with api "completions" and the prompt as token ids, so the daemon
sees exactly the trace's sharing structure: block h is --block-tokens token ids drawn from a
generator seeded by h (the last block of a prompt is cut to its length), the same ids wherever
h appears. With --block-tokens equal to the daemon's cache.block_tokens (64 by default), the
trace's blocks are the cache's blocks.
"""
import argparse
import json
import random

# Ordinary token ids of DeepSeek's V4 vocabulary (no added or special tokens among them).
LOW, HIGH = 1000, 100000


def block(h, n):
    rng = random.Random(0x5EED0000 ^ int(h))
    return [rng.randrange(LOW, HIGH) for _ in range(n)]


def convert(lines, block_tokens, max_requests, tenant_key):
    out = []
    for i, x in enumerate(lines):
        if max_requests and len(out) >= max_requests:
            break
        if "hash_ids" not in x or "input_length" not in x:
            raise ValueError("line %d: needs hash_ids and input_length" % (i + 1))
        n = int(x["input_length"])
        ids = x["hash_ids"]
        if not ids or n <= 0:
            continue
        prompt = []
        for k, h in enumerate(ids):
            take = min(block_tokens, n - k * block_tokens)
            if take <= 0:
                break
            prompt += block(h, take)
        t = x["t"] if "t" in x else x.get("timestamp", 0) / 1000.0
        session = str(x.get("session_id", x.get("conversation_id", "r%d" % i)))
        tenant = str(x.get("tenant", x.get(tenant_key, "default")))
        body = {"model": "deepseek-v4.1-flash", "prompt": prompt,
                "max_tokens": max(1, int(x.get("output_length", 1))), "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        out.append({"t": t, "tenant": tenant, "session": session, "client": "cc-traces",
                    "api": "completions", "body": body, "volatile": []})
    out.sort(key=lambda r: r["t"])
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("inp")
    p.add_argument("out")
    p.add_argument("--block-tokens", type=int, default=64)
    p.add_argument("--max-requests", type=int, default=0)
    p.add_argument("--max-output", type=int, default=8,
                   help="cap on generated tokens per request (the cache is about prompts)")
    p.add_argument("--tenant-key", default="tenant")
    args = p.parse_args()
    with open(args.inp) as f:
        lines = [json.loads(l) for l in f if l.strip()]
    reqs = convert(lines, args.block_tokens, args.max_requests, args.tenant_key)
    for r in reqs:
        r["body"]["max_tokens"] = min(r["body"]["max_tokens"], args.max_output)
    with open(args.out, "w") as f:
        f.write(json.dumps({"meta": {"generator": "bench/agent_trace/cctraces.py",
                                     "source": args.inp, "block_tokens": args.block_tokens,
                                     "requests": len(reqs)}}) + "\n")
        for r in reqs:
            f.write(json.dumps(r) + "\n")
    print("%d requests -> %s" % (len(reqs), args.out))


if __name__ == "__main__":
    main()
