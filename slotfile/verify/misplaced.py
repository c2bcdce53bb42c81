"""Damage that moves data (issue 25): a block of the file that matches another recomputed block.

Drift (:mod:`slotfile.verify.shape`) moves each stored row a little away from its own
recompute, in no particular direction: the row stays far closer to its own recompute than to
any other.  Damage that *moves* bytes - two layers exchanged, a layer's K and V exchanged, two
cells' rows exchanged, a row copied over another - leaves a stored block that is near another
recomputed block (another layer of the same type and byte length in the same stream, the other
of K and V, another cell's row of the same layer) and far from its own.  The judge calls
:func:`find_misplaced` on the first recompute, before any difference is excused as drift: a
block over its noise floor (:data:`SUSPECT`) that lies within :data:`MATCH` of its own distance
of another recomputed block, when the other stored block corroborates the move
(:func:`corroborate`) and, for a cell, no other layer exceeds the limit at its position
(:func:`_confined`), is damage whatever the shape.

Distances are relative: ``||stored - recomputed|| / max(||stored||, ||recomputed||)`` (0: the
same values, about 1.4 for unrelated vectors of one norm).  A layer is compared on up to
:data:`SAMPLE` of its values at fixed places in the file's byte order (the bytes a swap moves
with; a transposed V stores each element of all cells together), a cell on its whole row.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from slotfile.format.records import Body, LayerRun, MemoryBlock, MemoryKind
from slotfile.format.types import TypeId
from slotfile.problems import ProblemCode
from slotfile.verify.judge import MARGIN_LIMIT, Judgment, Problem, RunCells, align_cells
from slotfile.verify.stats import CHUNK_CELLS, dequant_rows, median

# another recomputed block "matches" a stored one that is nearer to it than this fraction of the
# stored block's distance to its own recompute.  Measured on 34 clean real-server Gemma files
# (v4-cuda, v4-native, v3-native, the former false alarms among them): a layer's nearest other
# recomputed layer at 8.8 times its own distance or more; among the 64 worst cells of each layer
# (confined, corroborated) 0.94 or more (two positions with near-equal rows).  A move: 0 to 0.05.
MATCH = 0.25
# two cells' rows each nearer the other's recompute (exchanged) match from this fraction on when
# each is also distinctly nearest that one (DISTINCT): a q4_0 K cell swap in a file of another
# build (the rows 0.18-0.23 from their own recomputes, by q4_0's steps and the drift) sat at 0.27
# and 0.32 of their own distances, missed at MATCH, each row 0.48-0.52 of the way to its next
# nearest.  Clean q4_0 files hold near-ties closer than MATCH's calibration said: 0.51 and 0.53
# (V rows of -fa on q4_0 edited chats, 74 v4 files against the portable library), each row about
# as near other rows (0.80-1.0 of the way): several near-equal rows, not a move
MATCH_EXCHANGE = 0.5
DISTINCT = 0.7
# a whole layer has far more room: no clean layer came nearer another's recompute than 8.8 times
# its own distance, so a layer matches from half its own distance on.  A K/V swap of a q4_0 SWA
# layer in a CUDA-written Gemma file (every layer drifting, q4_0's own distance 0.2-0.35) sat at
# 0.25-0.26 of its own distance: missed at MATCH, caught here
MATCH_LAYER = 0.5
SAMPLE = 1 << 16  # values of a layer compared, evenly spaced in byte order
MAX_CELLS = 64  # suspect cells per layer looked up among the layer's recomputed rows
# a layer or cell is suspect from this many noise floors on: a move is judged by its distances,
# not its size (a q4_0 cell swap can stay under the limit: 2.9 floors)
SUSPECT = 1.0
TINY = 1e-30
# two positions whose last REPEAT tokens are the same (a looping reply: a small model at temperature 0
# repeats a phrase) hold rows the model computed from near-equal contexts, and V carries no position:
# a drifting row there lies nearer the recompute of its repeat than of its own (a -t 4 -fa on v3 server's
# 64-token reply looping with period 7: V of model layer 5 at position 2146 0.0706 from the recompute of
# 2153, 0.17 from its own), so no distance tells a move between them from the drift, and rows exchanged
# between them would change little.  They are not candidates for each other
REPEAT = 8
_HASH_BASE = 1_000_003  # repeat_ids: the base of its polynomial hash (a prime)
# where every layer drifts beyond the limit (a GPU-written file), a cell is confined to its
# layer when it stands this many times above the layer's median cell (at least one floor) and
# no other layer's cell at its position stands out of its own layer so: a cell swap in a CUDA
# file's K layer 9 stood 21x above its layer's median, the other layers there 0.5-2.7x
STAND_OUT = 4.0


@dataclass
class Group:
    """The runs of one stream (or one recurrent block) of the file and of the recompute, and for
    each file cell the recompute's cell holding its position (None: the same order)."""

    section: str
    runs: list[tuple[LayerRun, LayerRun]]  # (file run, recomputed run) by part and layer
    positions: np.ndarray | None
    rec_positions: np.ndarray | None
    align: np.ndarray | None


