#!/usr/bin/env bash
# Installs flashd's build and test dependencies from Debian's archive.
# Idempotent: a package that is already installed is skipped, and nothing runs when all are present.
# Usage: packaging/install-deps.sh [--with-hip] [--with-fuzz]
set -euo pipefail

packages=(
  build-essential cmake pkg-config make curl ca-certificates
  librocksdb-dev libyaml-cpp-dev libcpp-httplib-dev libuv1-dev libxxhash-dev
  nlohmann-json3-dev libspdlog-dev libsqlite3-dev libboost-test-dev
  libpcre2-dev libutf8proc-dev liburing-dev libsystemd-dev libssl-dev
  python3 python3-venv python3-pip clang-format util-linux
  debootstrap lintian git jq libtbb-dev
)
# HIP adds about 650 MB and is only needed to build the AMD backend; clang and its runtime
# libraries (libFuzzer, the sanitizers) only for make fuzz.
for arg in "$@"; do
  case "$arg" in
    --with-hip) packages+=(hipcc libamdhip64-dev) ;;
    --with-fuzz) packages+=(clang-14 libclang-rt-14-dev) ;;
    *) echo "install-deps: unknown option $arg (--with-hip, --with-fuzz)" >&2; exit 2 ;;
  esac
done

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [[ ${#missing[@]} -eq 0 ]]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
sudo=""
if [[ $(id -u) -ne 0 ]]; then
  sudo="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q
$sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
echo "install-deps: done"
