#!/usr/bin/env bash
# Fails when a tracked C++ file differs from what clang-format makes of it; exits 77 (skipped)
# when clang-format is not installed.
set -euo pipefail
root=${1:-.}
cd "$root"
if ! command -v clang-format >/dev/null 2>&1; then
  echo "SKIP: clang-format is not installed"
  exit 77
fi
mapfile -t files < <(git ls-files --cached --others --exclude-standard '*.h' '*.cc' '*.cu' 2>/dev/null || find . -name '*.h' -o -name '*.cc' -o -name '*.cu')
if [[ ${#files[@]} -eq 0 ]]; then
  echo "no C++ files found"
  exit 1
fi
clang-format --dry-run --Werror "${files[@]}"
echo "clang-format: ${#files[@]} files formatted"
