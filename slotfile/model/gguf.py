"""GGUF metadata without the arrays: a bounded scan over an mmap of the header, every key/value
pair and the tensor infos, in the order llama.cpp's ``gguf_init_from_file_impl`` reads them
(ggml/src/gguf.cpp).

``gguf.GGUFReader`` builds a numpy view for every element of every array: 20 s on a model with a
262,144-entry vocabulary.  Here scalars, strings and short arrays become Python values, and a long
array stays in the file as a :class:`GGUFArray` (offset and count): numbers as a zero-copy numpy
view, strings as a :class:`StringArray` that decodes an entry when it is asked for.  Skipping a
string array still has to follow its length prefixes; the walk keeps every ``CHECKPOINT``-th offset
so that any entry is a few steps away.

Every count and length is checked against the bytes left in the file before it is used, so a
hostile GGUF is a one-line :class:`GGUFError` naming the key and the offset, never a big allocation.
"""

from __future__ import annotations

import mmap
import struct
from array import array
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, overload

import numpy as np

# gguf_type (ggml/include/gguf.h)
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
TYPE_NAMES = ("u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "str", "arr", "u64", "i64", "f64")
_FMT = {
    UINT8: "B",
    INT8: "b",
    UINT16: "H",
    INT16: "h",
    UINT32: "I",
    INT32: "i",
    FLOAT32: "f",
    BOOL: "?",
    UINT64: "Q",
    INT64: "q",
    FLOAT64: "d",
}
_DTYPE = {
    UINT8: "u1",
    INT8: "i1",
    UINT16: "u2",
    INT16: "i2",
    UINT32: "u4",
    INT32: "i4",
    FLOAT32: "f4",
    BOOL: "?",
    UINT64: "u8",
    INT64: "i8",
    FLOAT64: "f8",
}
# the fewest bytes one element of each type takes: what a count is bounded by
_MIN_SIZE = {t: struct.calcsize(f) for t, f in _FMT.items()} | {STRING: 8, ARRAY: 12}

MAX_STRING = MAX_ARRAY = 1 << 30  # GGUF_MAX_STRING_LENGTH, GGUF_MAX_ARRAY_ELEMENTS (gguf.cpp)
GGML_MAX_DIMS = 4
SHORT_ARRAY = 1024  # arrays up to this many elements become lists (per-layer hparams, patterns)
DECODE_BUDGET = 1 << 18  # elements decoded into lists over the whole file; past it arrays stay lazy
MAX_DEPTH = 8  # nested arrays (gguf-py writes them, llama.cpp refuses them)
CHECKPOINT = 16  # a long string array keeps the offset of every 16th entry
DEFAULT_ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT


class GGUFError(ValueError):
    """The file is not a GGUF this scanner can read; the message is one line."""


def _name(key: str) -> str:
    return repr(key if len(key) <= 80 else key[:77] + "...")


class StringArray(Sequence[str]):
    """A string array left in the file: ``len()``, indexing and iteration decode on demand."""

    __slots__ = ("_buf", "_count", "_errors", "_marks", "_order")

    def __init__(self, buf: Any, count: int, marks: np.ndarray, order: str, errors: str = "strict") -> None:
        self._buf = buf
        self._count = count
        self._marks = marks  # offset of entry i * CHECKPOINT
        self._order = order
        self._errors = errors

    def __len__(self) -> int:
        return self._count

    def offset(self, i: int) -> int:
        """File offset of entry ``i``'s length prefix."""
        if not 0 <= i < self._count:
            raise IndexError(i)
        unpack = struct.Struct(self._order + "Q").unpack_from
        buf = self._buf
        o = int(self._marks[i // CHECKPOINT])
        for _ in range(i % CHECKPOINT):
            o += 8 + unpack(buf, o)[0]
        return o

    def raw(self, i: int) -> bytes:
        o = self.offset(i)
        n = struct.unpack_from(self._order + "Q", self._buf, o)[0]
        return bytes(self._buf[o + 8 : o + 8 + n])

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...
    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._count))]
        i = int(i)
        if i < 0:
            i += self._count
        return self.raw(i).decode("utf-8", self._errors)

    def __iter__(self) -> Iterator[str]:
        if not self._count:
            return
        unpack = struct.Struct(self._order + "Q").unpack_from
        buf, errors = self._buf, self._errors
        o = int(self._marks[0])
        for _ in range(self._count):
            n = unpack(buf, o)[0]
            yield bytes(buf[o + 8 : o + 8 + n]).decode("utf-8", errors)
            o += 8 + n

    def tolist(self) -> list[str]:
        return list(self)

    def __repr__(self) -> str:
        return f"<StringArray of {self._count} strings>"


