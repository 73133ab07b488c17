#!/usr/bin/env bash
# make test NGINX_VERSION=...: nginx of another version, built with the
# modules the suite uses, and this module built against it.  Cached; prints
# the two paths for the suite:
#
#   NGINX_BINARY=.../objs/nginx NGINX_MODULE=.../ngx_http_llama_session_module.so
#
# 1.22.*, 1.26.*: Debian's source package (Debian 12 "bookworm", Debian 13
# "trixie"; make test's default is the machine's own, with debug, so these
# are built without).  1.30.*, 1.31.*:
# nginx.org's stable and mainline lines, from the source trees in
# ../shared/nginx/ (NGINX_SOURCES= another folder), configured as nginx.org
# builds its packages' nginx: --with-compat, threads, SSL, HTTP/2, no debug.
set -euo pipefail

version=${1:?usage: build-nginx.sh VERSION}
here=$(cd "$(dirname "$0")/.." && pwd)
cache=${LLAMA_RIG_CACHE:-/var/cache/llama-session-rig}
dir=$cache/nginx-$version
log() { echo "build-nginx: $*" >&2; }

case "$version" in
    1.26.*) suite=trixie ;;
    1.22.*) suite=bookworm ;;
    1.30.*|1.31.*) suite= ;;
    *) log "no source known for nginx $version (Debian's 1.22, 1.26;"
       log "nginx.org's 1.30, 1.31 from ../shared/nginx/)"; exit 1 ;;
esac

mkdir -p "$dir"
cd "$dir"

src=nginx-$version

if [ -z "$suite" ]; then
    # nginx.org's line: a git archive of the release tag (auto/configure)
    tarball=${NGINX_SOURCES:-$here/../shared/nginx}/nginx-$version.tar.gz
    if [ ! -d "$src" ]; then
        [ -f "$tarball" ] || { log "no $tarball"; exit 1; }
        tar xzf "$tarball"
        [ -x "$src/auto/configure" ] || { log "no $src/ in $tarball"; exit 1; }
    fi
    configure=auto/configure
    # nginx.org's own flags for its packages, as `nginx -V` shows them
    ccopt="-O2 -g -fstack-protector-strong -Wformat -Werror=format-security"
    ccopt="$ccopt -Wp,-D_FORTIFY_SOURCE=2 -fPIC"
    debug=
else
    # the source package comes from apt's lists; its deb-src and the
    # apt-get update are make deps's (rig/deb-src.sh), this script changes
    # nothing outside the cache
    if ! ls nginx_"$version".orig.tar.gz >/dev/null 2>&1; then
        records=$(apt-cache showsrc nginx 2>/dev/null) || true
        if ! grep -q "^Version: $version-" <<<"$records"; then
            log "nginx $version's source package is not in the cache, and apt"
            log "knows no such source (Debian $suite's deb-src): run"
            log "'make deps NGINX_VERSION=$version' first (make test"
            log "NGINX_VERSION=$version runs it)"
            exit 1
        fi
        log "fetching nginx $version's source package"
        apt-get source --download-only "nginx=$version-*" >/dev/null 2>&1 \
            || apt-get source --download-only "nginx/$suite" >/dev/null 2>&1 \
            || true
        ls nginx_"$version".orig.tar.gz >/dev/null 2>&1 \
            || { log "nginx $version's source could not be fetched"; exit 1; }
    fi
    [ -d "$src" ] || tar xzf nginx_"$version".orig.tar.gz
    configure=./configure
    ccopt="-O2 -g -Wall -Wextra -Wno-unused-parameter -Werror"
    debug=
fi

# rebuilt when the module's sources are newer than the last build
stamp=$dir/$src/objs/ngx_http_llama_session_module.so
if [ ! -e "$stamp" ] \
    || [ -n "$(find "$here/config" "$here/ngx_http_llama_session_module" \
                    -newer "$stamp" -print -quit)" ]
then
    cd "$src"
    log "building nginx $version and the module"
    $configure --prefix="$dir/prefix" --with-compat --with-threads \
        --with-http_auth_request_module --with-http_realip_module \
        --with-http_ssl_module --with-http_v2_module $debug \
        --with-cc-opt="$ccopt" \
        --add-dynamic-module="$here" >"$dir/configure.log" 2>&1 \
        || { tail -n 30 "$dir/configure.log" >&2; exit 1; }
    make -j"$(nproc)" >"$dir/make.log" 2>&1 \
        || { tail -n 30 "$dir/make.log" >&2; exit 1; }
fi

echo "NGINX_BINARY=$dir/$src/objs/nginx"
echo "NGINX_MODULE=$dir/$src/objs/ngx_http_llama_session_module.so"
