"""Which files ``slotfile verify ARGS`` checks.

A file argument is taken as it is.  A directory is walked by :func:`slotfile.slotdir.walk.scan_dir`,
the walker of ``ls`` and ``prune``: every regular file under it (recursively, symlinks not
followed) named ``*.slot`` or ``*.bin`` or starting with a GGSQ or GGSN magic (the server saves
slots under any name).  Temp files are set aside, as ``ls`` and ``prune`` set them aside.  A
file modified within the last ``settle`` seconds may still be being written (llama-server
writes in place): the walk waits until ``settle`` seconds have passed since the newest such
write and walks again, so that a file a job has just finished writing is verified; a file
written meanwhile is set aside.  A path that does not exist and a directory with no slot file under
it are operational errors: a run that checks nothing must not pass.
"""

from __future__ import annotations

import time
from pathlib import Path

from slotfile.slotdir.walk import SETTLE_SECONDS, DirScan, scan_dir


def collect(
    args: list[Path], settle: float = SETTLE_SECONDS, wait: bool = True
) -> tuple[list[Path], list[str], list[str]]:
    """(files to verify, operational errors, notes on what a directory walk set aside).
    ``wait``: wait for files modified within ``settle`` seconds to settle (False: set them
    aside at once).  The files of a directory come sorted by path, the order of the report."""
    files: list[Path] = []
    errors: list[str] = []
    notes: list[str] = []
    for a in args:
        if a.is_dir():
            scan = _walk(a, settle, wait)
            errors += scan.errors
            aside = _set_aside(scan, settle)
            if not scan.slots and not scan.errors:
                errors.append(f"no slot files found under {a}{f' ({aside})' if aside else _what_is_there(a)}")
            elif aside:
                notes.append(f"{a}: {aside}")
            files += sorted(Path(e.path) for e in scan.slots)
        elif a.exists():
            files.append(a)
        else:
            errors.append(f"{a}: no such file or directory")
    return files, errors, notes


def _walk(d: Path, settle: float, wait: bool) -> DirScan:
    """The walk of ``d``; with ``wait``, again once ``settle`` seconds have passed since the
    newest write (at most ``settle`` seconds from now, whatever a skewed clock says)."""
    scan = scan_dir(d, settle=settle)
    if wait and scan.busy:
        newest = max(e.mtime for e in scan.busy)
        time.sleep(min(settle, max(0.0, newest + settle - time.time())))
        scan = scan_dir(d, settle=settle)  # what was written meanwhile is still busy
    return scan


def _set_aside(scan: DirScan, settle: float) -> str:
    """What the walk set aside and did not verify ("" when nothing)."""
    parts = []
    if scan.temps:
        parts.append(f"{len(scan.temps)} temp file(s)")
    if scan.busy:
        parts.append(f"{len(scan.busy)} file(s) still being written (modified within {settle:g} s, --settle)")
    return "set aside: " + ", ".join(parts) + " not verified" if parts else ""


def _what_is_there(d: Path) -> str:
    """For a directory without slot files: a hint when it holds models instead."""
    models = sum(1 for _ in d.rglob("*.gguf"))
    if models:
        return f" (it holds {models} GGUF model(s): give one with --model and the slot files as arguments)"
    return ""