class GGUFArray:
    """An array left in the file: its element type, count and where it lies."""

    __slots__ = ("_buf", "_marks", "_order", "count", "end", "item_type", "key", "offset")

    def __init__(
        self,
        key: str,
        item_type: int,
        count: int,
        offset: int,
        end: int,
        buf: Any,
        order: str,
        marks: np.ndarray | None = None,
    ) -> None:
        self.key, self.item_type, self.count, self.offset, self.end = key, item_type, count, offset, end
        self._buf, self._order, self._marks = buf, order, marks

    def __len__(self) -> int:
        return self.count

    def view(self) -> np.ndarray:
        """A numeric array as a read-only numpy view of the file (no copy)."""
        if self.item_type not in _DTYPE:
            raise TypeError(f"{self.key}: an array of {TYPE_NAMES[self.item_type]} has no numpy view")
        dt = np.dtype(self._order + _DTYPE[self.item_type])
        return np.frombuffer(self._buf, dtype=dt, count=self.count, offset=self.offset)

    def strings(self, errors: str = "strict") -> StringArray:
        if self.item_type != STRING or self._marks is None:
            raise TypeError(f"{self.key}: not an array of strings")
        return StringArray(self._buf, self.count, self._marks, self._order, errors)

    def tolist(self) -> list[Any]:
        if self.item_type == STRING:
            return self.strings().tolist()
        if self.item_type == ARRAY:
            sc = _Scanner(self._buf, len(self._buf), self._order)
            sc.pos = self.offset
            sc.short = sc.budget = MAX_ARRAY * MAX_DEPTH  # asked for explicitly: decode it all
            return [sc.array(self.key, 1) for _ in range(self.count)]
        return self.view().tolist()

    def __repr__(self) -> str:
        return f"<GGUFArray {self.key} {TYPE_NAMES[self.item_type]}[{self.count}] at {self.offset}>"


