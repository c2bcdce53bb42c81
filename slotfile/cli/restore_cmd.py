"""``verify DIR --server-args ARGS`` (will each file restore under these flags?) and
``re-save DIR -o OUTDIR --server-args ARGS`` (convert what can be converted).

``verify --server-args`` JSON, schema ``slotfile.restore/1``::

    {"schema": "slotfile.restore/1", "server": {... ServerSettings ..., "n_stream", "describe"},
     "model": str, "loader": {"llama_cpp_python", "state_seq_version"},
     "files": [{"path", "rel", "size", "n_tokens", "version", "fate": "restores as is" |
                "needs re-save, exact" | "needs re-save, lossy" | "cannot" | null,
                "reason": str, "changes": [str], "proven": bool,
                "load": {"ok", "message", "crashed", "settings", "checkpoints_rejected"} | null,
                "error": str | null}],
     "errors": [str], "summary": {"files", "as_is", "exact", "lossy", "cannot", "error", "seconds"},
     "still_being_written": [str], "tally": {"handled", "skipped", "failed"}, "exit_code": 0 | 4 | 8}

Exit codes: 0 every file restores as is; 4 at least one needs a re-save or cannot restore, or
was still being written after ``--settle-wait``; 8 a path or the model cannot be read
(unreadable files are reported one by one, the run goes on).

``re-save DIR`` JSON, schema ``slotfile.resave-dir/1``: ``{"schema", "root", "output", "server",
"dry_run", "files": [{"file", "fate", "action", "reason", "output", "changes"}], "errors",
"still_being_written": [str], "summary": {action: count, "seconds"}, "tally": {"handled",
"skipped", "failed"}, "exit_code"}``; exit 0 when every file was copied or converted (or would
be), 4 when one cannot be, failed its check or was still being written after ``--settle-wait``,
8 operational, 2 usage.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slotfile.cli.common import fail, out_console, progress_bar, say_waiting
from slotfile.cli.dir_batch import outdir_usage, report_batch, settle_batch
from slotfile.cli.listing import Row, pipe_line, print_rows, print_wrapped, screen_width, summary
from slotfile.cli.server_common import server_and_model, server_dict
from slotfile.cli.terminal import count, escape_text, human_size
from slotfile.exitcodes import OK, OPERATIONAL, PROBLEMS, USAGE
from slotfile.slotdir.restore import Fate
from slotfile.slotdir.serverargs import ServerSettings
from slotfile.slotdir.walk import SETTLE_SECONDS, SETTLE_WAIT_SECONDS, Tally, settle_problem

if TYPE_CHECKING:
    from slotfile.repair.batch import FileResult
    from slotfile.slotdir.restore import Checker, Restore
    from slotfile.slotdir.walk import DirEntry, DirScan, FileSummary

SCHEMA = "slotfile.restore/1"
_SHORT = {
    "restores as is": "as_is",
    "needs re-save, exact": "exact",
    "needs re-save, lossy": "lossy",
    "cannot": "cannot",
}


def _start(
    server: ServerSettings, model: str | None, jobs: int, n_gpu_layers: int, timeout: float, command: str
) -> Checker | int:
    from slotfile.llama.loader import LoaderError
    from slotfile.model.bridge import ModelError
    from slotfile.slotdir.restore import Checker

    try:
        return Checker(server, model, jobs=jobs, n_gpu_layers=n_gpu_layers, timeout=timeout)
    except (ModelError, LoaderError) as e:
        fail(str(e), command)
        return OPERATIONAL


@dataclass(slots=True)
class _Found:
    """The slot files of the given paths, and what was set aside or could not be read."""

    entries: list[DirEntry]
    errors: list[str]
    temps: int = 0
    symlinks: int = 0
    busy: list[str] = field(default_factory=list)  # lines naming the files still being written after the wait

    @property
    def n_busy(self) -> int:
        return len(self.busy)


def _entries(paths: tuple[Path, ...], settle: float, settle_wait: float, command: str) -> _Found:
    """Slot files of the given files and directories (temps left out; files being written
    waited for, up to ``settle_wait``)."""
    from slotfile.slotdir.walk import DirEntry, scan_dir

    found = _Found([], [])
    for p in paths:
        if p.is_dir():
            scan = scan_dir(p, settle=settle, settle_wait=settle_wait, on_wait=say_waiting(command))
            found.entries += scan.slots
            found.errors += scan.errors
            found.temps += len(scan.temps)
            found.symlinks += len(scan.symlinks)
            found.busy += scan.busy_lines()
            if not scan.slots and not scan.errors and not scan.busy:
                found.errors.append(f"no slot files found under {p}")
        elif p.is_file():
            st = p.stat()
            found.entries.append(DirEntry(os.path.dirname(str(p)), p.name, st.st_size, st.st_mtime))
        else:
            found.errors.append(f"{p}: no such file or directory")
    return found


def _usage_settle(settle: float, settle_wait: float, command: str) -> int | None:
    why = settle_problem(settle, settle_wait)
    if why is None:
        return None
    fail(why, command)
    return USAGE


# ---------------------------------------------------------------------------------------
# verify --server-args


@dataclass(frozen=True, slots=True)
class RestoreCheckArgs:
    """``verify PATH... --server-args ARGS``'s command line."""

    paths: tuple[Path, ...]
    server_args: str
    model: Path | None = None
    json_out: bool = False
    jobs: int = 1
    n_gpu_layers: int = 0
    timeout: float = 300.0
    quiet: bool = False
    settle: float = SETTLE_SECONDS
    settle_wait: float = SETTLE_WAIT_SECONDS