def _groups(file_body: Body, rec_body: Body) -> Iterator[Group]:
    """Every stream of the file with the same cells (by position) as the recompute's."""
    for fb, rb in zip(file_body.blocks, rec_body.blocks, strict=False):
        yield from _block_groups(fb, rb)


def _block_groups(fb: MemoryBlock, rb: MemoryBlock) -> Iterator[Group]:
    if fb.kind != MemoryKind.KV:
        if fb.cell_count == rb.cell_count:
            pairs = [
                (f, r) for pf, pr in ((fb.r, rb.r), (fb.p, rb.p), (fb.s, rb.s)) for f, r in zip(pf, pr, strict=False)
            ]
            yield Group(f"body.{fb.role}", _same_shape(pairs), None, None, None)
        return
    for fs, rs in zip(fb.streams, rb.streams, strict=False):
        if not fs.cell_count or fs.cell_count != rs.cell_count:
            continue
        if not np.array_equal(np.sort(fs.positions), np.sort(rs.positions)):
            continue
        pairs = [*zip(fs.k, rs.k, strict=False), *zip(fs.v, rs.v, strict=False)]
        sec = f"body.{fb.role}.stream[{fs.index}]"
        yield Group(sec, _same_shape(pairs), fs.positions, rs.positions, align_cells(fs.positions, rs.positions))


def _same_shape(pairs: list[tuple[LayerRun, LayerRun]]) -> list[tuple[LayerRun, LayerRun]]:
    return [
        (f, r)
        for f, r in pairs
        if (f.type_id, f.row_size, f.transposed, f.n_cells) == (r.type_id, r.row_size, r.transposed, r.n_cells)
        and f.elements
    ]


def _flat_length(run: LayerRun) -> int:
    return run.n_cells * int(run.elements or 0)


def sample(run: LayerRun, flat: np.ndarray, align: np.ndarray | None) -> np.ndarray:
    """The run's values at flat indices ``flat`` of the file's byte order, each taken from the
    cell ``align`` maps the file's cell to (a recompute holding the positions in other cells)."""
    n, e = run.n_cells, int(run.elements or 0)
    if flat.size == n * e:
        # every value (``flat`` is strictly increasing, so it is 0..n*e-1): the rows as they lie,
        # no gather (two index arrays and a fancy index per layer cost ~1 ms a layer of 32k values)
        x = dequant_rows(run, 0, n, cells=align)
        return np.nan_to_num((x.T if run.transposed else x).reshape(-1), nan=0.0, posinf=0.0, neginf=0.0)
    el, cell = np.divmod(flat, n) if run.transposed else np.divmod(flat, e)[::-1]
    src = cell if align is None else align[cell]
    if run.type_id in (TypeId.F32, TypeId.F16, TypeId.BF16):
        arr = run.array()
        v = arr[el, src] if run.transposed else arr[src, el]
        if run.type_id == TypeId.BF16:
            v = (v.astype(np.uint32) << 16).view(np.float32)
        return np.nan_to_num(np.asarray(v, dtype=np.float64), nan=0.0, posinf=0.0, neginf=0.0)
    rows, inv = np.unique(src, return_inverse=True)
    x = dequant_rows(run, 0, rows.size, cells=rows)
    return np.nan_to_num(x[inv, el], nan=0.0, posinf=0.0, neginf=0.0)


