"""The numpy statistics of the deep level: a file's rows against recomputed rows, per cell.

Rows are dequantized to float64 a chunk of :data:`CHUNK_CELLS` cells at a time (bounded
memory on big files; gguf-py's ``gguf.quants`` for the quantized types).  Per cell, each head
vector of the stored row is compared with the recomputed one: the angle between them and the
log of their norm ratio (:class:`CellStats`); :class:`RowStats` is the worst cell of each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from slotfile.format.records import LayerRun
from slotfile.format.types import TypeId

FLOAT_TYPES = (TypeId.F32, TypeId.F16, TypeId.BF16)
# A float zero run counts the values the recompute holds over this size: f16's smallest normal.
# No writer rounds such a value to an exact zero (a value rounds to an f16 zero below 2^-25, and a
# kernel that flushes subnormals zeroes only values under 2^-14), so a stored zero there is a
# zeroed byte; what the recompute holds below it a writer may well store as zero.
ZERO_SIGNIFICANT = 2.0**-14
EIGHT_BIT = (TypeId.Q8_0, TypeId.Q8_1)
CHUNK_CELLS = 4096  # cells dequantized at a time (bounded memory on big files)


def tolerance_class(type_id: int) -> str:
    """The tolerance a cache type gets: float, 8-bit or low-bit (the minimum floors)."""
    if type_id in FLOAT_TYPES:
        return "float"
    if type_id in EIGHT_BIT:
        return "8-bit"
    return "low-bit"


def dequant_rows(run: LayerRun, c0: int, c1: int, cells: np.ndarray | None = None) -> np.ndarray:
    """Cells c0..c1 of a run as float64 (cells, elements); with ``cells`` (an index array), the
    cells ``cells[c0:c1]`` instead (a recompute whose cells lie in another order)."""
    t = run.type_id
    sel: slice | np.ndarray = slice(c0, c1) if cells is None else cells[c0:c1]
    if run.n_cells == 0 or run.row_size == 0:
        return np.zeros((c1 - c0, 0))
    if run.transposed:
        a = run.array()[:, sel]
        a = (a.astype(np.uint32) << 16).view(np.float32) if t == TypeId.BF16 else a
        return np.asarray(a, dtype=np.float64).T
    if t in (TypeId.F32, TypeId.F16):
        return np.asarray(run.array()[sel], dtype=np.float64)
    if t == TypeId.BF16:
        return (run.array()[sel].astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    import gguf.quants as gq
    from gguf import GGMLQuantizationType

    raw = run.data.array(np.uint8).reshape(run.n_cells, run.row_size)[sel]
    return gq.dequantize(np.ascontiguousarray(raw), GGMLQuantizationType(t)).astype(np.float64).reshape(c1 - c0, -1)


def median(a: np.ndarray | list[float]) -> float:
    """``np.median`` of the values (NaN if any is NaN, NaN for none), without its first call's
    import of numpy.ma (``_median_nancheck``: ~20 ms, on the deep check's critical path)."""
    v = np.asarray(a, dtype=np.float64).ravel()
    if not v.size or np.isnan(v).any():
        return float("nan")
    k = v.size // 2
    if v.size % 2:
        return float(np.partition(v, k)[k])
    p = np.partition(v, (k - 1, k))
    return float((p[k - 1] + p[k]) / 2)


def nanmedian(a: np.ndarray) -> float:
    """``np.nanmedian`` of the values (NaN when all are NaN), as :func:`median`."""
    v = np.asarray(a, dtype=np.float64).ravel()
    return median(v[~np.isnan(v)])


LNORM_CAP = 10.0  # |ln(norm ratio)| given for a head whose norm is zero on one side only
TINY = 1e-20


@dataclass
class CellStats:
    """Per-cell statistics of a file run against a recomputed run.

    ``angle``: per cell, the largest angle in degrees between a stored and a recomputed head
    vector; ``lnorm``: the largest ``|ln(||stored head|| / ||recomputed head||)|``; ``rel``:
    ``||stored row - recomputed row|| / max norm`` (reported as ``worst_cell_rel``; not judged:
    one relative norm cannot tell a rounding difference from a wrong head); ``emax``: the
    largest single-element difference (the view that sees one flipped exponent, which a head
    angle over 256 elements dilutes).  ``zero_run``: the longest run, in the file's byte order,
    of stored values that are exactly zero where the recompute's are not (a float type's: where
    they are over :data:`ZERO_SIGNIFICANT`; a zeroed sector, page or a few values), starting
    at element ``zero_at`` (cell, element)."""

    angle: np.ndarray
    lnorm: np.ndarray
    rel: np.ndarray
    emax: np.ndarray = field(default_factory=lambda: np.zeros(0))
    max_abs: float = 0.0
    layer_rel: float = 0.0
    first_bad: int = -1  # first cell with a non-finite stored value
    ymax: float = 0.0  # the recompute's largest |value| in the layer (the element floor's scale)
    zero_run: int = 0
    zero_at: tuple[int, int] = (-1, -1)

    def summary(self, cells: np.ndarray | None = None) -> RowStats:
        """The worst cell of each statistic and the median angle, over ``cells`` (default all)."""
        idx = np.arange(self.angle.size) if cells is None else np.asarray(cells)
        st = RowStats(max_abs=self.max_abs, layer_rel=self.layer_rel, finite=self.first_bad < 0)
        st.first_bad = self.first_bad
        if not idx.size:
            return st
        for name, arr in (("angle", self.angle), ("lnorm", self.lnorm), ("rel", self.rel)):
            i = int(idx[int(np.argmax(arr[idx]))])
            setattr(st, name, float(arr[i]))
            setattr(st, f"{name}_cell", i)
        st.median_angle = median(self.angle[idx])
        if self.emax.size:
            i = int(idx[int(np.argmax(self.emax[idx]))])
            st.emax, st.emax_cell = float(self.emax[i]), i
        st.ymax = self.ymax
        return st


@dataclass
class RowStats:
    """The worst cell of each :class:`CellStats` statistic (and its cell), the median angle."""

    angle: float = 0.0
    angle_cell: int = -1
    lnorm: float = 0.0
    lnorm_cell: int = -1
    rel: float = 0.0
    rel_cell: int = -1
    median_angle: float = 0.0
    max_abs: float = 0.0
    layer_rel: float = 0.0
    finite: bool = True
    first_bad: int = -1
    emax: float = 0.0
    emax_cell: int = -1
    ymax: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def hadamard(n: int) -> np.ndarray:
    """The orthonormal Walsh-Hadamard matrix llama.cpp rotates quantized K/V with
    (``ggml_gen_hadamard``, src/llama-kv-cache.cpp; symmetric, its own inverse)."""
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def _head_stats(x: np.ndarray, y: np.ndarray, head: int) -> tuple[np.ndarray, np.ndarray]:
    """Per cell: the largest head angle (degrees) and the largest |ln norm ratio|."""
    c = x.shape[0]
    hs = head if head > 0 and x.shape[1] % head == 0 else x.shape[1]
    xh, yh = x.reshape(c, -1, hs), y.reshape(c, -1, hs)
    nx, ny = np.linalg.norm(xh, axis=2), np.linalg.norm(yh, axis=2)
    zx, zy = nx <= TINY, ny <= TINY
    cos = np.einsum("chk,chk->ch", xh, yh) / np.maximum(nx * ny, TINY * TINY)
    ang = np.degrees(np.arccos(np.clip(cos, -1.0, 1.0)))
    ang = np.where(zx & zy, 0.0, np.where(zx | zy, 90.0, ang))
    ln = np.abs(np.log(np.maximum(nx, TINY) / np.maximum(ny, TINY)))
    ln = np.where(zx & zy, 0.0, np.where(zx | zy, LNORM_CAP, np.minimum(ln, LNORM_CAP)))
    return np.max(ang, axis=1), np.max(ln, axis=1)


def _zero_run(x: np.ndarray, y: np.ndarray, transposed: bool, at_least: float = 0.0) -> tuple[int, int]:
    """The run, in byte order, of exact zeros in ``x`` that holds the most values where ``|y|`` is
    over ``at_least`` (:data:`ZERO_SIGNIFICANT` for a float type, 0: not zero): (that count, flat
    index of the run's start in that order).  The recompute's own zeros (or small values) inside
    the run do not end it: a quantized cache holds exact zeros (q4_0: about one
    value in 16, a quant of 8), so counting only consecutive "zero where the recompute is not"
    cut a zeroed q4_0 row of 256 values into runs under :data:`~slotfile.verify.judge.ZERO_RUN`.
    A transposed V stores each element's values of all cells together
    (``llama_kv_cache::state_write_data``), so its byte order is element-major."""

    def in_byte_order(a: np.ndarray) -> np.ndarray:
        return (a.T if transposed else a).ravel()

    flat = in_byte_order(x == 0)
    if not flat.any():
        return 0, -1
    counts = np.concatenate(([0], np.cumsum(in_byte_order(np.abs(y) > at_least), dtype=np.int64)))
    d = np.diff(np.concatenate(([0], flat.view(np.int8), [0])))
    starts, ends = np.flatnonzero(d == 1), np.flatnonzero(d == -1)
    held = counts[ends] - counts[starts]  # values in each run where the recompute is not zero
    k = int(np.argmax(held))
    return (int(held[k]), int(starts[k])) if held[k] else (0, -1)


def cell_stats(
    a: LayerRun,
    b: LayerRun,
    head: int = 0,
    rotate: int = 0,
    b_cells: np.ndarray | None = None,
    a_cells: np.ndarray | None = None,
) -> CellStats:
    """File run ``a`` against recomputed run ``b`` (same cells, same type), in chunks of cells.
    ``head``: elements per head (0: the whole row is one head); ``rotate``: apply llama.cpp's
    Hadamard rotation of this width to ``b`` first (comparing against the other rotation
    setting: the rotation is its own inverse); ``b_cells``: the cell of ``b`` for each cell of
    ``a`` (the recompute placed them in another order; None: the same order).  ``a_cells``:
    only these cells of ``a`` (``b_cells`` then gives ``b``'s cell for each of them); the
    statistics are indexed by their order in it."""
    n = a.n_cells if a_cells is None else len(a_cells)
    if a_cells is not None and b_cells is None:
        b_cells = a_cells
    st = CellStats(np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n))
    ss_d = ss_b = 0.0
    h_mat = hadamard(rotate) if rotate else None
    for c0 in range(0, n, CHUNK_CELLS):
        c1 = min(n, c0 + CHUNK_CELLS)
        x, y = dequant_rows(a, c0, c1, a_cells), dequant_rows(b, c0, c1, b_cells)
        if not x.size:
            continue
        if h_mat is not None and y.shape[1] % rotate == 0:
            y = (y.reshape(c1 - c0, -1, rotate) @ h_mat).reshape(c1 - c0, -1)
        ok = np.isfinite(x).all(axis=1)
        if not ok.all():
            if st.first_bad < 0:
                st.first_bad = c0 + int(np.flatnonzero(~ok)[0])
            x = np.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
        d = x - y
        ad = np.abs(d)
        st.emax[c0:c1] = np.max(ad, axis=1)
        st.ymax = max(st.ymax, float(np.max(np.abs(y))))
        run, at = _zero_run(x, y, a.transposed, ZERO_SIGNIFICANT if a.type_id in FLOAT_TYPES else 0.0)
        if run > st.zero_run:
            cells_in = c1 - c0
            cell, el = (at % cells_in, at // cells_in) if a.transposed else divmod(at, x.shape[1])
            st.zero_run, st.zero_at = run, (c0 + cell, el)
        st.max_abs = max(st.max_abs, float(np.max(ad)))
        ss_d += float(np.sum(d * d))
        ss_b += float(np.sum(y * y))
        den = np.maximum(np.maximum(np.linalg.norm(x, axis=1), np.linalg.norm(y, axis=1)), 1e-30)
        st.rel[c0:c1] = np.linalg.norm(d, axis=1) / den
        st.angle[c0:c1], st.lnorm[c0:c1] = _head_stats(x, y, head)
    st.layer_rel = (ss_d**0.5) / (ss_b**0.5) if ss_b > 0 else (0.0 if ss_d == 0 else float("inf"))
    return st


def compare_rows(a: LayerRun, b: LayerRun, head: int = 0, rotate: int = 0) -> RowStats:
    """:func:`cell_stats` summarised over every cell."""
    return cell_stats(a, b, head, rotate).summary()
