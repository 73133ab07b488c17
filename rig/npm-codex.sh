#!/usr/bin/env bash
# The OpenAI Codex CLI (@openai/codex) the tests play a real Responses API
# client with, installed once from the npm registry into the rig's cache;
# prints the path of the codex executable.
set -euo pipefail

cache=${LLAMA_RIG_CACHE:-/var/cache/llama-session-rig}
dir=$cache/npm-codex
# pinned: bump it here when the tests move.  0.171.0 is the release the
# recorded exchange came from; its engines field asks only node >= 16.
# bin/codex.js is a node launcher that runs the native binary shipped in the
# platform's optional dependency (@openai/codex-linux-x64, an npm alias of
# @openai/codex@VERSION-linux-x64), so optional dependencies must stay on.
packages="@openai/codex@0.171.0"

stamp="$dir/.installed $packages"
if [ ! -e "$dir/.stamp" ] || [ "$(cat "$dir/.stamp")" != "$stamp" ]; then
    mkdir -p "$dir"
    echo "npm-codex: installing $packages" >&2
    (cd "$dir" && npm install --no-audit --no-fund --silent \
        --prefix "$dir" $packages) >&2
    echo "$stamp" > "$dir/.stamp"
fi

echo "$dir/node_modules/.bin/codex"
