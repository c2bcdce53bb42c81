"""Level 4, deep (``--deep``): the stored tokens prefilled again in a fresh context with the
same settings; the recomputed K/V (R/S) compared with the file's, layer by layer
(:mod:`slotfile.verify.judge`), and the next-token logits after restoring the file compared
with those after the recompute.

On Gemma 3 270M (bench/deep_noise.py, deep_noise.json) prefills with n_ubatch 512 or 32, 1 or
2 threads are bit-identical; the stored-vs-recomputed difference comes from the tokens the
server generated one per call and grows with depth, hence a floor from stepwise decoding.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np

from slotfile.format.reader import open_slot_file
from slotfile.format.records import Body, FileFormat, MemoryKind, SlotFile
from slotfile.llama.loader import DeepResult, LoaderPool, LoadSettings
from slotfile.llama.settings import settings_for
from slotfile.llama.worker.runtime import DEEP_N_BATCH, DEEP_N_UBATCH
from slotfile.model.expect import attn_rot_disabled
from slotfile.problems import CheckLevel, ProblemCode
from slotfile.verify.deep_blobs import check_appendices, recompute_crashed
from slotfile.verify.judge import (
    LOGITS_MIN_FLOOR,
    MARGIN_LIMIT,
    MIN_FLOOR,
    STEPWISE_TOKENS,
    Caches,
    DeepInputs,
    Precomputed,
    head_size,
    holds_every_position,
    layer_pairs,
    rotation_width,
)
from slotfile.verify.options import VerifyOptions
from slotfile.verify.records import NO_DEEP, Level, SkipKind, Status
from slotfile.verify.shape import (
    SHIFTED_CHECKS,
    Recompute,
    Schedule,
    WindowCache,
    as_shifted,
    blame_not_arithmetic,
    commit_outcome,
    judge_with_schedules,
    window_cache,
)
from slotfile.verify.stats import FLOAT_TYPES, cell_stats, median, tolerance_class
from slotfile.verify.turns import model_reply_spans


def _deep_preconditions(sf: SlotFile, n_vocab: int) -> str | None:
    """Why the stored tokens cannot reproduce the state (None: they should)."""
    if sf.format != FileFormat.GGSQ:
        return "session files (GGSN) hold every sequence; the deep check covers slot files"
    if sf.body is None or sf.body.layout is None or not sf.body.blocks:
        return "the body does not parse" if sf.body is None or sf.body.layout is None else "the file holds no state"
    tp = sf.tokens
    if tp is None or not tp.tokens.size:
        return "the file stores no tokens"
    if tp.media or np.any(tp.tokens < 0):
        return "the prompt has media chunks (image/audio embeddings cannot be recomputed from token ids)"
    if n_vocab and np.any(tp.tokens >= n_vocab):
        return "token ids outside the model's vocabulary (see the model level)"
    n = int(tp.tokens.size)
    first = sf.body.blocks[0]
    if first.kind == MemoryKind.KV:
        act = first.active_streams()
        # the cells in any order (a v3 server's slot 0 of 4: positions 0..49, 76..78, 50..75,
        # 79..124); the judge pairs cells by position
        if len(act) != 1 or not holds_every_position(act[0].positions, n):
            return (
                f"the cache does not hold positions 0..{n - 1} of the {n} stored tokens (context shift, "
                "a partial prompt or cache reuse): nothing to recompute it from"
            )
    else:
        pos = first.positions()
        if pos.size != 1 or int(pos[0]) != n - 1:
            return f"the recurrent state is not at position {n - 1} of the {n} stored tokens"
    return None


def rotation_check(file_body: Body, rec_body: Body, caches: Caches) -> dict[str, Any] | None:
    """For quantized caches that llama.cpp rotates (head size a multiple of 64): which rotation
    setting the stored values were computed with.  The stored rows are compared with the
    recompute as it is and with the recompute's Hadamard rotation undone (the transform is its
    own inverse); the setting whose median head angle is smaller is the file's.  None when no
    layer is rotatable."""
    direct: list[float] = []
    other: list[float] = []
    for fb, rb in zip(file_body.blocks, rec_body.blocks, strict=False):
        if fb.kind != MemoryKind.KV:
            continue
        cache = caches.get(fb.role)
        for _sec, fr, rr, _pos in layer_pairs(fb, rb):
            if fr is None or rr is None or fr.type_id in FLOAT_TYPES or fr.type_id != rr.type_id:
                continue
            head = head_size(cache, fr.part)
            w = rotation_width(cache, fr.part, fr.type_id)
            if not w or fr.row_size != rr.row_size:
                continue
            direct.append(cell_stats(fr, rr, head).summary().median_angle)
            other.append(cell_stats(fr, rr, head, rotate=w).summary().median_angle)
    if not direct:
        return None
    here_off = attn_rot_disabled()  # the workers inherit this environment
    d, o = median(direct), median(other)
    same = d <= o
    stored_off = here_off if same else not here_off
    return {
        "stored": "disabled (LLAMA_ATTN_ROT_DISABLE)" if stored_off else "rotated (as this llama.cpp does)",
        "recompute": "disabled (LLAMA_ATTN_ROT_DISABLE)" if here_off else "rotated",
        "matches": same,
        "median_angle_as_recomputed": round(d, 3),
        "median_angle_other_setting": round(o, 3),
        "layers": len(direct),
    }


def level_deep(
    sf: SlotFile,
    path: str,
    pool: LoaderPool | None,
    load: Level,
    opts: VerifyOptions,
    settings: LoadSettings | None,
    caches: Caches,
) -> Level:
    """Recompute the stored tokens the way the server did (n_batch/n_ubatch: ``opts``, default
    the server's 2048/512), and the last :data:`STEPWISE_TOKENS` of them once more one per
    call, as the server decodes generated tokens: that second state's difference from the
    first, per layer, is the noise floor each stored layer is judged against
    (:func:`slotfile.verify.judge.judge_run`).  ``caches``: the model's caches by role."""
    lv = Level(CheckLevel.DEEP)
    why = _skip_reason(sf, pool, load, opts)
    if why is not None:
        return lv.skip(*why)
    assert pool is not None  # _skip_reason: a loader
    tokens = [int(t) for t in sf.tokens.tokens]  # type: ignore[union-attr]
    body: Body = sf.body  # type: ignore[assignment]  # _deep_preconditions: a parsed body
    first = Schedule(opts.n_batch or DEEP_N_BATCH, opts.n_ubatch or DEEP_N_UBATCH)
    early = _Early(body, caches)
    with _scratch_files(2) as (rec_out, floor_out), contextlib.closing(early):
        res = pool.deep(
            path,
            tokens,
            tokens[-1],
            rec_out,
            settings,
            timeout=opts.timeout,
            batch=first.n_batch,
            n_ubatch=first.n_ubatch,
            n_stepwise=STEPWISE_TOKENS,
            out_floor=floor_out,
            on_recomputed=lambda: early.compare(rec_out),
        )
        if res.ok:
            retry = _retrier(pool, path, tokens, settings, opts)
            window = _recompute_window(sf, body, settings or settings_for(sf, opts.n_gpu_layers))
            run = (tokens, first, _needs_checkpoints(sf), opts.model, window)
            _judge_deep(lv, body, run, res, early, retry)
        elif res.crashed:
            blobs = " (the appendix blobs are not recomputed either)" if sf.sckp or sf.draft else ""
            what = "the stored tokens" + blobs
            recompute_crashed(lv, "body", body.offset, res.message, what)
            return lv.finish()
        else:
            lv.error(ProblemCode.DEEP_FAILED, "body", body.offset, "recompute failed: " + res.message)
    check_appendices(lv, sf, pool, opts, settings, caches)  # SCKP and SDFT blobs (deep_blobs.py)
    if lv.details.get("decided_by") == "logits":  # the body's and the blobs' drift warnings alike
        lv.problems = [
            dataclasses.replace(p, message=blame_not_arithmetic(p.message)) if p.code == ProblemCode.DEEP_DRIFT else p
            for p in lv.problems
        ]
    return lv.finish()


def _skip_reason(
    sf: SlotFile, pool: LoaderPool | None, load: Level, opts: VerifyOptions
) -> tuple[str, SkipKind] | None:
    """Why the deep level does not run for this file (None: it runs)."""
    if not opts.deep:
        return NO_DEEP, SkipKind.NOT_REQUESTED
    if pool is None:
        return "no --model", SkipKind.NOT_REQUESTED
    if load.status == Status.SKIPPED:
        return "the file could not be test-loaded here", SkipKind.CANNOT_CHECK
    if load.status != Status.PASS:
        return "the file does not load", SkipKind.BLOCKED
    why = _deep_preconditions(sf, int(pool.info.get("n_vocab") or 0))
    return (why, SkipKind.CANNOT_CHECK) if why else None


@contextlib.contextmanager
def _scratch_files(n: int) -> Iterator[list[str]]:
    """``n`` empty temporary files for the worker to save states into, removed afterwards."""
    outs: list[str] = []
    try:
        for _ in range(n):
            fd, out = tempfile.mkstemp(prefix="slotfile-deep-", suffix=".slot")
            os.close(fd)
            outs.append(out)
        yield outs
    finally:
        for o in outs:
            try:
                os.unlink(o)
            except OSError:
                pass


class _Early:
    """The comparisons that need no noise floor, made as soon as the recompute is written while
    the loader decodes the floor's tokens on the other core(s): the recomputed file, the
    rotation check and every layer's :class:`~slotfile.verify.judge.Precomputed` comparison.
    The same calls as without it; when one fails here the judgment makes it again and reports
    it there."""

    def __init__(self, body: Body, caches: Caches) -> None:
        self.body, self.caches = body, caches
        self.rec: Any = None  # the opened recompute (a SlotFileHandle), once compared
        self.rotation: dict[str, Any] | None = None
        self.pre: Precomputed | None = None

    def compare(self, rec_path: str) -> None:
        try:
            rec = open_slot_file(rec_path)
        except Exception:  # the judgment opens it again and reports why
            return
        self.rec = rec
        try:
            if rec.body is not None:
                self.rotation = rotation_check(self.body, rec.body, self.caches)
                if self.rotation is None or self.rotation["matches"]:
                    self.pre = Precomputed(self.body, rec.body, self.caches)
        except Exception:  # as above: made again where it is reported
            self.rec, self.rotation, self.pre = None, None, None
            rec.close()

    def close(self) -> None:
        if self.rec is not None:
            self.rec.close()
            self.rec = None


def _needs_checkpoints(sf: SlotFile) -> bool:
    """Whether the server stopped this file's prompts at checkpoint breaks: a recurrent state,
    or a sliding-window cache that does not hold every position (no ``--swa-full``)."""
    body = sf.body
    if body is None or sf.tokens is None:
        return False
    if any(b.kind != MemoryKind.KV for b in body.blocks):
        return True
    return any(b.role == "kv-swa" and b.cell_count < sf.tokens.tokens.size for b in body.blocks)


def _recompute_window(sf: SlotFile, body: Body, settings: LoadSettings) -> WindowCache | None:
    """What sizes the recompute's sliding-window cache (:class:`~slotfile.verify.shape.WindowCache`),
    for the state versions whose ``llama_kv_cache_iswa`` sizes it so (3 and 4); None otherwise."""
    if sf.version not in (3, 4):
        return None
    return window_cache(body, settings.n_seq_max if settings.kv_unified else 1, settings.n_ctx_seq)


def _retrier(
    pool: LoaderPool, path: str, tokens: list[int], settings: LoadSettings | None, opts: VerifyOptions
) -> tuple[Recompute, list[Any], list[tuple[Schedule, dict[str, Any]]]]:
    """A ``recompute(schedule)`` for :func:`judge_with_schedules`, the list of the files it
    opened (closed by the caller) and the next-token logits comparison of each recompute; each
    recompute is written to a scratch file removed at once (the parsed body keeps its own map)."""
    opened: list[Any] = []
    logits: list[tuple[Schedule, dict[str, Any]]] = []

    def recompute(s: Schedule) -> tuple[Body | None, str]:
        with _scratch_files(1) as (out,):
            r = pool.deep(
                path, tokens, tokens[-1], out, settings, timeout=opts.timeout,
                batch=s.n_batch, n_ubatch=s.n_ubatch, cuts=list(s.cuts), stepwise=s.stepwise, swa_full=s.swa_full,
            )  # fmt: skip
            if not r.ok:
                return None, r.message
            f = open_slot_file(out)
        opened.append(f)
        if r.logits:
            logits.append((s, r.logits))
        return f.body, ""

    return recompute, opened, logits


def _judge_deep(
    lv: Level,
    body: Body,
    run: tuple[list[int], Schedule, bool, str | None, WindowCache | None],
    res: DeepResult,
    early: _Early,
    retry: tuple[Recompute, list[Any], list[tuple[Schedule, dict[str, Any]]]],
) -> None:
    """The file's state against the recomputed one (rotation, then every layer against the
    noise floor, other schedules when the difference has the drift shape:
    :func:`slotfile.verify.shape.judge_with_schedules`) and the next-token logits: problems
    into ``lv``, the figures into its details.  ``run``: the tokens, the first schedule,
    whether the server took checkpoints, the model (its vocabulary shows the chat's replies) and
    what sizes the recompute's sliding-window cache (None: unknown or none)."""
    tokens, first, checkpoints, model, window = run
    assert res.recomputed is not None  # res.ok
    caches = early.caches
    made_early = early.rec is not None
    rec = early.rec if made_early else open_slot_file(res.recomputed)
    early.rec = None  # closed below
    flo = open_slot_file(res.floor) if res.floor else None
    recompute, opened, retried_logits = retry
    try:
        inputs = DeepInputs(
            flo.body if flo else None, caches, len(tokens), res.n_stepwise, pre=early.pre, tokens=np.asarray(tokens)
        )
        if made_early:
            rot = early.rotation
        else:
            rot = rotation_check(body, rec.body, caches) if rec.body is not None else None
        outcome = None
        if rot is not None and not rot["matches"]:
            lv.error(ProblemCode.DEEP_ROTATION, "body", body.offset, _rotation_message(rot))
        else:
            replies = (lambda: model_reply_spans(model, tokens)) if model else None
            lg0 = res.logits or {}
            logits_ok = bool(lg0.get("all_finite", True)) and _logits_ratio(body, lg0)[1] <= MARGIN_LIMIT
            assert rec.body is not None  # a recomputed state parses
            outcome = judge_with_schedules(
                body, inputs, (first, rec.body), recompute, checkpoints, replies, logits_ok, window=window
            )
    finally:
        for f in (rec, flo, *opened):
            if f is not None:
                f.close()
    lg = _closest_logits(res.logits or {}, retried_logits)
    if outcome is not None and outcome.drift and _logits_ratio(body, lg)[1] > MARGIN_LIMIT:
        # layers that pass as drift with logits that do not: shifted cells answer otherwise too
        outcome = as_shifted(outcome, body, caches) or outcome
    if outcome is not None:
        commit_outcome(lv, body, outcome)
        if outcome.shifted is not None:  # checked there only for tokens and byte damage: say so
            lv.unchecked_parts.append(_shifted_part(body, outcome.shifted, len(tokens)))
        if outcome.unreplayed is not None:  # drift no recompute replays: not verified from there
            lv.unchecked_parts.append(_unreplayed_part(body, outcome.unreplayed, len(tokens)))
    rows = outcome.judgment.rows if outcome else []
    worst = max(rows, key=lambda r: r["ratio"], default=None)
    drift = outcome.judgment.margin if outcome is not None and outcome.drift else None
    shifted = outcome is not None and outcome.shifted is not None
    lfloor, lratio = _check_logits(lv, body, lg, drift, shifted)
    lv.details = {
        "layers": rows,
        "logits": dict(lg, floor=lfloor, ratio=round(lratio, 3)),
        "probe_token": tokens[-1],
        "n_batch": outcome.schedule.n_batch if outcome else res.n_batch,
        "n_ubatch": outcome.schedule.n_ubatch if outcome else res.n_ubatch,
        "cuts": list(outcome.schedule.cuts) if outcome else [],
        "tail": res.n_stepwise,  # the JSON key of the stepwise tokens (schema slotfile.verify/1)
        "limit": MARGIN_LIMIT,
        "margin": worst["ratio"] if worst else 0.0,
        "worst": {k: worst[k] for k in ("section", "part", "layer", "ratio", "by", "worst_pos")} if worst else None,
        "rotation": rot,
        "min_floor": MIN_FLOOR,
        **(outcome.details() if outcome else {"decided_by": "rotation", "evidence": "", "schedules": []}),
    }
    if drift is not None and lv.has(ProblemCode.DEEP_LOGITS):
        # the layers alone would pass as drift: what failed the file is what it would answer
        lv.details["decided_by"] = "logits"
        lv.details["evidence"] = (
            f"the next-token logits differ by {lratio:.3g} floors, though the layers' difference "
            f"({drift:.3g} floors) has the shape of drift ({outcome.evidence if outcome else ''})"
        )


def _shifted_part(body: Body, p: int, n: int) -> dict[str, Any]:
    """The deep level's unchecked part for cells the server shifted (``Outcome.shifted``):
    ``--require deep`` fails on it, and the summary counts the file as not fully checkable."""
    reason = (
        f"positions {p}-{n - 1} hold cells the server shifted (a context shift or a reused chunk), computed over "
        f"tokens the file no longer holds: their values are not compared; checked there: {SHIFTED_CHECKS}"
    )
    return _body_part(body, reason, "none: no recompute gives them")


def _unreplayed_part(body: Body, p: int, n: int) -> dict[str, Any]:
    """The deep level's unchecked part for a slot's positions that differ from every recompute
    tried as a share of other slots' batches does (``Outcome.unreplayed``)."""
    reason = (
        f"positions {p}-{n - 1} differ from every recompute tried, as a slot's share of batches with other slots "
        "(one cache stream per slot) makes and a changed token before the first layer's window would: not verified"
    )
    hint = "verify a copy saved by a server that handled this slot's prompt alone, or with the same -b/-ub"
    return _body_part(body, reason, hint)


def _body_part(body: Body, reason: str, hint: str) -> dict[str, Any]:
    """An entry of the deep level's ``unchecked_parts`` for positions of the body."""
    return {"section": "body", "offset": body.offset, "reason": reason, "hint": hint}


def _closest_logits(first: dict[str, Any], retried: list[tuple[Schedule, dict[str, Any]]]) -> dict[str, Any]:
    """The next-token logits comparison of the recompute closest to the restored file's: the
    first one's, or a retried schedule's when that is closer (relative difference), with the
    first one's noise floor (only the first recompute decodes a floor) and its ``schedule``.  A
    server's schedule reproduces its logits as it does its layers (a 2,440-token two-reply file
    of a ``-fa on`` server: 17.5 % from a prefill, 7.9 % with its replies replayed; floor 3.4 %);
    damage in the file moves them from every recompute alike."""
    best = first
    for s, lg in retried:
        if lg.get("all_finite", True) and float(lg.get("rel", np.inf)) < float(best.get("rel", np.inf)):
            best = dict(lg, schedule=s.as_dict())
    if best is not first and "floor_rel" in first:
        best["floor_rel"] = first["floor_rel"]
    return best


def _rotation_message(rot: dict[str, Any]) -> str:
    fix = (
        "load it with LLAMA_ATTN_ROT_DISABLE=1"
        if rot["stored"].startswith("disabled")
        else "load it without LLAMA_ATTN_ROT_DISABLE"
    )
    return (
        f"the stored K/V were computed with rotation {rot['stored']}; this llama.cpp's recompute is "
        f"{rot['recompute']} (median head angle {rot['median_angle_as_recomputed']:.3g} degrees as "
        f"recomputed, {rot['median_angle_other_setting']:.3g} with the rotation undone): restored here, "
        f"attention reads the cache in the wrong basis; {fix}"
    )


def _logits_ratio(body: Body, lg: dict[str, Any]) -> tuple[float, float]:
    """The logits comparison's floor (at least LOGITS_MIN_FLOOR of the body's coarsest type)
    and its difference in floors."""
    tol_class = max(
        (tolerance_class(r.type_id) for b in body.blocks for r in b.runs()),
        key=lambda c: LOGITS_MIN_FLOOR[c],
        default="float",
    )
    lfloor = max(float(lg.get("floor_rel", 0.0)), LOGITS_MIN_FLOOR[tol_class])
    return lfloor, float(lg.get("rel", 0.0)) / lfloor


def _check_logits(
    lv: Level, body: Body, lg: dict[str, Any], drift: float | None = None, shifted: bool = False
) -> tuple[float, float]:
    """Next-token logits after restoring the file against those after recomputing, judged
    against their floor (at least LOGITS_MIN_FLOOR of the body's coarsest type): (floor, ratio).
    ``drift``: the layers' margin when they passed as drift (the message then says what that
    means for the file: another build's drift leaves the logits within their floor).  ``shifted``:
    the state holds cells the server shifted, computed over tokens the file no longer holds, so its
    logits are not those of a recompute and only non-finite ones are an error."""
    lfloor, lratio = _logits_ratio(body, lg)
    if not lg.get("all_finite", True):
        lv.error(ProblemCode.DEEP_LOGITS, "body", body.offset, "non-finite next-token logits after restoring the file")
    elif lratio > MARGIN_LIMIT and not lv.has(ProblemCode.DEEP_ROTATION) and not shifted:
        lv.error(
            ProblemCode.DEEP_LOGITS,
            "body",
            body.offset,
            f"next-token logits after restoring differ from those after recomputing the tokens by "
            f"{lratio:.3g} noise floors ({100 * lg['rel']:.3g}%; floor {100 * lfloor:.3g}%, limit "
            f"{MARGIN_LIMIT:g}; top token {lg['top5_restored'][0]} vs {lg['top5_recomputed'][0]})"
            + (
                ""
                if drift is None
                else f"; every layer differs from this model's recompute ({drift:.3g} floors at most) with the "
                "shape of drift, which another build's arithmetic gives but leaves the logits within their floor: "
                "likely computed with other weights (another model or quantization than --model)"
            ),
        )
    return lfloor, lratio
