"""The per-shape cache of :func:`slotfile.format.layout.detect`.

Files of one server share a few shapes: the layout search, repeated for each, was 85 % of a
directory listing.  A shape's detection is kept here, with every byte the grammar read to
accept it and its blocks as a template over no buffer, and re-checked against every file's own
bytes (:func:`same_bytes`, ``layout._reparse``) before it is used.

This module does not import ``layout`` (the import graph has no cycle): a shape's layout and
failure are ``layout.Layout`` and ``layout.Failure``, held as they are.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from construct import Container

from slotfile.format.grammar import CellTable, Run, ViewStream


@dataclass(frozen=True, slots=True)
class Shape:
    """A detection that a file of this size and these arguments had: the layout, the
    structure its blocks read (every count, type, row size and offset, relative to the body's
    start), where the body ended, and the deepest failure of the other candidates."""

    layout: Any  # a layout.Layout
    shape: tuple[Any, ...]
    end: int
    failure: Any  # a layout.Failure or None
    # the parsed blocks with every offset relative to the body's start and no reference to the
    # file's buffer (tensor runs as (offset, length), arrays copied), compiled (:func:`_compile`),
    # and every byte of the body outside the tensor runs: what the grammar read to accept this layout
    template: list[tuple[int, Any]]
    structure: tuple[tuple[int, bytes], ...]
    # the fixed-stride cell tables, left out of ``structure``: (offset, cells, dtype, n_seq_id)
    tables: tuple[tuple[int, int, np.dtype, int], ...] = ()


SHAPES: dict[tuple[Any, ...], list[Shape]] = {}
SHAPES_MAX = 128  # sizes
SHAPES_PER_KEY = 4
_SHAPE_INTS = frozenset(
    ("offset", "end", "v_trans_offset", "n_stream", "cell_count", "v_trans", "n_layer", "n_rot_k", "n_rot_v")
)
_SHAPE_POS = frozenset(("offset", "end", "v_trans_offset"))


def shape_of(blocks: Iterable[Any], start: int) -> tuple[Any, ...]:
    """Every structural word of parsed blocks (counts, types, row sizes, offsets relative to
    ``start``), tensor data and cell positions left out: two bodies with equal shapes were
    cut into the same pieces by the same layout."""
    out: list[Any] = []

    def visit(x: Any) -> None:
        if isinstance(x, list):
            out.append(len(x))
            for y in x:
                visit(y)
        elif isinstance(x, dict):  # construct's Container
            for k, v in x.items():
                if k in _SHAPE_INTS or k in ("type", "row_size"):
                    out.append((k, None if v is None else int(v) - (start if k in _SHAPE_POS else 0)))
                elif isinstance(v, list | dict):
                    out.append(k)
                    visit(v)

    for b in blocks:
        visit(b)
    return tuple(out)


class _RunAt:
    """A tensor run of a cached template: where it lies relative to the body's start."""

    __slots__ = ("length", "offset")

    def __init__(self, offset: int, length: int) -> None:
        self.offset, self.length = offset, length


class _CellsAt:
    """A cell table of a cached template: its place and (copied, read-only) arrays."""

    __slots__ = ("cells", "length", "offset", "seq_ids")

    def __init__(self, t: CellTable, start: int) -> None:
        self.offset, self.length = t.offset - start, len(t.raw)
        self.cells, self.seq_ids = _frozen(t.cells), _frozen(t.seq_ids)


class _StreamAt:
    """The ``_io`` stream construct leaves in a container (rebuilt over the new buffer)."""

    __slots__ = ("end", "start")

    def __init__(self, s: ViewStream, start: int) -> None:
        self.start, self.end = s.start - start, s.end - start


def _frozen(a: np.ndarray) -> np.ndarray:
    c = np.array(a, copy=True)
    c.flags.writeable = False
    return c


def _template(x: Any, start: int, runs: list[Any], key: str = "") -> Any:
    """A parsed block with its offsets made relative to ``start`` and no reference to the
    buffer (the cache must not hold a file open); ``runs`` collects the tensor runs
    ``(offset, length)`` and the fixed-stride cell tables ``(offset, length, dtype, n_seq_id)``."""
    if isinstance(x, Run):
        runs.append((x.offset - start, x.length))
        return _RunAt(x.offset - start, x.length)
    if isinstance(x, CellTable):
        if x.cells.size and len(x.raw) == x.cells.dtype.itemsize * x.cells.size:
            runs.append((x.offset - start, len(x.raw), x.cells.dtype, int(x.cells["n_seq_id"][0])))
        return _CellsAt(x, start)
    if isinstance(x, ViewStream):
        return _StreamAt(x, start)
    if isinstance(x, np.ndarray):
        return _frozen(x)
    if isinstance(x, dict):
        c = Container()
        for k, v in x.items():
            c[k] = _template(v, start, runs, k)
        return c
    if isinstance(x, list):
        return type(x)(_template(v, start, runs) for v in x)
    if type(x) is int and key in _SHAPE_POS:
        return x - start
    return x


# A template compiled for :func:`_build`: (kind, payload).  A container's payload is its items
# in their order with None in the places that depend on the file, and those places; constants
# (types, row sizes, counts, frozen arrays) are copied in one step.
_CONST, _POS, _RUN, _CELLS, _STREAM, _NODE, _LIST = range(7)


