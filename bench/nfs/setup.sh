#!/bin/bash
# two "hosts" (netns h1, h2, veth to the root ns), ganesha in the root ns
# exporting $EXPORT, a fuse-nfs mount of it per host (traffic through the
# host's veth), at $EXP/hN/store
set -eu
. "$(dirname "$0")/env.sh"
cd $EXP
[ -x "$FUSENFS" ] || { echo "no fuse-nfs at $FUSENFS" >&2; exit 1; }

mkdir -p $EXPORT
rm -rf $EXPORT/* 
# the store folder as LlamaTest's slots_dir: owner the llama user, group
# of the workers, setgid, 02775
chown $LLAMA_UID:$(id -g $NGX_USER) $EXPORT
chmod 02775 $EXPORT

for h in $HOSTS; do
    n=$(hostnum $h)
    ip netns add $h
    ip link add veth-$h type veth peer name eth0 netns $h
    ip addr add 10.200.$n.1/24 dev veth-$h
    ip link set veth-$h up
    ip netns exec $h ip addr add 10.200.$n.2/24 dev eth0
    ip netns exec $h ip link set eth0 up
    ip netns exec $h ip link set lo up
done

cat > $EXP/ganesha.conf <<CONF
NFS_CORE_PARAM { Protocols = 3, 4; NFS_Port = 2049; Enable_NLM = false; Enable_RQUOTA = false; }
NFSV4 { Graceless = true; }
EXPORT {
  Export_Id = 1; Path = $EXPORT; Pseudo = /export;
  Access_Type = RW; Squash = No_Root_Squash; SecType = sys; Protocols = 3, 4; Transports = TCP;
  Attr_Expiration_Time = 0;
  FSAL { Name = VFS; }
}
LOG { Default_Log_Level = EVENT; }
CONF

rpcbind -w -f & echo $! > rpcbind.pid
sleep 0.5
ganesha.nfsd -f $EXP/ganesha.conf -L $EXP/ganesha.log -p $EXP/ganesha.pid -N NIV_EVENT
for i in $(seq 1 100); do
    ss -ltn | grep -q ':2049 ' && break; sleep 0.1
done
sleep 1
echo "$(ts) ganesha pid $(cat ganesha.pid)"

for h in $HOSTS; do
    n=$(hostnum $h)
    mkdir -p $EXP/$h/store
    # -a: allow_other (nginx workers and llama-server are not root);
    # the NFS credentials are each caller's uid/gid (fuse-nfs's default)
    nsenter --net=/run/netns/$h $FUSENFS -n nfs://10.200.$n.1$EXPORT \
        -m $EXP/$h/store -a -q -E 0 -T 0 -N 0 >$EXP/$h/fuse-nfs.out 2>&1
    for i in $(seq 1 50); do
        mountpoint -q $EXP/$h/store && break; sleep 0.1
    done
    mountpoint -q $EXP/$h/store || { echo "mount of $h failed" >&2; cat $EXP/$h/fuse-nfs.out; exit 1; }
    pgrep -f "fuse-nfs .*-m $EXP/$h/store" > $EXP/$h/fuse-nfs.pid
    echo "$(ts) $h: fuse-nfs pid $(cat $EXP/$h/fuse-nfs.pid): $(grep " $EXP/$h/store " /proc/mounts)"
done
ls -la $EXP/h1/store $EXP/h2/store
