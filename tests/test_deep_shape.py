"""``verify --deep`` tells drift from damage by its shape (issue 25): cells matched by position,
zero runs in byte order, one flipped exponent, the drift shape across layers and the schedule
retries.  Damaged copies are built from the committed tiny Gemma 3 fixture with a seeded
generator; the unit tests need no llama.cpp, the ``llama`` ones run the real worker."""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from slotfile.format.reader import open_slot_file, parse_buffer
from slotfile.format.records import Body
from slotfile.format.types import TypeId
from slotfile.llama.settings import settings_for
from slotfile.problems import CheckLevel, ProblemCode
from slotfile.verify import deep, shape
from slotfile.verify.judge import ZERO_RUN, ZERO_RUN_FLOAT, DeepInputs, Judgment, RunCells, align_cells, judge_layers
from slotfile.verify.records import Level
from slotfile.verify.shape import (
    LARGER_UBATCH,
    MAX_RETRIES,
    MAX_STEPWISE,
    Schedule,
    candidate_schedules,
    changed_token_at,
    commit_outcome,
    computes_alike_until,
    drift_shape,
    first_difference,
    judge_with_schedules,
    larger_schedules,
    low_bit_k,
    micro_batches,
    out_of_order_from,
    over_limit_before,
    reply_schedules,
    spiked_tokens,
)
from slotfile.verify.stats import ZERO_SIGNIFICANT, _zero_run

from .conftest import MODELS, SLOTS

GEMMA = SLOTS / "gemma3_iswa_nofa.slot"  # tiny Gemma 3 iSWA, f16, V transposed (flash attention off)


def _last_v(sf):
    """The last V layer of the global (kv-base) block: 54 cells, transposed."""
    blk = next(b for b in sf.body.blocks if b.role == "kv-base")
    return blk.active_streams()[0].v[-1]


