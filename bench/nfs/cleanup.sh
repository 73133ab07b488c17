#!/bin/bash
# stops what setup.sh and hosts.sh started (by their pids), unmounts, deletes the netns
. "$(dirname "$0")/env.sh"
cd $EXP
bash "$HERE/hosts.sh" stop
for h in $HOSTS; do
    if mountpoint -q $EXP/$h/store; then
        # before ganesha stops: a fuse-nfs that cannot reach it blocks the
        # unmount (and spins); it ignores SIGTERM
        # (a blocked umount is not ended by a signal to it: kill fuse-nfs)
        umount $EXP/$h/store & u=$!
        for i in $(seq 1 100); do kill -0 $u 2>/dev/null || break; sleep 0.1; done
        if kill -0 $u 2>/dev/null; then
            echo "$(ts) $h: umount blocked 10 s, fuse-nfs killed"
            kill -KILL $(cat $EXP/$h/fuse-nfs.pid)
        fi
        wait $u
    fi
    echo "$(ts) $h: unmounted"
done
if [ -f ganesha.pid ] && kill -0 $(cat ganesha.pid) 2>/dev/null; then
    p=$(cat ganesha.pid); kill -TERM $p
    for i in $(seq 1 100); do kill -0 $p 2>/dev/null || break; sleep 0.1; done
    echo "$(ts) ganesha $p stopped"; rm -f ganesha.pid
fi
if [ -f rpcbind.pid ]; then kill -TERM $(cat rpcbind.pid) 2>/dev/null; rm -f rpcbind.pid; echo "$(ts) rpcbind stopped"; fi
for h in $HOSTS; do ip netns del $h 2>/dev/null && echo "$(ts) netns $h deleted"; done
