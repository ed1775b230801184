#!/usr/bin/env python3
"""Replays a coding-agent trace (generate.py's JSONL, or a captured one in the same format) against
a real daemon over its Unix socket, computes the oracle and reports how close the cache came.

  bench/agent_trace/replay.py BUILD/bin/flashd TRACE.jsonl [--model DIR] [--out DIR]
        [--time-scale 500] [--concurrency 4] [--quota-bytes N] [--check 12] [--label NAME]

Each request goes through the API its client speaks (Anthropic Messages, Responses, Chat
Completions), streamed, with the trace's timing divided by --time-scale; a session's requests
run in order (its subagents in between), at most --concurrency at once. The trace's restart
events stop the daemon (SIGTERM) and start it again on the same state directory.

Before each request the prompt it renders to is asked of the daemon (POST /tokenize with the
request body: the same rendering as the route), and again with the trace's volatile strings
blanked. From these the oracle: for each request, the longest prefix (in tokens) shared with any
earlier request of the same tenant, across restarts, with unbounded memory; at most all but the
last token, which is always run.

Report (printed, and DIR/report.json, DIR/requests.jsonl, DIR/hit-rate.png):
  hit rate             restored prompt tokens / prompt tokens (token-weighted), and its ratio to
                       the oracle's; the same counted in whole 64-token blocks
  replayed tokens      tokens run again to rebuild state after a divergence (/metrics)
  TTFT                 p50/p95/p99 for warm requests (>= half the prompt restored) and cold ones
  disk, evictions      the cache's bytes on disk at the end; entries evicted
  misses               requests that got less than the oracle, by reason: restart (the prefix
                       was last stored before a restart), eviction (evictions happened since it
                       was stored), block (the gap is inside one block: only whole blocks and
                       snapshots are restored), other
  volatile             tokens the oracle itself loses to volatile strings (the oracle of the
                       blanked prompts minus the oracle): what moving them after the cacheable
                       prefix could gain
  check                --check N sampled requests answered again by a cold daemon (fresh state,
                       temperature 0): every output must be identical

Uses only the Python standard library.
"""
import argparse
import http.client
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plot  # noqa: E402

KEYS = {}  # tenant -> API key (the daemon's auth.keys)
SESSIONS = {}  # (tenant, trace session) -> (the daemon's session id, its create body)


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path, timeout):
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


