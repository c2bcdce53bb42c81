"""``re-save DIR -o OUTDIR --server-args ARGS``: every slot file under DIR, written under OUTDIR
(the same tree) in the form the server with those flags restores.

Per file (verdicts of :mod:`slotfile.slotdir.restore`):

* restores as is: copied;
* needs re-save, exact: another stream count is written byte for byte
  (:mod:`slotfile.repair.streams`); another V layout goes through the single-file re-save with
  ``--flash-attn`` (V transposed exactly, then loaded and saved through llama.cpp);
* needs re-save, lossy: the single-file re-save with the server's cache types (a prefill);
* cannot: left out, with the reason.

The safe-write rules hold for every output: the input is only read; intermediate files are
dot-prefixed temps in the output's directory, removed at the end; the output is written to a
temp, fsynced and test-loaded *under the server's settings* (:func:`restorecheck.prove`'s load)
before it is linked (no-clobber) into place.  Nothing under OUTDIR is replaced without
``force``; OUTDIR must not lie inside DIR.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slotfile.repair.common import Refused, RepairOptions
from slotfile.repair.report import Outcome
from slotfile.safewrite import CheckFailed, Plan, WriteRefused, commit, create_temp, unlink_quiet, write_plan
from slotfile.slotdir.restore import Checker, Fate, Restore, need_cells
from slotfile.slotdir.walk import DirEntry, DirScan

SCHEMA = "slotfile.resave-dir/1"


@dataclass(slots=True)
class FileResult:
    rel: str
    fate: str | None
    action: str  # copied | converted | skipped | failed | error | would-copy | would-convert
    reason: str
    output: str | None = None
    changes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "file": self.rel,
            "fate": self.fate,
            "action": self.action,
            "reason": self.reason,
            "output": self.output,
            "changes": self.changes,
        }


def outputs_in_the_way(scan: DirScan, outdir: str) -> list[str]:
    """Outputs that exist already (refused without --force)."""
    return [os.path.join(outdir, e.rel) for e in scan.slots if os.path.lexists(os.path.join(outdir, e.rel))]


def server_check(checker: Checker, rel: str) -> Callable[[str], tuple[bool, str]]:
    """The safe write's check: a clean re-read and a load under the server's settings."""

    def check(path: str) -> tuple[bool, str]:
        from slotfile.format.reader import open_slot_file

        sf = open_slot_file(path)
        try:
            if sf.errors:
                return False, f"the output reads with errors: {sf.errors[0].line()}"
            if checker.pool is None or checker.side is None:
                return True, ""
            s = checker.server.load_settings(checker.side.n_ctx_train, need_cells(sf), checker.n_gpu_layers)
            res = checker.pool.load(path, s, timeout=checker.timeout, sf=sf)
        finally:
            sf.close()
        if not res.ok:
            return False, f"the output does not load under the server's settings: {res.message}"
        bad = [f"checkpoint {i}: {m}" for i, (ok, m) in enumerate(res.checkpoints) if not ok]
        if bad:
            return False, "the output's checkpoints do not load under the server's settings: " + "; ".join(bad)
        return True, ""

    return check


def convert_one(
    entry: DirEntry, r: Restore, outdir: str, checker: Checker, *, force: bool, dry_run: bool, timeout: float
) -> FileResult:
    """One file; never raises for an expected failure."""
    out = os.path.join(outdir, entry.rel)
    res = FileResult(entry.rel, str(r.fate), "", r.reason, out, list(r.changes))
    if r.fate == Fate.CANNOT:
        res.action, res.output = "skipped", None
        return res
    if dry_run:
        res.action = "would-copy" if r.fate == Fate.AS_IS else "would-convert"
        return res
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    from slotfile.safewrite import Target

    target = Target(entry.path, out, False, None, force)
    temps: list[str] = []
    try:
        src = entry.path
        if r.n_stream_to is not None:
            src = _streams_temp(entry.path, r.n_stream_to, os.path.dirname(out), temps)
        if r.fa_to is not None or r.types_to is not None:
            src = _resave_temp(src, r, checker, os.path.dirname(out), temps, timeout)
        plan = Plan()
        plan.copy(src, 0, os.path.getsize(src))
        commit(plan, target, server_check(checker, entry.rel))
        # the output keeps the input's age: prune and ls order sessions by when they were saved
        os.utime(out, (entry.mtime, entry.mtime), follow_symlinks=False)
        res.action = "copied" if r.fate == Fate.AS_IS else "converted"
        if r.changes:
            how = "recomputed from the tokens" if r.fate == Fate.LOSSY else "exact"
            res.reason = f"{', '.join(r.changes)} ({how}); loads under the server's settings"
        else:
            res.reason = "restores as is; copied"
    except (Refused, CheckFailed, WriteRefused) as e:
        res.action, res.reason, res.output = "failed", str(e), None
    except OSError as e:
        res.action, res.reason, res.output = "error", f"{e.filename or entry.path}: {e.strerror or e}", None
    finally:
        for t in temps:
            unlink_quiet(t)
    return res


def _streams_temp(path: str, n_stream: int, workdir: str, temps: list[str]) -> str:
    from slotfile.format.reader import open_slot_file
    from slotfile.repair.streams import plan_streams

    sf = open_slot_file(path)
    try:
        plan = plan_streams(sf, n_stream)
        tmp, fd = create_temp(workdir, Path(path).name, ".streams")
        temps.append(tmp)
        try:
            write_plan(plan, fd)
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        sf.close()
    return tmp


def _resave_temp(src: str, r: Restore, checker: Checker, workdir: str, temps: list[str], timeout: float) -> str:
    """The single-file re-save (runner: its own check) into a temp that the final commit copies."""
    from slotfile.repair.runner import run
    from slotfile.safewrite import Target, temp_path

    out = temp_path(workdir, Path(src).name.lstrip("."), ".resaved")
    temps.append(out)
    opts = RepairOptions(
        model=checker.model,
        flash_attn=r.fa_to if r.fa_to is not None else checker.server.fa_on,
        type_k=r.types_to[0] if r.types_to else None,
        type_v=r.types_to[1] if r.types_to else None,
        timeout=timeout,
        n_gpu_layers=checker.n_gpu_layers,
    )
    rep = run("re-save", src, Target(src, out), opts)
    if rep.outcome not in (Outcome.REPAIRED, Outcome.NOTHING_TO_DO):
        raise Refused(f"re-save: {rep.reason or rep.status}")
    return out
