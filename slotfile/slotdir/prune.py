"""Plan (and, asked to, carry out) the removal of slot files to keep a directory within a quota.

Rules, each an upper bound; a file goes when any rule wants it gone:

* ``damaged``: every damaged file (it cannot restore), listed first;
* ``older_than``: every file last modified longer ago than this;
* ``keep``: at most this many files, the newest kept;
* ``max_total``: then the oldest files until what is left takes at most this many bytes
  (temp files and files being written count towards it, and are never removed).

Never touched: temp files and files modified within the last ``settle`` seconds (a server
may be writing them: llama-server writes in place), symlinks, anything outside DIR.  A
removal re-checks the file first (still a regular file, same size and modification time as
planned) and unlinks it through directory descriptors opened with ``O_NOFOLLOW`` from DIR
down, so a directory swapped for a symlink meanwhile is never followed.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from dataclasses import dataclass, field
from typing import Any

from slotfile.slotdir.walk import DirEntry, DirScan, FileSummary

SCHEMA = "slotfile.prune/1"


@dataclass(slots=True)
class Removal:
    entry: DirEntry
    why: str
    rule: str = ""  # the rule that wants it gone: damaged, older-than, keep, max-total
    done: bool = False
    error: str | None = None

    def to_dict(self, now: float) -> dict[str, Any]:
        return {
            "path": self.entry.path,
            "rel": self.entry.rel,
            "size": self.entry.size,
            "age_s": round(now - self.entry.mtime, 1),
            "rule": self.rule,
            "why": self.why,
            "removed": self.done,
            "error": self.error,
        }


@dataclass(slots=True)
class PrunePlan:
    remove: list[Removal] = field(default_factory=list)
    total_before: int = 0  # bytes of the slot files considered
    total_after: int = 0
    untouchable: int = 0  # bytes of temp files and files being written (counted, never removed)
    quota_met: bool = True
    note: str = ""


def plan_prune(
    scan: DirScan,
    summaries: dict[str, FileSummary] | None,
    *,
    now: float,
    max_total: int | None = None,
    older_than: float | None = None,
    keep: int | None = None,
    damaged: bool = False,
) -> PrunePlan:
    """``summaries``: path -> structure summary (needed for ``damaged``)."""
    files = sorted(scan.slots, key=lambda e: (e.mtime, e.rel))  # oldest first
    plan = PrunePlan(
        total_before=sum(e.size for e in files),
        untouchable=sum(e.size for e in scan.temps) + sum(e.size for e in scan.busy),
    )
    gone: dict[str, tuple[str, str]] = {}  # path -> (rule, why)
    if damaged and summaries is not None:
        for e in files:
            s = summaries.get(e.path)
            if s is not None and s.damaged:
                gone[e.path] = ("damaged", f"damaged: {s.first_problem}")
    if older_than is not None:
        for e in files:
            if e.path not in gone and now - e.mtime > older_than:
                gone[e.path] = ("older-than", f"older than {_age(older_than)} ({_age(now - e.mtime)})")
    if keep is not None:
        left = [e for e in files if e.path not in gone]
        for e in left[: max(0, len(left) - keep)]:
            gone[e.path] = (
                "keep",
                {0: "--keep 0", 1: "not the newest file"}.get(keep, f"beyond the {keep} newest files"),
            )
    if max_total is not None:
        # the quota is the directory's: temp files and files being written count, never go
        total = sum(e.size for e in files if e.path not in gone) + plan.untouchable
        for e in files:
            if total <= max_total:
                break
            if e.path not in gone:
                gone[e.path] = ("max-total", f"oldest while the total exceeds {max_total} bytes")
                total -= e.size
        plan.quota_met = total <= max_total
        if not plan.quota_met:
            plan.note = f"the files that may be removed do not free enough: {total} bytes remain"
    order = [e for e in files if e.path in gone and gone[e.path][0] == "damaged"]
    order += [e for e in files if e.path in gone and gone[e.path][0] != "damaged"]
    plan.remove = [Removal(e, gone[e.path][1], gone[e.path][0]) for e in order]
    plan.total_after = plan.total_before - sum(r.entry.size for r in plan.remove)
    return plan


def _age(seconds: float) -> str:
    from slotfile.slotdir.walk import human_age

    return human_age(seconds)


def carry_out(plan: PrunePlan, root: str, settle: float) -> None:
    """Remove the planned files; each outcome goes into its Removal (``done`` / ``error``)."""
    for r in plan.remove:
        try:
            _remove(root, r.entry, settle)
            r.done = True
        except OSError as e:
            r.error = e.strerror or str(e)
        except _Changed as e:
            r.error = str(e)


class _Changed(Exception):
    """The file is not what was planned any more: left alone."""


def _remove(root: str, e: DirEntry, settle: float) -> None:
    parts = e.rel.split(os.sep)
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(root, flags)
    try:
        for part in parts[:-1]:
            nfd = os.open(part, flags, dir_fd=fd)  # ELOOP for a symlink: never followed
            os.close(fd)
            fd = nfd
        st = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            raise _Changed("no longer a regular file")
        if st.st_size != e.size or st.st_mtime != e.mtime:
            raise _Changed("changed since it was planned (a server may be writing it)")
        if time.time() - st.st_mtime < settle:
            raise _Changed("modified within the last seconds")
        os.unlink(parts[-1], dir_fd=fd)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR):  # O_NOFOLLOW | O_DIRECTORY on a symlink
            raise OSError(
                err.errno, "a directory on its path is no longer a directory (a symlink?): not followed"
            ) from None
        raise
    finally:
        os.close(fd)
    fsync_parent = os.path.dirname(e.path) or "."
    from slotfile.safewrite import fsync_dir

    fsync_dir(fsync_parent)