def _compile(x: Any, key: str = "") -> tuple[int, Any]:
    """A template (:func:`_template`) compiled for :func:`_build`."""
    t = type(x)
    if t is int and key in _SHAPE_POS:
        return _POS, x
    kind = {_RunAt: _RUN, _CellsAt: _CELLS, _StreamAt: _STREAM}.get(t)
    if kind is not None:
        return kind, x
    if t is Container:
        base, dyn = Container(), []
        for k, v in x.items():
            if k == "_io":
                # the stream construct parsed from: skipped by construct's own equality and repr,
                # never read by slotfile, and an io object per container is costly to make
                continue
            kd, p = _compile(v, k)
            base[k] = p if kd == _CONST else None
            if kd != _CONST:
                dyn.append((k, kd, p))
        return _NODE, (base, tuple(dyn))
    if isinstance(x, list):
        return _LIST, (t, tuple(_compile(v) for v in x))
    return _CONST, x


def _build(kind: int, p: Any, view: Any, start: int) -> Any:
    """A compiled template's value over ``view``, the body starting at ``start`` (this runs
    once per block of every cached file: each container is one copy of its constants, then
    its file-dependent places)."""
    if kind == _NODE:
        base, dyn = p
        c = Container(base)
        for k, kd, q in dyn:
            if kd == _POS:
                c[k] = q + start
            elif kd == _RUN:  # a layer's rows: the commonest place, built here without a call
                a = start + q.offset
                c[k] = Run(a, q.length, view[a : a + q.length])
            else:
                c[k] = _build(kd, q, view, start)
        return c
    if kind == _LIST:
        t, items = p
        out = [_build(kd, q, view, start) for kd, q in items]
        return out if t is list else t(out)
    if kind == _POS:
        return p + start
    if kind == _RUN:
        a = start + p.offset
        return Run(a, p.length, view[a : a + p.length])
    if kind == _CELLS:
        return _cells(p, view, start)
    if kind == _STREAM:
        return ViewStream(view, start + p.start, start + p.end)
    return p


def _cells(x: _CellsAt, view: Any, start: int) -> CellTable:
    a = start + x.offset
    raw = view[a : a + x.length]
    cells, seq_ids = x.cells, x.seq_ids
    if cells.dtype.itemsize * cells.size == x.length:
        # the fixed-stride table (grammar_core.CellMeta's fast path): a zero-copy view over this
        # file again, as the full parse gives, not the cached copy of the first file's bytes
        cells = np.frombuffer(raw, dtype=cells.dtype)
        if "seq_id" in (cells.dtype.names or ()):
            seq_ids = cells["seq_id"]
    return CellTable(a, cells, seq_ids, raw)


def _structure_bytes(view: Any, start: int, end: int, runs: list[Any]) -> tuple[tuple[int, bytes], ...]:
    """Every byte of ``view[start:end]`` outside the tensor runs and fixed-stride cell tables
    (``runs``, relative offsets), plus the 4 bytes after the body (an appendix magic there is
    part of the decision)."""
    out, at = [], 0
    for off, n, *_ in sorted(runs, key=lambda r: r[0]):
        if off > at:
            out.append((at, bytes(view[start + at : start + off])))
        at = max(at, off + n)
    stop = min(len(view), end + 4) - start
    if stop > at:
        out.append((at, bytes(view[start + at : start + stop])))
    return tuple(out)


def same_bytes(view: Any, start: int, hit: Shape) -> list[Any] | None:
    """The cached blocks over ``view``, when every byte the grammar read to accept it (the body
    outside its tensor runs and cell tables, and the 4 bytes after it) is the same in this file
    as in the file it was found in, and each cell table passes the grammar's test of a
    fixed-stride table (grammar_core.CellMeta: every n_seq_id the fixed one, no negative
    position; the grammar reads nothing else of a cell): the grammar then reads this body as it
    read that one, cell for cell, so its blocks are the cached ones over this buffer.  Cells
    differ between files of one shape (positions, seq ids, each cell's token in the ext), so
    without this such a file took the slower re-parse of ``layout._reparse``, to the same end."""
    for off, b in hit.structure:
        if view[start + off : start + off + len(b)] != b:
            return None
    for off, length, dtype, fixed in hit.tables:
        cells = np.frombuffer(view, dtype=dtype, count=length // dtype.itemsize, offset=start + off)
        if (cells["n_seq_id"] != fixed).any() or (cells["pos"] < 0).any():
            return None
    return [_build(kd, p, view, start) for kd, p in hit.template]


def shifted(f: Any, by: int) -> Any:
    """A failure (or None) with its offset moved by ``by``."""
    return f and replace(f, offset=f.offset + by)


def remember(
    key: tuple[Any, ...], hits: list[Shape], lay: Any, blocks: list[Any], end: int, failure: Any, view: Any, start: int
) -> None:
    """Keep a unique detection (``lay``, ``blocks``, ending at ``end``) of the body at ``start``
    under ``key``, after the ``hits`` already there."""
    # bounded: memory stays flat whatever the directory holds
    if key not in SHAPES and len(SHAPES) >= SHAPES_MAX:
        # verify --jobs reads files on threads: another may have evicted this one already
        SHAPES.pop(next(iter(SHAPES), ()), None)
    runs: list[Any] = []
    template = [_compile(_template(b, start, runs)) for b in blocks]
    shape = Shape(
        lay,
        shape_of(blocks, start),
        end - start,
        shifted(failure, -start),
        template,
        _structure_bytes(view, start, end, runs),
        tuple(r for r in runs if len(r) == 4),
    )
    # several shapes share a size (f16 with and without flash attention): kept side by side
    SHAPES[key] = [*hits[-(SHAPES_PER_KEY - 1) :], shape]
