"""The parsed file as plain records: what the reader produces and every other module reads.

Pure data, no parsing: :class:`SlotFile` and its parts (tokens, body, memory blocks, layer
runs, appendices, checkpoints), plus what the model says the state must look like
(:class:`ModelExpect`), so that the reader, the model expectation (:mod:`slotfile.model.expect`) and
the comparison (:mod:`slotfile.model.compare`) all import these records and none imports another
for its types.  Bulk data stays a zero-copy view (:class:`slotfile.format.grammar.Run`) over the
file's buffer.  :class:`Problem` and :class:`Severity` live in :mod:`slotfile.problems` (with the
registry of problem codes) and are re-exported here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Generic, TypeVar

import numpy as np

from slotfile.format import grammar as g
from slotfile.format.appendix import BlobSpan
from slotfile.format.layout import Layout, MemoryKind
from slotfile.format.magics import FileFormat as FileFormat  # defined there: the loader pool reads it
from slotfile.format.types import ELEMENT_DTYPE, TYPES, type_name
from slotfile.problems import Problem, ProblemCode, Severity

__all__ = [
    "Appendix",
    "BlobInfo",
    "BlockExpect",
    "Body",
    "CacheExpect",
    "Checkpoint",
    "FileFormat",
    "KVStream",
    "LayerRun",
    "MemoryBlock",
    "MemoryKind",
    "ModelExpect",
    "Problem",
    "RecExpect",
    "Section",
    "Severity",
    "SlotFile",
    "TokenForm",
    "TokenPayload",
]


class TokenForm(StrEnum):
    PACKED = "packed"  # server_tokens::serialize
    PLAIN = "plain"  # the ids themselves
    EMPTY = "empty"


@dataclass(slots=True)
class Section:
    name: str
    offset: int
    size: int
    note: str = ""


@dataclass(slots=True)
class LayerRun:
    """One layer's rows of one tensor (K, V, R, P or S) in one stream."""

    part: str
    index: int
    offset: int  # where the entry's header starts
    type_id: int
    row_size: int  # bytes per cell (for transposed V: n_embd * el_size)
    n_cells: int
    data: g.Run
    transposed: bool = False
    n_embd: int | None = None

    @property
    def type_name(self) -> str:
        return type_name(self.type_id)

    @property
    def elements(self) -> int | None:
        if self.n_embd is not None:
            return self.n_embd
        t = TYPES.get(self.type_id)
        return t.row_elements(self.row_size) if t else None

    def array(self) -> np.ndarray:
        """Zero-copy view: (cells, elements) for f32/f16/bf16-as-u16, (elements, cells) when
        transposed, raw (cells, row bytes) uint8 for quantized types."""
        dt = ELEMENT_DTYPE.get(self.type_id)
        if dt is None or self.elements is None:
            return self.data.array(np.uint8).reshape(self.n_cells, -1) if self.n_cells else self.data.array(np.uint8)
        arr = self.data.array(dt)
        shape = (self.elements, self.n_cells) if self.transposed else (self.n_cells, self.elements)
        if not arr.size and max(shape) * arr.itemsize > np.iinfo(np.intp).max:
            shape = (0, 0)  # no cells: the row size was never backed by bytes and numpy cannot hold it
        return arr.reshape(shape)


@dataclass(slots=True)
class KVStream:
    index: int
    offset: int
    cell_count: int
    cells: g.CellTable | None = None
    v_trans: int | None = None
    n_layer: int = 0
    # state version 4 / session 11 only (None before): the K and V rotation widths, 0 = none
    n_rot_k: int | None = None
    n_rot_v: int | None = None
    rot_offset: int | None = None  # file offset of n_rot_k (n_rot_v follows)
    k: list[LayerRun] = field(default_factory=list)
    v: list[LayerRun] = field(default_factory=list)

    @property
    def positions(self) -> np.ndarray:
        return self.cells.cells["pos"] if self.cells is not None else np.empty(0, np.int32)


