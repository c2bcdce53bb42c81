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
from slotfile.model.expect import rotation_widths
from slotfile.problems import ProblemCode
from slotfile.verify.records import Level
from slotfile.verify.stats import RowStats, cell_stats, tolerance_class

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
MIN_FLOOR = {
    "float": {"angle": 0.5, "lnorm": 0.03, "median": 0.05},
    "8-bit": {"angle": 2.0, "lnorm": 0.05, "median": 0.5},
    "low-bit": {"angle": 10.0, "lnorm": 0.1, "median": 3.0},
}
MARGIN_LIMIT = 4.0  # a layer fails when a statistic is more than this many noise floors
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
    }
    ratios = {"angle": s.angle / fl["angle"], "lnorm": s.lnorm / fl["lnorm"], "median": s.median_angle / fl["median"]}
    by = max(ratios, key=lambda k: ratios[k])
    return {
        "angle": round(s.angle, 4),
        "lnorm": round(s.lnorm, 5),
        "median_angle": round(s.median_angle, 4),
        "rel": round(s.rel, 5),
        "floor": {k: round(v, 5) for k, v in fl.items()},
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
        "ratio": round(ratios[by], 3),
        "by": by,
        "cell": {"angle": s.angle_cell, "lnorm": s.lnorm_cell, "median": s.angle_cell}[by],
    }


def _stepwise_cells(run: LayerRun, pos: np.ndarray | None, n_tokens: int, n_stepwise: int) -> np.ndarray:
    """The cells of the last ``n_stepwise`` tokens (those the floor state decoded one per call)."""
    if not n_stepwise:
        return np.arange(0)
    if pos is None:  # a recurrent state: one cell, the state after the last token
        return np.arange(run.n_cells)
    return np.flatnonzero(pos[: run.n_cells] >= n_tokens - n_stepwise)


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
    the model's caches by role, for the head sizes (:func:`head_size`)."""
    layers = []
    for fb, ab, bb in zip(file_body.blocks, rec_a.blocks, (rec_b.blocks if rec_b else rec_a.blocks), strict=False):
        for (_sec, fr, ar, _pos), (_s2, _a2, br, bpos) in zip(layer_pairs(fb, ab), layer_pairs(ab, bb), strict=False):
            if fr is None or ar is None:
                continue
            head = head_size((caches or {}).get(fb.role), fr.part)
            s = cell_stats(fr, ar, head).summary()
            f = None
            if rec_b is not None and br is not None:
                f = cell_stats(ar, br, head).summary(_stepwise_cells(ar, bpos, n_tokens, n_stepwise))
            j = judge_run(s, f, tolerance_class(fr.type_id))
            layers.append({"block": fb.role, "part": fr.part, "layer": fr.index, **j})
    worst = max(layers, key=lambda r: r["ratio"], default=None)
    return {"margin": worst["ratio"] if worst else 0.0, "worst": worst, "layers": layers}


def layer_pairs(
    fb: MemoryBlock, rb: MemoryBlock
) -> Iterator[tuple[str, LayerRun | None, LayerRun | None, np.ndarray | None]]:
    """(section, file run, recomputed run, positions) for every layer entry of two blocks."""
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


@dataclass
class DeepInputs:
    """What a layer is judged against: the noise-floor state (the recompute with its last
    ``n_stepwise`` tokens decoded one per call), the model's caches by role (head sizes) and
    the token count."""

    floor_body: Body | None = None
    caches: Caches = field(default_factory=dict)
    n_tokens: int = 0
    n_stepwise: int = 0


def compare_bodies(
    lv: Level, file_body: Body, rec_body: Body, inputs: DeepInputs | None = None
) -> list[dict[str, Any]]:
    """Per-layer statistics of the file's state against the recomputed one, each against the
    noise floor (:func:`judge_run`); problems into ``lv``."""
    inp = inputs or DeepInputs()
    rows: list[dict[str, Any]] = []
    if rec_body.layout is None or file_body.layout is None:
        lv.error(ProblemCode.DEEP_INTERNAL, "body", file_body.offset, "the recomputed state does not parse")
        return rows
    if file_body.layout.kinds != rec_body.layout.kinds:
        lv.error(
            ProblemCode.DEEP_LAYOUT,
            "body",
            file_body.offset,
            f"the file holds {file_body.layout.describe()}; recomputing gives {rec_body.layout.describe()}",
        )
        return rows
    floors = _floor_runs(rec_body, inp.floor_body)
    for fb, rb in zip(file_body.blocks, rec_body.blocks, strict=False):
        if _cells_differ(lv, fb, rb):
            continue  # different cells: a row-by-row comparison means nothing
        for sec, fr, rr, pos in layer_pairs(fb, rb):
            if fr is None or rr is None:
                run = fr or rr
                assert run is not None  # layer_pairs yields at least one side
                lv.error(
                    ProblemCode.DEEP_LAYOUT,
                    sec,
                    fr.offset if fr else None,
                    f"{run.part} layer {run.index} present in only one of file and recomputed state",
                )
            elif (fr.type_id, fr.row_size, fr.transposed) != (rr.type_id, rr.row_size, rr.transposed):
                lv.error(
                    ProblemCode.DEEP_LAYOUT,
                    sec,
                    fr.offset,
                    f"{fr.part} layer {fr.index}: {fr.type_name} rows of "
                    f"{fr.row_size} B; the recomputed state has {rr.type_name} rows of {rr.row_size} B",
                )
            else:
                rows.append(_compare_run(lv, inp, sec, fb.role, fr, rr, pos, floors.get((fb.role, rr.part, rr.index))))
    return rows


