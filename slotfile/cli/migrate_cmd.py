"""``slotfile migrate DIR -o OUTDIR --to N`` and ``slotfile ls DIR --llama-lib LIB``: state versions
across a whole directory (:mod:`slotfile.repair.migrate_dir`).

``migrate DIR`` JSON, schema ``slotfile.migrate-dir/1``: ``{"schema", "root", "output", "to",
"dry_run", "only_changed", "files": [{"file", "fate", "action", "reason", "output", "changes"}],
"errors", "still_being_written", "summary": {action: count, "seconds"}, "tally": {"handled", "skipped",
"failed"}, "exit_code"}`` (the rows of ``re-save DIR``;
``fate`` is ``"GGSQ 2 -> 4"``).  Exit 0 when every file was converted or copied (or would be), 4
when one was refused or failed its check, 8 operational, 2 usage.

``ls --llama-lib`` JSON: ``slotfile.ls/1`` with ``"library": {"path", "state_seq_version"}`` and per
file ``"llama_lib": {"verdict": "as-is" | "after-migrate" | "no", "reason", "version", "to"}``.
Exit 0 when every file loads as is, 4 when one needs a migrate or does not load at all.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from slotfile.cli.common import batch_summary, fail, progress_bar, say_waiting
from slotfile.exitcodes import OK, OPERATIONAL, PROBLEMS, USAGE
from slotfile.slotdir.walk import SETTLE_SECONDS, SETTLE_WAIT_SECONDS

SCHEMA = "slotfile.migrate-dir/1"


@dataclass(frozen=True, slots=True)
class MigrateDirArgs:
    """``slotfile migrate DIR``'s command line."""

    root: Path
    outdir: Path | None
    to: int
    model: Path | None = None
    draft_model: Path | None = None
    llama_lib: Path | None = None
    dry_run: bool = False
    force: bool = False
    only_changed: bool = False
    json_out: bool = False
    timeout: float = 600.0
    settle: float = SETTLE_SECONDS
    settle_wait: float = SETTLE_WAIT_SECONDS


@dataclass(frozen=True, slots=True)
class LsLibraryArgs:
    """``slotfile ls DIR --llama-lib LIB``'s command line."""

    root: Path
    llama_lib: Path
    model: Path | None = None
    json_out: bool = False
    settle: float = 5.0
    server_args: str | None = None


def run_migrate_dir(args: MigrateDirArgs) -> int:
    root, outdir, to, model, draft_model, llama_lib = (
        args.root,
        args.outdir,
        args.to,
        args.model,
        args.draft_model,
        args.llama_lib,
    )
    dry_run, force, only_changed, json_out = args.dry_run, args.force, args.only_changed, args.json_out
    from slotfile.cli.restore_cmd import _print_resave_dir
    from slotfile.cli.terminal import escape_text
    from slotfile.repair.common import RepairOptions
    from slotfile.repair.migrate_dir import migrate_entry
    from slotfile.slotdir.walk import scan_dir

    if outdir is None:
        fail("migrate of a directory needs -o OUTDIR", "migrate")
        return USAGE
    rin, rout = os.path.realpath(root), os.path.realpath(outdir)
    if rout == rin or rout.startswith(rin + os.sep):
        fail(f"{outdir} lies inside {root}: choose an output directory outside it", "migrate")
        return USAGE
    if os.path.lexists(outdir) and (os.path.islink(outdir) or not os.path.isdir(outdir)):
        fail(f"{outdir} exists and is not a directory", "migrate")
        return USAGE
    for m in (model, draft_model):
        if m is not None and not m.is_file():
            fail(f"model {m} not found", "migrate")
            return OPERATIONAL
    if llama_lib is not None:
        from slotfile.llama.loader import LoaderError, resolve_library

        try:
            resolve_library(str(llama_lib))
        except LoaderError as e:
            fail(str(e), "migrate")
            return OPERATIONAL
    t0 = time.monotonic()
    scan = scan_dir(root, settle=args.settle, settle_wait=args.settle_wait, on_wait=say_waiting("migrate"))
    opts = RepairOptions(
        model=str(model) if model else None,
        draft_model=str(draft_model) if draft_model else None,
        to_version=to,
        timeout=args.timeout,
        llama_lib=str(llama_lib) if llama_lib else None,
    )
    results = []
    with progress_bar(disable=len(scan.slots) < 2) as progress:
        task = progress.add_task("migrating", total=len(scan.slots))
        for entry in scan.slots:
            one = migrate_entry(entry, str(outdir), opts, force=force, dry_run=dry_run, only_changed=only_changed)
            results.append(one)
            progress.update(task, advance=1, description=escape_text(entry.rel, 40))
    errors = list(scan.errors)
    summary = batch_summary("migrate", results, errors, scan, passed_over=("skipped", "left-out"))
    rc, counts, tally = summary.rc, summary.counts, summary.tally
    elapsed = time.monotonic() - t0
    if json_out:
        doc = {
            "schema": SCHEMA,
            "root": str(root),
            "output": str(outdir),
            "to": to,
            "dry_run": dry_run,
            "only_changed": only_changed,
            **summary.json_fields(results, errors, elapsed),
        }
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        _print_resave_dir(results, counts, scan, tally, elapsed, dry_run)
    return rc