class Daemon:
    def __init__(self, binary, model_dir, work, state_dir, quota, tenants, eviction="cost"):
        self.binary, self.model_dir, self.work, self.state_dir = binary, model_dir, work, state_dir
        self.socket = os.path.join(work, "flashd.sock")
        self.quota, self.tenants, self.eviction = quota, tenants, eviction
        self.proc = None
        self.log = open(os.path.join(work, "daemon.log"), "ab")

    def start(self):
        cfg = os.path.join(self.work, "flashd.yaml")
        with open(cfg, "w") as f:
            f.write("server:\n  listen: \"\"\n  pid_file: \"\"\n  shutdown_grace_seconds: 30\n")
            f.write("engine:\n  speculative: off\n")
            f.write("cache:\n  disk_quota_bytes: %d\n  eviction: %s\n" % (self.quota,
                                                                          self.eviction))
            f.write("auth:\n  keys:\n")
            for t in self.tenants:
                f.write("    %s: %s\n" % (t, KEYS[t]))
        env = dict(os.environ, FLASHD_SOCKET=self.socket, FLASHD_STATE_DIR=self.state_dir,
                   FLASHD_MODEL_DIR=self.model_dir, FLASHD_LOG_LEVEL="warn")
        env.pop("FLASHD_LISTEN", None)
        self.proc = subprocess.Popen([self.binary, "serve", "--config", cfg], env=env,
                                     stdout=subprocess.PIPE, stderr=self.log)
        line = self.proc.stdout.readline().decode()
        if "ready:" not in line:
            raise RuntimeError("daemon did not start: " + line + self.tail())
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if self.request("GET", "/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError("model did not load" + self.tail())

    def tail(self):
        self.log.flush()
        with open(self.log.name, "rb") as f:
            return "\n" + f.read()[-2000:].decode(errors="replace")

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=120)
        self.proc = None

    def request(self, method, path, body=None, tenant=None, timeout=600):
        c = UnixConnection(self.socket, timeout)
        headers = {"Content-Type": "application/json"}
        if tenant:
            headers["x-api-key"] = KEYS[tenant]
        c.request(method, path, body=json.dumps(body) if body is not None else None,
                  headers=headers)
        r = c.getresponse()
        data = r.read()
        c.close()
        return r.status, data

    def metrics(self):
        status, data = self.request("GET", "/metrics")
        out = {}
        for line in data.decode().splitlines():
            if line.startswith("#") or " " not in line:
                continue
            name, value = line.rsplit(" ", 1)
            if "{" not in name:
                try:
                    out[name] = float(value)
                except ValueError:
                    pass
        return out

    def session_turn(self, r, sessions):
        """For the sessions API: the daemon's session of trace session `r` (created on its first
        request), and the chat body its next turn renders (system, tools, the conversation the
        daemon keeps, the new messages)."""
        key = (r["tenant"], r["session"])
        if key not in sessions:
            create = r["body"].get("create", {})
            status, data = self.request("POST", "/v1/sessions", create, r["tenant"])
            if status not in (200, 201):
                raise RuntimeError("session create failed: %d %s" % (status, data[:300]))
            sessions[key] = (json.loads(data)["id"], create)
        sid, create = sessions[key]
        status, data = self.request("GET", "/v1/sessions/" + sid, None, r["tenant"])
        if status != 200:
            raise RuntimeError("session read failed: %d %s" % (status, data[:300]))
        got = json.loads(data)
        messages = []
        if got.get("system"):
            messages.append({"role": "system", "content": got["system"]})
        messages += got.get("conversation", []) + r["body"]["messages"]
        chat = {"model": "deepseek-v4.1-flash", "messages": messages}
        if create.get("tools"):
            chat["tools"] = create["tools"]
        turn = {k: v for k, v in r["body"].items() if k != "create"}
        return sid, chat, turn

    def render(self, api, body, tenant):
        if api == "completions" and isinstance(body.get("prompt"), list):
            return body["prompt"]  # Token ids: the prompt as sent.
        status, data = self.request("POST", "/tokenize", {"api": api, "request": body}, tenant)
        if status != 200:
            raise RuntimeError("render failed: %d %s" % (status, data[:300]))
        return json.loads(data)["tokens"]

    def stream(self, api, body, tenant, path=None):
        """Sends a streamed request; returns (ttft seconds, prompt, cached, output signature)."""
        path = path or {"messages": "/v1/messages", "responses": "/v1/responses",
                        "chat.completions": "/v1/chat/completions",
                        "completions": "/v1/completions"}[api]
        c = UnixConnection(self.socket, 600)
        t0 = time.monotonic()
        c.request("POST", path, body=json.dumps(body),
                  headers={"Content-Type": "application/json", "x-api-key": KEYS[tenant],
                           "anthropic-version": "2023-06-01"})
        r = c.getresponse()
        if r.status != 200:
            data = r.read()
            c.close()
            raise RuntimeError("%s answered %d: %s" % (path, r.status, data[:300]))
        ttft, prompt, cached, out = None, None, None, []
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            e = json.loads(payload)
            deltas = delta_strings(e)
            if deltas and ttft is None:
                ttft = time.monotonic() - t0
            out += deltas
            u = usage_of(api, e)
            if u:
                prompt, cached = u
        c.close()
        if ttft is None:
            ttft = time.monotonic() - t0
        return ttft, prompt, cached, "".join(out)


def delta_strings(e):
    """The generated text an event carries (ids left out: they differ between runs)."""
    out = []

    def walk(v, key):
        if isinstance(v, str):
            if key not in ("id", "call_id", "item_id", "type", "object", "role", "stop_reason",
                           "stop_sequence"):
                out.append(v)
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(x, k)
        elif isinstance(v, list):
            for x in v:
                walk(x, key)

    if isinstance(e, dict):
        if "delta" in e:
            walk(e["delta"], "delta")
        for ch in e.get("choices") or []:
            if isinstance(ch, dict) and "delta" in ch:
                walk(ch["delta"], "delta")
            if isinstance(ch, dict) and isinstance(ch.get("text"), str) and ch["text"]:
                out.append(ch["text"])
    return out


