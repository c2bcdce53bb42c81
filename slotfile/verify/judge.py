"""The deep level's judgment of each layer: the file's rows against the recompute (state A),
against the noise floor between A and the same recompute with its last :data:`STEPWISE_TOKENS`
tokens decoded one per call (state B), as the server decodes generated tokens.

Per layer, the worst head angle, the worst head norm ratio and the median head angle of the
stored rows against A are each divided by the floor from A against B (raised to
:data:`MIN_FLOOR` for the cache type); a layer fails above :data:`MARGIN_LIMIT` floors.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from slotfile.format.records import Body, CacheExpect, LayerRun, MemoryBlock, MemoryKind, ModelExpect
from slotfile.format.types import TypeId
from slotfile.model.expect import rotation_widths
from slotfile.problems import ProblemCode
from slotfile.verify.records import Level
from slotfile.verify.spikes import Spike, block_size, find_spike, spike_message
from slotfile.verify.stats import FLOAT_TYPES, CellStats, RowStats, cell_stats, tolerance_class

Caches = dict[str, CacheExpect]  # a model's KV caches by block role ("kv", "kv-base", "kv-swa", ...)


def caches_of(expect: ModelExpect | None) -> Caches:
    """The KV caches of the model's expected state, by block role (empty: no expectation; every
    row is then compared as one head)."""
    if expect is None:
        return {}
    return {b.role: b for b in (*expect.blocks, *expect.partial_blocks) if isinstance(b, CacheExpect)}


def head_size(cache: CacheExpect | None, part: str) -> int:
    """Elements per head of a K or V row of ``cache``: ``n_embd_head_k_all`` / ``_v_all``, the
    size all its layers share (0: unknown or mixed; the whole row is compared as one head)."""
    if cache is None:
        return 0
    return max(cache.head_k if part == "K" else cache.head_v, 0)


def rotation_width(cache: CacheExpect | None, part: str, type_id: int) -> int:
    """The Hadamard rotation width llama.cpp applies to this part of ``cache`` when rotation is
    on (:func:`slotfile.model.expect.rotation_widths`; 0: none)."""
    if cache is None:
        return 0
    n_rot_k, n_rot_v = rotation_widths(cache, type_id, type_id, disabled=False)
    return n_rot_k if part == "K" else n_rot_v


# The smallest noise floor per cache type (bench/deep_noise.py): what re-rounding into the
# type alone does to a head.  A floor from two recomputes that agree exactly (every
# committed tiny fixture; layers before the first difference) must not turn a last-bit
# difference into a failure.
# "element": the smallest floor of the largest single-element difference, as a fraction of the
# layer's largest recomputed |value|: 8 f16 steps at the top of the range, two q8_0 steps, two
# q4_0 steps (a layer whose floor recomputes agree exactly: every tiny fixture, the first layers).
MIN_FLOOR = {
    "float": {"angle": 0.5, "lnorm": 0.03, "median": 0.05, "element": 2.0**-7},
    "8-bit": {"angle": 2.0, "lnorm": 0.05, "median": 0.5, "element": 2.0 / 64},
    "low-bit": {"angle": 10.0, "lnorm": 0.1, "median": 3.0, "element": 2.0 / 7},
}
# A run of stored values, in byte order, exactly zero and holding at least this many values where
# the recompute's are not, is damage whatever the floors say (a zeroed 512-byte sector holds 256
# f16 values; stats._zero_run).  A quantized cache holds exact zeros of its own (a q4_0 quant of
# 8, one value in 16), so it takes ZERO_RUN; a float one ZERO_RUN_FLOAT, counting only recomputed
# values over 2^-14 (stats.ZERO_SIGNIFICANT): 16 zeroed bytes hold 7-8 f16 values, and
# clean real-server files show such runs of one value at most (2026-12-07: every comparison deep
# made on 84 v3/v4 Gemma 3 f16 files, 16 of them with one, and 311 fixture-model files with f16
# K/V and f32 R/S, none; bench/detect-zero-runs.md).
# f32 and bf16, with f32's 8-bit exponent, round nothing over 2^-126 to zero, so ZERO_RUN_WIDE: 2
# such values claim 16 zeroed bytes of f32 wherever they start (3 whole values where unaligned: 4
# missed both such spans of bench/detect-cache-types.md); every comparison deep made on 16 v3/v4
# Gemma 3 files with f32 and bf16 caches (2026-12-07) and on the 311 fixture-model files' f32 R/S
# showed no such value at all.
ZERO_RUN = 32
ZERO_RUN_FLOAT = 4
ZERO_RUN_WIDE = 2


def zero_run_limit(type_id: int) -> int:
    """The zero run (:func:`slotfile.verify.stats._zero_run`) that is damage in a run of this type."""
    if type_id in (TypeId.F32, TypeId.BF16):
        return ZERO_RUN_WIDE
    return ZERO_RUN_FLOAT if type_id in FLOAT_TYPES else ZERO_RUN


MARGIN_LIMIT = 4.0  # a layer fails when a statistic is more than this many noise floors
# A cell whose head norm is off the recompute's this many times more (in |ln(norm ratio)|) than
# any other cell's of its layer, beyond MARGIN_LIMIT floors, while its direction is no outlier:
# a scaled row, damage in that cell's bytes.  Drift turns a vector as much as it stretches it and
# moves every cell after its onset (an AVX-512 server's file against an AVX2 library: one K row
# scaled by 2 gives ln 2 = 0.69 in its cell, every other cell of the layer at most 0.011, its
# angle 2.1 degrees like the drifting cells around it; it passed as drift).
SCALED_STANDOUT = 8.0
SCALED_MIN_LNORM = 0.2  # and its length off by at least 22 % (a factor e^0.2): no rounding does that
LOGITS_MIN_FLOOR = {"float": 0.01, "8-bit": 0.03, "low-bit": 0.15}
# The last tokens the recompute decodes again one per llama_decode call, as the server decodes
# generated tokens: that state's difference from the prefill is the noise floor.
STEPWISE_TOKENS = 32
# what --json shows as "tolerances": how the deep level judges ("tail": STEPWISE_TOKENS)
DEEP_JUDGMENT = {
    "limit": MARGIN_LIMIT,
    "min_floor": MIN_FLOOR,
    "logits_min_floor": LOGITS_MIN_FLOOR,
    "tail": STEPWISE_TOKENS,
}


def judge_run(s: RowStats, f: RowStats | None, tol_class: str) -> dict[str, Any]:
    """One layer: the stored-vs-recomputed statistics ``s`` against the noise floor ``f`` (the
    recompute against its last tokens decoded one per call), each raised to the type's minimum."""
    mf = MIN_FLOOR[tol_class]
    fl = {
        "angle": max(f.angle if f else 0.0, mf["angle"]),
        "lnorm": max(f.lnorm if f else 0.0, mf["lnorm"]),
        # the median over all cells against the worst single-token drift: stored generated cells
        # carry their context's drift too (median 1.5x the stepwise tokens' in bench/deep_noise.json)
        "median": max(f.angle if f else 0.0, mf["median"]),
        # one element against the largest single-element noise of the layer
        "element": max(f.emax if f else 0.0, mf["element"] * s.ymax, 1e-30),
    }
    ratios = {
        "angle": s.angle / fl["angle"],
        "lnorm": s.lnorm / fl["lnorm"],
        "median": s.median_angle / fl["median"],
        "element": s.emax / fl["element"],
    }
    by = max(ratios, key=lambda k: ratios[k])
    return {
        "angle": round(s.angle, 4),
        "lnorm": round(s.lnorm, 5),
        "median_angle": round(s.median_angle, 4),
        "element": round(s.emax, 6),
        "rel": round(s.rel, 5),
        "floor": {k: round(v, 5) for k, v in fl.items()},
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
        "ratio": round(ratios[by], 3),
        "by": by,
        "cell": {"angle": s.angle_cell, "lnorm": s.lnorm_cell, "median": s.angle_cell, "element": s.emax_cell}[by],
    }


