#!/usr/bin/env bash
# make demo: the rig's llama-server with the small model behind nginx with
# the module on localhost, a short scripted run of two sessions, and where
# to point a client.  DEMO_PORT (default 8000) is nginx's port; DEMO_KEEP=1
# keeps the stack running until Ctrl-C.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
port=${DEMO_PORT:-8000}
llama_bin=$("$here/rig/build-llama-server.sh")
model=$("$here/rig/make-model.sh")
dir=$(mktemp -d /tmp/llama-session-demo.XXXXXX)
mkdir -p "$dir/slots" "$dir/logs" "$dir/tmp"
chmod 755 "$dir"
# the store folder as docs/directives.md sets it up: nginx's workers
# (www-data) rename and delete what llama-server writes there
chgrp www-data "$dir/slots"
chmod 2775 "$dir/slots"

llama_port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')

cleanup() {
    [ -f "$dir/nginx.pid" ] && kill -QUIT "$(cat "$dir/nginx.pid")" 2>/dev/null || true
    [ -n "${llama_pid:-}" ] && kill "$llama_pid" 2>/dev/null || true
    wait 2>/dev/null || true
    echo "demo stopped; logs are in $dir"
}
trap cleanup EXIT

echo "== starting llama-server on 127.0.0.1:$llama_port (small random-weight model)"
"$llama_bin" -m "$model" --host 127.0.0.1 --port "$llama_port" -c 16384 \
    -np 1 --slot-save-path "$dir/slots" --no-kv-unified \
    --no-cache-idle-slots -sps 0 --cache-ram 0 -t 2 --no-webui \
    >"$dir/logs/llama-server.log" 2>&1 &
llama_pid=$!

for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$llama_port/health" >/dev/null 2>&1 && break
    sleep 0.2
done

# the example configuration, pointed at this run's folders and ports
sed -e "s#/usr/lib/nginx/modules/ngx_http_llama_session_module.so#$here/objs/ngx_http_llama_session_module.so#" \
    -e "s#/var/cache/llama-slots#$dir/slots#" \
    -e "s#127.0.0.1:8080#127.0.0.1:$llama_port#" \
    -e "s#127.0.0.1:8000#127.0.0.1:$port#" \
    -e "s#/var/log/nginx/llama.log#$dir/logs/access.log#" \
    -e "s#worker_processes auto;#worker_processes 2;\npid $dir/nginx.pid;\nerror_log $dir/logs/error.log info;#" \
    -e "s#^http {#http {\n    client_body_temp_path $dir/tmp/body;\n    proxy_temp_path $dir/tmp/proxy;#" \
    "$here/examples/nginx.conf" >"$dir/nginx.conf"

echo "== starting nginx with the module on 127.0.0.1:$port"
/usr/sbin/nginx -p "$dir/" -c "$dir/nginx.conf" -e "$dir/logs/error.log"

for _ in $(seq 1 50); do
    curl -s -o /dev/null "http://127.0.0.1:$port/health" && break
    sleep 0.1
done

system=$(python3 -c 'print(" ".join("Rule %d: answer briefly and cite the handbook section %d." % (i, i) for i in range(350)))')

ask() { # session, user text
    local t0 t1 body
    body=$(python3 -c 'import json,sys; print(json.dumps({"messages":[{"role":"system","content":sys.argv[1]},{"role":"user","content":sys.argv[2]}],"max_tokens":8,"temperature":0}))' "$system" "$2")
    t0=$(date +%s.%N)
    curl -s -D "$dir/h" -H "Content-Type: application/json" \
        -H "X-Session-Id: $1" -d "$body" \
        "http://127.0.0.1:$port/v1/chat/completions" >"$dir/r"
    t1=$(date +%s.%N)
    python3 - "$1" "$dir/r" "$dir/h" "$t0" "$t1" <<'PY'
import json, sys
s, r, h, t0, t1 = sys.argv[1:]
d = json.load(open(r))
act = [l.split(":", 1)[1].strip() for l in open(h) if l.lower().startswith("x-llama-session-action")]
u = d.get("usage", {})
print("  session %-6s action %-8s prompt %5d tokens, cached %5d, %6.2f s"
      % (s, act[0] if act else "?", u.get("prompt_tokens", 0),
         u.get("prompt_tokens_details", {}).get("cached_tokens", 0),
         float(t1) - float(t0)))
PY
}

echo "== two sessions take turns on llama-server's one slot"
ask alice "What is rule 1?"
ask bob   "What is rule 2?"
ask alice "What is rule 1?"
ask bob   "What is rule 2?"

echo "== saved sessions in llama-server's --slot-save-path:"
ls -l "$dir/slots" | sed 's/^/  /'
echo "== the swaps, from nginx's error log:"
grep -o 'llama_session: swap.*ms in all' "$dir/logs/error.log" | sed 's/^/  /'

cat <<EOF

Point a client at http://127.0.0.1:$port/v1 (OpenAI API) or
http://127.0.0.1:$port/completion, with an X-Session-Id header per conversation.
EOF

if [ "${DEMO_KEEP:-0}" = 1 ]; then
    echo "running until Ctrl-C"
    wait "$llama_pid"
fi
