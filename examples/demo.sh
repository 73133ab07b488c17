#!/usr/bin/env bash
# make demo: the rig's llama-server with the small model behind nginx with
# the module on localhost, a short scripted run of two sessions, and where
# to point a client.  It fails (exit 1, with the reason) when a turn fails
# or a returning turn does not come back from its cache.
#
#   DEMO_PORT        nginx's port (8000)
#   DEMO_KEEP=1      keep the stack running until Ctrl-C
#   DEMO_RULES       the system prompt's size in rules (350: ~6,800 tokens)
#   DEMO_LLAMA_ARGS  more llama-server flags (the tests use it)
#   NGINX_BINARY, NGINX_MODULE  another nginx and module build
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
port=${DEMO_PORT:-8000}
rules=${DEMO_RULES:-350}
nginx_bin=${NGINX_BINARY:-/usr/sbin/nginx}
module=${NGINX_MODULE:-$here/objs/ngx_http_llama_session_module.so}
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
    ${DEMO_LLAMA_ARGS:-} >"$dir/logs/llama-server.log" 2>&1 &
llama_pid=$!

fail() {
    echo "demo FAILED: $*" >&2
    exit 1
}

up=0
for _ in $(seq 1 300); do
    if curl -sf "http://127.0.0.1:$llama_port/health" >/dev/null 2>&1; then
        up=1
        break
    fi
    kill -0 "$llama_pid" 2>/dev/null || break
    sleep 0.2
done
[ "$up" = 1 ] || fail "llama-server did not start, see $dir/logs/llama-server.log"

# the example configuration, pointed at this run's folders and ports
# (one slot, as llama-server's -np 1: the two sessions take turns on it)
sed -e "s#/usr/lib/nginx/modules/ngx_http_llama_session_module.so#$module#" \
    -e "s#/var/lib/llama-session#$dir/slots#" \
    -e "s#slots=4#slots=1#" \
    -e "s#127.0.0.1:8080#127.0.0.1:$llama_port#" \
    -e "s#127.0.0.1:8000#127.0.0.1:$port#" \
    -e "s#/var/log/nginx/llama.log#$dir/logs/access.log#" \
    -e "s#worker_processes auto;#worker_processes 2;\npid $dir/nginx.pid;\nerror_log $dir/logs/error.log info;#" \
    -e "s#^http {#http {\n    client_body_temp_path $dir/tmp/body;\n    proxy_temp_path $dir/tmp/proxy;#" \
    "$here/examples/nginx.conf" >"$dir/nginx.conf"

echo "== starting nginx with the module on 127.0.0.1:$port"
"$nginx_bin" -p "$dir/" -c "$dir/nginx.conf" -e "$dir/logs/error.log" \
    || fail "nginx did not start, see $dir/logs/error.log"

up=0
for _ in $(seq 1 50); do
    if curl -s -o /dev/null "http://127.0.0.1:$port/health"; then
        up=1
        break
    fi
    sleep 0.1
done
[ "$up" = 1 ] || fail "nginx does not answer on 127.0.0.1:$port"

system=$(python3 -c 'import sys; print(" ".join("Rule %d: answer briefly and cite the handbook section %d." % (i, i) for i in range(int(sys.argv[1]))))' "$rules")

ask() { # session, user text, what the turn must show: first | returning
    local t0 t1 body
    body=$(python3 -c 'import json,sys; print(json.dumps({"messages":[{"role":"system","content":sys.argv[1]},{"role":"user","content":sys.argv[2]}],"max_tokens":8,"temperature":0}))' "$system" "$2")
    t0=$(date +%s.%N)
    curl -s -D "$dir/h" -o "$dir/r" -H "Content-Type: application/json" \
        -H "X-Session-Id: $1" -d "$body" \
        "http://127.0.0.1:$port/v1/chat/completions" \
        || fail "session $1: no reply from nginx"
    t1=$(date +%s.%N)
    python3 - "$1" "$3" "$dir/r" "$dir/h" "$t0" "$t1" <<'PY'
import json, sys
s, want, r, h, t0, t1 = sys.argv[1:]
lines = open(h, errors="replace").read().splitlines()
status = lines[0].split()[1] if lines and len(lines[0].split()) > 1 else "?"
act = [l.split(":", 1)[1].strip() for l in lines
       if l.lower().startswith("x-llama-session-action")]
act = act[0] if act else "?"
body = open(r, errors="replace").read()
try:
    d = json.loads(body)
except ValueError:
    d = {}
u = d.get("usage", {}) if isinstance(d, dict) else {}
prompt = u.get("prompt_tokens", 0)
cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
print("  session %-6s action %-8s prompt %5d tokens, cached %5d, %6.2f s"
      % (s, act, prompt, cached, float(t1) - float(t0)), flush=True)
if status != "200":
    sys.exit("demo FAILED: session %s: HTTP %s: %s" % (s, status, body.strip()[:300]))
if prompt == 0:
    sys.exit("demo FAILED: session %s: the reply shows no prompt tokens: %s"
             % (s, body.strip()[:300]))
if want == "returning" and (act not in ("restore", "hit")
                            or cached < 0.9 * prompt):
    sys.exit("demo FAILED: session %s came back with %d of its %d prompt tokens cached "
             "(action %s): its cache was not kept" % (s, cached, prompt, act))
PY
    [ $? = 0 ] || exit 1
}

echo "== two sessions take turns on llama-server's one slot"
ask alice "What is rule 1?" first
ask bob   "What is rule 2?" first
ask alice "What is rule 1?" returning
ask bob   "What is rule 2?" returning

echo "== saved sessions in llama-server's --slot-save-path:"
ls -l "$dir/slots" | sed 's/^/  /'
echo "== the swaps, from nginx's error log:"
grep -o 'llama_session: swap.*ms in all' "$dir/logs/error.log" | sed 's/^/  /' || true
for s in alice bob; do
    grep -q "llama_session: swap.* in \"$s-[^\"]*\" restored" "$dir/logs/error.log" \
        || fail "no swap in nginx's error log restored session $s"
done
echo "== demo passed: both sessions came back from their caches"

cat <<EOF

Point a client at http://127.0.0.1:$port/v1 (OpenAI API) or
http://127.0.0.1:$port/completion, with an X-Session-Id header per conversation.
EOF

if [ "${DEMO_KEEP:-0}" = 1 ]; then
    echo "running until Ctrl-C"
    wait "$llama_pid"
fi
