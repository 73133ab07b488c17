#!/bin/bash
# The two-host experiment of docs/scaling.md (section 4, "Tried over NFS"):
# two "hosts" (network namespaces h1, h2), each with a llama-server and an
# nginx owner zone (shared=on), share one store over NFS: nfs-ganesha in
# the root namespace, a fuse-nfs mount per host.  Run as root, by hand (not
# part of make test: it needs fuse-nfs, built from source, see README).
# Output in $NFS_EXP/run.out (default /tmp/nfs-exp).
set -u
. "$(dirname "$0")/env.sh"
cd "$EXP"
exec > >(tee run.out) 2>&1
[ -e /run/netns/h1 ] && { echo "netns h1 exists: run cleanup.sh first"; exit 1; }
for h in h1 h2; do mountpoint -q $h/store && { echo "$h/store still mounted"; exit 1; }; done
cp "$HERE/../../objs/ngx_http_llama_session_module.so" module.so || exit 1
rm -rf conv h1 h2
bash "$HERE/setup.sh" || { bash "$HERE/cleanup.sh"; exit 1; }
bash "$HERE/hosts.sh" start && bash "$HERE/scenario.sh" part1
bash "$HERE/scenario.sh" part2
for h in h1 h2; do echo "== $h: swap lines"; grep 'swap on slot' $h/error.log | sed 's/, client: .*//'; done
bash "$HERE/cleanup.sh"
