"""A ``--slot-save-path`` directory as a whole: which files are slot files, which are still
being written, and what each holds at the structure level (header and layout; no value scan).

llama-server writes a slot file in place under its final name (``llama_state_seq_save_file``
opens it with ``"wb"``, tools/server/server-context.cpp ``SERVER_TASK_TYPE_SLOT_SAVE``), so a
file being written has no telling name: it is recognised by a modification time within the
last ``settle`` seconds.  Temp files of slotfile's own safe writes (``.NAME.slotfile-PID-HEX.*``)
and the usual partial-download names (``*.tmp``, ``*.part``, ``*.partial``) are temp files.
Temp files are counted apart and never listed, checked, converted or removed.  A file being
written is waited for, up to ``settle_wait`` seconds (:func:`walk_dir`), and then handled
like any other; one still changing after that bound is named by the commands, which exit 4:
a run never reports success over a file it left out.

Symlinks are never followed: a symlinked file or directory under DIR is counted as skipped.
"""

from __future__ import annotations

import heapq
import os
import re
import stat
import time
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, overload

from slotfile.problems import Severity

# slotfile.format (numpy, the grammar) is imported where a file is read (summarize): the
# walk and the rows of a directory run on forked processes need none of it in this process.

SLOT_SUFFIXES = (".slot", ".bin")
MAGICS = (b"qsgg", b"nsgg")  # GGSQ / GGSN as little-endian u32 (llama.cpp's LLAMA_STATE_*_MAGIC)
SETTLE_SECONDS = 5.0  # a file modified this recently may still be being written
SETTLE_WAIT_SECONDS = 30.0  # how long a command waits, by default, for such files to settle
LISTING_BATCH = 1024  # names of a folder read and sorted at a time (_listing)
SETTLE_WAIT_MAX = 86400.0  # --settle-wait above a day is taken for a typo
_SLOTFILE_TEMP = re.compile(r"^\..+\.slotfile-\d+-[0-9a-f]{12}\.[\w-]+$")
_TEMP_SUFFIXES = (".tmp", ".part", ".partial")


@dataclass(slots=True)
class DirEntry:
    """One regular file under DIR (never a symlink).  Its path is ``root`` joined with ``rel``,
    made when asked: a walk holds an entry a file, and its ``root`` is one string all its
    entries share (a path string kept in each was ~30 % of a large store's walk)."""

    root: str  # the directory walked, as given ("" where ``rel`` is the whole path)
    rel: str  # relative to ``root``
    size: int
    mtime: float

    @property
    def path(self) -> str:
        return os.path.join(self.root, self.rel) if self.root else self.rel


class EntryList(Sequence[DirEntry]):
    """A walk's entries under one root, kept as columns: the relative paths (the walk's own
    strings), the sizes and the times in arrays; a :class:`DirEntry` is made when one is
    asked for.  A store of 20,000 files held ~190 B a file as entries (the object, its size
    int and time float beside the string), ~90 B this way."""

    __slots__ = ("_mtime", "_rel", "_size", "root")

    def __init__(self, root: str) -> None:
        self.root = root
        self._rel: list[str] = []
        self._size = array("q")
        self._mtime = array("d")

    def append(self, e: DirEntry) -> None:
        if e.root != self.root:
            raise ValueError(f"{e.rel}: under {e.root!r}, not this walk's root {self.root!r}")
        self._rel.append(e.rel)
        self._size.append(e.size)
        self._mtime.append(e.mtime)

    def extend(self, entries: Iterable[DirEntry]) -> None:
        for e in entries:
            self.append(e)

    def __len__(self) -> int:
        return len(self._rel)

    @overload
    def __getitem__(self, i: int) -> DirEntry: ...
    @overload
    def __getitem__(self, i: slice) -> EntryList: ...
    def __getitem__(self, i: int | slice) -> DirEntry | EntryList:
        if isinstance(i, slice):
            return self._take(range(len(self))[i])
        return DirEntry(self.root, self._rel[i], self._size[i], self._mtime[i])

    def __iter__(self) -> Iterator[DirEntry]:
        root = self.root
        for rel, size, mtime in zip(self._rel, self._size, self._mtime, strict=True):
            yield DirEntry(root, rel, size, mtime)

    def __add__(self, other: Iterable[DirEntry]) -> list[DirEntry]:
        return [*self, *other]

    def sizes(self) -> Sequence[int]:
        """Every entry's size, in order (the column itself: no list is made)."""
        return self._size

    def sort_by_rel(self, key: Callable[[str], Any]) -> None:
        """Sorted in place by ``key`` of each relative path (stable; no entry is made to sort)."""
        rel = self._rel
        self._set(self._take(sorted(range(len(self)), key=lambda i: key(rel[i]))))

    def _take(self, order: Iterable[int]) -> EntryList:
        out = EntryList(self.root)
        for i in order:
            out._rel.append(self._rel[i])
            out._size.append(self._size[i])
            out._mtime.append(self._mtime[i])
        return out

    def _set(self, other: EntryList) -> None:
        self._rel, self._size, self._mtime = other._rel, other._size, other._mtime


