"""``slotfile prune DIR``: plan which slot files to remove to meet a quota; remove with --delete.

JSON (``--json``), schema ``slotfile.prune/1``::

    {"schema": "slotfile.prune/1", "root": str, "delete": bool,
     "rules": {"max_total", "older_than_s", "keep", "damaged", "settle_s"},
     "remove": [{"path", "rel", "size", "age_s", "rule", "why", "removed", "error"}],
     # rule: the one that picked the file: damaged, older-than, keep or max-total
     "total_before": int, "total_after": int, "untouchable_bytes": int,
     "quota_met": bool, "note": str, "errors": [str], "still_being_written": [str],
     "tally": {"handled", "skipped", "failed"}, "exit_code": 0 | 4 | 8,
     "manifest"?: {"path", "dropped": [rel]}}     # --delete in a sealed DIR (slotfile seal)

Exit codes: 0 the plan meets every rule (and, with --delete, every removal succeeded);
4 --max-total cannot be met with the files that may be removed, or a file was still being
written after ``--settle-wait`` (it was left alone, unjudged); 8 a path could not be read or a
removal failed; 2 usage.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slotfile.cli.common import fail, out_console, say_waiting
from slotfile.cli.listing import Row, pipe_line, print_rows, screen_width, summary
from slotfile.cli.terminal import count, escape_text, human_size
from slotfile.exitcodes import OK, OPERATIONAL, PROBLEMS, USAGE
from slotfile.slotdir.prune import SCHEMA, PrunePlan, carry_out, plan_prune
from slotfile.slotdir.walk import (
    SETTLE_SECONDS,
    SETTLE_WAIT_SECONDS,
    DirScan,
    FileSummary,
    Tally,
    human_age,
    parse_age,
    parse_size,
    scan_dir,
    settle_problem,
    summarize_all,
)


@dataclass(frozen=True, slots=True)
class PruneArgs:
    """``slotfile prune``'s command line."""

    root: Path
    max_total: str | None = None
    older_than: str | None = None
    keep: int | None = None
    damaged: bool = False
    delete: bool = False
    json_out: bool = False
    settle: float = SETTLE_SECONDS
    settle_wait: float = SETTLE_WAIT_SECONDS


def run_prune(args: PruneArgs) -> int:
    rules = _rules(args)
    if isinstance(rules, int):
        return rules
    size, age = rules
    root = args.root
    if root.is_symlink() or not root.is_dir():
        fail(f"{root}: not a directory (a symlink is not followed)", "prune")
        return OPERATIONAL
    scan = scan_dir(root, settle=args.settle, settle_wait=args.settle_wait, on_wait=say_waiting("prune"))
    now = time.time()
    errors = list(scan.errors)
    summaries = _summaries(scan, errors) if args.damaged else None
    plan = plan_prune(scan, summaries, now=now, max_total=size, older_than=age, keep=args.keep, damaged=args.damaged)
    manifest: dict[str, Any] | None = None
    not_updated: str | None = None
    if args.delete:
        manifest, not_updated = _delete(plan, root, args.settle)
    busy = scan.busy_lines()
    for line in errors + busy:
        fail(line, "prune")
    failed = [r for r in plan.remove if r.error]
    for r in failed:
        fail(f"{r.entry.path}: not removed: {r.error}", "prune")
    rc = OPERATIONAL if errors or failed else (OK if plan.quota_met and not busy else PROBLEMS)
    if not_updated is not None:
        fail(not_updated, "prune")
        rc = OPERATIONAL
    unread = len(errors) - len(scan.errors)  # files --damaged could not read
    tally = Tally(
        len(scan.slots) - unread - len(failed),
        len(scan.temps) + len(scan.symlinks),
        unread + len(failed) + len(busy) + len(scan.errors),
    )
    if args.json_out:
        doc = _document(args, plan, size, age, errors, now, rc)
        doc["still_being_written"] = [e.path for e in scan.busy]
        doc["tally"] = tally.to_dict()
        if manifest is not None:
            doc["manifest"] = manifest
        doc["exit_code"] = doc.pop("exit_code")  # stays last
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        _render(plan, args.delete, scan, tally, now)
        if manifest is not None:
            out_console().print(
                escape_text(
                    f"manifest {manifest['path']}: {count(len(manifest['dropped']), 'entry', 'entries')} dropped"
                ),
                soft_wrap=True,
            )
    return rc