@dataclass(slots=True)
class MemoryBlock:
    role: str
    kind: MemoryKind
    offset: int
    end: int
    has_v: bool = True
    n_stream: int = 0
    streams: list[KVStream] = field(default_factory=list)
    # REC only
    cell_count: int = 0
    cells: g.CellTable | None = None
    n_layer: int = 0
    r: list[LayerRun] = field(default_factory=list)
    p: list[LayerRun] = field(default_factory=list)
    s: list[LayerRun] = field(default_factory=list)
    raw: Any = None  # the construct Container, for building

    @property
    def size(self) -> int:
        return self.end - self.offset

    def active_streams(self) -> list[KVStream]:
        return [s for s in self.streams if s.cell_count]

    def runs(self) -> list[LayerRun]:
        out: list[LayerRun] = []
        for s in self.streams:
            out += s.k + s.v
        return out + self.r + self.p + self.s

    def n_cells(self) -> int:
        if self.kind == MemoryKind.REC:
            return self.cell_count
        return sum(s.cell_count for s in self.streams)

    def positions(self) -> np.ndarray:
        if self.kind == MemoryKind.REC:
            return self.cells.cells["pos"] if self.cells is not None else np.empty(0, np.int32)
        parts = [s.positions for s in self.streams if s.cell_count]
        return np.concatenate(parts) if parts else np.empty(0, np.int32)


@dataclass(slots=True)
class Body:
    offset: int
    end: int
    layout: Layout | None
    confidence: str  # a layout.Confidence
    blocks: list[MemoryBlock] = field(default_factory=list)
    alternatives: list[Layout] = field(default_factory=list)

    @property
    def size(self) -> int:
        return self.end - self.offset

    @property
    def memory_class(self) -> str:
        return self.layout.memory_class if self.layout else "unknown"


B = TypeVar("B", bound=BlobSpan)


@dataclass(slots=True)
class BlobInfo(BlobSpan):
    name: str
    offset: int  # of the u64 length field
    length: int
    data: g.Run
    seq_id: int | None = None
    body: Body | None = None


@dataclass(slots=True)
class CheckpointFields(Generic[B]):
    """One SCKP entry as server_context writes it (n_tokens, pos_min, pos_max and the blobs
    data_tgt, data_dft, data_spec), with where it lies; ``B`` is how a blob is described
    (:class:`BlobInfo` here, repair's ``BlobRef`` for its own walk)."""

    index: int
    offset: int
    end: int
    n_tokens: int
    pos_min: int
    pos_max: int
    tgt: B
    dft: B
    spec: B


@dataclass(slots=True)
class Checkpoint(CheckpointFields[BlobInfo]):
    """A checkpoint of a file the reader opened."""


@dataclass(slots=True)
class Appendix:
    name: str  # "SCKP" or "SDFT"
    offset: int
    end: int
    version: int
    count: int = 0  # SCKP
    complete: bool = True
    dft: BlobInfo | None = None  # SDFT
    spec: BlobInfo | None = None


@dataclass(slots=True)
class TokenPayload:
    form: TokenForm
    offset: int
    n_words: int
    tokens: np.ndarray
    version: int | None = None
    media: list[dict[str, Any]] = field(default_factory=list)
    padding: int = 0
    raw: Any = None

    @property
    def size(self) -> int:
        return 4 * self.n_words

    @property
    def ids_offset(self) -> int:
        """File offset of the first token id (after the packed form's marker, version, count)."""
        return self.offset + (12 if self.form == TokenForm.PACKED else 0)


# ---------------------------------------------------------------------------------------
# what the model says the state must look like (built by slotfile.model.expect)
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheExpect:
    """One ``llama_kv_cache`` block."""

    role: str  # "kv", "kv-base", "kv-swa", "kv-index"
    layers: tuple[int, ...]  # model layer indices in this cache, ascending
    n_embd_k: tuple[int, ...]  # per cache layer: n_embd_k_gqa(il)
    n_embd_v: tuple[int, ...]  # per cache layer: n_embd_v_gqa(il); () when the cache has no V
    # what the rotation widths of state version 4 derive from (llama_kv_cache ctor, slotfile.model.expect)
    head_k: int = 0  # n_embd_head_k_all: the head size all cache layers share; -1 mixed, 0 no layer
    head_v: int = 0  # n_embd_head_v_all (0 for an MLA cache)
    head_k_first: int = 0  # hparams.n_embd_head_k() / _v(): layer 0's head size, whatever the cache
    head_v_first: int = 0
    rot_k_always: bool = False  # a DeepSeek/GLM lightning indexer: K rotated whatever its type

    @property
    def kind(self) -> MemoryKind:
        return MemoryKind.KV

    @property
    def has_v(self) -> bool:
        # has_v is uniform over a cache (llama_kv_cache ctor: has_v = !is_mla)
        return len(self.n_embd_v) == len(self.n_embd_k)


