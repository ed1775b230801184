"""flashctl against a real daemon: every command, with --json and as a person reads it (80
columns), over the Unix socket and TCP, and its exit codes.

usage: flashctl_test.py FLASHD_BINARY FLASHCTL GOLDEN_DIR
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

BINARY, FLASHCTL, GOLDEN = sys.argv[1], sys.argv[2], sys.argv[3]
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)


def start(work):
    model = os.path.join(work, "model")
    subprocess.run([BINARY, "mkmodel", model, "--tokenizer", GOLDEN, "--set", "vocab_size=480",
                    "--set", "engram_compressed_vocab_size=389", "--set",
                    "dspark_noise_token_id=400", "--seed", "3"], check=True,
                   stdout=subprocess.DEVNULL)
    env = dict(os.environ, FLASHD_LISTEN="127.0.0.1:0", FLASHD_SOCKET=os.path.join(work, "s.sock"),
               FLASHD_STATE_DIR=os.path.join(work, "state"), FLASHD_MODEL_DIR=model)
    cfg = os.path.join(work, "flashd.yaml")
    with open(cfg, "w") as f:
        f.write("server:\n  pid_file: \"\"\n")
    proc = subprocess.Popen([BINARY, "serve", "--config", cfg], env=env, stdout=subprocess.PIPE,
                            stderr=open(os.path.join(work, "daemon.log"), "w"), text=True)
    line = proc.stdout.readline()
    assert line.startswith("flashd ready:"), line
    return proc, line.split()[2], env["FLASHD_SOCKET"]


def ctl(*args, where=None, stdin=None):
    cmd = [sys.executable, FLASHCTL] + list(where or []) + list(args)
    r = subprocess.run(cmd, capture_output=True, text=True, input=stdin, timeout=300)
    return r.returncode, r.stdout, r.stderr


def ctl_json(*args, where=None):
    code, out, err = ctl(*args, "--json", where=where)
    check(code == 0, "%s: exit %d: %s" % (" ".join(args), code, err))
    try:
        return json.loads(out)
    except ValueError:
        check(False, "%s: not JSON: %r" % (" ".join(args), out[:200]))
        return {}


def fits(*args, where=None):
    code, out, err = ctl(*args, where=where)
    check(code == 0, "%s (human): exit %d: %s" % (" ".join(args), code, err))
    longest = max((len(l) for l in out.splitlines()), default=0)
    check(longest <= 80, "%s: a line of %d columns:\n%s" % (" ".join(args), longest, out))
    return out


def main():
    work = tempfile.mkdtemp(prefix="flashctl-test-")
    proc = None
    try:
        proc, url, sock = start(work)
        s = ["--socket", sock]
        t = ["--url", url]
        status = ctl_json("status", "--wait", "60", where=s)
        check(status.get("health", {}).get("status") == "ok", "status: %s" % status)
        check(status.get("model", {}).get("id") == "deepseek-v4.1-flash", "status model")
        check("ok" in fits("status", where=s), "status human")

        models = ctl_json("models", where=t)
        check(models["data"][0]["id"] == "deepseek-v4.1-flash", "models")
        fits("models", where=t)

        # Some traffic, so the counters move: two tokens each (sampled, so the end of sentence
        # could otherwise come first).
        for i in range(3):
            req = urllib.request.Request(url + "/v1/completions", method="POST",
                                         data=json.dumps({"prompt": [5 + i] * 150,
                                                          "max_tokens": 2,
                                                          "ignore_eos": True}).encode(),
                                         headers={"Content-Type": "application/json"})
            urllib.request.urlopen(req).read()
        metrics = ctl_json("metrics", where=s)
        check(metrics.get("flashd_engine_generated_tokens_total", 0) >= 6, "metrics: %s" % metrics)
        code, out, _ = ctl("metrics", where=s)
        check(code == 0 and "# TYPE flashd_engine_running gauge" in out, "metrics text")

        # The metrics the operator's guide and the Grafana dashboard use all exist.
        docs = os.path.join(os.path.dirname(os.path.abspath(FLASHCTL)), "..", "docs")
        used = set()
        for name in ("grafana-dashboard.json", "operations.md"):
            with open(os.path.join(docs, name)) as f:
                used |= set(re.findall(r"flashd_[a-z_]+[a-z]", f.read()))
        code, text, _ = ctl("metrics", where=s)
        for name in sorted(used):
            if name.startswith("flashd_tenant"):
                continue
            check(name in text or name.replace("_bucket", "") in text,
                  "a metric the docs use is missing from /metrics: " + name)

        stats = ctl_json("cache", "stats", where=t)
        check(stats["scope"] == "daemon" and stats["lookups"] >= 3, "cache stats: %s" % stats)
        fits("cache", "stats", where=t)

        text = "the tool reads a file and prints it. " * 40
        pin = ctl_json("cache", "pin", "tools", "--text", text, where=t)
        check(pin.get("tokens", 0) > 64 and pin.get("blocks", 0) >= 1, "cache pin: %s" % pin)
        pins = ctl_json("cache", "pins", where=t)
        check([p["name"] for p in pins["pins"]] == ["tools"], "cache pins: %s" % pins)
        fits("cache", "pins", where=t)

        # Sessions (TCP: the tenant "default", like the pin above).
        req = urllib.request.Request(url + "/v1/sessions", method="POST",
                                     data=json.dumps({"system": "You help.", "title": "demo",
                                                      "settings": {"max_tokens": 3}}).encode(),
                                     headers={"Content-Type": "application/json"})
        sid = json.loads(urllib.request.urlopen(req).read())["id"]
        for text_turn in ("first", "second"):
            req = urllib.request.Request(
                url + "/v1/sessions/%s/turns" % sid, method="POST",
                data=json.dumps({"messages": [{"role": "user", "content": text_turn}]}).encode(),
                headers={"Content-Type": "application/json"})
            urllib.request.urlopen(req).read()
        ls = ctl_json("sessions", "ls", where=t)
        check([x["id"] for x in ls["data"]] == [sid], "sessions ls: %s" % ls)
        fits("sessions", "ls", where=t)
        show = ctl_json("sessions", "show", sid, where=t)
        check(show["turns"] == 2 and show["title"] == "demo", "sessions show: %s" % show)
        check("first" in fits("sessions", "show", sid, where=t), "sessions show human")
        fork = ctl_json("sessions", "fork", sid, "--turn", "1", where=t)
        check(fork["forked_at_turn"] == 1 and fork["id"] != sid, "sessions fork: %s" % fork)
        cls = ctl_json("cache", "ls", where=t)
        check(len(cls["sessions"]) == 2 and cls["pins"][0]["name"] == "tools", "cache ls: %s" % cls)
        check(all("cached_tokens" in x for x in cls["sessions"]), "cache ls cached tokens")
        fits("cache", "ls", where=t)
        rm = ctl_json("sessions", "rm", fork["id"], where=t)
        check(rm["deleted"] is True, "sessions rm")
        check(ctl("sessions", "rm", fork["id"], where=t)[0] == 1, "rm twice: exit 1")

        # tokens FILE and standard input.
        path = os.path.join(work, "notes.txt")
        with open(path, "w") as f:
            f.write("hello world, hello tokens\n")
        tok = ctl_json("tokens", path, where=t)
        req = urllib.request.Request(url + "/tokenize", method="POST",
                                     data=json.dumps({"text": "hello world, hello tokens\n"}).encode(),
                                     headers={"Content-Type": "application/json"})
        want = json.loads(urllib.request.urlopen(req).read())["count"]
        check(tok["tokens"] == want, "tokens: %s vs %d" % (tok, want))
        code, out, _ = ctl("tokens", "-", "--json", where=t, stdin="hello world, hello tokens\n")
        check(code == 0 and json.loads(out)["tokens"] == want, "tokens from stdin")

        # pin-repo: tracked text files only (not the binary, the ignored or the untracked one).
        repo = os.path.join(work, "repo")
        os.makedirs(os.path.join(repo, "src"))
        for name, content in (("src/a.py", "def a():\n    return 1\n" * 20),
                              ("README.md", "# demo\n" * 10), (".gitignore", "build/\n")):
            with open(os.path.join(repo, name), "w") as f:
                f.write(content)
        with open(os.path.join(repo, "logo.bin"), "wb") as f:
            f.write(bytes(range(256)) * 4)
        os.makedirs(os.path.join(repo, "build"))
        with open(os.path.join(repo, "build", "out.txt"), "w") as f:
            f.write("ignored\n")
        git = ["git", "-C", repo, "-c", "user.email=t@example.com", "-c", "user.name=t"]
        subprocess.run(git + ["init", "-q"], check=True)
        subprocess.run(git + ["add", "src/a.py", "README.md", ".gitignore", "logo.bin"], check=True)
        subprocess.run(git + ["commit", "-qm", "x"], check=True)
        with open(os.path.join(repo, "untracked.txt"), "w") as f:
            f.write("not tracked\n")
        pr = ctl_json("pin-repo", repo, "--name", "demo-repo", where=t)
        check(pr.get("files") == 3 and pr.get("skipped") == 1, "pin-repo files: %s" % pr)
        check(pr.get("cached_tokens", 0) >= 64, "pin-repo cached: %s" % pr)
        check("demo-repo" in [p["name"] for p in ctl_json("cache", "pins", where=t)["pins"]],
              "pin-repo pinned")

        top = ctl_json("top", "--once", "--interval", "0.2", where=t)
        check(top.get("running") == 0 and "cache_hit_rate" in top, "top: %s" % top)
        fits("top", "--once", "--interval", "0.2", where=t)

        bench = ctl_json("bench", "--tokens", "4", where=t)
        check(bench.get("tokens") == 4 and bench.get("ttft_ms", 0) > 0, "bench: %s" % bench)
        fits("bench", "--tokens", "4", where=t)

        unpin = ctl_json("cache", "unpin", "tools", where=t)
        check(unpin.get("deleted") is True, "unpin")
        check(ctl("cache", "unpin", "tools", where=t)[0] == 1, "unpin twice: exit 1")
        before = ctl_json("cache", "stats", where=t)
        ev = ctl_json("cache", "evict", where=t)
        after = ctl_json("cache", "stats", where=t)
        check(ev["evicted"] > 0 and after["blocks"] < before["blocks"], "evict: %s %s" % (ev, after))
        check(after["pinned_entries"] > 0 and after["blocks"] > 0, "evict keeps pins: %s" % after)

        # Exit codes: usage 2, nothing there 3.
        check(ctl("frobnicate", where=t)[0] == 2, "unknown command: exit 2")
        check(ctl("status", where=["--socket", os.path.join(work, "none.sock")])[0] == 3,
              "no daemon: exit 3")
        check(ctl("--help")[0] == 0, "--help")

        # Shell completions know the commands.
        here = os.path.dirname(os.path.abspath(FLASHCTL))
        r = subprocess.run(["bash", "-c", "source %s/completions/flashctl.bash; "
                            "COMP_WORDS=(flashctl ca); COMP_CWORD=1; _flashctl; "
                            "echo ${COMPREPLY[@]}" % here], capture_output=True, text=True)
        check(r.stdout.split() == ["cache"], "bash completion: %r %r" % (r.stdout, r.stderr))
        with open(os.path.join(here, "completions", "_flashctl")) as f:
            zsh = f.read()
        check("#compdef flashctl" in zsh and "pin-repo" in zsh, "zsh completion")
    finally:
        if proc:
            proc.terminate()
            proc.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
    if failures:
        print("%d failed" % len(failures))
        return 1
    print("flashctl_test: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