def _stepwise_cells(pos: np.ndarray | None, n_cells: int, n_tokens: int, n_stepwise: int) -> np.ndarray:
    """The cells of the last ``n_stepwise`` tokens (those the floor state decoded one per call)."""
    if not n_stepwise:
        return np.arange(0)
    if pos is None:  # a recurrent state: one cell, the state after the last token
        return np.arange(n_cells)
    return np.flatnonzero(pos[:n_cells] >= n_tokens - n_stepwise)


def holds_every_position(pos: np.ndarray, n: int) -> bool:
    """Whether the cells hold positions ``0..n-1``, each once, in any order (a unified cache
    shared by concurrent slots gives a slot's later positions whatever cells are free,
    ``llama_kv_cache::find_slot``, and the file keeps cell order)."""
    return pos.size == n and np.array_equal(np.sort(pos), np.arange(n))


def align_cells(want: np.ndarray | None, have: np.ndarray | None) -> np.ndarray | None:
    """For each position of ``want``, the cell of ``have`` holding it (None: the same order, or
    no positions).  The server's prompt split decides where a sliding-window cache's ring puts
    each position (``llama_kv_cache::find_slot``), so a recompute can hold the same positions in
    other cells; callers check the sets are equal (:func:`_cells_differ`) first."""
    if want is None or have is None or np.array_equal(want, have):
        return None
    order = np.argsort(have, kind="stable")
    return order[np.searchsorted(have, want, sorter=order)]