def _norm(v: np.ndarray) -> float:
    # einsum, not BLAS: a BLAS call per vector (np.linalg.norm) spins its threads on a loaded machine
    return float(np.sqrt(np.einsum("i,i->", v, v)))


def distance(x: np.ndarray, y: np.ndarray) -> float:
    """``||x - y|| / max(||x||, ||y||)`` (0 when both are zero)."""
    den = max(_norm(x), _norm(y))
    return _norm(x - y) / den if den > TINY else 0.0


def _failing(j: Judgment, limit: float) -> dict[tuple[str, str, int], RunCells | None]:
    """The layers of ``j`` over ``limit`` floors, by (section, part, layer), with their cells."""
    cells = j.cells if len(j.cells) == len(j.rows) else [None] * len(j.rows)
    out: dict[tuple[str, str, int], RunCells | None] = {}
    for row, c in zip(j.rows, cells, strict=True):
        if row.get("ratio", 0.0) > limit:
            ok = c is not None and (c.block, c.part, c.layer) == (row["block"], row["part"], row["layer"])
            out[(row["section"], row["part"], row["layer"])] = c if ok else None
    return out


def repeat_ids(tokens: np.ndarray, width: int = REPEAT) -> np.ndarray:
    """Per position, an id shared by the positions whose last ``width`` tokens (the token there
    and the ``width - 1`` before it; before position 0: none) are the same: a polynomial hash
    of the window modulo 2^64 (a collision, about n^2 / 2^64, only leaves one pair unmatched)."""
    t = np.asarray(tokens, dtype=np.int64)
    n = t.size
    padded = np.concatenate([np.zeros(width - 1, dtype=np.uint64), (t + 1).astype(np.uint64)])
    ids = np.zeros(n, dtype=np.uint64)
    for k in range(width):  # uint64 arithmetic wraps: the hash modulo 2^64
        ids = ids * np.uint64(_HASH_BASE) + padded[k : k + n]
    return ids


def find_misplaced(
    file_body: Body,
    rec_body: Body,
    j: Judgment,
    tokens: np.ndarray | None = None,
    suspect: float = SUSPECT,
    limit: float = MARGIN_LIMIT,
) -> list[Problem]:
    """Every layer of the file over ``suspect`` floors in ``j`` whose values match another
    recomputed layer of its stream (:func:`_layer_match`), else whose cells over ``suspect``
    floors, where no other layer exceeds ``limit``, match other cells' recomputed rows
    (:func:`_cell_matches`): one problem per layer.  ``tokens``: the stored tokens by position;
    a cell is not matched with a position repeating its last :data:`REPEAT` tokens."""
    failing = _failing(j, suspect)
    if not failing or file_body.layout is None or rec_body.layout is None:
        return []
    out: list[Problem] = []
    over = _over_by_position(j, limit)
    outstanding = _outstanding_by_position(j)
    repeats = repeat_ids(tokens) if tokens is not None and tokens.size else None
    for g in _groups(file_body, rec_body):
        cache: dict[int, np.ndarray] = {}
        stacks: dict[tuple[int, int], Any] = {}
        for fr, rr in g.runs:
            key = (g.section, fr.part, fr.index)
            if key not in failing:
                continue
            p = _layer_match(g, fr, rr, cache, stacks)
            rc = failing[key]
            if p is None and rc is not None and g.positions is not None:
                p = _cell_matches(g, (fr, rr), rc, _confined(rc, over, suspect, outstanding), repeats)
            if p is not None:
                out.append(p)
    return out


def _over_by_position(j: Judgment, limit: float) -> dict[int, set[tuple[str, int]]]:
    """Per position, the layers (block role, layer) with a cell over ``limit`` floors there."""
    over: dict[int, set[tuple[str, int]]] = {}
    for c in j.cells:
        if c.positions is not None:
            for p in c.positions[np.flatnonzero(c.ratio > limit)]:
                over.setdefault(int(p), set()).add((c.block, c.layer))
    return over


