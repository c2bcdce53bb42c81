"""Declarative grammars of every section of llama.cpp slot and session files.

One place for bytes: everything here is a ``construct`` grammar, and the same grammars
build files, so ``build(parse(x)) == x``.  Bulk data (K/V/R/S rows, blobs, token arrays,
cell metadata) never passes through construct fields: the custom constructs below record
``(offset, length)`` and hand out zero-copy numpy views of the buffer being parsed.

Grammars are parameterised through construct's context parameters:

* ``ext``     per-cell ext size of KV metadata (0, 8 or 12 bytes; ``has_cell_ext``);
* ``whole``   True for the ``seq_id = -1`` variant (GGSN session files), where a cell
              carries a variable number of seq ids;
* ``rot``     True for state version 4 / session version 11: every KV stream's data section
              carries ``n_rot_k``, ``n_rot_v`` after ``n_layer``;
* KV blocks take ``has_v`` and REC blocks ``n_rec`` / ``has_p`` as arguments, because
  those differ between the blocks of one body.

Sources: llama.cpp ``src/llama-kv-cache.cpp`` (``state_write_meta`` / ``state_write_data``),
``src/llama-memory-recurrent.cpp``, ``src/llama-context.cpp`` (``state_seq_save_file``,
``state_save_file``, ``state_seq_get_data``), ``tools/server/server-common.cpp``
(``server_tokens::serialize``), ``tools/mtmd/mtmd.cpp`` (chunk blobs); SCKP from PR #26004,
SDFT from the article in ``shared/reference`` (see README, "Format reference").
"""

from __future__ import annotations

import functools
import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from construct import (
    Bytes,
    Computed,
    Const,
    Construct,
    ConstructError,
    Default,
    If,
    IfThenElse,
    Int8ul,
    Int32sl,
    Int32ul,
    Int64sl,
    Int64ul,
    Struct,
    Tell,
    this,
)
from construct.core import evaluate

from slotfile.format.types import TRANSPOSABLE, TYPES

# ---------------------------------------------------------------------------------------
# magics and caps
# ---------------------------------------------------------------------------------------

GGSQ_MAGIC = 0x67677371  # LLAMA_STATE_SEQ_MAGIC, include/llama.h
GGSN_MAGIC = 0x6767736E  # LLAMA_SESSION_MAGIC
IO_MAGIC = 0xAF143CD8  # llama_context::state_seq_get_data prefix
SCKP_MAGIC = b"SCKP"  # 0x504b4353 little-endian
SDFT_MAGIC = b"SDFT"  # 0x54464453 little-endian
DSV4_MAGIC = 0x34565344
PACKED_MARKER = -1  # LLAMA_TOKEN_NULL opens a packed server_tokens payload
SERVER_TOKENS_VERSION = 1
SCKP_VERSION = 1  # SLOT_CKPT_VERSION (PR #26004)
SDFT_VERSION = 1
MTMD_SERIALIZATION_VERSION = 2

