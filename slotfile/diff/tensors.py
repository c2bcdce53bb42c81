"""K/V/R/P/S runs of two files, layer by layer, over the cells both hold.

Bytes first: each run's shared cells are compared as raw bytes, a chunk at a time, through
zero-copy views of the two mmaps (the pages of a compared chunk are handed back with
``madvise(MADV_DONTNEED)``, so the resident set follows the chunk, not the file).  Only a run
whose bytes differ is dequantized, and then only its differing cells: the statistics are those of
``slotfile verify --deep`` (head angle, |ln norm ratio|, relative difference, worst cell), computed
by :func:`slotfile.verify.cell_stats`.  Runs stored in different byte layouts (another cache
type, V transposed in one file only: flash attention on in one server and off in the other) are
compared by value over every shared cell.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from slotfile.diff.report import CellsDiff, RunDiff, Status
from slotfile.format import grammar as g
from slotfile.format.records import Body, KVStream, LayerRun, MemoryBlock, MemoryKind, SlotFile

CHUNK_BYTES = 4 << 20  # bytes of each file compared (and then released) at a time
JOBS = 2  # threads comparing chunks
AHEAD = 1  # chunks in flight per thread (each maps CHUNK_BYTES of both files until compared)
WORD = 8  # bytes compared as one uint64
STATS_ELEMENTS = 1 << 20  # values per call of the statistics (float64 temporaries of ~8 MiB each)


@dataclass
class Source:
    """One file's bytes: a flat memoryview, and the mmap (when mapped) to release pages of."""

    view: memoryview
    mm: Any = None
    page: int = mmap.PAGESIZE

    @classmethod
    def of(cls, sf: SlotFile) -> Source:
        buf = sf.buffer
        view = buf if isinstance(buf, memoryview) else memoryview(buf if buf is not None else b"")
        mm = buf if isinstance(buf, mmap.mmap) and hasattr(buf, "madvise") else None
        return cls(view.cast("B") if view.format != "B" or view.ndim != 1 else view, mm)

    def release(self, off: int, n: int) -> None:
        """Give the pages of ``[off, off + n)`` back (they are re-read from the page cache if
        touched again): what keeps the resident set flat over a 1 GiB file."""
        if self.mm is None or n <= 0:
            return
        a = off // self.page * self.page
        try:
            self.mm.madvise(mmap.MADV_DONTNEED, a, off + n - a)
        except (OSError, ValueError):  # pragma: no cover - a platform without it: RSS grows, nothing else
            pass


def bytes_equal(a: memoryview, b: memoryview) -> bool:
    """Whether two equally long byte views are equal: uint64 words through numpy (no copy), the
    few bytes past the last whole word as bytes."""
    n = len(a)
    if n != len(b):
        return False
    k = n // WORD
    if k and not np.array_equal(np.frombuffer(a, np.uint64, k), np.frombuffer(b, np.uint64, k)):
        return False
    return a[k * WORD :].tobytes() == b[k * WORD :].tobytes()


@dataclass
class Context:
    """What every run comparison shares: the two files' bytes, head sizes, a byte counter."""

    a: Source
    b: Source
    head_k: int = 0
    head_v: int = 0
    bytes_compared: int = 0
    cells: list[CellsDiff] = field(default_factory=list)
    runs: list[RunDiff] = field(default_factory=list)
    # with --model: the model layer of each cache layer, by block role (target model only)
    model_layers: dict[str, tuple[int, ...]] = field(default_factory=dict)
    jobs: int = field(default_factory=lambda: min(JOBS, os.cpu_count() or 1))
    _pool: ThreadPoolExecutor | None = None

    def head(self, part: str) -> int:
        return self.head_k if part == "K" else self.head_v if part == "V" else 0

    def model_layer(self, container: str, role: str, index: int) -> int | None:
        """The model layer of cache layer ``index`` of block ``role`` (None: no model, or a draft
        blob, whose layers are the draft model's)."""
        if container != "body" and not container.endswith("data_tgt"):
            return None
        layers = self.model_layers.get(role)
        return layers[index] if layers is not None and 0 <= index < len(layers) else None

    def chunks_equal(self, pa: int, pb: int, n: int, step: int) -> Iterator[tuple[int, int, bool]]:
        """(offset, length, equal) of each ``step``-byte chunk of ``n`` bytes at ``pa`` in A and
        ``pb`` in B, in order, each chunk's pages released once compared.  numpy's comparison
        lets the GIL go, so with two threads two chunks (and their page faults) go at once."""

        def one(off: int) -> tuple[int, int, bool]:
            k = min(step, n - off)
            same = bytes_equal(self.a.view[pa + off : pa + off + k], self.b.view[pb + off : pb + off + k])
            if same:  # a differing chunk is read again by the caller
                self.a.release(pa + off, k)
                self.b.release(pb + off, k)
            return off, k, same

        offsets = range(0, n, step)
        if self.jobs < 2 or len(offsets) < 2:
            yield from map(one, offsets)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.jobs, thread_name_prefix="slotfile-diff")
        # bounded look-ahead: AHEAD x jobs chunks in flight (the resident set stays flat)
        ahead = AHEAD * self.jobs
        pending = [self._pool.submit(one, o) for o in offsets[:ahead]]
        for i in range(len(offsets)):
            res = pending[i].result()
            if i + ahead < len(offsets):
                pending.append(self._pool.submit(one, offsets[i + ahead]))
            yield res

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


