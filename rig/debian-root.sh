#!/usr/bin/env bash
# A build and test root of another Debian release (13 "trixie"), for the
# package built against that release's nginx (make deb DEBIAN=trixie) and
# its first-hour check (t/107-deb-trixie.t): debootstrap's minbase from the
# Debian archive this machine's apt uses, then what building, linting and
# running the package needs.  Cached in $LLAMA_RIG_CACHE/root-SUITE (about
# 1.1 GB; two minutes once, then nothing); prints its path.  Services never
# start in it (policy-rc.d): its nginx runs only when a test starts it.
set -euo pipefail

suite=${1:?usage: debian-root.sh SUITE}
here=$(cd "$(dirname "$0")" && pwd)
cache=${LLAMA_RIG_CACHE:-/var/cache/llama-session-rig}
root=$cache/root-$suite
log() { echo "debian-root: $*" >&2; }

case "$suite" in
    trixie) ;;
    *) log "no build root known for Debian \"$suite\" (trixie)"; exit 1 ;;
esac

packages="build-essential debhelper dpkg-dev fakeroot lintian nginx nginx-dev
          libcjson-dev libssl-dev openssl procps"
packages=$(echo $packages)

if [ -f "$root/.llama-session-root" ] \
   && [ "$(cat "$root/.llama-session-root")" = "$packages" ]
then
    echo "$root"
    exit 0
fi

[ "$(id -u)" = 0 ] || { log "building the root needs root"; exit 1; }
command -v debootstrap >/dev/null \
    || { log "no debootstrap: run 'make deps'"; exit 1; }

mirror=$("$here/debian-mirror.sh")
mkdir -p "$cache"

if [ ! -x "$root/usr/bin/apt-get" ]; then
    log "debootstrap $suite (minbase) into $root"
    rm -rf "$root.tmp"
    debootstrap --variant=minbase "$suite" "$root.tmp" "$mirror" \
        >"$cache/root-$suite.log" 2>&1 \
        || { tail -n 30 "$cache/root-$suite.log" >&2; exit 1; }
    mv "$root.tmp" "$root"
fi

# no service starts in the root (nginx's own postinst would)
printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
chmod 755 "$root/usr/sbin/policy-rc.d"

# the machine's network settings for apt, and its name server
grep -hs '^Acquire::' /etc/apt/apt.conf.d/* \
    >"$root/etc/apt/apt.conf.d/90llama-session-host" || true
cp -L /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true

mounted=
cleanup() { [ -z "$mounted" ] || umount "$root/proc" 2>/dev/null || true; }
trap cleanup EXIT
if ! mountpoint -q "$root/proc"; then
    mount -t proc proc "$root/proc" && mounted=1
fi

log "installing into the root: $packages"
chroot "$root" apt-get update -qq >>"$cache/root-$suite.log" 2>&1 \
    && DEBIAN_FRONTEND=noninteractive chroot "$root" apt-get install -y -qq \
        --no-install-recommends $packages >>"$cache/root-$suite.log" 2>&1 \
    || { tail -n 30 "$cache/root-$suite.log" >&2; exit 1; }

echo "$packages" >"$root/.llama-session-root"
echo "$root"
