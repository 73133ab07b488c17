#!/usr/bin/env bash
# Builds llama-server from the llama.cpp source that the npm package
# node-llama-cpp ships (llama/gitRelease.bundle), once per version, into a
# cache outside the work tree.  Prints the path of the binary on stdout.
#
#   LLAMA_RIG_CACHE   cache root (default /var/cache/llama-session-rig)
#   NODE_LLAMA_CPP    npm package version (default 3.21.1)
set -euo pipefail

version=${NODE_LLAMA_CPP:-3.21.1}
cache=${LLAMA_RIG_CACHE:-/var/cache/llama-session-rig}
dir=$cache/node-llama-cpp-$version
bin=$dir/bin/llama-server

if [ -x "$bin" ] && "$bin" --version >/dev/null 2>&1; then
    echo "$bin"
    exit 0
fi

log() { echo "build-llama-server: $*" >&2; }

mkdir -p "$dir"
cd "$dir"

if [ ! -f package/llama/gitRelease.bundle ]; then
    log "fetching node-llama-cpp@$version with npm pack"
    rm -rf package ./*.tgz
    npm pack --silent "node-llama-cpp@$version" >/dev/null
    tar xzf "node-llama-cpp-$version.tgz" package/llama/gitRelease.bundle \
        package/llama/llama.cpp.info.json
    rm -f "node-llama-cpp-$version.tgz"
fi

if [ ! -f src/CMakeLists.txt ]; then
    log "cloning the bundled llama.cpp tree"
    rm -rf src
    git -c advice.detachedHead=false clone --quiet package/llama/gitRelease.bundle src
fi

log "building llama-server (several minutes on 2 cores)"
cmake -S src -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DBUILD_SHARED_LIBS=OFF >build.log 2>&1 \
    || { tail -n 40 build.log >&2; exit 1; }
cmake --build build --target llama-server -j"$(nproc)" >>build.log 2>&1 \
    || { tail -n 40 build.log >&2; exit 1; }

mkdir -p bin
cp build/bin/llama-server bin/llama-server.tmp
mv bin/llama-server.tmp "$bin"
log "built $bin"
echo "$bin"