# ---------------------------------------------------------------------------------------
# cells
# ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class Alignment:
    a0: int
    b0: int
    m: int
    meta_same: bool
    note: str = ""


KEY_FIELDS = ("pos", "x", "y", "tok")  # what makes two cells the same token slot; seq ids are compared apart
META_FIELDS = ("n_seq_id", "seq_id")


def align(ca: g.CellTable | None, cb: g.CellTable | None, limit: int | None) -> Alignment:
    """The run of cells both tables hold: the same positions (and cell ext) at ``a0..`` in A and
    ``b0..`` in B, below ``limit`` (the first token index where the prompts diverge: cells from
    there on hold different tokens).  An SWA cache keeps only the last window, so the two runs
    may start at different cells."""
    if ca is None or cb is None or not ca.cells.size or not cb.cells.size:
        return Alignment(0, 0, 0, True)
    xa, xb = ca.cells, cb.cells
    pa, pb = xa["pos"], xb["pos"]
    a0 = b0 = 0
    if pa[0] != pb[0]:
        hit = np.flatnonzero(pb == pa[0])
        if hit.size:
            b0 = int(hit[0])
        else:
            hit = np.flatnonzero(pa == pb[0])
            if not hit.size:
                return Alignment(0, 0, 0, True, "no position in common")
            a0 = int(hit[0])
    n = min(pa.size - a0, pb.size - b0)
    names_a, names_b = xa.dtype.names or (), xb.dtype.names or ()
    ok = np.ones(n, bool)
    for f in KEY_FIELDS:
        if f in names_a and f in names_b:
            ok &= xa[f][a0 : a0 + n] == xb[f][b0 : b0 + n]
    if limit is not None:
        ok &= pa[a0 : a0 + n] < limit
    bad = np.flatnonzero(~ok)
    m = int(bad[0]) if bad.size else n
    note = ""
    if m < n and limit is None and a0 == b0 == 0 and pa.size == pb.size:
        # the same prompt and as many cells, but a cell's position (or ext) differs: damage to the
        # cell metadata, not another state; say where, and still compare every row index by index
        note = f"cell {m} differs: position {int(pa[m])} in A, {int(pb[m])} in B" + (
            " (or its cell ext)" if pa[m] == pb[m] else ""
        )
        m = n
    meta_same = not note
    if m == pa.size == pb.size and a0 == b0 == 0 and ca.size == cb.size:
        meta_same &= bytes(ca.raw) == bytes(cb.raw)  # every cell compared: the exact bytes
    else:
        for f in META_FIELDS:
            if f in names_a and f in names_b:
                meta_same &= bool(np.array_equal(xa[f][a0 : a0 + m], xb[f][b0 : b0 + m]))
    if not meta_same and not note:
        note = _first_meta_difference(xa, xb, a0, b0, m)
    return Alignment(a0, b0, m, meta_same, note)


def _first_meta_difference(xa: np.ndarray, xb: np.ndarray, a0: int, b0: int, m: int) -> str:
    best: tuple[int, str] | None = None
    for f in xa.dtype.names or ():
        if f not in (xb.dtype.names or ()):
            continue
        ne = np.flatnonzero(xa[f][a0 : a0 + m] != xb[f][b0 : b0 + m])
        if ne.size and (best is None or int(ne[0]) < best[0]):
            best = (int(ne[0]), f)
    if best is None:
        return ""
    i, f = best
    return f"cell {a0 + i}: {f} {int(xa[f][a0 + i])} in A, {int(xb[f][b0 + i])} in B"


