#!/usr/bin/env bash
# Fuzzes the body scanner with libFuzzer and AddressSanitizer for a while:
#   fuzz/run.sh [seconds]        (default 60; needs `make` to have run once)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
src=/usr/share/nginx/src
out=$here/objs/json_fuzz
inc="-I $src/src/core -I $src/src/event -I $src/src/event/modules
     -I $src/src/os/unix -I $src/src/http -I $src/src/http/modules
     -I $src/src/http/v2 -I $here/objs -I $here/ngx_http_llama_session_module"
clang -g -O1 -fsanitize=fuzzer,address $inc \
    "$here/fuzz/json_fuzz.c" \
    "$here/ngx_http_llama_session_module/ngx_http_llama_session_json.c" \
    -o "$out"
mkdir -p "$here/objs/json_corpus"
cp "$here"/fuzz/seeds/* "$here/objs/json_corpus/" 2>/dev/null || true
"$out" -max_total_time="${1:-60}" -max_len=4096 "$here/objs/json_corpus"
