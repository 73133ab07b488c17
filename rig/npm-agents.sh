#!/usr/bin/env bash
# The coding agents the tests play real agents with (Claude Code, the
# @anthropic-ai/claude-code CLI), installed once from the npm registry into the
# rig's cache; prints the path of the claude executable.
set -euo pipefail

cache=${LLAMA_RIG_CACHE:-/var/cache/llama-session-rig}
dir=$cache/npm-agents
# pinned: bump it here when the tests move; 2.1.197 is the newest release
# whose engines field still accepts node 20 (2.1.198 on want node >= 22).
# Its postinstall links the platform's native binary (an optional dependency)
# to bin/claude.exe, so optional dependencies and install scripts must stay on.
packages="@anthropic-ai/claude-code@2.1.197"

stamp="$dir/.installed $packages"
if [ ! -e "$dir/.stamp" ] || [ "$(cat "$dir/.stamp")" != "$stamp" ]; then
    mkdir -p "$dir"
    echo "npm-agents: installing $packages" >&2
    (cd "$dir" && npm install --no-audit --no-fund --silent \
        --prefix "$dir" $packages) >&2
    echo "$stamp" > "$dir/.stamp"
fi

echo "$dir/node_modules/.bin/claude"
