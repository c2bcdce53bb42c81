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
     "exit_code": 0 | 4 | 8}

Exit codes: 0 every file restores as is; 4 at least one needs a re-save or cannot restore;
8 a path or the model cannot be read (unreadable files are reported one by one, the run goes on).

``re-save DIR`` JSON, schema ``slotfile.resave-dir/1``: ``{"schema", "root", "output", "server",
"dry_run", "files": [{"file", "fate", "action", "reason", "output", "changes"}], "errors",
"summary": {action: count, "seconds"}, "exit_code"}``; exit 0 when every file was copied or
converted (or would be), 4 when one cannot be or failed its check, 8 operational, 2 usage.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slotfile.cli.common import fail, progress_bar
from slotfile.cli.server_common import server_and_model, server_dict, wide_console
from slotfile.cli.terminal import escape_text, human_size
from slotfile.exitcodes import OK, OPERATIONAL, PROBLEMS, USAGE
from slotfile.slotdir.serverargs import ServerSettings

if TYPE_CHECKING:
    from slotfile.repair.batch import FileResult
    from slotfile.slotdir.restore import Checker, Restore
    from slotfile.slotdir.walk import DirScan, FileSummary

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


def _entries(paths: list[Path]) -> tuple[list[Any], list[str], dict[str, int]]:
    """Slot files of the given files and directories (temps and files being written left out)."""
    from slotfile.slotdir.walk import Entry, scan_dir

    entries: list[Entry] = []
    errors: list[str] = []
    apart = {"temp": 0, "busy": 0, "symlinks": 0}
    for p in paths:
        if p.is_dir():
            scan = scan_dir(p)
            entries += scan.slots
            errors += scan.errors
            apart["temp"] += len(scan.temps)
            apart["busy"] += len(scan.busy)
            apart["symlinks"] += len(scan.symlinks)
            if not scan.slots and not scan.errors:
                errors.append(f"no slot files found under {p}")
        elif p.is_file():
            st = p.stat()
            entries.append(Entry(str(p), p.name, st.st_size, st.st_mtime))
        else:
            errors.append(f"{p}: no such file or directory")
    return entries, errors, apart


# ---------------------------------------------------------------------------------------
# verify --server-args


def run_restore_check(
    paths: list[Path],
    server_args: str,
    model: Path | None,
    json_out: bool,
    jobs: int = 1,
    n_gpu_layers: int = 0,
    timeout: float = 300.0,
    quiet: bool = False,
) -> int:
    got = server_and_model(server_args, model, "verify")
    if isinstance(got, int):
        return got
    server, model_path = got
    t0 = time.monotonic()
    entries, errors, apart = _entries(paths)
    checker = _start(server, model_path, jobs, n_gpu_layers, timeout, "verify")
    if isinstance(checker, int):
        return checker
    results: list[tuple[FileSummary, Restore | None]] = []
    try:
        with progress_bar(disable=len(entries) < 2) as progress:
            task = progress.add_task("checking", total=len(entries))
            for e in entries:
                results.append(checker.check(e.path, e.rel, e.size, e.mtime))
                progress.update(task, advance=1, description=f"checked {escape_text(e.rel, 40)}")
        loader = dict(checker.pool.info) if checker.pool is not None else {}
    finally:
        checker.close()
    for line in errors:
        fail(line, "verify")
    for s, _ in results:
        if s.error:
            fail(s.error, "verify")
    rc = (
        OPERATIONAL
        if errors or any(r is None for _, r in results)
        else (OK if all(r is not None and r.fate == "restores as is" for _, r in results) else PROBLEMS)
    )
    elapsed = time.monotonic() - t0
    if json_out:
        doc = restore_document(results, errors, server, model_path, loader, elapsed, rc)
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        _render_restore(results, server, apart, elapsed, quiet)
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
    apart: dict[str, int],
    elapsed: float,
    quiet: bool,
) -> None:
    from rich.table import Table

    from slotfile.cli.common import out

    if not quiet:
        table = Table(title=f"will these restore? server: {server.describe()}", title_justify="left")
        for c in ("file", "size", "tokens", "verdict", "why"):
            table.add_column(c, justify="right" if c in ("size", "tokens") else "left", overflow="fold")
        for s, r in results:
            fate = r.fate if r is not None else "unreadable"
            table.add_row(
                escape_text(s.rel),
                human_size(s.size),
                str(s.n_tokens if s.n_tokens is not None else "-"),
                str(fate),
                escape_text(r.reason if r is not None else s.error or ""),
            )
        if results:
            wide_console().print(table)
    else:
        for s, r in results:
            if r is not None and r.fate != "restores as is":
                out.print(escape_text(f"{s.path}: {r.fate}: {r.reason}"), soft_wrap=True)
    counts: dict[str, int] = {}
    for _, r in results:
        k = str(r.fate) if r is not None else "unreadable"
        counts[k] = counts.get(k, 0) + 1
    line = f"{len(results)} file(s): " + ", ".join(f"{n} {k}" for k, n in counts.items())
    if apart["temp"] or apart["busy"]:
        line += f"; left out: {apart['temp']} temp file(s), {apart['busy']} being written"
    out.print(line + f" in {elapsed:.1f} s", soft_wrap=True)