def run_ls_library(args: LsLibraryArgs) -> int:
    """``ls DIR --llama-lib LIB``: per file, does that llama.cpp load it as is, after migrate, or not.
    The model: ``--model``, else the ``-m`` of ``--server-args``."""
    root, llama_lib, model, json_out, settle, server_args = (
        args.root,
        args.llama_lib,
        args.model,
        args.json_out,
        args.settle,
        args.server_args,
    )
    from slotfile.cli.common import out_console
    from slotfile.cli.terminal import escape_text
    from slotfile.llama.loader import LoaderError
    from slotfile.repair.migrate_dir import library_verdicts
    from slotfile.slotdir.walk import scan_dir

    if model is None and server_args is not None:
        from slotfile.cli.server_common import server_and_model

        got = server_and_model(server_args, None, "ls")
        if isinstance(got, int):
            return got
        model = Path(got[1]) if got[1] else None
    if model is None:
        fail("ls --llama-lib needs --model or --server-args with -m (each file is asked through a real load)", "ls")
        return USAGE
    if not root.is_dir():
        fail(f"{root}: not a directory", "ls")
        return OPERATIONAL
    if not model.is_file():
        fail(f"model {model} not found", "ls")
        return OPERATIONAL
    t0 = time.monotonic()
    scan = scan_dir(root, settle=settle)
    try:
        state, verdicts = library_verdicts(scan, str(model), str(llama_lib))
    except LoaderError as e:
        fail(str(e), "ls")
        return OPERATIONAL
    for line in scan.errors:
        fail(line, "ls")
    rc = OPERATIONAL if scan.errors else (PROBLEMS if any(v.verdict != "as-is" for v in verdicts) else OK)
    elapsed = time.monotonic() - t0
    if json_out:
        doc = {
            "schema": "slotfile.ls/1",
            "root": scan.root,
            "library": {"path": str(llama_lib), "state_seq_version": state},
            "files": [{"rel": v.rel, "version": v.version, "llama_lib": v.to_dict()} for v in verdicts],
            "errors": scan.errors,
            "exit_code": rc,
        }
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return rc
    out = out_console()
    label = {"as-is": "loads as is", "after-migrate": "after migrate", "no": "not at all"}
    for v in verdicts:
        out.print(escape_text(f"{label[v.verdict]:14} {v.rel}: {v.reason}"), soft_wrap=True)
    counts: dict[str, int] = {}
    for v in verdicts:
        counts[label[v.verdict]] = counts.get(label[v.verdict], 0) + 1
    summary = ", ".join(f"{n} {k}" for k, n in counts.items()) or "no slot files"
    out.print(
        f"{len(verdicts)} file(s) for {llama_lib} (state version {state}): {summary} in {elapsed:.1f} s",
        soft_wrap=True,
    )
    return rc
