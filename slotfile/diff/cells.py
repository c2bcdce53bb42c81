"""Which cells of two KV streams (or REC blocks) hold the same token slots: the same positions
(and cell ext) from a cell on in each file, below the first token where the prompts diverge."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from slotfile.format import grammar as g


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
