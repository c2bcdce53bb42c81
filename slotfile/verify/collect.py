"""Which files ``slotfile verify ARGS`` checks.

A file argument is taken as it is.  A directory is walked by :func:`slotfile.slotdir.walk.walk_dir`,
the walker of ``ls``, ``prune`` and ``re-save DIR``: every regular file under it (recursively,
symlinks not followed) named ``*.slot`` or ``*.bin`` or starting with a GGSQ or GGSN magic (the
server saves slots under any name).  Temp files and symlinks are skipped, as ``ls`` skips them.
A file modified within the last ``settle`` seconds may still be being written (llama-server
writes in place): the walker waits for it, up to ``settle_wait`` seconds
(:func:`slotfile.slotdir.walk.walk_dir`), and verifies it once it has settled; one still
changing after that is named in ``busy`` and fails the run (exit 4): a run never passes over a
file it left out.  A path that does not exist and a directory with no slot file under it are
operational errors: a run that checks nothing must not pass.
"""

from __future__ import annotations

import bisect
import os
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import overload

from slotfile.slotdir.walk import (
    SETTLE_SECONDS,
    SETTLE_WAIT_SECONDS,
    DirEntry,
    DirScan,
    walk_dir,
)
from slotfile.text import count


class PathList(Sequence[Path]):
    """Paths held as strings, each made a :class:`~pathlib.Path` when it is taken: a ``Path``
    kept for every file of a 20,000-file store cost ~440 bytes a file (its parts list, its
    cached string).  A walked directory's files are held as their paths relative to it (the
    walk's own strings, shared, not copied) under one root string for all of them."""

    __slots__ = ("_roots", "_s", "_starts")

    def __init__(self, paths: Iterable[str | os.PathLike[str]] = ()) -> None:
        self._s: list[str] = []
        # each run of items under one root: its first index and its root ("": whole paths)
        self._starts: list[int] = []
        self._roots: list[str] = []
        self.extend(paths)

    def __len__(self) -> int:
        return len(self._s)

    def _path(self, i: int) -> str:
        root = self._roots[bisect.bisect_right(self._starts, i) - 1]
        return os.path.join(root, self._s[i]) if root else self._s[i]

    @overload
    def __getitem__(self, i: int) -> Path: ...
    @overload
    def __getitem__(self, i: slice) -> PathList: ...
    def __getitem__(self, i: int | slice) -> Path | PathList:
        if isinstance(i, slice):
            return PathList(self._path(j) for j in range(*i.indices(len(self._s))))
        if i < 0:
            i += len(self._s)
        if not 0 <= i < len(self._s):
            raise IndexError("PathList index out of range")
        return Path(self._path(i))

    def __iter__(self) -> Iterator[Path]:
        return (Path(self._path(i)) for i in range(len(self._s)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PathList | list) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]  # mutable, as a list

    def __repr__(self) -> str:
        return f"PathList({[str(p) for p in self]!r})"

    def append(self, p: str | os.PathLike[str]) -> None:
        self.extend((p,))

    def extend(self, paths: Iterable[str | os.PathLike[str]]) -> None:
        for p in paths:
            self.add("", os.fspath(p))

    def add(self, root: str, rel: str) -> None:
        """A path ``rel`` relative to the directory ``root`` ("": a whole path)."""
        if not self._roots or self._roots[-1] != root:
            self._starts.append(len(self._s))
            self._roots.append(root)
        self._s.append(rel)


@dataclass
class Collected:
    """The files to verify (a directory's sorted by path, the order of the report), the
    operational errors (missing paths, unreadable directories), notes on what a walk skipped,
    the lines naming files still being written after the wait (``busy``), and how many files
    were skipped by rule (temp names, symlinks)."""

    files: PathList = field(default_factory=PathList)
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    busy: list[str] = field(default_factory=list)
    busy_paths: list[str] = field(default_factory=list)
    skipped: int = 0
    dirs: int = 0  # directory arguments walked
    # of ``files``, as walked (-1: not walked); an array: a large store's sizes held as 8 bytes each
    sizes: array[int] = field(default_factory=lambda: array("q"))


def collect(
    args: list[Path],
    settle: float = SETTLE_SECONDS,
    settle_wait: float = SETTLE_WAIT_SECONDS,
    on_wait: Callable[[list[DirEntry], float], None] | None = None,
) -> Collected:
    """What ``args`` name, directories walked (see the module docstring), every file held in
    ``files``.  ``settle_wait`` 0: files being written are not waited for (they are named in
    ``busy`` at once)."""
    out = Collected()
    for root, rel, size in _walked_files(out, args, settle, settle_wait, on_wait):
        out.files.add(root, rel)  # a walk's file held as its relative path (the walk's string)
        out.sizes.append(size)
    return out


def collect_stream(
    args: list[Path],
    settle: float = SETTLE_SECONDS,
    settle_wait: float = SETTLE_WAIT_SECONDS,
    on_wait: Callable[[list[DirEntry], float], None] | None = None,
) -> tuple[Collected, Iterator[tuple[str, int]]]:
    """:func:`collect` taken as it goes: the files, each as (path, size as walked or -1), in
    the same order, a directory's yielded as its walk reaches them
    (:func:`~slotfile.slotdir.walk.walk_dir`: none held); the :class:`Collected`, its
    ``files`` left empty, fills in its errors, notes, busy files and skipped count as they are
    passed (complete once the iterator is exhausted)."""
    out = Collected()
    found = _walked_files(out, args, settle, settle_wait, on_wait)
    return out, ((os.path.join(root, rel) if root else rel, size) for root, rel, size in found)


def _walked_files(
    out: Collected,
    args: list[Path],
    settle: float,
    settle_wait: float,
    on_wait: Callable[[list[DirEntry], float], None] | None,
) -> Iterator[tuple[str, str, int]]:
    """The files of ``args`` as (root, path relative to it, size): root "" for a file argument
    (its path whole, size -1); what each walk left out goes into ``out`` once it is done."""
    for a in args:
        if a.is_dir():
            out.dirs += 1
            scan, found = walk_dir(a, settle=settle, settle_wait=settle_wait, on_wait=on_wait)
            n = 0
            for e in found:
                n += 1
                yield e.root, e.rel, e.size
            _walked(out, a, scan, n)
        elif a.exists():
            yield "", os.fspath(a), -1
        else:
            out.errors.append(f"{a}: no such file or directory")


def _walked(out: Collected, a: Path, scan: DirScan, n: int) -> None:
    """What the walk of ``a`` (``n`` slot files) left out or could not read, into ``out``."""
    out.errors += scan.errors
    out.busy += scan.busy_lines()
    out.busy_paths += [e.path for e in scan.busy]
    out.skipped += len(scan.temps) + len(scan.symlinks)
    aside = _skipped(scan)
    if not n and not scan.errors and not scan.busy:
        out.errors.append(f"no slot files found under {a}{f' ({aside})' if aside else _what_is_there(a)}")
    elif aside:
        out.notes.append(f"{a}: {aside}")


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
