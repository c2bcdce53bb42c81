"""The runner: plan a repair, write it through :func:`slotfile.safewrite.commit` with its
check, and after a failed test-load try again without what failed (truncate-recover), up to
four attempts.  Never raises for an expected failure: the report says what happened."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from slotfile.format.reader import open_slot_file
from slotfile.repair.check import make_check
from slotfile.repair.common import Operational, Planned, Refused, RepairOptions, Retry
from slotfile.repair.migrate import migrate
from slotfile.repair.plan import commit_plan, has_transposed, plan_equals
from slotfile.repair.report import Outcome, Report
from slotfile.repair.resave import resave
from slotfile.repair.strip_draft import strip_draft
from slotfile.repair.truncate import truncate_recover
from slotfile.safewrite import CheckFailed, Target, WriteRefused, describe_plan, unlink_quiet

OPERATIONS: dict[str, Callable[..., Planned]] = {
    "truncate-recover": truncate_recover,
    "strip-draft": strip_draft,
    "re-save": resave,
    "migrate": migrate,
}
ATTEMPTS = 4


@dataclass(slots=True)
class _Run:
    command: str
    input_path: str
    target: Target | None
    opts: RepairOptions
    dry_run: bool
    report: Report
    retry: Retry = field(default_factory=Retry)
    retries: list[str] = field(default_factory=list)  # what each failed attempt led to
    temps: list[str] = field(default_factory=list)  # every scratch file any attempt made


def run(command: str, input_path: str, target: Target | None, opts: RepairOptions, *, dry_run: bool = False) -> Report:
    """Plan and (unless ``dry_run``) write one repair; never raises for an expected failure."""
    t0 = time.monotonic()
    report = Report(command, input_path, dry_run=dry_run, input_size=_size(input_path))
    if target is not None:
        report.output, report.in_place, report.backup = target.output, target.in_place, target.backup
    r = _Run(command, input_path, target, opts, dry_run, report)
    try:
        for m in (opts.model, opts.draft_model):
            if m is not None and not os.path.isfile(m):
                raise Operational(f"model {m} not found")
        if opts.model is not None:  # an unusable --llama-lib fails before anything is planned
            from slotfile.llama.loader import LoaderError, resolve_library

            try:
                resolve_library(opts.llama_lib)
            except LoaderError as e:
                raise Operational(str(e)) from None
        return _attempts(r)
    except Refused as e:
        if r.retries and not any(n.startswith("first attempt") for n in r.report.notes):
            r.report.notes.append(f"first attempt: {r.retries[0]}")
        return r.report.fail(Outcome.REFUSED, str(e))
    except CheckFailed as e:
        return r.report.fail(Outcome.CHECK_FAILED, str(e))
    except WriteRefused as e:
        return r.report.fail(Outcome.UNUSABLE_OUTPUT, str(e))
    except Operational as e:
        return r.report.fail(Outcome.OPERATIONAL, str(e))
    except OSError as e:
        return r.report.fail(Outcome.OPERATIONAL, f"{e.filename or ''}: {e.strerror or e}".lstrip(": "))
    finally:
        for t in r.temps:
            unlink_quiet(t)
        r.report.timings["total"] = time.monotonic() - t0


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _attempts(r: _Run) -> Report:
    target = r.target
    workdir = target.directory if target is not None else (os.path.dirname(os.path.abspath(r.input_path)) or ".")
    for attempt in range(ATTEMPTS):
        planned = _plan(r, workdir)
        if r.dry_run:
            return _dry(r.report, planned)
        assert planned.plan is not None and target is not None
        report = r.report
        report.output_size = planned.plan.size
        if planned.identity or plan_equals(planned.plan, r.input_path, report.input_size):
            report.outcome = Outcome.NOTHING_TO_DO
            if target.in_place:
                report.notes.append("the file is left as it is (no backup needed)")
                report.backup = None
                return report
            report.notes.append("the output is a byte-identical copy of the input")
        try:
            check = make_check(r.opts, planned.test_draft, report, model_level=planned.model_check)
            done = commit_plan(planned.plan, target, check)
        except CheckFailed as e:
            why = _retry(r.command, planned, r.retry, report) if attempt < ATTEMPTS - 1 else None
            if why is None:
                raise
            r.retries.append(f"{e} -> {why}")
            while r.temps:
                unlink_quiet(r.temps.pop())
            continue
        for path in done.cleaned:
            report.notes.append(f"removed {path}, a temporary file left by an earlier run that was killed")
        return report
    raise AssertionError("unreachable")


def _plan(r: _Run, workdir: str) -> Planned:
    """One attempt's plan; its report replaces the run's (keeping output, timings, notes)."""
    try:
        sf = open_slot_file(r.input_path)
    except OSError as e:
        raise Operational(f"{r.input_path}: {e.strerror or e}") from None
    r.report.input_size = sf.size
    sink: list[Report] = []
    try:
        planned = OPERATIONS[r.command](sf, r.opts, workdir, dry_run=r.dry_run, temps=r.temps, sink=sink, retry=r.retry)
    except Refused:
        if sink:  # what the operation found before it had to give up
            r.report = _carry(r.report, sink[-1], r.retries, first=False)
        raise
    r.report = _carry(r.report, planned.report, r.retries, first=True)
    if not r.dry_run:
        sf.close()
    return planned


def _carry(old: Report, new: Report, retries: list[str], first: bool) -> Report:
    """``new`` with the run's destination, timings and notes of ``old`` (and, for a planned
    attempt, the retries that led to it)."""
    new.output, new.in_place, new.backup = old.output, old.in_place, old.backup
    if not first:
        new.timings = old.timings | new.timings
        new.notes = old.notes + new.notes
        return new
    new.timings = {k: old.timings.get(k, 0.0) + new.timings.get(k, 0.0) for k in {*old.timings, *new.timings}}
    first_of = [f"first attempt: {x}" if i == 0 and len(retries) == 1 else x for i, x in enumerate(retries)]
    new.notes = first_of + new.notes
    return new


def _dry(report: Report, planned: Planned) -> Report:
    plan = planned.plan
    report.outcome = Outcome.DRY_RUN
    report.output_size = plan.size if plan is not None else None
    report.plan = describe_plan(plan) if plan is not None and not has_transposed(plan) else None
    if planned.identity:
        report.notes.append("nothing to do: the output would be a byte-identical copy")
    return report


def _retry(command: str, planned: Planned, retry: Retry, report: Report) -> str | None:
    """After a failed test-load: what to change for another attempt (None: give up)."""
    tl = report.test_load
    if command != "truncate-recover" or tl is None:
        return None
    if not tl.get("ok") and not tl.get("body_bytes"):
        if planned.rebuilt_body or retry.force_rebuild:
            return None
        retry.force_rebuild = f"llama.cpp refuses it ({tl.get('message')})"
        return "the kept body failed its test-load: rebuilt it from the tokens"
    if planned.ckpt_map is None:
        return None
    what = _exclude(planned.ckpt_map, tl.get("checkpoints") or [], retry.exclude_ckpt, "")
    what += _exclude(planned.ckpt_map, tl.get("checkpoint_drafts") or [], retry.exclude_dft, " data_dft")
    d = tl.get("draft")
    if d is not None and not d[0]:
        retry.exclude_sdft = d[1]
        what.append("the SDFT draft state")
    if not what:
        return None
    return "dropped what failed its test-load: " + ", ".join(what)


def _exclude(ckpt_map: list[int], results: list[list[object]], into: dict[int, str], what: str) -> list[str]:
    """Checkpoints whose test-load failed (output index k is input checkpoint ckpt_map[k])."""
    out = []
    for k, (ok, msg) in enumerate(results):
        if not ok and k < len(ckpt_map):
            into[ckpt_map[k]] = str(msg)
            out.append(f"checkpoint {ckpt_map[k]}{what}")
    return out
