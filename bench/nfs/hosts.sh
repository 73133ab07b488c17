#!/bin/bash
# hosts.sh start|stop [HOST...]: per host, a llama-server (as nobody, flags
# of LlamaTest::llama with -c 8192 as t/43) and an nginx (master, 2
# workers as www-data, the owner server of LlamaTest::owners / t/44), both
# in the host's netns and a UTS namespace named after the host
set -eu
. "$(dirname "$0")/env.sh"
cmd=$1; shift
hosts=${*:-$HOSTS}

conf() {
    local h=$1 d=$EXP/$1
    cat > $d/nginx.conf <<EOC
load_module $EXP/module.so;
worker_processes 2;
daemon off;
master_process on;
pid $d/nginx.pid;
error_log $d/error.log info;
user $NGX_USER;
events { worker_connections 1024; }

http {
    access_log $d/access.log;
    client_body_temp_path $d/tmp/body;
    proxy_temp_path $d/tmp/proxy;
    fastcgi_temp_path $d/tmp/fastcgi;
    uwsgi_temp_path $d/tmp/uwsgi;
    scgi_temp_path $d/tmp/scgi;

    llama_session_zone zone=$h:1m store=$d/store shared=on save_idle=1s;

    server {
        listen 127.0.0.1:8080;

        location / {
            llama_session $h;
            proxy_pass http://127.0.0.1:8081;
            proxy_read_timeout 300s;
            add_header X-S-Action \$llama_session_action always;
            add_header X-Backend $h always;
        }

        location /_llama_slots/ {
            internal;
            proxy_pass http://127.0.0.1:8081/;
        }

        location /api/ { llama_session_api $h; }
        location = /metrics { llama_session_metrics $h; }
    }
}
EOC
}

start() {
    local h=$1 d=$EXP/$1
    mkdir -p $d/tmp
    ip netns exec $h unshare --uts sh -c "hostname $h; exec setpriv --reuid=$LLAMA_UID --regid=$LLAMA_GID --clear-groups \
        $LLAMA -m $MODEL --host 127.0.0.1 --port 8081 -np 1 -c 8192 \
        --slot-save-path $d/store --no-kv-unified --no-cache-idle-slots \
        -sps 0 --cache-ram 0 -t 2 --no-webui" </dev/null >>$d/llama.log 2>&1 &
    echo $! > $d/llama.pid
    local i
    for i in $(seq 1 600); do
        [ "$(ip netns exec $h curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8081/health)" = 200 ] && break
        sleep 0.1
    done
    echo "$(ts) $h: llama-server pid $(cat $d/llama.pid) health after ${i}x0.1s"
    conf $h
    $NGINX -t -p $d/ -c $d/nginx.conf -e $d/nginx-t.log 2>&1 | tail -1
    ip netns exec $h unshare --uts sh -c "hostname $h; exec $NGINX -p $d/ -c $d/nginx.conf -e $d/error.log" \
        </dev/null >>$d/nginx.out 2>&1 &
    echo $! > $d/nginx.master
    for i in $(seq 1 100); do
        ip netns exec $h ss -ltn | grep -q '127.0.0.1:8080 ' && break; sleep 0.1
    done
    echo "$(ts) $h: nginx master $(cat $d/nginx.master), workers: $(ps -o user=,pid= --ppid $(cat $d/nginx.master) | tr '\n' ' ')"
}

stop() {
    local h=$1 d=$EXP/$1 p i
    if [ -f $d/nginx.master ]; then
        p=$(cat $d/nginx.master); kill -QUIT $p 2>/dev/null || true
        for i in $(seq 1 100); do kill -0 $p 2>/dev/null || break; sleep 0.1; done
        kill -0 $p 2>/dev/null && { echo "$h: nginx $p still up after 10 s, KILL"; kill -KILL $p; }
        rm -f $d/nginx.master
    fi
    if [ -f $d/llama.pid ]; then
        p=$(cat $d/llama.pid); kill -TERM $p 2>/dev/null || true
        for i in $(seq 1 100); do kill -0 $p 2>/dev/null || break; sleep 0.1; done
        kill -0 $p 2>/dev/null && { echo "$h: llama-server $p still up after 10 s, KILL"; kill -KILL $p; }
        rm -f $d/llama.pid
    fi
    echo "$(ts) $h: stopped"
}

for h in $hosts; do $cmd $h; done
