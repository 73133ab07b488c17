#!/bin/bash
# scenario.sh part1|part2 : the turns (run under /tmp/run-locked)
set -u
. "$(dirname "$0")/env.sh"
cd $EXP
declare -A mark
for h in $HOSTS; do mark[$h]=$(wc -l < $h/error.log 2>/dev/null || echo 0); done

# new swap/shared/error lines of each error.log since the last call
logs() {
    local h n
    for h in $HOSTS; do
        n=$(wc -l < $h/error.log)
        sed -n "$((mark[$h]+1)),${n}p" $h/error.log \
          | grep -E 'swap on slot|idle save|another owner|\[(warn|error|crit|alert|emerg)\]|stale|ESTALE|EIO' \
          | sed -E "s/^[0-9\/]+ ([0-9:]+) \[([a-z]+)\] [0-9#]+: (\*[0-9]+ )?/  $h \1 [\2] /; s/, client: .*//"
        mark[$h]=$n
    done
}
files() {
    echo "  export:"
    (cd $EXPORT && for f in *; do [ -e "$f" ] || continue; printf '    %-70s ino=%s size=%s mtime=%s %s\n' "$f" \
        $(stat -c '%i %s %y' "$f" | awk '{print $1, $2, $4}') \
        "$(case $f in *.json) python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); print("tokens=%s" % j.get("tokens"))' "$f" 2>/dev/null;; esac)"; done)
}
# wait until HOST's error.log has N lines "idle save of" (at most 20 s)
wait_idle_save() {
    local h=$1 n=$2 i t0=$(date +%s.%N)
    for i in $(seq 1 200); do
        [ $(grep -c 'idle save of' $h/error.log) -ge $n ] && break; sleep 0.1
    done
    echo "  $h: idle saves in log: $(grep -c 'idle save of' $h/error.log) (waited $(echo "$(date +%s.%N) - $t0" | bc | cut -c1-4) s)"
}
turn() { NFS_EXP=$EXP python3 "$HERE/turn.py" "$@"; }
metrics() {
    echo "  $1 metrics: $(ip netns exec $1 curl -s -m 10 http://127.0.0.1:8080/metrics | grep -E '^nginx_llama_session_(shared_newer_total|swaps_total|restores_total|saves_total|errors_total)' | tr '\n' ' ')"
}

part1() {
    echo "== step 1: s1's first turn on h1 (fresh), h1 idle-saves it through its mount"
    turn h1 s1
    wait_idle_save h1 1
    logs; files
    echo "  seen through h2's mount: $(ls $EXP/h2/store | tr '\n' ' ')"

    echo "== step 2: s1's next turn on h2 (expected restore, cached >= 90 %)"
    turn h2 s1
    logs
    wait_idle_save h2 1
    logs; files

    echo "== step 3: s1 on h1 again (its slot holds s1's first turn; expected restore of h2's newer file)"
    turn h1 s1
    logs
    grep -c 'out its own older state (another owner saved a newer one since)' h1/error.log | sed 's/^/  h1 lines "out its own older state": /'
    wait_idle_save h1 2
    logs; files; metrics h1; metrics h2

    echo "== step 3b: a swap save in the request path: s1 on h1, then at once s2 on h1 (s1 out, saved), then s1 on h2"
    turn h1 s1
    turn h1 s2
    logs; files
    turn h2 s1
    logs
    wait_idle_save h2 2
    wait_idle_save h1 3
    logs; files; metrics h1; metrics h2
}

part2() {
    echo "== step 4: ganesha stopped (the store gone) for at most 60 s; a turn on h1 (new session s3) and on h2 (s2, never on h2)"
    local gp=$(cat ganesha.pid) f1=$(pgrep -f "fuse-nfs .*-m $EXP/h1/store") f2=$(pgrep -f "fuse-nfs .*-m $EXP/h2/store")
    cpu() { echo "fuse-nfs cpu h1 $(ps -o time= -p $f1) h2 $(ps -o time= -p $f2)"; }
    echo "  $(ts) $(cpu)"
    kill -TERM $gp
    for i in $(seq 1 100); do kill -0 $gp 2>/dev/null || break; sleep 0.1; done
    kill -0 $gp 2>/dev/null && echo "  ganesha $gp still up" || echo "  $(ts) ganesha $gp stopped"
    turn h1 s3 150 & local p1=$!
    sleep 0.5
    turn h2 s2 150 & local p2=$!
    local t0=$(date +%s)
    for i in $(seq 1 60); do
        kill -0 $p1 2>/dev/null || kill -0 $p2 2>/dev/null || break
        sleep 1
    done
    echo "  $(ts) after $(( $(date +%s) - t0 )) s: $(cpu)"
    if kill -0 $p1 2>/dev/null || kill -0 $p2 2>/dev/null; then
        echo "  turns still waiting; processes:"
        for h in $HOSTS; do
            for p in $(cat $h/nginx.master) $(ps -o pid= --ppid $(cat $h/nginx.master)) $(cat $h/llama.pid); do
                echo "    $h $(ps -o pid=,user=,stat=,wchan:22=,comm= -p $p)"
            done
            echo "    $h metrics (5 s): $(ip netns exec $h curl -s -m 5 -o /dev/null -w '%{http_code} %{time_total}s' http://127.0.0.1:8080/metrics)"
        done
    fi
    logs
    echo "  $(ts) starting ganesha again"
    ganesha.nfsd -f $EXP/ganesha.conf -L $EXP/ganesha.log -p $EXP/ganesha.pid -N NIV_EVENT
    wait $p1 $p2
    echo "  $(ts) both turns done; $(cpu)"
    logs
    echo "  $(ts) ls of h1's mount: $(timeout 10 ls $EXP/h1/store 2>&1 | wc -l) entries, of h2's: $(timeout 10 ls $EXP/h2/store 2>&1 | wc -l)"
    sleep 3
    logs; files
    echo "== step 4b: ganesha back: s1 on h1 (slot holds s3): expected restore; s3 on h2"
    turn h1 s1
    turn h2 s3
    sleep 2
    logs; files; metrics h1; metrics h2
}
$1
