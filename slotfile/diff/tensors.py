"""K/V/R/P/S runs of two files, layer by layer, over the cells both hold.

Bytes first (:mod:`slotfile.diff.rawbytes`): each run's shared cells are compared as raw bytes
through the two mmaps.  Only a run whose bytes differ is dequantized, and then only its
differing cells (:mod:`slotfile.diff.values`: the statistics of ``slotfile verify --deep``).  Runs
stored in different byte layouts (another cache type, V transposed in one file only: flash
attention on in one server and off in the other) are compared by value over every shared cell.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from slotfile.diff.cells import Alignment, align
from slotfile.diff.rawbytes import Context, columns_diff, rows_diff
from slotfile.diff.report import CellsDiff, RunDiff, Status
from slotfile.diff.values import run_stats
from slotfile.format.records import Body, KVStream, LayerRun, MemoryBlock, MemoryKind


def _layout(r: LayerRun) -> tuple[int, int, bool, int | None]:
    return (r.type_id, r.row_size, r.transposed, r.n_embd)


def _v(x: object) -> str:
    return "?" if x is None else str(x)


def _try_stats(
    rd: RunDiff, ra: LayerRun, rb: LayerRun, sel_a: np.ndarray, sel_b: np.ndarray, pos_a: np.ndarray | None, head: int
) -> np.ndarray | None:
    """:func:`slotfile.diff.values.run_stats`, or None (with the reason in ``rd``) for a type
    gguf cannot dequantize."""
    try:
        return run_stats(rd, ra, rb, sel_a, sel_b, pos_a, head)
    except (NotImplementedError, ValueError, KeyError, TypeError) as e:
        rd.stats = None
        rd.reason = f"{ra.type_name} / {rb.type_name} cannot be dequantized ({type(e).__name__}: {e})"
        return None


def _by_bytes(
    ctx: Context, rd: RunDiff, ra: LayerRun, rb: LayerRun, al: Alignment, pos_a: np.ndarray | None
) -> int | None:
    """The same byte layout in both files: the cells whose bytes differ, their statistics into
    ``rd``; the first differing cell (A's index), None when every byte is equal."""
    if ra.transposed:
        d, fa, fb = columns_diff(ctx, ra, rb, al.a0, al.b0, al.m)
    else:
        row = ra.row_size
        d, fa, fb = rows_diff(ctx, ra.data.offset + al.a0 * row, rb.data.offset + al.b0 * row, al.m, row)
    if not d.size:
        return None
    rd.first_offset_a, rd.first_offset_b = fa, fb
    sel_a, sel_b = d + al.a0, d + al.b0
    if ra.elements is not None:
        _try_stats(rd, ra, rb, sel_a, sel_b, pos_a, ctx.head(rd.container, rd.block, ra.part))
    else:
        rd.reason = f"type {ra.type_name} cannot be dequantized: bytes compared only"
    rd.differing_cells = int(d.size)
    return int(sel_a[0])


def _by_value(
    ctx: Context, rd: RunDiff, ra: LayerRun, rb: LayerRun, al: Alignment, pos_a: np.ndarray | None
) -> int | None:
    """Another type or V layout: no byte can be compared, every shared value is.  The first
    differing cell, None when every value is equal (or cannot be dequantized: ``rd.status``)."""
    rd.by_value = True
    idx = np.arange(al.m)
    differ = _try_stats(rd, ra, rb, idx + al.a0, idx + al.b0, pos_a, ctx.head(rd.container, rd.block, ra.part))
    ctx.bytes_compared += al.m * ra.row_size
    if differ is None:
        rd.status = Status.INCOMPARABLE
        return None
    if not differ.any():
        rd.reason = "the same values in another byte layout"
        rd.stats = None
        return None
    rd.differing_cells = int(differ.sum())
    return int(np.flatnonzero(differ)[0]) + al.a0


def compare_run(
    ctx: Context,
    where: tuple[str, str, int | None],
    ra: LayerRun | None,
    rb: LayerRun | None,
    al: Alignment,
    pos_a: np.ndarray | None,
) -> RunDiff:
    """One layer's run of each file over the aligned cells."""
    container, block, stream = where
    r = ra if ra is not None else rb
    assert r is not None
    rd = RunDiff(container, block, stream, r.part, r.index, Status.IDENTICAL, cells=al.m)
    rd.model_layer = ctx.model_layer(container, block, r.index)
    if ra is not None:
        rd.type_a, rd.offset_a = ra.type_name, ra.data.offset
    if rb is not None:
        rd.type_b, rd.offset_b = rb.type_name, rb.data.offset
    if ra is None or rb is None:
        rd.status, rd.cells = (Status.ONLY_B if ra is None else Status.ONLY_A), 0
        return rd
    same_layout = _layout(ra) == _layout(rb)
    if not same_layout and (ra.elements is None or ra.elements != rb.elements):
        rd.status = Status.INCOMPARABLE
        rd.reason = f"{_v(ra.elements)} elements per cell in A, {_v(rb.elements)} in B"
        return rd
    if al.m == 0:
        if ra.n_cells or rb.n_cells:
            rd.status, rd.reason = Status.NOT_COMPARED, "no cell both files hold for the shared tokens"
        return rd
    first = (_by_bytes if same_layout else _by_value)(ctx, rd, ra, rb, al, pos_a)
    # the statistics read the rows through the mmaps: hand those pages back too
    ctx.a.release(ra.data.offset, ra.data.length)
    ctx.b.release(rb.data.offset, rb.data.length)
    if first is None:
        return rd
    rd.status = Status.DIFFERENT
    rd.first_cell = first
    rd.first_pos = int(pos_a[first]) if pos_a is not None and first < pos_a.size else None
    return rd


# ---------------------------------------------------------------------------------------
# blocks and bodies
# ---------------------------------------------------------------------------------------


def _pairs(xs: list[LayerRun], ys: list[LayerRun]) -> Iterator[tuple[LayerRun | None, LayerRun | None]]:
    for j in range(max(len(xs), len(ys))):
        yield (xs[j] if j < len(xs) else None), (ys[j] if j < len(ys) else None)


def _one_side(ctx: Context, container: str, blk: MemoryBlock, status: Status) -> None:
    streams: list[KVStream | None] = list(blk.streams) or [None]
    for st in streams:
        runs = (st.k + st.v) if st is not None else blk.r + blk.p + blk.s
        for r in runs:
            rd = RunDiff(container, blk.role, st.index if st is not None else None, r.part, r.index, status)
            if status == Status.ONLY_A:
                rd.type_a, rd.offset_a = r.type_name, r.data.offset
            else:
                rd.type_b, rd.offset_b = r.type_name, r.data.offset
            ctx.runs.append(rd)


def compare_stream(
    ctx: Context, container: str, role: str, sa: KVStream | None, sb: KVStream | None, limit: int | None
) -> None:
    if (sa is None or not sa.cell_count) and (sb is None or not sb.cell_count):
        return
    idx = sa.index if sa is not None else sb.index if sb is not None else 0
    al = align(sa.cells if sa else None, sb.cells if sb else None, limit)
    pos_a = sa.positions if sa is not None else None
    ctx.cells.append(
        _cells_diff(container, role, idx, sa.cell_count if sa else 0, sb.cell_count if sb else 0, al, pos_a)
    )
    for ra, rb in _pairs(sa.k if sa else [], sb.k if sb else []):
        ctx.runs.append(compare_run(ctx, (container, role, idx), ra, rb, al, pos_a))
    for ra, rb in _pairs(sa.v if sa else [], sb.v if sb else []):
        ctx.runs.append(compare_run(ctx, (container, role, idx), ra, rb, al, pos_a))


def _cells_diff(
    container: str, role: str, stream: int | None, na: int, nb: int, al: Alignment, pos_a: np.ndarray | None
) -> CellsDiff:
    cd = CellsDiff(container, role, stream, na, nb, al.a0, al.b0, al.m, meta_same=al.meta_same, note=al.note)
    if al.m and pos_a is not None and pos_a.size >= al.a0 + al.m:
        cd.pos_first, cd.pos_last = int(pos_a[al.a0]), int(pos_a[al.a0 + al.m - 1])
    return cd


def compare_block(ctx: Context, container: str, ba: MemoryBlock, bb: MemoryBlock, limit: int | None) -> None:
    from slotfile.diff.headers import pair_streams

    if ba.kind == MemoryKind.KV:
        for sa, sb in pair_streams(ba, bb):
            compare_stream(ctx, container, ba.role, sa, sb, limit)
        return
    al = align(ba.cells, bb.cells, limit)
    pos_a = ba.positions()
    ctx.cells.append(_cells_diff(container, ba.role, None, ba.cell_count, bb.cell_count, al, pos_a))
    for xs, ys in ((ba.r, bb.r), (ba.p, bb.p), (ba.s, bb.s)):
        for ra, rb in _pairs(xs, ys):
            ctx.runs.append(compare_run(ctx, (container, ba.role, None), ra, rb, al, pos_a))


def compare_bodies(ctx: Context, container: str, a: Body | None, b: Body | None, limit: int | None) -> None:
    """Every block of two bodies (a file's, or a checkpoint's or draft blob's), block by block."""
    blocks_a = a.blocks if a is not None and a.layout is not None else []
    blocks_b = b.blocks if b is not None and b.layout is not None else []
    for i in range(max(len(blocks_a), len(blocks_b))):
        ba = blocks_a[i] if i < len(blocks_a) else None
        bb = blocks_b[i] if i < len(blocks_b) else None
        if ba is not None and bb is not None and ba.kind == bb.kind:
            compare_block(ctx, container, ba, bb, limit)
            continue
        if ba is not None:
            _one_side(ctx, container, ba, Status.ONLY_A)
        if bb is not None:
            _one_side(ctx, container, bb, Status.ONLY_B)