def _rules(args: PruneArgs) -> tuple[int | None, float | None] | int:
    """The quota (bytes) and age (seconds) asked for, or USAGE after saying what is wrong."""
    why_settle = settle_problem(args.settle, args.settle_wait)
    if why_settle is not None:
        fail(why_settle, "prune")
        return USAGE
    try:
        size = parse_size(args.max_total) if args.max_total is not None else None
        age = parse_age(args.older_than) if args.older_than is not None else None
    except ValueError as why:
        fail(str(why), "prune")
        return USAGE
    if args.keep is not None and args.keep < 0:
        fail("--keep cannot be negative", "prune")
        return USAGE
    if size is None and age is None and args.keep is None and not args.damaged:
        fail("nothing to plan: give --max-total, --older-than, --keep and/or --damaged", "prune")
        return USAGE
    return size, age


def _summaries(scan: DirScan, errors: list[str]) -> dict[str, FileSummary]:
    """Every slot file read (for --damaged); the ones that cannot be read add to ``errors``."""
    summaries: dict[str, FileSummary] = {}
    for entry, s in zip(scan.slots, summarize_all(scan.slots), strict=True):
        if s.error:
            errors.append(s.error)
        summaries[entry.path] = s
    return summaries


def _delete(plan: PrunePlan, root: Path, settle: float) -> tuple[dict[str, Any] | None, str | None]:
    """Remove the planned files; when DIR is sealed, drop them from its manifest too.  (The
    manifest's path and entries dropped, or None; why the manifest could not be updated.)"""
    from slotfile.seal.verify_hook import prune_manifest

    carry_out(plan, str(root), settle)
    mpath, dropped, not_updated = prune_manifest(root, [r.entry.path for r in plan.remove if r.done])
    if mpath is None:
        return None, not_updated
    return {"path": mpath, "dropped": dropped}, not_updated


def _document(
    args: PruneArgs, plan: PrunePlan, size: int | None, age: float | None, errors: list[str], now: float, rc: int
) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "root": str(args.root),
        "delete": args.delete,
        "rules": {
            "max_total": size,
            "older_than_s": age,
            "keep": args.keep,
            "damaged": args.damaged,
            "settle_s": args.settle,
        },
        "remove": [r.to_dict(now) for r in plan.remove],
        "total_before": plan.total_before,
        "total_after": plan.total_after,
        "untouchable_bytes": plan.untouchable,
        "quota_met": plan.quota_met,
        "note": plan.note,
        "errors": errors,
        "exit_code": rc,
    }


def _render(plan: PrunePlan, delete: bool, scan: DirScan, tally: Tally, now: float) -> None:
    """One row per file planned (:mod:`slotfile.cli.listing`), then what the plan frees."""
    out = out_console()
    width = screen_width(out)
    verb = "removed" if delete else "would remove"
    rows = []
    for r in plan.remove:
        state = verb if r.error is None else "NOT removed"
        size, age = human_size(r.entry.size), human_age(now - r.entry.mtime)
        details = [("red", r.why)] if r.rule == "damaged" else []
        details += [("red", f"not removed: {r.error}")] if r.error else []
        rows.append(Row((state, size, age, r.rule, r.entry.rel), "bold red" if r.error else "", tuple(details)))
        if width is None:
            pipe_line(r.entry.rel, f"{state}, size {size}, age {age}: {r.why}", [r.error] if r.error else [])
    if width is not None and rows:
        print_rows(out, ("action", "size", "age", "rule", "file"), rows, width, right=("size", "age"))
    summary(out, _plan_line(plan, delete, scan, tally), width)


def _plan_line(plan: PrunePlan, delete: bool, scan: DirScan, tally: Tally) -> str:
    """What the plan removes and frees, what it left alone, what is left to do."""
    n = len(plan.remove)
    if not n:
        line = "nothing to remove"
    elif delete:
        done = [r for r in plan.remove if r.done]
        line = f"removed {count(len(done), 'file')}, {human_size(sum(r.entry.size for r in done))} freed"
        line += f", {n - len(done)} not removed" if len(done) < n else ""
    else:
        line = f"would remove {count(n, 'file')}, {human_size(plan.total_before - plan.total_after)}"
    after = plan.total_before - sum(r.entry.size for r in plan.remove if r.done) if delete else plan.total_after
    line += f"; slot files {human_size(plan.total_before)} -> {human_size(after)}"
    if scan.temps or scan.busy:
        line += (
            f"; left alone: {count(len(scan.temps), 'temp file')} and {len(scan.busy)} still being written"
            f" ({human_size(plan.untouchable)})"
        )
    if plan.note:
        line += f"; {plan.note}"
    if not delete and n:
        line += "; a plan only: add --delete to remove them"
    return line + f"; {tally.line()}"