def _standing_out(c: RunCells) -> np.ndarray:
    """Which cells of a layer stand :data:`STAND_OUT` times above the layer's typical cell
    (its median ratio, at least one floor)."""
    return c.ratio >= STAND_OUT * max(median(c.ratio), 1.0) if c.ratio.size else c.ratio.astype(bool)


def _outstanding_by_position(j: Judgment) -> dict[int, set[tuple[str, int]]]:
    """Per position, the layers (block role, layer) whose cell there stands out of its layer."""
    out: dict[int, set[tuple[str, int]]] = {}
    for c in j.cells:
        if c.positions is not None:
            for p in c.positions[np.flatnonzero(_standing_out(c))]:
                out.setdefault(int(p), set()).add((c.block, c.layer))
    return out


def _confined(
    rc: RunCells,
    over: dict[int, set[tuple[str, int]]],
    suspect: float,
    outstanding: dict[int, set[tuple[str, int]]] | None = None,
) -> np.ndarray:
    """The cells of ``rc`` over ``suspect`` floors where no other layer is over the limit (its
    K or V may be) in ``over`` (:func:`_over_by_position`), or, where every layer drifts (a
    file from another build: every layer over the limit everywhere), that stand out of their
    layer while no other layer's cell at that position stands out of its own
    (``outstanding``: :func:`_outstanding_by_position`).  Damage lives in one layer's bytes,
    while a drifting row that tips towards another position's recompute (a long repetitive
    prompt: two near-tied attention targets) carries that difference into every layer above it."""
    assert rc.positions is not None
    bad = np.flatnonzero(rc.ratio > suspect)
    me = {(rc.block, rc.layer)}
    mine = _standing_out(rc)
    keep = [
        c
        for c in bad
        if not over.get(int(rc.positions[c]), set()) - me
        or (outstanding is not None and mine[c] and not outstanding.get(int(rc.positions[c]), set()) - me)
    ]
    return np.array(keep, dtype=np.int64)


def _layer_match(
    g: Group, fr: LayerRun, rr: LayerRun, cache: dict[int, np.ndarray], stacks: dict[tuple[int, int], Any]
) -> Problem | None:
    """The file's layer against every recomputed layer of the group with its type and byte
    length (another layer, the other of K and V): a problem when one is within :data:`MATCH_LAYER`
    of the distance to its own recompute and the move is corroborated (:func:`corroborate`)."""
    size = _flat_length(fr)
    # evenly spaced, strictly increasing (a step of at least 1)
    flat = np.arange(size) if size <= SAMPLE else np.linspace(0, size - 1, SAMPLE).astype(np.int64)
    x = sample(fr, flat, None)

    def rec(r: LayerRun) -> np.ndarray:
        if id(r) not in cache:
            cache[id(r)] = sample(r, flat, g.align)
        return cache[id(r)]

    cands = [(fo, o) for fo, o in g.runs if o is not rr and o.type_id == fr.type_id and _flat_length(o) == size]
    if not cands:
        return None
    own = distance(x, rec(rr))
    # every candidate at once: the group's recomputed samples of this type and length stacked
    # once (their norms with them), one product per layer instead of a distance call per pair
    key = (fr.type_id, size)
    if key not in stacks:
        same = [o for _fo, o in g.runs if o.type_id == fr.type_id and _flat_length(o) == size]
        ys = np.stack([rec(o) for o in same])
        stacks[key] = ({id(o): i for i, o in enumerate(same)}, ys, np.einsum("ij,ij->i", ys, ys))
    row, ys, ny2 = stacks[key]
    idx = np.array([row[id(o)] for _fo, o in cands])
    # one product of x with the whole stack (a matrix-vector product over its rows), then the
    # candidates' entries: indexing the stack first copied it (~4 MB a Gemma layer) per layer
    d_all = _product_distances(x[None, :], np.einsum("i,i->", x, x)[None], ys, ny2)[0]
    k = int(np.argmin(d_all[idx]))
    fo, other = cands[k]
    d = distance(x, rec(other))  # exact (the product form rounds near 0: a copy is at 0)
    if not d < MATCH_LAYER * own:
        return None
    how = corroborate(x, sample(fo, flat, None), rec(rr), rec(other), MATCH_LAYER)
    if not how:
        return None
    name = f"{other.part} layer {other.index}"
    msg = (
        f"{fr.part} layer {fr.index} ({fr.type_name}) matches the recompute of {name} (distance {d:.3g} "
        f"vs {own:.3g} to its own recompute) and the file's {name} "
        + ("holds the same values" if how == "copied" else f"matches the recompute of {fr.part} layer {fr.index}")
        + f": {'K and V' if other.index == fr.index else 'layers'} {how}"
    )
    return (ProblemCode.DEEP_MISMATCH, g.section, fr.data.offset, msg)


