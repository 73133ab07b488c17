#!/usr/bin/env bash
# make asan: nginx 1.22.1 from Debian's nginx source package, built with
# AddressSanitizer (and NGX_DEBUG_PALLOC, so every pool allocation is its
# own malloc), plus this module built the same way.  Prints the two paths;
# run the suite with them:
#
#   NGINX_BINARY=.../sbin/nginx NGINX_MODULE=.../ngx_http_llama_session_module.so \
#   ASAN_OPTIONS=detect_odr_violation=0:detect_leaks=0 prove t/
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
cache=${LLAMA_RIG_CACHE:-/var/cache/llama-session-rig}
dir=$cache/nginx-asan
log() { echo "build-asan-nginx: $*" >&2; }

mkdir -p "$dir"
cd "$dir"

# the source package comes from apt's lists; its deb-src and the apt-get
# update are make deps's (rig/deb-src.sh), this script changes nothing
# outside the cache
if ! ls nginx_*.orig.tar.gz >/dev/null 2>&1; then
    records=$(apt-cache showsrc nginx 2>/dev/null) || true
    if ! grep -q '^Version: ' <<<"$records"; then
        log "nginx's source package is not in the cache, and apt knows no"
        log "such source (Debian's deb-src): run 'make deps ASAN=1' first"
        log "(make asan and make test-asan run it)"
        exit 1
    fi
    log "fetching Debian's nginx source package"
    apt-get source --download-only nginx >/dev/null 2>&1 || true
    ls nginx_*.orig.tar.gz >/dev/null 2>&1 \
        || { log "no nginx source package could be fetched"; exit 1; }
fi

src=$(ls -d nginx-1.*/ 2>/dev/null | head -n 1 || true)
if [ -z "$src" ]; then
    tar xzf nginx_*.orig.tar.gz
    src=$(ls -d nginx-1.*/ | head -n 1)
fi
src=${src%/}

cd "$src"
log "building $src with AddressSanitizer and the module"
./configure --prefix="$dir/prefix" --with-debug --with-compat \
    --with-http_auth_request_module --with-http_realip_module \
    --with-http_ssl_module --with-http_v2_module --with-threads \
    --with-cc-opt="-O1 -g -fno-omit-frame-pointer -fsanitize=address -DNGX_DEBUG_PALLOC=1" \
    --with-ld-opt="-fsanitize=address" \
    --add-dynamic-module="$here" >"$dir/configure.log" 2>&1 \
    || { tail -n 30 "$dir/configure.log" >&2; exit 1; }
make -j"$(nproc)" >"$dir/make.log" 2>&1 \
    || { tail -n 30 "$dir/make.log" >&2; exit 1; }

echo "NGINX_BINARY=$dir/$src/objs/nginx"
echo "NGINX_MODULE=$dir/$src/objs/ngx_http_llama_session_module.so"
