"""The building blocks of every slot-file grammar: magics and caps, the zero-copy stream, the
custom constructs that hand out numpy views instead of copying bulk data, cell metadata and the
type checks.  :mod:`slotfile.format.grammar` is the public entry; see its docstring for the
context parameters (``ext``, ``whole``, ``rot``) these constructs read."""

from __future__ import annotations

import functools
import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from construct import (
    Construct,
    ConstructError,
)
from construct.core import evaluate

from slotfile.format.types import TYPES
from slotfile.problems import ProblemCode

# ---------------------------------------------------------------------------------------
# versions and caps (the magics are in slotfile.format.magics)
# ---------------------------------------------------------------------------------------

PACKED_MARKER = -1  # LLAMA_TOKEN_NULL opens a packed server_tokens payload
SERVER_TOKENS_VERSION = 1
SCKP_VERSION = 1  # SLOT_CKPT_VERSION (PR #26004)
SDFT_VERSION = 1
MTMD_SERIALIZATION_VERSION = 2

MAX_STREAMS = 256  # LLAMA_MAX_SEQ
MAX_LAYERS = 4096
MAX_CHECKPOINTS = 1024  # the SCKP writer refuses more; the reader treats more as corrupt
MAX_TYPE_ID = 1024  # ids above this are not a type id of any build: reject the layout


# ---------------------------------------------------------------------------------------
# the stream every grammar parses from
# ---------------------------------------------------------------------------------------


class ViewStream(io.RawIOBase):
    """A read-only stream over ``buf[start:end]`` that never copies more than it is asked.

    Offsets are absolute in ``buf`` (the whole file), so every ``Tell`` is a file offset.
    ``loc`` is a stack of names pushed by :class:`Named` / :class:`Seq`; after a failed
    parse it still holds the location of the failure.  ``short`` records the last read
    that hit the end: ``(offset, wanted, available)``.
    """

    def __init__(self, buf: Any, start: int = 0, end: int | None = None) -> None:
        super().__init__()
        self.view = memoryview(buf).cast("B") if not isinstance(buf, memoryview) else buf
        self.pos = start
        self.start = start
        self.end = len(self.view) if end is None else end
        self.loc: list[str] = []
        self.short: tuple[int, int, int] | None = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def remaining(self) -> int:
        return self.end - self.pos

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = self.end - self.pos
        if self.pos + n > self.end:
            self.short = (self.pos, n, self.end - self.pos)
            n = self.end - self.pos
        data = bytes(self.view[self.pos : self.pos + n])
        self.pos += n
        return data

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.end}[whence]
        self.pos = base + offset
        return self.pos