# The first versions whose KV streams carry the rotation words (llama.cpp of 2026-10-05 on).
ROT_STATE_VERSION = 4  # LLAMA_STATE_SEQ_VERSION
ROT_SESSION_VERSION = 11  # LLAMA_SESSION_VERSION

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

    def __init__(self, message: str, offset: int, code: str = "invalid", loc: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.offset = offset
        self.code = code
        self.loc = loc


def _loc(stream: Any) -> str:
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
            code="truncated",
            loc=_loc(stream),
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
            raise FormatError(f"{self.what}: negative count {n}", stream.tell(), loc=_loc(stream))
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

    def __init__(self, predicate: Callable[[Any], bool], message: Callable[[Any], str], code: str = "invalid") -> None:
        super().__init__()
        self.flagbuildnone = True
        self.predicate = predicate
        self.message = message
        self.code = code

    def _parse(self, stream: Any, context: Any, path: str) -> None:
        if not self.predicate(context):
            # the failing field was the one just read: point at its start when we can
            raise FormatError(self.message(context), stream.tell(), code=self.code, loc=_loc(stream))
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
                code="bad-position",
                loc=_loc(stream),
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
                code="invalid",
                loc=_loc(stream),
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


class Tail(Construct):
    """Whatever remains of a bounded stream (the 0-3 padding bytes of a packed payload)."""

    def _parse(self, stream: Any, context: Any, path: str) -> Run:
        return Rows(stream.remaining(), "tail")._parse(stream, context, path)

    def _build(self, obj: Any, stream: Any, context: Any, path: str) -> Any:
        stream.write(obj.view if isinstance(obj, Run) else obj)
        return obj


# ---------------------------------------------------------------------------------------
# scalars with checks
# ---------------------------------------------------------------------------------------


def _type_ok(type_id: int) -> bool:
    return 0 <= type_id < MAX_TYPE_ID


def _row_ok(type_id: int, row: int) -> bool:
    # rows of 0 bytes exist: LFM2 short-conv layers have n_embd_s == 0 but still get an S entry
    t = TYPES.get(type_id)
    return t is None or row % t.type_size == 0


def _type_msg(field: str) -> Callable[[Any], str]:
    return lambda c: f"{field} {c[field]} is not a ggml type id"


def _row_msg(field: str, type_field: str) -> Callable[[Any], str]:
    return lambda c: f"{field} {c[field]} is not a whole number of {_tname(c[type_field])} blocks"


def _tname(type_id: int) -> str:
    t = TYPES.get(type_id)
    return t.name if t else f"type {type_id}"


# ---------------------------------------------------------------------------------------
# KV block: llama_kv_cache::state_write
# ---------------------------------------------------------------------------------------

# The u32 that says how V is laid out (0: rows, flash attention on; 1: transposed).
VTransWord = Int32ul

# The head of one K layer, or of one V layer when V is not transposed: type, row size.
KVLayerHead = Struct(
    "type" / Int32sl,
    "row_size" / Int64ul,
)

# The head of one transposed V layer: type, element size, n_embd_v_gqa.
KVLayerTHead = Struct(
    "type" / Int32sl,
    "el_size" / Int32ul,
    "n_embd" / Int32ul,
)

# One K layer, or one V layer when V is not transposed: type, row size, cell_count rows.
KVLayer = Struct(
    "offset" / Tell,
    "type" / Int32sl,
    Ensure(lambda c: _type_ok(c.type), _type_msg("type"), code="bad-type"),
    "row_size" / Int64ul,
    Ensure(lambda c: _row_ok(c.type, c.row_size), _row_msg("row_size", "type"), code="bad-row-size"),
    "cell_count" / Computed(this._.cell_count),
    "data" / Rows(this.row_size * this.cell_count, "rows"),
)

# One transposed V layer (v_trans == 1, flash attention off): type, element size,
# n_embd_v_gqa, then the matrix element-major (element j of every cell, for each j).
KVLayerT = Struct(
    "offset" / Tell,
    "type" / Int32sl,
    Ensure(
        lambda c: c.type in TRANSPOSABLE,
        lambda c: f"transposed V of type {_tname(c.type)} (only f32/f16/bf16 can be)",
        code="bad-type",
    ),
    "el_size" / Int32ul,
    Ensure(
        lambda c: c.el_size == TYPES[c.type].type_size,
        lambda c: f"el_size {c.el_size} does not match {_tname(c.type)}",
        code="bad-row-size",
    ),
    "n_embd" / Int32ul,
    "cell_count" / Computed(this._.cell_count),
    "data" / Rows(this.n_embd * this.cell_count * this.el_size, "transposed V columns"),
)


# One rotation width (n_rot_k or n_rot_v) of a version-4 KV stream.
RotWord = Int32ul

# Both rotation words, as a version-4 writer puts them after n_layer (what migrate inserts).
RotWords = Struct(
    "n_rot_k" / RotWord,
    "n_rot_v" / RotWord,
)


def _rot(c: Any) -> bool:
    return bool(c._params.get("rot", False))


def _kv_stream_data(has_v: bool, legacy: bool = False) -> Struct:
    v_plain = Seq("V", this.n_layer, KVLayer, 12)
    v_trans = Seq("V", this.n_layer, KVLayerT, 12)
    fields: list[Any] = [
        "cell_count" / Computed(this._.cell_count),
        # a legacy single-sequence cell is (pos, n_seq_id = 0) like a recurrent one
        "meta" / Named("cells", CellMeta(this._.cell_count, rec=legacy)),
        # a state version newer than slotfile knows is parsed by trial: a few unknown u32
        # words before v_trans and after the rotation words (params trial_pre / trial_post)
        "trial_pre" / ExtraWords(lambda c: c._params.get("trial_pre", 0), "unknown metadata words"),
        "v_trans_offset" / Tell,
        "v_trans" / VTransWord,
        Ensure(lambda c: c.v_trans in (0, 1), lambda c: f"v_trans {c.v_trans} (must be 0 or 1)"),
        "n_layer" / Int32ul,
        Ensure(
            lambda c: c.n_layer <= MAX_LAYERS,
            lambda c: f"n_layer {c.n_layer} over the cap {MAX_LAYERS}",
            code="over-cap",
        ),
        # GGSQ 4 / GGSN 11 (param ``rot``): the K and V Hadamard rotation widths of the cache,
        # 0 when not rotated (llama_kv_cache::state_write_data, llama.cpp of 2026-10-06)
        "n_rot_k" / If(_rot, Default(RotWord, 0)),  # Default: a build object without it (v3) is fine
        "n_rot_v" / If(_rot, Default(RotWord, 0)),
        "trial_post" / ExtraWords(lambda c: c._params.get("trial_post", 0), "unknown metadata words"),
        "k" / Seq("K", this.n_layer, KVLayer, 12),
    ]
    if has_v:
        fields.append("v" / IfThenElse(this.v_trans == 1, v_trans, v_plain))
    else:
        fields.append("v" / Computed(lambda c: []))
    return Struct(*fields)


def _kv_stream(has_v: bool) -> Struct:
    return Struct(
        "offset" / Tell,
        "cell_count" / Int32ul,
        "data" / If(this.cell_count > 0, _kv_stream_data(has_v)),
    )


@functools.lru_cache(maxsize=4)
def kv_block(has_v: bool = True) -> Struct:
    """One ``llama_kv_cache::state_write`` block.  ``has_v=False`` for MLA and indexer caches."""
    return Struct(
        "offset" / Tell,
        "n_stream" / Int32ul,
        Ensure(
            lambda c: 1 <= c.n_stream <= MAX_STREAMS,
            lambda c: f"n_stream {c.n_stream} (must be 1..{MAX_STREAMS})",
            code="over-cap",
        ),
        "streams" / Seq("stream", this.n_stream, _kv_stream(has_v), 4),
        "end" / Tell,
    )


@functools.lru_cache(maxsize=4)
def kv_block_legacy(has_v: bool = True) -> Struct:
    """The KV block as llama.cpp wrote it before per-stream caches (2024 to mid-2025; GGSQ 2,
    GGSN 9): ``llama_kv_cache_unified::state_write`` wrote ``cell_count`` with no ``n_stream``
    word, the layer headers even when no cell is written, and in a single-sequence save
    ``n_seq_id = 0`` with no seq id.  Recurrent models of that time used the same block (K
    holding the conv state r, V the SSM state s).  Parsed as one stream."""
    stream = Struct(
        "offset" / Tell,
        "cell_count" / Int32ul,
        "data" / _kv_stream_data(has_v, legacy=True),
    )
    return Struct(
        "offset" / Tell,
        "n_stream" / Computed(1),
        "streams" / Seq("stream", 1, stream, 12),
        "end" / Tell,
    )


KV_BLOCK = kv_block(True)
KV_BLOCK_NO_V = kv_block(False)


# ---------------------------------------------------------------------------------------
# REC block: llama_memory_recurrent::state_write
# ---------------------------------------------------------------------------------------

RecLayer = Struct(
    "offset" / Tell,
    "type" / Int32sl,
    Ensure(lambda c: _type_ok(c.type), _type_msg("type"), code="bad-type"),
    "row_size" / Int64ul,
    Ensure(lambda c: _row_ok(c.type, c.row_size), _row_msg("row_size", "type"), code="bad-row-size"),
    "cell_count" / Computed(this._.cell_count),
    "data" / Rows(this.row_size * this.cell_count, "rows"),
)

# PLE conv history after an R entry: a row size with no type field (the type is r_type).
RecPLayer = Struct(
    "offset" / Tell,
    "row_size" / Int64ul,
    "cell_count" / Computed(this._.cell_count),
    "data" / Rows(this.row_size * this.cell_count, "P rows"),
)

RecRWithP = Struct(
    "cell_count" / Computed(this._.cell_count),
    "r" / RecLayer,
    "p" / RecPLayer,
)


@functools.lru_cache(maxsize=256)
def rec_block(n_rec: int, has_p: bool = False) -> Struct:
    """One REC block with ``n_rec`` R entries and as many S entries (the written ``n_layer``
    also counts layers that have no recurrent state, so the count comes from the layout)."""
    r = Seq("R", n_rec, RecRWithP, 20) if has_p else Seq("R", n_rec, RecLayer, 12)
    return Struct(
        "offset" / Tell,
        "cell_count" / Int32ul,
        # a sequence occupies one recurrent cell: a single-sequence save has 0 or 1
        Ensure(
            lambda c: c.cell_count <= (MAX_STREAMS if c._params.get("whole") else 1),
            lambda c: f"recurrent cell_count {c.cell_count} (a single-sequence save has at most 1)",
            code="over-cap",
        ),
        "meta" / Named("cells", CellMeta(this.cell_count, rec=True)),
        "s_trans_offset" / Tell,
        "s_trans" / Int32ul,
        Ensure(lambda c: c.s_trans == 0, lambda c: f"s_trans {c.s_trans} (always written as 0)"),
        "n_layer" / Int32ul,
        Ensure(
            lambda c: c.n_layer <= MAX_LAYERS,
            lambda c: f"n_layer {c.n_layer} over the cap {MAX_LAYERS}",
            code="over-cap",
        ),
        Ensure(lambda c: n_rec <= max(c.n_layer, 1), lambda c: f"{n_rec} recurrent entries for n_layer {c.n_layer}"),
        "r" / r,
        "s" / Seq("S", n_rec, RecLayer, 12),
        "end" / Tell,
    )


# ---------------------------------------------------------------------------------------
# header, token payloads
# ---------------------------------------------------------------------------------------

FileHeader = Struct(
    "magic" / Int32ul,
    "version" / Int32ul,
    "n_token_count" / Int32ul,
)

PlainTokens = Struct(
    "offset" / Tell,
    "tokens" / NumpyArray("<i4", this._params.n_words, "token ids"),
)

# mtmd chunk blob (tools/mtmd/mtmd.cpp mtmd_input_chunk::serialize); strings are u64 + bytes.
MtmdString = Struct(
    "length" / Int64ul,
    "data" / Rows(this.length, "string"),
)
MtmdBatchEntry = Struct(
    "add_viewsep" / Int8ul,
    "add_newline" / Int8ul,
    "lead_pad" / Int32sl,
    "nx" / Int32sl,
    "ny" / Int32sl,
)
MtmdBatch = Struct(
    "is_audio" / Int8ul,
    "n_entries" / Int64ul,
    "entries" / Seq("entry", this.n_entries, MtmdBatchEntry, 14),
)
MtmdImage = Struct(
    "nx" / Int32ul,
    "ny" / Int32ul,
    "pos_type" / Int32ul,
    Ensure(lambda c: c.pos_type < 3, lambda c: f"image pos_type {c.pos_type} (0..2)"),
    "image_idx" / Int32ul,
    "n_temporal_merge" / Int32ul,
    "id" / MtmdString,
    "batch" / MtmdBatch,
)
MtmdAudio = Struct(
    "n_tokens" / Int32ul,
    "id" / MtmdString,
    "batch" / MtmdBatch,
)


MtmdChunk = Struct(
    "version" / Int64ul,
    Ensure(
        lambda c: c.version == MTMD_SERIALIZATION_VERSION,
        lambda c: f"mtmd chunk version {c.version} (must be 2)",
        code="bad-version",
    ),
    "type" / Int32ul,
    Ensure(lambda c: c.type < 3, lambda c: f"mtmd chunk type {c.type} (0 text, 1 image, 2 audio)"),
    "n_text" / Int64ul,
    "text" / NumpyArray("<i4", this.n_text, "chunk text tokens"),
    "has_image" / Int8ul,
    "image" / If(this.has_image != 0, MtmdImage),
    "has_audio" / Int8ul,
    "audio" / If(this.has_audio != 0, MtmdAudio),
)


class BoundedBlob(Construct):
    """``u32 length`` then that many bytes parsed by ``subcon``, which must use them all."""

    def __init__(self, subcon: Construct, what: str) -> None:
        super().__init__()
        self.subcon = subcon
        self.what = what

    def _parse(self, stream: Any, context: Any, path: str) -> Any:
        start = stream.tell()
        n = Int32ul._parsereport(stream, context, path)
        require_bytes(stream, n, self.what)
        body_start = stream.tell()
        sub = ViewStream(stream.view, body_start, body_start + n)
        sub.loc = stream.loc
        obj = self.subcon._parsereport(sub, context, path)
        if sub.tell() != body_start + n:
            raise FormatError(
                f"{self.what} declares {n} bytes but its content ends after {sub.tell() - body_start}",
                sub.tell(),
                loc=_loc(stream),
            )
        stream.seek(body_start + n)
        return {"offset": start, "length": n, "raw": stream.view[body_start : body_start + n], "chunk": obj}

    def _build(self, obj: Any, stream: Any, context: Any, path: str) -> Any:
        raw = obj["raw"]
        stream.write(len(raw).to_bytes(4, "little"))
        stream.write(raw)
        return obj


PackedTokens = Struct(
    "offset" / Tell,
    "marker" / Int32sl,
    Ensure(lambda c: c.marker == PACKED_MARKER, lambda c: "packed payload must open with -1"),
    "version" / Int32ul,
    Ensure(
        lambda c: c.version == SERVER_TOKENS_VERSION,
        lambda c: f"server_tokens version {c.version} (only 1 is known)",
        code="bad-version",
    ),
    "n_tokens" / Int32ul,
    "tokens" / NumpyArray("<i4", this.n_tokens, "tokens"),
    "n_media" / Int32ul,
    "media_keys" / NumpyArray("<u4", this.n_media, "media keys"),
    "media" / Seq("media", this.n_media, BoundedBlob(MtmdChunk, "media chunk"), 4),
    "padding_offset" / Tell,
    "padding" / Tail(),
    Ensure(
        lambda c: c.padding.length < 4,
        lambda c: f"{c.padding.length} bytes after the last media chunk (the server refuses 4 or more)",
        code="trailing-bytes",
    ),
)


# ---------------------------------------------------------------------------------------
# in-memory sequence blob, SCKP and SDFT appendices
# ---------------------------------------------------------------------------------------

SeqBlobPrefix = Struct(
    "io_magic" / Int32ul,
    Ensure(
        lambda c: c.io_magic == IO_MAGIC,
        lambda c: f"blob magic 0x{c.io_magic:08x} (must be 0x{IO_MAGIC:08x})",
        code="bad-magic",
    ),
    "seq_id" / Int32sl,
)

# u64 length then bytes (ckpt_write_buf in the SCKP writer; SDFT uses the same helper)
BlobLength = Int64ul

Blob = Struct(
    "offset" / Tell,
    "length" / BlobLength,
    "data" / Rows(this.length, "blob"),
)

SckpHeader = Struct(
    "offset" / Tell,
    "magic" / Const(SCKP_MAGIC),
    "version" / Int32ul,
    "count" / Int32ul,
)

# The same 12 bytes whatever the magic says (a repair may find intact entries behind an
# overwritten magic).
SckpHeaderAnyMagic = Struct(
    "offset" / Tell,
    "magic" / Bytes(4),
    "version" / Int32ul,
    "count" / Int32ul,
)

# n_tokens is 64-bit (PR #26004's load_slot_checkpoints reads it with ckpt_read<int64_t>).
NTokens = Int64sl

CheckpointHead = Struct(
    "n_tokens" / NTokens,
    "pos_min" / Int32sl,
    "pos_max" / Int32sl,
)

CheckpointEntry = Struct(
    "offset" / Tell,
    "n_tokens" / NTokens,
    "pos_min" / Int32sl,
    "pos_max" / Int32sl,
    "tgt" / Named("data_tgt", Blob),
    "dft" / Named("data_dft", Blob),
    "spec" / Named("data_spec", Blob),
    "end" / Tell,
)

Sckp = Struct(
    "header" / SckpHeader,
    "entries" / Seq("checkpoint", this.header.count, CheckpointEntry, 40),
)

SdftHeader = Struct(
    "offset" / Tell,
    "magic" / Const(SDFT_MAGIC),
    "version" / Int32ul,
)

SdftBody = Struct(
    "dft" / Named("data_dft", Blob),
    "spec" / Named("data_spec", Blob),
    "end" / Tell,
)

Sdft = Struct(
    "header" / SdftHeader,
    "body" / SdftBody,
)

# GGSN v10 (llama_context::state_write_data): the arch string after the tokens.
ArchString = Struct(
    "offset" / Tell,
    "length" / Int32ul,
    Ensure(lambda c: c.length <= 256, lambda c: f"arch name of {c.length} bytes (over 256)", code="over-cap"),
    "data" / Rows(this.length, "arch name"),
)

# GGSN v9 wrote output ids, logits and embeddings between the arch and the memory.
GgsnV9Extra = Struct(
    "n_outputs" / Int32ul,
    "output_ids" / NumpyArray("<i4", this.n_outputs, "output ids"),
    "logits_size" / Int64ul,
    "logits" / NumpyArray("<f4", this.logits_size, "logits"),
    "embd_size" / Int64ul,
    "embd" / NumpyArray("<f4", this.embd_size, "embeddings"),
)


def build(grammar: Construct, obj: Any, **params: Any) -> bytes:
    """Build ``obj`` with ``grammar``; parameters as for parsing (``ext``, ``whole``, ``n_words``)."""
    out = io.BytesIO()
    grammar.build_stream(obj, out, **params)
    return out.getvalue()


def parse(grammar: Construct, stream: ViewStream, **params: Any) -> Any:
    return grammar.parse_stream(stream, **params)


# ---------------------------------------------------------------------------------------
# the build side of the small framing pieces a repair writes around copied ranges
# ---------------------------------------------------------------------------------------


def file_header(magic: int, version: int, n_token_count: int) -> bytes:
    return build(FileHeader, {"magic": magic, "version": version, "n_token_count": n_token_count})


def plain_tokens(words: Any) -> bytes:
    """``words`` as the i32 array of section B (plain ids, or a packed payload's words)."""
    arr = np.asarray(words, dtype="<i4")
    return build(PlainTokens, {"tokens": arr}, n_words=arr.size)


def sckp_header(count: int, version: int = SCKP_VERSION) -> bytes:
    return build(SckpHeader, {"version": version, "count": count})


def checkpoint_head(n_tokens: int, pos_min: int, pos_max: int) -> bytes:
    return build(CheckpointHead, {"n_tokens": n_tokens, "pos_min": pos_min, "pos_max": pos_max})


def blob_length(n: int) -> bytes:
    """The u64 length in front of every SCKP/SDFT blob (0: no blob)."""
    return build(BlobLength, n)


def sdft_header(version: int = SDFT_VERSION) -> bytes:
    return build(SdftHeader, {"version": version})


def rot_words(n_rot_k: int, n_rot_v: int) -> bytes:
    """The two rotation words of a version-4 KV stream (migrate inserts them)."""
    return build(RotWords, {"n_rot_k": n_rot_k, "n_rot_v": n_rot_v})


def n_stream_word(n_stream: int) -> bytes:
    """A KV block's ``u32 n_stream`` (also an empty stream's ``u32 cell_count = 0``)."""
    return build(Int32ul, n_stream)


def v_trans_word(v_trans: int) -> bytes:
    return build(VTransWord, v_trans)


def kv_layer_head(type_id: int, row_size: int) -> bytes:
    return build(KVLayerHead, {"type": type_id, "row_size": row_size})


def kv_layer_t_head(type_id: int, el_size: int, n_embd: int) -> bytes:
    return build(KVLayerTHead, {"type": type_id, "el_size": el_size, "n_embd": n_embd})
