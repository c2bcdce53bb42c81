"""Plans beyond safewrite's ranges and literals: a V matrix written transposed, streamed in
bounded chunks; committing such a plan; and telling whether a plan reproduces its input."""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from slotfile.safewrite import CommitResult, Literal, Plan, Range, Target, commit, write_plan


@dataclass(frozen=True, slots=True)
class Transposed:
    """A ``rows x cols`` matrix of ``itemsize``-byte elements at ``offset`` of ``path``,
    written transposed (``cols x rows``), in bounded chunks at write time."""

    path: str
    offset: int
    rows: int
    cols: int
    itemsize: int

    @property
    def length(self) -> int:
        return self.rows * self.cols * self.itemsize


class TPlan(Plan):
    """A Plan that may hold :class:`Transposed` pieces (``size`` counts them)."""

    def transposed(self, path: str, offset: int, rows: int, cols: int, itemsize: int) -> None:
        if rows and cols:
            self.pieces.append(Transposed(os.fspath(path), offset, rows, cols, itemsize))  # type: ignore[arg-type]


def has_transposed(plan: Plan) -> bool:
    return any(isinstance(p, Transposed) for p in plan.pieces)


def write_with_transposed(plan: Plan, fd: int) -> int:
    """write_plan, extended with :class:`Transposed` pieces."""
    n = 0
    run: list[Any] = []
    for piece in plan.pieces:
        if isinstance(piece, Transposed):
            n += write_plan(Plan(run), fd) if run else 0
            run = []
            n += _write_transposed(piece, fd)
        else:
            run.append(piece)
    return n + (write_plan(Plan(run), fd) if run else 0)


def _write_transposed(t: Transposed, fd: int) -> int:
    dt = {2: "<u2", 4: "<u4", 1: "u1", 8: "<u8"}[t.itemsize]
    with open(t.path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            arr = np.frombuffer(mm, dtype=dt, count=t.rows * t.cols, offset=t.offset).reshape(t.rows, t.cols)
            step = max(1, (8 << 20) // max(1, t.rows * t.itemsize))
            done = 0
            for i in range(0, t.cols, step):
                chunk = np.ascontiguousarray(arr[:, i : i + step].T).tobytes()
                view = memoryview(chunk)
                while view:
                    k = os.write(fd, view)
                    view = view[k:]
                done += len(chunk)
            del arr
            return done
        finally:
            mm.close()


def commit_plan(plan: Plan, target: Target, check: Callable[[str], tuple[bool, str]] | None) -> CommitResult:
    if has_transposed(plan):
        return commit(plan, target, check, writer=write_with_transposed)
    return commit(plan, target, check)


def plan_equals(plan: Plan, path: str, size: int) -> bool:
    """Whether ``plan`` would write exactly the bytes of ``path`` (compared chunk-wise; ranges
    of ``path`` at their own offset are equal by construction)."""
    if plan.size != size:
        return False
    if plan.is_identity(path, size):
        return True
    if has_transposed(plan):
        return False  # a flip always changes bytes
    pos = 0
    with open(path, "rb") as f:
        for piece in plan.pieces:
            same_place = isinstance(piece, Range) and piece.path == path and piece.offset == pos
            if not same_place and not _piece_equals(f, piece, pos):
                return False
            pos += piece.length
    return True


def _piece_equals(f: Any, piece: Range | Literal, pos: int) -> bool:
    left, at = piece.length, pos
    while left:
        k = min(left, 1 << 22)
        f.seek(at)
        mine = f.read(k)
        theirs = piece.data[at - pos : at - pos + k] if isinstance(piece, Literal) else _read(piece, at - pos, k)
        if mine != theirs:
            return False
        at += k
        left -= k
    return True


def _read(piece: Range, off: int, n: int) -> bytes:
    with open(piece.path, "rb") as f:
        f.seek(piece.offset + off)
        return f.read(n)
