#!/usr/bin/env bash
# Installs the flashd package into a fresh Debian root and serves from the installed files:
# builds the .deb (cpack), makes a minimal Debian 12 root (debootstrap, cached under the build
# dir), installs the package with apt (which brings its dependencies), checks what the postinst
# made (the flashd user and group, /var/lib/flashd 0700, the conffile), starts `flashd serve` as
# the flashd user on the installed config, and checks /health and a completion over the
# installed socket path with the installed flashctl. Also runs lintian when it is there.
# Exit 77 (skipped) with the reason when this machine cannot do it (not root, no debootstrap,
# no package archive reachable).
# Usage: tests/packaging/install_test.sh BUILD_DIR
set -euo pipefail
build=$(cd "${1:?usage: install_test.sh BUILD_DIR}" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
skip() { echo "SKIP: $*"; exit 77; }

[[ $(id -u) -eq 0 ]] || skip "installing a package into a Debian root needs root"
command -v debootstrap >/dev/null || skip "debootstrap is not installed (packaging/install-deps.sh installs it)"
[[ -f "$build/tokenizer/deepseek-v4/tokenizer.json" ]] || skip "the tokenizer was not fetched"

work=$(mktemp -d /tmp/flashd-install-test.XXXXXX)
root="$work/root"
cleanup() {
  if [[ -n "${daemon_pid:-}" ]]; then kill "$daemon_pid" 2>/dev/null || true; wait "$daemon_pid" 2>/dev/null || true; fi
  umount -l "$root/proc" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

echo "install-test: building the package"
(cd "$build" && cpack -G DEB -B "$work/deb" > "$work/cpack.log" 2>&1) || { cat "$work/cpack.log"; exit 1; }
deb=$(ls "$work"/deb/flashd_*.deb)

if command -v lintian >/dev/null; then
  # Explained in docs/operations.md: a package built from source has no public maintainer
  # mailbox, so its address is a local one.
  tags=$(lintian --no-tag-display-limit "$deb" 2>/dev/null | grep -E '^[EW]: ' |
         grep -v -E 'bogus-mail-host' || true)
  if [[ -n "$tags" ]]; then echo "install-test: lintian: $tags"; exit 1; fi
  echo "install-test: lintian clean (bar the explained bogus-mail-host)"
fi

cache="$build/debian-root-bookworm.tar"
if [[ ! -f "$cache" ]]; then
  echo "install-test: making a minimal Debian 12 root (debootstrap)"
  if ! debootstrap --variant=minbase bookworm "$root" > "$work/debootstrap.log" 2>&1; then
    tail -5 "$work/debootstrap.log"
    skip "debootstrap could not make a Debian root (no package archive reachable?)"
  fi
  tar -C "$root" -cf "$cache.tmp" . && mv "$cache.tmp" "$cache"
else
  mkdir -p "$root" && tar -C "$root" -xf "$cache"
fi
mount -t proc proc "$root/proc"
cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
cp "$deb" "$root/tmp/flashd.deb"

echo "install-test: apt-get install ./flashd.deb"
chroot "$root" /usr/bin/env DEBIAN_FRONTEND=noninteractive sh -c \
  'apt-get update -q >/dev/null && apt-get install -y -q /tmp/flashd.deb' > "$work/apt.log" 2>&1 ||
  { tail -20 "$work/apt.log"; exit 1; }

fail=0
check() { if ! eval "$1"; then echo "install-test: FAILED: $2"; fail=1; fi; }
check 'chroot "$root" getent passwd flashd >/dev/null' "the flashd user exists"
check 'chroot "$root" getent group flashd >/dev/null' "the flashd group exists"
check '[[ $(chroot "$root" stat -c "%a %U" /var/lib/flashd) == "700 flashd" ]]' "/var/lib/flashd is 0700 flashd"
check 'chroot "$root" dpkg-query -W -f="\${Conffiles}" flashd > "$work/conffiles" && grep -q /etc/flashd/flashd.yaml "$work/conffiles"' "flashd.yaml is a conffile"
check '[[ -f "$root/lib/systemd/system/flashd.socket" && -f "$root/lib/systemd/system/flashd.service" ]]' "systemd units installed"
check '[[ -f "$root/usr/share/man/man8/flashd.8.gz" && -f "$root/usr/share/man/man1/flashctl.1.gz" ]]' "man pages installed"

# What systemd's units would do: the runtime directory, then the daemon as the flashd user.
install -d -o "$(chroot "$root" id -u flashd)" -g "$(chroot "$root" id -g flashd)" -m 0750 "$root/run/flashd"
echo "install-test: flashd serve as the flashd user, from /"
chroot "$root" /usr/bin/env -C / FLASHD_LISTEN=127.0.0.1:0 \
  /usr/sbin/runuser -u flashd -- /usr/bin/flashd serve --config /etc/flashd/flashd.yaml \
  > "$work/daemon.out" 2> "$work/daemon.err" &
daemon_pid=$!
ctl() { chroot "$root" /usr/sbin/runuser -u flashd -- /usr/bin/flashctl --socket /run/flashd/flashd.sock "$@"; }
if ! ctl status --wait 300 --json > "$work/status.json"; then
  echo "install-test: FAILED: the daemon did not get ready"; tail -20 "$work/daemon.err"; exit 1
fi
check 'grep -q "\"embedded_default\": true" "$work/status.json"' "/health and /v1/models answer over /run/flashd/flashd.sock"
# Through a file: `grep -q` in a pipe may exit before flashctl has written everything, which then
# fails on the closed pipe.
check 'ctl bench --tokens 4 --json > "$work/bench.json" && grep -q "\"tokens\": 4" "$work/bench.json"' "a completion over the installed socket"
check '[[ $(stat -c "%a" "$root/var/lib/flashd/catalog.db") == 600 ]]' "the catalog is 0600"
check 'grep -q "tokenizer: " "$work/daemon.err"' "the embedded model found its installed tokenizer"
[[ $fail -eq 0 ]] || { tail -20 "$work/daemon.err"; exit 1; }
echo "install-test: all checks passed"