def judge_body(
    file_body: Body,
    rec_a: Body,
    rec_b: Body | None,
    caches: Caches | None = None,
    n_tokens: int = 0,
    n_stepwise: int = 0,
) -> dict[str, Any]:
    """Every K/V layer of ``file_body`` against recompute ``rec_a``, the floor from ``rec_a``
    against ``rec_b`` over its last ``n_stepwise`` positions (bench/deep_noise.py); ``caches``:
    the model's caches by role, for the head sizes (:func:`head_size`).  The same judgment as
    :func:`compare_bodies`, without a :class:`Level`: {"margin", "worst", "layers", "problems"}."""
    j = judge_layers(file_body, rec_a, DeepInputs(rec_b, caches or {}, n_tokens, n_stepwise))
    worst = max(j.rows, key=lambda r: r["ratio"], default=None)
    probs = [{"code": str(c), "section": s, "offset": o, "message": m} for c, s, o, m in j.problems]
    return {"margin": worst["ratio"] if worst else 0.0, "worst": worst, "layers": j.rows, "problems": probs}


def layer_pairs(
    fb: MemoryBlock, rb: MemoryBlock
) -> Iterator[tuple[str, LayerRun | None, LayerRun | None, np.ndarray | None]]:
    """(section, file run, recomputed run, the file's positions) for every layer entry of two blocks."""
    if fb.kind == MemoryKind.KV:
        for fs, rs in zip(fb.streams, rb.streams, strict=False):
            if not fs.cell_count and not rs.cell_count:
                continue
            sec = f"body.{fb.role}.stream[{fs.index}]"
            for part_f, part_r in ((fs.k, rs.k), (fs.v, rs.v)):
                for j in range(max(len(part_f), len(part_r))):
                    yield (
                        sec,
                        part_f[j] if j < len(part_f) else None,
                        part_r[j] if j < len(part_r) else None,
                        fs.positions,
                    )
    else:
        sec = f"body.{fb.role}"
        for part_f, part_r in ((fb.r, rb.r), (fb.p, rb.p), (fb.s, rb.s)):
            for j in range(max(len(part_f), len(part_r))):
                yield sec, part_f[j] if j < len(part_f) else None, part_r[j] if j < len(part_r) else None, None


def _stream_positions(blk: MemoryBlock, sec: str) -> np.ndarray | None:
    """The positions of the stream a :func:`layer_pairs` section names (None: not a KV stream)."""
    if blk.kind != MemoryKind.KV:
        return None
    idx = int(sec.rsplit("[", 1)[1].rstrip("]"))
    return next((s.positions for s in blk.streams if s.index == idx), None)


