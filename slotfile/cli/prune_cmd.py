"""``slotfile prune DIR``: plan which slot files to remove to meet a quota; remove with --delete.

JSON (``--json``), schema ``slotfile.prune/1``::

    {"schema": "slotfile.prune/1", "root": str, "delete": bool,
     "rules": {"max_total", "older_than_s", "keep", "damaged", "settle_s"},
     "remove": [{"path", "rel", "size", "age_s", "why", "removed", "error"}],
     "total_before": int, "total_after": int, "untouchable_bytes": int,
     "quota_met": bool, "note": str, "errors": [str], "exit_code": 0 | 4 | 8,
     "manifest"?: {"path", "dropped": [rel]}}     # --delete in a sealed DIR (slotfile seal)

Exit codes: 0 the plan meets every rule (and, with --delete, every removal succeeded);
4 --max-total cannot be met with the files that may be removed; 8 a path could not be read or
a removal failed; 2 usage.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from slotfile.cli.common import fail
from slotfile.cli.terminal import escape_text, human_size
from slotfile.exitcodes import OK, OPERATIONAL, PROBLEMS, USAGE
from slotfile.slotdir.prune import SCHEMA, PrunePlan, carry_out, plan_prune
from slotfile.slotdir.walk import FileSummary, human_age, parse_age, parse_size, scan_dir, summarize


def run_prune(
    root: Path,
    max_total: str | None,
    older_than: str | None,
    keep: int | None,
    damaged: bool,
    delete: bool,
    json_out: bool,
    settle: float = 5.0,
) -> int:
    try:
        size = parse_size(max_total) if max_total is not None else None
        age = parse_age(older_than) if older_than is not None else None
    except ValueError as why:
        fail(str(why), "prune")
        return USAGE
    if keep is not None and keep < 0:
        fail("--keep cannot be negative", "prune")
        return USAGE
    if size is None and age is None and keep is None and not damaged:
        fail("nothing to plan: give --max-total, --older-than, --keep and/or --damaged", "prune")
        return USAGE
    if root.is_symlink() or not root.is_dir():
        fail(f"{root}: not a directory (a symlink is not followed)", "prune")
        return OPERATIONAL
    now = time.time()
    scan = scan_dir(root, settle=settle, now=now)
    errors = list(scan.errors)
    summaries: dict[str, FileSummary] | None = None
    if damaged:
        summaries = {}
        for entry in scan.slots:
            s = summarize(entry)
            if s.error:
                errors.append(s.error)
            summaries[entry.path] = s
    plan = plan_prune(scan, summaries, now=now, max_total=size, older_than=age, keep=keep, damaged=damaged)
    manifest: dict[str, Any] | None = None
    if delete:
        carry_out(plan, str(root), settle)
        from slotfile.seal.verify_hook import prune_manifest

        mpath, dropped, not_updated = prune_manifest(root, [r.entry.path for r in plan.remove if r.done])
        if mpath is not None:  # DIR is sealed: the removed files leave the manifest too
            manifest = {"path": mpath, "dropped": dropped}
        if not_updated is not None:
            errors.append(not_updated)
    for line in errors:
        fail(line, "prune")
    failed = [r for r in plan.remove if r.error]
    for r in failed:
        fail(f"{r.entry.path}: not removed: {r.error}", "prune")
    rc = OPERATIONAL if errors or failed else (OK if plan.quota_met else PROBLEMS)
    if json_out:
        doc = _document(root, plan, delete, size, age, keep, damaged, settle, errors, now, rc)
        if manifest is not None:
            doc["manifest"] = manifest
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        _render(plan, delete, len(scan.temps) + len(scan.busy), now)
        if manifest is not None:
            from slotfile.cli.common import out

            out.print(escape_text(f"manifest {manifest['path']}: {len(manifest['dropped'])} entry(ies) dropped"))
    return rc


def _document(
    root: Path,
    plan: PrunePlan,
    delete: bool,
    size: int | None,
    age: float | None,
    keep: int | None,
    damaged: bool,
    settle: float,
    errors: list[str],
    now: float,
    rc: int,
) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "root": str(root),
        "delete": delete,
        "rules": {"max_total": size, "older_than_s": age, "keep": keep, "damaged": damaged, "settle_s": settle},
        "remove": [r.to_dict(now) for r in plan.remove],
        "total_before": plan.total_before,
        "total_after": plan.total_after,
        "untouchable_bytes": plan.untouchable,
        "quota_met": plan.quota_met,
        "note": plan.note,
        "errors": errors,
        "exit_code": rc,
    }


def _render(plan: PrunePlan, delete: bool, n_apart: int, now: float) -> None:
    from slotfile.cli.common import out

    verb = "removed" if delete else "would remove"
    for r in plan.remove:
        state = verb if r.error is None else "NOT removed"
        out.print(
            escape_text(
                f"{state}: {r.entry.rel} ({human_size(r.entry.size)}, {human_age(now - r.entry.mtime)} "
                f"old): {r.why}" + (f": {r.error}" if r.error else "")
            ),
            soft_wrap=True,
        )
    freed = plan.total_before - plan.total_after
    line = (
        f"{len(plan.remove)} file(s) {verb}, {human_size(freed)} freed; slot files "
        f"{human_size(plan.total_before)} -> {human_size(plan.total_after)}"
    )
    if n_apart:
        line += f"; {n_apart} temp file(s) or file(s) being written left alone ({human_size(plan.untouchable)})"
    if plan.note:
        line += f"; {plan.note}"
    if not delete and plan.remove:
        line += " (plan only: add --delete to remove)"
    out.print(line, soft_wrap=True)