@dataclass(slots=True)
class DirScan:
    """What a walk of DIR found, by kind."""

    root: str
    slots: EntryList = field(init=False)  # under ``root``
    temps: list[DirEntry] = field(default_factory=list)  # temp names
    # modified within ``settle`` seconds, and still so once ``settle_wait`` ran out
    busy: list[DirEntry] = field(default_factory=list)
    symlinks: list[str] = field(default_factory=list)  # skipped, never followed
    errors: list[str] = field(default_factory=list)  # per path: could not be read (operational)
    settle: float = SETTLE_SECONDS
    settle_wait: float = 0.0
    waited: float = 0.0  # seconds spent waiting for files being written
    settled: int = 0  # files that were being written at the walk and settled while waited for

    def __post_init__(self) -> None:
        self.slots = EntryList(self.root)

    def busy_lines(self) -> list[str]:
        """One line per file left out because it was still being written: the file, how long
        ago it changed, and what would let the command handle it."""
        now = time.time()
        return [
            f"{e.path}: still being written (modified {max(0.0, now - e.mtime):.1f} s ago, within --settle "
            f"{self.settle:g} s) after waiting {self.waited:.1f} s (--settle-wait {self.settle_wait:g}): "
            "not handled; run again once it is complete, or raise --settle-wait"
            for e in self.busy
        ]


@dataclass(frozen=True, slots=True)
class Tally:
    """What became of the files a directory command found: ``handled`` (listed, checked,
    converted, planned), ``skipped`` (set aside by rule: temp names, symlinks, files a command
    declines), ``failed`` (unreadable, vanished, still being written after the wait, a failed
    action).  Exit 0 needs ``failed == 0``."""

    handled: int
    skipped: int
    failed: int

    def to_dict(self) -> dict[str, int]:
        return {"handled": self.handled, "skipped": self.skipped, "failed": self.failed}

    def line(self) -> str:
        return f"{self.handled} handled, {self.skipped} skipped, {self.failed} failed"


def settle_problem(settle: float, settle_wait: float) -> str | None:
    """The usage error of ``--settle`` / ``--settle-wait`` values, or None when both are usable."""
    import math

    if not math.isfinite(settle) or settle < 0:
        return f"--settle takes seconds >= 0, not {settle!r}"
    if not math.isfinite(settle_wait) or not 0 <= settle_wait <= SETTLE_WAIT_MAX:
        return f"--settle-wait takes seconds from 0 to {SETTLE_WAIT_MAX:g}, not {settle_wait!r}"
    return None


def is_temp_name(name: str) -> bool:
    return bool(_SLOTFILE_TEMP.match(name)) or name.endswith(_TEMP_SUFFIXES)


