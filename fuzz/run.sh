#!/usr/bin/env bash
# Fuzzes the module with libFuzzer and AddressSanitizer for a while:
#   fuzz/run.sh [seconds] [target]    (default 60 seconds each, all targets;
#                                      needs `make` to have run once)
# Targets:
#   json      the body scanner alone (ngx_http_llama_session_json.c)
#   identity  ngx_http_llama_session_identify() on any body (body.c):
#             field paths, types, id cap, system-prompt digest, key, the
#             messages' digests (miss.c), the billing header's rewrite
#             (canon.c)
#   replies   the slot reply parsers (slots.c): GET /slots, save, restore,
#             erase, GET /props, GET /v1/models
#   ollama    Ollama's translation (ollama.c, convert.c): requests, SSE
#             events, whole replies
#   anthropic Anthropic's translation (anthropic.c, convert.c): requests and
#             warm primes, SSE events (checked as Anthropic's event
#             sequence), whole replies
#   turn      what the re-prime reads: a chat reply's assistant message,
#             streamed or whole (turn.c), and a model file's GGUF header
#             (gguf.c)
#   differential  the module's reading of a body (the scanner, identify())
#             against llama-server's own JSON library (nlohmann's json.hpp
#             from the rig's llama.cpp tree, rig/build-llama-server.sh):
#             the members, roles, model and probe llama-server takes
# identity and replies take ngx_sprintf() and its kin from nginx's own
# src/core/ngx_string.c: $NGX_STRING_C, else the nginx source tree, else
# the one fetched once into objs/nginx-src by `apt-get source` (Debian's
# nginx, whose headers nginx-dev installs: `apt-get update` first).
# Crashes are written to objs/<target>-crash-*, corpora kept in
# objs/<target>_corpus.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
src=/usr/share/nginx/src
mod=$here/ngx_http_llama_session_module
secs=${1:-60}
targets=${2:-json identity replies ollama anthropic turn differential}
inc="-I $src/src/core -I $src/src/event -I $src/src/event/modules
     -I $src/src/os/unix -I $src/src/http -I $src/src/http/modules
     -I $src/src/http/v2 -I $here/objs -I $mod -I $here/fuzz"

ngx_string_c() {
    local f dir tgz ver
    for f in "${NGX_STRING_C:-}" "$src/src/core/ngx_string.c" \
             "$here/objs/nginx-src/ngx_string.c"; do
        if [ -n "$f" ] && [ -f "$f" ]; then echo "$f"; return; fi
    done
    dir=$here/objs/nginx-src
    mkdir -p "$dir"
    # apt fails on the parts it cannot fetch (the .dsc of a security
    # update): only the upstream tarball is needed
    (cd "$dir" && apt-get source --download-only nginx >&2) || true
    tgz=$(ls "$dir"/nginx_*.orig.tar.gz 2>/dev/null | head -1)
    if [ -z "$tgz" ]; then
        echo "fuzz/run.sh: no ngx_string.c: set NGX_STRING_C to one" >&2
        exit 1
    fi
    tar -xzf "$tgz" -C "$dir" --wildcards --strip-components=3 \
        '*/src/core/ngx_string.c'
    ver=$(sed -n 's/^#define NGINX_VERSION *"\(.*\)"/\1/p' \
          "$src/src/core/nginx.h")
    case $tgz in
    *"_$ver.orig.tar.gz") ;;
    *) echo "fuzz/run.sh: $tgz is not nginx $ver of the headers" >&2 ;;
    esac
    echo "$dir/ngx_string.c"
}

