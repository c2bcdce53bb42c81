"""Which files ``slotfile verify ARGS`` checks.

A file argument is taken as it is.  A directory is walked by :func:`slotfile.slotdir.walk.scan_dir`,
the walker of ``ls``, ``prune`` and ``re-save DIR``: every regular file under it (recursively,
symlinks not followed) named ``*.slot`` or ``*.bin`` or starting with a GGSQ or GGSN magic (the
server saves slots under any name).  Temp files and symlinks are skipped, as ``ls`` skips them.
A file modified within the last ``settle`` seconds may still be being written (llama-server
writes in place): the walker waits for it, up to ``settle_wait`` seconds
(:func:`slotfile.slotdir.walk.wait_for_settle`), and verifies it once it has settled; one still
changing after that is named in ``busy`` and fails the run (exit 4): a run never passes over a
file it left out.  A path that does not exist and a directory with no slot file under it are
operational errors: a run that checks nothing must not pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from slotfile.slotdir.walk import SETTLE_SECONDS, SETTLE_WAIT_SECONDS, DirEntry, DirScan, scan_dir
from slotfile.text import count


@dataclass
class Collected:
    """The files to verify (a directory's sorted by path, the order of the report), the
    operational errors (missing paths, unreadable directories), notes on what a walk skipped,
    the lines naming files still being written after the wait (``busy``), and how many files
    were skipped by rule (temp names, symlinks)."""

    files: list[Path] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    busy: list[str] = field(default_factory=list)
    busy_paths: list[str] = field(default_factory=list)
    skipped: int = 0
    dirs: int = 0  # directory arguments walked
    sizes: list[int | None] = field(default_factory=list)  # of ``files``, as walked (None: not walked)


def collect(
    args: list[Path],
    settle: float = SETTLE_SECONDS,
    settle_wait: float = SETTLE_WAIT_SECONDS,
    on_wait: Callable[[list[DirEntry], float], None] | None = None,
) -> Collected:
    """What ``args`` name, directories walked (see the module docstring).  ``settle_wait`` 0:
    files being written are not waited for (they are named in ``busy`` at once)."""
    out = Collected()
    for a in args:
        if a.is_dir():
            out.dirs += 1
            scan = scan_dir(a, settle=settle, settle_wait=settle_wait, on_wait=on_wait)
            out.errors += scan.errors
            out.busy += scan.busy_lines()
            out.busy_paths += [e.path for e in scan.busy]
            out.skipped += len(scan.temps) + len(scan.symlinks)
            aside = _skipped(scan)
            if not scan.slots and not scan.errors and not scan.busy:
                out.errors.append(f"no slot files found under {a}{f' ({aside})' if aside else _what_is_there(a)}")
            elif aside:
                out.notes.append(f"{a}: {aside}")
            walked = sorted((Path(e.path), e.size) for e in scan.slots)
            out.files += [p for p, _ in walked]
            out.sizes += [n for _, n in walked]
        elif a.exists():
            out.files.append(a)
            out.sizes.append(None)
        else:
            out.errors.append(f"{a}: no such file or directory")
    return out


def _skipped(scan: DirScan) -> str:
    """What the walk skipped by rule ("" when nothing); files still being written are named
    apart (:attr:`Collected.busy`)."""
    parts = []
    if scan.temps:
        parts.append(f"{count(len(scan.temps), 'temp file')}")
    if scan.symlinks:
        parts.append(f"{len(scan.symlinks)} symlink(s) not followed")
    return "skipped: " + ", ".join(parts) + " (not verified)" if parts else ""


def _what_is_there(d: Path) -> str:
    """For a directory without slot files: a hint when it holds models instead."""
    models = sum(1 for _ in d.rglob("*.gguf"))
    if models:
        return f" (it holds {models} GGUF model(s): give one with --model and the slot files as arguments)"
    return ""
