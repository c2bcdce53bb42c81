"""A GGUF model's fingerprint: which model exactly, without reading all of it.

Three parts, each a BLAKE2b-256 digest, and the fingerprint over the three:

* ``metadata``: the header and every key/value pair, byte for byte as stored (the file's
  bytes from offset 0 to the first tensor info: architecture, hyperparameters, tokenizer,
  ``general.name``);
* ``tensors``: every tensor info as stored (name, dimensions, ggml type, data offset);
* ``data``: sampled tensor data: from *every* tensor, :data:`WINDOWS` windows of
  :data:`WINDOW` bytes (its start, evenly spaced inside, its end; the whole tensor when it is
  smaller), each prefixed with the tensor's index and the window's offset.

Two fine-tunes of one base model share their tensor infos and (apart from the name) their
metadata, but every tensor's weights differ, so the sampled windows differ; a copy with one
tensor replaced differs in that tensor's windows.  A change that touches none of the sampled
bytes (one weight edited in the middle of a large tensor) is not seen: the fingerprint is a
cheap identity, not a checksum of the whole file (seal one with ``slotfile seal`` for that).

The cost is the metadata walk (:func:`slotfile.model.gguf.scan`'s, over the mapped header)
plus ``n_tensors * WINDOWS`` page reads: flat in the model's size, growing only with its
tensor count (a few hundred for most models).
"""

from __future__ import annotations

import hashlib
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slotfile.model.gguf import _MIN_SIZE, DEFAULT_ALIGNMENT, GGML_MAX_DIMS, UINT32, GGUFError, _Scanner

SCHEME = "slotfile.gguf-fingerprint/1"  # bump when what is hashed changes
WINDOW = 1024  # bytes per sampled window
WINDOWS = 4  # windows per tensor: start, two inside, end
DIGEST_SIZE = 32


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]
    type_id: int
    offset: int  # absolute file offset of the data
    size: int  # bytes of data


@dataclass(frozen=True)
class Fingerprint:
    """A model's identity; ``value`` is what the manifest records and compares."""

    value: str  # hex, over the three parts
    metadata: str
    tensors: str
    data: str
    n_tensors: int
    sampled_bytes: int
    file_size: int
    name: str | None = None  # general.name, for messages
    arch: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "scheme": SCHEME,
            "value": self.value,
            "metadata": self.metadata,
            "tensors": self.tensors,
            "data": self.data,
            "n_tensors": self.n_tensors,
            "sampled_bytes": self.sampled_bytes,
            "file_size": self.file_size,
            "name": self.name,
            "arch": self.arch,
        }

    def differs(self, other: dict[str, Any]) -> list[str]:
        """Which parts differ from a recorded fingerprint (``to_dict`` form): empty when equal."""
        if other.get("scheme") != SCHEME:
            return ["scheme"]
        return [k for k in ("metadata", "tensors", "data") if other.get(k) != getattr(self, k)]


def _h() -> Any:
    return hashlib.blake2b(digest_size=DIGEST_SIZE)


def _walk_kv(sc: _Scanner, n_kv: int) -> tuple[str | None, str | None, int]:
    """Walk the key/value pairs (the scanner of slotfile.model.gguf, so that a hostile
    header is refused the same way); (general.name, general.architecture, alignment)."""
    name = arch = None
    alignment = DEFAULT_ALIGNMENT
    for i in range(n_kv):
        at = sc.pos
        kb = sc.read_bytes(None, f"key {i} of {n_kv}")
        key = kb.decode("utf-8", "replace")
        vtype = sc.read_u32(key, "value type")
        if vtype not in _MIN_SIZE:
            raise sc.fail(key, at, f"unknown value type {vtype}")
        v = sc.value(key, vtype)
        if key == "general.name" and isinstance(v, str):
            name = v
        elif key == "general.architecture" and isinstance(v, str):
            arch = v
        elif key == "general.alignment":
            if vtype != UINT32 or not isinstance(v, int) or v == 0 or v & (v - 1):
                raise sc.fail(key, at, "must be a u32 power of two")
            alignment = v
    return name, arch, alignment


def _tensor_infos(sc: _Scanner, n: int) -> list[tuple[str, tuple[int, ...], int, int]]:
    from slotfile.format.types import TYPES

    out = []
    for i in range(n):
        at = sc.pos
        name = sc.read_bytes(None, f"tensor {i} name").decode("utf-8", "replace")
        n_dims = sc.read_u32(None, f"tensor {name!r} dimension count")
        if n_dims > GGML_MAX_DIMS:
            raise GGUFError(f"offset {at}: tensor {name!r} has {n_dims} dimensions (at most {GGML_MAX_DIMS})")
        dims = tuple(sc.read_u64(None, f"tensor {name!r} shape") for _ in range(n_dims))
        ttype = sc.read_u32(None, f"tensor {name!r} type")
        ofs = sc.read_u64(None, f"tensor {name!r} offset")
        if ttype not in TYPES:
            raise GGUFError(f"offset {at}: tensor {name!r} has unknown ggml type {ttype}")
        out.append((name, dims, ttype, ofs))
    return out