# ---------------------------------------------------------------------------------------
# bytes
# ---------------------------------------------------------------------------------------


def _first_diff(ctx: Context, pa: int, pb: int, n: int) -> int | None:
    """The first differing byte of ``n`` bytes at ``pa`` in A and ``pb`` in B, relative to them
    (None: equal), a chunk at a time."""
    ctx.bytes_compared += n
    for off, k, same in ctx.chunks_equal(pa, pb, n, CHUNK_BYTES):
        if not same:
            ua = np.frombuffer(ctx.a.view, np.uint8, k, pa + off)
            ub = np.frombuffer(ctx.b.view, np.uint8, k, pb + off)
            return off + int(np.flatnonzero(ua != ub)[0])
    return None


def _rows_diff(ctx: Context, pa: int, pb: int, m: int, row: int) -> tuple[np.ndarray, int | None, int | None]:
    """``m`` rows of ``row`` bytes at ``pa`` in A and ``pb`` in B: the indices of the rows whose
    bytes differ and the file offsets of the first differing byte."""
    total = m * row
    if total <= 0:  # rows of no bytes (an S entry of a zero-width state): nothing to compare
        return np.empty(0, np.intp), None, None
    found: list[np.ndarray] = []
    first_a = first_b = None
    for off, n, same in ctx.chunks_equal(pa, pb, total, max(1, CHUNK_BYTES // row) * row):
        if same:
            continue
        xa, xb = pa + off, pb + off
        ua = np.frombuffer(ctx.a.view, np.uint8, n, xa).reshape(-1, row)
        ub = np.frombuffer(ctx.b.view, np.uint8, n, xb).reshape(-1, row)
        neq = ua != ub
        rows = np.flatnonzero(neq.any(axis=1))
        if first_a is None:
            j = int(np.flatnonzero(neq[rows[0]])[0])
            first_a, first_b = xa + int(rows[0]) * row + j, xb + int(rows[0]) * row + j
        found.append(rows + off // row)
        del ua, ub, neq
        ctx.a.release(xa, n)
        ctx.b.release(xb, n)
    ctx.bytes_compared += total
    return (np.concatenate(found) if found else np.empty(0, np.intp)), first_a, first_b


def _columns_diff(
    ctx: Context, ra: LayerRun, rb: LayerRun, a0: int, b0: int, m: int
) -> tuple[np.ndarray, int | None, int | None]:
    """The same for a transposed V run (``state_write_data`` with v_trans: element j of every
    cell, then element j + 1): E rows of cells, the shared cells a strided window of each."""
    el = ra.row_size // ra.n_embd if ra.n_embd else 0
    e = ra.n_embd or 0
    if not el or not e:
        return np.empty(0, np.intp), None, None
    full = a0 == b0 == 0 and m == ra.n_cells == rb.n_cells
    if full and _first_diff(ctx, ra.data.offset, rb.data.offset, ra.data.length) is None:
        # the whole run in one piece: equal runs (the usual case) cost one pass of word compares
        return np.empty(0, np.intp), None, None
    A = np.frombuffer(ra.data.view, np.uint8).reshape(e, ra.n_cells, el)[:, a0 : a0 + m]
    B = np.frombuffer(rb.data.view, np.uint8).reshape(e, rb.n_cells, el)[:, b0 : b0 + m]
    step = max(1, CHUNK_BYTES // max(1, m * el))
    mask = np.zeros(m, bool)
    first_a = first_b = None
    for r0 in range(0, e, step):
        neq = A[r0 : r0 + step] != B[r0 : r0 + step]
        cells = neq.any(axis=(0, 2))
        if first_a is None and cells.any():
            r, c, k = (int(v[0]) for v in np.nonzero(neq))
            first_a = ra.data.offset + ((r0 + r) * ra.n_cells + a0 + c) * el + k
            first_b = rb.data.offset + ((r0 + r) * rb.n_cells + b0 + c) * el + k
        mask |= cells
    if not full:
        ctx.bytes_compared += e * m * el
    ctx.a.release(ra.data.offset, ra.data.length)
    ctx.b.release(rb.data.offset, rb.data.length)
    return np.flatnonzero(mask), first_a, first_b


# ---------------------------------------------------------------------------------------
# values
# ---------------------------------------------------------------------------------------


def _bytes_view(a: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data).cast("B")


def select(run: LayerRun, cells: np.ndarray) -> LayerRun:
    """The run restricted to ``cells`` (ascending indices): a zero-copy slice for a contiguous
    range of row-major cells, a small copy otherwise."""
    k = int(cells.size)
    if k == run.n_cells and (k == 0 or (cells[0] == 0 and cells[-1] == k - 1)):
        return run
    contiguous = k > 0 and int(cells[-1]) - int(cells[0]) == k - 1
    if not run.transposed:
        if contiguous:
            c0 = int(cells[0])
            v = run.data.view[c0 * run.row_size : (c0 + k) * run.row_size]
            return replace(run, n_cells=k, data=g.Run(run.data.offset + c0 * run.row_size, len(v), v))
        rows = np.frombuffer(run.data.view, np.uint8).reshape(run.n_cells, run.row_size)[cells]
        return replace(run, n_cells=k, data=g.Run(run.data.offset, rows.nbytes, _bytes_view(rows)))
    e = run.n_embd or 0
    el = run.row_size // e if e else 0
    cols = np.ascontiguousarray(np.frombuffer(run.data.view, np.uint8).reshape(e, run.n_cells, el)[:, cells])
    return replace(run, n_cells=k, data=g.Run(run.data.offset, cols.nbytes, _bytes_view(cols)))


def _cell_stats(ra: LayerRun, rb: LayerRun, sel_a: np.ndarray, sel_b: np.ndarray, head: int) -> tuple[Any, int]:
    """:func:`slotfile.verify.cell_stats` of cells ``sel_a`` of A against ``sel_b`` of B, called on
    at most :data:`STATS_ELEMENTS` values at a time (its own chunks are 4,096 cells, whatever the
    row width: 4,096 rows of 8,192 float64 are 256 MiB per array), the per-cell results joined.
    Returns (the joined CellStats, the first selected cell holding a non-finite value in B or -1)."""
    # the deep level's statistics, imported (not copied) so that diff and verify --deep measure
    # alike; here, not at the top: slotfile.verify brings the loader and model modules, which a
    # diff of equal bytes never needs
    from slotfile.verify import CellStats, cell_stats

    per = max(1, STATS_ELEMENTS // max(1, ra.elements or 1))
    parts = []
    max_abs = 0.0
    first_bad = first_bad_b = -1
    for i in range(0, sel_a.size, per):
        xa, xb = select(ra, sel_a[i : i + per]), select(rb, sel_b[i : i + per])
        st = cell_stats(xa, xb, head)
        if first_bad < 0 and st.first_bad >= 0:
            first_bad = i + st.first_bad
        if not np.isfinite(st.rel).all():  # non-finite in B: cell_stats zeroes only its first argument's
            fb = cell_stats(xb, xa, head).first_bad
            if first_bad_b < 0 and fb >= 0:
                first_bad_b = i + fb
            for arr in (st.rel, st.angle, st.lnorm):
                np.nan_to_num(arr, copy=False, nan=np.inf)
        max_abs = max(max_abs, st.max_abs)
        parts.append(st)
    joined = CellStats(
        np.concatenate([p.angle for p in parts]),
        np.concatenate([p.lnorm for p in parts]),
        np.concatenate([p.rel for p in parts]),
        max_abs=max_abs,
        first_bad=first_bad,
    )
    return joined, first_bad_b


def _stats(
    rd: RunDiff, ra: LayerRun, rb: LayerRun, sel_a: np.ndarray, sel_b: np.ndarray, pos_a: np.ndarray | None, head: int
) -> np.ndarray:
    """The deep statistics of cells ``sel_a`` of A against ``sel_b`` of B into ``rd.stats``;
    returns the mask of selected cells whose values differ."""
    st, first_bad_b = _cell_stats(ra, rb, sel_a, sel_b, head)
    # exact: a zero difference vector (the angle of two equal rows is arccos noise, ~1e-6 degrees)
    differ = (st.rel != 0) | ~np.isfinite(st.rel)
    for i in (st.first_bad, first_bad_b):
        if i >= 0:
            differ[i] = True
    s = st.summary(np.flatnonzero(differ)) if differ.any() else st.summary()

    def cell(i: int) -> int | None:
        return int(sel_a[i]) if 0 <= i < sel_a.size else None

    def pos(i: int) -> int | None:
        c = cell(i)
        return int(pos_a[c]) if c is not None and pos_a is not None and c < pos_a.size else None

    worst = s.rel_cell
    rd.stats = {
        "head": head,
        "angle": s.angle,
        "angle_cell": cell(s.angle_cell),
        "median_angle": s.median_angle,
        "lnorm": s.lnorm,
        "rel": s.rel,
        "max_abs": s.max_abs,
        "worst_cell": cell(worst),
        "worst_pos": pos(worst),
        "nonfinite_a_cell": cell(st.first_bad) if st.first_bad >= 0 else None,
        "nonfinite_b_cell": int(sel_b[first_bad_b]) if first_bad_b >= 0 else None,
        "over": "differing cells" if not rd.by_value else "shared cells",
    }
    return differ


def _layout(r: LayerRun) -> tuple[int, int, bool, int | None]:
    return (r.type_id, r.row_size, r.transposed, r.n_embd)


def _v(x: object) -> str:
    return "?" if x is None else str(x)


def _try_stats(
    rd: RunDiff, ra: LayerRun, rb: LayerRun, sel_a: np.ndarray, sel_b: np.ndarray, pos_a: np.ndarray | None, head: int
) -> np.ndarray | None:
    """:func:`_stats`, or None (with the reason in ``rd``) for a type gguf cannot dequantize."""
    try:
        return _stats(rd, ra, rb, sel_a, sel_b, pos_a, head)
    except (NotImplementedError, ValueError, KeyError, TypeError) as e:
        rd.stats = None
        rd.reason = f"{ra.type_name} / {rb.type_name} cannot be dequantized ({type(e).__name__}: {e})"
        return None


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
    same_layout = (ra.type_id, ra.row_size, ra.transposed, ra.n_embd) == (
        rb.type_id,
        rb.row_size,
        rb.transposed,
        rb.n_embd,
    )
    known = ra.elements is not None and ra.elements == rb.elements
    if not same_layout and not known:
        rd.status = Status.INCOMPARABLE
        rd.reason = f"{_v(ra.elements)} elements per cell in A, {_v(rb.elements)} in B"
        return rd
    if al.m == 0:
        if ra.n_cells or rb.n_cells:
            rd.status, rd.reason = Status.NOT_COMPARED, "no cell both files hold for the shared tokens"
        return rd
    head = ctx.head(r.part)
    if same_layout:
        if ra.transposed:
            d, fa, fb = _columns_diff(ctx, ra, rb, al.a0, al.b0, al.m)
        else:
            row = ra.row_size
            d, fa, fb = _rows_diff(ctx, ra.data.offset + al.a0 * row, rb.data.offset + al.b0 * row, al.m, row)
        if not d.size:
            return rd
        rd.first_offset_a, rd.first_offset_b = fa, fb
        sel_a, sel_b = d + al.a0, d + al.b0
        if known:
            _try_stats(rd, ra, rb, sel_a, sel_b, pos_a, head)
        else:
            rd.reason = f"type {ra.type_name} cannot be dequantized: bytes compared only"
        rd.differing_cells = int(d.size)
        first = int(sel_a[0])
    else:
        # another type or V layout: no byte can be compared, every shared value is
        rd.by_value = True
        idx = np.arange(al.m)
        differ = _try_stats(rd, ra, rb, idx + al.a0, idx + al.b0, pos_a, head)
        ctx.bytes_compared += al.m * ra.row_size
        ctx.a.release(ra.data.offset, ra.data.length)
        ctx.b.release(rb.data.offset, rb.data.length)
        if differ is None:
            rd.status = Status.INCOMPARABLE
            return rd
        if not differ.any():
            rd.reason = "the same values in another byte layout"
            rd.stats = None
            return rd
        rd.differing_cells = int(differ.sum())
        first = int(np.flatnonzero(differ)[0]) + al.a0
    # the statistics read the differing rows through the mmaps: hand those pages back too
    ctx.a.release(ra.data.offset, ra.data.length)
    ctx.b.release(rb.data.offset, rb.data.length)
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
