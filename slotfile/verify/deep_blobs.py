"""The deep level's check of what follows the body (``--deep``): every SCKP checkpoint's
``data_tgt`` against a recompute of its first ``n_tokens`` stored tokens, and with
``--draft-model`` each checkpoint's ``data_dft`` and the SDFT ``data_dft`` against the draft
model's recompute of the same tokens.

The worker prefills the tokens once, stopping at every checkpoint's n_tokens (where the server
stopped its prompt to call ``create_checkpoint``) and taking the PARTIAL_ONLY blob there
(``Worker.deep_blobs``).  Each recomputed blob is parsed by the reader's own blob parser
(:func:`slotfile.format.read_appendix.parse_seq_blob`) and judged by the body's rules
(:func:`slotfile.verify.shape.judge_with_schedules`, without other schedules: statistics, zero
runs and spikes, then moved data - swapped layers, K/V or cell rows - before any difference is
excused as drift, then the drift-or-damage shape), first against the cache type's minimum floors
(:data:`~slotfile.verify.judge.MIN_FLOOR`; a single prompt's checkpoints recompute bit for bit);
a checkpoint above them is judged again against a stepwise floor of its own, as the body is:
the same prefill with the tokens since the previous checkpoint (at most
:data:`CHECKPOINT_STEPWISE`) decoded one per call (a later turn's checkpoint holds an
earlier turn's generated rows, which the server decoded that way); draft blobs alike, in the draft context.  A blob that
cannot be recomputed from the stored tokens is skipped with the reason in the details, never
silently.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import mmap
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from slotfile.format import grammar as g
from slotfile.format.read_appendix import parse_seq_blob
from slotfile.format.records import BlobInfo, Body, CacheExpect, Checkpoint, MemoryKind, ModelExpect, SlotFile
from slotfile.llama.pool import LoaderPool
from slotfile.llama.settings import draft_settings_for, settings_for
from slotfile.llama.worker.runtime import DEEP_N_BATCH, DEEP_N_UBATCH
from slotfile.llama.worker.settings import LoadSettings
from slotfile.problems import CheckLevel, ProblemCode
from slotfile.verify.judge import Caches, DeepInputs, caches_of
from slotfile.verify.lone import lone_cells
from slotfile.verify.options import VerifyOptions
from slotfile.verify.records import Level, Status
from slotfile.verify.shape import MAX_RETRIES, USUAL_UBATCH, Outcome, Schedule, commit_outcome, judge_with_schedules

WORST_KEYS = ("section", "part", "layer", "ratio", "by", "worst_pos")
# The most tokens before a blob that its noise floor decodes one per call (never more than the
# tokens since the previous checkpoint).  A checkpoint's window can hold generated rows anywhere
# since the previous one, not only in its last STEPWISE_TOKENS: on Gemma 3 270M a second-turn
# checkpoint saved with -ub 32 and judged with --n-ubatch 32 was 5.5 floors from its recompute
# with 32 stepwise tokens, 1.1 with the 59 since the previous checkpoint (bench/deep_blobs_noise.py).
CHECKPOINT_STEPWISE = 128


@dataclasses.dataclass
class _Plan:
    """What the worker recomputes: checkpoint n_tokens, whether the draft runs, and the report
    entries of the blobs (skipped ones already hold their reason)."""

    at: list[int]
    draft: bool
    checkpoints: list[dict[str, Any]]
    sdft: dict[str, Any] | None


def check_appendices(
    lv: Level,
    sf: SlotFile,
    pool: LoaderPool,
    opts: VerifyOptions,
    settings: LoadSettings | None,
    caches: Caches,
) -> None:
    """Recompute and judge every checkpoint blob and the SDFT draft state of ``sf`` (its tokens
    already passed the body's deep preconditions): problems into ``lv``, per-blob figures into
    ``lv.details["checkpoints"]`` and ``lv.details["draft"]``.  A checkpoint whose values exceed
    the minimum floors is judged again against its stepwise floor (:func:`_with_floors`): a
    second pass that single-prompt files, whose checkpoints recompute exactly, never pay."""
    tokens = [int(t) for t in sf.tokens.tokens] if sf.tokens is not None else []
    plan = _plan(sf, len(tokens), pool.draft_model is not None, lv.has(ProblemCode.DEEP_ROTATION))
    lv.details["checkpoints"], lv.details["draft"] = plan.checkpoints, plan.sdft
    lv.unchecked_parts += unchecked_parts(sf, plan)
    if not plan.at and not plan.draft:
        return
    t0 = time.monotonic()
    call = functools.partial(
        pool.deep_blobs,
        tokens,
        plan.at,
        settings=settings or settings_for(sf, opts.n_gpu_layers),
        draft_settings=draft_settings_for(sf, opts.n_gpu_layers) if plan.draft else None,
        timeout=opts.timeout,
        n_batch=opts.n_batch,
        n_ubatch=opts.n_ubatch,
    )
    judged = Level(CheckLevel.DEEP)
    with _scratch() as out:
        reply, why, crashed = call(out=out)
        if reply is None:
            _failed(judged, sf, why, crashed)
            _mark_pending(plan, "llama.cpp crashed recomputing them" if crashed else "the recompute failed", crashed)
        else:
            with _mapped(out) as view:
                sched = Schedule(opts.n_batch or DEEP_N_BATCH, opts.n_ubatch or DEEP_N_UBATCH)
                judge = _Judge(judged, dataclasses.replace(sf, problems=[], sections=[]), view, sched)
                _judge_all(judge, sf, plan, reply, caches)
                _with_floors(judge, sf, plan, reply, caches, call)
                _with_splits(judge, sf, plan, caches, call)
    lv.problems += judged.problems
    lv.unchecked_parts += judged.unchecked_parts  # a recompute that crashed (recompute_crashed)
    lv.details["appendix_seconds"] = round(time.monotonic() - t0, 3)


def _with_floors(
    judge: _Judge, sf: SlotFile, plan: _Plan, reply: dict[str, Any], caches: Caches, call: Callable[..., Any]
) -> None:
    """Judge again, each against its stepwise noise floor, the blobs that failed by their values
    alone (deep-mismatch) against the minimum floors."""
    retry: list[int] = []
    dretry: list[int] = []
    for sec, (e, n, draft) in _blob_sections(sf, plan).items():
        if _reopen(judge.lv, e, sec):
            (dretry if draft else retry).append(n)
    if not retry and not dretry:
        return
    with _scratch() as out:
        got, why, crashed = call(out=out, n_stepwise=CHECKPOINT_STEPWISE, floor_at=retry, draft_floor_at=dretry)
        if got is None:
            _failed(judge.lv, sf, f"the noise floor: {why}", crashed)
            _mark_pending(plan, "the noise-floor recompute " + ("crashed" if crashed else "failed"), crashed)
            return
        with _mapped(out) as judge.floor_view:
            _judge_all(judge, sf, plan, reply | {k: got[k] for k in ("floors", "draft_floors")}, caches)


def _blob_sections(sf: SlotFile, plan: _Plan) -> dict[str, tuple[dict[str, Any], int, bool]]:
    """Every planned blob by its section: (its report entry, the n_tokens it holds, whether it is
    the draft model's)."""
    out: dict[str, tuple[dict[str, Any], int, bool]] = {}
    for ck, e in zip(sf.checkpoints, plan.checkpoints, strict=True):
        out[f"sckp.checkpoint[{ck.index}].data_tgt"] = (e, ck.n_tokens, False)
        if e["draft"] is not None:
            out[f"sckp.checkpoint[{ck.index}].data_dft"] = (e["draft"], ck.n_tokens, True)
    if plan.sdft is not None:
        out["sdft.data_dft"] = (plan.sdft, int(sf.tokens.tokens.size) if sf.tokens is not None else 0, True)
    return out


def _with_splits(judge: _Judge, sf: SlotFile, plan: _Plan, caches: Caches, call: Callable[..., Any]) -> None:
    """The blobs whose final judgment failed only because their difference, drift-shaped, was
    not moved by another split (``Outcome.unmoved``: the first judgment has no other schedule
    to offer), recomputed with the usual ``-ub`` values below the first one
    (:data:`~slotfile.verify.shape.USUAL_UBATCH`, at most :data:`~slotfile.verify.shape.MAX_RETRIES`),
    each with its own stepwise floor, until one leaves the blob within its floors, as the body's
    are (:func:`slotfile.verify.shape.judge_with_schedules`).  The file does not record the
    server's ``-b``/``-ub``, and on a long prompt the split moves a checkpoint's values beyond
    the floors (a 1,175-token Gemma 3 270M chat saved with ``-ub 128``: 12.8 floors at ``-ub 512``,
    2.7 at 128).  A blob no split clears keeps its first judgment."""
    todo = {sec: v for sec, v in _blob_sections(sf, plan).items() if sec in judge.unmoved}
    first = judge.schedule
    tried = {sec: [first.as_dict() | {"margin": e["margin"]}] for sec, (e, _n, _d) in todo.items()}
    for sec, (e, _n, _d) in todo.items():
        e["schedules"] = tried[sec]  # filled in as the splits are tried (kept across the restores below)
    for u in [u for u in USUAL_UBATCH if u < first.n_ubatch][:MAX_RETRIES]:
        if not todo:
            break
        sched = Schedule(first.n_batch, u)
        kept = {sec: dict(e) for sec, (e, _n, _d) in todo.items()}
        for e, _n, _d in todo.values():
            e.update(status="pending")
        sub = Level(CheckLevel.DEEP)
        with _scratch() as out, _scratch() as fout:
            reply, why, _crashed = call(out=out, n_ubatch=u)
            floors = None
            if reply is not None:
                tgt = [n for _e, n, d in todo.values() if not d]
                dft = [n for _e, n, d in todo.values() if d]
                floors, why, _crashed = call(
                    out=fout, n_ubatch=u, n_stepwise=CHECKPOINT_STEPWISE, floor_at=tgt, draft_floor_at=dft
                )
            if reply is not None and floors is not None:
                with _mapped(out) as view, _mapped(fout) as fview:
                    split = _Judge(sub, judge.scratch, view, sched, fview)
                    _judge_all(split, sf, plan, reply | {k: floors[k] for k in ("floors", "draft_floors")}, caches)
        for sec, (e, _n, _d) in list(todo.items()):
            got = {"margin": e["margin"]} if e["status"] != "pending" else {"error": why}
            tried[sec].append(sched.as_dict() | got)
            if e["status"] == Status.PASS:
                judge.lv.problems = [p for p in judge.lv.problems if not p.section.startswith(sec)]
                judge.lv.problems += [p for p in sub.problems if p.section.startswith(sec)]
                e.update(
                    decided_by="schedule",
                    evidence=f"replaying the split {sched.label()} leaves it within its floors",
                )
                del todo[sec]
            else:
                e.clear()
                e.update(kept[sec])


def _reopen(lv: Level, e: dict[str, Any], section: str) -> bool:
    """Whether the blob of entry ``e`` failed by its values alone (deep-mismatch), not by a lone
    cell (:func:`_with_lone`); if so its problems are dropped and the entry is pending again,
    for its stepwise floor."""
    mine = [p for p in lv.problems if p.section.startswith(section)]
    if e["status"] != Status.FAIL or e.get("decided_by") == LONE:
        return False
    if not all(p.code == ProblemCode.DEEP_MISMATCH for p in mine):
        return False
    lv.problems = [p for p in lv.problems if p not in mine]
    e.update(status="pending")
    return True


def _failed(lv: Level, sf: SlotFile, why: str, crashed: bool) -> None:
    where = sf.sckp or sf.draft
    section, offset = "sckp" if sf.sckp else "sdft", where.offset if where else None
    if crashed:
        recompute_crashed(lv, section, offset, why, "the appendix blobs")
        return
    lv.error(ProblemCode.DEEP_FAILED, section, offset, "recomputing the appendix blobs failed: " + why)


def recompute_crashed(lv: Level, section: str, offset: int | None, why: str, what: str) -> None:
    """The deep level's llama.cpp worker died (a signal, or ``--timeout``) while it recomputed the
    stored tokens.  Deep runs only on a file that restored at the load level, and a recompute
    reads nothing of the file but its tokens (in the model's vocabulary, checked at the model
    level), so the crash is the loader's, not the file's (llama-cpp-python's AMX kernels on a
    Xeon: slotfile.llama.cpu): a warning of class cannot-check, and ``what`` becomes an
    unchecked part, so the summary says "not fully checkable" and ``--require deep`` fails."""
    lv.warn(
        ProblemCode.RECOMPUTE_CRASHED,
        section,
        offset,
        f"llama.cpp crashed recomputing {what}: {why}; the file restored at the load level, so its values are "
        "not judged here (the loader's fault, not the file's)",
    )
    lv.unchecked_parts.append(
        {
            "section": section,
            "offset": offset,
            "reason": f"llama.cpp crashed recomputing {what} ({why})",
            "hint": "a llama.cpp build that recomputes them here: --llama-lib DIR, or a longer --timeout",
        }
    )


def _plan(sf: SlotFile, n: int, draft_model: bool, rotation: bool) -> _Plan:
    """Which blobs can be recomputed from the ``n`` stored tokens, and why not the others."""
    rot = "the body's rotation setting is not this llama.cpp's (deep-rotation): its blobs differ the same way"
    cks: list[dict[str, Any]] = []
    at: list[int] = []
    for ck in sf.checkpoints:
        where = rot if rotation else _ck_skip(ck, n)
        e: dict[str, Any] = {"index": ck.index, "n_tokens": ck.n_tokens, "offset": ck.offset}
        e.update(_entry(ck.tgt, where, True))
        e["draft"] = _entry(ck.dft, where, draft_model) if ck.dft.length else None
        if where is None and (e["status"] == "pending" or (e["draft"] or {}).get("status") == "pending"):
            at.append(ck.n_tokens)
        cks.append(e)
    sdft = None
    dft = sf.draft.dft if sf.draft is not None else None
    if dft is not None and dft.length:
        sdft = _entry(dft, rot if rotation else _holds_prefix(dft.body, n), draft_model) | {"offset": dft.offset}
    wants_draft = (sdft or {}).get("status") == "pending" or any(
        (c["draft"] or {}).get("status") == "pending" for c in cks
    )
    return _Plan(at, wants_draft, cks, sdft)


NO_DRAFT_MODEL = "no --draft-model"


def unchecked_parts(sf: SlotFile, plan: _Plan) -> list[dict[str, Any]]:
    """The blobs ``plan`` skips, and every speculative-state blob (``data_spec``: EAGLE3 rows
    from ``common_speculative_get_state``, which no recompute here reproduces), as the deep
    level's unchecked parts: section, offset, the reason and what would make them checkable
    (``--require deep`` fails on them)."""
    out = []
    for section, blob, e in _blob_entries(sf, plan):
        if not blob.length:
            continue
        if e is None:  # data_spec
            reason = "speculative state (data_spec) is not recomputed by slotfile"
            out.append({"section": section, "offset": blob.offset, "reason": reason, "hint": f"none: {reason}"})
        elif e["status"] == "skipped" and "does not parse" not in e["reason"]:  # parse problems: earlier levels
            hint = (
                "--draft-model D.gguf (the draft model the server ran)"
                if e["reason"] == NO_DRAFT_MODEL
                else "none: this blob cannot be recomputed from the stored tokens (the reason above)"
            )
            out.append({"section": section, "offset": blob.offset, "reason": e["reason"], "hint": hint})
    return out


def _blob_entries(sf: SlotFile, plan: _Plan) -> list[tuple[str, BlobInfo, dict[str, Any] | None]]:
    """Every appendix blob with its plan entry (None: a speculative-state blob, never planned)."""
    blobs: list[tuple[str, BlobInfo, dict[str, Any] | None]] = []
    for ck, e in zip(sf.checkpoints, plan.checkpoints, strict=True):
        sec = f"sckp.checkpoint[{ck.index}]"
        blobs += [(f"{sec}.data_tgt", ck.tgt, e), (f"{sec}.data_dft", ck.dft, e["draft"])]
        blobs.append((f"{sec}.data_spec", ck.spec, None))
    if sf.draft is not None and sf.draft.dft is not None:
        blobs.append(("sdft.data_dft", sf.draft.dft, plan.sdft))
    if sf.draft is not None and sf.draft.spec is not None:
        blobs.append(("sdft.data_spec", sf.draft.spec, None))
    return blobs


def _entry(blob: BlobInfo, why: str | None, loaded: bool) -> dict[str, Any]:
    """A blob's report entry before the recompute: pending, or skipped with the reason
    (``loaded``: the blob's model is in the worker)."""
    if not loaded:
        why = NO_DRAFT_MODEL
    elif why is None and (blob.body is None or blob.body.layout is None):
        why = f"its {blob.name} does not parse (see the structure and model levels)"
    if why is not None:
        return {"status": "skipped", "reason": why, "margin": None, "worst": None}
    return {"status": "pending", "margin": None, "worst": None}


def _ck_skip(ck: Checkpoint, n: int) -> str | None:
    """Why checkpoint ``ck`` cannot be recomputed from the ``n`` stored tokens (None: it can)."""
    if not 0 < ck.n_tokens <= n:
        return f"its n_tokens {ck.n_tokens} is not within the {n} stored tokens: nothing to recompute it from"
    if ck.pos_max != ck.n_tokens - 1:
        return (
            f"its pos_max {ck.pos_max} is not n_tokens - 1 = {ck.n_tokens - 1}: not the state after the first "
            f"{ck.n_tokens} stored tokens (a context shift or cache reuse)"
        )
    return None


def _holds_prefix(body: Body | None, n: int) -> str | None:
    """Why the draft state ``body`` is not the state after the ``n`` stored tokens (None: it is)."""
    if body is None or body.layout is None or not body.blocks:
        return "the stored blob does not parse (see the structure and model levels)"
    first = body.blocks[0]
    if first.kind == MemoryKind.KV:
        act = first.active_streams()
        if len(act) != 1 or not np.array_equal(act[0].positions, np.arange(n)):
            return f"the draft cache does not hold positions 0..{n - 1} of the {n} stored tokens"
    else:
        pos = first.positions()
        if pos.size != 1 or int(pos[0]) != n - 1:
            return f"the draft's recurrent state is not at position {n - 1} of the {n} stored tokens"
    return None


def _mark_pending(plan: _Plan, why: str, crashed: bool = False) -> None:
    """Every pending entry failed with the recompute (``why``), or was not judged when llama.cpp
    crashed (``crashed``: :func:`recompute_crashed`)."""
    for e in [*plan.checkpoints, *(c["draft"] for c in plan.checkpoints), plan.sdft]:
        if e is not None and e["status"] == "pending":
            e.update(status="skipped" if crashed else "fail", reason=why)


def _judge_all(judge: _Judge, sf: SlotFile, plan: _Plan, reply: dict[str, Any], caches: Caches) -> None:
    """Every pending entry of ``plan`` against the worker's recomputed blobs (``reply``)."""
    got = {int(c["n_tokens"]): c for c in reply.get("checkpoints", [])}
    floors = {(int(f["n_tokens"]), False): f for f in reply.get("floors", [])}
    dfloors = {(int(f["n_tokens"]), bool(f["full"])): f for f in reply.get("draft_floors", [])}
    dcaches = caches_of(sf.draft_expect)
    for ck, e in zip(sf.checkpoints, plan.checkpoints, strict=True):
        rec = got.get(ck.n_tokens) or {}
        label, sec = f"checkpoint {ck.index} (n_tokens {ck.n_tokens})", f"sckp.checkpoint[{ck.index}]"
        if e["status"] == "pending":
            cs = blob_caches(ck.tgt.body, sf.expect, True, caches)
            w = _Want(ck.tgt, rec.get("tgt"), f"{sec}.data_tgt", label, ck.n_tokens, sf.expect, True, cs)
            e.update(judge(w.with_floor(floors.get((ck.n_tokens, False)))))
        d = e["draft"]
        if d is not None and d["status"] == "pending":
            label += ", draft"
            cs = blob_caches(ck.dft.body, sf.draft_expect, True, dcaches)
            w = _Want(ck.dft, rec.get("dft"), f"{sec}.data_dft", label, ck.n_tokens, sf.draft_expect, True, cs)
            d.update(judge(w.with_floor(dfloors.get((ck.n_tokens, False)))))
    dft = sf.draft.dft if sf.draft is not None else None
    if plan.sdft is not None and plan.sdft["status"] == "pending" and dft is not None:
        n = int(sf.tokens.tokens.size) if sf.tokens is not None else 0
        cs = blob_caches(dft.body, sf.draft_expect, False, dcaches)
        w = _Want(dft, reply.get("draft"), "sdft.data_dft", "draft state", n, sf.draft_expect, False, cs)
        plan.sdft.update(judge(w.with_floor(dfloors.get((n, True)))))


def blob_caches(body: Body | None, exp: ModelExpect | None, partial: bool, fallback: Caches) -> Caches:
    """The model's caches by the roles of a blob's blocks.  A PARTIAL_ONLY blob of an iSWA model
    holds the SWA cache alone (``llama_kv_cache_iswa::state_write`` skips kv_base), which the
    blob parser names ``kv`` (its only KV block): its head sizes and the model's first layer
    (:func:`slotfile.verify.shape.first_layer_block`) are the SWA cache's, not the body's ``kv``
    role's.  ``fallback``: the body's caches, when the blob's blocks are not the expected ones."""
    want = (exp.partial_blocks if partial else exp.blocks) if exp is not None else ()
    if body is None or len(body.blocks) != len(want):
        return fallback
    return {b.role: e for b, e in zip(body.blocks, want, strict=True) if isinstance(e, CacheExpect)}


@dataclasses.dataclass(frozen=True)
class _Want:
    """One stored blob to judge: its recompute at ``span`` ([offset, length] in the worker's
    scratch file), the model's expectation to read both with, and the noise-floor blob (the
    recompute with its last ``k`` tokens decoded one per call; None: the minimum floors)."""

    stored: BlobInfo
    span: list[int] | None
    section: str
    label: str
    n_tokens: int
    exp: ModelExpect | None
    exp_partial: bool
    caches: Caches
    floor: list[int] | None = None
    k: int = 0

    def with_floor(self, f: dict[str, Any] | None) -> _Want:
        """This blob with the worker's noise-floor blob ``f`` (None: none)."""
        return dataclasses.replace(self, floor=f["blob"], k=int(f["k"])) if f else self


@dataclasses.dataclass
class _Judge:
    """Judges stored blobs against the recomputed ones in ``view`` (the worker's scratch file)."""

    lv: Level
    scratch: SlotFile  # the file's settings for the reader's blob parser; its problems are the recompute's
    view: memoryview
    schedule: Schedule  # the worker's split (labels only: a blob is judged without other schedules)
    floor_view: memoryview | None = None  # the noise-floor blobs (_with_floors)
    unmoved: set[str] = dataclasses.field(default_factory=set)  # sections for _with_splits

    def __call__(self, w: _Want) -> dict[str, Any]:
        """The report entry of ``w.stored``; its problems into ``lv`` under ``w.section``."""
        sb = w.stored.body
        assert sb is not None and sb.layout is not None  # _plan: only parsed blobs are pending
        sub = Level(CheckLevel.DEEP)
        rows: list[dict[str, Any]] = []
        how: dict[str, Any] = {"decided_by": None, "evidence": None}
        rec = self._parse(w, w.span, sb, self.view)
        if rec is None:
            sub.error(ProblemCode.DEEP_INTERNAL, "body", sb.offset, "the worker returned no recomputed blob")
        elif rec.layout is None:
            sub.error(ProblemCode.DEEP_INTERNAL, "body", sb.offset, "the recomputed blob does not parse")
        else:
            flo = self._parse(w, w.floor, sb, self.floor_view) if self.floor_view is not None else None
            floor = flo if flo is not None and flo.layout is not None else None
            inputs = DeepInputs(floor, w.caches, w.n_tokens, w.k if floor else 0)
            final = self.floor_view is not None
            outcome = _with_lone(sb, judge_with_schedules(sb, inputs, (self.schedule, rec), None), final)
            _commit(sub, sb, outcome, final)
            if final and outcome.unmoved:
                self.unmoved.add(w.section)
            rows, how = outcome.judgment.rows, {k: outcome.details()[k] for k in how}
        for p in sub.problems:
            where = w.section + p.section.removeprefix("body")
            self.lv.add(p.severity, p.code, where, p.offset, f"{w.label}: {p.message}")
        worst = max(rows, key=lambda r: r["ratio"], default=None)
        if worst is not None:
            worst = {k: worst[k] for k in WORST_KEYS} | {"section": w.section + worst["section"].removeprefix("body")}
        return {
            "status": sub.finish().status,
            "margin": worst["ratio"] if worst else 0.0,
            "worst": worst,
            "layers": len(rows),
            "stepwise": w.k if w.floor else 0,
            **how,
        }

    def _parse(self, w: _Want, span: list[int] | None, sb: Body, view: memoryview) -> Body | None:
        """The blob at ``span`` read by the reader's blob parser, trying the stored blob's block
        sequence first (None: the worker wrote none)."""
        if not span or not span[1]:
            return None
        off, length = int(span[0]), int(span[1])
        # BlobInfo.offset is that of the u64 length the file would have before the blob
        rec = BlobInfo(w.stored.name, off - 8, length, g.Run(off, length, view[off : off + length]))
        assert sb.layout is not None
        parse_seq_blob(
            self.scratch, view, rec, w.section, partial=sb.layout.kinds, exp=w.exp, exp_partial=w.exp_partial
        )
        return rec.body


LONE = "lone-layer"  # decided_by of a blob with a lone cell (slotfile/verify/lone.py)


def _with_lone(body: Body, outcome: Outcome, final: bool) -> Outcome:
    """``outcome`` with the lone cells of its judgment (:func:`slotfile.verify.lone.lone_cells`)
    as damage, unless moved data or damaged bytes decided it already.  Lone cells do not wait
    for the stepwise floor (the other layers' exact agreement is their evidence; :func:`_reopen`
    leaves them), so outside the ``final`` judgment the layers' floor-dependent differences are
    dropped: only the stepwise floor could judge those."""
    lone = [] if outcome.decided_by in ("misplaced", "bytes") else lone_cells(body, outcome.judgment)
    if not lone:
        return outcome
    j = outcome.judgment
    keep = j.problems if final else [p for p in j.problems if p[0] != ProblemCode.DEEP_MISMATCH]
    j.problems = lone + keep
    ev = lone[0][3] + (f" (+{len(lone) - 1} more)" if len(lone) > 1 else "")
    # lone cells are damage whatever else the judgment read (drift, cells the server shifted)
    return dataclasses.replace(
        outcome, decided_by=LONE, evidence=ev, drift=False, unmoved=False, shifted=None, unreplayed=None
    )


def _commit(sub: Level, body: Body, outcome: Outcome, final: bool) -> None:
    """A blob's outcome into ``sub`` as the body's is (:func:`slotfile.verify.shape.commit_outcome`: a
    drift-shaped difference is one warning), but only in its ``final`` judgment, the one against
    its stepwise floor: against the minimum floors alone its layer errors stand, so that
    :func:`_reopen` judges it again against that floor."""
    if final or not outcome.drift:
        commit_outcome(sub, body, outcome)
    else:
        outcome.judgment.commit(sub)


@contextlib.contextmanager
def _scratch() -> Iterator[str]:
    """An empty temporary file for the worker's blobs, removed afterwards."""
    fd, path = tempfile.mkstemp(prefix="slotfile-deep-blobs-", suffix=".bin")
    os.close(fd)
    try:
        yield path
    finally:
        Path(path).unlink(missing_ok=True)


@contextlib.contextmanager
def _mapped(path: str) -> Iterator[memoryview]:
    """The worker's scratch file, mapped (as large as the appendix it recomputes), never read
    whole; the mapping goes when the last view of it does."""
    with open(path, "rb") as f:
        if not os.fstat(f.fileno()).st_size:
            yield memoryview(b"")
            return
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = memoryview(mm)
    try:
        yield view
    finally:
        with contextlib.suppress(BufferError):  # numpy views of it still alive: it goes with them
            view.release()
            mm.close()
