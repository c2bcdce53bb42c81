"""Declarative grammars of every section of llama.cpp slot and session files.

One place for bytes: everything here is a ``construct`` grammar, and the same grammars
build files, so ``build(parse(x)) == x``.  Bulk data (K/V/R/S rows, blobs, token arrays,
cell metadata) never passes through construct fields: the custom constructs of
:mod:`slotfile.format.grammar_core` record ``(offset, length)`` and hand out zero-copy numpy
views of the buffer being parsed.  The memory blocks (KV, REC) are in
:mod:`slotfile.format.grammar_memory`; this module holds the file's framing (header, tokens,
session prefix, appendices) and re-exports the other two, so callers import one module.

Grammars are parameterised through construct's context parameters, which one
:class:`~slotfile.format.grammar_variant.SlotGrammar` per file variant holds and passes:

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

import io
from typing import Any

import numpy as np
from construct import (
    Bytes,
    Const,
    Construct,
    If,
    Int8ul,
    Int32sl,
    Int32ul,
    Int64sl,
    Int64ul,
    Struct,
    Tell,
    this,
)

from slotfile.format.grammar_core import (
    MAX_CHECKPOINTS,
    MAX_LAYERS,
    MAX_STREAMS,
    MAX_TYPE_ID,
    MTMD_SERIALIZATION_VERSION,
    PACKED_MARKER,
    REC_CELL_DTYPE,
    SCKP_VERSION,
    SDFT_VERSION,
    SERVER_TOKENS_VERSION,
    CellMeta,
    CellTable,
    Ensure,
    ExtraWords,
    FormatError,
    Named,
    NumpyArray,
    Remainder,
    Rows,
    Run,
    Seq,
    ViewStream,
    kv_cell_dtype,
    require_bytes,
    row_msg,
    row_ok,
    stream_loc,
    type_msg,
    type_name,
    type_ok,
)
from slotfile.format.grammar_memory import (
    COUNT,
    KV_BLOCK,
    KV_STREAM_HEAD,
    LAYER_HEAD,
    REC_CELL_HEAD,
    CountWord,
    KVLayer,
    KVLayerHead,
    KVLayerT,
    KVLayerTHead,
    KVStreamHead,
    RecCellHead,
    RecLayer,
    RecPLayer,
    RecRWithP,
    RotWord,
    RotWords,
    VTransWord,
    fixed_reader,
    kv_block,
    kv_block_legacy,
    read_fixed,
    rec_block,
)
from slotfile.format.grammar_variant import SlotGrammar
from slotfile.format.magics import DSV4_MAGIC, GGSN_MAGIC, GGSQ_MAGIC, IO_MAGIC, SCKP_MAGIC, SDFT_MAGIC
from slotfile.problems import ProblemCode

# The grammars of the building blocks and the memory blocks live in grammar_core and
# grammar_memory; this module is the one entry every caller imports them from.
__all__ = [
    "COUNT",
    "DSV4_MAGIC",
    "GGSN_MAGIC",
    "GGSQ_MAGIC",
    "IO_MAGIC",
    "KV_BLOCK",
    "KV_STREAM_HEAD",
    "LAYER_HEAD",
    "MAX_CHECKPOINTS",
    "MAX_LAYERS",
    "MAX_STREAMS",
    "MAX_TYPE_ID",
    "MTMD_SERIALIZATION_VERSION",
    "PACKED_MARKER",
    "REC_CELL_DTYPE",
    "REC_CELL_HEAD",
    "SCKP_MAGIC",
    "SCKP_VERSION",
    "SDFT_MAGIC",
    "SDFT_VERSION",
    "SERVER_TOKENS_VERSION",
    "ArchString",
    "Blob",
    "BlobLength",
    "BoundedBlob",
    "CellMeta",
    "CellTable",
    "CheckpointEntry",
    "CheckpointHead",
    "CountWord",
    "Ensure",
    "ExtraWords",
    "FileHeader",
    "FormatError",
    "GgsnV9Extra",
    "KVLayer",
    "KVLayerHead",
    "KVLayerT",
    "KVLayerTHead",
    "KVStreamHead",
    "MtmdAudio",
    "MtmdBatch",
    "MtmdBatchEntry",
    "MtmdChunk",
    "MtmdImage",
    "MtmdString",
    "NTokens",
    "Named",
    "NumpyArray",
    "PackedTokens",
    "PlainTokens",
    "RecCellHead",
    "RecLayer",
    "RecPLayer",
    "RecRWithP",
    "Remainder",
    "RotWord",
    "RotWords",
    "Rows",
    "Run",
    "SckpHeader",
    "SckpHeaderAnyMagic",
    "SdftBody",
    "SdftHeader",
    "Seq",
    "SeqBlobPrefix",
    "SlotGrammar",
    "VTransWord",
    "ViewStream",
    "blob_length",
    "build",
    "checkpoint_head",
    "file_header",
    "fixed_reader",
    "kv_block",
    "kv_block_legacy",
    "kv_cell_dtype",
    "kv_layer_head",
    "kv_layer_t_head",
    "n_stream_word",
    "parse",
    "plain_tokens",
    "read_fixed",
    "rec_block",
    "require_bytes",
    "rot_words",
    "row_msg",
    "row_ok",
    "sckp_header",
    "sdft_header",
    "stream_loc",
    "type_msg",
    "type_name",
    "type_ok",
    "v_trans_word",
]
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
        code=ProblemCode.BAD_VERSION,
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
                loc=stream_loc(stream),
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
        code=ProblemCode.BAD_VERSION,
    ),
    "n_tokens" / Int32ul,
    "tokens" / NumpyArray("<i4", this.n_tokens, "tokens"),
    "n_media" / Int32ul,
    "media_keys" / NumpyArray("<u4", this.n_media, "media keys"),
    "media" / Seq("media", this.n_media, BoundedBlob(MtmdChunk, "media chunk"), 4),
    "padding_offset" / Tell,
    "padding" / Remainder(),
    Ensure(
        lambda c: c.padding.length < 4,
        lambda c: f"{c.padding.length} bytes after the last media chunk (the server refuses 4 or more)",
        code=ProblemCode.TRAILING_BYTES,
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
        code=ProblemCode.BAD_MAGIC,
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
    *CheckpointHead.subcons,
    "tgt" / Named("data_tgt", Blob),
    "dft" / Named("data_dft", Blob),
    "spec" / Named("data_spec", Blob),
    "end" / Tell,
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

# GGSN v10 (llama_context::state_write_data): the arch string after the tokens.
ArchString = Struct(
    "offset" / Tell,
    "length" / Int32ul,
    Ensure(lambda c: c.length <= 256, lambda c: f"arch name of {c.length} bytes (over 256)", code=ProblemCode.OVER_CAP),
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