def has_slot_magic(path: str | os.PathLike[str]) -> bool | None:
    """Whether the file starts with a slot (GGSQ) or session (GGSN) magic; None when it cannot
    be read.  Never follows a symlink (O_NOFOLLOW)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        return os.read(fd, 4) in MAGICS
    except OSError:
        return None
    finally:
        os.close(fd)


def scan_dir(
    root: str | os.PathLike[str],
    settle: float = SETTLE_SECONDS,
    now: float | None = None,
    settle_wait: float = 0.0,
    on_wait: Callable[[list[DirEntry], float], None] | None = None,
) -> DirScan:
    """Walk ``root`` (recursively, symlinks not followed) in the order its paths sort (part by
    part, as :class:`pathlib.PurePath` and :func:`path_order` sort them: each folder's
    entries by name, a subfolder's files where its name falls).  A directory that vanishes
    or cannot be listed mid-walk is an error line; the walk goes on.  Files modified within
    ``settle`` seconds of ``now`` are waited for, up to ``settle_wait`` seconds
    (:func:`wait_for_settle`; ``on_wait(files, bound)`` is told before the wait starts); those
    that settle join ``slots`` in that order, the rest stay in ``busy``.  Every slot file is
    held (:class:`EntryList`); :func:`walk_dir` gives them one at a time instead."""
    scan, found = walk_dir(root, settle, now, settle_wait, on_wait)
    for e in found:
        scan.slots.append(e)
    return scan


def walk_dir(
    root: str | os.PathLike[str],
    settle: float = SETTLE_SECONDS,
    now: float | None = None,
    settle_wait: float = 0.0,
    on_wait: Callable[[list[DirEntry], float], None] | None = None,
) -> tuple[DirScan, Iterator[DirEntry]]:
    """:func:`scan_dir` taken as it goes: the scan, whose temps, symlinks, errors and busy files
    fill in as the walk passes them (complete once the iterator is exhausted), and the slot
    files in the same order, each yielded when the walk reaches it (nothing is held: a
    directory command's memory stays flat in the number of files).  The files after the
    first one still being written are held (an :class:`EntryList`) until the walk's end, the
    wait, and the merge of what settled into their order: the order is :func:`scan_dir`'s."""
    scan = DirScan(os.fspath(root), settle=settle, settle_wait=settle_wait)
    return scan, _walk(scan, time.time() if now is None else now, on_wait)


def _walk(scan: DirScan, now: float, on_wait: Callable[[list[DirEntry], float], None] | None) -> Iterator[DirEntry]:
    wait = scan.settle_wait > 0
    held = EntryList(scan.root)  # after the first file being written, until it is waited for
    top = scan.root
    # depth first, one listing per open folder (its names in order: _listing)
    stack: list[tuple[str, str, Iterator[str]]] = [(top, "", _listing(scan, top))]
    while stack:
        d, rel_dir, names = stack[-1]
        name = next(names, None)
        if name is None:
            stack.pop()
            continue
        rel = os.path.join(rel_dir, name) if rel_dir else name
        p = os.path.join(d, name)
        try:
            st = os.lstat(p)  # never followed: a symlink to a folder is a symlink here
        except OSError as why:
            scan.errors.append(f"{p}: {why.strerror or why}")
            continue
        if stat.S_ISDIR(st.st_mode):
            stack.append((p, rel, _listing(scan, p)))
            continue
        e = _classify(scan, p, rel, name, st, now)
        if e is None:
            continue
        if wait and scan.busy:
            held.append(e)
        else:
            yield e
    if not (wait and scan.busy):
        return
    if on_wait is not None:
        on_wait(list(scan.busy), scan.settle_wait)
    held.extend(_settle(scan, scan.settle_wait))
    held.sort_by_rel(path_order)
    yield from held


def wait_for_settle(
    scan: DirScan,
    bound: float,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Wait, at most ``bound`` seconds, for the ``busy`` files of ``scan`` to go ``scan.settle``
    seconds without a change (:func:`_settle`); those that settled join ``scan.slots`` in the
    walk's order."""
    scan.slots.extend(_settle(scan, bound, clock, sleep))
    scan.slots.sort_by_rel(path_order)


def _settle(
    scan: DirScan,
    bound: float,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
) -> list[DirEntry]:
    """The ``busy`` files of ``scan`` that went ``scan.settle`` seconds without a change within
    ``bound`` seconds, with their new sizes and times.  Each is looked at again (lstat, no
    follow) when it would be due; one that vanished or turned into something else is an error
    line (the server may rename or remove it, and the command must say so rather than count
    it); the rest stay in ``busy``."""
    t0 = clock()
    deadline = t0 + bound
    pending = scan.busy
    settled: list[DirEntry] = []
    while pending:
        t = clock()
        still: list[DirEntry] = []
        for e in pending:
            fresh = _restat(scan, e)
            if fresh is None:
                continue
            if t - fresh.mtime >= scan.settle:
                settled.append(fresh)
            else:
                still.append(fresh)
        pending = still
        if not pending or t >= deadline:
            break
        due = min(e.mtime for e in pending) + scan.settle  # the first that could settle
        sleep(min(max(due - t, 0.05), deadline - t))
    scan.busy = pending
    scan.waited = clock() - t0
    scan.settled += len(settled)
    return settled


def _restat(scan: DirScan, e: DirEntry) -> DirEntry | None:
    try:
        st = os.lstat(e.path)
    except FileNotFoundError:
        scan.errors.append(f"{e.path}: vanished while it was being written")
        return None
    except OSError as why:
        scan.errors.append(f"{e.path}: {why.strerror or why}")
        return None
    if not stat.S_ISREG(st.st_mode):
        scan.errors.append(f"{e.path}: no longer a regular file")
        return None
    return DirEntry(e.root, e.rel, st.st_size, st.st_mtime)


def _listing(out: DirScan, d: str) -> Iterator[str]:
    """Folder ``d``'s names in sorted order; a folder that cannot be listed is an error line.
    Sorting needs every name of the folder (a server's store is one flat folder): they are
    read :data:`LISTING_BATCH` at a time, each batch sorted and kept as one NUL-joined string
    (no name holds a NUL), and the batches merged as the names are taken.  A name costs its
    characters, not a string object and a list slot (~70 bytes): 100,000 files in one folder
    hold ~1.6 MB of names while they are walked, not ~7 MB."""
    batches: list[str] = []
    try:
        with os.scandir(d) as it:
            while batch := [e.name for e in islice(it, LISTING_BATCH)]:
                batch.sort()
                batches.append("\0".join(batch))
    except OSError as e:
        out.errors.append(f"{e.filename}: {e.strerror or e}")
        return iter(())
    return heapq.merge(*map(_split_names, batches))


def _split_names(joined: str) -> Iterator[str]:
    """The names of one NUL-joined batch, one at a time (no list of them is made)."""
    i = 0
    while (j := joined.find("\0", i)) >= 0:
        yield joined[i:j]
        i = j + 1
    yield joined[i:]


def path_order(path: str) -> str:
    """The key that sorts path strings as :class:`~pathlib.PurePosixPath` sorts them (part by
    part: ``d/x`` before ``d-2/x``), one string a file rather than a list of its parts: the
    separator becomes the lowest character (no part holds a NUL).  :func:`scan_dir` walks in
    this order."""
    return path.replace(os.sep, "\x00")


def _suffix(name: str) -> str:
    """``PurePath(name).suffix``, without making a path (a walk asks it of every file)."""
    i = name.rfind(".")
    return name[i:] if 0 < i < len(name) - 1 else ""


def _classify(out: DirScan, p: str, rel: str, name: str, st: os.stat_result, now: float) -> DirEntry | None:
    """The entry of a slot file (``p``, its lstat ``st``) settled at ``now``; anything else is
    counted in ``out`` (a temp name, a symlink, a file being written, an error line) or passed
    over (None)."""
    if stat.S_ISLNK(st.st_mode):
        out.symlinks.append(p)
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    entry = DirEntry(out.root, rel, st.st_size, st.st_mtime)  # its path is p: os.path.join(root, rel)
    if is_temp_name(name):
        out.temps.append(entry)
        return None
    if _suffix(name).lower() not in SLOT_SUFFIXES:
        magic = has_slot_magic(p)
        if magic is None:
            out.errors.append(f"{p}: cannot be read")
            return None
        if not magic:
            return None
    if now - st.st_mtime < out.settle:
        out.busy.append(entry)
        return None
    return entry


# ---------------------------------------------------------------------------------------
# one file, structure level


@dataclass(slots=True)
class FileSummary:
    """What ``ls`` shows for a file (structure level: header, layout, appendix)."""

    path: str
    rel: str
    size: int
    mtime: float
    format: str | None = None
    version: int | None = None
    n_tokens: int | None = None
    memory_class: str | None = None
    n_stream: int | None = None  # of the first KV block
    active_streams: int | None = None  # streams with cells, most of any KV block
    kv_cells: int | None = None  # cells of the largest KV stream
    type_k: str | None = None
    type_v: str | None = None
    v_trans: int | None = None
    checkpoints: int = 0
    draft: bool = False
    damaged: bool = False
    first_problem: str | None = None
    error: str | None = None  # could not be read (operational)

    @property
    def flash_attn(self) -> bool | None:
        return None if self.v_trans is None else self.v_trans == 0

    def age(self, now: float) -> float:
        return max(0.0, now - self.mtime)

    def to_dict(self, now: float) -> dict[str, Any]:
        return {
            "path": self.path,
            "rel": self.rel,
            "size": self.size,
            "age_s": round(self.age(now), 1),
            "format": self.format,
            "version": self.version,
            "n_tokens": self.n_tokens,
            "memory_class": self.memory_class,
            "n_stream": self.n_stream,
            "active_streams": self.active_streams,
            "kv_cells": self.kv_cells,
            "type_k": self.type_k,
            "type_v": self.type_v,
            "flash_attn": self.flash_attn,
            "checkpoints": self.checkpoints,
            "draft": self.draft,
            "damaged": self.damaged,
            "first_problem": self.first_problem,
            "error": self.error,
        }


def summarize(entry: DirEntry) -> FileSummary:
    """Open one file read-only and describe it; never raises (an unreadable file sets ``error``)."""
    from slotfile.format.reader import open_slot_file

    s = FileSummary(entry.path, entry.rel, entry.size, entry.mtime)
    try:
        sf = open_slot_file(entry.path)
    except OSError as e:
        s.error = f"{entry.path}: {e.strerror or e}"
        return s
    try:
        fill_summary(s, sf)
    finally:
        sf.close()
    return s


def summarize_all(entries: Iterable[DirEntry], jobs: int | None = None) -> list[FileSummary]:
    """:func:`summarize` of every entry, in their order (:func:`summarize_stream`, kept)."""
    return list(summarize_stream(entries, jobs))


def summarize_stream(entries: Iterable[DirEntry], jobs: int | None = None) -> Iterator[FileSummary]:
    """:func:`summarize` of every entry, yielded in their order as they are read: on forked
    processes for a large directory (:func:`slotfile.slotdir.forked.ordered_map`).  The
    entries are taken as they are needed (a :func:`walk_dir` as it goes)."""
    from slotfile.slotdir.forked import ordered_map

    return ordered_map(_summarize_list, ((e, e.size) for e in entries), jobs)


def _summarize_list(entries: list[DirEntry]) -> list[FileSummary]:
    return [summarize(e) for e in entries]


def fill_summary(s: FileSummary, sf: Any) -> None:
    s.size = sf.size
    s.format, s.version, s.n_tokens = str(sf.format), sf.version, sf.n_tokens
    body = sf.body
    if body is not None and body.layout is not None:
        s.memory_class = body.memory_class
        _kv_facts(s, body)
    s.checkpoints = len(sf.checkpoints)
    s.draft = sf.draft is not None
    errs = [p for p in sf.file_problems if p.severity == Severity.ERROR]  # the model check is the caller's
    s.damaged = bool(errs)
    s.first_problem = errs[0].line() if errs else None


def _kv_facts(s: FileSummary, body: Any) -> None:
    from slotfile.format.records import MemoryKind
    from slotfile.format.types import type_name

    for blk in body.blocks:
        if blk.kind != MemoryKind.KV:
            continue
        act = blk.active_streams()
        s.active_streams = max(s.active_streams or 0, len(act))
        if s.n_stream is None:
            s.n_stream = blk.n_stream
        for st in act:
            s.kv_cells = max(s.kv_cells or 0, st.cell_count)
            if s.type_k is None and st.k:
                s.type_k = type_name(st.k[0].type_id)
            if s.type_v is None and st.v:
                s.type_v = type_name(st.v[0].type_id)
                s.v_trans = st.v_trans


# ---------------------------------------------------------------------------------------
# sizes and ages on the command line

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_AGES = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_NUM = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """``10G``, ``500M``, ``1.5T``, ``4096`` (bytes; K/M/G/T are powers of 1024, an
    ``iB``/``B`` suffix is allowed).  Raises ValueError with a one-line reason."""
    m = _NUM.match(text)
    unit = m.group(2).lower() if m else ""
    unit = unit[:-2] if unit.endswith("ib") else (unit[:-1] if len(unit) == 2 and unit.endswith("b") else unit)
    if m is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size (examples: 10G, 500M, 4096)")
    return int(float(m.group(1)) * _UNITS[unit])


def parse_age(text: str) -> float:
    """``7d``, ``12h``, ``30m``, ``90s``, ``2w`` (seconds).  Raises ValueError."""
    m = _NUM.match(text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _AGES:
        raise ValueError(f"{text!r} is not an age (examples: 7d, 12h, 30m, 90s)")
    return float(m.group(1)) * _AGES[unit]


def human_age(seconds: float) -> str:
    s = int(seconds)
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s / n:.1f}{unit}"
    return f"{s}s"