@dataclass(frozen=True)
class RecExpect:
    """One ``llama_memory_recurrent`` block."""

    n_layer_field: int  # the n_layer word: hparams.n_layer(), null layers included
    layers: tuple[int, ...]  # layers with R/S entries
    n_embd_r: int
    n_embd_s: int
    has_p: bool = False
    role: str = "rec"

    @property
    def kind(self) -> MemoryKind:
        return MemoryKind.REC


BlockExpect = CacheExpect | RecExpect


@dataclass(frozen=True)
class ModelExpect:
    arch: str
    memory_class: str
    blocks: tuple[BlockExpect, ...]  # body order for a full (flags = 0) save
    partial_blocks: tuple[BlockExpect, ...]  # body order under LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
    cell_ext: int  # 0 or 12 (llama_kv_cache::has_cell_ext)
    n_vocab: int
    n_ctx_train: int
    n_layer: int
    notes: tuple[str, ...] = ()

    @property
    def modelled(self) -> bool:
        """Whether ``blocks`` describes the body (False: unknown arch or unmodelled class)."""
        return self.memory_class == "none" or bool(self.blocks)


# ---------------------------------------------------------------------------------------
# the whole file
# ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class SlotFile:
    path: str
    size: int
    format: FileFormat
    version: int | None = None
    n_token_count: int | None = None
    tokens: TokenPayload | None = None
    arch: str | None = None
    body: Body | None = None
    sckp: Appendix | None = None
    checkpoints: list[Checkpoint] = field(default_factory=list)
    draft: Appendix | None = None
    trailing: tuple[int, int] | None = None
    sections: list[Section] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    buffer: Any = None
    expect: ModelExpect | None = None  # of --model, when given
    draft_expect: ModelExpect | None = None  # of --draft-model

    def __post_init__(self) -> None:
        self.format = FileFormat(self.format)  # a caller may still pass the plain string

    def close(self) -> None:
        """Release the mapping (where no numpy view of it is still alive: then it goes with them)."""
        buf, self.buffer = self.buffer, None
        closer = getattr(buf, "close", None)
        if closer is not None:
            try:
                closer()
            except BufferError:  # numpy views still alive: the mapping goes with them
                pass

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == Severity.ERROR]

    @property
    def file_problems(self) -> list[Problem]:
        """The problems the bytes show by themselves (without the model check)."""
        return [p for p in self.problems if not p.from_model]

    @property
    def model_problems(self) -> list[Problem]:
        """The problems of the model check (slotfile.model.check.check_against_model)."""
        return [p for p in self.problems if p.from_model]

    def value_runs(self) -> Iterator[tuple[str, LayerRun]]:
        """Every non-empty K/V/R/P/S run of the body, the checkpoint blobs and the draft
        state, as (section name, run), in file order."""
        bodies = [("body", self.body)]
        bodies += [(f"sckp.checkpoint[{c.index}].{b.name}", b.body) for c in self.checkpoints for b in (c.tgt, c.dft)]
        if self.draft and self.draft.dft:
            bodies.append(("sdft.data_dft", self.draft.dft.body))
        for name, body in bodies:
            if body is None:
                continue
            for blk in body.blocks:
                for r in blk.runs():
                    if r.data.length:
                        yield f"{name}.{blk.role}", r

    @property
    def verdict(self) -> str:
        if self.errors:
            return "damaged"
        if self.problems:
            return "ok with warnings"
        return "ok"

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.tokens.size) if self.tokens is not None else 0

    def problem(self, severity: Severity, code: ProblemCode, section: str, offset: int, message: str) -> None:
        """Add a structure problem.  The code is a :class:`ProblemCode` member, so an unregistered one is
        a type error; a plain string still passes at run time only when it is registered (ValueError)."""
        self.problems.append(Problem(Severity(severity), ProblemCode(code), section, offset, message))
