#!/usr/bin/env bash
# Writes the rig's small random-weight model once into the cache and prints
# its path.  Needs the llama.cpp tree that build-llama-server.sh unpacked.
set -euo pipefail

version=${NODE_LLAMA_CPP:-3.21.1}
cache=${LLAMA_RIG_CACHE:-/var/cache/llama-session-rig}
src=$cache/node-llama-cpp-$version/src
here=$(cd "$(dirname "$0")" && pwd)

# the generator's own version: bump it when make-model.py changes;
# an argument asks for another number of layers (router mode's second model)
layers=${1:-8}
if [ "$layers" = 8 ]; then
    model=$cache/models/tiny-llama-v1.gguf
else
    model=$cache/models/tiny-llama-l$layers-v1.gguf
fi

if [ -s "$model" ]; then
    echo "$model"
    exit 0
fi

[ -d "$src/gguf-py" ] || "$here/build-llama-server.sh" >/dev/null

mkdir -p "$cache/models"
echo "make-model: writing $model" >&2
/usr/bin/python3 "$here/make-model.py" "$src" "$model" "$layers"
echo "$model"