def usage_of(api, e):
    if api == "messages":
        if e.get("type") == "message_start":
            u = e["message"]["usage"]
            cached = u.get("cache_read_input_tokens", 0)
            return u["input_tokens"] + cached, cached
    elif api == "responses":
        if e.get("type") in ("response.completed", "response.incomplete"):
            u = e["response"]["usage"]
            return u["input_tokens"], u.get("input_tokens_details", {}).get("cached_tokens", 0)
    elif e.get("usage"):
        u = e["usage"]
        return u["prompt_tokens"], u.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return None


def blank(v, strings):
    if isinstance(v, str):
        for s in strings:
            if s:
                v = v.replace(s, "")
        return v
    if isinstance(v, dict):
        return {k: blank(x, strings) for k, x in v.items()}
    if isinstance(v, list):
        return [blank(x, strings) for x in v]
    return v


class Oracle:
    """Longest shared prefix with any earlier prompt of the tenant, unbounded memory."""

    def __init__(self, block):
        self.block = block
        self.chains = {}  # (tenant, hash of the first k blocks) -> set of next-block tuples

    def lookup(self, tenant, tokens):
        B, h, best = self.block, 0, 0
        k = 0
        while True:
            nexts = self.chains.get((tenant, k, h))
            if not nexts:
                return best
            blk = tuple(tokens[k * B:(k + 1) * B])
            if len(blk) == B and blk in nexts:
                k += 1
                h = hash((h, blk))
                best = k * B
                continue
            # Partial match inside the next block: the longest common start with any candidate.
            for cand in nexts:
                n = 0
                while n < len(blk) and n < len(cand) and blk[n] == cand[n]:
                    n += 1
                best = max(best, k * B + n)
            return best

    def add(self, tenant, tokens):
        B, h = self.block, 0
        for k in range((len(tokens) + B - 1) // B):
            blk = tuple(tokens[k * B:(k + 1) * B])
            self.chains.setdefault((tenant, k, h), set()).add(blk)
            if len(blk) < B:
                break
            h = hash((h, blk))

    def hit(self, tenant, tokens):
        return min(self.lookup(tenant, tokens), max(0, len(tokens) - 1))


def percentile(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100.0 * (len(xs) - 1))))]


def load(path):
    meta, reqs = {}, []
    with open(path) as f:
        for i, line in enumerate(f):
            x = json.loads(line)
            if "meta" in x:
                meta = x["meta"]
                continue
            x["index"] = len(reqs)
            reqs.append(x)
    return meta, reqs


def root_of(session):
    return session.split("-sub")[0]