@dataclass
class DeepInputs:
    """What a layer is judged against: the noise-floor state (the recompute with its last
    ``n_stepwise`` tokens decoded one per call), the model's caches by role (head sizes) and
    the token count."""

    floor_body: Body | None = None
    caches: Caches = field(default_factory=dict)
    n_tokens: int = 0
    n_stepwise: int = 0
    # the floor statistics per (block role, part, layer), once measured: a recompute with
    # another schedule is judged against the first recompute's floor (Judgment.floors)
    floors: dict[tuple[str, str, int], RowStats | None] | None = None
    # the floor-free comparisons of the file with one recompute, made ahead (Precomputed)
    pre: Precomputed | None = None
    # the stored tokens by position (None: not known; the misplaced rule then takes no repeats into account)
    tokens: np.ndarray | None = None


@dataclass
class Compared:
    """One layer of the file against the same layer recomputed, before any noise floor: the
    per-cell statistics and the isolated spike (None: none, or the layer holds non-finite
    values or a run of zeros, which are reported instead)."""

    stats: CellStats
    spike: Spike | None


def compare_layer(fr: LayerRun, rr: LayerRun, head: int, b_cells: np.ndarray | None) -> Compared:
    """``fr`` against ``rr``: :func:`~slotfile.verify.stats.cell_stats`, then
    :func:`~slotfile.verify.spikes.find_spike` where the stored values are finite and hold no
    run of zeros (what :func:`_compare_run` reports first)."""
    cs = cell_stats(fr, rr, head, b_cells=b_cells)
    clean = cs.first_bad < 0 and cs.zero_run < zero_run_limit(fr.type_id)
    return Compared(cs, find_spike(fr, rr, head, b_cells) if clean else None)


_Key = tuple[str, str, int]  # (block role, part, layer)


class Precomputed:
    """Every layer's :class:`Compared` for one file body and one recomputed body, made while the
    loader decodes the noise floor's tokens (:meth:`slotfile.llama.pool.LoaderPool.deep`'s
    ``on_recomputed``): a :func:`judge_layers` without floors, kept for its comparisons; the
    judgment then only has the floors left to apply.  Used only for the bodies it was made
    from (a recompute with another schedule is compared afresh)."""

    def __init__(self, file_body: Body, rec_body: Body, caches: Caches) -> None:
        self.file_body, self.rec_body = file_body, rec_body
        self.layers = judge_layers(file_body, rec_body, DeepInputs(caches=caches)).compared

    def of(self, file_body: Body, rec_body: Body) -> dict[_Key, Compared]:
        """The comparisons made for these two bodies (empty for any other pair)."""
        return self.layers if file_body is self.file_body and rec_body is self.rec_body else {}


def _comparable(fr: LayerRun, rr: LayerRun) -> bool:
    """Rows of the same type, size and orientation (otherwise a layout problem, not a comparison)."""
    return (fr.type_id, fr.row_size, fr.transposed) == (rr.type_id, rr.row_size, rr.transposed)


@dataclass
class RunCells:
    """One layer's judgment per cell, for the shape of the difference
    (:mod:`slotfile.verify.shape`): the file's positions of its cells and, per cell, the
    largest of its ratios to the floors (head angle, head norm, single element)."""

    block: str
    part: str
    layer: int
    positions: np.ndarray | None
    ratio: np.ndarray
    # the layer's own ratio (its report row's): a recurrent state's one cell fails by the median
    # head angle, which its cell ratios need not reach
    layer_ratio: float = 0.0


Problem = tuple[ProblemCode, str, int | None, str]


