#!/usr/bin/env python3
"""A bounded soak of the real daemon: concurrent sessions, fuzzed traffic, kill -9 rounds and a
filling disk, for a fixed time, then the counts: requests, crashes, lost turns, corrupt answers.

  bench/soak/soak.py BUILD/bin/flashd MODEL_DIR [--minutes 60] [--sessions 4] [--kill-every 45]

Uses only the Python standard library. Listens on loopback only. The state dir sits on a small
tmpfs when this process may mount one (root), so the disk really fills; otherwise on a temporary
directory, and the disk-filling part is skipped (said in the report).

What is counted:
  requests        every request sent, by kind (turn, probe, fuzz, admin)
  crashes         daemon exits the soak did not cause (its kill -9 rounds excluded)
  lost turns      session turns answered 200 (committed) that a later read of the session lacks
  corrupt answers probe completions (temperature 0, cached or not) that differ from the answers
                  a fresh daemon gave to the same prompts at the start
"""
import argparse
import http.client
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time


class Daemon:
    def __init__(self, binary, model_dir, work, state_dir):
        self.binary, self.model_dir, self.work, self.state_dir = binary, model_dir, work, state_dir
        self.proc = None
        self.port = None
        self.socket = os.path.join(work, "flashd.sock")
        self.log = open(os.path.join(work, "daemon.log"), "ab")

    def start(self):
        cfg = os.path.join(self.work, "flashd.yaml")
        with open(cfg, "w") as f:
            f.write("server:\n  shutdown_grace_seconds: 2\n  pid_file: \"\"\n"
                    "cache:\n  disk_quota_bytes: 64MiB\n")
        env = dict(os.environ, FLASHD_LISTEN="127.0.0.1:0", FLASHD_SOCKET=self.socket,
                   FLASHD_STATE_DIR=self.state_dir, FLASHD_MODEL_DIR=self.model_dir,
                   FLASHD_LOG_LEVEL="warn")
        self.proc = subprocess.Popen([self.binary, "serve", "--config", cfg], env=env,
                                     stdout=subprocess.PIPE, stderr=self.log)
        line = self.proc.stdout.readline().decode()
        if "ready:" not in line:
            raise RuntimeError("daemon did not start: " + line)
        self.port = int(line.split("http://127.0.0.1:")[1].split()[0])
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                status, _ = self.request("GET", "/health", timeout=5)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError("daemon not healthy")

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def kill9(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self):
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill9()

    def request(self, method, path, body=None, timeout=120, headers=None, raw=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            h = {"Content-Type": "application/json"}
            h.update(headers or {})
            data = raw if raw is not None else (json.dumps(body) if body is not None else None)
            conn.request(method, path, body=data, headers=h)
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()


class Counts:
    def __init__(self):
        self.lock = threading.Lock()
        self.c = {}

    def add(self, key, n=1):
        with self.lock:
            self.c[key] = self.c.get(key, 0) + n


def probe(d, prompt):
    status, body = d.request("POST", "/v1/completions",
                             {"prompt": prompt, "max_tokens": 6, "temperature": 0,
                              "logprobs": 1, "ignore_eos": True})
    if status != 200:
        return None
    j = json.loads(body)
    return (j["choices"][0]["text"], json.dumps(j["choices"][0]["logprobs"]))


def fuzz_request(rng):
    """One malformed or hostile request: random bytes, broken JSON, deep nesting, bad UTF-8,
    wrong types, odd paths and headers."""
    paths = ["/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/sessions",
             "/v1/completions", "/tokenize", "/v1/cache/pins", "/v1/sessions/%ff/turns",
             "/v1/models/%c3%28", "/metrics", "/v1/cache"]
    path = rng.choice(paths)
    kind = rng.randrange(7)
    if kind == 0:
        raw = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400)))
    elif kind == 1:
        raw = b'{"messages":' + b"[" * rng.randrange(100, 5000) + b"]"
    elif kind == 2:
        raw = b'{"messages":[{"role":"user","content":"\xff\xfe' + os.urandom(8) + b'"}]}'
    elif kind == 3:
        raw = json.dumps({"messages": [{"role": rng.choice(["user", 5, None]),
                                        "content": rng.choice(["x", 1e308, [], {"a": 1}])}],
                          "max_tokens": rng.choice([1, -1, "x", 1e999 if False else 10**30]),
                          "thinking": rng.choice([{"type": 5}, "on", None]),
                          "text": {"format": {"type": rng.choice([[], "json_schema", 3])}},
                          "tools": rng.choice([[{"type": "function"}], "x", [1]])}).encode()
    elif kind == 4:
        raw = b'{"temperature": 1e999, "messages": []}'
    elif kind == 5:
        valid = json.dumps({"model": "m", "max_tokens": 2,
                            "messages": [{"role": "user", "content": "hi"}]}).encode()
        cut = rng.randrange(len(valid))
        raw = valid[:cut] + bytes([rng.randrange(256)]) + valid[cut + 1:]
    else:
        raw = b"{}"
    headers = {}
    if rng.random() < 0.2:
        headers["Host"] = "evil.example"
    if rng.random() < 0.2:
        headers["Content-Type"] = "text/plain"
    if rng.random() < 0.1:
        headers["Range"] = "bytes=0-3"
    return rng.choice(["POST", "POST", "GET", "DELETE"]), path, raw, headers


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("binary")
    ap.add_argument("model_dir")
    ap.add_argument("--minutes", type=float, default=60)
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--kill-every", type=float, default=45, help="seconds between kill -9 rounds")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    work = tempfile.mkdtemp(prefix="flashd-soak-")
    disk = os.path.join(work, "disk")
    os.makedirs(disk)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", disk],
                             capture_output=True).returncode == 0
    state = os.path.join(disk, "state")
    rng = random.Random(args.seed)
    counts = Counts()
    d = Daemon(args.binary, args.model_dir, work, state)

    # Reference answers from a fresh daemon (its own state dir, removed after).
    probes = [[rng.randrange(3, 390) for _ in range(rng.choice([80, 300, 700]))] for _ in range(6)]
    ref_state = os.path.join(work, "reference-state")
    ref = Daemon(args.binary, args.model_dir, work, ref_state)
    ref.socket = os.path.join(work, "ref.sock")
    ref.start()
    reference = [probe(ref, p) for p in probes]
    ref.stop()
    shutil.rmtree(ref_state, ignore_errors=True)
    assert all(reference), "the reference daemon did not answer the probes"

    d.start()
    stop = threading.Event()
    sessions = {}  # id -> turns committed (user message texts)
    sessions_lock = threading.Lock()
    restarting = threading.Lock()  # held while the daemon is being killed and restarted

    def session_worker(w):
        wrng = random.Random(args.seed * 100 + w)
        sid = None
        n = 0
        while not stop.is_set():
            try:
                with restarting:
                    pass
                if sid is None:
                    status, body = d.request("POST", "/v1/sessions",
                                             {"system": "You are agent %d." % w,
                                              "settings": {"max_tokens": 4, "temperature": 0}})
                    counts.add("requests.admin")
                    if status == 201:
                        sid = json.loads(body)["id"]
                        with sessions_lock:
                            sessions[sid] = []
                    continue
                text = "worker %d step %d %s" % (w, n, "x" * wrng.randrange(0, 200))
                status, body = d.request("POST", "/v1/sessions/%s/turns" % sid,
                                         {"messages": [{"role": "user", "content": text}],
                                          "stream": wrng.random() < 0.3})
                counts.add("requests.turn")
                counts.add("status.turn.%d" % status)
                # A reply that could not be saved ends in an error (the status went out first).
                saved = status == 200 and b'data: {"error"' not in body
                if saved and not body.lstrip().startswith(b"data:"):
                    saved = "error" not in json.loads(body)
                if status == 200 and not saved:
                    counts.add("turn_not_saved")
                if saved:
                    with sessions_lock:
                        sessions[sid].append(text)
                n += 1
            except (OSError, http.client.HTTPException):
                counts.add("connection_errors")
                time.sleep(0.2)

    def fuzz_worker():
        frng = random.Random(args.seed + 7)
        while not stop.is_set():
            method, path, raw, headers = fuzz_request(frng)
            try:
                status, _ = d.request(method, path, raw=raw, headers=headers, timeout=30)
                counts.add("requests.fuzz")
                counts.add("status.fuzz.%d" % status)
                # 503 (not ready) and 507 (the disk is full) are the daemon telling the truth.
                if status >= 500 and status not in (503, 507):
                    counts.add("fuzz_5xx")
            except (OSError, http.client.HTTPException):
                counts.add("connection_errors")
                time.sleep(0.1)

    def disk_filler():
        if not mounted:
            return
        frng = random.Random(args.seed + 11)
        while not stop.wait(frng.uniform(20, 40)):
            filler = os.path.join(disk, "filler")
            try:
                with open(filler, "wb") as f:
                    while True:
                        f.write(b"\0" * (1 << 20))
            except OSError:
                counts.add("disk_filled")
            stop.wait(frng.uniform(3, 8))
            try:
                os.remove(filler)
            except OSError:
                pass

    threads = [threading.Thread(target=session_worker, args=(w,)) for w in range(args.sessions)]
    threads += [threading.Thread(target=fuzz_worker), threading.Thread(target=disk_filler)]
    for t in threads:
        t.start()

    end = time.time() + args.minutes * 60
    next_kill = time.time() + args.kill_every
    lost = corrupt = crashes = rounds = 0
    try:
        while time.time() < end:
            time.sleep(1)
            if not d.alive():
                crashes += 1
                with restarting:
                    d.start()
            if time.time() < next_kill:
                continue
            next_kill = time.time() + args.kill_every
            with restarting:
                time.sleep(rng.uniform(0, 2))
                d.kill9()
                rounds += 1
                d.start()
                # Every committed turn is there, whole and in order.
                with sessions_lock:
                    snapshot = {k: list(v) for k, v in sessions.items()}
                for sid, turns in snapshot.items():
                    status, body = d.request("GET", "/v1/sessions/" + sid)
                    counts.add("requests.admin")
                    got = []
                    if status == 200:
                        got = [m["content"] for m in json.loads(body)["conversation"]
                               if m["role"] == "user"]
                    lost += sum(1 for t in turns if t not in got)
                # Cached answers are the fresh daemon's, bit for bit.
                for p, want in zip(probes, reference):
                    got = probe(d, p)
                    counts.add("requests.probe")
                    if got != want:
                        corrupt += 1
    finally:
        stop.set()
        for t in threads:
            t.join()
        d.stop()
        if mounted:
            subprocess.run(["umount", "-l", disk])
        shutil.rmtree(work, ignore_errors=True)

    c = counts.c
    total = sum(v for k, v in c.items() if k.startswith("requests."))
    report = {
        "minutes": args.minutes, "sessions": args.sessions, "kill_rounds": rounds,
        "disk_filling": "tmpfs of 48 MiB" if mounted else "skipped (cannot mount a tmpfs)",
        "requests": total,
        "requests_by_kind": {k[9:]: v for k, v in c.items() if k.startswith("requests.")},
        "statuses": {k[7:]: v for k, v in sorted(c.items()) if k.startswith("status.")},
        "fuzz_5xx": c.get("fuzz_5xx", 0), "times_disk_filled": c.get("disk_filled", 0),
        "turns_refused_unsaved": c.get("turn_not_saved", 0),
        "connection_errors_during_kills": c.get("connection_errors", 0),
        "crashes": crashes, "lost_turns": lost, "corrupt_answers": corrupt,
    }
    print(json.dumps(report, indent=2))
    return 0 if crashes == 0 and lost == 0 and corrupt == 0 and c.get("fuzz_5xx", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
