"""Isolated spikes: one stored element (or one quantization block) far off while the rest of
its head and the same element of the other cells sit at the noise level (issue 25).

A bit flip moves one value: an f16/f32/bf16 element, or, in a q8_0/q4_0 row, the 32 values of
one block together (its f16 scale ``d``, ``block_q8_0`` in ggml-common.h) or one of them (a
quant).  Drift (another build's kernels, another prompt split) moves whole rows from the
position where two computations part, and a dimension the model amplifies moves in every cell;
neither leaves one value alone.  So each unit's difference from the recompute (an element's
``|stored - recomputed|``; a block's largest over its 32 values) is divided by the largest of
three noise levels:

* the rest of its head in the same cell: the largest difference of the other units;
* the same unit in the other cells: the largest of their differences;
* the storage resolution at the recomputed value: one f16/bf16/f32 step (ulp) of the element,
  one quantization step of the block (its largest |value| over 127 for q8_0, over 8 for q4_0).
  An element's step is taken at no less than :data:`SIZE_FLOOR` of its size (its root mean
  square over the cells): a value the model computed as a small sum of large terms rounds in
  f32 at the terms' scale, so near zero one f16 step says nothing (a 4-slot unified server's
  V element at 0.00024, of size 0.34, four f16 steps off in an otherwise exact context).

Largest, not typical: drift's largest difference in a row or a column is within a few times
any other value's there, so a flip that moves a value more than the drift around it does not
hide behind a limit wide enough for drift's heavy tail (the root mean square this rule first
divided by needed limits of 15.8 to 46 and passed a V element moved 2.3 times the layer's
largest difference).  A K or V element is judged a second way too, the rest of its head scaled
to its own size (each element's differences over the root mean square of its recomputed values
across the cells; a small dimension drifts less than a large one), so a sign flip in a small
dimension of a row whose large dimensions drift is not excused by them.  A unit more than
:func:`spike_limit` times its noise (scaled: :data:`SPIKE_MARGIN` times
:data:`CLEAN_MAX_SCALED`) is damage in the file's bytes: :data:`SPIKE_MARGIN` times the largest
ratio 280 clean real-server files show for its kind (:data:`CLEAN_MAX`).  In an exact context
(the rest of the head and the unit in every other cell equal the recompute bit for bit) a unit
more than :data:`EXACT_LIMIT` storage steps off (a block: :data:`EXACT_BLOCK_LIMIT`), or its
kind's limit where that is lower, is damage too, and :data:`LAYER_EXACT_LIMIT` steps where
every other value of the layer is exact.  What stays unclaimed: a flip within a few storage
steps (a low mantissa bit, a q8_0/q4_0 quant's lowest bit), and a flip no larger than a few
times the drift around it (bench/detect-shape-judge.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from slotfile.format.records import LayerRun
from slotfile.format.types import TYPES, TypeId
from slotfile.verify.stats import CHUNK_CELLS, FLOAT_TYPES, dequant_rows

# The largest ratio clean files show against their first recompute (bench/spike_maxima.py; bench/detect-shape-judge.md,
# 2026-12-04 16:00: 280 real-server files, every GPU-written one (v3-cuda, v4-cuda, v4-cuda-fa: -fa on/off, q8_0,
# q4_0) verified on a CPU, every v3/v4-native Gemma 3 270M file (-fa on/off, q8_0, q4_0, SWA full, -np 4,
# -ub 64/128, long prompts) and the fixture models'), per kind: K 3.53 where a -ub 128 server's split makes
# a CPU-written Gemma 3 file drift (g-ub128-b256-fa-off long, cell 293: 5.98 against 1.70 in its row), V
# 2.36 in a GPU-written one, R/S two f32 steps of an LFM2 or Mamba state, quantized blocks 1.61 (q4_0 V);
# with the rest of the head scaled to the element's size, K 2.59 and V 2.94 (the tiny Gemma 3 fixture model
# written on a GPU, a few f16 steps apart).  R/S since 2026-12-06: 3.33, the Jamba fixture's S state in a 4-slot
# unified (-kvu) v4 server's slot (f-jamba-np4-kvu long slot 3: 452 of its 512 values a few f32 steps off, the
# largest value 10 steps where the rest of the row shows 3; the batch the server decoded holds the other
# slots' tokens too, and its attention sums this slot's cells in their placement).
CLEAN_MAX = {"K": 3.53, "V": 2.36, "rec": 3.33, "quantized": 1.61}
CLEAN_MAX_SCALED = {"K": 2.59, "V": 2.94}
SPIKE_MARGIN = 1.5  # a unit fails above this many times the clean maximum of its kind
# In an exact context (every other unit of its head and this unit in every other cell equal the
# recompute bit for bit) the same files show at most three f16 steps (a GPU-written tiny Gemma 3's
# K) and no quantized block that differs at all: an element that moved more than EXACT_LIMIT steps
# there, or a block value more than EXACT_BLOCK_LIMIT (one re-rounded quant moves one step), is no
# rounding.  Where every other value of the whole layer is exact they show one step (a DeepSeek2 K).
# An AVX-512 server's tiny Gemma 3 file against an AVX2 library showed 5 steps there (2026-12-05):
# the limit is 7, which claims what it claimed before from one flipped bit (a mantissa bit k moves
# a value by exactly 2^k steps: 8 and up) and leaves 5-7 steps, which no single flip gives.
EXACT_LIMIT = 7.0
EXACT_BLOCK_LIMIT = 1.5
LAYER_EXACT_LIMIT = 2.0
# a float element within this factor of its recompute, with its sign, that no single flipped bit
# explains, is drift however far above its noise (_drift_sized)
DRIFT_FACTOR = 2.0
# An element's storage step is taken at no less than this fraction of its size (its root mean
# square over the cells).  ggml sums a K/V value in f32 from terms of about the size of the
# element; an input that moved by a few f32 steps (another grouping of the same cells, another
# batch's kernel path) moves the sum by about 2^-24 times the terms' scale times the square root
# of their number, which is one f16 step (2^-11 of a value) only for values below 1/1,000 (64
# terms) to 1/128 (4,096 terms) of that scale; the clean files that needed it held values 780 to
# 52,000 times below their size.  1/64 leaves room and gives up only the low mantissa bits of
# values that small.
SIZE_FLOOR = 1.0 / 64
# mantissa bits per float type: one step (ulp) of a value in [2^e, 2^(e+1)) is 2^(e - bits);
# the smallest step is a subnormal's
_MANTISSA: dict[int, tuple[int, float]] = {
    TypeId.F16: (10, 2.0**-24),
    TypeId.BF16: (7, 2.0**-133),
    TypeId.F32: (23, 2.0**-149),
}
# quantized types: the largest |quant| of a block (its step is the block's largest |value| over it)
_QMAX: dict[int, float] = {
    TypeId.Q8_0: 127.0,
    TypeId.Q8_1: 127.0,
    TypeId.Q5_0: 16.0,
    TypeId.Q5_1: 31.0,
    TypeId.Q4_0: 8.0,
    TypeId.Q4_1: 15.0,
    # block_iq4_nl: d times a 16-entry table of -127..113 (kvalues_iq4nl, ggml-common.h), with
    # d = the block's largest |value| / 127: its widest step (113 - 89 = 24) is that over 127 / 24
    TypeId.IQ4_NL: 127.0 / 24.0,
}
_TINY = 1e-300


@dataclass
class Spike:
    """The unit furthest above its noise in one layer: where it lies and what it shows."""

    cell: int
    element: int  # the element (a block's: the one that moved most)
    ratio: float  # its difference over its noise level
    diff: float  # |stored - recomputed| (a block's: the largest over its values)
    stored: float
    recomputed: float
    head_rest: float  # the rest of its head: the largest difference of the other units
    cells_rest: float  # the same unit in the other cells: the largest of their differences
    resolution: float  # one storage step at the recomputed value (an element's: at least SIZE_FLOOR of its size)
    block: int  # values moving together: 1 for an element, 32 for a q8_0/q4_0 block
    limit: float = 0.0  # the limit it was judged against (its kind's, or exact_limit() steps)
    exact: bool = False  # the rest of its head and its element in every other cell equal the recompute
    scaled: bool = False  # judged with the rest of its head scaled to its element's size (CLEAN_MAX_SCALED)
    alone: bool = False  # exact, and every other unit of the layer equals the recompute too
    # a quantized block's raw bytes show one flipped bit whatever the noise (flipped_block): what they show
    signature: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {k: (float(f"{v:.6g}") if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def block_size(type_id: int) -> int:
    """Values per unit: 1 for a float type, the block's for a quantized one (32 for q8_0/q4_0)."""
    return 1 if type_id in FLOAT_TYPES else int(TYPES[type_id].blck_size)


