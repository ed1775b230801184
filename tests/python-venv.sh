#!/usr/bin/env bash
# Creates (once) the virtual environment the peer tests use, under the build tree, and installs
# the pinned test-only packages into it from PyPI. Prints the venv's python on success; exits 77
# (ctest: skipped) with the reason when it cannot be made, e.g. without network access.
set -uo pipefail
venv=$1
shift
stamp="$venv/.installed-$(echo "$*" | sha256sum | cut -c1-16)"
if [[ -f "$stamp" ]]; then
  echo "$venv/bin/python"
  exit 0
fi
if ! python3 -m venv "$venv" >&2; then
  echo "SKIP: cannot create a Python venv at $venv (python3-venv missing?)" >&2
  exit 77
fi
if ! "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$@" >&2; then
  echo "SKIP: cannot install $* from PyPI" >&2
  exit 77
fi
touch "$stamp"
echo "$venv/bin/python"
