"""Stage 2 of ``slotfile identify``: the stored rows paired with the recomputed ones and
compared head by head.

The K and V rows of the first :data:`LAYERS` layers of each KV cache are paired by position
(positions 0..n-1, which a prefix recompute fills exactly as the whole prompt did), the R/S
rows of a recurrent cache by layer; :func:`head_stats` gives the worst head angle and norm
ratio, the same statistic the deep level uses (:func:`slotfile.verify.stats._head_stats`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from slotfile.format.records import Body, LayerRun
from slotfile.verify.stats import _head_stats, dequant_rows

LAYERS = 2  # first layers of each cache compared


def rows_f64(run: LayerRun, idx: np.ndarray) -> np.ndarray:
    """The rows of cells ``idx`` as float64 (cells, elements), dequantized by the deep level's
    :func:`~slotfile.verify.stats.dequant_rows` a cell at a time (the proof compares at most
    ``PREFIX`` cells, which need not be adjacent)."""
    if not len(idx):
        return dequant_rows(run, 0, 0)
    return np.concatenate([dequant_rows(run, int(c), int(c) + 1) for c in idx])


def raw_rows(run: LayerRun, idx: np.ndarray) -> np.ndarray:
    if run.transposed:
        return np.ascontiguousarray(run.array()[:, idx].T)
    return np.ascontiguousarray(run.data.array(np.uint8).reshape(run.n_cells, run.row_size)[idx])


def head_stats(x: np.ndarray, y: np.ndarray, head: int) -> tuple[float, float]:
    """Worst head angle (degrees) and worst |ln norm ratio| of rows ``x`` against ``y``."""
    if not x.size:
        return 0.0, 0.0
    ang, ln = _head_stats(x, y, head)
    return float(np.max(ang)), float(np.max(ln))


def pos_index(pos: np.ndarray, n: int, keep: np.ndarray | None = None) -> np.ndarray | None:
    """Cell indices holding positions 0..n-1, in position order (None: some missing or doubled).
    ``keep``: only these cells (a mask) count."""
    idx = np.full(n, -1, dtype=np.int64)
    for cell, p in enumerate(pos.tolist()):
        if 0 <= p < n and (keep is None or keep[cell]):
            if idx[p] >= 0:
                return None
            idx[p] = cell
    return idx if (idx >= 0).all() else None


def _first_seq_cells(st: Any) -> np.ndarray | None:
    """The cells of the stream's first sequence (a session file of several sequences holds them
    all in one stream: the token list is one of them); None when every cell is one sequence's."""
    ct = st.cells
    if ct is None or not ct.seq_ids.size or "n_seq_id" not in (ct.cells.dtype.names or ()):
        return None
    counts = ct.cells["n_seq_id"].astype(np.int64)
    if len(set(ct.seq_ids.tolist())) <= 1 or int(counts.sum()) != ct.seq_ids.size:
        return None
    first = int(ct.seq_ids.min())
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    return np.array([first in ct.seq_ids[a : a + c].tolist() for a, c in zip(starts, counts, strict=True)])


def _stored_index(st: Any, n: int) -> np.ndarray | None:
    idx = pos_index(st.positions, n)
    if idx is None:
        mask = _first_seq_cells(st)
        if mask is not None:
            idx = pos_index(st.positions, n, mask)
    return idx


def kv_pairs(
    stored: Body, recomputed: Body, n: int
) -> list[tuple[str, int, LayerRun, LayerRun, np.ndarray, np.ndarray]]:
    """(role, layer, stored run, recomputed run, stored cells, recomputed cells): K and V of the
    first LAYERS layers of every KV cache whose stored cells hold positions 0..n-1.  V counts as
    much as K: a fine-tune that adapted only the query and value projections (a common LoRA)
    leaves layer 0's K as it was and changes its V."""
    out = []
    rec_by_role = {b.role: b for b in recomputed.blocks}
    for b in stored.blocks:
        rb = rec_by_role.get(b.role)
        if b.kind != "KV" or rb is None or rb.kind != "KV":
            continue
        sts = b.active_streams()
        rsts = rb.active_streams()
        if not sts or not rsts:
            continue
        st, rst = sts[0], rsts[0]
        si, ri = _stored_index(st, n), pos_index(rst.positions, n)
        if si is None or ri is None:
            continue
        for k in range(min(LAYERS, len(st.k), len(rst.k))):
            out.append((b.role, st.k[k].index, st.k[k], rst.k[k], si, ri))
        for k in range(min(LAYERS, len(st.v), len(rst.v))):
            out.append((b.role, st.v[k].index, st.v[k], rst.v[k], si, ri))
    return out


def rec_pairs(stored: Body, recomputed: Body) -> list[tuple[str, int, LayerRun, LayerRun]]:
    out = []
    rec_by_role = {b.role: b for b in recomputed.blocks}
    for b in stored.blocks:
        rb = rec_by_role.get(b.role)
        if b.kind != "REC" or rb is None or rb.kind != "REC" or not b.cell_count or not rb.cell_count:
            continue
        for part in ("r", "s"):
            runs, rruns = getattr(b, part), getattr(rb, part)
            for k in range(min(LAYERS, len(runs), len(rruns))):
                out.append((b.role, runs[k].index, runs[k], rruns[k]))
    return out
