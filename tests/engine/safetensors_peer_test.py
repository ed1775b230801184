"""The safetensors files flashd writes, read by the `safetensors` library itself.

`flashd mkmodel` (one file and two shards) and `flashd eval --out FILE.safetensors` must write
files the library opens (it refuses holes between tensors, overlapping or unordered offsets),
listing the tensors flashd's index names with their dtypes and shapes; the tensors numpy can
hold (F32, U8, I8) must read back as the bytes flashd loads (`flashd eval`'s logits, which
.npy and .safetensors both hold, are compared value for value).

usage: safetensors_peer_test.py FLASHD TOKENIZER_DIR
"""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
from safetensors import safe_open

flashd, tokenizer_dir = sys.argv[1], sys.argv[2]
failed = 0


def check(ok, what):
    global failed
    print(("ok   " if ok else "FAIL ") + what)
    failed += not ok


def header(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n)), n


with tempfile.TemporaryDirectory() as tmp:
    for shards in (1, 2):
        model = os.path.join(tmp, f"model{shards}")
        subprocess.run([flashd, "mkmodel", model, "--tokenizer", tokenizer_dir, "--set",
                        "hidden_size=128", "--set", "vocab_size=480", "--set",
                        "engram_compressed_vocab_size=389", "--shards", str(shards)],
                       check=True, capture_output=True)
        files = sorted(f for f in os.listdir(model) if f.endswith(".safetensors"))
        check(len(files) == shards, f"mkmodel --shards {shards}: {len(files)} files")
        names = set()
        for name in files:
            path = os.path.join(model, name)
            meta, n = header(path)
            meta.pop("__metadata__", None)
            try:
                with safe_open(path, framework="numpy") as f:
                    keys = set(f.keys())
                    for k in keys:
                        dtype = meta[k]["dtype"]
                        if dtype in ("F32", "U8", "I8"):
                            got = f.get_tensor(k)
                            a, b = meta[k]["data_offsets"]
                            with open(path, "rb") as raw:
                                raw.seek(8 + n + a)
                                want = np.frombuffer(raw.read(b - a), dtype=got.dtype)
                            if list(got.shape) != meta[k]["shape"] or not np.array_equal(
                                    got.reshape(-1), want):
                                check(False, f"{name}: {k} reads back differently")
                check(keys == set(meta), f"{name}: the library opens it and lists {len(keys)} tensors")
                names |= keys
            except Exception as e:  # noqa: BLE001
                check(False, f"{name}: the library refuses it: {e}")
        if shards > 1:
            index = json.load(open(os.path.join(model, "model.safetensors.index.json")))
            check(set(index["weight_map"]) == names, "the index names every tensor of the shards")
    # flashd eval's own output file, beside its .npy.
    tokens = os.path.join(tmp, "tokens.json")
    json.dump([5, 17, 42, 7, 99, 3], open(tokens, "w"))
    model = os.path.join(tmp, "model1")
    out = os.path.join(tmp, "eval")
    subprocess.run([flashd, "eval", model, "--tokens", tokens, "--out", out + ".safetensors",
                    "--streams"], check=True, capture_output=True)
    subprocess.run([flashd, "eval", model, "--tokens", tokens, "--out", out + ".npy"], check=True,
                   capture_output=True)
    try:
        with safe_open(out + ".safetensors", framework="numpy") as f:
            logits = f.get_tensor("logits")
            check(set(f.keys()) == {"logits", "streams", "sublayers"},
                  f"eval --streams writes {sorted(f.keys())}")
            check(np.array_equal(logits, np.load(out + ".npy")),
                  "eval's logits in .safetensors equal those in .npy")
    except Exception as e:  # noqa: BLE001
        check(False, f"eval's safetensors: the library refuses it: {e}")

print(f"{failed} failed")
sys.exit(1 if failed else 0)
