#!/usr/bin/env bash
# Writes one of the rig's small random-weight models once into the cache and
# prints its path.  Needs the llama.cpp tree that build-llama-server.sh
# unpacked.
#
#   make-model.sh               the llama model (8 layers)
#   make-model.sh 4             the llama model with another number of layers
#                               (router mode's second and third models)
#   make-model.sh gemma3 [N]    sliding-window attention (6 layers: 5 with a
#                               256-token window, 1 global)
#   make-model.sh lfm2 [N]      hybrid short-conv + attention (6 layers,
#                               attention at 2 and 5)
#   make-model.sh mmproj        not a model: the multimodal projector
#                               (make-mmproj.py) that llama-server loads with
#                               --mmproj next to a text model, for requests
#                               with images
set -euo pipefail

version=${NODE_LLAMA_CPP:-3.21.1}
cache=${LLAMA_RIG_CACHE:-/var/cache/llama-session-rig}
src=$cache/node-llama-cpp-$version/src
here=$(cd "$(dirname "$0")" && pwd)

arch=llama
case ${1:-} in
    llama|gemma3|lfm2|mmproj) arch=$1; shift ;;
    ''|*[!0-9]*)
        if [ -n "${1:-}" ]; then
            echo "usage: $0 [llama|gemma3|lfm2] [LAYERS] | $0 mmproj" >&2
            exit 2
        fi ;;
esac

# the projector has no layer count to choose and its own generator; its
# output width is the text models' n_embd (256), so it goes with any of them
if [ "$arch" = mmproj ]; then
    if [ -n "${1:-}" ]; then
        echo "usage: $0 mmproj" >&2
        exit 2
    fi
    # make-mmproj.py's version of the file: bump it when the script changes
    # what it writes
    model=$cache/models/tiny-mmproj-v1.gguf
    if [ -s "$model" ]; then
        echo "$model"
        exit 0
    fi
    [ -d "$src/gguf-py" ] || "$here/build-llama-server.sh" >/dev/null
    mkdir -p "$cache/models"
    echo "make-model: writing $model" >&2
    /usr/bin/python3 "$here/make-mmproj.py" "$src" "$model"
    echo "$model"
    exit 0
fi

# each architecture's default number of layers (as in make-model.py)
case $arch in
    llama) default=8 ;;
    *) default=6 ;;
esac
layers=${1:-$default}
case $layers in
    ''|*[!0-9]*) echo "usage: $0 [llama|gemma3|lfm2] [LAYERS]" >&2; exit 2 ;;
esac

# the generator's own version of each architecture's file: bump it when
# make-model.py changes what it writes for that architecture
case $arch in
    llama) v=v1 ;;
    gemma3) v=v1 ;;
    lfm2) v=v1 ;;
esac
if [ "$layers" = "$default" ]; then
    model=$cache/models/tiny-$arch-$v.gguf
else
    model=$cache/models/tiny-$arch-l$layers-$v.gguf
fi

if [ -s "$model" ]; then
    echo "$model"
    exit 0
fi

[ -d "$src/gguf-py" ] || "$here/build-llama-server.sh" >/dev/null

mkdir -p "$cache/models"
echo "make-model: writing $model" >&2
/usr/bin/python3 "$here/make-model.py" "$src" "$model" "$layers" --arch "$arch"
echo "$model"
