"""The records of a comparison of two slot files: what ``slotfile diff`` prints and ``--json`` shows.

Plain data, no comparing: :mod:`slotfile.diff.engine` fills a :class:`DiffReport` in file order
(headers and settings, tokens, cells and layer runs of the body, appendices) and the command
renders it.  ``to_dict`` gives schema ``slotfile.diff/1`` (documented in the README; keys are only
ever added).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from slotfile.exitcodes import OK, OPERATIONAL

SCHEMA = "slotfile.diff/1"
DIFFERENT = 1  # like cmp: 0 identical, 1 different; 8 (OPERATIONAL) when a file cannot be read


class Status(StrEnum):
    IDENTICAL = "identical"
    DIFFERENT = "different"
    ONLY_A = "only-a"  # present in the first file only
    ONLY_B = "only-b"
    INCOMPARABLE = "incomparable"  # present in both, in shapes that cannot be compared value by value
    NOT_COMPARED = "not-compared"  # no cell both files hold for the shared token prefix


class Verdict(StrEnum):
    IDENTICAL = "identical"
    ROTATION_ONLY = "identical-but-rotation"  # a v3 file and its v4 migration: only version and rotation words
    VERSION_ONLY = "identical-but-version"  # only the version word differs (same format, every other byte equal)
    DIFFERENT = "different"
    UNREADABLE = "unreadable"


def clean(v: Any) -> Any:
    """A JSON-safe value: non-finite floats become None, floats are rounded."""
    if isinstance(v, float):
        return round(v, 6) if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: clean(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [clean(x) for x in v]
    return v


@dataclass(slots=True)
class Side:
    """What one file is: path, size, format and version, the reader's verdict and problems."""

    path: str
    size: int | None = None
    format: str | None = None
    version: int | None = None
    verdict: str | None = None
    problems: list[dict[str, Any]] = field(default_factory=list)
    unreadable: str | None = None  # why the file (or its state) cannot be read; None when it can

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "size": self.size,
            "format": self.format,
            "version": self.version,
            "verdict": self.verdict,
            "problems": self.problems,
            "unreadable": self.unreadable,
        }


@dataclass(slots=True)
class FieldDiff:
    """One header or settings field of both files (``a`` / ``b``: None where a file lacks it)."""

    section: str  # "header", "tokens", "body", "body.kv", "body.kv.stream[0]", "sckp", "sdft"
    name: str
    a: Any
    b: Any
    # a difference made by state version 4 alone: the version word, rotation words one file lacks
    rotation: bool = False

    @property
    def same(self) -> bool:
        return bool(self.a == self.b)

    def to_dict(self) -> dict[str, Any]:
        return {
            "section": self.section,
            "field": self.name,
            "a": self.a,
            "b": self.b,
            "same": self.same,
            "rotation": self.rotation,
        }


def _version(f: FieldDiff) -> bool:
    """The header's version word (the format word is a field of its own: two formats differ)."""
    return f.section == "header" and f.name == "version"


@dataclass(slots=True)
class TokenDiff:
    n_a: int
    n_b: int
    shared: int  # length of the common prefix
    first_diff: int | None  # None when equal
    token_a: int | None = None  # the ids at first_diff (None past a file's end)
    token_b: int | None = None
    media_same: bool = True
    context_start: int = 0  # the index the shared context starts at
    shared_ids: list[int] = field(default_factory=list)  # the last shared ids before first_diff
    ids_a: list[int] = field(default_factory=list)  # each side's ids from first_diff on (a few)
    ids_b: list[int] = field(default_factory=list)
    shared_text: str | None = None  # the same, detokenised with --model
    text_a: str | None = None
    text_b: str | None = None

    @property
    def same(self) -> bool:
        return self.first_diff is None and self.media_same

    def to_dict(self) -> dict[str, Any]:
        return {
            "same": self.same,
            "n_a": self.n_a,
            "n_b": self.n_b,
            "shared": self.shared,
            "first_diff": self.first_diff,
            "token_a": self.token_a,
            "token_b": self.token_b,
            "media_same": self.media_same,
            "context": {
                "start": self.context_start,
                "shared_ids": self.shared_ids,
                "ids_a": self.ids_a,
                "ids_b": self.ids_b,
                "shared_text": self.shared_text,
                "text_a": self.text_a,
                "text_b": self.text_b,
            },
        }


