#!/usr/bin/env bash
# make deps-src (run by make deps): the apt sources of the Debian source
# packages that rig/build-nginx.sh and rig/build-asan-nginx.sh fetch, and
# apt-get update.  Those scripts only download and build into the cache;
# this one, run before the tests, is the only one that changes apt's
# configuration.  Arguments, what is to be built:
#
#   VERSION   nginx VERSION for make test NGINX_VERSION=VERSION
#             (1.26.*: Debian 13 "trixie"; 1.22.*: Debian 12 "bookworm";
#             1.30.*, 1.31.*: nginx.org's, from ../shared/nginx/, nothing)
#   asan      the machine's own nginx source package, for make asan
#
# Nothing is done for a source package the cache holds already, nor when
# apt knows it: a second run changes nothing.
set -euo pipefail

cache=${LLAMA_RIG_CACHE:-/var/cache/llama-session-rig}
log() { echo "deb-src: $*" >&2; }

own=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")

# the source package is known to apt: VERSION, or any version
known() {
    local records
    records=$(apt-cache showsrc nginx 2>/dev/null) || true
    grep -q "^Version: ${1:+$1-}" <<<"$records"
}

# deb-src of the suite in apt's sources: a one-line entry, or a deb822
# paragraph whose Types has deb-src and whose Suites has the suite
configured() {
    local suite=$1
    local lines
    lines=$(grep -hsE "^deb-src[[:space:]]+(\[[^]]*\][[:space:]]+)?[^[:space:]]+[[:space:]]+$suite([[:space:]]|$)" \
                 /etc/apt/sources.list /etc/apt/sources.list.d/*.list) || true
    [ -n "$lines" ] && return 0
    local f
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] || continue
        awk -v suite="$suite" '
            function check() { if (src && has && on) found = 1
                               src = has = 0; on = 1 }
            BEGIN { on = 1 }
            /^[[:space:]]*$/ { check(); next }
            tolower($1) == "types:" {
                for (i = 2; i <= NF; i++) if ($i == "deb-src") src = 1 }
            tolower($1) == "suites:" {
                for (i = 2; i <= NF; i++) if ($i == suite) has = 1 }
            tolower($1) == "enabled:" && tolower($2) == "no" { on = 0 }
            END { check(); exit !found }' "$f" && return 0
    done
    return 1
}

suites=()
for what in "$@"; do
    case "$what" in
        asan)
            ls "$cache"/nginx-asan/nginx_*.orig.tar.gz >/dev/null 2>&1 \
                && continue
            known "" && continue
            suite=$own ;;
        1.26.*|1.22.*)
            ls "$cache/nginx-$what/nginx_$what.orig.tar.gz" >/dev/null 2>&1 \
                && continue
            known "$what" && continue
            case "$what" in
                1.26.*) suite=trixie ;;
                1.22.*) suite=bookworm ;;
            esac ;;
        1.30.*|1.31.*)
            # nginx.org's lines: rig/build-nginx.sh builds them from the
            # source trees in ../shared/nginx/, no apt source needed
            continue ;;
        *)
            log "no Debian source package known for nginx $what"
            exit 1 ;;
    esac
    [ -n "$suite" ] || { log "the machine's Debian release is unknown"; exit 1; }
    suites+=("$suite")
done

[ ${#suites[@]} -gt 0 ] || exit 0

for suite in $(printf '%s\n' "${suites[@]}" | sort -u); do
    configured "$suite" && continue
    if [ "$suite" = "$own" ] && [ -f /etc/apt/sources.list.d/debian.sources ]
    then
        # the machine's own release: its entries get deb-src beside deb
        log "enabling Debian source packages in debian.sources"
        sed -i 's/^Types: deb$/Types: deb deb-src/' \
            /etc/apt/sources.list.d/debian.sources
    else
        # sources only: nothing of the other release gets installed
        list=/etc/apt/sources.list.d/llama-session-$suite-src.sources
        log "adding Debian $suite's source packages to apt ($list)"
        uri=$("$(dirname "$0")/debian-mirror.sh")
        cat >"$list" <<EOS
Types: deb-src
URIs: $uri
Suites: $suite
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOS
    fi
done

log "apt-get update"
apt-get update -qq

for what in "$@"; do
    v=$what
    [ "$what" = asan ] && v=
    ls "$cache/nginx-${v:-asan}"/nginx_*.orig.tar.gz >/dev/null 2>&1 \
        || known "$v" \
        || { log "apt knows no source package of nginx ${v:-(any)} after the update"; exit 1; }
done