class _Scanner:
    def __init__(self, buf: Any, size: int, order: str) -> None:
        self.buf, self.size, self.order, self.pos = buf, size, order, 0
        self.short, self.budget = SHORT_ARRAY, DECODE_BUDGET
        self.u32 = struct.Struct(order + "I").unpack_from
        self.u64 = struct.Struct(order + "Q").unpack_from

    def fail(self, key: str | None, at: int, msg: str) -> GGUFError:
        where = f"key {_name(key)} at offset {at}" if key is not None else f"offset {at}"
        return GGUFError(f"{where}: {msg}")

    def need(self, n: int, key: str | None, what: str) -> None:
        left = self.size - self.pos
        if n > left:
            raise self.fail(key, self.pos, f"{what} needs {n} bytes, {max(left, 0)} left in the file")

    def read_u32(self, key: str | None, what: str) -> int:
        self.need(4, key, what)
        v = self.u32(self.buf, self.pos)[0]
        self.pos += 4
        return v

    def read_u64(self, key: str | None, what: str) -> int:
        self.need(8, key, what)
        v = self.u64(self.buf, self.pos)[0]
        self.pos += 8
        return v

    def read_bytes(self, key: str | None, what: str) -> bytes:
        at = self.pos
        n = self.read_u64(key, f"{what} length")
        if n > MAX_STRING or n > self.size - self.pos:
            raise self.fail(
                key, at, f"{what} ({n} bytes) runs past the end of the file ({self.size - self.pos} bytes left)"
            )
        b = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return b

    def count(self, key: str, item_type: int) -> int:
        at = self.pos
        n = self.read_u64(key, "array length")
        left = self.size - self.pos
        if n > MAX_ARRAY or n * _MIN_SIZE[item_type] > left:
            raise self.fail(
                key, at, f"array of {n} {TYPE_NAMES[item_type]} claims more than the {left} bytes left in the file"
            )
        return n

    def value(self, key: str, vtype: int, depth: int = 0, what: str = "string") -> Any:
        if vtype == STRING:
            b = self.read_bytes(key, what)
            try:
                return b.decode("utf-8")
            except UnicodeDecodeError:
                return None  # what GGUFReader's contents() failing gave load_model_info
        if vtype == ARRAY:
            return self.array(key, depth)
        fmt = _FMT.get(vtype)
        if fmt is None:
            raise self.fail(key, self.pos - 4, f"unknown value type {vtype}")
        n = _MIN_SIZE[vtype]
        self.need(n, key, TYPE_NAMES[vtype])
        v = struct.unpack_from(self.order + fmt, self.buf, self.pos)[0]
        self.pos += n
        return v

    def array_head(self, key: str, depth: int) -> tuple[int, int]:
        """An array's element type and count (gguf.cpp's gguf_reader: type u32, count u64)."""
        if depth >= MAX_DEPTH:
            raise self.fail(key, self.pos, f"arrays nested more than {MAX_DEPTH} deep")
        at = self.pos
        itype = self.read_u32(key, "array type")
        if itype not in _MIN_SIZE:
            raise self.fail(key, at, f"unknown array element type {itype}")
        return itype, self.count(key, itype)

    def array(self, key: str, depth: int) -> list[Any] | GGUFArray | None:
        itype, n = self.array_head(key, depth)
        start = self.pos
        if n <= self.short and n <= self.budget:
            self.budget -= n
            if itype in _DTYPE:
                size = n * _MIN_SIZE[itype]
                dt = np.dtype(self.order + _DTYPE[itype])
                out = np.frombuffer(self.buf, dtype=dt, count=n, offset=start).tolist()
                self.pos += size
                return out
            vals = [self.value(key, itype, depth + 1, f"string {i} of {n}") for i in range(n)]
            if itype == STRING and any(v is None for v in vals):
                return None  # one bad string spoiled the whole array in GGUFReader
            return vals
        marks = None
        if itype in _DTYPE:
            self.pos += n * _MIN_SIZE[itype]
        elif itype == STRING:
            marks = self.skip_strings(key, n)
        else:
            for _ in range(n):
                self.skip_array(key, depth + 1)
        return GGUFArray(key, itype, n, start, self.pos, self.buf, self.order, marks)

    def skip_array(self, key: str, depth: int) -> None:
        itype, n = self.array_head(key, depth)
        if itype in _DTYPE:
            self.pos += n * _MIN_SIZE[itype]
        elif itype == STRING:
            self.skip_strings(key, n)
        else:
            for _ in range(n):
                self.skip_array(key, depth + 1)

    def skip_strings(self, key: str, n: int) -> np.ndarray:
        """Follow ``n`` length prefixes from ``pos``; the offsets of every CHECKPOINT-th entry."""
        buf, size, unpack = self.buf, self.size, self.u64
        marks = array("q")
        mark = marks.append
        inner = range(CHECKPOINT)
        o = start = self.pos
        full, rest = divmod(n, CHECKPOINT)
        try:
            # the hot loop: no bound checks inside a block; a prefix read past the end raises
            # struct.error, and a block that ends past the end is caught below it
            for _ in range(full):
                mark(o)
                for _ in inner:
                    o += 8 + unpack(buf, o)[0]
                if o > size:
                    raise OverflowError
            if rest:
                mark(o)
                for _ in range(rest):
                    o += 8 + unpack(buf, o)[0]
                if o > size:
                    raise OverflowError
        except (struct.error, OverflowError):
            o = start
            for i in range(n):  # again, slowly, to say which entry is bad
                if o + 8 > size:
                    raise self.fail(
                        key, o, f"string {i} of {n}: its length prefix is cut off by the end of the file"
                    ) from None
                ln = unpack(buf, o)[0]
                if ln > size - o - 8:
                    raise self.fail(
                        key,
                        o,
                        f"string {i} of {n} ({ln} bytes) runs past the end of the file ({size - o - 8} bytes left)",
                    ) from None
                o += 8 + ln
            raise AssertionError("unreachable") from None  # pragma: no cover
        self.pos = o
        return np.frombuffer(marks, dtype=np.int64) if marks else np.zeros(0, np.int64)


class GGUFMeta:
    """What :func:`scan` found: the header, every key/value pair, the tensor count."""

    def __init__(
        self,
        path: str,
        version: int,
        order: str,
        tensor_count: int,
        kv_count: int,
        fields: dict[str, Any],
        types: dict[str, tuple[int, ...]],
        offsets: dict[str, int],
        data_offset: int,
        buf: Any,
    ) -> None:
        self.path, self.version, self.order = path, version, order
        self.tensor_count, self.kv_count = tensor_count, kv_count
        self.fields = fields  # key -> value: int/float/bool/str/None, list, or GGUFArray
        self.types = types  # key -> (type,) or (ARRAY, element type)
        self.offsets = offsets  # key -> offset of its key/value pair
        self.data_offset = data_offset
        self._buf = buf

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def array(self, key: str) -> GGUFArray | None:
        """An array field as a :class:`GGUFArray` whether or not it was short enough to decode."""
        if key not in self.fields or self.types[key][0] != ARRAY:
            return None
        v = self.fields[key]
        if isinstance(v, GGUFArray):
            return v
        sc = _Scanner(self._buf, len(self._buf), self.order)
        sc.pos = self.offsets[key]
        sc.read_bytes(key, "key")
        sc.pos += 4
        sc.short = -1
        out = sc.array(key, 0)
        assert isinstance(out, GGUFArray)
        return out