@dataclass(slots=True)
class CellsDiff:
    """How the cells of one KV stream (or REC block) line up: cells ``a0 .. a0+compared`` of A
    hold the same positions (and cell metadata) as ``b0 .. b0+compared`` of B."""

    container: str  # "body", "sckp.checkpoint[0].data_tgt", "sdft.data_dft"
    block: str
    stream: int | None
    cells_a: int
    cells_b: int
    a0: int = 0
    b0: int = 0
    compared: int = 0
    pos_first: int | None = None
    pos_last: int | None = None
    meta_same: bool = True  # seq ids / cell ext of the compared cells
    note: str = ""

    @property
    def same(self) -> bool:
        return self.meta_same and self.compared == self.cells_a == self.cells_b

    @property
    def where(self) -> str:
        return f"{self.container}.{self.block}" + (f".stream[{self.stream}]" if self.stream is not None else "")

    def to_dict(self) -> dict[str, Any]:
        return {
            "section": self.where,
            "container": self.container,
            "block": self.block,
            "stream": self.stream,
            "cells_a": self.cells_a,
            "cells_b": self.cells_b,
            "a0": self.a0,
            "b0": self.b0,
            "compared": self.compared,
            "pos_first": self.pos_first,
            "pos_last": self.pos_last,
            "meta_same": self.meta_same,
            "same": self.same,
            "note": self.note,
        }


@dataclass(slots=True)
class RunDiff:
    """One layer's K/V/R/P/S rows of both files, over the cells they share."""

    container: str
    block: str
    stream: int | None
    part: str
    layer: int
    status: Status
    type_a: str | None = None
    type_b: str | None = None
    offset_a: int | None = None  # file offset of the run's first data byte
    offset_b: int | None = None
    cells: int = 0  # cells compared
    by_value: bool = False  # byte layouts differ (type, v_trans): compared after dequantizing
    differing_cells: int = 0
    first_cell: int | None = None  # first differing compared cell (A's cell index)
    first_pos: int | None = None
    first_offset_a: int | None = None  # first differing byte (same byte layout only)
    first_offset_b: int | None = None
    stats: dict[str, Any] | None = None
    reason: str = ""
    model_layer: int | None = None  # with --model: the model's layer index of this cache layer

    @property
    def where(self) -> str:
        return f"{self.container}.{self.block}" + (f".stream[{self.stream}]" if self.stream is not None else "")

    def to_dict(self) -> dict[str, Any]:
        return clean(
            {
                "section": self.where,
                "container": self.container,
                "block": self.block,
                "stream": self.stream,
                "part": self.part,
                "layer": self.layer,
                "model_layer": self.model_layer,
                "status": str(self.status),
                "type_a": self.type_a,
                "type_b": self.type_b,
                "offset_a": self.offset_a,
                "offset_b": self.offset_b,
                "cells": self.cells,
                "by_value": self.by_value,
                "differing_cells": self.differing_cells,
                "first_cell": self.first_cell,
                "first_pos": self.first_pos,
                "first_offset_a": self.first_offset_a,
                "first_offset_b": self.first_offset_b,
                "stats": self.stats,
                "reason": self.reason,
            }
        )


@dataclass(slots=True)
class BlobDiff:
    """An appendix blob compared as bytes (data_spec), or its presence."""

    name: str
    status: Status
    length_a: int | None = None
    length_b: int | None = None
    first_offset_a: int | None = None
    first_offset_b: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": str(self.status),
            "length_a": self.length_a,
            "length_b": self.length_b,
            "first_offset_a": self.first_offset_a,
            "first_offset_b": self.first_offset_b,
        }


@dataclass(slots=True)
class CheckpointDiff:
    """One checkpoint, matched between the files by (n_tokens, pos_min, pos_max)."""

    n_tokens: int
    pos_min: int
    pos_max: int
    status: Status
    index_a: int | None = None
    index_b: int | None = None
    blobs: list[BlobDiff] = field(default_factory=list)  # data_spec bytes, presence of tgt/dft

    def to_dict(self) -> dict[str, Any]:
        return {
            "n_tokens": self.n_tokens,
            "pos_min": self.pos_min,
            "pos_max": self.pos_max,
            "status": str(self.status),
            "index_a": self.index_a,
            "index_b": self.index_b,
            "blobs": [b.to_dict() for b in self.blobs],
        }


