"""The values of two runs where their bytes differ: the statistics of ``slotfile verify --deep``
(head angle, |ln norm ratio|, relative difference, worst cell), computed by
:func:`slotfile.verify.stats.cell_stats` over the selected cells, quantized types dequantized."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from slotfile.diff.report import RunDiff
from slotfile.format import grammar as g
from slotfile.format.records import LayerRun

STATS_ELEMENTS = 1 << 20  # values per call of the statistics (float64 temporaries of ~8 MiB each)


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
    """:func:`slotfile.verify.stats.cell_stats` of cells ``sel_a`` of A against ``sel_b`` of B, called on
    at most :data:`STATS_ELEMENTS` values at a time (its own chunks are 4,096 cells, whatever the
    row width: 4,096 rows of 8,192 float64 are 256 MiB per array), the per-cell results joined.
    Returns (the joined CellStats, the first selected cell holding a non-finite value in B or -1)."""
    # the deep level's statistics, imported (not copied) so that diff and verify --deep measure
    # alike; here, not at the top: slotfile.verify brings the loader and model modules, which a
    # diff of equal bytes never needs
    from slotfile.verify.stats import CellStats, cell_stats

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


def run_stats(
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