def scan(path: str | Path) -> GGUFMeta:
    """Read a GGUF's header, key/value pairs and tensor infos (never its tensor data)."""
    p = str(path)
    with open(p, "rb") as f:
        size = f.seek(0, 2)
        if size < 8:
            raise GGUFError(f"offset 0: a GGUF header needs at least 8 bytes, the file has {size}")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if buf[:4] != b"GGUF":
        raise GGUFError(f"offset 0: not a GGUF file (magic {bytes(buf[:4])!r})")
    order = "<"
    version = struct.unpack_from("<I", buf, 4)[0]
    if version & 0xFFFF == 0:  # written on a host of the other byte order (gguf.cpp, GGUFReader)
        order = ">"
        version = struct.unpack_from(">I", buf, 4)[0]
    if version == 1:
        raise GGUFError("offset 4: GGUF version 1 is no longer supported (llama.cpp refuses it too)")
    if version not in (2, 3):
        raise GGUFError(f"offset 4: GGUF version {version} is not supported (2 and 3 are)")
    sc = _Scanner(buf, size, order)
    sc.pos = 8
    n_tensors = sc.read_u64(None, "tensor count")
    n_kv = sc.read_u64(None, "key/value count")
    # a key/value pair takes at least 13 bytes, a tensor info 24
    if n_kv > MAX_ARRAY or n_kv * 13 > size - sc.pos:
        raise GGUFError(f"offset 16: {n_kv} key/value pairs claimed, {size - sc.pos} bytes left in the file")
    if n_tensors > MAX_ARRAY or n_tensors * 24 > size - sc.pos:
        raise GGUFError(f"offset 8: {n_tensors} tensors claimed, {size - sc.pos} bytes left in the file")
    fields: dict[str, Any] = {}
    types: dict[str, tuple[int, ...]] = {}
    offsets: dict[str, int] = {}
    for i in range(n_kv):
        at = sc.pos
        kb = sc.read_bytes(None, f"key {i} of {n_kv}")
        try:
            key = kb.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"offset {at}: key {i} of {n_kv} is not UTF-8: {kb[:40]!r}") from None
        if key in fields:
            raise sc.fail(key, at, f"duplicate key (first at offset {offsets[key]})")
        vtype = sc.read_u32(key, "value type")
        if vtype not in _MIN_SIZE:
            raise sc.fail(key, at, f"unknown value type {vtype}")
        if vtype == ARRAY:
            itype = sc.u32(buf, sc.pos)[0] if sc.pos + 4 <= size else -1
            types[key] = (ARRAY, itype)
        else:
            types[key] = (vtype,)
        offsets[key] = at
        fields[key] = sc.value(key, vtype)
    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if "general.alignment" in fields:
        if types["general.alignment"] != (UINT32,):
            raise sc.fail("general.alignment", offsets["general.alignment"], "must be a u32")
        if alignment == 0 or alignment & (alignment - 1):
            raise sc.fail("general.alignment", offsets["general.alignment"], f"{alignment} is not a power of two")
    data_offset = _scan_tensor_infos(sc, n_tensors, alignment)
    return GGUFMeta(p, version, order, n_tensors, n_kv, fields, types, offsets, data_offset, buf)


def _scan_tensor_infos(sc: _Scanner, n: int, alignment: int) -> int:
    """Walk the tensor infos (gguf.cpp reads them after the KV pairs); the tensor data offset.
    Their data must lie inside the file, as GGUFReader and llama.cpp require."""
    from slotfile.format.types import TYPES

    infos: list[tuple[str, int, int, int]] = []
    names: set[str] = set()
    for i in range(n):
        at = sc.pos
        nb = sc.read_bytes(None, f"tensor {i} name")
        name = nb.decode("utf-8", "replace")
        if name in names:
            raise GGUFError(f"offset {at}: duplicate tensor {_name(name)}")
        names.add(name)
        n_dims = sc.read_u32(None, f"tensor {_name(name)} dimension count")
        if n_dims > GGML_MAX_DIMS:
            raise GGUFError(f"offset {at}: tensor {_name(name)} has {n_dims} dimensions (at most {GGML_MAX_DIMS})")
        ne = 1
        for _ in range(n_dims):
            ne *= sc.read_u64(None, f"tensor {_name(name)} shape")
        ttype = sc.read_u32(None, f"tensor {_name(name)} type")
        ofs = sc.read_u64(None, f"tensor {_name(name)} offset")
        infos.append((name, ttype, ne, ofs))
        if ttype not in TYPES:
            raise GGUFError(f"offset {at}: tensor {_name(name)} has unknown ggml type {ttype}")
    data = -(-sc.pos // alignment) * alignment
    for name, ttype, ne, ofs in infos:
        t = TYPES[ttype]
        end = data + ofs + ne * t.type_size // t.blck_size
        if end > sc.size:
            raise GGUFError(
                f"offset {data + ofs}: tensor {_name(name)} data ends at {end}, past the end of the "
                f"file ({sc.size} bytes)"
            )
    return data
