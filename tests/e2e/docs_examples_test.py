"""Every shell example in the README and docs that talks to a running daemon is run as written
against a daemon set up as `make run` sets it up (the embedded default model, ./var/run/
flashd.sock, TCP on loopback): it must succeed, answer without an error, and finish in seconds.

The one change made to an example is the TCP port: the daemon listens on a free port, which
replaces 8741. Blocks that install, build or start other programs (make, apt-get, systemctl,
claude, codex, sqlite3 backups) are not run; the test names what it ran and skipped.

usage: docs_examples_test.py FLASHD_BINARY SOURCE_DIR
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

BINARY, SOURCE = sys.argv[1], sys.argv[2]
DOCS = ["README.md", "docs/clients.md", "docs/operations.md"]
NOT_RUN = re.compile(r"\b(make|apt-get|systemctl|claude|codex|sqlite3|opencode|pip|export)\b")
LIMIT_S = 60  # A hang guard: each example is meant to take seconds.


def blocks(path):
    text = open(os.path.join(SOURCE, path)).read()
    return re.findall(r"```sh\n(.*?)```", text, re.S)


def main():
    work = tempfile.mkdtemp(prefix="flashd-docs-")
    os.symlink(os.path.join(SOURCE, "clients"), os.path.join(work, "clients"))
    cfg = os.path.join(SOURCE, "config", "flashd.yaml")
    env = dict(os.environ, FLASHD_LISTEN="127.0.0.1:0")
    proc = subprocess.Popen([BINARY, "serve", "--config", cfg], cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=open(os.path.join(work, "log"), "w"),
                            text=True)
    failures, ran, skipped = [], 0, 0
    try:
        line = proc.stdout.readline()
        assert line.startswith("flashd ready:"), line
        port = line.split("http://127.0.0.1:")[1].split()[0]
        for _ in range(1200):
            try:
                if urllib.request.urlopen("http://127.0.0.1:%s/health" % port).status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.1)
        else:
            sys.exit("the embedded default model did not load: " + open(os.path.join(work, "log")).read())
        for doc in DOCS:
            for block in blocks(doc):
                if "8741" not in block and "flashd.sock" not in block:
                    continue
                if NOT_RUN.search(block):
                    skipped += 1
                    print("not run (%s): %s" % (doc, block.strip().splitlines()[0]))
                    continue
                script = block.replace("8741", port)
                start = time.time()
                try:
                    r = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=work,
                                       capture_output=True, text=True, timeout=LIMIT_S,
                                       env=dict(os.environ, FLASHD_SOCKET=""))
                    out, code = r.stdout + r.stderr, r.returncode
                except subprocess.TimeoutExpired:
                    out, code = "(still running after %d s)" % LIMIT_S, -1
                ran += 1
                took = time.time() - start
                first = block.strip().splitlines()[0]
                print("ran (%s, %.1f s, exit %d): %s" % (doc, took, code, first))
                if code != 0 or '"error"' in out or "HTTP 4" in out or "HTTP 5" in out:
                    failures.append("%s: %s\n%s" % (doc, first, out[-800:]))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
    for f in failures:
        print("FAIL:", f)
    print("%d passed, %d failed" % (ran - len(failures), len(failures)))
    return 1 if failures or ran == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