build() {
    local t=$1 files
    case $t in
    json)     files="$here/fuzz/json_fuzz.c $mod/ngx_http_llama_session_json.c"
              libs=-lcjson ;;
    identity) files="$here/fuzz/identity_fuzz.c $here/fuzz/fuzz_ngx.c
                     $mod/ngx_http_llama_session_canon.c
                     $mod/ngx_http_llama_session_json.c
                     $mod/ngx_http_llama_session_miss.c $(ngx_string_c)"
              libs="-lcjson -lcrypto" ;;
    replies)  files="$here/fuzz/replies_fuzz.c $here/fuzz/fuzz_ngx.c
                     $mod/ngx_http_llama_session_json.c $(ngx_string_c)"
              libs="-lcjson -lcrypto" ;;
    ollama)   files="$here/fuzz/ollama_fuzz.c $here/fuzz/fuzz_ngx.c
                     $here/fuzz/conv_stubs.c
                     $mod/ngx_http_llama_session_convert.c
                     $mod/ngx_http_llama_session_json.c $(ngx_string_c)"
              libs="-lcjson -lcrypto" ;;
    anthropic) files="$here/fuzz/anthropic_fuzz.c $here/fuzz/fuzz_ngx.c
                     $here/fuzz/conv_stubs.c
                     $mod/ngx_http_llama_session_convert.c
                     $mod/ngx_http_llama_session_json.c $(ngx_string_c)"
              libs="-lcjson -lcrypto" ;;
    turn)     files="$here/fuzz/turn_fuzz.c $here/fuzz/fuzz_ngx.c
                     $mod/ngx_http_llama_session_file.c
                     $here/fuzz/conv_stubs.c $(ngx_string_c)"
              libs="-lcjson -lcrypto" ;;
    differential)
              # C for the module's side, C++ for llama-server's library
              llama=$("$here/rig/build-llama-server.sh")
              vendor=$(dirname "$(dirname "$llama")")/src/vendor
              nice -n 19 clang -g -O1 -fsanitize=fuzzer-no-link,address $inc \
                  -c "$here/fuzz/differential.c" -o "$here/objs/differential.o"
              nice -n 19 clang -g -O1 -fsanitize=fuzzer-no-link,address $inc \
                  -c "$here/fuzz/fuzz_ngx.c" -o "$here/objs/differential_ngx.o"
              nice -n 19 clang -g -O1 -fsanitize=fuzzer-no-link,address $inc \
                  -c "$mod/ngx_http_llama_session_json.c" \
                  -o "$here/objs/differential_json.o"
              nice -n 19 clang -g -O1 -fsanitize=fuzzer-no-link,address $inc \
                  -c "$mod/ngx_http_llama_session_miss.c" \
                  -o "$here/objs/differential_miss.o"
              nice -n 19 clang -g -O1 -fsanitize=fuzzer-no-link,address $inc \
                  -c "$mod/ngx_http_llama_session_canon.c" \
                  -o "$here/objs/differential_canon.o"
              nice -n 19 clang -g -O1 -fsanitize=fuzzer-no-link,address $inc \
                  -c "$(ngx_string_c)" -o "$here/objs/differential_string.o"
              nice -n 19 clang++ -g -O1 -std=c++17 -fsanitize=fuzzer,address \
                  -I "$vendor" -I "$here/fuzz" "$here/fuzz/differential_fuzz.cc" \
                  "$here/objs/differential.o" "$here/objs/differential_ngx.o" \
                  "$here/objs/differential_json.o" \
                  "$here/objs/differential_miss.o" \
                  "$here/objs/differential_canon.o" \
                  "$here/objs/differential_string.o" -lcjson -lcrypto \
                  -o "$here/objs/differential_fuzz"
              return ;;
    *)        echo "fuzz/run.sh: unknown target \"$t\"" >&2; exit 1 ;;
    esac
    # shellcheck disable=SC2086
    nice -n 19 clang -g -O1 -fsanitize=fuzzer,address $inc $files $libs \
        -o "$here/objs/${t}_fuzz"
}

seeds() {
    local t=$1
    mkdir -p "$here/objs/${t}_corpus"
    if [ "$t" = replies ]; then
        cp "$here"/fuzz/seeds/replies/* "$here/objs/${t}_corpus/"
    elif [ "$t" = differential ]; then
        find "$here/fuzz/seeds" "$here/fuzz/seeds/differential" -maxdepth 1 \
            -type f -exec cp {} "$here/objs/${t}_corpus/" \;
    elif [ "$t" = ollama ] || [ "$t" = anthropic ]; then
        cp "$here"/fuzz/seeds/"$t"/* "$here/objs/${t}_corpus/"
    else
        find "$here/fuzz/seeds" -maxdepth 1 -type f \
            -exec cp {} "$here/objs/${t}_corpus/" \;
    fi
}

failed=0
for t in $targets; do
    build "$t"
    seeds "$t"
    dict=()
    if [ -f "$here/fuzz/$t.dict" ]; then dict=(-dict="$here/fuzz/$t.dict"); fi
    echo "fuzz/run.sh: $t for $secs s" >&2
    nice -n 19 "$here/objs/${t}_fuzz" -max_total_time="$secs" -max_len=4096 \
        -timeout=10 -artifact_prefix="$here/objs/${t}-" "${dict[@]}" \
        "$here/objs/${t}_corpus" || failed=1
done
exit $failed
