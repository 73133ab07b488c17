#!/usr/bin/env bash
# The official client libraries the tests play real clients with (openai,
# @anthropic-ai/sdk, ollama), installed once from the npm registry into the rig's
# cache; prints the node_modules folder (NODE_PATH for the examples).
set -euo pipefail

cache=${LLAMA_RIG_CACHE:-/var/cache/llama-session-rig}
dir=$cache/npm-clients
# pinned: bump them here when the examples move
packages="openai@7.59.0 @anthropic-ai/sdk@1.14.0 ollama@0.6.4"

stamp="$dir/.installed $packages"
if [ ! -e "$dir/.stamp" ] || [ "$(cat "$dir/.stamp")" != "$stamp" ]; then
    mkdir -p "$dir"
    echo "npm-clients: installing $packages" >&2
    (cd "$dir" && npm install --no-audit --no-fund --silent \
        --prefix "$dir" $packages) >&2
    echo "$stamp" > "$dir/.stamp"
fi

echo "$dir/node_modules"
