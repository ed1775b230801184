"""What the SDK tests share: a tiny model, a daemon on a free port and a private socket."""

import os
import subprocess
import sys
import time

import httpx2

MODEL = "deepseek-v4.1-flash"


def make_model(binary, tokenizer_dir, work):
    model_dir = os.path.join(work, "tiny-model")
    subprocess.run(
        [binary, "mkmodel", model_dir, "--tokenizer", tokenizer_dir, "--set", "vocab_size=480",
         "--set", "engram_compressed_vocab_size=389", "--set", "dspark_noise_token_id=400",
         "--seed", "3"],
        check=True, stdout=subprocess.DEVNULL)
    return model_dir


def start(binary, model_dir, work):
    env = dict(os.environ)
    env.update(
        FLASHD_LISTEN="127.0.0.1:0",
        FLASHD_SOCKET=os.path.join(work, "flashd.sock"),
        FLASHD_STATE_DIR=os.path.join(work, "state"),
        FLASHD_MODEL_DIR=model_dir,
    )
    config = os.path.join(work, "flashd.yaml")
    with open(config, "w") as f:
        f.write("server:\n  pid_file: %s\n" % os.path.join(work, "flashd.pid"))
    log = open(os.path.join(work, "daemon.log"), "w")
    proc = subprocess.Popen(
        [binary, "serve", "--config", config], env=env, stdout=subprocess.PIPE, stderr=log, text=True
    )
    line = proc.stdout.readline()
    if not line.startswith("flashd ready:"):
        proc.kill()
        sys.exit("daemon did not start: " + open(log.name).read())
    url = line.split()[2]
    return proc, url, env["FLASHD_SOCKET"], log.name


def wait_ready(url):
    # /health turns 200 once the model is loaded.
    for _ in range(600):
        try:
            if httpx2.get(url + "/health").status_code == 200:
                return
        except httpx2.HTTPError:
            pass
        time.sleep(0.1)
    sys.exit("model did not load")


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print("ok:", what)


