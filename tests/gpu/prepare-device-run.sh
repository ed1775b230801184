#!/usr/bin/env bash
# Gathers what a GPU machine needs to run flashd's device tests into build-device/ (git-ignored):
# the GPU test binaries of an existing build (the kernels' tests, and the forward pass's tests,
# which run on the backend FLASHD_TEST_BACKEND names, with the DSpark golden checkpoint the build
# wrote), engine_bench, gpu_bench, the daemon and its cache end-to-end test, and every shared
# library they load that is not part of the C library, because the device machine has the CUDA
# toolkit but none of the project's Debian libraries, and this machine's C library and loader in
# glibc/, which run-on-device.sh uses only where the device's own C library is older than the one
# the binaries were linked against. The folder is packed into build-device-pack/device.tar.xz (a
# run carries at most 64 MiB; the binaries compress to about a quarter). Then, on the device
# machine, from the repository root:
#
#   tar xJf build-device-pack/device.tar.xz && build-device/run-on-device.sh "$OUT"
#
# Usage: tests/gpu/prepare-device-run.sh [BUILD_DIR]   (default: build; run `make build` first)
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build}
dest=build-device
pack=build-device-pack
rm -rf "$dest" "$pack"
mkdir -p "$dest/bin" "$dest/lib" "$dest/glibc" "$pack"
shopt -s nullglob
tests=("$build"/tests/gpu_*_cuda_test)
if [[ ${#tests[@]} -eq 0 ]]; then
  echo "prepare-device-run: no CUDA test binaries in $build/tests (is nvcc installed?)" >&2
  exit 1
fi
tests+=("$build"/tests/golden_test "$build"/tests/forward_equivalence_test
        "$build"/tests/dspark_golden_test
        "$build"/tests/backend_equivalence_test "$build"/bench/engine_bench
        "$build"/bench/gpu_bench_cuda "$build"/tests/cache_e2e_test "$build"/bin/flashd)
cp "${tests[@]}" "$dest/bin/"
cp tests/gpu/run-on-device.sh "$dest/"
# The DSpark golden checkpoint the build wrote, with the reference's outputs beside it.
cp -r "$build"/tests/golden-dspark "$dest/"
for t in "${tests[@]}"; do
  # Libraries the loader resolves here, except the C library and the CUDA driver (the device
  # machine has its own, matching its GPU).
  ldd "$t" | awk '/=> \// {print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libcuda.so*) ;;
      *) cp -L -n "$lib" "$dest/lib/" ;;
    esac
  done
done
# The C library, the loader and the libraries split from it, for a device machine whose own are
# older (run-on-device.sh starts the binaries through this loader then).
for lib in libc.so.6 libm.so.6 libpthread.so.0 libdl.so.2 librt.so.1 ld-linux-x86-64.so.2; do
  path=$(ldconfig -p | awk -v l="$lib" '$1 == l && /x86-64/ && !p {p = $NF} END {print p}')
  [[ -n "$path" ]] && cp -L "$path" "$dest/glibc/"
done
[[ -x "$dest/glibc/ld-linux-x86-64.so.2" ]] || chmod +x "$dest/glibc/ld-linux-x86-64.so.2"
# Symbols are not needed there; without them the bundle stays well inside what a run carries.
strip --strip-unneeded "$dest"/bin/* "$dest"/lib/*
tar cJf "$pack/device.tar.xz" "$dest"
echo "prepare-device-run: $(ls "$dest/bin" | wc -l) binaries, $(ls "$dest/lib" | wc -l) libraries," \
  "$(du -sh "$dest" | cut -f1) in $dest, packed to $(du -sh "$pack/device.tar.xz" | cut -f1)" \
  "in $pack/device.tar.xz"