def windows(size: int, window: int = WINDOW, count: int = WINDOWS) -> list[tuple[int, int]]:
    """(offset, length) of the sampled windows of a tensor of ``size`` bytes: the whole tensor
    when it is no larger than ``count`` windows, else ``count`` windows from its start to its end."""
    if size <= window * count:
        return [(0, size)] if size else []
    step = (size - window) / (count - 1)
    return [(round(i * step), window) for i in range(count)]


def fingerprint(path: str | Path) -> Fingerprint:
    """The fingerprint of the GGUF at ``path``; raises GGUFError (one line) for a file that is not
    a readable GGUF and OSError for one that cannot be read."""
    p = str(path)
    with open(p, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:
            raise GGUFError(f"offset 0: a GGUF header needs at least 24 bytes, the file has {size}")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _fingerprint(buf, size)
    finally:
        buf.close()


def _fingerprint(buf: mmap.mmap, size: int) -> Fingerprint:
    if buf[:4] != b"GGUF":
        raise GGUFError(f"offset 0: not a GGUF file (magic {bytes(buf[:4])!r})")
    order = "<"
    version = struct.unpack_from("<I", buf, 4)[0]
    if version & 0xFFFF == 0:  # written on a host of the other byte order (gguf.cpp)
        order = ">"
        version = struct.unpack_from(">I", buf, 4)[0]
    if version not in (2, 3):
        raise GGUFError(f"offset 4: GGUF version {version} is not supported (2 and 3 are)")
    sc = _Scanner(buf, size, order)
    sc.short = -1  # nothing decoded into lists: only the walk is needed
    sc.pos = 8
    n_tensors = sc.read_u64(None, "tensor count")
    n_kv = sc.read_u64(None, "key/value count")
    if n_kv * 13 > size - sc.pos or n_tensors * 24 > size - sc.pos:
        raise GGUFError(f"offset 8: {n_tensors} tensors and {n_kv} key/value pairs claimed in a {size}-byte file")
    name, arch, alignment = _walk_kv(sc, n_kv)
    kv_end = sc.pos
    infos = _tensor_infos(sc, n_tensors)
    ti_end = sc.pos
    data0 = -(-ti_end // alignment) * alignment

    meta = _h()
    meta.update(memoryview(buf)[:kv_end])
    tens = _h()
    tens.update(memoryview(buf)[kv_end:ti_end])
    data = _h()
    sampled = 0
    mv = memoryview(buf)
    try:
        for i, (tname, dims, ttype, ofs) in enumerate(infos):
            nbytes = _nbytes(dims, ttype)
            start = data0 + ofs
            if start + nbytes > size:
                raise GGUFError(
                    f"offset {start}: tensor {tname!r} data ends at {start + nbytes}, "
                    f"past the end of the file ({size} bytes)"
                )
            for wo, wl in windows(nbytes):
                data.update(struct.pack("<IQ", i, wo))
                data.update(mv[start + wo : start + wo + wl])
                sampled += wl
    finally:
        mv.release()
    parts = (meta.hexdigest(), tens.hexdigest(), data.hexdigest())
    top = _h()
    top.update(SCHEME.encode())
    for part in parts:
        top.update(bytes.fromhex(part))
    return Fingerprint(
        top.hexdigest(), *parts, n_tensors=n_tensors, sampled_bytes=sampled, file_size=size, name=name, arch=arch
    )


def tensor_layout(path: str | Path) -> list[TensorInfo]:
    """Every tensor's name, dimensions, type, absolute data offset and size (the same walk as
    :func:`fingerprint`; for tools that edit or sample tensor data)."""

    with open(str(path), "rb") as f:
        size = f.seek(0, 2)
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        order = ">" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF == 0 else "<"
        sc = _Scanner(buf, size, order)
        sc.short = -1
        sc.pos = 8
        n_tensors = sc.read_u64(None, "tensor count")
        n_kv = sc.read_u64(None, "key/value count")
        _, _, alignment = _walk_kv(sc, n_kv)
        infos = _tensor_infos(sc, n_tensors)
        data0 = -(-sc.pos // alignment) * alignment
    finally:
        buf.close()
    out = []
    for name, dims, ttype, ofs in infos:
        out.append(TensorInfo(name, dims, ttype, data0 + ofs, _nbytes(dims, ttype)))
    return out


def _nbytes(dims: tuple[int, ...], ttype: int) -> int:
    """A tensor's data size: its elements in blocks of the type (ggml_nbytes for a contiguous
    tensor)."""
    from slotfile.format.types import TYPES

    t = TYPES[ttype]
    ne = 1
    for d in dims:
        ne *= d
    return ne * t.type_size // t.blck_size
