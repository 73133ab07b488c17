#!/usr/bin/env bash
# Prints the URI of the Debian archive that this machine's apt sources use
# for its own release (a one-line entry or a deb822 paragraph), for the
# other Debian release's sources (rig/deb-src.sh) and its build root
# (rig/debian-root.sh): the project names no archive of its own.
set -euo pipefail

own=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
[ -n "$own" ] || { echo "debian-mirror: the machine's release is unknown" >&2; exit 1; }

uri=$(
    grep -hsE '^deb[[:space:]]' /etc/apt/sources.list \
             /etc/apt/sources.list.d/*.list \
    | awk -v suite="$own" '{
          i = 2
          if ($i ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }
          if ($(i + 1) == suite) { print $i; exit }
      }'
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] || continue
        awk -v suite="$own" '
            function check() { if (deb && has && on && uri != "") { print uri; exit }
                               deb = has = 0; on = 1; uri = "" }
            BEGIN { on = 1 }
            /^[[:space:]]*$/ { check(); next }
            tolower($1) == "types:" {
                for (i = 2; i <= NF; i++) if ($i == "deb") deb = 1 }
            tolower($1) == "uris:" { uri = $2 }
            tolower($1) == "suites:" {
                for (i = 2; i <= NF; i++) if ($i == suite) has = 1 }
            tolower($1) == "enabled:" && tolower($2) == "no" { on = 0 }
            END { check() }' "$f"
    done
)
uri=$(head -n 1 <<<"$uri")

[ -n "$uri" ] || { echo "debian-mirror: no apt source of Debian $own" >&2; exit 1; }
echo "$uri"