def zero_512(data: bytes) -> bytes:
    """512 bytes of the last global V layer zeroed, from its first sector boundary on."""
    run = _last_v(parse_buffer(data))
    start = -(-run.data.offset // 512) * 512
    assert start + 512 <= run.data.offset + run.n_cells * run.row_size
    out = bytearray(data)
    out[start : start + 512] = bytes(512)
    return bytes(out)


def flip_exponent(data: bytes, seed: int = 25) -> bytes:
    """One f16 value of the last global V layer, among the larger ones, with the top exponent
    bit flipped (a value near 2 becomes a denormal near 0)."""
    run = _last_v(parse_buffer(data))
    vals = np.frombuffer(data, np.float16, run.n_cells * run.row_size // 2, run.data.offset)
    big = np.flatnonzero(np.abs(vals) >= 0.5 * np.abs(vals).max())
    i = int(big[np.random.default_rng(seed).integers(big.size)])
    out = bytearray(data)
    off = run.data.offset + 2 * i
    word = int.from_bytes(out[off : off + 2], "little") ^ 0x4000
    out[off : off + 2] = word.to_bytes(2, "little")
    return bytes(out)


def drift_from(data: bytes, onset: int, factor: float = 1.3, first: bool = False) -> bytes:
    """Every layer but the first of each block scaled by ``factor`` from position ``onset`` on:
    a difference shaped like drift (spread over the layers above the first, from an onset).
    ``first``: the first layer of each block alone instead."""
    sf = parse_buffer(data)
    out = np.frombuffer(bytearray(data), np.uint8)
    for blk in sf.body.blocks:
        st = blk.active_streams()[0]
        cells = np.flatnonzero(st.positions >= onset)
        for run in (st.k[0], st.v[0]) if first else (*st.k[1:], *st.v[1:]):
            n_el = run.row_size // 2
            a = out[run.data.offset : run.data.offset + run.n_cells * run.row_size].view(np.float16)
            a = a.reshape((n_el, run.n_cells) if run.transposed else (run.n_cells, n_el))
            if run.transposed:
                a[:, cells] = (a[:, cells] * factor).astype(np.float16)
            else:
                a[cells] = (a[cells] * factor).astype(np.float16)
    return out.tobytes()


# ------------------------------------------------------------------ without llama.cpp


def test_align_cells_matches_positions():
    assert align_cells(np.array([3, 4, 5]), np.array([3, 4, 5])) is None
    perm = align_cells(np.array([5, 6, 7, 8]), np.array([7, 8, 5, 6]))
    assert perm is not None and perm.tolist() == [2, 3, 0, 1]


def test_zero_run_follows_byte_order():
    y = np.ones((4, 8))
    x = y.copy()
    x[:, 3] = 0  # one element of every cell: a run of 4 in a transposed layout only
    assert _zero_run(x, y, transposed=True) == (4, 3 * 4)
    assert _zero_run(x, y, transposed=False)[0] == 1
    x[1, :] = 0  # a whole row: 8 in a row-major layout, from element 8 (cell 1, element 0)
    assert _zero_run(x, y, transposed=False) == (8, 8)
    z = np.zeros((4, 8))
    assert _zero_run(z, z, transposed=False) == (0, -1)  # zeros where the recompute is zero too


def test_zero_run_is_not_cut_by_the_recomputes_own_zeros():
    """A zeroed q4_0 row: the recompute holds exact zeros too (a quant of 8, one value in 16), which
    must not split the run (a Gemma chat's zeroed K row of 256 passed as drift when they did)."""
    y = np.ones((2, 256))
    y[1, ::12] = 0  # the recompute's own zeros, every 12th value
    x = y.copy()
    x[1, :] = 0
    assert _zero_run(x, y, transposed=False) == (256 - 22, 256)
    # a clean quantized row keeps its zeros where the recompute has them: nothing
    assert _zero_run(y, y, transposed=False) == (0, -1)


def test_a_float_zero_run_counts_only_values_no_writer_rounds_to_zero():
    """A float cache's zero run counts the recomputed values over 2^-14 (f16's smallest normal):
    a writer that flushes subnormals stores the smaller ones as zero."""
    y = np.full((1, 16), 0.25)
    y[0, 4:8] = 2.0**-16  # subnormal in f16
    x = y.copy()
    x[0, 2:10] = 0
    assert _zero_run(x, y, transposed=False) == (8, 2)
    assert _zero_run(x, y, transposed=False, at_least=ZERO_SIGNIFICANT) == (4, 2)


def test_sixteen_zeroed_bytes_in_a_drifting_f16_layer_are_damage(gemma_bytes):
    """16 bytes (8 f16 values) zeroed in a layer drifting far over its floors: the spike rule's noise
    is the rest of its head, which the other zeroed values fill, and 8 is under ZERO_RUN; a float
    cache's own limit (ZERO_RUN_FLOAT) claims it, and 3 zeroed values stay unclaimed by it."""
    clean = parse_buffer(gemma_bytes).body
    drifting = drift_from(gemma_bytes, 30)
    run = _last_v(parse_buffer(gemma_bytes))
    assert run.transposed and run.type_id == TypeId.F16
    # element 5 of cells 40-47 (transposed: element-major, so 8 values in a row), after the onset
    start = run.data.offset + 2 * (5 * run.n_cells + 40)
    assert np.abs(np.frombuffer(gemma_bytes, np.float16, 8, start)).min() >= ZERO_SIGNIFICANT

    def zeroed(n: int) -> bytes:
        out = bytearray(drifting)
        out[start : start + 2 * n] = bytes(2 * n)
        return bytes(out)

    j = judge_layers(parse_buffer(zeroed(8)).body, clean)
    assert j.byte_damage and any("exactly zero, 8 of them" in p[3] for p in j.problems)
    assert drift_shape(j).evidence.startswith("bytes:")
    j = judge_layers(parse_buffer(zeroed(3)).body, clean)
    assert not any("exactly zero" in p[3] for p in j.problems)
    assert ZERO_RUN_FLOAT < 8 <= ZERO_RUN


def test_two_zeroed_f32_values_are_damage_where_no_rounding_makes_a_zero():
    """f32 (and bf16) round nothing over 2^-126 to zero, so 2 stored zeros where the recompute holds
    values over 2^-14 are zeroed bytes (ZERO_RUN_WIDE): 16 bytes of f32 at an unaligned offset
    hold 3 whole values, under the f16 limit of 4.  One zeroed value is not claimed so."""
    from slotfile.format.types import TypeId
    from slotfile.verify.judge import ZERO_RUN_WIDE, zero_run_limit

    assert zero_run_limit(TypeId.F32) == zero_run_limit(TypeId.BF16) == ZERO_RUN_WIDE < 3
    assert zero_run_limit(TypeId.F16) == ZERO_RUN_FLOAT and zero_run_limit(TypeId.Q4_0) == ZERO_RUN
    data = (SLOTS / "extra-jamba.slot").read_bytes()
    clean = parse_buffer(data).body
    (s0,) = [r for b in clean.blocks for r in b.s if r.index == 0]
    assert s0.type_id == TypeId.F32
    vals = np.frombuffer(data, np.float32, s0.n_cells * s0.row_size // 4, s0.data.offset)
    k = int(np.flatnonzero((np.abs(vals[:-1]) >= ZERO_SIGNIFICANT) & (np.abs(vals[1:]) >= ZERO_SIGNIFICANT))[0])
    for n, claimed in ((2, True), (1, False)):
        out = bytearray(data)
        at = s0.data.offset + 4 * k
        out[at : at + 4 * n] = bytes(4 * n)
        j = judge_layers(parse_buffer(bytes(out)).body, clean)
        assert any(f"exactly zero, {n} of them" in p[3] for p in j.problems) == claimed, j.problems


def _cells(layers: dict[tuple[str, int], dict[int, float]], n: int = 40, base: float = 0.5) -> Judgment:
    j = Judgment()
    for (part, layer), hot in layers.items():
        r = np.full(n, base)
        for p, v in hot.items():
            r[p] = v
        j.cells.append(RunCells("kv", part, layer, np.arange(n), r))
    j.problems.append((ProblemCode.DEEP_MISMATCH, "body.kv.stream[0]", 0, "layer over its floors"))
    return j


def test_drift_shape_needs_other_layers_and_a_quiet_first_layer():
    # a cell far over its floors, other layers differing near it, the first layer quiet: drift
    drift = _cells({("K", 0): {}, ("K", 1): {20: 9.0}, ("V", 2): {22: 3.0}})
    assert drift_shape(drift).drift and drift_shape(drift).onset == 20
    # the same cell with no other layer differing near it: damage in that layer's bytes
    alone = _cells({("K", 0): {}, ("K", 1): {20: 9.0}, ("V", 2): {35: 3.0}})
    s = drift_shape(alone)
    assert not s.drift and s.evidence.startswith("isolated: K layer 1") and "position 20" in s.evidence
    # ... unless another schedule's recompute moves that cell's ratio: the split decides it, drift
    moved = _cells({("K", 0): {}, ("K", 1): {20: 1.5}, ("V", 2): {35: 3.0}})
    assert drift_shape(alone, others=(moved,)).drift
    same = _cells({("K", 0): {}, ("K", 1): {20: 8.0}, ("V", 2): {35: 3.0}})
    assert not drift_shape(alone, others=(same,)).drift  # damage differs from every recompute alike
    # a region where every layer drifts at about its floor: a cell up to 2 x limit x that
    # background is drift (the split could not be replayed), far beyond it damage
    assert drift_shape(_cells({("K", 0): {}, ("K", 1): {20: 6.0}, ("V", 2): {}}, base=1.2)).drift
    assert not drift_shape(_cells({("K", 0): {}, ("K", 1): {20: 12.0}, ("V", 2): {}}, base=1.2)).drift
    # the first layer over the limit in K and V: a token or first-layer rows changed
    token = _cells({("K", 0): {20: 9.0}, ("V", 0): {20: 8.0}, ("K", 1): {20: 9.0}})
    assert drift_shape(token).evidence.startswith("first layer: at position 20")
    # ... but a first layer over the limit in every cell alike is another backend's rounding of
    # the token's own projection (a CUDA server's file), not one changed token
    backend = _cells({("K", 0): {20: 9.0}, ("V", 0): {20: 8.0}, ("K", 1): {20: 9.0}}, base=4.5)
    assert not drift_shape(backend).evidence.startswith("first layer")
    # byte evidence decides before any shape
    zeros = _cells({("K", 1): {20: 9.0}, ("K", 2): {20: 9.0}})
    zeros.byte_damage.append("V layer 1: zeroed bytes")
    assert drift_shape(zeros).evidence == "bytes: V layer 1: zeroed bytes"


def test_a_cell_of_a_layer_that_drifts_as_a_whole_is_not_isolated():
    # model layer 5 of a 4-slot server's long slot: every cell of it over a floor the noise
    # recompute set low (a median of 5.4 floors), the layers above drifting within their larger
    # floors (1.1-1.5 around its worst cells, 9.6 and 27.9 floors, over 2 x limit x that): drift
    def judgment(hot: float, around: float) -> Judgment:
        j = _cells({("K", 0): {}, ("K", 2): {}, ("V", 2): {}}, base=around)
        for c in j.cells:
            if c.layer == 0:
                c.ratio[:] = 0.5  # the first layer agrees
        r = np.full(40, 5.4)
        r[20] = hot
        j.cells.append(RunCells("kv", "V", 1, np.arange(40), r))
        j.cells.append(RunCells("kv", "K", 1, np.arange(40), np.full(40, 5.0)))
        return j

    assert drift_shape(judgment(27.9, 1.2)).drift
    # a cell far beyond its own layer's level (2 x limit x the layer's median) stays damage
    s = drift_shape(judgment(60.0, 1.2))
    assert not s.drift and s.evidence.startswith("isolated: V layer 1") and "position 20" in s.evidence
    # and outside a drifting region a layer off as a whole lends its cells no excuse (a K layer
    # scaled; the one layer above the first of a 2-layer model after a context shift)
    s = drift_shape(judgment(27.9, 0.5))
    assert not s.drift and s.evidence.startswith("isolated: V layer 1"), s.evidence


def test_candidate_schedules_are_bounded_and_ordered():
    first = Schedule(2048, 512)
    c = candidate_schedules(first, 2056, 768, checkpoints=False)
    assert len(c) == MAX_RETRIES and c[0] == Schedule(2048, 256) and first not in c
    c = candidate_schedules(first, 2056, 800, checkpoints=True)  # 800 = 25 x 32: on -ub 32 boundaries only
    assert c[0] == Schedule(2048, 32, (2020, 2052)) and all(s.cuts for s in c)
    assert candidate_schedules(Schedule(2048, 32), 100, None, checkpoints=False) == []
    # a difference from the first tokens on: no split explains it (another build), nothing to replay
    assert candidate_schedules(first, 2056, 1, checkpoints=True) == []
    # a 38-token prompt: -ub 256 and 128 split it as 512 does
    assert [s.n_ubatch for s in candidate_schedules(first, 38, 34, checkpoints=False)] == [32]


def test_larger_ubatch_schedules_where_the_recompute_agrees_past_its_first_ubatch():
    """A -ub 1024 server's 2,056-token file (v3, a document and a question) agreed exactly with the
    first recompute (-ub 512) up to position 1,026: a larger -ub computes the first 512 tokens alike,
    and sizes the window cache n_swa + n_ubatch.  Its split replays it (1.56 floors, 30.7 before)."""
    first = Schedule(2048, 512)
    assert larger_schedules(first, 2056, True, 1027) == [
        Schedule(2048, 1024, (1028, 2052)),
        Schedule(2048, 2048, (4, 2052)),
    ]
    assert larger_schedules(Schedule(512, 512), 2056, False, 600) == [Schedule(1024, 1024), Schedule(2048, 2048)]
    # parting inside the first micro-batch: a larger -ub would have agreed there; nothing to try
    assert larger_schedules(first, 2056, True, 300) == [] and larger_schedules(first, 2056, True, None) == []
    # one micro-batch of 1,024 holds all 900 tokens: 2,048 would split them alike
    assert larger_schedules(first, 900, False, 600) == [Schedule(2048, 1024)]
    assert larger_schedules(Schedule(2048, 2048), 4000, False, 3000) == []
    # first when the recompute parts at its second micro-batch boundary, at a break of theirs last, else none
    c = candidate_schedules(first, 2056, 1030, True, 1027)
    assert c[:2] == larger_schedules(first, 2056, True, 1027)
    c = candidate_schedules(first, 2205, 2083, True, 1490)
    assert c[:2] == reply_schedules(first, 2205, 2083, True, 1490) and all(s.n_ubatch <= 512 for s in c)
    # parting at a larger -ub's checkpoint break n - 4 - 1024 (a memory that takes checkpoints): that one, last
    c = candidate_schedules(first, 2205, 1180, True, 1177)
    assert c[-1] == Schedule(2048, 1024, (1177, 2201)) and all(s.n_ubatch != 2048 for s in c)
    c = candidate_schedules(first, 2056, 780, True, 776)  # a -ub 128 server's file: no larger -ub
    assert Schedule(2048, 128, (1924, 2052)) in c and all(s.n_ubatch <= 512 for s in c)


def test_a_larger_ubatch_is_replayed_with_its_own_window(gemma_bytes):
    """The whole-context window that brought the state closer is kept for the later retries, but
    not for a larger -ub's: its own window (n_swa + n_ubatch cells) is the one it replays."""
    file_body, drifted, closer = _bodies_drifting_from_46(gemma_bytes)
    asked: list[Schedule] = []

    def replay(s: Schedule):
        asked.append(s)
        return (file_body if s.n_ubatch > 24 and not s.swa_full else closer if s.swa_full else drifted), ""

    # parting at position 46, near the second boundary (48) of a -ub 24 recompute: a larger -ub comes first
    out = judge_with_schedules(file_body, DeepInputs(n_tokens=54), (Schedule(2048, 24), drifted), replay)
    assert asked == [Schedule(2048, 24, swa_full=True), Schedule(2048, 1024)]
    assert out.decided_by == "schedule" and out.schedule == Schedule(2048, 1024) and "-ub 1024" in out.evidence


def _bodies_drifting_from_46(data: bytes) -> tuple[Body, Body, Body]:
    """The file's body, a recompute drifting from position 46, and one closer (1.1 times, not 1.3)."""
    return (
        parse_buffer(data).body,
        parse_buffer(drift_from(data, 46)).body,
        parse_buffer(drift_from(data, 46, 1.1)).body,
    )


def _token_judgment(p: int, k_at: float, after: float, window_k: float) -> Judgment:
    """An iSWA state exact before ``p`` against its recompute: the base block (model layer 5 and up)
    holds positions 0..199, the window block 150..199; at ``p`` the base block's layer 0 differs by
    ``k_at`` floors in K and 20 in V, ``after`` at the positions after it; the window's first
    layer K ``window_k`` from 150 on (0: exact; a shift rotates K a second time)."""
    j = Judgment()
    for part in ("K", "V"):
        for layer in (0, 1):
            r = np.zeros(200)
            r[p] = k_at if part == "K" else 20.0
            r[p + 1 :] = after
            j.cells.append(RunCells("kv-base", part, layer, np.arange(200), r))
        w = np.full(50, window_k if part == "K" else 0.0)
        j.cells.append(RunCells("kv-swa", part, 0, np.arange(150, 200), w))
        j.cells.append(RunCells("kv-swa", part, 1, np.arange(150, 200), np.full(50, after)))
    return j


def test_a_changed_token_before_the_window_is_its_lowest_layers_jump(gemma_bytes):
    """Exact up to a position, then the lowest layer holding it off in K and V by more than the
    limit while the later positions come back: that position's own token (a v3 -ub 1024 file's
    token at 1,362: 5.6 and 23.7 floors in model layer 5, exact before; clean files: at most 0.80)."""
    body = parse_buffer(gemma_bytes).body
    assert changed_token_at(_token_judgment(100, 6.0, 1.0, 0.0), body, "kv-swa") == 100
    # within the limit in K (a split's or a placement's rounding), or in the first tokens (another build)
    assert changed_token_at(_token_judgment(100, 3.0, 1.0, 0.0), body, "kv-swa") is None
    assert changed_token_at(_token_judgment(10, 6.0, 1.0, 0.0), body, "kv-swa") is None
    # every later position as far off (cells computed in another context: shifted), or the window's
    # first layer K rotated a second time: a context shift, not a token
    assert changed_token_at(_token_judgment(100, 6.0, 6.0, 0.0), body, "kv-swa") is None
    assert changed_token_at(_token_judgment(100, 6.0, 1.0, 0.04), body, "kv-swa") is None
    # a block whose lowest layer holds the position and agrees there (the window's first layer): no token changed
    j = _token_judgment(160, 6.0, 1.0, 0.0)
    assert changed_token_at(j, body, "kv-swa") is None


def test_a_changed_token_in_a_low_bit_k_cache_is_its_v_jump(gemma_bytes):
    """With a low-bit K cache (q4_0: K's floor is the quantization's step) a changed token moves K
    by about one floor and V far beyond the limit (an AMD EPYC's copy: K 1.1, V 12.7, the later
    positions 1.2): the low-bit rule names it, the plain rule does not; K within its floor, or the
    positions after it as far off as V, are no changed token either way."""
    body = parse_buffer(gemma_bytes).body
    j = _token_judgment(100, 1.5, 1.0, 0.0)
    assert changed_token_at(j, body, "kv-swa") is None
    assert changed_token_at(j, body, "kv-swa", low_bit=True) == 100
    assert changed_token_at(_token_judgment(100, 0.9, 0.0, 0.0), body, "kv-swa", low_bit=True) is None
    assert changed_token_at(_token_judgment(100, 1.5, 12.0, 0.0), body, "kv-swa", low_bit=True) is None


def _spike_judgment(
    p: int, v_at: float, k_next: float, background: float, after: float, k_background: float | None = None
) -> Judgment:
    """A drifting iSWA state (another build's: every position off by ``background`` floors, K by
    ``k_background`` if given, with a seeded spread) against its recompute: the base block holds
    0..199, the window block 150..199; the base block's layer 0 off by ``v_at`` in V at ``p`` and
    ``k_next`` in K at ``p + 1``, and by ``after`` from ``p + 8`` on."""
    rng = np.random.default_rng(7)
    j = Judgment()
    for part in ("K", "V"):
        for layer in (0, 1):
            bg = k_background if part == "K" and k_background is not None else background
            r = bg * rng.uniform(0.5, 1.5, 200)
            if layer == 0:
                r[p + 8 :] = np.maximum(r[p + 8 :], after)
                if part == "V":
                    r[p] = v_at
                else:
                    r[p + 1] = k_next
            j.cells.append(RunCells("kv-base", part, layer, np.arange(200), r))
        j.cells.append(RunCells("kv-swa", part, 0, np.arange(150, 200), background * rng.uniform(0.5, 1.5, 50)))
    return j


def test_a_changed_token_in_a_drifting_state_stands_out_of_its_background():
    """Another build's state drifts from the first tokens, so no exact prefix shows where a token
    changed; the lowest layer holding it does, in V at the token and in K at the next cell, far
    above the positions before (v4 files of this machine's server against the portable library,
    a token changed before Gemma 3's window: 12-283 times their background in 13 of 14 copies;
    no clean position of 33 long files meets the rule's other conditions)."""
    assert spiked_tokens(_spike_judgment(100, 20.0, 20.0, 0.7, 1.0), "kv-swa") == [100]
    # as much in a drift that large (a background of 3: 6.7 times), in V or in K, or in V alone, or in K alone
    assert spiked_tokens(_spike_judgment(100, 20.0, 20.0, 3.0, 1.0), "kv-swa") == []
    assert spiked_tokens(_spike_judgment(100, 20.0, 20.0, 3.0, 1.0, k_background=0.7), "kv-swa") == []
    assert spiked_tokens(_spike_judgment(100, 20.0, 20.0, 0.7, 1.0, k_background=3.0), "kv-swa") == []
    assert spiked_tokens(_spike_judgment(100, 20.0, 0.7, 0.7, 1.0), "kv-swa") == []
    assert spiked_tokens(_spike_judgment(100, 0.7, 20.0, 0.7, 1.0), "kv-swa") == []
    # the later positions as far off (cells a context shift moved), or a position the first layer holds
    assert spiked_tokens(_spike_judgment(100, 20.0, 20.0, 0.7, 15.0), "kv-swa") == []
    assert spiked_tokens(_spike_judgment(160, 20.0, 20.0, 0.7, 1.0), "kv-swa") == []
    # nor without a background before it, or without the first layer's block
    assert spiked_tokens(_spike_judgment(20, 20.0, 20.0, 0.7, 1.0), "kv-swa") == []
    assert spiked_tokens(_spike_judgment(100, 20.0, 20.0, 0.7, 1.0), None) == []


def test_a_changed_token_under_a_low_bit_k_caches_limit_stands_out_of_its_floors():
    """A low-bit K cache (q4_0 K beside an f16 V): the lowest layer's floors are the
    quantization's, so a changed token reaches 1.5-15 floors in V and 2.1-4.8 in K at the next
    position, under the limit, while it stands 4.7-89 times above the positions before (15 copies of
    v3 and v4 servers' files); no clean position over its floors that comes back stands more than
    2.62 times (51 files, most of them another build's: bench/detect-low-bit-token.md)."""
    weak = _spike_judgment(100, 3.0, 2.5, 0.3, 0.5)  # V 10 times, K 8.3 times its background
    assert spiked_tokens(weak, "kv-swa") == []
    assert spiked_tokens(weak, "kv-swa", low_bit=True) == [100]
    # under 4 times the background (0.8: 3.75 and 3.1 times), within the floors, or not coming back
    assert spiked_tokens(_spike_judgment(100, 3.0, 2.5, 0.8, 0.5), "kv-swa", low_bit=True) == []
    assert spiked_tokens(_spike_judgment(100, 3.0, 0.9, 0.1, 0.3), "kv-swa", low_bit=True) == []
    assert spiked_tokens(_spike_judgment(100, 0.9, 2.5, 0.1, 0.3), "kv-swa", low_bit=True) == []
    assert spiked_tokens(_spike_judgment(100, 3.0, 2.5, 0.3, 1.5), "kv-swa", low_bit=True) == []


def test_low_bit_k_names_the_k_caches_that_cannot_reach_the_limit():
    """``low_bit_k``: a q4_0 K (any layer) is low-bit; f16 and q8_0 K are not, whatever V is."""

    def body(type_k: int) -> Any:
        run = SimpleNamespace(type_id=type_k)
        stream = SimpleNamespace(k=[run], v=[SimpleNamespace(type_id=1)])
        return SimpleNamespace(blocks=[SimpleNamespace(active_streams=lambda: [stream])])

    assert low_bit_k(body(2))  # q4_0
    assert not low_bit_k(body(1)) and not low_bit_k(body(8))  # f16, q8_0


def test_reply_schedules_start_where_the_computations_parted():
    first = Schedule(2048, 512)
    # a 2,006-token prompt and a 199-token reply on a memory with checkpoints: the first difference is
    # the server's break n_prompt - 4 - 512 = 1490, so the reply began at 1490 + 4 + 512 = 2006
    c = reply_schedules(first, 2205, 2083, True, 1490)
    assert c == [Schedule(2048, 512, (1490, 2002), ((2006, 2205),)), Schedule(2048, 512, (), ((1490, 2205),))]
    assert c[0].as_dict()["stepwise"] == [[2006, 2205]] and "one token per call at positions 2006-2204" in c[0].label()
    # without checkpoints the first difference is the reply's first token
    assert reply_schedules(first, 2205, 2083, False, 2006) == [Schedule(2048, 512, (), ((2006, 2205),))]
    # a difference from the first tokens (another build), none at all, or after the onset: nothing to replay
    assert reply_schedules(first, 2205, 3, False, 2) == []
    assert reply_schedules(first, 2205, 2083, False, None) == []
    assert reply_schedules(first, 2205, 2083, False, 2100) == []
    # at most MAX_STEPWISE tokens one per call
    assert reply_schedules(first, MAX_STEPWISE + 1000, 900, False, 500) == []
    # replies come before the splits, which stay bounded
    c = candidate_schedules(first, 2205, 2083, True, 1490)
    assert c[:2] == reply_schedules(first, 2205, 2083, True, 1490) and len(c) <= 2 + len(LARGER_UBATCH) + MAX_RETRIES
    assert not Schedule(2048, 512).as_dict().get("stepwise")


def test_first_difference_is_the_earliest_differing_position(gemma_bytes):
    clean = parse_buffer(gemma_bytes).body
    assert first_difference(judge_layers(clean, clean)) is None
    j = judge_layers(parse_buffer(drift_from(gemma_bytes, 46)).body, clean)
    assert first_difference(j) == 46


@pytest.fixture(scope="module")
def gemma_bytes() -> bytes:
    return GEMMA.read_bytes()


def test_zeroed_sector_and_flipped_exponent_are_damage(gemma_bytes):
    clean = parse_buffer(gemma_bytes).body
    j = judge_layers(parse_buffer(zero_512(gemma_bytes)).body, clean)
    (p,) = j.problems
    assert j.byte_damage and "exactly zero" in p[3] and int(p[3].split("exactly zero, ")[1].split()[0]) >= ZERO_RUN
    assert not drift_shape(j).drift
    j = judge_layers(parse_buffer(flip_exponent(gemma_bytes)).body, clean)
    (p,) = j.problems  # one value far off, its head and its element in the other cells exact: a spike
    (row,) = [r for r in j.rows if "spike" in r]
    assert "isolated spike" in p[3] and j.byte_damage and row["spike"]["offset"] == p[2] and row["layer"] == 1
    assert drift_shape(j).evidence.startswith("bytes: body.kv-base.stream[0] V layer 1 (f16): isolated spike")


def test_drift_is_replayed_then_accepted(gemma_bytes, monkeypatch):
    file_body = parse_buffer(gemma_bytes).body
    drifted = parse_buffer(drift_from(gemma_bytes, 46)).body  # the SWA window: 46-53
    inputs = DeepInputs(n_tokens=54)
    asked: list[Schedule] = []

    def replay(s: Schedule):
        asked.append(s)
        return (file_body if s.n_ubatch == 32 else drifted), ""

    out = judge_with_schedules(file_body, inputs, (Schedule(2048, 512), drifted), replay)
    assert out.decided_by == "schedule" and out.schedule == Schedule(2048, 32) and not out.judgment.problems
    # first a reply from the first difference (46) decoded one token per call; then the splits:
    # -ub 256/128/64 put their first boundary after the onset at 46, only -ub 32 can explain it
    assert asked == [Schedule(2048, 512, (), ((46, 54),)), Schedule(2048, 32)]
    assert [t["n_ubatch"] for t in out.tried] == [512, 512, 32] and out.tried[1]["stepwise"] == [[46, 54]]
    # a split that halves it without replaying it: the state depends on the split, drift (a pass)
    less = parse_buffer(drift_from(gemma_bytes, 46, 1.15)).body
    drifted_more = parse_buffer(drift_from(gemma_bytes, 46, 1.6)).body
    out = judge_with_schedules(file_body, inputs, (Schedule(2048, 512), drifted_more), lambda s: (less, ""))
    assert out.judgment.problems and out.drift and out.decided_by == "drift", out.evidence
    assert out.tried[-1]["margin"] * 2 <= out.tried[0]["margin"]
    # no split moves it and it starts well after the first tokens: damage, though spread like
    # drift, in a cache of one stream per slot (test_unmoved_drift_in_a_one_stream_cache_is_cell_placement)
    monkeypatch.setattr(shape, "single_stream", lambda body: False)
    out = judge_with_schedules(file_body, inputs, (Schedule(2048, 512), drifted_more), lambda s: (None, "no"))
    assert not out.drift and out.decided_by == "shape" and "no split tried moves it" in out.evidence
    assert out.tried[-1]["error"] == "no"
    assert out.tried[0]["first_difference"] == 46  # where the state stops agreeing exactly
    # the same in a quantized cache: its steps hide where another build's drift starts, so no
    # exact prefix tells it from damage (test_quantized_kv_is_every_k_and_v_layer_quantized)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(shape, "quantized_kv", lambda body: True)
        out = judge_with_schedules(file_body, inputs, (Schedule(2048, 512), drifted_more), lambda s: (None, "no"))
        assert out.drift and out.decided_by == "drift" and "the cache is quantized" in out.evidence
        # a caller with no splits to offer (the appendix blobs) still gets "unmoved", to try its own
        out = judge_with_schedules(file_body, inputs, (Schedule(2048, 512), drifted_more), None)
        assert not out.drift and out.unmoved
    # damage is never retried
    damaged = parse_buffer(flip_exponent(gemma_bytes)).body
    out = judge_with_schedules(damaged, inputs, (Schedule(2048, 512), file_body), replay)
    assert out.decided_by == "bytes" and len(out.tried) == 1 and out.judgment.problems


def test_micro_batches_are_the_workers_calls_cut_by_the_ubatch():
    """The worker decodes the pieces between cuts and the replies' ends in calls of -b tokens, a
    reply one token per call; llama.cpp cuts each call into -ub pieces.  Two schedules compute alike
    up to their first differing micro-batch, from 0 in another context (-b, -ub, window)."""
    first = Schedule(2048, 512)
    assert micro_batches(first, 1100) == [(0, 512), (512, 1024), (1024, 1100)]
    assert micro_batches(Schedule(256, 512), 600) == [(0, 256), (256, 512), (512, 600)]  # -ub is at most -b
    reply = Schedule(2048, 512, (1000,), ((1090, 1093),))
    assert micro_batches(reply, 1100)[1:] == [
        (512, 1000),
        (1000, 1090),
        (1090, 1091),
        (1091, 1092),
        (1092, 1093),
        (1093, 1100),
    ]
    assert computes_alike_until(first, reply, 1100) == 512
    assert computes_alike_until(first, Schedule(2048, 512, (1030,)), 1100) == 1024
    assert computes_alike_until(first, first, 1100) == 1100
    assert computes_alike_until(first, Schedule(2048, 256), 1100) == 0
    assert computes_alike_until(first, Schedule(2048, 512, swa_full=True), 1100) == 0


def test_a_replay_that_computes_alike_where_the_first_recompute_fails_is_skipped(gemma_bytes):
    """A retry recomputes nothing otherwise before its first differing micro-batch, so the layers the
    first recompute fails there fail it too: a reply replayed after the drift is over the limit in
    several layers is not recomputed, and ``schedules[]`` says so."""
    file_body = parse_buffer(gemma_bytes).body
    drifted = parse_buffer(drift_from(gemma_bytes, 46)).body
    j = judge_layers(file_body, drifted)
    assert over_limit_before(j, 46) == (0, 0.0)
    layers, worst = over_limit_before(j, 48)
    assert layers >= 3 and worst == pytest.approx(j.margin, rel=1e-3)
    asked: list[Schedule] = []

    def replay(s: Schedule):
        asked.append(s)
        return drifted, ""

    first = Schedule(2048, 24)  # micro-batches 0-23, 24-47, 48-53
    out = judge_with_schedules(
        file_body, DeepInputs(n_tokens=54), (first, drifted), replay, replies=lambda: [(10, 20), (50, 54)]
    )
    last_only = Schedule(2048, 24, (), ((50, 54),))
    assert last_only not in asked and Schedule(2048, 24, (), ((10, 20), (50, 54))) in asked
    (skipped,) = [t for t in out.tried if "skipped" in t]
    assert skipped["stepwise"] == [[50, 54]] and "up to position 48" in skipped["skipped"]
    assert len(asked) == len(out.tried) - 2  # the first recompute is not asked of ``replay``
    # with the first recompute within its floors before 48, the replay is tried
    asked.clear()
    late = parse_buffer(drift_from(gemma_bytes, 49)).body
    judge_with_schedules(
        file_body, DeepInputs(n_tokens=54), (first, late), replay, replies=lambda: [(10, 20), (50, 54)]
    )
    assert last_only in asked
    # over the limit in 4 layers before 48, but at 7.5 floors, under half the margin (55): the replay could
    # still halve it, so it is tried
    asked.clear()
    mild = parse_buffer(drift_from(drift_from(gemma_bytes, 46, 1.1), 48, 1.6)).body
    j = judge_layers(file_body, mild)
    layers, worst = over_limit_before(j, 48)
    assert layers >= 3 and 4 < worst < j.margin / 2
    judge_with_schedules(
        file_body, DeepInputs(n_tokens=54), (first, mild), replay, replies=lambda: [(10, 20), (50, 54)]
    )
    assert last_only in asked
    # a damage-shaped difference gets only the replays that could leave every layer agreeing: a zeroed
    # sector before position 48 rules out the last reply's, not the one from position 10
    asked.clear()
    damaged = parse_buffer(zero_512(gemma_bytes)).body
    out = judge_with_schedules(
        damaged, DeepInputs(n_tokens=54), (first, file_body), replay, replies=lambda: [(10, 20), (50, 54)]
    )
    assert out.decided_by == "bytes" and asked == [Schedule(2048, 24, (), ((10, 20), (50, 54)))]
    assert [t.get("stepwise") for t in out.tried if "skipped" in t] == [[[50, 54]]]


def test_a_spike_in_an_exact_context_gets_no_replay(gemma_bytes):
    """A value far off while the rest of its head and its element in every other cell equal the
    first recompute bit for bit: that recompute computes the layer as the server did, so the
    difference is the bytes' whatever schedule a replay tries.  A replay that computes the layer
    otherwise (another first micro-batch rounds every cell anew) would only hide the value in its
    own noise: none is asked for."""
    file_body = parse_buffer(gemma_bytes).body
    damaged = parse_buffer(flip_exponent(gemma_bytes)).body
    asked: list[Schedule] = []

    def replay(s: Schedule):
        asked.append(s)
        return parse_buffer(drift_from(gemma_bytes, 0, 1.01)).body, ""

    out = judge_with_schedules(
        damaged, DeepInputs(n_tokens=54), (Schedule(2048, 24), file_body), replay, replies=lambda: [(10, 20), (50, 54)]
    )
    assert out.decided_by == "bytes" and asked == [] and len(out.tried) == 1
    assert any(r.get("spike", {}).get("exact") for r in out.judgment.rows)
    assert "isolated spike" in out.evidence


def test_cells_in_another_order_are_the_same_cells(gemma_bytes):
    """A sliding-window ring holds the positions in the order the server's split wrote them: a
    file whose SWA cells are rotated is the same state."""
    sf = parse_buffer(gemma_bytes)
    blk = next(b for b in sf.body.blocks if b.role == "kv-swa")
    st = blk.active_streams()[0]
    rot = np.roll(np.arange(st.cell_count), 3)
    moved = parse_buffer(_reorder_cells(gemma_bytes, "kv-swa", rot))
    mst = next(b for b in moved.body.blocks if b.role == "kv-swa").active_streams()[0]
    assert mst.positions.tolist() == st.positions[rot].tolist()
    j = judge_layers(moved.body, sf.body)
    assert not j.problems and j.margin == 0.0


def _noisy(data: bytes, rel: float = 0.01, seed: int = 3) -> bytes:
    """Every layer but the first of each block with small random noise on every element (about
    ``rel`` of the layer's spread): a recompute that differs from the file as drift does, in
    direction and length alike, in every cell."""
    rng = np.random.default_rng(seed)
    sf = parse_buffer(data)
    out = np.frombuffer(bytearray(data), np.uint8)
    for blk in sf.body.blocks:
        st = blk.active_streams()[0]
        for run in (*st.k[1:], *st.v[1:]):
            a = out[run.data.offset : run.data.offset + run.n_cells * run.row_size].view(np.float16)
            noise = rng.normal(0, rel * float(np.std(a.astype(np.float32))), a.size)
            a[:] = (a.astype(np.float32) + noise).astype(np.float16)
    return out.tobytes()


def _scale_row(data: bytes, role: str, layer: int, cell: int, factor: float) -> bytes:
    sf = parse_buffer(data)
    run = next(b for b in sf.body.blocks if b.role == role).active_streams()[0].k[layer]
    out = bytearray(data)
    o = run.data.offset + cell * run.row_size
    row = np.frombuffer(out, np.float16, run.row_size // 2, o).astype(np.float32) * factor
    out[o : o + run.row_size] = row.astype(np.float16).tobytes()
    return bytes(out)


def test_a_row_scaled_among_drifting_cells_is_damage(gemma_bytes):
    """A K row scaled by 2 in a file whose every cell drifts (another build's: an AVX-512 server's
    file against an AVX2 library) keeps its direction and doubles its length; drift turns and
    stretches every cell alike.  The cell's norm stands out of its layer's: damage in its bytes,
    where it passed as drift before."""
    rec = parse_buffer(_noisy(gemma_bytes)).body
    clean = parse_buffer(gemma_bytes).body
    j = judge_layers(clean, rec)
    assert not any("scaled row" in p[3] for p in j.problems)
    damaged = parse_buffer(_scale_row(gemma_bytes, "kv-base", 1, 20, 2.0))
    j = judge_layers(damaged.body, rec)
    (p,) = [p for p in j.problems if "scaled row" in p[3]]
    assert "cell 20 (position 20)" in p[3] and "factor 1.99" in p[3] and j.byte_damage
    run = next(b for b in damaged.body.blocks if b.role == "kv-base").active_streams()[0].k[1]
    assert p[2] == run.data.offset + 20 * run.row_size
    assert drift_shape(j).evidence.startswith("bytes: ")


def _scale_cell(data: bytes, where: list[tuple[str, str, int]], position: int, factor: float) -> bytes:
    """The cell holding ``position`` scaled by ``factor`` in each (block, part, layer) of ``where``
    (a transposed V: its column)."""
    sf = parse_buffer(data)
    out = bytearray(data)
    for role, part, layer in where:
        st = next(b for b in sf.body.blocks if b.role == role).active_streams()[0]
        run = (st.k if part == "K" else st.v)[layer]
        cell = int(np.flatnonzero(st.positions == position)[0])
        n_el = run.row_size // 2
        a = np.frombuffer(out, np.float16, run.n_cells * n_el, run.data.offset).astype(np.float32)
        a = a.reshape((n_el, run.n_cells) if run.transposed else (run.n_cells, n_el))
        if run.transposed:
            a[:, cell] *= factor
        else:
            a[cell] *= factor
        out[run.data.offset : run.data.offset + a.size * 2] = a.astype(np.float16).tobytes()
    return bytes(out)


def test_one_position_scaled_in_many_layers_is_model_space(gemma_bytes, monkeypatch):
    """A 4-slot server's 2,136-token file (v3 and v4 alike) holds one position whose K and V are
    off in length by up to 1.31 in every layer from model layer 6 to 11 while its neighbours
    drift as usual: that token's computation parted, not one row's bytes (the scaled-row rule
    failed the clean file).  A scaled row counts as damage only while fewer than COHERENT_LAYERS
    other layers peak at its position, as a spike does; in one layer alone it still fails."""
    # the tiny model has three layers besides its first (the SWA block's layer 0): ask for two
    monkeypatch.setattr(shape, "COHERENT_LAYERS", 2)
    rec = parse_buffer(_noisy(gemma_bytes)).body
    many = [("kv-base", "K", 0), ("kv-base", "K", 1), ("kv-base", "V", 1), ("kv-swa", "K", 1)]
    j = judge_layers(parse_buffer(_scale_cell(gemma_bytes, many, 50, 1.3)).body, rec)
    assert sum("scaled row" in p[3] for p in j.problems) == 4 and len(j.byte_damage) == 4
    # the SWA block holds the model's first layer (its layer 0 stays exact); the base block's
    # layer 0 is model layer 5
    assert drift_shape(j, first_block="kv-swa").drift
    for few in (many[1:2], many[1:3]):  # one layer (its K, or its K and V)
        j = judge_layers(parse_buffer(_scale_cell(gemma_bytes, few, 50, 1.3)).body, rec)
        assert any("scaled row" in p[3] for p in j.problems)
        assert drift_shape(j, first_block="kv-swa").evidence.startswith("bytes: "), few
    # each K or V tensor counts, the spike's own layer's other part too: no byte change reaches a
    # layer's K and V at one cell (a 4-slot unified q8_0 server's long slot on an AMD EPYC: V of
    # window layers 5 and 6 scaled by 1.45 and 1.39 at one position, K there 4.7 floors off in both)
    j = judge_layers(parse_buffer(_scale_cell(gemma_bytes, many[1:], 50, 1.3)).body, rec)
    assert sum("scaled row" in p[3] for p in j.problems) == 3
    assert drift_shape(j, first_block="kv-swa").drift


def _reorder_cells(data: bytes, role: str, order: np.ndarray) -> bytes:
    """The block's cells (rows and cell entries) in the order ``order`` gives."""
    sf = parse_buffer(data)
    st = next(b for b in sf.body.blocks if b.role == role).active_streams()[0]
    out = bytearray(data)
    for run in (*st.k, *st.v):
        n_el = run.row_size // 2
        a = np.frombuffer(out, np.float16, run.n_cells * n_el, run.data.offset)
        a = a.reshape((n_el, run.n_cells) if run.transposed else (run.n_cells, n_el)).copy()
        b = a[:, order] if run.transposed else a[order]
        out[run.data.offset : run.data.offset + b.nbytes] = b.tobytes()
    _rotate_cell_table(out, st, order)
    return bytes(out)


def test_cells_out_of_position_order_explain_drift_from_there(gemma_bytes, monkeypatch):
    """A unified cache shared by concurrent slots gives a slot's later positions whatever cells
    are free, and the file keeps the cells in cell order (a v3 server's slot 0 of 4: positions
    0..49, 76..78, 50..75, 79..124; exact up to 51, then 4.2 floors in every recompute): the
    server's attention summed those cells in another order, so drift from there passes.  Such a
    file is checked (it was skipped as not holding its positions), and drift that starts before
    the first cell out of order is still damage."""
    from slotfile.verify.deep import _deep_preconditions

    order = np.r_[0:40, 50:54, 40:50]
    shuffled = _reorder_cells(gemma_bytes, "kv-base", order)
    sf = parse_buffer(shuffled)
    assert _deep_preconditions(sf, 0) is None
    assert out_of_order_from(sf.body) == 40 and out_of_order_from(parse_buffer(gemma_bytes).body) is None
    inputs = DeepInputs(n_tokens=54)
    rec = parse_buffer(drift_from(gemma_bytes, 40, 1.6)).body
    out = judge_with_schedules(sf.body, inputs, (Schedule(2048, 512), rec), lambda s: (rec, ""))
    assert out.drift and out.decided_by == "drift" and "out of position order from position 40" in out.evidence
    # with the first recompute's logits agreeing, no retry can change that: none is made
    out = judge_with_schedules(
        sf.body, inputs, (Schedule(2048, 512), rec), lambda s: pytest.fail("retried"), logits_ok=True
    )
    assert out.drift and len(out.tried) == 1 and "not retried" in out.evidence
    # unless the state parts where a token changed (a 4-slot unified q8_0 slot, out of order from
    # position 0, exact up to 314, its token at 315 changed): that is no order of sums
    with monkeypatch.context() as m:
        m.setattr(shape, "changed_token_at", lambda j, body, first_block: 45)
        m.setattr(shape, "shifted_from", lambda *a, **k: None)  # this drift starts where the order breaks
        out = judge_with_schedules(
            sf.body, inputs, (Schedule(2048, 512), rec), lambda s: pytest.fail("retried"), logits_ok=True
        )
    assert not out.drift and out.decided_by == "shape" and out.evidence.startswith("changed token:")
    # the same drift in a file whose cells are in order, in a cache of one stream per slot (one
    # stream: test_unmoved_drift_in_a_one_stream_cache_is_cell_placement): no split moves it, damage
    monkeypatch.setattr(shape, "single_stream", lambda body: False)
    plain = parse_buffer(gemma_bytes).body
    out = judge_with_schedules(plain, inputs, (Schedule(2048, 512), rec), lambda s: (rec, ""))
    assert not out.drift and out.unmoved
    # drift from position 38, before the first cell out of order: damage, retried first
    rec = parse_buffer(drift_from(gemma_bytes, 38, 1.6)).body
    out = judge_with_schedules(sf.body, inputs, (Schedule(2048, 512), rec), lambda s: (rec, ""), logits_ok=True)
    assert not out.drift and out.unmoved and "agrees exactly up to position 38" in out.evidence
    assert len(out.tried) > 1


def _rotate_cell_table(out: bytearray, st, rot: np.ndarray) -> None:
    """Rotate the stream's cell entries (a one-sequence save: entries of one fixed size)."""
    start, size = st.cells.offset, st.cells.size // st.cell_count
    rows = [bytes(out[start + i * size : start + (i + 1) * size]) for i in range(st.cell_count)]
    out[start : start + size * st.cell_count] = b"".join(rows[i] for i in rot)


# ------------------------------------------------------------------ the real worker


@pytest.fixture(scope="module")
def verifier():
    from slotfile.verify import Verifier, VerifyOptions

    with Verifier(VerifyOptions(model=str(MODELS / "gemma3.gguf"), deep=True)) as v:
        yield v


@pytest.mark.llama
def test_clean_fixture_is_decided_by_statistics(verifier):
    d = verifier.verify(GEMMA).levels["deep"]
    assert d.status == "pass" and d.details["decided_by"] == "statistics"
    assert len(d.details["schedules"]) == 1 and d.details["cuts"] == []


@pytest.mark.llama
def test_the_file_is_compared_while_the_floor_decodes(verifier, monkeypatch):
    """The worker says when the recompute is written (an interim line) and goes on with the
    floor's one-token decodes; the parent compares every layer meanwhile, once."""
    import slotfile.verify.deep as deep_mod

    made: list[int] = []
    compare = deep_mod._Early.compare

    def spy(self, path):
        compare(self, path)
        made.append(len(self.pre.layers) if self.pre else -1)

    monkeypatch.setattr(deep_mod._Early, "compare", spy)
    d = verifier.verify(GEMMA).levels["deep"]
    assert d.status == "pass" and made == [len(d.details["layers"])] and made[0] > 0


@pytest.mark.llama
@pytest.mark.parametrize("damage, decided", [(zero_512, "bytes"), (flip_exponent, "bytes")])
def test_damaged_fixture_fails_deep(verifier, gemma_bytes, tmp_path: Path, damage, decided):
    p = tmp_path / f"{damage.__name__}.slot"
    p.write_bytes(damage(gemma_bytes))
    r = verifier.verify(p)
    d = r.levels["deep"]
    assert {k: v.status for k, v in r.levels.items()} == {
        "structure": "pass",
        "model": "pass",
        "load": "pass",
        "deep": "fail",
    }
    assert d.details["decided_by"] == decided and len(d.details["schedules"]) == 1  # no retry on damage
    assert any(p.code == "deep-mismatch" and "V layer 1" in p.message for p in d.problems)


@pytest.mark.llama
def test_worker_replays_cuts():
    """A recompute split at the checkpoint breaks is the same state on the tiny model (its
    recomputes agree bit for bit), and the worker reports the cuts it used."""
    from slotfile.llama.loader import LoaderPool

    sf = open_slot_file(GEMMA)
    toks = [int(t) for t in sf.tokens.tokens]
    n = len(toks)
    with LoaderPool(str(MODELS / "gemma3.gguf")) as pool, tempfile.TemporaryDirectory() as d:
        r = pool.deep(str(GEMMA), toks, toks[-1], f"{d}/a.slot", n_ubatch=16, cuts=[n - 20, n - 4, 0, n + 3])
        assert r.ok and r.cuts == [n - 20, n - 4] and r.n_ubatch == 16
        rec = open_slot_file(f"{d}/a.slot")
        assert not judge_layers(sf.body, rec.body).problems
        rec.close()


def test_first_layer_is_the_models_layer_0_not_each_blocks():
    # iSWA (Gemma 3): the SWA block holds model layer 0, the base block's layer 0 is model layer 5.
    # A changed token differs far beyond the limit in the model's first layer while the base
    # block's layer 0 (drifting like any deeper layer) may stay under it: still a changed token.
    from slotfile.format.records import CacheExpect
    from slotfile.verify.shape import first_layer_block

    caches = {
        "kv-base": CacheExpect("kv-base", (5, 11, 17), (256,) * 3, (256,) * 3),
        "kv-swa": CacheExpect("kv-swa", (0, 1, 2, 3, 4, 6), (256,) * 6, (256,) * 6),
    }
    assert first_layer_block(caches) == "kv-swa" and first_layer_block({}) is None
    n = 64
    j = Judgment()
    for block, part, layer, hot in (
        ("kv-swa", "K", 0, {20: 5.5}),
        ("kv-swa", "V", 0, {20: 7.8}),
        ("kv-swa", "V", 1, {20: 9.0, 24: 3.0}),
        ("kv-base", "K", 0, {20: 3.4}),
        ("kv-base", "V", 0, {20: 4.1}),
    ):
        r = np.zeros(n)
        for p, v in hot.items():
            r[p] = v
        j.cells.append(RunCells(block, part, layer, np.arange(n), r))
    j.problems.append((ProblemCode.DEEP_MISMATCH, "body.kv-swa.stream[0]", 0, "layer over its floors"))
    assert drift_shape(j, first_block="kv-swa").evidence.startswith("first layer: at position 20")
    assert drift_shape(j).drift  # taking the base block's layer 0 as a first layer hid it


def test_comparisons_made_ahead_give_the_same_judgment(gemma_bytes, monkeypatch):
    """The deep check compares the file with the recompute while the loader decodes the noise
    floor's tokens (slotfile.verify.deep._Early): judge_layers then takes each layer's
    comparison from the Precomputed instead of making it, with the same rows and problems,
    and ignores one made for another pair of bodies."""
    import slotfile.verify.judge as judge_mod

    clean = parse_buffer(gemma_bytes).body
    copies = {
        "clean": gemma_bytes,
        "zeroed": zero_512(gemma_bytes),
        "flipped": flip_exponent(gemma_bytes),
        "drift": drift_from(gemma_bytes, 46),
    }
    for name, data in copies.items():
        body = parse_buffer(data).body
        plain = judge_layers(body, clean, DeepInputs(n_tokens=54))
        pre = judge_mod.Precomputed(body, clean, {})
        assert len(pre.layers) == len(plain.rows), name
        assert pre.of(parse_buffer(data).body, clean) == {}  # another parse: another pair
        with monkeypatch.context() as m:
            m.setattr(judge_mod, "compare_layer", lambda *a: pytest.fail("compared again"))
            ahead = judge_layers(body, clean, DeepInputs(n_tokens=54, pre=pre))
        assert ahead.rows == plain.rows and ahead.problems == plain.problems, name
        assert ahead.byte_damage == plain.byte_damage, name
        assert all(np.array_equal(a.ratio, b.ratio) for a, b in zip(ahead.cells, plain.cells, strict=True)), name


def test_median_and_nanmedian_are_numpys():
    """slotfile.verify.stats.median / nanmedian (which spare the deep check numpy.ma's import)
    give numpy's values: odd and even sizes, NaN anywhere (NaN), none left (NaN)."""
    from slotfile.verify.stats import median, nanmedian

    rng = np.random.default_rng(25)
    for n in range(1, 40):
        a = rng.normal(size=n)
        assert median(a) == float(np.median(a)), n
        b = a.copy()
        b[::3] = np.nan
        assert np.isnan(median(b))
        if (~np.isnan(b)).any():
            assert nanmedian(b) == float(np.nanmedian(b)), n
    assert np.isnan(median([])) and np.isnan(nanmedian(np.array([np.nan, np.nan])))


def _spiked(peaking_layers: tuple[int, ...], p: int = 70, n: int = 100) -> Judgment:
    """Six K layers of one block, every cell at 0.3 floors but ``p`` in ``peaking_layers`` (15
    floors) and an isolated spike in layer 3 at ``p`` (its byte-damage line)."""
    rng = np.random.default_rng(5)
    j = Judgment()
    for layer in range(6):
        ratio = 0.3 + 0.05 * rng.random(n)
        if layer in peaking_layers or layer == 3:
            ratio[p] = 15.0
        j.cells.append(RunCells("kv-swa", "k", layer, np.arange(n), ratio))
        if layer == 3:
            j.problems.append((ProblemCode.DEEP_MISMATCH, "body.kv-swa.stream[0]", 0, "isolated spike"))
            j.byte_damage.append("body.kv-swa.stream[0] K layer 3 (f16): isolated spike at cell 70")
            j.spikes.append((layer, p))
    return j


def test_a_spike_where_many_layers_peak_is_the_position_diverging_not_the_bytes():
    # one element far off in layer 3 alone: a flipped bit
    assert drift_shape(_spiked(())).evidence.startswith("bytes: ")
    assert drift_shape(_spiked((4, 5))).evidence.startswith("bytes: ")  # two other layers: not enough
    # the same position far off in 3 other layers from depth 2 on, the first layer exact: that
    # token's residual stream parted (an ill-conditioned position), model space
    s = drift_shape(_spiked((2, 4, 5)))
    assert not s.evidence.startswith("bytes: ")
    # ... unless the first layer differs there too (a changed token)
    assert drift_shape(_spiked((0, 2, 4, 5))).evidence.startswith("bytes: ")
    # zeros or non-finite values are damage on any recompute, whatever the other layers show
    j = _spiked((2, 4, 5))
    j.byte_damage.append("body.kv-swa.stream[0] V layer 1 (f16): 300 stored values exactly zero")
    assert drift_shape(j).evidence.startswith("bytes: ")


def test_the_logits_of_the_closest_recompute_decide():
    from slotfile.verify.deep import _closest_logits

    first = {"rel": 0.175, "floor_rel": 0.034, "all_finite": True}
    s1, s2 = Schedule(2048, 512, (2237,), ((2241, 2440),)), Schedule(2048, 32)
    out = _closest_logits(first, [(s1, {"rel": 0.05, "all_finite": True}), (s2, {"rel": 0.3, "all_finite": True})])
    assert out["rel"] == 0.05 and out["floor_rel"] == 0.034 and out["schedule"] == s1.as_dict()
    assert _closest_logits(first, [(s2, {"rel": 0.3})]) is first
    assert _closest_logits(first, [(s1, {"rel": 0.01, "all_finite": False})]) is first


def test_drift_that_starts_at_the_first_tokens_small_is_another_builds(gemma_bytes, monkeypatch):
    """Another build's kernels part from this one's at the first tokens, though the drift may
    reach 2 floors only much later (an AVX-512 server's long file against an AVX2 library: exact
    up to position 3, over the floors from 1,371): no split moves it, and it passes as drift."""
    file_body = parse_buffer(gemma_bytes).body
    rec = parse_buffer(drift_from(drift_from(gemma_bytes, 3, 1.004), 40, 1.6)).body
    inputs = DeepInputs(n_tokens=54)
    j = judge_layers(file_body, rec, inputs)
    assert first_difference(j) == 3 and drift_shape(j).onset == 40
    out = judge_with_schedules(file_body, inputs, (Schedule(2048, 512), rec), lambda s: (rec, ""))
    assert out.drift and out.decided_by == "drift", out.evidence
    # the same drift from position 40 alone, exact before it, in a cache of several streams
    # (each slot alone in its own): no split moves it, damage
    rec = parse_buffer(drift_from(gemma_bytes, 40, 1.6)).body
    monkeypatch.setattr(shape, "single_stream", lambda body: False)
    out = judge_with_schedules(file_body, inputs, (Schedule(2048, 512), rec), lambda s: (rec, ""))
    assert not out.drift and out.unmoved and "agrees exactly up to position 40" in out.evidence


def test_unmoved_drift_in_a_one_stream_cache_is_cell_placement(gemma_bytes):
    """A unified cache gives a slot's tokens whatever cells are free, among other slots' cells
    (``llama_kv_cache::find_slot``), and the file keeps only their order: a 4-slot v3 server's
    multi-turn slot, cells in position order, is exact up to position 17 and 17 floors off, and
    no split moves it.  Placement reaches no first layer: with that layer agreeing at every
    position it passes as drift; with the first layer off too (a token changed from there, 1.1
    to 1.3 floors) it stays damage."""
    file_body = parse_buffer(gemma_bytes).body
    assert shape.single_stream(file_body)
    assert not shape.single_stream(parse_buffer((SLOTS / "llama_2stream.slot").read_bytes()).body)
    inputs = DeepInputs(n_tokens=54)
    drifted = drift_from(gemma_bytes, 40, 1.6)
    rec = parse_buffer(drifted).body
    out = judge_with_schedules(file_body, inputs, (Schedule(2048, 512), rec), lambda s: (rec, ""))
    assert out.drift and out.decided_by == "drift" and "one stream" in out.evidence, out.evidence
    # a caller with no splits to offer (the appendix blobs) still gets "unmoved", to try its own
    out = judge_with_schedules(file_body, inputs, (Schedule(2048, 512), rec), None)
    assert not out.drift and out.unmoved
    rec = parse_buffer(drift_from(drifted, 40, 1.01, first=True)).body
    j = judge_layers(file_body, rec, inputs)
    assert not shape.first_layer_agrees(j, None) and not drift_shape(j).evidence.startswith("first layer")
    out = judge_with_schedules(file_body, inputs, (Schedule(2048, 512), rec), lambda s: (rec, ""))
    assert not out.drift and out.unmoved and "agrees exactly up to position 40" in out.evidence


def test_unreplayed_drift_in_a_cache_of_one_stream_per_slot_is_left_unverified(gemma_bytes, monkeypatch):
    """A cache of one stream per slot (-np N without -kvu): concurrent slots' prompts share the
    server's batches, cut by llama_batch_allocr::split_equal into per-slot pieces whose sizes the
    file does not keep (a 4-slot server's long slots: exact up to position 513, then 49.6-66.5
    floors, 10 recomputes moving none).  With the first layer agreeing it is neither passed nor
    failed: positions from the first difference are an unchecked part (deep-unreplayed); with the
    first layer off as well it stays damage.  (The Gemma file, one stream, stands in for such a
    slot: the 2-stream fixture's model has one layer above the first, which reads as isolated.)"""
    assert shape.streams_per_slot(parse_buffer((SLOTS / "llama_2stream.slot").read_bytes()).body)
    file_body = parse_buffer(gemma_bytes).body
    assert not shape.streams_per_slot(file_body)
    monkeypatch.setattr(shape, "single_stream", lambda body: False)
    monkeypatch.setattr(shape, "streams_per_slot", lambda body: True)
    inputs = DeepInputs(n_tokens=54)
    drifted = drift_from(gemma_bytes, 40, 1.6)
    rec = parse_buffer(drifted).body
    out = judge_with_schedules(file_body, inputs, (Schedule(2048, 512), rec), lambda s: (rec, ""))
    assert out.drift and out.unreplayed == 40 and "one stream per slot" in out.evidence, out.evidence
    assert out.details()["unreplayed"] == 40
    lv = Level(CheckLevel.DEEP)
    commit_outcome(lv, file_body, out)
    assert [p.code for p in lv.problems] == [ProblemCode.DEEP_UNREPLAYED] and "positions 40 on" in lv.problems[
        0
    ].message
    rec = parse_buffer(drift_from(drifted, 40, 1.01, first=True)).body
    out = judge_with_schedules(file_body, inputs, (Schedule(2048, 512), rec), lambda s: (rec, ""))
    assert not out.drift and out.unreplayed is None and out.unmoved


def test_a_swa_full_server_is_replayed_with_a_whole_context_window(gemma_bytes):
    """A sliding-window cache of n_swa + n_ubatch cells reuses cells past that many positions and
    sums them in another order; a ``--swa-full`` server's never does, and the file does not say
    which (both save the window's cells): where the state agrees exactly past the first
    n_ubatch positions, the first retry is the same schedule with a whole-context window."""
    file_body = parse_buffer(gemma_bytes).body
    assert any(b.role == "kv-swa" for b in file_body.blocks)
    drifted = parse_buffer(drift_from(gemma_bytes, 46)).body
    asked: list[Schedule] = []

    def replay(s: Schedule):
        asked.append(s)
        return (file_body if s.swa_full else drifted), ""

    out = judge_with_schedules(file_body, DeepInputs(n_tokens=54), (Schedule(2048, 32), drifted), replay)
    assert asked[0] == Schedule(2048, 32, swa_full=True) and out.decided_by == "schedule"
    assert out.tried[1]["swa_full"] is True and "--swa-full" in out.evidence
    # a first difference inside the first n_ubatch positions: no cell was reused yet, no such retry
    asked.clear()
    judge_with_schedules(file_body, DeepInputs(n_tokens=54), (Schedule(2048, 512), drifted), replay)
    assert asked and not any(s.swa_full for s in asked)


def test_the_whole_context_window_is_kept_for_the_later_retries(gemma_bytes):
    """A --swa-full server's chat with a generated reply: the whole-context window alone brings the
    state closer, and the reply's replay passes only with it (a v3 long document: 74.98 floors,
    20.3 with --swa-full, 1.16 with --swa-full and both replies replayed)."""
    file_body, drifted, closer = _bodies_drifting_from_46(gemma_bytes)
    asked: list[Schedule] = []

    def replay(s: Schedule):
        asked.append(s)
        return (file_body if s.swa_full and s.stepwise else closer if s.swa_full else drifted), ""

    out = judge_with_schedules(file_body, DeepInputs(n_tokens=54), (Schedule(2048, 32), drifted), replay)
    assert [s.swa_full for s in asked] == [True, True] and asked[1].stepwise == ((46, 54),)
    assert out.decided_by == "schedule" and out.schedule == asked[1]


def test_a_smaller_window_is_replayed_with_its_own_split(gemma_bytes):
    """A state that parts before the first recompute's own sliding window reuses a cell (n_swa +
    n_ubatch: 8 + 40 here) was written with a smaller window: a smaller -ub's split comes first,
    with that split's own window, not a whole-context one, even after a whole-context retry
    brought the state closer (a -ub 128 v3 server's 2,056-token file: exact up to 776 against
    -ub 512's 1,024 cells, 57 floors; 5.9 with --swa-full; 1.27 with -ub 256 and its own window)."""
    file_body, drifted, closer = _bodies_drifting_from_46(gemma_bytes)
    assert shape.window_wraps(file_body, 40) == 48 and shape.window_wraps(file_body, 512) == 520
    asked: list[Schedule] = []

    def replay(s: Schedule):
        asked.append(s)
        return (file_body if s.n_ubatch == 32 and not s.swa_full else closer if s.swa_full else drifted), ""

    out = judge_with_schedules(file_body, DeepInputs(n_tokens=54), (Schedule(2048, 40), drifted), replay)
    assert asked == [Schedule(2048, 32)] and out.decided_by == "schedule"
    # a reply the text shows starting there: the replies first, and the whole-context window that
    # brought the state closer is kept for them, but not for the smaller split
    asked.clear()
    out = judge_with_schedules(
        file_body, DeepInputs(n_tokens=54), (Schedule(2048, 40), drifted), replay, replies=lambda: [(46, 54)]
    )
    assert asked[0] == Schedule(2048, 40, swa_full=True) and asked[1].swa_full and asked[1].stepwise
    assert asked[-1] == Schedule(2048, 32) and out.decided_by == "schedule" and out.schedule == Schedule(2048, 32)
    # parting past that window (a --swa-full server's, or a larger -ub's): the smaller split keeps it
    asked.clear()
    judge_with_schedules(file_body, DeepInputs(n_tokens=54), (Schedule(2048, 36), drifted), replay)
    assert asked[0] == Schedule(2048, 36, swa_full=True) and Schedule(2048, 32, swa_full=True) in asked
    assert Schedule(2048, 32) not in asked


def test_the_smaller_window_rule_counts_the_padded_window(gemma_bytes):
    """The recompute's window is padded to 256 cells (llama_kv_cache_iswa): where that holds the
    whole slot, it never reused a cell, so a state parting early is not put down to a smaller
    server window first; with a pad of 8 (48 cells, as unpadded) the smaller -ub's split comes
    first, as above."""
    file_body, drifted, closer = _bodies_drifting_from_46(gemma_bytes)

    def judged(window: shape.WindowCache) -> list[Schedule]:
        asked: list[Schedule] = []

        def replay(s: Schedule):
            asked.append(s)
            return (file_body if s.n_ubatch == 32 and not s.swa_full else closer if s.swa_full else drifted), ""

        judge_with_schedules(file_body, DeepInputs(n_tokens=54), (Schedule(2048, 40), drifted), replay, window=window)
        return asked

    assert judged(shape.WindowCache(8, 1, 4096, pad=8)) == [Schedule(2048, 32)]
    assert judged(shape.WindowCache(8, 1, 4096))[0] != Schedule(2048, 32)


def test_damage_a_retry_leaves_alone_is_damage(gemma_bytes):
    """Damage inside a drifting region reads as drift against the first recompute; a retry that
    replays the drift away leaves it alone, shaped like damage, and the file fails there (before:
    the later retries drowned it in drift again, and its ratio moving between recomputes read as
    drift: a -ub 128 server's file with 16 bytes of a SWA V layer zeroed passed after 9)."""
    bad = parse_buffer(_scale_cell(gemma_bytes, [("kv-base", "V", 1)], 50, 1.2)).body
    clean = parse_buffer(gemma_bytes).body
    drifted = parse_buffer(drift_from(gemma_bytes, 46)).body
    assert drift_shape(judge_layers(bad, drifted, DeepInputs(n_tokens=54))).drift
    asked: list[Schedule] = []

    def replay(s: Schedule):
        asked.append(s)
        return (clean if s.stepwise else drifted), ""

    out = judge_with_schedules(bad, DeepInputs(n_tokens=54), (Schedule(2048, 512), drifted), replay)
    assert out.decided_by == "shape" and not out.drift and len(asked) == 1, out.evidence
    assert (
        out.evidence.startswith("isolated: V layer 1 of kv-base at position 50") and "replays the rest" in out.evidence
    )
    # the clean file: that retry leaves nothing, a pass by it
    out = judge_with_schedules(clean, DeepInputs(n_tokens=54), (Schedule(2048, 512), drifted), replay)
    assert out.decided_by == "schedule" and not out.judgment.problems


def test_a_retry_that_parts_before_the_first_recompute_leaves_nothing_alone(gemma_bytes):
    """A retry that parts earlier than the first recompute computes those positions otherwise than
    the server did (the first recompute matched them bit for bit), so a lone cell it leaves there
    is its own, not the file's: the retries go on (a clean v3 ``-ctk q5_1 -fa off`` long document:
    exact up to 2,005 first, 1,028 with a whole-context window, a lone V cell at 1,051 read as
    damage; it passes as drift once the replies are replayed)."""
    file_body = parse_buffer(gemma_bytes).body
    drifted = parse_buffer(drift_from(gemma_bytes, 46)).body
    own = parse_buffer(_scale_cell(gemma_bytes, [("kv-base", "V", 1)], 30, 1.2)).body
    assert shape.first_difference(judge_layers(file_body, own, DeepInputs(n_tokens=54))) == 30

    def pick(s: Schedule) -> Body:
        return file_body if s.stepwise else own if s.swa_full else drifted

    out, asked = _judged_as_a_chat(file_body, drifted, pick)
    assert asked[0] == Schedule(2048, 32, swa_full=True) and len(asked) >= 2, out.evidence
    assert out.decided_by == "schedule" and not out.judgment.problems
    # a retry that parts where the first recompute did and leaves a lone cell there still fails
    bad = parse_buffer(_scale_cell(gemma_bytes, [("kv-base", "V", 1)], 50, 1.2)).body
    out, _ = _judged_as_a_chat(bad, drifted, pick)
    assert out.decided_by == "shape" and "isolated" in out.evidence and "replays the rest" in out.evidence


def _judged_as_a_chat(
    file_body: Body, first: Body, pick: Callable[[Schedule], Body], window: shape.WindowCache | None = None
) -> tuple[Any, list[Schedule]]:
    """``file_body`` judged against a first recompute ``first`` (-ub 32) of a 54-token chat whose
    reply the text shows at 46-54, each retry's state ``pick(schedule)``: the outcome and the
    schedules recomputed, in order."""
    asked: list[Schedule] = []

    def replay(s: Schedule) -> tuple[Body, str]:
        asked.append(s)
        return pick(s), ""

    out = judge_with_schedules(
        file_body,
        DeepInputs(n_tokens=54),
        (Schedule(2048, 32), first),
        replay,
        replies=lambda: [(46, 54)],
        window=window,
    )
    return out, asked


def test_a_lone_cell_past_an_earlier_reply_the_replay_prefilled_waits_for_every_reply(gemma_bytes):
    """A replay of the last reply alone prefills the earlier one, which the server decoded one
    token per call, so a lone cell it leaves after that reply is not yet damage: the replay of
    every reply decides (a clean v3 ``-ub 4096 -fa off`` long document: its second reply replayed
    with a whole-context window left one K element of window layer 5 at 5.92 times its noise, a
    false alarm).  A lone cell that replay leaves too fails; so does the first, where no later
    replay decodes the earlier reply."""
    clean = parse_buffer(gemma_bytes).body
    drifted = parse_buffer(drift_from(gemma_bytes, 40)).body
    closer = parse_buffer(drift_from(gemma_bytes, 40, 1.1)).body
    own = parse_buffer(_scale_cell(gemma_bytes, [("kv-base", "V", 1)], 50, 1.2)).body
    both = ((40, 44), (48, 54))

    def judged(file_body: Body, last: Body, every: Body | None) -> tuple[Any, list[Schedule]]:
        asked: list[Schedule] = []

        def replay(s: Schedule) -> tuple[Body | None, str]:
            asked.append(s)
            if s.stepwise == ((48, 54),):
                return last, ""
            if s.decodes_one_per_call(40):  # every reply, or a replay from the first difference
                return every, "" if every is not None else "failed"
            return (closer if s.swa_full else drifted), ""

        out = judge_with_schedules(
            file_body,
            DeepInputs(n_tokens=54),
            (Schedule(2048, 32), drifted),
            replay,
            replies=lambda: [(40, 44), (48, 54)],
        )
        return out, asked

    # the clean file: the last reply's replay leaves a lone cell at 50, every reply's none
    out, asked = judged(clean, own, clean)
    assert [s.stepwise for s in asked[1:3]] == [((48, 54),), both], asked
    assert out.decided_by == "schedule" and out.schedule.stepwise == both, out.evidence
    # damage at 50 that both replays leave alone: it fails, named by the replay of every reply
    bad = parse_buffer(_scale_cell(gemma_bytes, [("kv-base", "V", 1)], 50, 1.2)).body
    out, asked = judged(bad, clean, clean)
    assert out.decided_by == "shape" and out.schedule.stepwise == both, out.evidence
    assert "position 50" in out.evidence and "replays the rest" in out.evidence
    # no replay of every reply to decide: the lone cell the last reply's replay left fails
    out, asked = judged(clean, own, None)
    assert out.decided_by == "shape" and out.schedule.stepwise == ((48, 54),), out.evidence
    assert "replays the rest" in out.evidence


def test_a_split_that_reproduces_the_prompt_up_to_a_reply_leaves_only_reply_replays(gemma_bytes):
    """A retry that moves the first difference to the start of a reply the text shows reproduced
    the prompt's computation bit for bit: what follows, the server generated one token per call,
    so the splits that prefill the reply are not tried, only replays that decode it (a v3 ``-ub
    4096 -fa off`` long document: exact up to 1,029, up to its first reply at 2,014 with a
    whole-context window, then 7 splits that parted at 2,014 or earlier)."""
    file_body = parse_buffer(gemma_bytes).body
    drifted = parse_buffer(drift_from(gemma_bytes, 40)).body
    at_reply = parse_buffer(drift_from(gemma_bytes, 46, 1.1)).body

    def judged(swa_full: Body) -> tuple[Any, list[Schedule]]:
        asked: list[Schedule] = []

        def replay(s: Schedule) -> tuple[Body, str]:
            asked.append(s)
            return (swa_full if s.swa_full and not s.stepwise else drifted), ""

        out = judge_with_schedules(
            file_body, DeepInputs(n_tokens=54), (Schedule(2048, 40), drifted), replay, replies=lambda: [(46, 54)]
        )
        return out, asked

    out, asked = judged(at_reply)
    assert asked[0] == Schedule(2048, 40, swa_full=True) and len(asked) >= 2, asked
    assert all(s.decodes_one_per_call(46) for s in asked[1:]), asked
    assert out.decided_by == "drift" and out.drift, out.evidence
    # a whole-context window that parts elsewhere found no reply: the smaller split follows
    _, asked = judged(drifted)
    assert Schedule(2048, 32) in asked, asked
    # one that reaches the reply no closer (the margin not halved) still shows the drift: the
    # prompt was reproduced bit for bit up to the reply, the first layer agreeing
    out, asked = judged(parse_buffer(drift_from(gemma_bytes, 46)).body)
    assert all(s.decodes_one_per_call(46) for s in asked[1:]), asked
    assert out.decided_by == "drift" and "-ub 40, --swa-full reproduces the state past position 40" in out.evidence
    assert "up to the reply at 46" in out.evidence, out.evidence


def test_a_whole_context_window_that_parts_earlier_is_not_kept(gemma_bytes):
    """A whole-context window's retry that comes closer but parts before the first recompute did
    is not the server's window (the first recompute, with its own window, reproduced those
    positions bit for bit), so the replies are replayed with the first recompute's window, not
    that one (a v3 ``-ctk q4_1`` long document: exact up to its first reply at 2,005; --swa-full
    parted at 1,026 and took it from 18.3 to 5.4 floors, and every later retry kept it: 9
    recomputes; replaying the replies with the default window passes at 2.4 after 3)."""
    file_body = parse_buffer(gemma_bytes).body
    drifted = parse_buffer(drift_from(gemma_bytes, 46)).body
    earlier = parse_buffer(drift_from(gemma_bytes, 30, 1.1)).body
    first = judge_layers(file_body, drifted, DeepInputs(n_tokens=54))
    closer = judge_layers(file_body, earlier, DeepInputs(n_tokens=54))
    assert shape.first_difference(first) == 46 and shape.first_difference(closer) == 30
    assert closer.margin * shape.SCHEDULE_DEPENDENT <= first.margin
    out, asked = _judged_as_a_chat(
        file_body, drifted, lambda s: earlier if s.swa_full else file_body if s.stepwise else drifted
    )
    assert asked[:2] == [Schedule(2048, 32, swa_full=True), Schedule(2048, 32, (), ((46, 54),))], asked
    assert out.decided_by == "schedule" and not out.judgment.problems


def test_the_window_cache_is_the_iswa_size_padded_to_256():
    """llama_kv_cache_iswa's window: GGML_PAD(min(size_base, n_swa * seqs + n_ubatch), 256), the
    file's 8-cell window standing for n_swa; the whole context with --swa-full; None without a
    sliding window."""
    body = parse_buffer(GEMMA.read_bytes()).body
    assert shape.window_wraps(body, 32) == 40
    w = shape.window_cache(body, 1, 4096)
    assert w == shape.WindowCache(8, 1, 4096)
    assert w.cells(Schedule(2048, 32)) == 256
    assert w.cells(Schedule(2048, 512)) == 768  # 520 cells, padded
    assert w.cells(Schedule(2048, 512, swa_full=True)) == 4096
    assert shape.WindowCache(8, 65, 4096).cells(Schedule(2048, 512)) == 1280  # a unified cache: 8 * 65 + 512
    assert shape.WindowCache(8, 1, 256).cells(Schedule(2048, 512)) == 256  # no larger than the context
    assert shape.window_cache(parse_buffer((SLOTS / "llama_f16_fa.slot").read_bytes()).body, 1, 4096) is None


def test_the_recompute_window_comes_from_the_load_settings():
    """deep sizes the recompute's window from the settings it loads with: the tiny Gemma 3 file's
    context of 256 cells; a unified cache of 4 slots shares one window among them, 4 streams
    have one each; no window without a sliding-window block."""
    sf = open_slot_file(str(GEMMA))
    settings = settings_for(sf)
    assert (settings.n_ctx, settings.kv_unified) == (256, True)
    assert deep._recompute_window(sf, sf.body, settings) == shape.WindowCache(8, 1, 256)
    wide = dataclasses.replace(settings, n_ctx=4096, n_seq_max=4)
    assert deep._recompute_window(sf, sf.body, wide) == shape.WindowCache(8, 4, 4096)
    split = dataclasses.replace(settings, n_ctx=4096, n_seq_max=4, kv_unified=False)
    assert deep._recompute_window(sf, sf.body, split) == shape.WindowCache(8, 1, 1024)
    llama = open_slot_file(str(SLOTS / "llama_f16_fa.slot"))
    assert deep._recompute_window(llama, llama.body, settings_for(llama)) is None


def test_no_retry_whose_window_the_first_recompute_rules_out(gemma_bytes):
    """The first recompute reproduced the state bit for bit past where its window or a retry's
    first reuses a cell: a window of another size, which parts from it there, was not the
    server's (a v3 ``-t 4`` long document, exact up to 1,502 with a 1,024-cell window: a
    --swa-full retry and 4 smaller -ub with 768 cells were 5 of its 9 recomputes; it passes by
    its reply's replay after 2).  No whole-context retry where the first's window holds every
    token (it would compute alike).  Still where the state parts before that (WINDOW_PARTS
    allowed) or the window is unknown."""
    file_body = parse_buffer(gemma_bytes).body
    drifted = parse_buffer(drift_from(gemma_bytes, 46)).body
    whole = Schedule(2048, 32, swa_full=True)
    for window, asked_whole in (
        (shape.WindowCache(8, 1, 256), False),  # 256 cells hold all 54 tokens
        (shape.WindowCache(-24, 1, 256, pad=1), False),  # 8 cells: reused from 8, and 46 > 8 + 32
        (shape.WindowCache(-18, 1, 256, pad=1), True),  # 14 cells: 46 is within 32 of 14
        (None, True),
    ):
        out, asked = _judged_as_a_chat(
            file_body, drifted, lambda s: file_body if s.stepwise and not s.swa_full else drifted, window
        )
        assert (whole in asked) == asked_whole, (window, asked)
        assert out.decided_by == "schedule", window
        assert any("skipped" in t for t in out.tried) != asked_whole, out.tried


def test_window_rules_out_where_the_smaller_window_reuses_a_cell():
    """Windows of 1,024 cells (-ub 512, n_swa 512) and 768 (-ub 256: 512 + 256) part at 768; a
    state reproduced up to 1,502 rules the smaller one out; up to 790, not yet (WINDOW_PARTS);
    a larger -ub's or a whole context's parts at 1,024; a replay with the same window never."""
    w = shape.WindowCache(512, 1, 2304)
    first, smaller, larger = Schedule(2048, 512), Schedule(2048, 256), Schedule(2048, 1024)
    whole = dataclasses.replace(first, swa_full=True)
    assert "from position 768" in (shape.window_rules_out(w, first, smaller, 2168, 1502) or "")
    assert shape.window_rules_out(w, first, smaller, 2168, 790) is None
    assert "from position 1024" in (shape.window_rules_out(w, first, larger, 2168, 1502) or "")
    assert shape.window_rules_out(w, first, Schedule(2048, 512, (2101,), ((2105, 2168),)), 2168, 2005) is None
    assert "from position 1024" in (shape.window_rules_out(w, first, whole, 2168, 2005) or "")
    assert shape.window_rules_out(w, first, whole, 2168, 1030) is None
    assert shape.window_rules_out(None, first, smaller, 2168, 1502) is None


def test_quantized_kv_is_every_k_and_v_layer_quantized():
    """A q8_0 cache (a default 4-slot server's 2,136-token q8_0 file agrees exactly up to position
    69 with a recompute where its f16 twin parts at 3) against f16 and an f16 K with a q8_0 V."""
    assert shape.quantized_kv(parse_buffer((SLOTS / "llama_q8_0_fa.slot").read_bytes()).body)
    assert not shape.quantized_kv(parse_buffer(GEMMA.read_bytes()).body)
    assert not shape.quantized_kv(parse_buffer((SLOTS / "llama_f16_fa.slot").read_bytes()).body)


def test_no_split_where_another_builds_drift_is_settled(gemma_bytes, monkeypatch):
    """A state that stops agreeing exactly at the first tokens (another build's: position 3) and
    drifts past the limit later (46): with the next-token logits in agreement, no reply is placed
    after the first difference and decoded one token per call (a default 4-slot server's
    2,136-token file decoded 1,617 tokens so), and no split is tried (six such clean long files
    took 1-4 split retries each, none closer than the first recompute); the reply the text shows
    is replayed instead, and without one it passes as drift on the first recompute.  Without
    agreeing logits, the found reply comes first, then the splits.  A token changed where the
    state parts still fails."""
    file_body = parse_buffer(gemma_bytes).body
    rec = parse_buffer(drift_from(drift_from(gemma_bytes, 3, 1.002), 46, 1.6)).body
    reply = Schedule(2048, 512, (), ((46, 54),))
    for logits_ok, spans, want in (
        (False, None, [Schedule(2048, 512, (), ((3, 54),)), Schedule(2048, 32)]),
        (True, None, []),
        (True, [(46, 54)], [reply]),
    ):
        asked: list[Schedule] = []

        def replay(s: Schedule, asked: list[Schedule] = asked):
            asked.append(s)
            return rec, ""

        out = judge_with_schedules(
            file_body,
            DeepInputs(n_tokens=54),
            (Schedule(2048, 512), rec),
            replay,
            replies=(lambda spans=spans: spans) if spans else None,
            logits_ok=logits_ok,
        )
        assert out.tried[0]["first_difference"] == 3 and out.drift and out.decided_by == "drift"
        assert asked == want, (logits_ok, spans)
    monkeypatch.setattr(shape, "changed_token_at", lambda j, body, first_block: 3)
    out = judge_with_schedules(
        file_body, DeepInputs(n_tokens=54), (Schedule(2048, 512), rec), lambda s: pytest.fail("retried"), logits_ok=True
    )
    assert not out.drift and out.decided_by == "shape" and out.evidence.startswith("changed token:")


@pytest.mark.llama
def test_a_recurrent_state_failing_by_its_median_is_not_drift(tmp_path: Path, monkeypatch):
    """A recurrent S state is one cell: its layer fails by the median head angle, which its cell
    ratios need not reach, and drift_shape read "no cell over the limit" as drift; a one-stream
    cache whose first layer agrees then excused it (seed 25's 16-byte zero span in a Jamba S
    state, 15 floors).  Judged by the layer's row, it is damage, with no retry.  (The span's 3
    zeroed f32 values are a zero run since ZERO_RUN_WIDE; the limit is raised here to reach the
    median path, which damage that is not zeros takes.)"""
    from slotfile.verify import Verifier, VerifyOptions
    from slotfile.verify import judge as judge_mod

    monkeypatch.setattr(judge_mod, "ZERO_RUN_WIDE", 8)

    src = SLOTS / "extra-jamba.slot"
    sf = open_slot_file(src)
    (s0,) = [r for b in sf.body.blocks for r in b.s if r.index == 0]
    at = s0.data.offset + 114
    sf.close()
    data = bytearray(src.read_bytes())
    data[at : at + 16] = bytes(16)
    p = tmp_path / "jamba-s-zeroed.slot"
    p.write_bytes(bytes(data))
    with Verifier(VerifyOptions(model=str(MODELS / "extra-jamba.gguf"), deep=True)) as v:
        d = v.verify(p).levels["deep"]
    assert d.status == "fail" and d.details["decided_by"] == "shape", d.details["evidence"]
    assert "recurrent state" in d.details["evidence"] and len(d.details["schedules"]) == 1
    assert d.details["margin"] > 4


def _replayed_bodies(gemma_bytes: bytes, monkeypatch, first_at: int, replay_at: int) -> tuple[Any, Any, Any]:
    """The file's body, a first recompute drifting from ``first_at`` and a replay's drifting from
    ``replay_at``, in a cache taken as several streams (so no one-stream rule passes the drift)."""
    monkeypatch.setattr(shape, "single_stream", lambda body: False)
    return (
        parse_buffer(gemma_bytes).body,
        parse_buffer(drift_from(gemma_bytes, first_at, 1.6)).body,
        parse_buffer(drift_from(gemma_bytes, replay_at, 1.6)).body,
    )


def test_a_replay_of_generated_tokens_that_moves_the_difference_skips_prefill_splits(gemma_bytes, monkeypatch):
    """A reply replayed one token per call reproduces the state past where the prefill parted
    (46 -> 50): the server generated those tokens, so the splits that prefill position 46 are not
    recomputed (an edited 1,607-token chat: 5 recomputes, 30 of 56 seconds), and the drift left
    passes on that replay, with the first layer agreeing, even in a cache of several streams."""
    file_body, first, later = _replayed_bodies(gemma_bytes, monkeypatch, 46, 50)
    asked: list[Schedule] = []

    def replay(s: Schedule):
        asked.append(s)
        return (later if s.decodes_one_per_call(46) else first), ""

    out = judge_with_schedules(
        file_body, DeepInputs(n_tokens=54), (Schedule(2048, 512), first), replay, replies=lambda: [(46, 54)]
    )
    assert asked[0].stepwise == ((46, 54),) and all(s.decodes_one_per_call(46) for s in asked), asked
    assert (
        out.drift and out.decided_by == "drift" and "one per call reproduces the state past position 46" in out.evidence
    )
    # a replay that does not move the first difference proves nothing: the splits are tried
    asked.clear()
    out = judge_with_schedules(
        file_body, DeepInputs(n_tokens=54), (Schedule(2048, 512), first), lambda s: (asked.append(s), (first, ""))[1],
        replies=lambda: [(46, 54)],
    )  # fmt: skip
    assert any(not s.stepwise for s in asked) and not out.drift and out.decided_by == "shape"


def test_a_replay_that_parts_at_its_first_generated_token_skips_prefill_splits(gemma_bytes, monkeypatch):
    """A reply replayed one token per call can reproduce the state up to the reply's first token and
    part exactly there (a -t 6 -fa on server generated it: flash attention's split path sums a
    one-token decode's cells in one chunk per thread): no split that prefills that token can agree
    there, so none is recomputed (a 2,440-token chat: 4 recomputes, 25 of 67 seconds, saved)."""
    file_body, first, at_reply = _replayed_bodies(gemma_bytes, monkeypatch, 40, 46)
    asked: list[Schedule] = []

    def replay(s: Schedule):
        asked.append(s)
        # the reply the text shows replayed from its first token; a replay from the first difference
        # (40) computes 40-45 otherwise than the server
        return (at_reply if any(a == 46 for a, _ in s.stepwise) else first), ""

    out = judge_with_schedules(
        file_body, DeepInputs(n_tokens=54), (Schedule(2048, 512), first), replay, replies=lambda: [(46, 54)]
    )
    assert len(asked) >= 2 and all(s.decodes_one_per_call(46) for s in asked), asked
    assert out.drift and "one per call reproduces the state past position 40" in out.evidence


def test_a_replay_that_leaves_drift_where_the_first_recompute_looked_damaged_passes_as_drift(gemma_bytes, monkeypatch):
    """A generated position the server decoded with its own thread count can sit far from a prefill in
    one element or one row's length, shaped like a flipped bit or a scaled row (a -t 3 -fa on server's
    713-token chat at position 704).  When replaying the replies leaves no byte damage, the first layer
    agreeing, the drift shape and at most half the margin, that shape was the schedule's: drift.  A byte
    change in the file differs from the replay alike and still fails; so does a replay that does not
    halve the margin."""
    clean = parse_buffer(gemma_bytes).body
    # the prefill's value far off at one element, in a layer the prefill rounds otherwise everywhere (a
    # generated row decoded by another kernel path: no exact context, which gets no replay)
    odd_first = parse_buffer(flip_exponent(drift_from(gemma_bytes, 0, 1.002))).body
    replayed = parse_buffer(drift_from(gemma_bytes, 46, 1.1)).body  # the replay: drift, 11.6 floors
    asked: list[Schedule] = []

    def replay(s: Schedule):
        asked.append(s)
        return replayed, ""

    def judge(body: Body):
        return judge_with_schedules(
            body, DeepInputs(n_tokens=54), (Schedule(2048, 24), odd_first), replay, replies=lambda: [(2, 54)]
        )

    out = judge(clean)
    assert asked and out.drift and out.decided_by == "drift", out.evidence
    assert "the schedule's, not the bytes'" in out.evidence and out.judgment.margin < 12
    # the file's own flipped bit differs from the replay too
    damaged = parse_buffer(flip_exponent(gemma_bytes)).body
    out = judge_with_schedules(
        damaged, DeepInputs(n_tokens=54), (Schedule(2048, 24), clean), replay, replies=lambda: [(2, 54)]
    )
    assert not out.drift and out.decided_by == "bytes"
    # a replay that does not halve the margin leaves the first recompute's verdict
    monkeypatch.setattr(shape, "SCHEDULE_DEPENDENT", 100.0)
    out = judge(clean)
    assert not out.drift and out.decided_by == "bytes"