def corroborate(x: np.ndarray, y: np.ndarray, rx: np.ndarray, ry: np.ndarray, match: float = MATCH) -> str:
    """How stored block ``x``, which matches recomputed block ``ry`` better than its own ``rx``,
    got there, from the stored block ``y`` recomputed as ``ry``: ``copied`` (``y`` holds the
    same values), ``exchanged`` (``y`` matches ``rx`` likewise), or '' (not corroborated: a
    long repetitive prompt can tip one drifting row towards another position's recompute, never
    two rows towards each other's, never to the same bytes)."""
    if np.array_equal(x, y):
        return "copied"
    return "exchanged" if distance(y, rx) < match * distance(y, ry) else ""


def _cell_matches(
    g: Group, runs: tuple[LayerRun, LayerRun], rc: RunCells, bad: np.ndarray, repeats: np.ndarray | None = None
) -> Problem | None:
    """The layer's cells ``bad`` (suspect, in this layer alone: the :data:`MAX_CELLS`
    worst) against every recomputed row of the layer: a problem naming the first cell whose row
    is within :data:`MATCH` of its own distance of another cell's recomputed row, corroborated
    by that cell's stored row (:func:`corroborate`: the same values), or within
    :data:`MATCH_EXCHANGE` where that row lies as near this cell's recompute (exchanged) and each
    row is distinctly nearest the other's recompute (:func:`_distinct`).  ``repeats``: the repeat
    ids by position (:func:`repeat_ids`); a cell is not matched with a position sharing its id."""
    fr, rr = runs
    if bad.size < 1 or fr.n_cells < 2:
        return None
    bad = np.sort(bad[np.argsort(-rc.ratio[bad], kind="stable")][:MAX_CELLS])
    x = _rows(fr, bad)
    own_cells = bad if g.align is None else g.align[bad]
    d = _row_distances(x, rr)  # (bad cells, recomputed cells)
    own = d[np.arange(bad.size), own_cells]
    d[np.arange(bad.size), own_cells] = np.inf
    rid = _repeat_of(g, repeats)
    if rid is not None:
        _drop_repeats(d, rid[0][bad], rid[1])
    near = np.argmin(d, axis=1)
    file_cell = np.arange(fr.n_cells)
    if g.align is not None:
        file_cell[g.align] = np.arange(fr.n_cells)  # the file's cell of each recomputed cell
    hits: list[tuple[int, int, str]] = []
    dn = d[np.arange(bad.size), near]
    for h in np.flatnonzero(dn < MATCH_EXCHANGE * own):
        rx, ry = _rows(rr, np.array([own_cells[h], near[h]]))
        y = _rows(fr, file_cell[[near[h]]])[0]
        how = corroborate(x[h], y, rx, ry) if dn[h] < MATCH * own[h] else ""
        if not how and corroborate(x[h], y, rx, ry, MATCH_EXCHANGE) == "exchanged":
            # past MATCH: each row distinctly nearest the other's recompute, not one of several
            dy = _row_distances(y[None, :], rr)
            dy[0, near[h]] = np.inf  # that row's own recompute
            if rid is not None:
                _drop_repeats(dy, rid[1][[near[h]]], rid[1])
            dy = dy[0]
            how = "exchanged" if _distinct(d[h]) and _distinct(dy) else ""
        if how:
            hits.append((int(h), int(near[h]), how))
    if not hits:
        return None
    i, k, how = hits[0]
    c = int(bad[i])
    pos, rpos = g.positions, g.rec_positions
    assert pos is not None and rpos is not None
    msg = (
        f"{fr.part} layer {fr.index} ({fr.type_name}): cell {c} (position {int(pos[c])}) holds the row "
        f"recomputed for position {int(rpos[k])} (distance {d[i, k]:.3g} vs {own[i]:.3g} to its own recompute; "
        f"{len(hits)} cell(s) like it): rows {how}"
    )
    elsize = fr.row_size // max(int(fr.elements or 1), 1)
    off = fr.data.offset + (c * elsize if fr.transposed else c * fr.row_size)
    return (ProblemCode.DEEP_MISMATCH, g.section, off, msg)