@dataclass
class Judgment:
    """Every layer of a file against one recompute: the report rows, the problems (not yet in
    a :class:`Level`), the per-cell ratios, and the runs holding values that are damage on any
    recompute (exact zeros where the recompute has values, non-finite values)."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    cells: list[RunCells] = field(default_factory=list)
    byte_damage: list[str] = field(default_factory=list)  # one line per run
    # the isolated spikes and scaled rows among byte_damage: (index of the run in ``cells``, the
    # cell's position)
    spikes: list[tuple[int, int | None]] = field(default_factory=list)
    floors: dict[tuple[str, str, int], RowStats | None] = field(default_factory=dict)
    compared: dict[_Key, Compared] = field(default_factory=dict)  # per layer, before any floor

    @property
    def margin(self) -> float:
        return max((r["ratio"] for r in self.rows), default=0.0)

    def commit(self, lv: Level) -> None:
        for code, sec, off, msg in self.problems:
            lv.error(code, sec, off, msg)


def compare_bodies(
    lv: Level, file_body: Body, rec_body: Body, inputs: DeepInputs | None = None
) -> list[dict[str, Any]]:
    """Per-layer statistics of the file's state against the recomputed one, each against the
    noise floor (:func:`judge_run`); problems into ``lv`` (:func:`judge_layers` without the
    per-cell detail)."""
    j = judge_layers(file_body, rec_body, inputs)
    j.commit(lv)
    return j.rows


def judge_layers(file_body: Body, rec_body: Body, inputs: DeepInputs | None = None) -> Judgment:
    """Every layer of ``file_body`` against ``rec_body`` (cells matched by position), each
    statistic against the noise floor from ``inputs.floor_body``: a :class:`Judgment`."""
    inp = inputs or DeepInputs()
    out = Judgment()
    if rec_body.layout is None or file_body.layout is None:
        msg = "the recomputed state does not parse"
        out.problems.append((ProblemCode.DEEP_INTERNAL, "body", file_body.offset, msg))
        return out
    if file_body.layout.kinds != rec_body.layout.kinds:
        msg = f"the file holds {file_body.layout.describe()}; recomputing gives {rec_body.layout.describe()}"
        out.problems.append((ProblemCode.DEEP_LAYOUT, "body", file_body.offset, msg))
        return out
    floors = _floor_runs(rec_body, inp.floor_body)
    done = inp.pre.of(file_body, rec_body) if inp.pre is not None else {}
    for fb, rb in zip(file_body.blocks, rec_body.blocks, strict=False):
        if _cells_differ(out.problems, fb, rb):
            continue  # different cells: a row-by-row comparison means nothing
        for sec, fr, rr, pos in layer_pairs(fb, rb):
            if fr is None or rr is None:
                run = fr or rr
                assert run is not None  # layer_pairs yields at least one side
                msg = f"{run.part} layer {run.index} present in only one of file and recomputed state"
                out.problems.append((ProblemCode.DEEP_LAYOUT, sec, fr.offset if fr else None, msg))
            elif not _comparable(fr, rr):
                msg = (
                    f"{fr.part} layer {fr.index}: {fr.type_name} rows of "
                    f"{fr.row_size} B; the recomputed state has {rr.type_name} rows of {rr.row_size} B"
                )
                out.problems.append((ProblemCode.DEEP_LAYOUT, sec, fr.offset, msg))
            else:
                key = (fb.role, rr.part, rr.index)
                runs = (fr, rr, done.get(key))
                _compare_run(out, inp, (sec, fb.role), runs, (pos, _stream_positions(rb, sec)), floors.get(key))
    return out


_Floor = tuple[LayerRun, np.ndarray | None, np.ndarray | None]  # floor run, its positions, the recompute's
_Floors = dict[tuple[str, str, int], _Floor]


def _floor_runs(rec_body: Body, floor_body: Body | None) -> _Floors:
    """The noise-floor state's run, its positions and the recompute's, for each (block role,
    part, layer) of the recomputed state."""
    floors: _Floors = {}
    if floor_body is not None and floor_body.layout is not None:
        for rb, bb in zip(rec_body.blocks, floor_body.blocks, strict=False):
            for sec, ar, br, apos in layer_pairs(rb, bb):
                if ar is not None and br is not None and ar.n_cells == br.n_cells:
                    floors[(rb.role, ar.part, ar.index)] = (br, _stream_positions(bb, sec), apos)
    return floors


def window_edge_given_away(role: str, pos: np.ndarray, rec_pos: np.ndarray) -> bool:
    """Whether a sliding-window stream holds the recompute's window but its oldest cell.  The
    state writer saves a sequence's cells that are not SWA-masked against its last position
    (``llama_kv_cache::state_write``: ``p > pos_max - n_swa``), but ``find_slot`` may hand a cell
    masked against the position the sequence decodes next (``p <= pos_max + 1 - n_swa``) to
    another sequence: in a cache shared by concurrent slots (unified), the window's oldest cell
    can be gone before the slot is saved (a v3 4-slot ``-kvu`` server's slot on the tiny Gemma 3
    fixture: positions 230..236 where a recompute holds 229..236).  The next token attends to
    none of it, so the state is whole."""
    if pos.size + 1 != rec_pos.size or not rec_pos.size:
        return False
    r = np.sort(rec_pos)
    window = np.array_equal(r, np.arange(r[0], r[-1] + 1)) and (r[0] > 0 or role == "kv-swa")
    return bool(window and np.array_equal(np.sort(pos), r[1:]))


def _cells_differ(problems: list[Problem], fb: MemoryBlock, rb: MemoryBlock) -> bool:
    """Cell counts or positions of the file's block differ from the recomputed block's (the
    same positions in another order are the same cells): problems appended; True when any."""
    before = len(problems)
    if fb.kind == MemoryKind.KV:
        for fs, rs in zip(fb.streams, rb.streams, strict=False):
            sec = f"body.{fb.role}.stream[{fs.index}]"
            if window_edge_given_away(fb.role, fs.positions, rs.positions):
                continue  # the rows of the cells both hold are compared
            if fs.cell_count != rs.cell_count:
                msg = f"{fs.cell_count} cells; recomputing the tokens gives {rs.cell_count}"
                problems.append((ProblemCode.DEEP_CELLS, sec, fs.offset, msg))
            elif fs.cell_count and not np.array_equal(np.sort(fs.positions), np.sort(rs.positions)):
                msg = "cell positions differ from those of the recomputed state"
                problems.append((ProblemCode.DEEP_POSITIONS, sec, fs.offset, msg))
    elif fb.cell_count != rb.cell_count:
        msg = f"{fb.cell_count} cells; recomputing the tokens gives {rb.cell_count}"
        problems.append((ProblemCode.DEEP_CELLS, f"body.{fb.role}", fb.offset, msg))
    return len(problems) > before


def _floor_stats(rr: LayerRun, floor: _Floor | None, head: int, inp: DeepInputs) -> RowStats | None:
    """The recompute against the floor state over the stepwise cells (cells matched by position)."""
    if floor is None:
        return None
    br, bpos, apos = floor
    cells = _stepwise_cells(apos, rr.n_cells, inp.n_tokens, inp.n_stepwise)
    b_cells = align_cells(apos, bpos)
    # only the stepwise cells: the floor is their worst angle, norm and element (judge_run);
    # the summary's *_cell fields index ``cells``
    return cell_stats(rr, br, head, b_cells=b_cells[cells] if b_cells is not None else None, a_cells=cells).summary()


def _cell_ratios(cs: CellStats, fl: dict[str, float]) -> np.ndarray:
    """Per cell, the largest of its head angle, head norm and element ratios to the floors."""
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.maximum.reduce([cs.angle / fl["angle"], cs.lnorm / fl["lnorm"], cs.emax / fl["element"]])
    return np.nan_to_num(r, nan=0.0, posinf=np.inf)


def _compare_run(
    out: Judgment,
    inp: DeepInputs,
    where: tuple[str, str],
    runs: tuple[LayerRun, LayerRun, Compared | None],
    positions: tuple[np.ndarray | None, np.ndarray | None],
    floor: _Floor | None,
) -> None:
    """One layer's rows of the file against the recomputed ones (``runs``: the file's, the
    recompute's and their :class:`Compared` when made ahead): the layer's report row, its
    per-cell ratios and a problem when the values are not finite, hold a run of zeros, an
    isolated spike (:mod:`slotfile.verify.spikes`) or differ by more than MARGIN_LIMIT noise
    floors."""
    sec, role = where
    fr, rr, cmp = runs
    pos, rpos = positions
    head = head_size(inp.caches.get(role), fr.part)
    cmp = cmp or compare_layer(fr, rr, head, align_cells(pos, rpos))
    key = (role, fr.part, fr.index)
    out.compared[key] = cmp
    cs = cmp.stats
    s_st = cs.summary()
    f_st = inp.floors.get(key) if inp.floors is not None else _floor_stats(rr, floor, head, inp)
    out.floors[key] = f_st
    j = judge_run(s_st, f_st, tolerance_class(fr.type_id))
    cell = j["cell"] if s_st.finite else s_st.first_bad
    p = _cell_position(cell, pos)
    out.rows.append(
        {
            "section": sec,
            "block": role,
            "part": fr.part,
            "layer": fr.index,
            "type": fr.type_name,
            "cells": fr.n_cells,
            "max_abs": s_st.max_abs,
            "rel": s_st.layer_rel,
            "worst_cell_rel": s_st.rel,
            **{k: v for k, v in j.items() if k != "cell"},
            "worst_cell": cell,
            "worst_pos": p,
            "limit": MARGIN_LIMIT,
        }
    )
    out.cells.append(RunCells(role, fr.part, fr.index, pos, _cell_ratios(cs, j["floor"]), float(j["ratio"])))
    off = _cell_offset(fr, cell)
    if not s_st.finite:
        msg = f"{fr.part} layer {fr.index}: non-finite values (first in cell {cell})"
        out.problems.append((ProblemCode.DEEP_NONFINITE, sec, fr.data.offset, msg))
        out.byte_damage.append(f"{sec} {msg}")
    elif cs.zero_run >= zero_run_limit(fr.type_id):
        zc, ze = cs.zero_at
        msg = (
            f"{fr.part} layer {fr.index} ({fr.type_name}): {_cell_label(zc, pos)} element {ze} starts a run of "
            f"stored values (file byte order) that are exactly zero, {cs.zero_run} of them where the recompute's are "
            f"not: zeroed bytes (relative difference {100 * s_st.rel:.3g}%)"
        )
        out.problems.append((ProblemCode.DEEP_MISMATCH, sec, _element_offset(fr, zc, ze), msg))
        out.byte_damage.append(f"{sec} {msg}")
    elif cmp.spike is not None:
        _add_spike(out, sec, fr, cmp.spike, pos)
    elif (scaled := scaled_cell(cs, j["floor"])) is not None:
        sc, standout = scaled
        msg = (
            f"{fr.part} layer {fr.index} ({fr.type_name}): {_cell_label(sc, pos)} points where the recompute's "
            f"does but its length is off by a factor {np.exp(cs.lnorm[sc]):.3g}, {standout:.3g} times (in log) "
            "any other cell's of the layer: a scaled row (damage in that cell's bytes)"
        )
        out.problems.append((ProblemCode.DEEP_MISMATCH, sec, _cell_offset(fr, sc), msg))
        out.byte_damage.append(f"{sec} {msg}")
        # like a spike, a position whose every layer from some depth on differs is that token's
        # computation parting, not one row's bytes (shape._spikes_in_model_space)
        out.spikes.append((len(out.cells) - 1, _cell_position(sc, pos)))
    elif j["ratio"] > MARGIN_LIMIT:
        out.problems.append((ProblemCode.DEEP_MISMATCH, sec, off, _mismatch_message(fr, j, cell, p, s_st.rel)))


def _cell_offset(fr: LayerRun, cell: int) -> int:
    """The file offset of a cell's row (the run's start for a transposed V or no cell)."""
    return fr.data.offset + (cell * fr.row_size if not fr.transposed and cell >= 0 else 0)


def _cell_label(cell: int, pos: np.ndarray | None) -> str:
    """``cell N (position P)``, the position where the file holds one."""
    p = _cell_position(cell, pos)
    return f"cell {cell}" + (f" (position {p})" if p is not None else "")


def _cell_position(cell: int, pos: np.ndarray | None) -> int | None:
    """The position the file holds for ``cell`` (None: no positions, or no such cell)."""
    return int(pos[cell]) if pos is not None and 0 <= cell < len(pos) else None


def scaled_cell(cs: CellStats, floor: dict[str, float]) -> tuple[int, float] | None:
    """The cell whose head norm alone stands out (:data:`SCALED_STANDOUT`): over MARGIN_LIMIT norm
    floors and :data:`SCALED_MIN_LNORM`, that many times any other cell's norm difference, and its
    head angle within the largest of the other cells' (or within MARGIN_LIMIT angle floors):
    (the cell, how many times the next cell's norm difference its own is).  None: no such cell."""
    if cs.lnorm.size < 2:
        return None
    c = int(np.argmax(cs.lnorm))
    top = float(cs.lnorm[c])
    second = float(np.partition(cs.lnorm, -2)[-2])
    if not np.isfinite(top) or top < max(SCALED_MIN_LNORM, MARGIN_LIMIT * floor["lnorm"], SCALED_STANDOUT * second):
        return None
    others = np.delete(cs.angle, c)
    if float(cs.angle[c]) > max(float(others.max()), MARGIN_LIMIT * floor["angle"]):
        return None
    return c, top / max(second, 1e-12)


def _add_spike(out: Judgment, sec: str, fr: LayerRun, sp: Spike, pos: np.ndarray | None) -> None:
    """An isolated spike (:mod:`slotfile.verify.spikes`): damage in the file's bytes at its element,
    with its evidence in the layer's report row (the last one)."""
    p = _cell_position(sp.cell, pos)
    off = _element_offset(fr, sp.cell, sp.element)  # a block: where its scale is
    out.rows[-1]["spike"] = dict(sp.as_dict(), position=p, offset=off)
    msg = spike_message(fr, sp, p)
    out.problems.append((ProblemCode.DEEP_MISMATCH, sec, off, msg))
    out.byte_damage.append(f"{sec} {msg}")
    out.spikes.append((len(out.cells) - 1, p))


def _element_offset(fr: LayerRun, cell: int, el: int) -> int:
    """The file offset of one element's bytes (its block's, for a quantized row)."""
    if fr.transposed:
        size = fr.row_size // max(fr.elements or 1, 1)
        return fr.data.offset + (el * fr.n_cells + cell) * size
    elems = max(fr.elements or 1, 1)
    el -= el % block_size(fr.type_id)  # a quantized element's bytes lie inside its block's
    return fr.data.offset + cell * fr.row_size + (el * fr.row_size) // elems


def _mismatch_message(fr: LayerRun, j: dict[str, Any], cell: int, p: int | None, rel: float) -> str:
    at = f"cell {cell}" + (f" (position {p})" if p is not None else "")
    what = {
        "angle": f"a head at {j['angle']:.3g} degrees from the recomputed one",
        "lnorm": f"a head norm off by a factor {np.exp(j['lnorm']):.3g}",
        "median": f"a median head angle of {j['median_angle']:.3g} degrees over all cells",
        "element": f"one element off by {j['element']:.3g}",
    }[j["by"]]
    fl = {
        "angle": f"{j['floor']['angle']:.3g} degrees",
        "lnorm": f"a factor {np.exp(j['floor']['lnorm']):.3g}",
        "median": f"{j['floor']['median']:.3g} degrees",
        "element": f"{j['floor']['element']:.3g}",
    }[j["by"]]
    return (
        f"{fr.part} layer {fr.index} ({fr.type_name}): {at} differs from the recomputed value by "
        f"{j['ratio']:.3g} noise floors ({what}; the floor is {fl}; limit {MARGIN_LIMIT:g} floors, "
        f"relative difference {100 * rel:.3g}%)"
    )
