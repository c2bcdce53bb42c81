"""Drift or damage: the shape of a stored state's difference from its recompute (issue 25).

A server computes a prompt in pieces this recompute need not share (bench/corpus.md: the
``-b``/``-ub`` split, the checkpoint breaks ``4 + n_ubatch`` and 4 tokens before a prompt's end,
a reused prefix, another build's kernels).  That *drift* lives in model space: from the position
where the two computations first part, the hidden state of every later token differs, so the
same positions differ in every layer above, and the first layer (a function of the token and
its position alone) stays within rounding.  *Damage* lives in byte space: a contiguous range of
one layer's bytes (a sector, a page, a row) - exact zeros, non-finite values, an element far
outside the layer's noise - while the other layers at the same positions agree.

:func:`judge_with_schedules` judges a file against one recompute (:func:`judge_layers`); when
layers fail and the failure has the drift shape, it asks ``recompute`` for up to
:data:`MAX_RETRIES` other schedules (:func:`candidate_schedules`) and keeps the closest.  A
failure left after that is damage unless it still has the drift shape (then the file passes
with evidence ``drift``: no split can be replayed for another build or a prefix computed by an
earlier request).  The benchmark (bench/detect.py) calls it with its own ``recompute``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Concatenate, ParamSpec

import numpy as np

from slotfile.format.records import Body, MemoryKind
from slotfile.llama.worker.pieces import prompt_pieces, stepwise_ranges
from slotfile.problems import ProblemCode
from slotfile.verify.judge import (
    MARGIN_LIMIT,
    Caches,
    DeepInputs,
    Judgment,
    RunCells,
    holds_every_position,
    judge_layers,
)
from slotfile.verify.lone import EXACT
from slotfile.verify.misplaced import find_misplaced
from slotfile.verify.records import Level
from slotfile.verify.stats import median, nanmedian, tolerance_class

_P = ParamSpec("_P")
MAX_RETRIES = 4  # extra recomputes, each only while the difference has the drift shape
# the most tokens a reply replay (reply_schedules) decodes one per call: ~15 ms each on Gemma 3 270M
# and 2 cores, ~0.1-0.2 s on a 7B model
MAX_STEPWISE = 2048
# a layer at a position "differs too" (corroborates a failing cell of another layer) above this
# many floors: clean layers stay below 1.2 on the real-server corpus (bench/corpus.md)
CORROBORATE = 2.0
USUAL_UBATCH = (256, 128, 64, 32)  # llama-server -ub values tried below the first recompute's
# larger -ub values (throughput settings, a GPU server's usual) tried when the first recompute
# agrees exactly past its own first micro-batch: a server that cut the prompt in larger pieces
# agrees with it there (a -ub 1024 server's 2,056-token file: exact up to position 1,026, where
# the recompute's n_swa + 512-cell window starts reusing cells and the server's 1,536 do not)
LARGER_UBATCH = (1024, 2048)
NEAR = 8  # positions either side where another layer's difference corroborates a cell's
SWA_PAD = 256  # llama_kv_cache_iswa pads its sliding-window cache to a multiple of 256 cells (v3 and v4)
# positions past where a window cache first reuses a cell by which a computation over a cache of
# another size has parted from it (measured 2-6 on Gemma 3: f16, q8_0, q4_1; window_rules_out)
WINDOW_PARTS = 32
SCHEDULE_DEPENDENT = 2.0  # a cell's ratio moving this many times between recomputes: drift
# a drifting region: the other layers' largest ratios within NEAR positions have a median of at
# least this many floors (a clean region of an agreeing recompute: about 0); a cell there is
# drift up to 2 * limit times that background (g-swa-full: 3.8 floors on a background of 1.26)
DRIFTING = 0.75
# other layers (each K or V tensor counts) peaking at a spike's position: the position diverged, not the bytes
COHERENT_LAYERS = 3
PEAK = 4.0  # a layer peaks at a position: this many times the median of its neighbourhood
# the first layer's cell at a position must stand this many times above the median of that
# layer's cells to be a changed token: layer 0's K/V of a cell is a function of its token alone,
# so a changed token moves that cell's K and V far above the typical cell, while a rounding that
# moves every cell (another backend's, a quantized cache's) does not. What keeps a CUDA server's
# files out today is V: their layer-0 K reaches 3.7-4.5 floors at a few tokens with large
# activations (BOS), V stays under 0.7 (bench/corpus.md)
STANDOUT = 3.0
# a changed token in a state drifting from the first tokens (another build's), at a position no
# first layer holds: the lowest layer holding it stands this many times above the median of the
# BACKGROUND positions before it, in V at the token and in K at the next position (calibrated in
# bench/detect-cross-build-token.md)
TOKEN_SPIKE = 10.0
# the same where the K cache is low-bit (q4_0 K beside an f16 V, ``-fa off``): the lowest layer's K
# floor is the quantization's, and so is its V's (attention reads that K), so a changed token
# reaches only 1.5-15 floors in V and 2.1-4.8 in K at the next position, under the limit, yet
# stands 4.7-89 times above the background in both (15 copies of v3 and v4 servers' files,
# bench/detect-low-bit-token.md); over their floors and coming back after, no clean position of
# 51 files (101 recomputes, most of them another build's) stands out more than 2.62 times
TOKEN_SPIKE_LOW_BIT = 4.0


def token_spike_rule(low_bit: bool) -> tuple[float, float]:
    """How far (floors) and how many times its background a changed token's lowest layer must
    stand in V and in K at the next position (:func:`spiked_tokens`): beyond the limit and
    :data:`TOKEN_SPIKE` times, or for a low-bit K cache beyond one floor and
    :data:`TOKEN_SPIKE_LOW_BIT` times."""
    return (1.0, TOKEN_SPIKE_LOW_BIT) if low_bit else (MARGIN_LIMIT, TOKEN_SPIKE)


BACKGROUND = 32
MIN_BACKGROUND = 0.05  # floors: the background of a state exact before the position


@dataclass(frozen=True)
class Schedule:
    """How a prefill is split: tokens per llama_decode call, per micro-batch, and the
    positions where a new call starts (checkpoint breaks, a reused prefix)."""

    n_batch: int
    n_ubatch: int
    cuts: tuple[int, ...] = ()
    stepwise: tuple[tuple[int, int], ...] = ()  # ranges [a, b) decoded one token per call (replies)
    swa_full: bool = False  # a whole-context sliding-window cache (llama-server --swa-full)

    @property
    def n_one_per_call(self) -> int:
        return sum(b - a for a, b in self.stepwise)

    def decodes_one_per_call(self, pos: int) -> bool:
        """Whether this schedule decodes position ``pos`` in a call of its own."""
        return any(a <= pos < b for a, b in self.stepwise)

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"n_batch": self.n_batch, "n_ubatch": self.n_ubatch, "cuts": list(self.cuts)}
        if self.stepwise:
            d["stepwise"] = [list(r) for r in self.stepwise]
        if self.swa_full:
            d["swa_full"] = True
        return d

    def label(self) -> str:
        spans = ", ".join(f"{a}-{b - 1}" for a, b in self.stepwise)
        return (
            f"-b {self.n_batch} -ub {self.n_ubatch}"
            + (f", breaks at {list(self.cuts)}" if self.cuts else "")
            + (f", one token per call at positions {spans}" if self.stepwise else "")
            + (", --swa-full" if self.swa_full else "")
        )


@dataclass
class Shape:
    """What the difference looks like: ``drift`` (True: spread over the layers from an onset),
    the evidence in one line, and the onset position (None: no cell differs beyond the floors)."""

    drift: bool
    evidence: str
    onset: int | None = None
    at: int | None = None  # the position of the cell the evidence names, when not drift


# recompute(schedule) -> (the recomputed body, or None and why it failed)
Recompute = Callable[[Schedule], tuple[Body | None, str]]


@dataclass
class Outcome:
    """The judgment the verdict rests on, the schedule of its recompute, what decided it
    (``statistics``, ``misplaced``, ``bytes``, ``shape``, ``schedule`` or ``drift``) and every schedule tried."""

    judgment: Judgment
    schedule: Schedule
    decided_by: str
    evidence: str
    tried: list[dict[str, Any]] = field(default_factory=list)
    drift: bool = False  # the file passes as drift though a layer exceeds its floors
    # it fails only because no split tried moved a drift-shaped difference: a caller that could
    # not offer other splits (the appendix blobs' first judgment) may recompute with its own
    unmoved: bool = False
    # the position from which the server shifted the cells (llama_kv_cache::seq_add): the state
    # there was computed over tokens the file no longer holds, so it is not compared value by value
    shifted: int | None = None
    # the position from which a drift no schedule replays, in a cache of one stream per slot, is
    # left unverified (the slot's share of batches with other slots: streams_per_slot)
    unreplayed: int | None = None

    def details(self) -> dict[str, Any]:
        shifted = {} if self.shifted is None else {"shifted": self.shifted}
        unreplayed = {} if self.unreplayed is None else {"unreplayed": self.unreplayed}
        return {
            "decided_by": self.decided_by,
            "evidence": self.evidence,
            **shifted,
            **unreplayed,
            "schedules": self.tried,
        }


def _position_matrix(cells: list[RunCells]) -> tuple[np.ndarray, list[RunCells]]:
    """Per run holding positions, its cell ratios by position (NaN: not held)."""
    runs = [c for c in cells if c.positions is not None and c.positions.size]
    if not runs:
        return np.zeros((0, 0)), runs
    n = int(max(int(c.positions.max()) for c in runs if c.positions is not None)) + 1
    m = np.full((len(runs), n), np.nan)
    for i, c in enumerate(runs):
        assert c.positions is not None
        m[i, c.positions] = c.ratio
    return m, runs


def drift_shape(
    j: Judgment, limit: float = MARGIN_LIMIT, others: tuple[Judgment, ...] = (), first_block: str | None = None
) -> Shape:
    """Whether the cells of ``j`` that exceed ``limit`` floors have the shape of drift: near each
    such cell (within :data:`NEAR` positions) another layer differs too (above
    :data:`CORROBORATE` floors), and the first layer of the blocks holding it stays within the
    limit in K or V.  ``others``: the same file judged against recomputes with other schedules;
    a cell whose ratio changes by more than :data:`SCHEDULE_DEPENDENT` times between them is
    drift whatever its neighbours (damage differs from every recompute alike).  No: the evidence
    names the first cell that is not drift (or the byte damage, or a problem not a value's).
    ``first_block``: the block whose layer 0 is the model's layer 0 (:func:`first_layer_block`;
    None: every block's layer 0 is taken as a first layer)."""
    if j.byte_damage and not _spikes_in_model_space(j, limit, first_block):
        # spikes and scaled rows name their positions; zeros and non-finite values differ from any recompute
        at = [p for _i, p in j.spikes if p is not None]
        named = len(at) == len(j.byte_damage)
        return Shape(False, "bytes: " + j.byte_damage[0], None, min(at) if named and at else None)
    other = [p for p in j.problems if p[0] != ProblemCode.DEEP_MISMATCH]
    if other:
        return Shape(False, f"{other[0][0]}: {other[0][3]}")
    # a recurrent state is judged by its layer's ratio too, or a failure by its median would read
    # as no cell over the limit, i.e. drift (a 16-byte zero span in a Jamba S state: 15 floors)
    if any(c.positions is None and (c.layer_ratio > limit or bool(np.any(c.ratio > limit))) for c in j.cells):
        return Shape(False, "a recurrent state differs beyond its floors (one cell: no shape to read)")
    m, runs = _position_matrix(j.cells)
    if not runs:
        return Shape(True, "no cell exceeds its floors")
    r = np.nan_to_num(m)
    alt = [np.nan_to_num(_position_matrix(o.cells)[0]) for o in others]
    alt = [a for a in alt if a.shape == r.shape]
    high = r >= CORROBORATE
    held = ~np.isnan(m)
    cols = np.flatnonzero(high.any(axis=0))
    onset = int(cols[0]) if cols.size else None
    for i in range(len(runs)):
        level: float | None = None  # _layer_level(runs, i), once a cell of the run needs it
        for p in np.flatnonzero(r[i] > limit):
            why = _first_layer(m, runs, int(p), limit, first_block)
            seen = [float(a[i, p]) for a in alt] + [float(r[i, p])]
            if not why and max(seen) > SCHEDULE_DEPENDENT * max(min(seen), 1e-9):
                continue  # the split moves it: drift
            bg = max(_background(x, runs, i, int(p), held) for x in (r, *alt))
            if not why and bg >= DRIFTING:
                level = _layer_level(runs, i) if level is None else level
                if r[i, p] <= 2 * limit * max(bg, level):
                    # as far from the recompute as every layer around it, or as its own layer's
                    # typical cell, relative to its floor: a region and a layer that drift
                    continue
            why = why or _isolated(runs, high, i, int(p), float(r[i, p]))
            if why:
                return Shape(False, why, onset, int(p))
    return Shape(True, f"drift: from position {onset} on, the layers differ together (model space)", onset)


def _spikes_in_model_space(j: Judgment, limit: float, first_block: str | None) -> bool:
    """Whether every byte-damage line of ``j`` is an isolated spike at a position where the
    model's computation itself parted: at least :data:`COHERENT_LAYERS` other K or V tensors (the
    spike's own layer's other part among them) peak at that same position (:data:`PEAK` times
    their own neighbourhood, above :data:`CORROBORATE` floors) while the first layer agrees.
    Damage in the bytes sits in one layer's tensor; one position that differs in many layers at
    once, from some depth on, is that token's residual stream diverging: an ill-conditioned
    position amplifying the drift of another build or schedule (a 713-token chat: the K of a cell
    at position 704 45 degrees off in every layer from 5 on, one element of it 5.4 times its
    noise, on every recompute; a 4-slot unified q8_0 v3 server's long slot on an AMD EPYC: the V
    rows of window layers 5 and 6 at position 1,820 1.45 and 1.39 times as long as recomputed, K
    there 4.7 floors off in both, 2-3 floors in layers 7-12 against about 0.8 around it, read as
    two scaled rows while this counted layers, not tensors)."""
    if len(j.spikes) != len(j.byte_damage):
        return False  # zeros or non-finite values: damage on any recompute
    m, runs = _position_matrix(j.cells)
    r = np.nan_to_num(m)
    for idx, p in j.spikes:
        c = j.cells[idx]
        i = next((k for k, x in enumerate(runs) if x is c), None)
        if p is None or i is None or p >= m.shape[1] or _first_layer(m, runs, p, limit, first_block):
            return False
        peaks = set()
        for k in range(len(runs)):
            # the layer's other part counts: K and V of a layer lie apart in the file (every
            # layer's K rows, then every layer's V rows: llama_kv_cache::state_write_data), so
            # no byte change reaches both at one cell
            if runs[k] is c or np.isnan(m[k, p]):
                continue
            near = np.delete(m[k, max(0, p - NEAR) : p + NEAR + 1], min(p, NEAR))
            bg = float(np.nanmedian(near)) if bool(np.any(~np.isnan(near))) else 0.0
            if r[k, p] >= max(CORROBORATE, PEAK * bg):
                peaks.add((runs[k].block, runs[k].layer, runs[k].part))
        if len(peaks) < COHERENT_LAYERS:
            return False
    return True


def _background(r: np.ndarray, runs: list[RunCells], i: int, p: int, held: np.ndarray) -> float:
    """The median over the other layers holding position ``p`` (``held``: runs by position) of
    their largest ratio within :data:`NEAR` positions of it."""
    key = (runs[i].block, runs[i].layer)
    rows = [k for k in np.flatnonzero(held[:, p]) if (runs[k].block, runs[k].layer) != key]
    if not rows:
        return 0.0
    return median(r[rows, max(0, p - NEAR) : p + NEAR + 1].max(axis=1))


def _layer_level(runs: list[RunCells], i: int) -> float:
    """The median ratio over every cell of run ``i``'s layer (K and V, each part's cells): how far
    the layer as a whole sits from the recompute.  In a drifting region, drift whose floor the
    noise recompute set low moves every cell of a layer alike (a 4-slot server's long slot: model
    layer 5's V at a median of 5.4 floors, its worst cells 9.6 and 27.9 where the other layers
    around sit at 1.1-1.5), while damage in the bytes leaves the layer's other cells where they
    were.  Outside a drifting region a layer off as a whole is not drift (a K layer scaled, the one
    layer above the first of a 2-layer model after a context shift)."""
    key = (runs[i].block, runs[i].layer)
    cells = [x.ratio for x in runs if (x.block, x.layer) == key and x.ratio.size]
    return median(np.concatenate(cells)) if cells else 0.0


def _isolated(runs: list[RunCells], high: np.ndarray, i: int, p: int, ratio: float) -> str:
    """Why cell ``p`` of run ``i`` is damage in its layer's bytes: no other layer differs near
    it ('': another does)."""
    c = runs[i]
    layer_of = [(x.block, x.layer) for x in runs]
    near = high[:, max(0, p - NEAR) : p + NEAR + 1].any(axis=1)
    if {layer_of[k] for k in np.flatnonzero(near)} - {layer_of[i]}:
        return ""
    return (
        f"isolated: {c.part} layer {c.layer} of {c.block} at position {p} differs by "
        f"{ratio:.3g} floors and no other layer differs near it (damage in that layer's bytes)"
    )


def first_layer_block(caches: Caches) -> str | None:
    """The role of the cache holding the model's first layer with K/V (``CacheExpect.layers``):
    in an iSWA model each block numbers its layers from 0, but only one block's layer 0 is the
    model's, the one computed from the token and its position alone (Gemma 3: the SWA block;
    the base block's layer 0 is model layer 5 and drifts like any other).  None: unknown."""
    firsts = {role: c.layers[0] for role, c in caches.items() if c.layers}
    return min(firsts, key=lambda r: firsts[r]) if firsts else None


def _first_layer(m: np.ndarray, runs: list[RunCells], p: int, limit: float, first_block: str | None = None) -> str:
    """Why position ``p`` is damage: the model's first layer (layer 0 of ``first_block``, or of
    every block when unknown) differs beyond the limit in K and V, and stands out from that
    layer's other cells (:data:`STANDOUT`) ('': it does not)."""
    held = [k for k, x in enumerate(runs) if _is_first_layer(x, first_block) and not np.isnan(m[k, p])]
    at = np.nan_to_num(m[held, p])
    typical = np.array([nanmedian(m[k]) for k in held])
    if held and float(at.min()) > limit and bool(np.all(at > STANDOUT * typical)):
        return (
            f"first layer: at position {p} the first layer's K and V differ beyond the limit "
            "(they depend on the token and its position only: a changed token or damaged rows)"
        )
    return ""


def _is_first_layer(c: RunCells, first_block: str | None) -> bool:
    """Whether ``c`` is the model's first layer: layer 0 of ``first_block`` (None: of any block)."""
    return c.layer == 0 and (first_block is None or c.block == first_block)


def candidate_schedules(
    first: Schedule,
    n_tokens: int,
    onset: int | None,
    checkpoints: bool,
    first_diff: int | None = None,
    replies: Sequence[tuple[int, int]] = (),
) -> list[Schedule]:
    """Up to :data:`MAX_RETRIES` other splits a server may have used, likeliest first: the usual
    ``-ub`` values below the first recompute's, those whose boundaries the divergence onset lies
    on first, each with the checkpoint breaks ``n - 4 - n_ubatch`` and ``n - 4`` when the memory
    takes checkpoints (``checkpoint_offsets`` in ``server_context_impl::update_slots``).  A split
    changes nothing before its first boundary: one that starts after the onset (NEAR allowed)
    cannot explain it (another build's kernels differ from the first token on) and is left out.
    Before them, when the recompute agrees exactly up to ``first_diff`` and drifts from a later
    onset, up to two replays of an earlier turn's reply (:func:`reply_schedules`) where the text
    allows one (:func:`starts_in_a_reply`); before those, the
    replies the chat template's text shows (``replies``, :func:`turn_schedules`).  The splits of a
    larger ``-ub`` (:func:`larger_schedules`) come right after the text's replies when the recompute
    parts at its second micro-batch boundary, last when it parts at one of their checkpoint
    breaks, else not at all."""
    us = [u for u in USUAL_UBATCH if u < first.n_ubatch and u < n_tokens]
    us.sort(key=lambda u: (onset is not None and onset % u != 0, -u))
    out = [Schedule(first.n_batch, u, _breaks(n_tokens, u) if checkpoints else ()) for u in us]
    if checkpoints:
        out.append(Schedule(first.n_batch, first.n_ubatch, _breaks(n_tokens, first.n_ubatch)))
    if onset is not None:
        out = [s for s in out if min((s.n_ubatch, *s.cuts)) <= onset + NEAR]
    turns = turn_schedules(first, n_tokens, replies, checkpoints)
    found = [
        s
        for s in reply_schedules(first, n_tokens, onset, checkpoints, first_diff)
        if s not in turns and starts_in_a_reply(s, n_tokens, replies)
    ]
    larger = larger_schedules(first, n_tokens, checkpoints, first_diff)
    rest = [s for s in out if s != first][:MAX_RETRIES]
    if first_diff is not None and abs(first_diff - 2 * first.n_ubatch) <= NEAR:
        # parting at the recompute's second micro-batch boundary (Gemma 3, n_swa 512: where its
        # window of n_swa + n_ubatch cells starts reusing cells), not at a reply: a larger -ub
        # first after the replies the text shows (a difference before them may have another cause)
        return [*turns, *larger, *found, *rest]
    # elsewhere only a larger -ub whose own checkpoint break the state parts at (a -ub 128 server's
    # 2,056-token file parts at 776, a 4-slot server's long slot at 513: two more recomputes each,
    # 10-15 s, that moved neither)
    near = [s for s in larger if any(abs(first_diff - c) <= NEAR for c in s.cuts)] if first_diff is not None else []
    return [*turns, *found, *rest, *near]


def larger_schedules(first: Schedule, n_tokens: int, checkpoints: bool, first_diff: int | None) -> list[Schedule]:
    """The splits of a server whose ``-ub`` is larger than the first recompute's
    (:data:`LARGER_UBATCH`), when that recompute agrees exactly up to ``first_diff`` at or past
    its own first micro-batch boundary: a smaller ``-ub`` would have parted there, a larger one
    computes the first ``n_ubatch`` tokens as the recompute did.  Its batch is at least its
    micro-batch (``llama_context``: ``n_ubatch <= n_batch``); with checkpoints, the server's breaks
    for that ``-ub`` (``n - 4 - n_ubatch``, ``n - 4``).  Besides the split, the ``-ub`` sizes an
    iSWA model's window cache (``n_swa + n_ubatch`` cells, llama_kv_cache_iswa), so where that
    window starts reusing cells moves with it."""
    if first_diff is None or first_diff < first.n_ubatch:
        return []
    out: list[Schedule] = []
    for u in (u for u in LARGER_UBATCH if u > first.n_ubatch):
        out.append(Schedule(max(first.n_batch, u), u, _breaks(n_tokens, u) if checkpoints else ()))
        if u >= n_tokens:
            break  # one micro-batch holds every token, and its window every cell: a larger -ub is the same
    return out


def saved_replies(replies: Sequence[tuple[int, int]], n_tokens: int) -> list[tuple[int, int]]:
    """The reply spans the text shows (``replies``) that lie within the file's ``n_tokens``, the last
    one running to the end of the file even where its text holds a template's markers (a small model
    repeating them): the slot was saved after it was generated."""
    spans = [(a, b) for a, b in replies if 0 < a < b <= n_tokens]
    if spans:
        spans[-1] = (spans[-1][0], n_tokens)
    return spans


def turn_schedules(
    first: Schedule, n_tokens: int, replies: Sequence[tuple[int, int]], checkpoints: bool
) -> list[Schedule]:
    """Replays of the replies a chat's text shows (:func:`slotfile.verify.turns.reply_spans`),
    each one token per call as the server generated it: the last reply alone (the next turn's
    prompt may have re-tokenized the earlier ones and prefilled them again: 34 and 272 of 238 and
    476 cached tokens reused in a three-turn chatml chat), then every reply.  With checkpoints,
    each prompt ends with the server's breaks ``n_prompt - 4 - n_ubatch`` and ``n_prompt - 4``
    (``checkpoint_offsets`` in ``update_slots``; the first only where that prompt's prefill
    reaches back to it, after the reply before).  Measured on a two-reply 2,440-token file of a
    ``-fa on`` v4 server: with a library of the server's instruction set, this replay is exact
    up to the second prompt and passes at 3.7 floors (a prefill: 76.8)."""
    spans = saved_replies(replies, n_tokens)
    if not spans:
        return []
    cuts: tuple[int, ...] = ()
    if checkpoints:
        ends = [0, *(b for _a, b in spans[:-1])]
        cuts = tuple(c for (a, _b), e in zip(spans, ends, strict=True) for c in _breaks(a, first.n_ubatch) if c > e)
    last = tuple(c for c in cuts if c > (spans[-2][1] if len(spans) > 1 else 0))
    out = [Schedule(first.n_batch, first.n_ubatch, last, (spans[-1],))]
    if len(spans) > 1:
        out.append(Schedule(first.n_batch, first.n_ubatch, cuts, tuple(spans)))
    return [s for s in out if s.n_one_per_call <= MAX_STEPWISE]


def starts_in_a_reply(s: Schedule, n_tokens: int, replies: Sequence[tuple[int, int]]) -> bool:
    """Whether a replay found from the first difference (:func:`reply_schedules`) starts its one-per-call
    decoding where the text could hold a reply: inside a reply the chat template's text shows
    (``replies``, the last one running to the end of the file: :func:`saved_replies`) or up to
    :data:`NEAR` positions before one; anywhere when the text shows none (a raw ``/completion``
    prompt).  A difference inside a user's turn of a chat whose replies the text shows is not a
    reply's: the server prefilled that turn (``update_slots``), so replaying it one token per call
    cannot agree.  On the real-server corpus such replays were never the split that passed, and
    cost most of deep's time on long files: a 4-slot server's 2,092-token slot parts at 513, where
    Gemma 3's window of 512 first leaves a cell out, and the two replays from there decode 1,063 and 1,579
    tokens one per call (measured: bench/detect-found-replays.md)."""
    spans = saved_replies(replies, n_tokens)
    if not spans or not s.stepwise:
        return True
    start = s.stepwise[0][0]
    return any(a - NEAR <= start < b for a, b in spans)


def reply_schedules(
    first: Schedule, n_tokens: int, onset: int | None, checkpoints: bool, first_diff: int | None
) -> list[Schedule]:
    """Where a multi-turn chat's earlier reply was generated: llama-server decodes a reply one
    token per call, and the next turn reuses those cells as its prompt's prefix
    (``server_context_impl::update_slots``: ``n_past`` from ``get_common_prefix``), so the state
    from the reply's first token on is what one-per-call decoding gives, which a prefill of the
    stored tokens does not replay (a 200-token reply on a 2,006-token prompt: 32.6 floors, from
    the reply's 77th token; replayed from its first token, 1.6).  The file does not say where the
    reply began, but the recompute does: up to the first difference the two computations were the
    same (a reply's first rows can still come out equal, so it may lie a few tokens into the reply:
    those rows match either way).  Without checkpoints that first difference is the reply's first
    token; with them it is the server's break ``n_prompt - 4 - n_ubatch`` (``checkpoint_offsets``),
    so the reply began ``4 + n_ubatch`` later, the prompt's tail cut at ``n_prompt - 4``.  Only for
    an onset well after the first tokens (another build differs from the first token on) and at
    most :data:`MAX_STEPWISE` tokens one per call."""
    if onset is None or first_diff is None or onset <= 2 * NEAR or not 0 < first_diff <= onset:
        return []
    out: list[Schedule] = []
    start = first_diff + 4 + first.n_ubatch
    if checkpoints and start < n_tokens:
        out.append(Schedule(first.n_batch, first.n_ubatch, (first_diff, start - 4), ((start, n_tokens),)))
    out.append(Schedule(first.n_batch, first.n_ubatch, (), ((first_diff, n_tokens),)))
    return [s for s in out if s.n_one_per_call <= MAX_STEPWISE]


def first_difference(j: Judgment) -> int | None:
    """The first position where any layer's cell differs from the recompute (over
    :data:`~slotfile.verify.lone.EXACT` floors); None without positions or differences."""
    firsts = [
        int(c.positions[np.flatnonzero(c.ratio > EXACT)].min())
        for c in j.cells
        if c.positions is not None and bool((c.ratio > EXACT).any())
    ]
    return min(firsts) if firsts else None


def _breaks(n: int, n_ubatch: int) -> tuple[int, ...]:
    return tuple(c for c in (n - 4 - n_ubatch, n - 4) if 0 < c < n)


def micro_batches(s: Schedule, n: int) -> list[tuple[int, int]]:
    """The ``[a, b)`` positions of each micro-batch a recompute of ``n`` tokens with ``s`` computes,
    in order: the worker's calls (:func:`~slotfile.llama.worker.pieces.prompt_pieces`), a reply one
    token per call, any other piece in calls of ``n_batch`` tokens, which
    llama_batch_allocr::split_simple cuts into ``n_ubatch`` pieces (one sequence)."""
    step, u = max(1, s.n_batch), max(1, min(s.n_ubatch, s.n_batch))
    out: list[tuple[int, int]] = []
    for a, b, one in prompt_pieces(n, list(s.cuts), stepwise_ranges(s.stepwise, n)):
        if one:
            out.extend((p, p + 1) for p in range(a, b))
            continue
        for c in range(a, b, step):
            e = min(b, c + step)
            out.extend((x, min(e, x + u)) for x in range(c, e, u))
    return out


def computes_alike_until(first: Schedule, s: Schedule, n: int) -> int:
    """The first position whose micro-batch ``s`` computes otherwise than ``first`` (``n``: none
    does).  Up to there the two recomputes are the same computation in the same context (the same
    micro-batches over the same cells, on the same threads), so their states agree bit for bit; a
    context of another ``-b``/``-ub`` or window (``swa_full``) may differ from position 0."""
    if (first.n_batch, first.n_ubatch, first.swa_full) != (s.n_batch, s.n_ubatch, s.swa_full):
        return 0
    a, b = micro_batches(first, n), micro_batches(s, n)
    return next((x[0] for x, y in zip(a, b, strict=False) if x != y), n)


def _exact_spike(j: Judgment) -> bool:
    """Whether a layer of ``j`` holds an isolated spike in an exact context
    (:class:`~slotfile.verify.spikes.Spike` ``exact``): byte damage no schedule explains."""
    return any(bool(r.get("spike", {}).get("exact")) for r in j.rows)


def over_limit_before(j: Judgment, p: int) -> tuple[int, float]:
    """The layers holding a cell over :data:`MARGIN_LIMIT` floors at a position before ``p``, and
    the largest such cell ratio there (0 layers: none, or no layer keeps positions)."""
    layers, worst = 0, 0.0
    for c in j.cells:
        if c.positions is None:
            continue
        r = c.ratio[c.positions < p]
        if r.size and float(r.max()) > MARGIN_LIMIT:
            layers += 1
            worst = max(worst, float(r.max()))
    return layers, worst


def as_shifted(out: Outcome, file_body: Body, caches: Caches) -> Outcome | None:
    """``out`` as cells the server shifted (decided_by ``shifted``), when its judgment has that
    shape (:func:`shifted_from`); None when it does not."""
    p = shifted_from(out.judgment, file_body, first_layer_block(caches))
    if p is None:
        return None
    ev = (
        f"shifted: the state agrees up to position {p - 1} and the first layer at every position (no token "
        f"changed); from position {p} every layer above the first differs in K and V, starting where "
        "the server moved cells back (a context shift or a reused chunk: llama_kv_cache::seq_add), so they "
        "were computed over tokens the file no longer holds"
    )
    return dataclasses.replace(out, decided_by="shifted", evidence=ev, drift=False, unmoved=False, shifted=p)


def _or_shifted(
    judge: Callable[Concatenate[Body, DeepInputs, _P], Outcome],
) -> Callable[Concatenate[Body, DeepInputs, _P], Outcome]:
    """``judge``, with a failing outcome read as cells the server shifted where it has that shape
    (:func:`as_shifted`).  Not one decided by misplaced rows: a K/V swap or a cell swap in a layer
    whose cells all sit after the onset is only one more differing layer to the shape (a shifted
    tiny Gemma 3 file's SWA block), while its rows match other recomputed rows.  Taking those too
    passed 2 of 16 K/V swaps and 4 of 19 cell swaps in shifted files, to pass one clean file whose
    looping reply gave a shifted row equal to the recompute's one period on (v3 Gemma 3, -c 1024,
    3 shifts: position 792's V row is the recompute's of 852 to the bit)."""

    @functools.wraps(judge)
    def judged(file_body: Body, inputs: DeepInputs, *args: _P.args, **kwargs: _P.kwargs) -> Outcome:
        out = judge(file_body, inputs, *args, **kwargs)
        failed = not out.drift and bool(out.judgment.problems) and out.decided_by != "misplaced"
        return (as_shifted(out, file_body, inputs.caches) or out) if failed else out

    return judged


@_or_shifted
def judge_with_schedules(
    file_body: Body,
    inputs: DeepInputs,
    first: tuple[Schedule, Body],
    recompute: Recompute | None,
    checkpoints: bool = False,
    replies: Callable[[], Sequence[tuple[int, int]]] | None = None,
    logits_ok: bool = False,
    window: WindowCache | None = None,
) -> Outcome:
    """Judge ``file_body`` against the first recompute (``first``: its schedule and body, the
    floor in ``inputs``); when layers fail with the drift shape, against up to
    :data:`MAX_RETRIES` more from ``recompute`` (None: no retries), keeping the closest.
    ``replies``: the reply spans the tokens' text shows, asked for only when retrying; they are
    not replayed for a drift from the first tokens (another build's, passed as drift anyway)
    while the first recompute's next-token logits agree (``logits_ok``): that costs a GPU-written
    file two recomputes and changes no verdict.  A difference that fails after all that, but has
    the shape of cells the server shifted (:func:`shifted_from`), is that instead
    (:func:`_or_shifted`).  ``window``: what sizes the recompute's sliding-window cache
    (None: unknown), which rules out a retry with a window of another size where the first
    recompute reproduced the state bit for bit past where either first reused a cell
    (:func:`window_rules_out`)."""
    sched, body = first
    j = judge_layers(file_body, body, inputs)
    tried = [_tried(sched, j)]
    moved = find_misplaced(file_body, body, j, inputs.tokens)  # before any difference is excused as drift
    if moved:
        j.problems[:0] = moved
        return Outcome(
            j, sched, "misplaced", moved[0][3] + (f" (+{len(moved) - 1} more)" if len(moved) > 1 else ""), tried
        )
    if not j.problems:
        return Outcome(j, sched, "statistics", "every layer within its noise floors", tried)
    first_block = first_layer_block(inputs.caches)
    shape = drift_shape(j, first_block=first_block)
    if not shape.drift and _exact_spike(j):
        # a value far off while the rest of its head and its element in every other cell equal the
        # recompute bit for bit: the recompute reproduces the server's computation there, so no
        # other schedule can explain the value, and a replay that computes the layer otherwise
        # (another micro-batch from position 0 rounds every cell anew) only hides it in its own
        # noise (a v3 chat's V layer 0 element moved 256 steps at position 14 passed by a replay
        # of its replies, bench/detect-zero-runs.md)
        return Outcome(j, sched, "bytes", shape.evidence, tried)
    again = DeepInputs(
        inputs.floor_body, inputs.caches, inputs.n_tokens, inputs.n_stepwise, j.floors, tokens=inputs.tokens
    )
    spans = replies() if replies is not None and recompute is not None else ()
    if not shape.drift:
        # one cell of a generated reply can sit far from a prefill's (a 713-token chat: 45 degrees,
        # one element 5.5 times its noise, like a flipped bit); replaying the replies is the one
        # retry a damage-shaped difference gets: it passes if every layer then agrees, or as drift if
        # no replay does and one left only drift (_schedules_shape)
        schedules: tuple[Judgment, Schedule] | None = None
        for s in turn_schedules(sched, inputs.n_tokens, spans, checkpoints) if recompute else []:
            assert recompute is not None
            until = computes_alike_until(sched, s, inputs.n_tokens)
            if over_limit_before(j, until)[0]:
                # a layer over the limit before the replay computes anything otherwise keeps it
                _skipped(s, until, tried)
                continue
            got = _judge_schedule(file_body, recompute, s, again, tried)
            if got is None or find_misplaced(file_body, got[1], got[0], inputs.tokens):
                continue
            jr = got[0]
            if not jr.problems:
                ev = f"replaying the replies ({s.label()}) leaves every layer within its floors"
                return Outcome(jr, s, "schedule", ev, tried)
            if schedules is None and _schedules_shape(j, jr, first_block):
                schedules = (jr, s)
        if schedules is not None:
            # the damage shape was the schedule's: a generated position the server decoded on its
            # own thread count (-t 3, -fa on: flash attention splits a one-token decode over 512 or
            # more cells into a chunk per thread) that amplifies any difference (a 713-token chat's
            # position 704: one K element 5.4 times its noise and a V row 1.41 times as long against
            # a prefill, 4.24 floors as drift with the last reply replayed on one thread).  A byte
            # change differs from every recompute alike: it would stay damage-shaped
            jr, s = schedules
            changed = _changed_token([(j, sched), (jr, s)], file_body, first_block, tried)
            if changed is not None:
                return changed
            ev = (
                f"{shape.evidence} against the first recompute ({j.margin:.3g} floors), but replaying the "
                f"replies ({s.label()}) leaves drift at {jr.margin:.3g} floors with the first layer agreeing: "
                "the schedule's, not the bytes'"
            )
            return Outcome(jr, s, "drift", ev, tried, drift=True)
        if not j.byte_damage:
            named = _named_token(j, sched, file_body, first_block, tried)
            if named is not None:
                return named
        return Outcome(j, sched, "bytes" if j.byte_damage else "shape", shape.evidence, tried)
    best, best_s = j, sched
    judged = [(j, sched)]  # every recompute's judgment with its schedule
    fd = first_difference(j)
    swa = any(b.role == "kv-swa" for b in file_body.blocks)
    # another build's kernels part from this one's at the first tokens (positions 2-3 where
    # attention first sums four or more terms: an AVX-512 server's files against an AVX2
    # library), though its drift may reach CORROBORATE floors only much later (position 1,371)
    build = (shape.onset is not None and shape.onset <= 2 * NEAR) or (fd is not None and fd <= 2 * NEAR)
    # nor are the replies a first difference would place (reply_schedules): from the first tokens
    # on, it is another build's; a 2,136-token file of a 4-slot server would decode 1,617 of its
    # tokens one per call
    settled = build and logits_ok
    # the file's own cells out of position order from where the state first differs: the server's
    # attention summed them in an order no recompute replays (each holds them in position
    # order), so with the first recompute's logits agreeing no retry can change the verdict (an
    # out-of-order unified-cache slot took 5 retries to pass so: 4.4 times a bare prefill)
    shuffled = out_of_order_from(file_body)
    if logits_ok and recompute is not None and shuffled is not None and fd is not None and fd >= shuffled:
        # but not a changed token: the order of sums moves the cell where the state parts by
        # rounding only (a 4-slot unified q8_0 slot, out of order from position 0, exact up to
        # 314; its token at 315 changed: 6.6 floors in K and 21.5 in V of model layer 5)
        changed = _changed_token([(j, sched)], file_body, first_block, tried)
        if changed is not None:
            return changed
        return Outcome(j, sched, "drift", f"{shape.evidence}; {_shuffled(shuffled)}; not retried", tried, drift=True)
    todo = candidate_schedules(
        sched, inputs.n_tokens, shape.onset, checkpoints, None if settled else fd, () if settled else spans
    )
    if settled and todo:
        # a drift from the first tokens with the logits agreeing (another build's kernels, another
        # placement of the cells) is one no split reproduces: every split retry of such files still
        # parted at position 1-3.  The splits give way to the replies the text shows, whose cells
        # the server computed one token per call on any build.  Six clean long files
        # drifting from position 2-3 (default 4-slot servers' slots; v4 files against the portable
        # library) took 1-4 split retries each, none closer than the first recompute (15-41 s);
        # their reply replays brought one from 74.8 to 16.5 floors, and two -t 3 / -t 6 chats
        # with flash attention, parting at position 1, from 7.0 and 7.8 to 3.08: a pass
        todo = turn_schedules(sched, inputs.n_tokens, spans, checkpoints)
    if swa and not sched.swa_full and fd is not None and fd >= sched.n_ubatch:
        # a sliding-window cache of n_swa + n_ubatch cells reuses cells from there on and sums
        # them in another order; a --swa-full server's never does (the file does not say which:
        # it saves the window's cells either way): a --swa-full long document agrees exactly up
        # to position 1,027 with the default cache and in 2,045 of 2,048 cells with a full one
        todo.insert(0, Schedule(sched.n_batch, sched.n_ubatch, sched.cuts, sched.stepwise, True))
    # parting before the first recompute's own window reuses a cell, past where a smaller -ub's
    # would (n_swa + n_ubatch cells each): the server's window reused cells first, so it was
    # smaller, not whole (a -ub 128 server's 2,056-token file: exact up to position 776 against
    # -ub 512's window of 1,024 cells; a whole-context window took it from 57 to 5.9 floors, and
    # so did every smaller split that kept one, while -ub 256, 128 or 64, each with its own
    # window, pass at 1.27-1.39).  Such a split comes first where the state parts past the first
    # recompute's first micro-batch (as for the whole-context retry; within it, a reply from
    # the first difference comes first, then the splits by their boundaries), unless a reply
    # the text shows starts there
    wraps = window_wraps(file_body, sched.n_ubatch)
    if wraps is not None and window is not None:
        # the window as the recompute sized it: padded to 256 cells (a -ub 128 window of Gemma 3's
        # 512 + 128 cells holds 768 and first reuses one at 768, not 640), none where it holds them all
        wraps = window.cells(sched) if window.cells(sched) < inputs.n_tokens else None
    smaller_window = wraps is not None and fd is not None and fd < wraps
    if smaller_window and fd is not None and wraps is not None and fd >= sched.n_ubatch:
        n_swa = wraps - sched.n_ubatch
        split = _smaller_window_split(
            todo, sched, fd, window.cells if window is not None else lambda s: n_swa + s.n_ubatch
        )
        if split is not None and not any(abs(fd - a) <= NEAR for a, _ in spans):
            todo.remove(split)
            todo.insert(0, split)
    # the whole-context window moved the state (its margin at least halved): every later retry
    # keeps it (a first recompute closer by less, as a -ub 64 server's file at 62 -> 51 floors,
    # is not told from chance, and its split then passes only without it), but a smaller -ub's
    # where the server's window was smaller (above)
    full = False
    # a position that a replay decoding it one token per call reproduced, past where the first
    # recompute differed: the server generated it, so no schedule that computes it in a larger
    # ubatch can agree there (an edited chat's 1,607 tokens: the replies replayed moved the first
    # difference from 370 to 972, and 5 more recomputes that prefill positions 373-971, 30 of deep's
    # 56 seconds, came out as far as the first); or the start of a reply the text shows where a
    # split that moved the first difference parts: it found the prompt's split (_generated)
    generated: int | None = None
    generated_by = sched  # the retry that found it
    # a lone cell a replay left past an earlier reply it prefilled, with the reply's start: the
    # verdict unless a later replay that decodes that reply too clears it (below)
    deferred: tuple[Outcome, int, Schedule] | None = None
    saved = saved_replies(spans, inputs.n_tokens)
    for k, s in enumerate(todo if recompute else []):
        assert recompute is not None
        if generated is not None and not s.decodes_one_per_call(generated):
            continue
        # a larger -ub's own window (n_swa + n_ubatch cells) is what it replays: not a full one
        keeps = s.n_ubatch == sched.n_ubatch or (s.n_ubatch < sched.n_ubatch and not smaller_window)
        s = dataclasses.replace(s, swa_full=s.swa_full or (full and keeps))
        ruled_out = window_rules_out(window, sched, s, inputs.n_tokens, fd)
        if ruled_out is not None:
            # the first recompute reproduced the server's state past where this schedule's window
            # computes otherwise (a v3 -t 4 long document, exact up to 1,502 with a 1,024-cell
            # window: a --swa-full retry and 4 smaller -ub, whose 768 cells part at 774, were 5
            # of its 9 recomputes; a q8_0 twin's 5 of 9 too, none of them closer)
            tried.append({**s.as_dict(), "skipped": ruled_out})
            continue
        until = computes_alike_until(sched, s, inputs.n_tokens)
        layers, worst = over_limit_before(j, until)
        if layers >= COHERENT_LAYERS and worst * SCHEDULE_DEPENDENT > j.margin:
            # the drift is already over the limit in several layers before this schedule computes
            # anything otherwise (a reply replayed at the end of a long document, parting at
            # 17 or 513): its recompute agrees with the first there bit for bit, so it keeps those
            # layers failing, cannot halve the margin, and leaves no lone damage-shaped layer
            _skipped(s, until, tried)
            continue
        got = _judge_schedule(file_body, recompute, s, again, tried)
        if got is None:
            continue
        jr = got[0]
        judged.append((jr, s))
        if generated is None and fd is not None:
            parts = first_difference(jr) or inputs.n_tokens
            generated = _generated(s, fd, parts, saved)
            generated_by = s if generated is not None else generated_by
        # a retry that parts before the first recompute did computes those positions otherwise than the
        # server (the first recompute reproduced them bit for bit), so it replays none of the state
        # there and what it leaves is its own: a --swa-full retry of a default window's file sums
        # the window otherwise from n_swa + n_ubatch on (a v3 -ctk q5_1 long document: exact up to
        # position 2,005 first, 1,028 with --swa-full, and a lone V cell there at 7.6 floors)
        fd_r = first_difference(jr)
        replays = fd is None or fd_r is None or fd_r >= fd
        # nor is a whole-context window that parts earlier the server's, however much closer it
        # comes: the later retries keep the first recompute's window (a v3 -ctk q4_1 long document,
        # exact up to its first reply at 2,005: --swa-full, parting at 1,026, took it from 18.3 to
        # 5.4 floors, and the replays of its replies and 4 smaller -ub that kept it came out no
        # closer: 9 recomputes, 9.4 times a bare prefill)
        full = full or (s.swa_full and replays and jr.margin * SCHEDULE_DEPENDENT <= j.margin)
        alone = (
            drift_shape(jr, first_block=first_block) if replays and 0 < len(jr.problems) <= len(j.problems) else None
        )
        if deferred is not None and replays and _replays_more(s, deferred[2], deferred[1], swa_full=True):
            # the same replay decoding the earlier reply too decides: a lone cell it leaves fails,
            # drift clears the one the replay before it left
            if alone is not None and not alone.drift:
                return _left_alone(jr, s, alone, tried)
            deferred = None
        if alone is not None and not alone.drift:
            # this recompute replays the drift the first one showed, and what it leaves is shaped
            # like damage (a cell no other layer follows): the later retries, which do not replay
            # the file, would drown it in their drift again, and a cell whose ratio moves between
            # recomputes reads as drift (a -ub 128 server's long file with 16 bytes of a SWA V
            # layer zeroed: 4.7 floors alone with -ub 256, passed as drift after 9 recomputes).
            # No retry of the clean files left such a shape (41 files, 127 retries, v3 and v4)
            earlier = _unreplayed_reply(s, saved, alone.at)
            if earlier is None or not any(_replays_more(x, s, earlier) for x in todo[k + 1 :]):
                return _left_alone(jr, s, alone, tried)
            # but not a reply replay's cell past an earlier reply it prefilled, while the same
            # replay decoding that reply too is still to come: the server decoded that reply one
            # token per call, so the state from there on is not this replay's to reproduce (a v3
            # -ub 4096 -fa off long document, its second reply replayed with a whole-context
            # window: a lone K element of window layer 5 at 2,143, in that reply, 5.92 times its
            # noise against a limit of 5.29; the first reply, at 2,014, prefilled)
            deferred = (_left_alone(jr, s, alone, tried), earlier, s)
        if (len(jr.problems), jr.margin) < (len(best.problems), best.margin):
            best, best_s = jr, s
        if not jr.problems:
            return Outcome(
                jr, s, "schedule", f"replaying the split {s.label()} leaves every layer within its floors", tried
            )
    if deferred is not None:
        return deferred[0]
    changed = _changed_token(judged, file_body, first_block, tried)
    if changed is not None:
        return changed
    final = drift_shape(best, others=tuple(x for x, _ in judged if x is not best), first_block=first_block)
    if not final.drift:
        return Outcome(best, best_s, "shape", final.evidence, tried)
    # drift that is left must show it: a split that moved it (the state depends on how the
    # prompt was cut), or an onset at the first tokens (another build's kernels differ there)
    # or a replay that decoded the server's generated tokens one per call reproduced the state past
    # where the first recompute parted (the later schedules, which prefill those tokens, were not
    # tried: see ``generated``), with the first layer, a function of the tokens, agreeing throughout
    shown = best.margin * SCHEDULE_DEPENDENT <= j.margin or build
    replayed = generated is not None and first_layer_agrees(best, first_block)
    if shown or replayed:
        ev = f"{final.evidence}; closest split {best_s.label()} at {best.margin:.3g} floors"
        if not shown:
            if generated_by.decodes_one_per_call(generated or 0):
                ev += f"; decoding the generated tokens one per call reproduces the state past position {fd}"
            else:
                ev += f"; {generated_by.label()} reproduces the state past position {fd} up to the reply at {generated}"
        return Outcome(best, best_s, "drift", ev, tried, drift=True)
    # or a quantized cache: its coarse steps hide where another build's computation parts (a
    # q8_0 default 4-slot server's 2,136-token file agrees exactly up to position 69 where its
    # f16 twin parts at 3; other builds' q8_0 files: 2, 32, 75, 89, 1,024, 2,003), so where the
    # state stops agreeing exactly cannot tell another build from damage there
    # (only after splits were tried: a caller without them, the appendix blobs' first judgment,
    # tries its own on an unmoved difference)
    if quantized_kv(file_body) and recompute is not None:
        ev = (
            f"{final.evidence}; closest split {best_s.label()} at {best.margin:.3g} floors; the cache is quantized, "
            f"so agreeing exactly up to position {fd} does not rule out another build's drift from the first tokens"
        )
        return Outcome(best, best_s, "drift", ev, tried, drift=True)
    # or the file's own cells: out of position order from where the state first differs, they
    # were summed in another order than any recompute's (which places them in position order)
    if shuffled is not None and fd is not None and fd >= shuffled:
        return Outcome(best, best_s, "drift", f"{final.evidence}; {_shuffled(shuffled)}", tried, drift=True)
    # or a cache of one stream (unified, or one slot): the server gave this slot's tokens
    # whatever cells were free, among other slots' cells or holes, and the file keeps only their
    # order, so attention summed them in another grouping, from where it first reached a hole (a
    # 4-slot unified v3 server's multi-turn slot: cells in position order, the state exact up to
    # position 17, 17 floors; the same tokens recomputed around holes: exact up to 49, 18.5).  The
    # cells' placement reaches no first layer (a function of the token and its position): where
    # that agrees at every position, no token changed
    if single_stream(file_body) and first_layer_agrees(best, first_block) and recompute is not None:
        ev = (
            f"{final.evidence}; closest split {best_s.label()} at {best.margin:.3g} floors; the cache has one "
            "stream (a unified cache shared by concurrent slots, or one slot), so the server may have placed "
            "this slot's cells among others' (the file keeps only their order) and summed them in another "
            "grouping; the first layer agrees at every position"
        )
        return Outcome(best, best_s, "drift", ev, tried, drift=True)
    # or a cache of one stream per slot (-np N without a unified cache): concurrent slots' prompts
    # shared the server's batches (server_context_impl::update_slots fills one batch from every
    # slot), and llama_batch_allocr::split_equal cuts such a batch into equal per-slot pieces, so
    # this slot's ubatch sizes depend on when the other requests arrived, which the file does not
    # keep (a 4-slot server's long slots: the state exact up to position 513, then 49.6 and 66.5
    # floors, 10 recomputes moving none).  A token changed before the sliding window (which the
    # first layer would show) looks the same there, so the positions from the first difference
    # are left unverified (deep-unreplayed, an unchecked part), not passed and not failed
    if streams_per_slot(file_body) and first_layer_agrees(best, first_block) and recompute is not None:
        at = next(x for x in (fd, first_difference(best), inputs.n_tokens) if x is not None)  # the first agreed to fd
        ev = (
            f"{final.evidence}; closest split {best_s.label()} at {best.margin:.3g} floors; the cache has one stream "
            "per slot, so concurrent slots' prompts may have shared the server's batches, cut into per-slot pieces "
            "whose sizes depend on when the requests arrived; the first layer agrees at every position it holds"
        )
        return Outcome(best, best_s, "drift", ev, tried, drift=True, unreplayed=at)
    ev = (
        f"spread like drift from position {shape.onset}, but no split tried moves it ({j.margin:.3g} floors "
        f"first, {best.margin:.3g} at best with {recomputes(tried)} recomputes) and the state agrees exactly up to "
        f"position {fd}, where another build's drift starts at the first tokens: damage"
    )
    return Outcome(best, best_s, "shape", ev, tried, unmoved=True)


def shifted_from(j: Judgment, body: Body, first_block: str | None, limit: float = MARGIN_LIMIT) -> int | None:
    """The position from which the server shifted this slot's cells back (None: the difference
    does not have that shape).  ``llama_kv_cache::seq_add`` moves cells to earlier positions
    without recomputing them: a context shift (``--context-shift``, server_context::pre_decode:
    ``seq_rm(n_keep, n_keep + n_discard)`` then ``seq_add(.., -n_discard)``, and the token list
    compacted) and a reused chunk (``--cache-reuse``, update_slots: a chunk of the cached prompt
    found later in the new one).  Those cells, and every cell computed after them, attended to
    tokens the file no longer holds, so no recompute of its tokens gives them: every layer
    above the first differs there by far more than drift (a 2-layer llama's context shift: 133
    floors).  The shape, every part required:

    * only value differences (no zeros, non-finite values, spikes or scaled rows), all in KV
      blocks (recurrent memory cannot shift: ``llama_memory_can_shift``);
    * the model's first layer within its floors at every position: K and V of a cell there are
      a function of its token and position alone (the shift re-rotates K:
      ``llama_kv_cache::build_graph_shift``), so no token changed;
    * every position before the onset (the first one over ``limit``) within the limit, and the
      onset where the file's cells break their order: the cell holding it does not follow the
      one holding the position before (``state_write`` keeps cell order, ``seq_add`` changes
      positions, not cells, and the cells it freed took later tokens), or the first layer's K
      differs by rounding from there on and not before (the shift's second rounding);
    * from the onset on, every layer above the first that differs at all differs in K and in V
      (where it stores V), and at least two such layers do (one where the model has only one):
      damage in the bytes sits in one layer's K or V."""
    if j.byte_damage or any(p[0] != ProblemCode.DEEP_MISMATCH for p in j.problems):
        return None
    if any(b.kind != MemoryKind.KV for b in body.blocks) or not first_layer_agrees(j, first_block):
        return None
    m, runs = _position_matrix(j.cells)
    if not runs:
        return None
    over = np.flatnonzero(np.nan_to_num(m).max(axis=0) > limit)
    onset = int(over[0]) if over.size else 0
    if onset < 1 or not (_order_breaks_at(body, onset) or _rerotated_from(m, runs, onset, first_block)):
        return None
    r = np.nan_to_num(m[:, onset:])
    differs = {(x.block, x.layer, x.part) for k, x in enumerate(runs) if float(r[k].max()) > CORROBORATE}
    above = {(x.block, x.layer) for x in runs if not _is_first_layer(x, first_block)}
    layers = {(b, ly) for b, ly, _ in differs} & above
    has_v = {(x.block, x.layer) for x in runs if x.part == "V"}
    whole = all((b, ly, "K") in differs and ((b, ly) not in has_v or (b, ly, "V") in differs) for b, ly in layers)
    return onset if whole and len(layers) >= min(2, len(above)) and layers else None


def _changed_token(
    judged: Sequence[tuple[Judgment, Schedule]], file_body: Body, first_block: str | None, tried: list[dict[str, Any]]
) -> Outcome | None:
    """The first of ``judged`` (judgments with their schedules) that shows a changed token
    (:func:`changed_token_at`), as the outcome that fails the state; None: none does."""
    for jt, st in judged:
        at = changed_token_at(jt, file_body, first_block)
        if at is not None:
            ev = (
                f"changed token: the state agrees exactly with the recompute ({st.label()}) up to position {at - 1}, "
                f"and at {at} the lowest layer holding it differs beyond the limit in K and V, the positions after "
                "it less: that position's own input differs, not the sums over the cells before it"
            )
            return Outcome(jt, st, "shape", ev, tried)
    low_bit = low_bit_k(file_body)
    spikes = [set(spiked_tokens(jt, first_block, low_bit=low_bit)) for jt, _ in judged]
    common = sorted(set.intersection(*spikes)) if spikes else []
    if common:
        at = common[0]
        jt, st = judged[0]
        beyond = "beyond its floors (a low-bit K cache)" if low_bit else "beyond the limit"
        times = token_spike_rule(low_bit)[1]
        ev = (
            f"changed token: at position {at}, which no first layer holds, the lowest layer holding it differs "
            f"{beyond} and at least {times:g} times the median of the {BACKGROUND} positions before "
            f"it, in V there and in K at {at + 1}, in every recompute ({len(judged)}), the positions after it "
            "closer: that position's own input differs, not the drift of the sums before it"
        )
        return Outcome(jt, st, "shape", ev, tried)
    return None


def _named_token(
    j: Judgment, sched: Schedule, file_body: Body, first_block: str | None, tried: list[dict[str, Any]]
) -> Outcome | None:
    """A damage-shaped difference (it fails either way) that begins as a changed token does, as
    that (:func:`_changed_token`, and :func:`changed_token_at` with a low-bit K cache's rule), not
    as the cell it also left somewhere downstream.  A token changed before Gemma 3's window in a
    ``-ctk q4_0`` state: exact up to the token, model layer 5's V 12.7 floors at it and K 2.0 at the
    next position, and an isolated V cell 270 positions on at 7.7 floors that the evidence named
    (on an AMD EPYC; the same copy on an Intel Xeon read as drift)."""
    changed = _changed_token([(j, sched)], file_body, first_block, tried)
    if changed is not None or not low_bit_k(file_body):
        return changed
    at = changed_token_at(j, file_body, first_block, low_bit=True)
    if at is None:
        return None
    ev = (
        f"changed token: the state agrees exactly with the recompute ({sched.label()}) up to position {at - 1}, "
        f"and at {at} the lowest layer holding it differs beyond the limit in V and beyond its floor in K (a "
        "low-bit K cache), the positions after it less: that position's own input differs"
    )
    return Outcome(j, sched, "shape", ev, tried)


def spiked_tokens(j: Judgment, first_block: str | None, low_bit: bool = False) -> list[int]:
    """Positions whose own token differs in a state that drifts (another build's computation,
    which parts from this one's at the first tokens, so :func:`changed_token_at` finds no exact
    prefix), where no first layer holds them (before Gemma 3's sliding window).  The lowest
    layer of a block holding position ``p``: its V at ``p`` and its K at ``p + 1`` (the next cell
    attends to the changed one in every window layer below) each beyond the limit and
    :data:`TOKEN_SPIKE` times the median of the :data:`BACKGROUND` positions before ``p``, and
    the positions 8-32 after it at most half as far off (a context shift keeps them as far:
    ``seq_add`` moved every cell from there).  Measured on v4 Gemma 3 files of this machine's
    native server against the portable library (bench/detect-cross-build-token.md): no position of
    33 clean long files (1,604-2,176 tokens, 72 recomputes) is over the limit in V and in K at the
    next one and comes back after (the nearest: the first positions of a drift that grows, 32-62,
    whose later positions stay 1.3 times as far off or more); without the limit, the clean maximum of the
    ratio is 2.3.  Changed tokens before the window: 12-283 times, the lowest over each copy's
    recomputes (13 of 14 copies; the 14th has a q4_0 K cache, whose K at the next position stays
    at 2.2 floors).  ``low_bit``: the K cache is low-bit (:func:`low_bit_k`), whose floors are the
    quantization's, so a changed token's K at the next position need not reach the limit (nor its
    V): beyond one floor each and :data:`TOKEN_SPIKE_LOW_BIT` times the background instead."""
    held_first, lowest = lowest_layers(j, first_block)
    if held_first.size <= BACKGROUND + 1:
        return []
    limit, times = token_spike_rule(low_bit)
    return sorted({p for _block, k, v in lowest for p in _spikes(k, v, held_first, limit, times)})


def lowest_layers(j: Judgment, first_block: str | None) -> tuple[np.ndarray, list[tuple[str, np.ndarray, np.ndarray]]]:
    """Where the model's first layer (layer 0 of ``first_block``) holds a position, by position,
    and the lowest layer (layer 0) of every other block with K and V: its block, K and V ratios
    by position (NaN where not held).  None of either without ``first_block``."""
    m, runs = _position_matrix(j.cells)
    if first_block is None or not runs:
        return np.zeros(0, bool), []
    held_first = np.zeros(m.shape[1], bool)
    for k, x in enumerate(runs):
        if _is_first_layer(x, first_block):
            held_first |= ~np.isnan(m[k])
    out = []
    for block in sorted({x.block for x in runs if x.block != first_block}):
        kk = [k for k, x in enumerate(runs) if (x.block, x.layer, x.part) == (block, 0, "K")]
        kv = [k for k, x in enumerate(runs) if (x.block, x.layer, x.part) == (block, 0, "V")]
        if len(kk) == 1 and len(kv) == 1:
            out.append((block, m[kk[0]], m[kv[0]]))
    return held_first, out


def _spikes(k: np.ndarray, v: np.ndarray, held_first: np.ndarray, limit: float, times: float) -> set[int]:
    """The positions ``p`` of :func:`spiked_tokens` in one block's lowest layer (``k``, ``v``:
    its ratios by position, NaN where not held): beyond ``limit`` and ``times`` the background."""
    s = spike_scores(k, v, held_first)
    ok = (s["v_at"] > limit) & (s["k_next"] > limit) & (np.minimum(s["v_times"], s["k_times"]) >= times)
    ok &= 2 * np.nan_to_num(s["after"]) <= np.minimum(s["v_at"], s["k_next"])
    return {int(p) for p in s["p"][ok]}


def spike_scores(k: np.ndarray, v: np.ndarray, held_first: np.ndarray) -> dict[str, np.ndarray]:
    """What :func:`spiked_tokens` weighs at each position ``p`` that no first layer holds
    (``held_first``), with :data:`BACKGROUND` positions before it and one after, in one block's
    lowest layer (``k``, ``v``: its ratios by position, NaN where not held): ``v_at`` (V at
    ``p``), ``k_next`` (K at ``p + 1``), each over the median of the background before ``p``
    (``v_times``, ``k_times``; the median taken at least :data:`MIN_BACKGROUND`), and ``after``,
    the median of K and V's larger at the positions 8-32 after ``p`` (NaN: none held)."""
    q = np.arange(BACKGROUND, k.size - 1)
    q = q[~held_first[q]]
    win = np.lib.stride_tricks.sliding_window_view
    with np.errstate(all="ignore"):
        bk = np.nanmedian(win(k, BACKGROUND)[q - BACKGROUND], axis=1)
        bv = np.nanmedian(win(v, BACKGROUND)[q - BACKGROUND], axis=1)
        top = np.concatenate([np.fmax(k, v), np.full(4 * NEAR, np.nan)])
        ahead = np.nanmedian(win(top, 3 * NEAR)[q + NEAR], axis=1)
    v_at, k_next = np.nan_to_num(v[q]), np.nan_to_num(k[q + 1])
    return {
        "p": q,
        "v_at": v_at,
        "k_next": k_next,
        "v_times": v_at / np.maximum(np.nan_to_num(bv), MIN_BACKGROUND),
        "k_times": k_next / np.maximum(np.nan_to_num(bk), MIN_BACKGROUND),
        "after": ahead,
    }


def changed_token_at(
    j: Judgment, body: Body, first_block: str | None, limit: float = MARGIN_LIMIT, low_bit: bool = False
) -> int | None:
    """The position whose own input differs (a changed token) where no first layer holds it: the
    state agrees exactly with the recompute of ``j`` up to ``p - 1`` (past the first tokens, where
    another build parts), and at ``p`` the lowest layer of every block holding ``p`` differs beyond
    ``limit`` in K and in V, while the positions after it come back towards the recompute (the
    jump at ``p`` at least twice their median: later tokens attend to it among all the others).
    With every earlier cell equal, the lowest layer's cell at ``p`` depends on the cells before it
    and on ``p``'s own token alone; a split, a cell placement or another order of sums moves it by
    rounding (clean files of this machine's servers: at most 0.80 floors there, 59 files, 151
    recomputes).  A 2,056-token file with its token at 1,362 changed (before Gemma 3's 512-token
    window, so only model layer 5, the base block's layer 0, holds it): 5.6 floors in K and 23.7 in
    V, exact before.  Not where the cells were shifted (``seq_add``): the file's cell order breaks
    there or the first layer's K, rotated again, is off exactly at the positions it holds from
    ``p`` on (a context shift keeping 40 tokens: 23 floors at 41, the window's K 0.04 off).

    ``low_bit``: the K cache is low-bit (:func:`low_bit_k`), whose floor is the quantization's step,
    so a changed token's K moves by about one floor (q4_0: 1.1 at ``p``, 2.0 at ``p + 1``, V 12.7 at
    ``p``): K beyond one floor at ``p`` or ``p + 1`` and V beyond ``limit`` at ``p``, the positions
    after it measured against V.  Only for naming what fails anyway (:func:`_named_token`): no
    clean file was measured against it."""
    p = first_difference(j)
    if p is None or p <= 2 * NEAR or _order_breaks_at(body, p):
        return None
    m, runs = _position_matrix(j.cells)
    if p >= m.shape[1]:
        return None
    lowest: dict[str, dict[str, int]] = {}
    for k, x in enumerate(runs):
        if x.layer == 0 and not np.isnan(m[k, p]):
            lowest.setdefault(x.block, {})[x.part] = k
    if not lowest or any(set(parts) != {"K", "V"} for parts in lowest.values()):
        return None
    for parts in lowest.values():
        k_p, v_p = float(m[parts["K"], p]), float(m[parts["V"], p])
        if low_bit:
            k_next = float(np.nan_to_num(m[parts["K"], p + 1])) if p + 1 < m.shape[1] else 0.0
            jump = v_p if max(k_p, k_next) > 1.0 else 0.0
        else:
            jump = min(k_p, v_p)
        if jump <= limit:
            return None
        ks = [parts["K"], parts["V"]]
        after = np.nanmax(m[ks, p + NEAR : p + 4 * NEAR], axis=0) if p + NEAR < m.shape[1] else np.zeros(0)
        after = after[~np.isnan(after)]
        if after.size and 2 * median(after) > jump:
            return None
    firsts = [k for k, x in enumerate(runs) if _is_first_layer(x, first_block) and x.part == "K"]
    if any(float(np.nan_to_num(m[k, p:]).max()) > EXACT for k in firsts):
        return None
    return p


def _order_breaks_at(body: Body, p: int) -> bool:
    """Whether a KV stream of ``body`` holds positions ``p - 1`` and ``p`` in cells that are not
    one after the other in the file's cell order."""
    for b in body.blocks:
        for st in b.active_streams():
            idx = {int(q): i for i, q in enumerate(st.positions)}
            if p - 1 in idx and p in idx and idx[p] != idx[p - 1] + 1:
                return True
    return False


def _rerotated_from(m: np.ndarray, runs: list[RunCells], p: int, first_block: str | None) -> bool:
    """Whether the first layer's K agrees exactly (within :data:`EXACT` floors) before ``p`` and
    differs from the recompute at ``p`` (by rounding: the caller has it within its floors):
    ``build_graph_shift`` rotated the stored K of the shifted cells a second time."""
    ks = [k for k, x in enumerate(runs) if _is_first_layer(x, first_block) and x.part == "K"]
    return bool(ks) and all(
        not np.isnan(m[k, p]) and m[k, p] > EXACT and bool(np.all(np.nan_to_num(m[k, :p]) <= EXACT)) for k in ks
    )


def _shuffled(at: int) -> str:
    return (
        f"the file's cells are out of position order from position {at} (a cache shared with concurrent "
        "slots), so the server's attention summed them in another order"
    )


def out_of_order_from(body: Body) -> int | None:
    """The first position whose cell is out of position order, in a KV stream holding every
    position from 0 (None: all in order).  A unified cache shared by concurrent slots gives a
    slot's later positions whatever cells are free (``llama_kv_cache::find_slot``), and
    ``llama_state_seq_save_file`` writes the cells in cell order: a v3 server's slot 0 of 4 holds
    positions 0..49, 76..78, 50..75, 79..124, and its state agrees exactly with a recompute up to
    position 51.  (A sliding-window ring that wrapped no longer holds position 0.)"""
    first: int | None = None
    for b in body.blocks:
        for st in b.active_streams():
            pos = st.positions
            if pos.size and holds_every_position(pos, pos.size):
                bad = np.flatnonzero(pos != np.arange(pos.size))
                if bad.size:
                    first = int(bad[0]) if first is None else min(first, int(bad[0]))
    return first


def _smaller_window_split(
    todo: list[Schedule], first: Schedule, fd: int, cells: Callable[[Schedule], int]
) -> Schedule | None:
    """The first split of ``todo`` with a smaller ``-ub`` than ``first`` whose own window
    (``cells(split)``: :meth:`WindowCache.cells`, or ``n_swa + n_ubatch`` where the recompute's
    window is unknown) reuses cells by the first difference ``fd`` (NEAR allowed); None: none."""
    return next(
        (
            s
            for s in todo
            if s.n_ubatch < first.n_ubatch and not s.stepwise and not s.swa_full and cells(s) <= fd + NEAR
        ),
        None,
    )


def window_wraps(body: Body, n_ubatch: int) -> int | None:
    """The position from which a sliding-window cache of ``n_ubatch``'s size reuses cells: its
    ``n_swa + n_ubatch`` cells (``llama_kv_cache_iswa``: padded up to ``n_pad`` where a tree
    pads, and ``n_swa * n_seq_max`` in a unified cache, so this is the earliest it can be), with
    the file's window standing for ``n_swa``: ``llama_kv_cache::state_write`` keeps the cells
    within ``n_swa`` of the last position, all of them once the slot is longer than that.  None:
    no sliding window, or a slot no longer than it (no window of any ``-ub`` reused a cell)."""
    kv = [b for b in body.blocks if b.kind == MemoryKind.KV]
    swa = [s for b in kv if b.role == "kv-swa" for s in b.active_streams()]
    longest = max((s.cell_count for b in kv if b.role != "kv-swa" for s in b.active_streams()), default=0)
    n_swa = max((s.cell_count for s in swa), default=0)
    return n_swa + n_ubatch if swa and longest > n_swa else None


@dataclass(frozen=True)
class WindowCache:
    """What sizes a recompute context's sliding-window cache: the model's window ``n_swa`` (the
    file's window standing for it: :func:`window_wraps`), the sequences sharing it (``n_seq_max``
    in a unified cache, else 1), the cells per stream (``n_ctx_seq``) and the padding."""

    n_swa: int
    n_seqs: int
    n_ctx_seq: int
    pad: int = SWA_PAD

    def cells(self, s: Schedule) -> int:
        """The window cache's cells with schedule ``s``: ``GGML_PAD(min(size_base, n_swa *
        n_seqs + n_ubatch), 256)`` (``llama_kv_cache_iswa::llama_kv_cache_iswa``, state versions 3
        and 4 alike), the whole context with ``swa_full``."""
        if s.swa_full:
            return self.n_ctx_seq
        size = min(self.n_ctx_seq, self.n_swa * max(1, self.n_seqs) + s.n_ubatch)
        return -(-size // self.pad) * self.pad


def window_cache(body: Body, n_seqs: int, n_ctx_seq: int) -> WindowCache | None:
    """The :class:`WindowCache` of a context for ``body`` (None: no sliding window, or a slot no
    longer than it)."""
    wraps = window_wraps(body, 0)
    return None if wraps is None else WindowCache(wraps, n_seqs, n_ctx_seq)


def window_rules_out(
    window: WindowCache | None, first: Schedule, s: Schedule, n_tokens: int, fd: int | None
) -> str | None:
    """Why ``s``'s sliding-window cache rules it out as a retry, or None (also where ``window`` is
    None: unknown).  Where the ``first`` recompute reproduced the state bit for bit (up to
    ``fd``) past where ``s``'s window or its own first reuses a cell, ``s`` cannot be the server's
    schedule: two window caches of another size part there, the smaller one summing its cells
    in another order from it (a --swa-full retry parts from a 1,024-cell window's at
    1,026-1,028, f16, q8_0 and q4_1; a smaller -ub's 768 cells from it at 774), so the server's
    window was the first recompute's size (:data:`WINDOW_PARTS` allowed).  And a whole-context
    retry of the first's split where the first's window holds every token computes as it did."""
    if window is None:
        return None
    a, b = window.cells(first), window.cells(s)
    if a >= n_tokens and dataclasses.replace(s, swa_full=first.swa_full) == first:
        return f"its window computes as the first recompute's {a} cells, which hold every token"
    reuse = min(a, b)
    if a == b or reuse >= n_tokens or fd is None or fd <= reuse + WINDOW_PARTS:
        return None
    return (
        f"its window of {b} cells computes otherwise than the first recompute's {a} from position {reuse}, "
        f"and the first recompute reproduced the state up to {fd}"
    )


def single_stream(body: Body) -> bool:
    """Whether every KV block of ``body`` has one stream: a unified cache (``-kvu``, which every
    slot of the server shares) or a one-slot server's, where ``llama_kv_cache::find_slot`` may
    have given this slot's tokens cells scattered among other slots' (``n_stream`` in
    ``llama_kv_cache::state_write``; a non-unified multi-slot cache writes one stream per slot,
    each slot alone in its own)."""
    kv = [b for b in body.blocks if b.kind == MemoryKind.KV]
    return bool(kv) and all(len(b.streams) == 1 for b in kv)


def streams_per_slot(body: Body) -> bool:
    """Whether a KV block of ``body`` has several streams: a multi-slot server without a unified
    cache, which writes one stream per slot (``n_stream`` in ``llama_kv_cache::state_write``)."""
    return any(b.kind == MemoryKind.KV and len(b.streams) > 1 for b in body.blocks)


def _schedules_shape(first: Judgment, replay: Judgment, first_block: str | None) -> bool:
    """Whether a replay turned the first recompute's damage-shaped difference into drift: no
    byte damage left, the drift shape, the first layer agreeing at every position, and the
    margin at most 1 / :data:`SCHEDULE_DEPENDENT` of the first."""
    return (
        not replay.byte_damage
        and replay.margin * SCHEDULE_DEPENDENT <= first.margin
        and first_layer_agrees(replay, first_block)
        and drift_shape(replay, first_block=first_block).drift
    )


def first_layer_agrees(j: Judgment, first_block: str | None) -> bool:
    """Whether the model's first layer (layer 0 of ``first_block``; unknown: of every block), K
    and V, is within its floors at every position ``j`` holds: no token was changed, since that
    layer is a function of the token and its position alone."""
    runs = [c for c in j.cells if _is_first_layer(c, first_block)]
    return bool(runs) and all(c.positions is not None and bool(np.all(c.ratio <= 1.0)) for c in runs)


def _generated(s: Schedule, fd: int, fd2: int, replies: Sequence[tuple[int, int]] = ()) -> int | None:
    """The first position of ``[fd, fd2)`` that ``s`` decodes one token per call, when ``s``
    reproduced the state over that range, from the first recompute's first difference ``fd`` to
    its own ``fd2`` (None: it did not move the first difference, or prefilled the whole range);
    or ``fd2`` itself where ``s`` starts decoding one token per call there: it reproduced the
    state up to the server's first generated token of a reply and parts at it, which no other
    split computes alike (a -t 6 -fa on server's reply: flash attention splits a one-token
    decode's cells into a chunk per thread, ``ggml_compute_forward_flash_attn_ext_f16``; four
    smaller -ub after such a replay, 25 of deep's 67 seconds, each parted at 773 or 1).  Or, for
    a split that prefills them, the start of a reply the text shows (``replies``) where ``s``
    parts at it or up to :data:`NEAR` tokens into it: it reproduced the prompt bit for bit, and
    what follows the server generated one token per call (a v3 ``-ub 4096 -b 4096 -fa off`` long
    document: exact up to 1,029 first, up to its first reply at 2,014 with a whole-context
    window; the 7 splits after that parted at 2,014 or earlier, none closer)."""
    if fd2 <= fd:
        return None
    found = next((max(a, fd) for a, b in s.stepwise if a <= fd2 and b > fd), None)
    if found is not None or s.stepwise:
        return found
    return next((a for a, _b in replies if a <= fd2 <= a + NEAR), None)


def _judge_schedule(
    file_body: Body, recompute: Recompute, s: Schedule, inputs: DeepInputs, tried: list[dict[str, Any]]
) -> tuple[Judgment, Body] | None:
    """Recompute with schedule ``s`` and judge the file against it, noting the try in ``tried``
    (None: the recompute failed, its error noted)."""
    rec, why = recompute(s)
    if rec is None:
        tried.append({**s.as_dict(), "error": why})
        return None
    j = judge_layers(file_body, rec, inputs)
    tried.append(_tried(s, j))
    return j, rec


def _left_alone(jr: Judgment, s: Schedule, alone: Shape, tried: list[dict[str, Any]]) -> Outcome:
    """The failure a retry ``s`` that replays the rest of the state leaves: the damage-shaped cell
    ``alone`` of its judgment ``jr``."""
    ev = f"{alone.evidence}; the recompute {s.label()} replays the rest of the state"
    return Outcome(jr, s, "bytes" if jr.byte_damage else "shape", ev, tried)


def _replays_more(x: Schedule, s: Schedule, earlier: int, swa_full: bool = False) -> bool:
    """Whether ``x`` is the reply replay ``s`` (its split, and its window where ``swa_full``) that also
    decodes the reply starting at ``earlier`` one token per call."""
    return (
        bool(s.stepwise)
        and (x.n_batch, x.n_ubatch) == (s.n_batch, s.n_ubatch)
        and (not swa_full or x.swa_full == s.swa_full)
        and x.decodes_one_per_call(earlier)
        and all(x.decodes_one_per_call(a) for a, _b in s.stepwise)
    )


def _unreplayed_reply(s: Schedule, replies: Sequence[tuple[int, int]], at: int | None) -> int | None:
    """The start of the first reply the text shows (``replies``) that begins before position
    ``at`` and that ``s`` does not decode one token per call (None: none, or ``at`` unknown)."""
    if at is None:
        return None
    return next((a for a, _b in replies if a < at and not s.decodes_one_per_call(a)), None)


def _skipped(s: Schedule, until: int, tried: list[dict[str, Any]]) -> None:
    """Note in ``tried`` a schedule not recomputed: up to ``until`` it computes as the first
    recompute did, which fails there (:func:`computes_alike_until`, :func:`over_limit_before`)."""
    why = f"computes as the first recompute up to position {until}, which fails before it"
    tried.append({**s.as_dict(), "skipped": why})


def recomputes(tried: Sequence[dict[str, Any]]) -> int:
    """How many of the schedules in ``tried`` were recomputed (not skipped)."""
    return sum(1 for t in tried if "skipped" not in t)


def _tried(s: Schedule, j: Judgment) -> dict[str, Any]:
    """One ``schedules[]`` entry: the schedule, its margin, its problem count and the first position
    where a cell differs from that recompute (``first_difference``; None: none does)."""
    return {**s.as_dict(), "margin": j.margin, "problems": len(j.problems), "first_difference": first_difference(j)}


def low_bit_k(body: Body) -> bool:
    """Whether the body's K cache is stored in a low-bit type (q4_0, q5_1...: ``tolerance_class``
    "low-bit"), in any layer."""
    return any(tolerance_class(r.type_id) == "low-bit" for b in body.blocks for st in b.active_streams() for r in st.k)


def quantized_kv(body: Body) -> bool:
    """Whether every K and V layer the body holds is stored quantized (q8_0, q4_0...: not a float type)."""
    types = {r.type_id for b in body.blocks for st in b.active_streams() for r in (*st.k, *st.v)}
    return bool(types) and all(tolerance_class(t) != "float" for t in types)


# what deep still checks in the positions of cells the server shifted (the warning and the unchecked part say it)
SHIFTED_CHECKS = "the first layer (the tokens), zeros, non-finite values and outliers"


def commit_outcome(lv: Level, body: Body, outcome: Outcome) -> None:
    """The outcome's problems into ``lv``; a drift-shaped difference left after every schedule
    tried, or shifted cells, is one warning instead of its layer errors."""
    if outcome.shifted is not None:
        lv.warn(
            ProblemCode.DEEP_SHIFTED,
            "body",
            body.offset,
            f"positions {outcome.shifted} on not compared value by value: {len(outcome.judgment.problems)} "
            f"layer(s) differ there as cells the server shifted ({outcome.evidence}); checked there: {SHIFTED_CHECKS}",
        )
        return
    if not outcome.drift:
        outcome.judgment.commit(lv)
        return
    if outcome.unreplayed is not None:
        lv.warn(
            ProblemCode.DEEP_UNREPLAYED,
            "body",
            body.offset,
            f"positions {outcome.unreplayed} on not verified: {len(outcome.judgment.problems)} layer(s) differ there "
            f"from every recompute tried ({outcome.evidence}); a token changed before the first layer's window "
            "would look the same",
        )
        return
    lv.warn(
        ProblemCode.DEEP_DRIFT,
        "body",
        body.offset,
        f"{len(outcome.judgment.problems)} layer(s) exceed their noise floors with the shape of drift, "
        f"not damage ({outcome.evidence}){_SERVER_PIECES}",
    )


_SERVER_PIECES = (  # the cause a drift warning names while the next-token logits agree
    "; the server computed this state in pieces this recompute could not replay (a prefix from an "
    "earlier request, another build or instruction set)"
)
_NOT_ARITHMETIC = "; but the next-token logits fail (deep-logits): not another build's arithmetic"


def blame_not_arithmetic(message: str) -> str:
    """A drift warning's message once the body's next-token logits failed (slotfile.verify.deep):
    another build's drift leaves them within their floor, so the cause it named is ruled out."""
    return message.replace(_SERVER_PIECES, _NOT_ARITHMETIC)
