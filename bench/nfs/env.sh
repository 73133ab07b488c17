# common settings of the experiment (sourced)
EXP=${NFS_EXP:-/tmp/nfs-exp}        # the work folder
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p "$EXP"
EXPORT=$EXP/export
FUSENFS=${FUSENFS:-/tmp/nfstest/fusenfs/fuse-nfs}   # built from source: README
LLAMA=${LLAMA:-/var/cache/llama-session-rig/node-llama-cpp-3.21.1/bin/llama-server}
MODEL=${MODEL:-/var/cache/llama-session-rig/models/tiny-llama-v1.gguf}
NGINX=/usr/sbin/nginx
NGX_USER=www-data          # nginx workers, as LlamaTest ($USER)
LLAMA_UID=65534            # llama-server as nobody, as LlamaTest ($LLAMA_USER)
LLAMA_GID=65534
HOSTS="h1 h2"
# h1: veth 10.200.1.1 (root) <-> 10.200.1.2 (h1); h2: 10.200.2.x
hostnum() { echo "${1#h}"; }
ts() { date +%H:%M:%S.%3N; }
