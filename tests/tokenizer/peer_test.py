"""flashd's tokenizer against Hugging Face `tokenizers`, token for token.

For every tokenizer given and every corpus file, `flashd tokenize` must print exactly
Tokenizer.encode(text, add_special_tokens=False).ids, and `flashd detokenize` of those ids must
give Tokenizer.decode(ids, skip_special_tokens=False). Files with invalid UTF-8 are given to the
peer decoded with errors="replace", which is what flashd does to its input.

usage: peer_test.py FLASHD CORPUS_DIR TOKENIZER_JSON...
"""
import glob
import json
import os
import subprocess
import sys

from tokenizers import Tokenizer

flashd, corpus_dir, tokenizers = sys.argv[1], sys.argv[2], sys.argv[3:]
files = sorted(glob.glob(os.path.join(corpus_dir, "*")))
passed = failed = 0
for path in tokenizers:
    if not os.path.exists(path):
        print(f"SKIP {path}: not present")
        continue
    peer = Tokenizer.from_file(path)
    for f in files:
        raw = open(f, "rb").read()
        text = raw.decode("utf-8", errors="replace")
        want = peer.encode(text, add_special_tokens=False).ids
        run = subprocess.run([flashd, "tokenize", "--tokenizer", path], input=raw,
                             capture_output=True, check=False)
        got = json.loads(run.stdout) if run.returncode == 0 else None
        name = f"{os.path.basename(os.path.dirname(path))}/{os.path.basename(f)}"
        if got != want:
            failed += 1
            at = next((i for i, (a, b) in enumerate(zip(got or [], want)) if a != b), None)
            print(f"FAIL encode {name}: {len(got or [])} vs {len(want)} ids, first difference at {at}"
                  f" ({run.stderr.decode(errors='replace').strip()})")
            continue
        back = subprocess.run([flashd, "detokenize", "--tokenizer", path],
                              input=json.dumps(want).encode(), capture_output=True, check=False)
        want_text = peer.decode(want, skip_special_tokens=False)
        if back.returncode != 0 or back.stdout.decode("utf-8", errors="replace") != want_text:
            failed += 1
            print(f"FAIL decode {name}")
            continue
        passed += 1
        print(f"ok {name}: {len(want)} ids")
print(f"{passed} passed, {failed} failed")
sys.exit(1 if failed or not passed else 0)