def run_restore_check(args: RestoreCheckArgs) -> int:
    bad = _usage_settle(args.settle, args.settle_wait, "verify")
    if bad is not None:
        return bad
    got = server_and_model(args.server_args, args.model, "verify")
    if isinstance(got, int):
        return got
    server, model_path = got
    t0 = time.monotonic()
    found = _entries(args.paths, args.settle, args.settle_wait, "verify")
    checker = _start(server, model_path, args.jobs, args.n_gpu_layers, args.timeout, "verify")
    if isinstance(checker, int):
        return checker
    results: list[tuple[FileSummary, Restore | None]] = []
    try:
        with progress_bar(disable=len(found.entries) < 2) as progress:
            task = progress.add_task("checking", total=len(found.entries))
            for e in found.entries:
                results.append(checker.check(e.path, e.rel, e.size, e.mtime))
                progress.update(task, advance=1, description=f"checked {escape_text(e.rel, 40)}")
        loader = dict(checker.pool.info) if checker.pool is not None else {}
    finally:
        checker.close()
    for line in found.errors + found.busy:
        fail(line, "verify")
    for s, _ in results:
        if s.error:
            fail(s.error, "verify")
    if found.errors or any(r is None for _, r in results):
        rc = OPERATIONAL
    elif found.busy or not all(r is not None and r.fate == Fate.AS_IS for _, r in results):
        rc = PROBLEMS
    else:
        rc = OK
    unread = sum(1 for _, r in results if r is None)
    tally = Tally(len(results) - unread, found.temps + found.symlinks, unread + found.n_busy + len(found.errors))
    elapsed = time.monotonic() - t0
    if args.json_out:
        doc = restore_document(results, found.errors, server, model_path, loader, elapsed, rc)
        doc["still_being_written"] = found.busy
        doc["tally"] = tally.to_dict()
        doc["exit_code"] = doc.pop("exit_code")  # stays last
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        _render_restore(results, server, found, tally, elapsed, args.quiet)
    return rc


def restore_document(
    results: list[tuple[FileSummary, Restore | None]],
    errors: list[str],
    server: ServerSettings,
    model: str | None,
    loader: dict[str, Any],
    elapsed: float,
    rc: int,
) -> dict[str, Any]:
    files = []
    counts = dict.fromkeys(("as_is", "exact", "lossy", "cannot", "error"), 0)
    for s, r in results:
        d: dict[str, Any] = {"path": s.path, "rel": s.rel, "size": s.size, "n_tokens": s.n_tokens, "version": s.version}
        if r is None:
            d.update({"fate": None, "reason": s.error, "changes": [], "proven": False, "load": None})
            counts["error"] += 1
        else:
            d.update(r.to_dict())
            counts[_SHORT[r.fate]] += 1
        d["error"] = s.error
        files.append(d)
    return {
        "schema": SCHEMA,
        "server": server_dict(server),
        "model": model,
        "loader": {k: loader.get(k) for k in ("llama_cpp_python", "state_seq_version")} if loader else None,
        "files": files,
        "errors": errors,
        "summary": {"files": len(results), **counts, "seconds": round(elapsed, 3)},
        "exit_code": rc,
    }


def _render_restore(
    results: list[tuple[FileSummary, Restore | None]],
    server: ServerSettings,
    found: _Found,
    tally: Tally,
    elapsed: float,
    quiet: bool,
) -> None:
    out = out_console()
    width = None if quiet else screen_width(out)
    if width is not None:  # one row per file (slotfile.cli.listing), the reason under it
        print_wrapped(out, f"will these restore? server: {server.describe()}", width)
        rows = [
            Row(
                (str(r.fate) if r is not None else "unreadable", human_size(s.size), _tokens(s), s.rel),
                "bold green" if r is not None and r.fate == Fate.AS_IS else "bold red",
                (("", r.reason if r is not None else s.error or ""),),
            )
            for s, r in results
        ]
        if rows:
            print_rows(out, ("verdict", "size", "tokens", "file"), rows, width, right=("size", "tokens"))
    for s, r in results:
        if quiet and r is not None and r.fate != Fate.AS_IS:
            out.print(escape_text(f"{s.path}: {r.fate}: {r.reason}"), soft_wrap=True)
        elif width is None and not quiet:
            pipe_line(s.rel, f"{r.fate if r is not None else 'unreadable'}: {r.reason if r is not None else s.error}")
    counts: dict[str, int] = {}
    for _, r in results:
        k = str(r.fate) if r is not None else "unreadable"
        counts[k] = counts.get(k, 0) + 1
    line = f"{count(len(results), 'file')}: " + (", ".join(f"{n} {k}" for k, n in counts.items()) or "none checked")
    if found.temps or found.busy:
        line += f"; left out: {count(found.temps, 'temp file')}, {found.n_busy} still being written"
    if width is None:
        line += f"; server: {server.describe()}"
    summary(out, line + f"; {tally.line()} in {elapsed:.1f} s", width)