def _repeat_of(g: Group, ids: np.ndarray | None) -> tuple[np.ndarray, np.ndarray] | None:
    """The repeat ids ``ids`` (by position: :func:`repeat_ids`) of the group's file cells and of
    its recomputed cells (None: the tokens are not known, or a cell holds a position beyond them)."""
    pos, rpos = g.positions, g.rec_positions
    if pos is None or rpos is None or ids is None or not pos.size:
        return None
    if min(int(pos.min()), int(rpos.min())) < 0 or max(int(pos.max()), int(rpos.max())) >= ids.size:
        return None
    return ids[pos], ids[rpos]


def _drop_repeats(d: np.ndarray, row_ids: np.ndarray, col_ids: np.ndarray) -> None:
    """Set to inf each distance of ``d`` (rows by recomputed cells) whose recomputed cell repeats
    the row's last tokens (equal repeat ids)."""
    d[row_ids[:, None] == col_ids[None, :]] = np.inf


def _distinct(dist: np.ndarray) -> bool:
    """Whether the nearest of a row's distances to the recomputed rows (its own left out as inf)
    is under :data:`DISTINCT` of the next nearest."""
    two = np.partition(dist, 1)[:2] if dist.size > 1 else np.array([0.0, np.inf])
    return bool(two[0] < DISTINCT * two[1])


def _rows(run: LayerRun, cells: np.ndarray) -> np.ndarray:
    """The rows of ``cells`` as float64, non-finite values as 0."""
    return np.nan_to_num(dequant_rows(run, 0, cells.size, cells=cells), nan=0.0, posinf=0.0, neginf=0.0)


def _row_distances(x: np.ndarray, run: LayerRun) -> np.ndarray:
    """Relative distances of rows ``x`` to every row of ``run`` (recompute cell order), in
    chunks of :data:`CHUNK_CELLS` cells."""
    nx2 = np.einsum("ij,ij->i", x, x)
    out = np.empty((x.shape[0], run.n_cells))
    for c0 in range(0, run.n_cells, CHUNK_CELLS):
        c1 = min(run.n_cells, c0 + CHUNK_CELLS)
        y = np.nan_to_num(dequant_rows(run, c0, c1), nan=0.0, posinf=0.0, neginf=0.0)
        out[:, c0:c1] = _product_distances(x, nx2, y, np.einsum("ij,ij->i", y, y))
    return out


def _product_distances(x: np.ndarray, nx2: np.ndarray, y: np.ndarray, ny2: np.ndarray) -> np.ndarray:
    """:func:`distance` of every row of ``x`` to every row of ``y`` (their squared norms ``nx2``,
    ``ny2``) from one matrix product instead of a call per pair; it rounds near 0, so a
    decision on a pair it picks takes :func:`distance` again."""
    d2 = np.maximum(nx2[:, None] + ny2[None, :] - 2.0 * (x @ y.T), 0.0)
    den = np.maximum(np.sqrt(np.maximum(nx2[:, None], ny2[None, :])), TINY)
    return np.sqrt(d2) / den
