"""Grammars of the memory blocks of a body: ``llama_kv_cache::state_write`` (KV, in the
current and the pre-mid-2025 layout) and ``llama_memory_recurrent::state_write`` (REC).
:mod:`slotfile.format.grammar` re-exports them; see its docstring for the context parameters."""

from __future__ import annotations

import functools
import struct
from typing import Any

from construct import (
    Computed,
    Construct,
    Default,
    FormatField,
    If,
    IfThenElse,
    Int32sl,
    Int32ul,
    Int64ul,
    Renamed,
    Struct,
    Tell,
    this,
)

from slotfile.format.grammar_core import (
    MAX_LAYERS,
    MAX_STREAMS,
    CellMeta,
    Ensure,
    ExtraWords,
    Named,
    Rows,
    Seq,
    row_msg,
    row_ok,
    type_msg,
    type_name,
    type_ok,
)
from slotfile.format.types import TRANSPOSABLE, TYPES
from slotfile.problems import ProblemCode

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
    Ensure(lambda c: type_ok(c.type), type_msg("type"), code=ProblemCode.BAD_TYPE),
    "row_size" / Int64ul,
    Ensure(lambda c: row_ok(c.type, c.row_size), row_msg("row_size", "type"), code=ProblemCode.BAD_ROW_SIZE),
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
        lambda c: f"transposed V of type {type_name(c.type)} (only f32/f16/bf16 can be)",
        code=ProblemCode.BAD_TYPE,
    ),
    "el_size" / Int32ul,
    Ensure(
        lambda c: c.el_size == TYPES[c.type].type_size,
        lambda c: f"el_size {c.el_size} does not match {type_name(c.type)}",
        code=ProblemCode.BAD_ROW_SIZE,
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
            code=ProblemCode.OVER_CAP,
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
            code=ProblemCode.OVER_CAP,
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


# ---------------------------------------------------------------------------------------
# REC block: llama_memory_recurrent::state_write
# ---------------------------------------------------------------------------------------

# One R or S layer: llama_memory_recurrent::state_write_data writes type, row size and
# cell_count rows exactly as llama_kv_cache writes a K layer.
RecLayer = KVLayer

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
            code=ProblemCode.OVER_CAP,
        ),
        "meta" / Named("cells", CellMeta(this.cell_count, rec=True)),
        "s_trans_offset" / Tell,
        "s_trans" / Int32ul,
        Ensure(lambda c: c.s_trans == 0, lambda c: f"s_trans {c.s_trans} (always written as 0)"),
        "n_layer" / Int32ul,
        Ensure(
            lambda c: c.n_layer <= MAX_LAYERS,
            lambda c: f"n_layer {c.n_layer} over the cap {MAX_LAYERS}",
            code=ProblemCode.OVER_CAP,
        ),
        Ensure(lambda c: n_rec <= max(c.n_layer, 1), lambda c: f"{n_rec} recurrent entries for n_layer {c.n_layer}"),
        "r" / r,
        "s" / Seq("S", n_rec, RecLayer, 12),
        "end" / Tell,
    )


# ---------------------------------------------------------------------------------------
# single heads, for probes that cannot parse a whole block
# ---------------------------------------------------------------------------------------

# A count word: n_stream of a KV block, cell_count of a stream or REC block, n_layer.
CountWord = Int32ul

# What follows a KV stream's cell table (before the rotation words of version 4).
KVStreamHead = Struct(
    "v_trans" / VTransWord,
    "n_layer" / Int32ul,
)

# The head of a recurrent cell (and of a legacy single-sequence KV cell): pos, n_seq_id.
RecCellHead = Struct(
    "pos" / Int32sl,
    "n_seq_id" / Int32ul,
)


def fixed_reader(grammar: Construct) -> struct.Struct:
    """A :class:`struct.Struct` that reads ``grammar`` (one little-endian integer field, or a
    Struct of them) at struct's speed.  For probes and scans that read heads one at a time in
    a loop (a cut body's settings, a REC block's entry count): the layout still comes from the
    grammar, never from offsets written out by hand."""
    fields = grammar.subcons if isinstance(grammar, Struct) else [grammar]
    fmt = "<"
    for field in fields:
        c = field.subcon if isinstance(field, Renamed) else field
        if not isinstance(c, FormatField) or not c.fmtstr.startswith("<"):
            raise TypeError(f"not a little-endian integer field: {field!r}")
        fmt += c.fmtstr[1:]
    return struct.Struct(fmt)


COUNT = fixed_reader(CountWord)
KV_STREAM_HEAD = fixed_reader(KVStreamHead)  # v_trans, n_layer
LAYER_HEAD = fixed_reader(KVLayerHead)  # type, row_size: a K layer, a plain V layer, a REC entry
REC_CELL_HEAD = fixed_reader(RecCellHead)  # pos, n_seq_id


def read_fixed(reader: struct.Struct, view: Any, off: int, end: int) -> tuple[Any, ...] | None:
    """The fields ``reader`` reads at ``off``; None where fewer than its size bytes remain."""
    if off < 0 or off + reader.size > end:
        return None
    return reader.unpack_from(view, off)