def run_phase(d, reqs, args, t_base, wall0, results, lock, errors, phase=0):
    """Runs `reqs` (no restart among them): one thread per root session, bounded concurrency."""
    by_root = {}
    for r in reqs:
        by_root.setdefault((r["tenant"], root_of(r["session"])), []).append(r)
    slots = threading.Semaphore(args.concurrency)
    sessions = SESSIONS

    def worker(items):
        for r in items:
            due = wall0 + (r["t"] - t_base) / args.time_scale
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            with slots:
                try:
                    api, body, path = r["api"], r["body"], None
                    if api == "sessions":
                        sid, chat, body = d.session_turn(r, sessions)
                        tokens = d.render("chat.completions", chat, r["tenant"])
                        path = "/v1/sessions/%s/turns" % sid
                    else:
                        tokens = d.render(api, body, r["tenant"])
                    vol = r.get("volatile") or []
                    blanked = d.render(api, blank(body, vol), r["tenant"]) if vol else tokens
                    start = time.monotonic()
                    ttft, prompt, cached, out = d.stream(api, body, r["tenant"], path)
                    if prompt is None or cached is None:
                        raise RuntimeError("the stream carried no usage")
                    res = {"index": r["index"], "t": r["t"], "tenant": r["tenant"],
                           "session": r["session"], "api": r["api"], "prompt": prompt,
                           "rendered": len(tokens), "cached": cached, "ttft": ttft,
                           "sent": start - wall0, "output": out, "tokens": tokens,
                           "phase": phase,
                           "blanked": blanked}
                except Exception as e:  # noqa: BLE001 - reported, the run goes on
                    with lock:
                        errors.append("request %d (%s): %s" % (r["index"], r["api"], e))
                    continue
            with lock:
                results[r["index"]] = res

    threads = [threading.Thread(target=worker, args=(items,)) for items in by_root.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("binary")
    p.add_argument("trace")
    p.add_argument("--model", default="",
                   help="model directory; the default is the daemon's embedded tiny model")
    p.add_argument("--out", default="agent-trace-out")
    p.add_argument("--time-scale", type=float, default=500.0)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--quota-bytes", type=int, default=64 << 30)
    p.add_argument("--eviction", choices=["lru", "cost"], default="lru")
    p.add_argument("--check", type=int, default=12)
    p.add_argument("--label", default="flashd")
    p.add_argument("--keep", action="store_true", help="keep the state directory")
    args = p.parse_args()

    meta, reqs = load(args.trace)
    tenants = sorted({r["tenant"] for r in reqs if "tenant" in r})
    for t in tenants:
        KEYS[t] = "key-%s-%s" % (t, "0123456789abcdef")
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="agent-trace-")
    state = os.path.join(work, "state")
    d = Daemon(args.binary, args.model, work, state, args.quota_bytes, tenants, args.eviction)
    d.start()
    block = int(json.loads(d.request("GET", "/v1/cache")[1]).get("block_tokens", 64))

    phases, cur = [], []
    for r in reqs:
        if r.get("event") == "restart":
            phases.append(cur)
            cur = []
        elif "body" in r:
            cur.append(r)
    phases.append(cur)

    results, lock, errors = {}, threading.Lock(), []
    totals = {"replayed": 0.0, "evictions": 0.0, "hit": 0.0, "miss": 0.0}
    restarts_at = []  # Trace index of the first request after each restart.
    wall0 = time.monotonic()
    t_base = reqs[0]["t"] if reqs else 0
    for i, phase in enumerate(phases):
        if i > 0:
            m = d.metrics()
            totals["replayed"] += m.get("flashd_prefix_cache_replayed_tokens_total", 0)
            totals["evictions"] += m.get("flashd_prefix_cache_evictions_total", 0)
            d.stop()
            d.start()
            if phase:
                restarts_at.append(phase[0]["index"])
        run_phase(d, phase, args, t_base, wall0, results, lock, errors, i)
        print("phase %d: %d requests, %.0f s" % (i, len(phase), time.monotonic() - wall0),
              flush=True)
    m = d.metrics()
    totals["replayed"] += m.get("flashd_prefix_cache_replayed_tokens_total", 0)
    totals["evictions"] += m.get("flashd_prefix_cache_evictions_total", 0)
    status, cache = d.request("GET", "/v1/cache")
    cache = json.loads(cache) if status == 200 else {}
    wall = time.monotonic() - wall0
    d.stop()

    # The oracle, in the trace's order.
    oracle, oracle_blanked = Oracle(block), Oracle(block)
    rows = []
    for idx in sorted(results):
        r = results[idx]
        o = oracle.hit(r["tenant"], r["tokens"])
        ob = oracle_blanked.hit(r["tenant"], r["blanked"])
        oracle.add(r["tenant"], r["tokens"])
        oracle_blanked.add(r["tenant"], r["blanked"])
        r["oracle"], r["oracle_blanked"] = o, ob
        rows.append(r)

    # Why a request got less than the oracle.
    evict_total = totals["evictions"]
    for r in rows:
        gap = r["oracle"] - r["cached"]
        r["reason"] = ""
        if gap <= 0:
            continue
        after = [k for k in restarts_at if k <= r["index"]]
        if r["oracle"] // block == r["cached"] // block or gap < block:
            r["reason"] = "block"
        elif after and not any(x["index"] >= after[-1] and x["index"] < r["index"] and
                               x["tenant"] == r["tenant"] and
                               x["tokens"][:r["oracle"]] == r["tokens"][:r["oracle"]]
                               for x in rows):
            r["reason"] = "restart"
        elif evict_total > 0:
            r["reason"] = "eviction"
        else:
            r["reason"] = "other"

    prompt = sum(r["prompt"] for r in rows)
    cached = sum(r["cached"] for r in rows)
    orc = sum(r["oracle"] for r in rows)
    # What the oracle itself loses to volatile strings: where the prompts without them share
    # more than the prompts with them.
    volatile_loss = sum(max(0, r["oracle_blanked"] - r["oracle"]) for r in rows)
    cached_blocks = sum(r["cached"] // block for r in rows)
    oracle_blocks = sum(r["oracle"] // block for r in rows)
    prompt_blocks = sum(r["prompt"] // block for r in rows)
    warm = [r["ttft"] for r in rows if r["cached"] * 2 >= r["prompt"]]
    cold = [r["ttft"] for r in rows if r["cached"] * 2 < r["prompt"]]
    reasons = {}
    for r in rows:
        if r["reason"]:
            x = reasons.setdefault(r["reason"], {"requests": 0, "tokens": 0})
            x["requests"] += 1
            x["tokens"] += r["oracle"] - r["cached"]
    mismatched = [r["index"] for r in rows if r["prompt"] != r["rendered"]]

    check = {"requested": args.check, "compared": 0, "identical": 0, "different": []}
    if args.check > 0 and rows:
        # Sessions-API turns are left out: their conversation lives in the warm daemon.
        stateless = [r for r in rows if r["api"] != "sessions"]
        sample = random.Random(7).sample(stateless, min(args.check, len(stateless)))
        cold_work = tempfile.mkdtemp(prefix="agent-trace-cold-")
        cd = Daemon(args.binary, args.model, cold_work, os.path.join(cold_work, "state"),
                    args.quota_bytes, tenants)
        cd.start()
        for r in sample:
            src = reqs[r["index"]]
            try:
                _, _, c0, out = cd.stream(src["api"], src["body"], src["tenant"])
            except Exception as e:  # noqa: BLE001
                check["different"].append({"index": r["index"], "error": str(e)})
                continue
            check["compared"] += 1
            if out == r["output"]:
                check["identical"] += 1
            else:
                check["different"].append({"index": r["index"], "warm": r["output"][:200],
                                           "cold": out[:200]})
        cd.stop()
        shutil.rmtree(cold_work, ignore_errors=True)

    report = {
        "label": args.label, "trace": os.path.basename(args.trace), "meta": meta,
        "requests": len(rows), "errors": errors[:20], "error_count": len(errors),
        "wall_seconds": round(wall, 1), "time_scale": args.time_scale,
        "concurrency": args.concurrency, "quota_bytes": args.quota_bytes,
        "eviction": args.eviction,
        "prompt_tokens": prompt, "cached_tokens": cached, "oracle_tokens": orc,
        "hit_rate": cached / prompt if prompt else 0, "oracle_hit_rate": orc / prompt if prompt else 0,
        "ratio_to_oracle": cached / orc if orc else 0,
        "block_hit_rate": cached_blocks / prompt_blocks if prompt_blocks else 0,
        "block_oracle_hit_rate": oracle_blocks / prompt_blocks if prompt_blocks else 0,
        "block_ratio_to_oracle": cached_blocks / oracle_blocks if oracle_blocks else 0,
        "replayed_tokens": int(totals["replayed"]),
        "replayed_fraction": totals["replayed"] / prompt if prompt else 0,
        "volatile_oracle_tokens": volatile_loss,
        "volatile_oracle_fraction": volatile_loss / prompt if prompt else 0,
        "ttft_warm": {"n": len(warm), "p50": percentile(warm, 50), "p95": percentile(warm, 95),
                      "p99": percentile(warm, 99)},
        "ttft_cold": {"n": len(cold), "p50": percentile(cold, 50), "p95": percentile(cold, 95),
                      "p99": percentile(cold, 99)},
        "disk_bytes": cache.get("disk_bytes"), "evictions": int(totals["evictions"]),
        "misses": reasons, "render_mismatches": mismatched[:20], "check": check,
    }
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(args.out, "requests.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps({k: r[k] for k in ("index", "t", "tenant", "session", "api",
                                                  "prompt", "cached", "oracle", "oracle_blanked",
                                                  "ttft", "reason", "phase")}) + "\n")
    plot.hit_rate_png(os.path.join(args.out, "hit-rate.png"), rows, restarts_at, args.label)
    print(json.dumps({k: v for k, v in report.items() if k not in ("meta",)}, indent=1))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    ok = not errors and not mismatched and not check["different"]
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