@dataclass(slots=True)
class OtherDiff:
    """Bytes outside every field compared above that still differ (a last byte-level check)."""

    offset_a: int
    offset_b: int
    section_a: str
    section_b: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "offset_a": self.offset_a,
            "offset_b": self.offset_b,
            "section_a": self.section_a,
            "section_b": self.section_b,
        }


@dataclass(slots=True)
class DiffReport:
    a: Side
    b: Side
    head_k: int = 0  # elements per head used for the angles (0: a whole row is one head)
    head_v: int = 0
    fields: list[FieldDiff] = field(default_factory=list)
    tokens: TokenDiff | None = None
    cells: list[CellsDiff] = field(default_factory=list)
    runs: list[RunDiff] = field(default_factory=list)
    checkpoints: list[CheckpointDiff] = field(default_factory=list)
    draft: BlobDiff | None = None  # the SDFT appendix's presence; its blobs: runs / draft_spec
    draft_spec: BlobDiff | None = None
    other: list[OtherDiff] = field(default_factory=list)
    bytes_compared: int = 0  # bulk bytes compared per file
    seconds: float = 0.0

    # -- what differs ---------------------------------------------------------------------

    @property
    def unreadable(self) -> list[str]:
        return [f"{n}: {s.unreadable}" for n, s in (("A", self.a), ("B", self.b)) if s.unreadable]

    def differences(self) -> list[str]:
        """Every difference as a short phrase, in file order; the version word of two files of
        one format, and rotation words only one of them has, are not counted (see ``verdict``)."""
        out = [f"{f.section} {f.name}" for f in self.fields if not f.same and not f.rotation and not _version(f)]
        if self.tokens is not None and not self.tokens.same:
            out.append("tokens")
        out += [f"cells of {c.where}" for c in self.cells if not c.same]
        out += [f"{r.where} {r.part} layer {r.layer}" for r in self.runs if r.status != Status.IDENTICAL]
        for c in self.checkpoints:
            if c.status != Status.IDENTICAL or any(b.status != Status.IDENTICAL for b in c.blobs):
                out.append(f"checkpoint n_tokens={c.n_tokens}")
        for b in (self.draft, self.draft_spec):
            if b is not None and b.status != Status.IDENTICAL:
                out.append(f"sdft {b.name}")
        out += [f"bytes at A offset {o.offset_a} ({o.section_a})" for o in self.other]
        return out

    @property
    def rotation_fields(self) -> list[FieldDiff]:
        return [f for f in self.fields if not f.same and f.rotation]

    @property
    def verdict(self) -> Verdict:
        if self.unreadable:
            return Verdict.UNREADABLE
        if self.differences():
            return Verdict.DIFFERENT
        if self.rotation_fields:
            return Verdict.ROTATION_ONLY
        if any(_version(f) and not f.same for f in self.fields):
            return Verdict.VERSION_ONLY
        return Verdict.IDENTICAL

    @property
    def exit_code(self) -> int:
        v = self.verdict
        if v == Verdict.UNREADABLE:
            return OPERATIONAL
        return DIFFERENT if v == Verdict.DIFFERENT else OK

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "a": self.a.to_dict(),
            "b": self.b.to_dict(),
            "verdict": str(self.verdict),
            "identical": self.verdict in (Verdict.IDENTICAL, Verdict.ROTATION_ONLY, Verdict.VERSION_ONLY),
            "differences": self.differences(),
            "unreadable": self.unreadable,
            "head_k": self.head_k,
            "head_v": self.head_v,
            "fields": [f.to_dict() for f in self.fields],
            "tokens": self.tokens.to_dict() if self.tokens is not None else None,
            "cells": [c.to_dict() for c in self.cells],
            "layers": [r.to_dict() for r in self.runs],
            "checkpoints": [c.to_dict() for c in self.checkpoints],
            "draft": self.draft.to_dict() if self.draft is not None else None,
            "draft_spec": self.draft_spec.to_dict() if self.draft_spec is not None else None,
            "other": [o.to_dict() for o in self.other],
            "bytes_compared": self.bytes_compared,
            "seconds": round(self.seconds, 4),
            "exit_code": self.exit_code,
        }