def _tokens(s: FileSummary) -> str:
    return str(s.n_tokens if s.n_tokens is not None else "-")


# ---------------------------------------------------------------------------------------
# re-save DIR


@dataclass(frozen=True, slots=True)
class ResaveDirArgs:
    """``re-save DIR -o OUTDIR --server-args ARGS``'s command line."""

    root: Path
    output: Path | None
    server_args: str | None
    model: Path | None = None
    dry_run: bool = False
    force: bool = False
    json_out: bool = False
    in_place: bool = False
    timeout: float = 600.0
    settle: float = SETTLE_SECONDS
    settle_wait: float = SETTLE_WAIT_SECONDS


def run_resave_dir(args: ResaveDirArgs) -> int:
    got = _resave_dir_args(args)
    if isinstance(got, int):
        return got
    server, model_path, outdir = got
    from slotfile.repair.batch import SCHEMA as BATCH_SCHEMA
    from slotfile.repair.batch import outputs_in_the_way
    from slotfile.slotdir.walk import scan_dir

    t0 = time.monotonic()
    scan = scan_dir(args.root, settle=args.settle, settle_wait=args.settle_wait, on_wait=say_waiting("re-save"))
    in_the_way = outputs_in_the_way(scan, str(outdir))
    if in_the_way and not args.force:
        fail(
            f"{in_the_way[0]} exists ({len(in_the_way)} output(s) in the way; pass --force to replace them)", "re-save"
        )
        return USAGE
    checker = _start(server, model_path, 1, 0, args.timeout, "re-save")
    if isinstance(checker, int):
        return checker
    try:
        results, errors = _convert_all(
            scan, checker, outdir, force=args.force, dry_run=args.dry_run, timeout=args.timeout
        )
    finally:
        checker.close()
    o = settle_batch(results, scan, errors, t0, "re-save")
    head = {
        "schema": BATCH_SCHEMA,
        "root": str(args.root),
        "output": str(outdir),
        "server": server_dict(server),
        "dry_run": args.dry_run,
    }
    report_batch(results, scan, o, head, args.dry_run, args.json_out)
    return o.rc


def _resave_dir_args(args: ResaveDirArgs) -> int | tuple[ServerSettings, str | None, Path]:
    """The usage checks of a directory re-save: (server, model, output directory), or the
    exit code after saying what is wrong."""
    root, outdir, server_args = args.root, args.output, args.server_args
    if not root.is_dir():
        fail("--server-args goes with a directory: re-save DIR -o OUTDIR --server-args ARGS", "re-save")
        return USAGE
    if args.in_place:
        fail("a directory is never converted in place: give -o OUTDIR", "re-save")
        return USAGE
    bad = _usage_settle(args.settle, args.settle_wait, "re-save")
    if bad is not None:
        return bad
    if server_args is None:
        fail("re-save of a directory needs --server-args (the flags of the server the files are for)", "re-save")
        return USAGE
    if outdir is None:
        fail("re-save of a directory needs -o OUTDIR", "re-save")
        return USAGE
    got = server_and_model(server_args, args.model, "re-save")
    if isinstance(got, int):
        return got
    bad = outdir_usage(root, outdir, "re-save")
    if bad is not None:
        return bad
    return got[0], got[1], outdir


def _convert_all(
    scan: DirScan, checker: Checker, outdir: Path, *, force: bool, dry_run: bool, timeout: float
) -> tuple[list[FileResult], list[str]]:
    """Each slot file of the scan checked against the server, and converted where it needs to
    be: (one result per readable file, the errors)."""
    from slotfile.repair.batch import convert_one

    results: list[FileResult] = []
    errors = list(scan.errors)
    with progress_bar(disable=len(scan.slots) < 2) as progress:
        task = progress.add_task("converting", total=len(scan.slots))
        for e in scan.slots:
            s, r = checker.check(e.path, e.rel, e.size, e.mtime)
            if r is None:
                errors.append(s.error or f"{e.path}: cannot be read")
            else:
                results.append(convert_one(e, r, str(outdir), checker, force=force, dry_run=dry_run, timeout=timeout))
            progress.update(task, advance=1, description=f"{escape_text(e.rel, 40)}")
    return results, errors
