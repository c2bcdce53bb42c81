"""Damage that one layer holds alone: a cell that differs from its recompute while every other
layer holding its position recomputes it exactly (issue 25 item 3: checkpoint blobs).

Drift lives in model space (:mod:`slotfile.verify.shape`): a token whose hidden state differs
from the layer where two computations part on differs in every layer above, K and V alike.  So
where every other layer holds a position's rows bit for bit as recomputed, the computation was
the same there, and a difference confined to one layer's cell is in that layer's bytes,
however small against the noise floors: a first-turn checkpoint recomputes bit for bit, so a
quant flip, a scale's exponent flip or 16 random bytes inside it show up as one lone cell.  The
cell must still stand :data:`~slotfile.verify.misplaced.SUSPECT` floors out (the type's minimum
floors: re-rounding one value into a quantized type moves it a quant step, half of them), so a
drift too small to change any other layer's quants cannot pass for damage.
"""

from __future__ import annotations

import numpy as np

from slotfile.format.records import Body, LayerRun, MemoryKind
from slotfile.problems import ProblemCode
from slotfile.verify.judge import Judgment, Problem, _element_offset
from slotfile.verify.misplaced import SUSPECT

# a layer "recomputes" a position "exactly" at or under this many floors: identical rows give 0
# (their head angle through arccos can come out a few 1e-6 degrees)
EXACT = 1e-3


def lone_cells(body: Body, j: Judgment, suspect: float = SUSPECT) -> list[Problem]:
    """One problem per layer of ``j`` holding a cell over ``suspect`` floors at a position where
    at least one other layer holds the position and every other layer holding it is within
    :data:`EXACT` floors (its worst such cell).  ``body``: the stored state ``j`` judged (its
    runs give the offsets)."""
    if len(j.cells) != len(j.rows):
        return []
    differs: dict[int, int] = {}  # position -> runs that do not recompute it exactly
    holders: dict[int, int] = {}  # position -> runs holding it
    for c in j.cells:
        if c.positions is not None:
            for p in c.positions.tolist():
                holders[p] = holders.get(p, 0) + 1
            for p in c.positions[c.ratio > EXACT].tolist():
                differs[p] = differs.get(p, 0) + 1
    out: list[Problem] = []
    for row, c in zip(j.rows, j.cells, strict=True):
        if c.positions is None:
            continue
        lone = [i for i in np.flatnonzero(c.ratio > suspect) if differs[int(c.positions[i])] == 1]
        lone = [i for i in lone if holders[int(c.positions[i])] > 1]
        if not lone:
            continue
        cell = int(max(lone, key=lambda i: float(c.ratio[i])))
        run = _run(body, row["section"], c.part, c.layer)
        pos = int(c.positions[cell])
        msg = (
            f"{c.part} layer {c.layer} ({row['type']}): cell {cell} (position {pos}) differs from its recompute by "
            f"{float(c.ratio[cell]):.3g} noise floors while the {holders[pos] - 1} other K/V layer(s) holding "
            f"position {pos} recompute it exactly ({len(lone)} cell(s) like it): a difference in this layer's "
            "bytes alone (drift reaches every layer above where it starts)"
        )
        out.append((ProblemCode.DEEP_MISMATCH, row["section"], _element_offset(run, cell, 0) if run else None, msg))
    return out


def _run(body: Body, section: str, part: str, layer: int) -> LayerRun | None:
    """The stored run of a judgment row (``body.<role>.stream[i]``, part, layer)."""
    for blk in body.blocks:
        if blk.kind != MemoryKind.KV:
            continue
        for st in blk.streams:
            if f"body.{blk.role}.stream[{st.index}]" == section:
                return next((r for r in (st.k if part == "K" else st.v) if r.index == layer), None)
    return None
