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
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from slotfile.cli.common import fail, progress_bar, say_waiting
from slotfile.cli.dir_batch import outdir_usage, report_batch, settle_batch
from slotfile.exitcodes import OK, OPERATIONAL, PROBLEMS, USAGE
from slotfile.slotdir.walk import SETTLE_SECONDS, SETTLE_WAIT_SECONDS

if TYPE_CHECKING:
    from slotfile.repair.batch import FileResult
    from slotfile.repair.common import RepairOptions
    from slotfile.repair.migrate_dir import LibVerdict
    from slotfile.slotdir.walk import DirScan

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
    bad = _migrate_dir_usage(args)
    if bad is not None:
        return bad
    from slotfile.repair.common import RepairOptions
    from slotfile.slotdir.walk import scan_dir

    t0 = time.monotonic()
    scan = scan_dir(args.root, settle=args.settle, settle_wait=args.settle_wait, on_wait=say_waiting("migrate"))
    opts = RepairOptions(
        model=str(args.model) if args.model else None,
        draft_model=str(args.draft_model) if args.draft_model else None,
        to_version=args.to,
        timeout=args.timeout,
        llama_lib=str(args.llama_lib) if args.llama_lib else None,
    )
    results = _migrate_all(scan, args, opts)
    o = settle_batch(results, scan, list(scan.errors), t0, "migrate")
    head = {
        "schema": SCHEMA,
        "root": str(args.root),
        "output": str(args.outdir),
        "to": args.to,
        "dry_run": args.dry_run,
        "only_changed": args.only_changed,
    }
    report_batch(results, scan, o, head, args.dry_run, args.json_out)
    return o.rc


def _migrate_dir_usage(args: MigrateDirArgs) -> int | None:
    """The exit code after saying what is wrong with the command line (no OUTDIR, one inside
    DIR, a model or library that is not there); None when it can run."""
    if args.outdir is None:
        fail("migrate of a directory needs -o OUTDIR", "migrate")
        return USAGE
    bad = outdir_usage(args.root, args.outdir, "migrate")
    if bad is not None:
        return bad
    for m in (args.model, args.draft_model):
        if m is not None and not m.is_file():
            fail(f"model {m} not found", "migrate")
            return OPERATIONAL
    if args.llama_lib is not None:
        from slotfile.llama.loader import LoaderError, resolve_library

        try:
            resolve_library(str(args.llama_lib))
        except LoaderError as e:
            fail(str(e), "migrate")
            return OPERATIONAL
    return None


def _migrate_all(scan: DirScan, args: MigrateDirArgs, opts: RepairOptions) -> list[FileResult]:
    """Each slot file of the scan migrated (or copied, or left out) into OUTDIR."""
    from slotfile.cli.terminal import escape_text
    from slotfile.repair.migrate_dir import migrate_entry

    results = []
    with progress_bar(disable=len(scan.slots) < 2) as progress:
        task = progress.add_task("migrating", total=len(scan.slots))
        for entry in scan.slots:
            one = migrate_entry(
                entry,
                str(args.outdir),
                opts,
                force=args.force,
                dry_run=args.dry_run,
                only_changed=args.only_changed,
            )
            results.append(one)
            progress.update(task, advance=1, description=escape_text(entry.rel, 40))
    return results


def run_ls_library(args: LsLibraryArgs) -> int:
    """``ls DIR --llama-lib LIB``: per file, does that llama.cpp load it as is, after migrate, or not.
    The model: ``--model``, else the ``-m`` of ``--server-args``."""
    from slotfile.llama.loader import LoaderError
    from slotfile.repair.migrate_dir import library_verdicts
    from slotfile.slotdir.walk import scan_dir

    model = _ls_library_model(args)
    if isinstance(model, int):
        return model
    t0 = time.monotonic()
    scan = scan_dir(args.root, settle=args.settle)
    try:
        state, verdicts = library_verdicts(scan, str(model), str(args.llama_lib))
    except LoaderError as e:
        fail(str(e), "ls")
        return OPERATIONAL
    for line in scan.errors:
        fail(line, "ls")
    rc = OPERATIONAL if scan.errors else (PROBLEMS if any(v.verdict != "as-is" for v in verdicts) else OK)
    elapsed = time.monotonic() - t0
    if args.json_out:
        doc = {
            "schema": "slotfile.ls/1",
            "root": scan.root,
            "library": {"path": str(args.llama_lib), "state_seq_version": state},
            "files": [{"rel": v.rel, "version": v.version, "llama_lib": v.to_dict()} for v in verdicts],
            "errors": scan.errors,
            "exit_code": rc,
        }
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        _print_ls_library(verdicts, args.llama_lib, state, elapsed)
    return rc


def _ls_library_model(args: LsLibraryArgs) -> Path | int:
    """The model each file is loaded with, or the exit code after saying why there is none."""
    model = args.model
    if model is None and args.server_args is not None:
        from slotfile.cli.server_common import server_and_model

        got = server_and_model(args.server_args, None, "ls")
        if isinstance(got, int):
            return got
        model = Path(got[1]) if got[1] else None
    if model is None:
        fail("ls --llama-lib needs --model or --server-args with -m (each file is asked through a real load)", "ls")
        return USAGE
    if not args.root.is_dir():
        fail(f"{args.root}: not a directory", "ls")
        return OPERATIONAL
    if not model.is_file():
        fail(f"model {model} not found", "ls")
        return OPERATIONAL
    return model


def _print_ls_library(verdicts: list[LibVerdict], llama_lib: Path, state: int | None, elapsed: float) -> None:
    from slotfile.cli.common import out_console
    from slotfile.cli.terminal import count, escape_text

    out = out_console()
    label = {"as-is": "loads as is", "after-migrate": "after migrate", "no": "not at all"}
    for v in verdicts:
        out.print(escape_text(f"{label[v.verdict]:14} {v.rel}: {v.reason}"), soft_wrap=True)
    counts: dict[str, int] = {}
    for v in verdicts:
        counts[label[v.verdict]] = counts.get(label[v.verdict], 0) + 1
    summary = ", ".join(f"{n} {k}" for k, n in counts.items()) or "no slot files"
    out.print(
        f"{count(len(verdicts), 'file')} for {llama_lib} (state version {state}): {summary} in {elapsed:.1f} s",
        soft_wrap=True,
    )