# ---------------------------------------------------------------------------------------
# re-save DIR


def run_resave_dir(
    root: Path,
    outdir: Path | None,
    server_args: str | None,
    model: Path | None,
    *,
    dry_run: bool,
    force: bool,
    json_out: bool,
    timeout: float = 600.0,
) -> int:
    got = _resave_dir_args(root, outdir, server_args, model)
    if isinstance(got, int):
        return got
    server, model_path, outdir = got
    from slotfile.repair.batch import outputs_in_the_way
    from slotfile.slotdir.walk import scan_dir

    t0 = time.monotonic()
    scan = scan_dir(root)
    in_the_way = outputs_in_the_way(scan, str(outdir))
    if in_the_way and not force:
        fail(
            f"{in_the_way[0]} exists ({len(in_the_way)} output(s) in the way; pass --force to replace them)", "re-save"
        )
        return USAGE
    checker = _start(server, model_path, 1, 0, timeout, "re-save")
    if isinstance(checker, int):
        return checker
    try:
        results, errors = _convert_all(scan, checker, outdir, force=force, dry_run=dry_run, timeout=timeout)
    finally:
        checker.close()
    for line in errors:
        fail(line, "re-save")
    if errors or any(x.action == "error" for x in results):
        rc = OPERATIONAL
    elif any(x.action in ("skipped", "failed") for x in results):
        rc = PROBLEMS
    else:
        rc = OK
    elapsed = time.monotonic() - t0
    counts: dict[str, int] = {}
    for x in results:
        counts[x.action] = counts.get(x.action, 0) + 1
    if json_out:
        from slotfile.repair.batch import SCHEMA as BATCH_SCHEMA

        doc = {
            "schema": BATCH_SCHEMA,
            "root": str(root),
            "output": str(outdir),
            "server": server_dict(server),
            "dry_run": dry_run,
            "files": [x.to_dict() for x in results],
            "errors": errors,
            "summary": {**counts, "seconds": round(elapsed, 3)},
            "exit_code": rc,
        }
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        _print_resave_dir(results, counts, scan, elapsed, dry_run)
    return rc


def _resave_dir_args(
    root: Path, outdir: Path | None, server_args: str | None, model: Path | None
) -> int | tuple[ServerSettings, str | None, Path]:
    """The usage checks of a directory re-save: (server, model, output directory), or the
    exit code after saying what is wrong."""
    if server_args is None:
        fail("re-save of a directory needs --server-args (the flags of the server the files are for)", "re-save")
        return USAGE
    if outdir is None:
        fail("re-save of a directory needs -o OUTDIR", "re-save")
        return USAGE
    got = server_and_model(server_args, model, "re-save")
    if isinstance(got, int):
        return got
    rin, rout = os.path.realpath(root), os.path.realpath(outdir)
    if rout == rin or rout.startswith(rin + os.sep):
        fail(f"{outdir} lies inside {root}: choose an output directory outside it", "re-save")
        return USAGE
    if os.path.lexists(outdir) and (os.path.islink(outdir) or not os.path.isdir(outdir)):
        fail(f"{outdir} exists and is not a directory", "re-save")
        return USAGE
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


def _print_resave_dir(
    results: list[FileResult], counts: dict[str, int], scan: DirScan, elapsed: float, dry_run: bool
) -> None:
    from slotfile.cli.common import out

    for x in results:
        tail = f" -> {x.output}" if x.output and x.action in ("copied", "converted") else ""
        out.print(escape_text(f"{x.action:13} {x.rel}: {x.fate}: {x.reason}{tail}"), soft_wrap=True)
    summary = ", ".join(f"{n} {k}" for k, n in counts.items()) or "nothing to do"
    left = (
        f"; left out: {len(scan.temps)} temp file(s), {len(scan.busy)} being written" if scan.temps or scan.busy else ""
    )
    out.print(
        f"{len(results)} file(s): {summary}{left} in {elapsed:.1f} s"
        + (" (dry run: nothing written)" if dry_run else ""),
        soft_wrap=True,
    )