class FormatError(ConstructError):
    """A problem found while parsing, with the file offset and the location inside the grammar."""

    def __init__(self, message: str, offset: int, code: ProblemCode = ProblemCode.INVALID, loc: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.offset = offset
        self.code = code
        self.loc = loc


def stream_loc(stream: Any) -> str:
    return ".".join(getattr(stream, "loc", []))


def _remaining(stream: Any) -> int:
    if isinstance(stream, ViewStream):
        return stream.remaining()
    return 1 << 62  # building into BytesIO: nothing to check


def require_bytes(stream: Any, n: int, what: str) -> None:
    """Check ``n`` bytes remain before anything is allocated or read."""
    have = _remaining(stream)
    if n < 0 or n > have:
        raise FormatError(
            f"{what} needs {n} bytes, {have} remain",
            stream.tell(),
            code=ProblemCode.TRUNCATED,
            loc=stream_loc(stream),
        )


# ---------------------------------------------------------------------------------------
# custom constructs for bulk data
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Run:
    """A run of bytes in the source buffer: recorded, never copied."""

    offset: int
    length: int
    view: memoryview | bytes

    def array(self, dtype: Any = np.uint8) -> np.ndarray:
        """A zero-copy numpy view (read-only when the source is a read-only mmap)."""
        return np.frombuffer(self.view, dtype=dtype)

    @classmethod
    def of(cls, data: bytes) -> Run:
        return cls(0, len(data), data)


class Rows(Construct):
    """``nbytes`` of bulk data, returned as a :class:`Run`; build writes the run's bytes."""

    def __init__(self, nbytes: Any, what: str) -> None:
        super().__init__()
        self.nbytes = nbytes
        self.what = what

    def _parse(self, stream: Any, context: Any, path: str) -> Run:
        n = int(evaluate(self.nbytes, context))
        require_bytes(stream, n, self.what)
        start = stream.tell()
        if isinstance(stream, ViewStream):
            view: memoryview | bytes = stream.view[start : start + n]
            stream.seek(start + n)
        else:  # a plain file-like object (tests, small inputs)
            view = stream.read(n)
        return Run(start, n, view)

    def _build(self, obj: Any, stream: Any, context: Any, path: str) -> Any:
        n = int(evaluate(self.nbytes, context))
        data = obj.view if isinstance(obj, Run) else obj
        if len(data) != n:
            raise FormatError(f"{self.what}: run of {len(data)} bytes where {n} are due", stream.tell())
        stream.write(data)
        return obj

    def _sizeof(self, context: Any, path: str) -> int:
        return int(evaluate(self.nbytes, context))


class NumpyArray(Construct):
    """``count`` items of a fixed numpy dtype, as one zero-copy array."""

    def __init__(self, dtype: Any, count: Any, what: str) -> None:
        super().__init__()
        self.dtype = np.dtype(dtype)
        self.count = count
        self.what = what

    def _parse(self, stream: Any, context: Any, path: str) -> np.ndarray:
        n = int(evaluate(self.count, context))
        if n < 0:
            raise FormatError(f"{self.what}: negative count {n}", stream.tell(), loc=stream_loc(stream))
        run = Rows(n * self.dtype.itemsize, self.what)._parse(stream, context, path)
        return np.frombuffer(run.view, dtype=self.dtype, count=n)

    def _build(self, obj: Any, stream: Any, context: Any, path: str) -> Any:
        arr = np.ascontiguousarray(obj, dtype=self.dtype)
        n = int(evaluate(self.count, context))
        if arr.shape != (n,):
            raise FormatError(f"{self.what}: {arr.size} items where {n} are due", stream.tell())
        stream.write(arr.tobytes())
        return obj


class ExtraWords(NumpyArray):
    """Optional u32 words (trial parses of unknown versions); absent from a build object means zeros."""

    def __init__(self, count: Any, what: str) -> None:
        super().__init__("<u4", count, what)
        self.flagbuildnone = True

    def _build(self, obj: Any, stream: Any, context: Any, path: str) -> Any:
        if obj is None:
            obj = np.zeros(int(evaluate(self.count, context)), "<u4")
        return super()._build(obj, stream, context, path)


class Ensure(Construct):
    """Fail the parse with a clear message when ``predicate(context)`` is false."""

    def __init__(
        self,
        predicate: Callable[[Any], bool],
        message: Callable[[Any], str],
        code: ProblemCode = ProblemCode.INVALID,
    ) -> None:
        super().__init__()
        self.flagbuildnone = True
        self.predicate = predicate
        self.message = message
        self.code = code

    def _parse(self, stream: Any, context: Any, path: str) -> None:
        if not self.predicate(context):
            # the failing field was the one just read: point at its start when we can
            raise FormatError(self.message(context), stream.tell(), code=self.code, loc=stream_loc(stream))
        return None

    def _build(self, obj: Any, stream: Any, context: Any, path: str) -> None:
        return None

    def _sizeof(self, context: Any, path: str) -> int:
        return 0


class Named(Construct):
    """Push ``name`` on the stream's location stack while ``subcon`` parses."""

    def __init__(self, name: str, subcon: Construct) -> None:
        super().__init__()
        self.label = name
        self.subcon = subcon
        self.flagbuildnone = subcon.flagbuildnone

    def _parse(self, stream: Any, context: Any, path: str) -> Any:
        loc = getattr(stream, "loc", None)
        if loc is not None:
            loc.append(self.label)
        obj = self.subcon._parsereport(stream, context, path)
        if loc is not None:
            loc.pop()  # left in place on failure: the reader reads it back
        return obj

    def _build(self, obj: Any, stream: Any, context: Any, path: str) -> Any:
        return self.subcon._build(obj, stream, context, path)


class Seq(Construct):
    """An array of ``count`` items; checks ``count * min_size`` fits before looping."""

    def __init__(self, name: str, count: Any, subcon: Construct, min_size: int) -> None:
        super().__init__()
        self.label = name
        self.count = count
        self.subcon = subcon
        self.min_size = min_size

    def _parse(self, stream: Any, context: Any, path: str) -> list[Any]:
        n = int(evaluate(self.count, context))
        require_bytes(stream, n * self.min_size, f"{n} x {self.label}")
        loc = getattr(stream, "loc", None)
        out = []
        for i in range(n):
            if loc is not None:
                loc.append(f"{self.label}[{i}]")
            context._index = i
            out.append(self.subcon._parsereport(stream, context, path))
            if loc is not None:
                loc.pop()
        return out

    def _build(self, obj: Any, stream: Any, context: Any, path: str) -> Any:
        n = int(evaluate(self.count, context))
        if len(obj) != n:
            raise FormatError(f"{self.label}: {len(obj)} items where {n} are due", stream.tell())
        for i, item in enumerate(obj):
            context._index = i
            self.subcon._build(item, stream, context, path)
        return obj


# ---------------------------------------------------------------------------------------
# per-cell metadata as one structured array
# ---------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def kv_cell_dtype(ext: int) -> np.dtype:
    """One single-sequence KV cell: pos, n_seq_id (always 1), [ext], seq_id."""
    fields: list[tuple[str, Any]] = [("pos", "<i4"), ("n_seq_id", "<u4")]
    if ext == 12:  # llama_kv_cell_ext { x, y, tok } (src/llama-kv-cells.h)
        fields += [("x", "<i4"), ("y", "<i4"), ("tok", "<i4")]
    elif ext == 8:  # older trees wrote only x, y
        fields += [("x", "<i4"), ("y", "<i4")]
    elif ext:
        raise ValueError(f"unsupported cell ext size {ext}")
    fields.append(("seq_id", "<i4"))
    return np.dtype(fields)


REC_CELL_DTYPE = np.dtype([("pos", "<i4"), ("n_seq_id", "<u4")])


@functools.lru_cache(maxsize=8)
def _cell_head_dtype(rec: bool, ext: int) -> np.dtype:
    """The fixed head of one cell (everything before its seq ids): the stride of the
    cell-by-cell walk of a whole-context save."""
    dtype = REC_CELL_DTYPE if rec else kv_cell_dtype(ext)
    return np.dtype(dtype.descr[:2] + ([] if rec else dtype.descr[2:-1]))


@dataclass(slots=True)
class CellTable:
    """Cell metadata of one KV stream or REC block.

    ``cells`` is a structured array with ``pos`` and ``n_seq_id`` (and ``x``, ``y``, ``tok``
    with an ext); ``seq_ids`` holds all seq ids flat, ``raw`` the exact bytes.
    """

    offset: int
    cells: np.ndarray
    seq_ids: np.ndarray
    raw: memoryview | bytes

    @property
    def size(self) -> int:
        return len(self.raw)


class CellMeta(Construct):
    """``count`` cells of KV (``rec=False``) or REC (``rec=True``) metadata.

    A single-sequence save has a fixed stride (KV: n_seq_id == 1; REC: n_seq_id == 0), read as
    one zero-copy structured array.  A whole-context save (``whole``, GGSN) may carry any number
    of seq ids per cell: when the fixed-stride fast path does not hold it is walked cell by cell.
    """

    def __init__(self, count: Any, rec: bool) -> None:
        super().__init__()
        self.count = count
        self.rec = rec

    def _parse(self, stream: Any, context: Any, path: str) -> CellTable:
        n = int(evaluate(self.count, context))
        whole = bool(context._params.get("whole", False))
        ext = 0 if self.rec else int(context._params.get("ext", 0))
        dtype, fixed = (REC_CELL_DTYPE, 0) if self.rec else (kv_cell_dtype(ext), 1)
        head = _cell_head_dtype(self.rec, ext)
        start = stream.tell()
        # every cell takes at least its fixed head: check that before reading any
        require_bytes(stream, n * head.itemsize, f"metadata of {n} cells")
        avail = min(n, stream.remaining() // dtype.itemsize)
        cells = np.frombuffer(stream.view, dtype=dtype, count=avail, offset=start)
        bad = np.flatnonzero(cells["n_seq_id"] != fixed)
        neg = np.flatnonzero(cells["pos"] < 0)
        if neg.size and (not bad.size or neg[0] < bad[0]):
            # empty cells (pos -1) are never written: a negative position is damage
            i = int(neg[0])
            raise FormatError(
                f"cell {i}: negative position {int(cells['pos'][i])}",
                start + i * dtype.itemsize,
                code=ProblemCode.BAD_POSITION,
                loc=stream_loc(stream),
            )
        if avail == n and not bad.size:
            end = start + n * dtype.itemsize
            stream.seek(end)
            seq = np.empty(0, np.int32) if self.rec else cells["seq_id"]
            return CellTable(start, cells, seq, stream.view[start:end])
        if whole:
            return self._parse_variable(stream, start, n, head)
        if bad.size:
            i = int(bad[0])
            stream.seek(start + i * dtype.itemsize + 4)
            raise FormatError(
                f"cell {i}: n_seq_id {int(cells['n_seq_id'][i])} in a single-sequence save (must be {fixed})",
                start + i * dtype.itemsize + 4,
                code=ProblemCode.INVALID,
                loc=stream_loc(stream),
            )
        require_bytes(stream, n * dtype.itemsize, f"metadata of {n} cells")
        raise AssertionError("unreachable")

    def _parse_variable(self, stream: Any, start: int, n: int, head: np.dtype) -> CellTable:
        view = stream.view
        cells = np.empty(n, head)
        seq_parts: list[np.ndarray] = []
        pos = start
        for i in range(n):  # only whole-context saves with shared cells come here
            stream.seek(pos)
            require_bytes(stream, head.itemsize, f"cell {i} metadata")
            cells[i] = np.frombuffer(view, dtype=head, count=1, offset=pos)[0]
            nseq = int(cells["n_seq_id"][i])
            pos += head.itemsize
            stream.seek(pos)
            require_bytes(stream, 4 * nseq, f"cell {i} seq ids")
            seq_parts.append(np.frombuffer(view, dtype="<i4", count=nseq, offset=pos))
            pos += 4 * nseq
        stream.seek(pos)
        seq = np.concatenate(seq_parts) if seq_parts else np.empty(0, np.int32)
        return CellTable(start, cells, seq, view[start:pos])

    def _build(self, obj: Any, stream: Any, context: Any, path: str) -> Any:
        stream.write(obj.raw)
        return obj


class Remainder(Construct):
    """Whatever remains of a bounded stream (the 0-3 padding bytes of a packed payload)."""

    def _parse(self, stream: Any, context: Any, path: str) -> Run:
        return Rows(stream.remaining(), "tail")._parse(stream, context, path)

    def _build(self, obj: Any, stream: Any, context: Any, path: str) -> Any:
        stream.write(obj.view if isinstance(obj, Run) else obj)
        return obj


# ---------------------------------------------------------------------------------------
# scalars with checks
# ---------------------------------------------------------------------------------------


def type_ok(type_id: int) -> bool:
    return 0 <= type_id < MAX_TYPE_ID


def row_ok(type_id: int, row: int) -> bool:
    # rows of 0 bytes exist: LFM2 short-conv layers have n_embd_s == 0 but still get an S entry
    t = TYPES.get(type_id)
    return t is None or row % t.type_size == 0


def type_msg(field: str) -> Callable[[Any], str]:
    return lambda c: f"{field} {c[field]} is not a ggml type id"


def row_msg(field: str, type_field: str) -> Callable[[Any], str]:
    return lambda c: f"{field} {c[field]} is not a whole number of {type_name(c[type_field])} blocks"


def type_name(type_id: int) -> str:
    t = TYPES.get(type_id)
    return t.name if t else f"type {type_id}"
