#!/usr/bin/env bash
# Build the llama.cpp library that writes GGSQ state version 2 / GGSN session version 9, for slotfile's tests
# and CI (issue 23, item 1): the last llama.cpp before the multi-stream KV cache bumped the state version to 3.
#
# Source: the PyPI source package llama-cpp-python 0.3.35, the newest whose vendored llama.h says
# `#define LLAMA_STATE_SEQ_VERSION 2` (0.3.36 says 3). Its vendor/llama.cpp/ folder is llama.cpp commit
# 4df29be4f4c3673f428170fda944a5b19f743bb8 (2026-08-16; MIT). The package's Python bindings are not built or
# used. The sdist's sha256 is pinned below. Only the `llama` shared library target is built (libllama.so +
# libggml*.so, RUNPATH $ORIGIN), exactly as scripts/build-llama-v2.sh does for version 4.
#
# The result is cached outside the checkout, keyed by the sdist's hash, so a machine builds it once:
#   ${SLOTFILE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/slotfile}/llama-v2/<sha256>/bin
# The last line on stdout is that folder; everything else goes to stderr.
#
# Environment: PYTHON (python with pip; default python3), JOBS (default 2), SLOTFILE_CACHE_DIR,
# SLOTFILE_LLAMA_V2_SDIST (a local copy of the sdist, checked against the pinned hash; skips the download).
set -euo pipefail

VERSION="0.3.35"
SDIST="llama_cpp_python-${VERSION}.tar.gz"
SHA256="1139dbb54509074b70893fab8554e3b079aa9f4d312058ce4018ef0019e3de12"

PYTHON="${PYTHON:-python3}"
JOBS="${JOBS:-2}"
CACHE="${SLOTFILE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/slotfile}/llama-v2/${SHA256}"
OUT="${CACHE}/bin"

log() { echo "build-llama-v2: $*" >&2; }

if [ -f "${OUT}/libllama.so" ] && [ -f "${CACHE}/.complete" ]; then
    log "cached: ${OUT}"
    echo "${OUT}"
    exit 0
fi

mkdir -p "${CACHE}"
# one build at a time per cache folder (CI and a developer, or two test sessions)
exec 9>"${CACHE}/.lock"
if command -v flock >/dev/null 2>&1; then
    flock 9
    if [ -f "${OUT}/libllama.so" ] && [ -f "${CACHE}/.complete" ]; then
        log "cached (built by another process): ${OUT}"
        echo "${OUT}"
        exit 0
    fi
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/slotfile-llama-v2.XXXXXX")"
trap 'rm -rf "${WORK}"' EXIT
start=$(date +%s)

# 1. the pinned source package
if [ -n "${SLOTFILE_LLAMA_V2_SDIST:-}" ]; then
    cp "${SLOTFILE_LLAMA_V2_SDIST}" "${WORK}/${SDIST}"
else
    log "downloading llama-cpp-python==${VERSION} (source package)"
    # --no-binary only for this package: `:all:` would also compile the build backend's own
    # requirements (pip builds cmake itself from source just to read the package's metadata).
    "${PYTHON}" -m pip download --quiet --no-deps --no-binary llama-cpp-python \
        "llama-cpp-python==${VERSION}" -d "${WORK}" >&2
fi
got="$(sha256sum "${WORK}/${SDIST}" | cut -d' ' -f1)"
if [ "${got}" != "${SHA256}" ]; then
    log "sha256 mismatch for ${SDIST}: got ${got}, pinned ${SHA256}"
    exit 1
fi
tar xzf "${WORK}/${SDIST}" -C "${WORK}" "llama_cpp_python-${VERSION}/vendor/llama.cpp"
SRC="${WORK}/llama_cpp_python-${VERSION}/vendor/llama.cpp"
grep -q '^#define LLAMA_STATE_SEQ_VERSION 2' "${SRC}/include/llama.h" || {
    log "the source's llama.h does not say LLAMA_STATE_SEQ_VERSION 2"
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
    -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=OFF \
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
rm -rf "${CACHE}/bin.new" "${OUT}"
mkdir -p "${CACHE}/bin.new"
cp -a "${libs[@]}" "${CACHE}/bin.new/"
cp "${SRC}/LICENSE" "${CACHE}/bin.new/LICENSE.llama.cpp"
mv "${CACHE}/bin.new" "${OUT}"
end=$(date +%s)
printf 'llama-cpp-python %s sha256 %s built in %ss with %s jobs\n' "${VERSION}" "${SHA256}" "$((end - start))" \
    "${JOBS}" >"${CACHE}/.complete"
log "built in $((end - start)) s: ${OUT}"
echo "${OUT}"