def resolution(y: np.ndarray, type_id: int) -> np.ndarray:
    """Per unit of ``y`` (cells, elements), one storage step at its value: an element's ulp, or
    a block's quantization step (the block's largest |value| over its largest |quant|)."""
    a = np.abs(y)
    if type_id in _MANTISSA:
        bits, smallest = _MANTISSA[type_id]
        _m, e = np.frexp(np.maximum(a, _TINY))
        return np.maximum(np.ldexp(1.0, e - 1 - bits), smallest)
    b = block_size(type_id)
    return a.reshape(a.shape[0], -1, b).max(axis=2) / _QMAX[type_id]


def unit_diffs(d: np.ndarray, type_id: int) -> np.ndarray:
    """Per unit, the size of the difference: |d| of an element, the largest |d| of a block's values
    (a flipped scale moves all 32, a flipped quant one of them)."""
    b = block_size(type_id)
    if b == 1:
        return np.abs(d)
    return np.abs(d).reshape(d.shape[0], -1, b).max(axis=2)


def _top2(u: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Along ``axis``: the largest value, the second largest (0 when there is one value) and the
    index of the largest."""
    i = np.argmax(u, axis=axis)
    if u.shape[axis] < 2:
        first = np.max(u, axis=axis)
        return first, np.zeros_like(first), i
    top = np.partition(u, -2, axis=axis)
    return np.take(top, -1, axis=axis), np.take(top, -2, axis=axis), i


def _rest_of_heads(u: np.ndarray, head_units: int) -> np.ndarray:
    """Per unit, the largest difference among the other units of its head in the same cell."""
    c, n = u.shape
    g = head_units if 0 < head_units <= n and n % head_units == 0 else n
    h = u.reshape(c, n // g, g)
    first, second, i = _top2(h, 2)
    mine = np.arange(g)[None, None, :] == i[..., None]
    return np.where(mine, second[..., None], first[..., None]).reshape(c, n)


def _pair(a: LayerRun, b: LayerRun, c0: int, c1: int, b_cells: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Cells c0..c1 of the stored and the recomputed run, non-finite stored values as the recompute's
    (the judge reports those on their own)."""
    x, y = dequant_rows(a, c0, c1), dequant_rows(b, c0, c1, b_cells)
    bad = ~np.isfinite(x)
    if bad.any():
        x = np.where(bad, y, x)
    return x, y


@dataclass
class _Columns:
    """Per unit over all cells: the largest difference, the second largest, the cell of the
    largest, and how many cells differ at all."""

    first: np.ndarray
    second: np.ndarray
    cell: np.ndarray
    nonzero: np.ndarray
    values: np.ndarray  # per element, the sum of the squared recomputed values
    n_cells: int = 0

    def add(self, u: np.ndarray, y: np.ndarray, c0: int) -> _Columns:
        """These columns joined with a chunk ``u`` of cells starting at cell ``c0``."""
        f, s, i = _top2(u, 0)
        nz = (u > 0).sum(axis=0)
        vv = (y * y).sum(axis=0)
        if not self.first.size:
            return _Columns(f, s, i + c0, nz, vv, len(u))
        mine = self.first >= f
        return _Columns(
            np.where(mine, self.first, f),
            np.where(mine, np.maximum(self.second, f), np.maximum(s, self.first)),
            np.where(mine, self.cell, i + c0),
            self.nonzero + nz,
            self.values + vv,
            self.n_cells + len(u),
        )

    def rest(self, c0: int, n: int) -> np.ndarray:
        """For cells c0..c0+n, per unit, the largest difference of the same unit in the other cells."""
        cells = np.arange(c0, c0 + n)[:, None]
        return np.where(cells == self.cell[None, :], self.second[None, :], self.first[None, :])


def find_spike(
    a: LayerRun, b: LayerRun, head: int = 0, b_cells: np.ndarray | None = None, limit: float | None = None
) -> Spike | None:
    """The unit of file run ``a`` furthest above its limit against recomputed run ``b`` (same
    cells, same type), when it exceeds it (None: no spike).  ``limit``: one ratio for every unit
    instead of :func:`spike_limit` and, in an exact context, :func:`exact_limit` steps.
    ``head``: elements per head (0: the row is one head); ``b_cells``: the cell of ``b`` for
    each cell of ``a`` (:func:`slotfile.verify.judge.align_cells`)."""
    n, t = a.n_cells, a.type_id
    if n == 0 or a.row_size == 0 or (t not in FLOAT_TYPES and t not in _QMAX):
        return None
    bs = block_size(t)
    head_units = head // bs if head and head % bs == 0 else 0
    cols = _Columns(np.zeros(0), np.zeros(0), np.zeros(0, dtype=np.intp), np.zeros(0), np.zeros(0))
    held: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # one chunk: dequantized once, not per pass
    for c0 in range(0, n, CHUNK_CELLS):
        x, y = _pair(a, b, c0, min(n, c0 + CHUNK_CELLS), b_cells)
        u = unit_diffs(x - y, t)
        cols = cols.add(u, y, c0)
        held = (x, y, u) if n <= CHUNK_CELLS else None
    if not cols.nonzero.any():
        return None
    scaled = CLEAN_MAX_SCALED.get(a.part) if t in FLOAT_TYPES else None
    lims = _Limits(
        spike_limit(a) if limit is None else 1.0,
        exact_limit(t) if limit is None else 1.0,
        LAYER_EXACT_LIMIT if limit is None else 1.0,
        (SPIKE_MARGIN * scaled if limit is None else 1.0) if scaled else None,
    )
    best: Spike | None = None
    for c0 in range(0, n, CHUNK_CELLS):
        if held is not None:
            sp = _worst_unit(*held[:2], t, head_units, cols, c0, lims, held[2])
        else:
            sp = _worst_unit(*_pair(a, b, c0, min(n, c0 + CHUNK_CELLS), b_cells), t, head_units, cols, c0, lims)
        if sp is not None and (best is None or sp.ratio / sp.limit > best.ratio / best.limit):
            best = sp
    if best is None or best.ratio / best.limit <= (1.0 if limit is None else limit):
        return flipped_block(a, b, b_cells) if limit is None else None
    return best


def exact_limit(type_id: int) -> float:
    """Storage steps a unit may move in an exact context: :data:`EXACT_LIMIT` for an element,
    :data:`EXACT_BLOCK_LIMIT` for a quantized block."""
    return EXACT_LIMIT if type_id in FLOAT_TYPES else EXACT_BLOCK_LIMIT


def spike_kind(run: LayerRun) -> str:
    """The kind whose clean maximum (:data:`CLEAN_MAX`) a unit of ``run`` is judged by:
    ``quantized``, ``K``, ``V`` or ``rec`` (R/S)."""
    return "quantized" if run.type_id not in FLOAT_TYPES else run.part if run.part in ("K", "V") else "rec"


def spike_limit(run: LayerRun) -> float:
    """The ratio above which a unit of ``run`` is a spike: :data:`SPIKE_MARGIN` times the clean
    maximum of its kind (:data:`CLEAN_MAX`)."""
    return SPIKE_MARGIN * CLEAN_MAX[spike_kind(run)]


@dataclass
class _Limits:
    """A run's limits: noisy context, exact context (storage steps), the whole layer exact but
    the unit (steps), and the scaled view's (None: not judged, see :data:`CLEAN_MAX_SCALED`)."""

    noisy: float
    exact: float
    layer_exact: float
    scaled: float | None


def _worst_unit(
    x: np.ndarray,
    y: np.ndarray,
    t: int,
    head_units: int,
    cols: _Columns,
    c0: int,
    lims: _Limits,
    u: np.ndarray | None = None,
) -> Spike | None:
    """The unit of the chunk of cells from ``c0`` furthest above its limit (``u``: its unit
    differences when already made)."""
    u = unit_diffs(x - y, t) if u is None else u
    if not u.size:
        return None
    size = np.maximum(np.sqrt(cols.values / cols.n_cells), _TINY)[None, :]  # each element's RMS over the cells
    at = np.maximum(np.abs(y), SIZE_FLOOR * size) if t in _MANTISSA else y
    row, col, res = _rest_of_heads(u, head_units), cols.rest(c0, u.shape[0]), np.maximum(resolution(at, t), _TINY)
    z = u / np.maximum(np.maximum(row, col), res)
    # exact context: every other unit of the head and this unit in every other cell equal the recompute
    exact = (_head_nonzero(u, head_units) == (u > 0)) & (cols.nonzero[None, :] == (u > 0))
    alone = exact & (int(cols.nonzero.sum()) == (u > 0))  # and every other unit of the layer does too
    lim = np.where(exact, min(lims.noisy, lims.exact), lims.noisy)  # an exact context never raises the limit
    lim = np.where(alone, np.minimum(lim, lims.layer_exact), lim)
    scaled = np.zeros(u.shape, dtype=bool)
    if lims.scaled is not None:
        # the rest of the head in units of each element's size (RMS of its recomputed values over the cells)
        row_s = _rest_of_heads(u / size, head_units) * size
        z_s = u / np.maximum(np.maximum(row_s, col), res)
        scaled = (z_s / lims.scaled > z / lim) & ~exact
        z, lim, row = np.where(scaled, z_s, z), np.where(scaled, lims.scaled, lim), np.where(scaled, row_s, row)
    if t in _MANTISSA:
        z = np.where(_drift_sized(x, y, z > lim, np.maximum(np.maximum(row, col), res), t) & ~exact, 0.0, z)
    c, k = np.unravel_index(int(np.argmax(z / lim)), z.shape)
    bs = block_size(t)
    el = int(k) * bs + int(np.argmax(np.abs(x[c, k * bs : (k + 1) * bs] - y[c, k * bs : (k + 1) * bs])))
    return Spike(
        cell=int(c) + c0,
        element=el,
        ratio=float(z[c, k]),
        diff=float(u[c, k]),
        stored=float(x[c, el]),
        recomputed=float(y[c, el]),
        head_rest=float(row[c, k]),
        cells_rest=float(col[c, k]),
        resolution=float(res[c, k]),
        block=bs,
        limit=float(lim[c, k]),
        exact=bool(exact[c, k]),
        scaled=bool(scaled[c, k]),
        alone=bool(alone[c, k]),
    )


def _drift_sized(x: np.ndarray, y: np.ndarray, over: np.ndarray, noise: np.ndarray, t: int) -> np.ndarray:
    """Which float elements over their limit (``over``) no single flipped bit explains: stored
    ``x`` of the recomputed ``y``'s sign, within a factor :data:`DRIFT_FACTOR` of it, and no value
    one bit away from ``x`` within ``noise`` of ``y``.  A flipped bit leaves the old value one bit
    away, and that value sat within the drift of its neighbours; an ill-conditioned position the
    server decoded on another thread count moves one large element by a quarter (a -t 3 -fa on
    chat's position 704: K element 203 of a SWA layer at 19.2 against 25.4, 5.6 times its noise,
    27.2 and 23.2 the nearest one bit away, the noise 1.1).  Random bytes seldom land within a
    factor of 2 of the value with its sign; exact zeros and exponent flips (a factor of 2 or
    more) are not this."""
    out = np.zeros(over.shape, dtype=bool)
    idx = np.flatnonzero(over)
    if not idx.size:
        return out
    xs, ys, tol = x.reshape(-1)[idx], y.reshape(-1)[idx], noise.reshape(-1)[idx]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = xs / ys
        near = np.isfinite(ratio) & (ratio > 1.0 / DRIFT_FACTOR) & (ratio < DRIFT_FACTOR)
        # an exponent bit flipped can give inf or NaN (inf - inf): never within the noise
        reach = np.abs(one_bit_away(xs, t) - ys[:, None]) <= tol[:, None]
    out.reshape(-1)[idx] = near & ~np.any(reach, axis=1)
    return out


def one_bit_away(v: np.ndarray, t: int) -> np.ndarray:
    """Per value of ``v`` (float type ``t``: f16, bf16, f32), the values its bits give with one
    bit flipped (one column per bit; NaN/Inf as they come)."""
    if t == TypeId.F16:
        bits = v.astype(np.float16).view(np.uint16)
        flips = bits[:, None] ^ (np.uint16(1) << np.arange(16, dtype=np.uint16))[None, :]
        return flips.view(np.float16).astype(np.float64)
    if t == TypeId.BF16:
        b32 = v.astype(np.float32).view(np.uint32) & np.uint32(0xFFFF0000)
        flips = b32[:, None] ^ (np.uint32(1) << np.arange(16, 32, dtype=np.uint32))[None, :]
        return flips.view(np.float32).astype(np.float64)
    bits32 = v.astype(np.float32).view(np.uint32)
    flips32 = bits32[:, None] ^ (np.uint32(1) << np.arange(32, dtype=np.uint32))[None, :]
    return flips32.view(np.float32).astype(np.float64)


def _head_nonzero(u: np.ndarray, head_units: int) -> np.ndarray:
    """Per unit, how many units of its head (itself included) differ from the recompute."""
    c, n = u.shape
    g = head_units if 0 < head_units <= n and n % head_units == 0 else n
    return np.repeat((u > 0).reshape(c, n // g, g).sum(axis=2), g, axis=1)


def spike_message(run: LayerRun, sp: Spike, pos: int | None) -> str:
    """One line: the layer, cell, element and how far the value stands above every noise level."""
    at = f"cell {sp.cell}" + (f" (position {pos})" if pos is not None else "")
    what = "element" if sp.block == 1 else f"block of {sp.block} values holding element"
    if sp.signature:
        why = sp.signature
    elif sp.exact:
        where = (
            "every other value of the layer"
            if sp.alone
            else "the rest of its head and this element in every other cell"
        )
        why = (
            f"{sp.ratio:.3g} storage steps of {sp.resolution:.3g} where {where} equal the recompute exactly "
            f"(limit {sp.limit:g} steps)"
        )
    else:
        head = "scaled to this element's size " if sp.scaled else ""
        why = (
            f"{sp.ratio:.3g} times its noise (the largest difference in the rest of its head {head}{sp.head_rest:.3g}, "
            f"of the same element in the other cells {sp.cells_rest:.3g}, one storage step {sp.resolution:.3g}; "
            f"limit {sp.limit:.3g})"
        )
    return (
        f"{run.part} layer {run.index} ({run.type_name}): isolated spike at {at}, {what} {sp.element}: "
        f"stored {sp.stored:.6g}, recomputed {sp.recomputed:.6g} (difference {sp.diff:.3g}), {why}: "
        "one value changed in the file's bytes (a bit flip), not drift"
    )


# Quantized blocks stored as an f16 scale ``d`` then the quants (ggml-common.h): ``block_q8_0``
# (int8 qs[32]) and ``block_q4_0`` (uint8 qs[16]: element j in the low nibble of qs[j], j + 16 in
# the high one, each minus 8); their bytes per block are the type registry's ``type_size``.  The
# types :func:`_quants` unpacks are :data:`BLOCK_QUANT_STEPS`' keys.


def _quants(raw: np.ndarray, t: int) -> np.ndarray:
    """The signed quants of raw blocks (..., block bytes) of type ``t``: (..., 32) int16."""
    qs = raw[..., 2:]
    if t == TypeId.Q8_0:
        return qs.view(np.int8).astype(np.int16)
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int16) - 8


# A q8_0/q4_0 block's raw bytes against the recomputed block's, on clean real-server files of an
# AMD EPYC (v3 against the installed llama-cpp-python, v4 against the portable library; 33 + 33
# q8_0/q4_0 files, 4,122 comparisons with every retry, drift up to 44 floors): where every quant is
# the same (q8_0: or re-rounded by a step) the scale differs by at most a factor of 2^0.028 in
# q8_0 and 2^0.184 in q4_0 (an edited chat); where the scale is the same bit for bit and one
# quant differs, by one step.  One flipped bit gives more: the scale's sign bit negates the block,
# an exponent bit scales it by 2^(2^k), its mantissa bit k by 1 + 2^(k-10)/m (m in [1, 2): bit 7 by
# 1.0625-1.125 or 0.89-0.94, bits 8-9 by more) (BLOCK_SCALE_LOG2: a factor of 2^0.085 = 1.06 in q8_0,
# 3 times its clean maximum, which claims every bit 7 and up; 2^0.5 = 1.41 in q4_0); a quant's
# bit k moves it by 2^k steps (BLOCK_QUANT_STEPS: q4_0 from bit 1, q8_0 from bit 2), whatever the
# noise around it.  Only blocks with MIN_QUANTS quants off zero: a block of one dominant value is
# that value's, and drift can move it as far (and a block of values near zero can change sign).
# The other block types a server stores that start with their f16 scale d (ggml-common.h: block_q4_1
# and block_q5_1 then their f16 minimum m, block_q5_0 / block_q5_1 their fifth bits qh[4],
# block_iq4_nl its table indices; twentieth session), the keys below with q8_0/q4_0: every byte
# after the scale the same and the scale not, on 14 clean v3 and 14 v4 Gemma 3 files (1,872
# comparisons with every retry; the two versions' files and libraries compute them alike): within
# 2^0.020 (q4_1), 2^0.034 (q5_0), 2^0.009 (q5_1), 2^0.065 (iq4_nl), never negated; the limit,
# 2^0.25 = 1.19, is 3.8 times the largest of them (few files: more room than q8_0's 3 times).
BLOCK_SCALE_LOG2: dict[int, float] = {
    TypeId.Q8_0: 0.085,
    TypeId.Q4_0: 0.5,
    TypeId.Q4_1: 0.25,
    TypeId.Q5_0: 0.25,
    TypeId.Q5_1: 0.25,
    TypeId.IQ4_NL: 0.25,
}
CLEAN_BLOCK_LOG2: dict[int, float] = {
    TypeId.Q8_0: 0.028,
    TypeId.Q4_0: 0.184,
    TypeId.Q4_1: 0.020,
    TypeId.Q5_0: 0.034,
    TypeId.Q5_1: 0.009,
    TypeId.IQ4_NL: 0.065,
}
BLOCK_QUANT_STEPS: dict[int, int] = {TypeId.Q8_0: 4, TypeId.Q4_0: 2}
MIN_QUANTS = 4


def flipped_block(a: LayerRun, b: LayerRun, b_cells: np.ndarray | None = None) -> Spike | None:
    """The quantized block of run ``a`` whose raw bytes differ from the recomputed block's as one
    flipped bit does and drift does not (:func:`block_changes`): every quant the same (q8_0: or
    re-rounded by a step) and the scale negated or scaled by :data:`BLOCK_SCALE_LOG2` octaves or
    more (a block of :data:`MIN_QUANTS` quants off zero or more), or the scale the same and one
    quant :data:`BLOCK_QUANT_STEPS` steps or more off; first, in any block type whose scale comes
    first (q4_1, q5_0, q5_1, iq4_nl too), the one block of an otherwise exact layer whose scale
    alone moved (:func:`_lone_scale`).  None: no such block."""
    lone = _lone_scale(a, b, b_cells)
    if lone is not None:
        return lone
    ratios, steps = block_changes(a, b, b_cells)
    if not ratios.size:
        return None
    with np.errstate(all="ignore"):
        octaves = np.abs(np.log2(np.abs(ratios)))
    octaves = np.where(np.isfinite(ratios), octaves, 0.0)
    limit = BLOCK_SCALE_LOG2[a.type_id]
    scale_score = np.where(ratios < 0, 1.0 + octaves, octaves) / limit
    scale_score = np.where((ratios < 0) | (octaves >= limit), scale_score, 0.0)
    quant_score = steps / BLOCK_QUANT_STEPS.get(a.type_id, 1)  # 0 steps but for q8_0/q4_0
    quant_score = np.where(quant_score >= 1.0, quant_score, 0.0)
    score = np.maximum(scale_score, quant_score)
    if not (score > 0).any():
        return None
    c, k = (int(i) for i in np.unravel_index(int(np.argmax(score)), score.shape))
    if scale_score[c, k] >= quant_score[c, k]:
        r = float(ratios[c, k])
        what = (
            f"every quant of its block as recomputed{' or one step off' if a.type_id == TypeId.Q8_0 else ''} and "
            f"the block's scale {r:.4g} times the "
            f"recomputed one (clean files: within {2.0 ** CLEAN_BLOCK_LOG2[a.type_id]:.3g} times)"
        )
    else:
        what = (
            f"the block's scale as recomputed bit for bit and this one quant {int(steps[c, k])} steps off "
            "(clean files: one step)"
        )
    return _block_spike(a, b, b_cells, c, k, float(score[c, k]), what)


def _block_spike(
    a: LayerRun,
    b: LayerRun,
    b_cells: np.ndarray | None,
    c: int,
    k: int,
    ratio: float,
    signature: str,
    exact: bool = False,
) -> Spike:
    """The :class:`Spike` of block ``k`` of cell ``c`` that a raw-block rule claims (limit 1), at
    the block's value that moved most; ``exact``: every other block of the layer is the recompute's."""
    bs = block_size(a.type_id)
    x = dequant_rows(a, c, c + 1)[0, k * bs : (k + 1) * bs]
    y = dequant_rows(b, c, c + 1, b_cells)[0, k * bs : (k + 1) * bs]
    i = int(np.argmax(np.abs(x - y)))
    return Spike(
        cell=c,
        element=k * bs + i,
        ratio=ratio,
        diff=float(abs(x[i] - y[i])),
        stored=float(x[i]),
        recomputed=float(y[i]),
        head_rest=0.0,
        cells_rest=0.0,
        resolution=float(np.max(np.abs(y))) / _QMAX[a.type_id],
        block=bs,
        limit=1.0,
        exact=exact,
        alone=exact,
        signature=signature,
    )


# In a layer the recompute matches bit for bit but for one block, that block's scale this many f16
# steps (ulps) off with every quant the same is a flipped mantissa bit (bit 2 and up): with every
# other value equal, a scale rounds to a neighbouring f16 at most (one re-rounded value of a whole
# exact layer is what clean files show: a DeepSeek2 K quant, one step).
EXACT_SCALE_ULPS = 4


def _lone_scale(a: LayerRun, b: LayerRun, b_cells: np.ndarray | None) -> Spike | None:
    """The one block of a layer of blocks whose f16 scale comes first (the types of
    :data:`BLOCK_SCALE_LOG2`) that differs from the recompute, when it differs only in its scale, by
    :data:`EXACT_SCALE_ULPS` f16 steps or more with its sign (a flipped low mantissa bit of the
    scale: a change under one quantization step, under any noise limit)."""
    t = a.type_id
    if t not in BLOCK_SCALE_LOG2 or a.transposed or a.n_cells == 0 or a.row_size % TYPES[t].type_size:
        return None
    bb = TYPES[t].type_size
    ra, rb = a.array(), b.array()
    if b_cells is not None:
        rb = rb[b_cells]
    xa, xb = ra.reshape(a.n_cells, -1, bb), rb.reshape(a.n_cells, -1, bb)
    diff = (xa != xb).any(axis=-1)
    if int(diff.sum()) != 1:
        return None
    c, k = (int(i) for i in np.argwhere(diff)[0])
    if (xa[c, k, 2:] != xb[c, k, 2:]).any():
        return None  # a quant differs: the noise and step rules judge it
    sa, sb = (int(np.frombuffer(x[c, k, :2].tobytes(), np.int16)[0]) for x in (xa, xb))
    if (sa < 0) != (sb < 0) or abs(sa - sb) < EXACT_SCALE_ULPS:
        return None  # a sign flip is the scale rule's; a step or two, rounding
    signature = (
        f"the only block of the layer that differs from the recompute, in its scale alone, {abs(sa - sb)} f16 "
        f"steps off (limit {EXACT_SCALE_ULPS})"
    )
    return _block_spike(a, b, b_cells, c, k, abs(sa - sb) / EXACT_SCALE_ULPS, signature, exact=True)


def block_changes(a: LayerRun, b: LayerRun, b_cells: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """For a q8_0/q4_0 run ``a`` against the recomputed ``b`` (``b_cells`` as in :func:`find_spike`),
    per block (cells, blocks): the ratio of the stored scale to the recomputed one where every quant
    is the same (q8_0: or one step off, re-rounded) and the scale is not, in blocks of
    :data:`MIN_QUANTS` quants off zero or more (NaN elsewhere), and the largest quant difference in
    steps where the scale is the same bit for bit and exactly one quant differs (0 elsewhere).  For
    q4_1, q5_0, q5_1 and iq4_nl, the ratio where every byte after the scale is the recomputed one's,
    in blocks whose recomputed values reach the scale :data:`MIN_QUANTS` times, and no steps.
    Empty arrays for any other type or a transposed run."""
    t, n = a.type_id, a.n_cells
    if t not in BLOCK_SCALE_LOG2 or a.transposed or n == 0 or a.row_size % TYPES[t].type_size:
        return np.zeros((0, 0)), np.zeros((0, 0))
    bb = TYPES[t].type_size
    ra, rb = a.array(), b.array()
    ratios, steps = [], []
    for c0 in range(0, n, CHUNK_CELLS):
        c1 = min(n, c0 + CHUNK_CELLS)
        xa = ra[c0:c1].reshape(c1 - c0, -1, bb)
        xb = (rb[c0:c1] if b_cells is None else rb[b_cells[c0:c1]]).reshape(c1 - c0, -1, bb)
        da = np.ascontiguousarray(xa[..., :2]).view(np.float16)[..., 0].astype(np.float64)
        db = np.ascontiguousarray(xb[..., :2]).view(np.float16)[..., 0].astype(np.float64)
        same_d = (xa[..., 0] == xb[..., 0]) & (xa[..., 1] == xb[..., 1])
        if t not in BLOCK_QUANT_STEPS:
            # every byte after the scale the same (a minimum m, fifth bits, quants or table indices),
            # the scale not, in a block whose recomputed values reach its scale MIN_QUANTS times
            yb = dequant_rows(b, c0, c1, b_cells).reshape(c1 - c0, -1, 32)
            big = (np.abs(yb) >= np.abs(db)[..., None]).sum(axis=-1) >= MIN_QUANTS
            same_rest = (xa[..., 2:] == xb[..., 2:]).all(axis=-1)
            with np.errstate(all="ignore"):
                ratios.append(np.where(same_rest & ~same_d & (db != 0) & big, da / db, np.nan))
            steps.append(np.zeros(da.shape))
            continue
        qa, qb = _quants(xa, t), _quants(xb, t)
        ndiff = (qa != qb).sum(axis=-1)
        # q8_0: every quant the same or re-rounded by a step; q4_0, whose steps are an eighth of the
        # block's largest value, every quant the same (a 4-slot v4 server's q4_0 blocks re-rounded by
        # a step had scales up to 1.82 times apart against the portable library)
        same_q = np.abs(qa - qb).max(axis=-1) <= (1 if t == TypeId.Q8_0 else 0)
        with np.errstate(all="ignore"):
            r = np.where(same_q & ~same_d & (db != 0) & ((qb != 0).sum(axis=-1) >= MIN_QUANTS), da / db, np.nan)
        ratios.append(r)
        steps.append(np.where(same_d & (ndiff == 1), np.abs(qa - qb).max(axis=-1), 0))
    return np.concatenate(ratios), np.concatenate(steps)