_Floors = dict[tuple[str, str, int], tuple[LayerRun, np.ndarray | None]]


def _floor_runs(rec_body: Body, floor_body: Body | None) -> _Floors:
    """The noise-floor state's run for each (block role, part, layer) of the recomputed state."""
    floors: _Floors = {}
    if floor_body is not None and floor_body.layout is not None:
        for rb, bb in zip(rec_body.blocks, floor_body.blocks, strict=False):
            for _sec, ar, br, bpos in layer_pairs(rb, bb):
                if ar is not None and br is not None:
                    floors[(rb.role, ar.part, ar.index)] = (br, bpos)
    return floors


def _cells_differ(lv: Level, fb: MemoryBlock, rb: MemoryBlock) -> bool:
    """Cell counts or positions of the file's block differ from the recomputed block's:
    problems into ``lv``; True when any was found."""
    before = len(lv.problems)
    if fb.kind == MemoryKind.KV:
        for fs, rs in zip(fb.streams, rb.streams, strict=False):
            if fs.cell_count != rs.cell_count:
                lv.error(
                    ProblemCode.DEEP_CELLS,
                    f"body.{fb.role}.stream[{fs.index}]",
                    fs.offset,
                    f"{fs.cell_count} cells; recomputing the tokens gives {rs.cell_count}",
                )
            elif fs.cell_count and not np.array_equal(fs.positions, rs.positions):
                lv.error(
                    ProblemCode.DEEP_POSITIONS,
                    f"body.{fb.role}.stream[{fs.index}]",
                    fs.offset,
                    "cell positions differ from those of the recomputed state",
                )
    elif fb.cell_count != rb.cell_count:
        lv.error(
            ProblemCode.DEEP_CELLS,
            f"body.{fb.role}",
            fb.offset,
            f"{fb.cell_count} cells; recomputing the tokens gives {rb.cell_count}",
        )
    return len(lv.problems) > before


def _compare_run(
    lv: Level,
    inp: DeepInputs,
    sec: str,
    role: str,
    fr: LayerRun,
    rr: LayerRun,
    pos: np.ndarray | None,
    floor: tuple[LayerRun, np.ndarray | None] | None,
) -> dict[str, Any]:
    """One layer's rows of the file against the recomputed ones, judged against the noise
    floor between two recomputations: the layer's report row; a problem into ``lv`` when the
    values are not finite or differ by more than MARGIN_LIMIT floors."""
    head = head_size(inp.caches.get(role), fr.part)
    s_st = cell_stats(fr, rr, head).summary()
    f_st = None
    if floor is not None:
        f_st = cell_stats(rr, floor[0], head).summary(_stepwise_cells(rr, floor[1], inp.n_tokens, inp.n_stepwise))
    j = judge_run(s_st, f_st, tolerance_class(fr.type_id))
    cell = j["cell"] if s_st.finite else s_st.first_bad
    p = int(pos[cell]) if pos is not None and 0 <= cell < len(pos) else None
    row = {
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
    if not s_st.finite:
        lv.error(
            ProblemCode.DEEP_NONFINITE,
            sec,
            fr.data.offset,
            f"{fr.part} layer {fr.index}: non-finite values (first in cell {cell})",
        )
    elif j["ratio"] > MARGIN_LIMIT:
        lv.error(
            ProblemCode.DEEP_MISMATCH,
            sec,
            fr.data.offset + (cell * fr.row_size if not fr.transposed and cell >= 0 else 0),
            _mismatch_message(fr, j, cell, p, s_st.rel),
        )
    return row


def _mismatch_message(fr: LayerRun, j: dict[str, Any], cell: int, p: int | None, rel: float) -> str:
    at = f"cell {cell}" + (f" (position {p})" if p is not None else "")
    what = {
        "angle": f"a head at {j['angle']:.3g} degrees from the recomputed one",
        "lnorm": f"a head norm off by a factor {np.exp(j['lnorm']):.3g}",
        "median": f"a median head angle of {j['median_angle']:.3g} degrees over all cells",
    }[j["by"]]
    fl = {
        "angle": f"{j['floor']['angle']:.3g} degrees",
        "lnorm": f"a factor {np.exp(j['floor']['lnorm']):.3g}",
        "median": f"{j['floor']['median']:.3g} degrees",
    }[j["by"]]
    return (
        f"{fr.part} layer {fr.index} ({fr.type_name}): {at} differs from the recomputed value by "
        f"{j['ratio']:.3g} noise floors ({what}; the floor is {fl}; limit {MARGIN_LIMIT:g} floors, "
        f"relative difference {100 * rel:.3g}%)"
    )
