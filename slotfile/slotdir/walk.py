"""A ``--slot-save-path`` directory as a whole: which files are slot files, which are still
being written, and what each holds at the structure level (header and layout; no value scan).

llama-server writes a slot file in place under its final name (``llama_state_seq_save_file``
opens it with ``"wb"``, tools/server/server-context.cpp ``SERVER_TASK_TYPE_SLOT_SAVE``), so a
file being written has no telling name: it is recognised by a modification time within the
last ``settle`` seconds.  Temp files of slotfile's own safe writes (``.NAME.slotfile-PID-HEX.*``)
and the usual partial-download names (``*.tmp``, ``*.part``, ``*.partial``) are temp files.
Both are counted apart and never listed, checked, converted or removed.

Symlinks are never followed: a symlinked file or directory under DIR is counted as skipped.
"""

from __future__ import annotations

import os
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SLOT_SUFFIXES = (".slot", ".bin")
MAGICS = (b"qsgg", b"nsgg")
SETTLE_SECONDS = 5.0  # a file modified this recently may still be being written
_SLOTFILE_TEMP = re.compile(r"^\..+\.slotfile-\d+-[0-9a-f]{12}\.[\w-]+$")
_TEMP_SUFFIXES = (".tmp", ".part", ".partial")


@dataclass(slots=True)
class Entry:
    """One regular file under DIR (never a symlink)."""

    path: str
    rel: str  # relative to DIR
    size: int
    mtime: float


@dataclass(slots=True)
class DirScan:
    """What a walk of DIR found, by kind."""

    root: str
    slots: list[Entry] = field(default_factory=list)
    temps: list[Entry] = field(default_factory=list)  # temp names
    busy: list[Entry] = field(default_factory=list)  # modified within ``settle`` seconds
    symlinks: list[str] = field(default_factory=list)  # skipped, never followed
    errors: list[str] = field(default_factory=list)  # per path: could not be read (operational)


def is_temp_name(name: str) -> bool:
    return bool(_SLOTFILE_TEMP.match(name)) or name.endswith(_TEMP_SUFFIXES)


def _has_magic(path: str) -> bool | None:
    """True/False; None when the file cannot be read."""
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


def scan_dir(root: str | os.PathLike[str], settle: float = SETTLE_SECONDS, now: float | None = None) -> DirScan:
    """Walk ``root`` (recursively, sorted, symlinks not followed).  A directory that vanishes
    or cannot be listed mid-walk is an error line; the walk goes on."""
    top = os.fspath(root)
    out = DirScan(top)
    now = time.time() if now is None else now

    def onerror(e: OSError) -> None:
        out.errors.append(f"{e.filename}: {e.strerror or e}")

    for d, dirs, names in os.walk(top, onerror=onerror, followlinks=False):
        for sub in list(dirs):
            if os.path.islink(os.path.join(d, sub)):
                out.symlinks.append(os.path.join(d, sub))
        dirs[:] = sorted(x for x in dirs if not os.path.islink(os.path.join(d, x)))
        for n in sorted(names):
            _classify(out, top, d, n, settle, now)
    return out


def _classify(out: DirScan, top: str, d: str, name: str, settle: float, now: float) -> None:
    p = os.path.join(d, name)
    try:
        st = os.lstat(p)
    except OSError as e:
        out.errors.append(f"{p}: {e.strerror or e}")
        return
    if stat.S_ISLNK(st.st_mode):
        out.symlinks.append(p)
        return
    if not stat.S_ISREG(st.st_mode):
        return
    entry = Entry(p, os.path.relpath(p, top), st.st_size, st.st_mtime)
    if is_temp_name(name):
        out.temps.append(entry)
        return
    if Path(name).suffix.lower() not in SLOT_SUFFIXES:
        magic = _has_magic(p)
        if magic is None:
            out.errors.append(f"{p}: cannot be read")
            return
        if not magic:
            return
    if now - st.st_mtime < settle:
        out.busy.append(entry)
        return
    out.slots.append(entry)


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


def summarize(entry: Entry) -> FileSummary:
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


def fill_summary(s: FileSummary, sf: Any) -> None:
    s.size = sf.size
    s.format, s.version, s.n_tokens = str(sf.format), sf.version, sf.n_tokens
    body = sf.body
    if body is not None and body.layout is not None:
        s.memory_class = body.memory_class
        _kv_facts(s, body)
    s.checkpoints = len(sf.checkpoints)
    s.draft = sf.draft is not None
    errs = [p for p in sf.file_problems if p.severity == "error"]  # the model check is the caller's
    s.damaged = bool(errs)
    s.first_problem = errs[0].line() if errs else None


def _kv_facts(s: FileSummary, body: Any) -> None:
    from slotfile.format.types import type_name

    for blk in body.blocks:
        if blk.kind != "KV":
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
