"""The one write path of every command that writes a file.

A repair is described as a :class:`Plan`: a list of pieces, each either a byte range of a
source file (the input, or a file a llama.cpp worker wrote) or a few literal bytes (a
rewritten count, a zeroed length).  :func:`commit` then

* refuses an existing OUT unless ``force``; refuses ``in_place`` on a symlink; keeps a
  backup (``IN.bak`` or a given path) before an in-place replace;
* writes the pieces into a dot-prefixed, uniquely named temp file in the target directory,
  copying byte ranges with ``os.copy_file_range`` (or ``os.sendfile``, or a plain chunked
  copy) so no large region passes through Python and the file is never built in memory;
* fsyncs it, runs the caller's ``check`` on it (structural re-read, test-load through
  llama.cpp), and deletes it again when the check fails;
* moves it into place (no-clobber link without ``force``, ``os.replace`` with it) and fsyncs
  the directory.

The input is only ever opened read-only.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import BinaryIO

CHUNK = 1 << 24  # bytes per copy_file_range / sendfile call


class WriteRefused(Exception):
    """A safety rule stops the write (existing output, symlink, same file): a usage problem."""


class CheckFailed(Exception):
    """The written temp file failed the caller's check; nothing was written."""


# --------------------------------------------------------------------------------------- plan


@dataclass(frozen=True, slots=True)
class Range:
    """``length`` bytes of ``path`` from ``offset``."""

    path: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class Literal:
    data: bytes

    @property
    def length(self) -> int:
        return len(self.data)


@dataclass(slots=True)
class Plan:
    pieces: list[Range | Literal] = field(default_factory=list)

    def copy(self, path: str | os.PathLike[str], offset: int, length: int) -> None:
        if length < 0:
            raise ValueError(f"negative range length {length}")
        if length == 0:
            return
        p = os.fspath(path)
        last = self.pieces[-1] if self.pieces else None
        if isinstance(last, Range) and last.path == p and last.offset + last.length == offset:
            self.pieces[-1] = Range(p, last.offset, last.length + length)  # merge adjacent ranges
        else:
            self.pieces.append(Range(p, offset, length))

    def literal(self, data: bytes) -> None:
        if data:
            self.pieces.append(Literal(bytes(data)))

    @property
    def size(self) -> int:
        return sum(p.length for p in self.pieces)

    def is_identity(self, path: str | os.PathLike[str], size: int) -> bool:
        """True when the plan copies ``path`` whole, unchanged."""
        p = os.fspath(path)
        return (
            len(self.pieces) == 1
            and isinstance(self.pieces[0], Range)
            and self.pieces[0].path == p
            and self.pieces[0].offset == 0
            and self.pieces[0].length == size
        ) or (size == 0 and not self.pieces)

    def read_range(self, start: int, length: int) -> bytes:
        """Bytes ``start .. start+length`` of the planned output (small reads: checks and tests)."""
        out = bytearray()
        pos = 0
        for piece in self.pieces:
            lo, hi = max(start, pos), min(start + length, pos + piece.length)
            if lo < hi:
                if isinstance(piece, Literal):
                    out += piece.data[lo - pos : hi - pos]
                else:
                    with open(piece.path, "rb") as f:
                        f.seek(piece.offset + lo - pos)
                        out += f.read(hi - lo)
            pos += piece.length
        return bytes(out)


# --------------------------------------------------------------------------------------- copies


def copy_range(src_fd: int, dst_fd: int, offset: int, length: int) -> int:
    """Copy ``length`` bytes of ``src_fd`` from ``offset`` to the current position of ``dst_fd``.

    Zero-copy where the kernel allows (``copy_file_range``, then ``sendfile``), otherwise a
    chunked read/write.  Returns the number of bytes copied; raises on a short source.
    """
    done = 0
    mode = "cfr" if hasattr(os, "copy_file_range") else ("sendfile" if hasattr(os, "sendfile") else "plain")
    while done < length:
        n = min(CHUNK, length - done)
        try:
            if mode == "cfr":
                # with offset_src given and offset_dst None the destination position advances
                got = os.copy_file_range(src_fd, dst_fd, n, offset + done)
            elif mode == "sendfile":
                got = os.sendfile(dst_fd, src_fd, offset + done, n)
            else:
                got = _plain_copy(src_fd, dst_fd, offset + done, n)
        except OSError as e:
            if mode != "plain" and e.errno in (
                errno.EXDEV,
                errno.EINVAL,
                errno.ENOSYS,
                errno.EOPNOTSUPP,
                errno.EBADF,
                errno.ETXTBSY,
                errno.EPERM,
            ):
                mode = "sendfile" if mode == "cfr" and hasattr(os, "sendfile") else "plain"
                continue
            raise
        if got == 0:
            raise OSError(errno.EIO, f"source ended {length - done} bytes early (offset {offset + done})")
        done += got
    return done


def _plain_copy(src_fd: int, dst_fd: int, offset: int, n: int) -> int:
    with os.fdopen(os.dup(src_fd), "rb") as src, os.fdopen(os.dup(dst_fd), "wb", buffering=0) as dst:
        src.seek(offset)
        reader = _Limited(src, n)
        shutil.copyfileobj(reader, dst, 1 << 20)
        return reader.done


class _Limited:
    def __init__(self, f: BinaryIO, n: int) -> None:
        self.f, self.left, self.done = f, n, 0

    def read(self, size: int = -1) -> bytes:
        size = self.left if size < 0 else min(size, self.left)
        data = self.f.read(size)
        self.left -= len(data)
        self.done += len(data)
        return data


def write_plan(plan: Plan, fd: int) -> int:
    """Write every piece of ``plan`` at the current position of ``fd``."""
    fds: dict[str, int] = {}
    n = 0
    try:
        for piece in plan.pieces:
            if isinstance(piece, Literal):
                view = memoryview(piece.data)
                while view:
                    k = os.write(fd, view)
                    view = view[k:]
                n += piece.length
                continue
            src = fds.get(piece.path)
            if src is None:
                src = fds[piece.path] = os.open(piece.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            n += copy_range(src, fd, piece.offset, piece.length)
    finally:
        for src in fds.values():
            os.close(src)
    return n


# --------------------------------------------------------------------------------------- temp files


def temp_path(directory: str | os.PathLike[str], name: str, suffix: str = ".tmp") -> str:
    """A fresh dot-prefixed name in ``directory`` (the file is not created)."""
    return os.path.join(os.fspath(directory), f".{name}.slotfile-{os.getpid()}-{secrets.token_hex(6)}{suffix}")


def create_temp(
    directory: str | os.PathLike[str], name: str, suffix: str = ".tmp", mode: int = 0o600
) -> tuple[str, int]:
    """Create (O_EXCL) and open a dot-prefixed unique temp file; returns (path, fd)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    for _ in range(16):
        path = temp_path(directory, name, suffix)
        try:
            return path, os.open(path, flags, mode)
        except FileExistsError:
            continue
    raise OSError(errno.EEXIST, f"could not create a unique temp file in {directory}")


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    try:
        fd = os.open(os.fspath(directory), os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def unlink_quiet(path: str | None) -> None:
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


# --------------------------------------------------------------------------------------- targets


@dataclass(slots=True)
class Target:
    """Where a command writes: resolved and checked before any work is done."""

    input: str
    output: str  # the final path (== input for --in-place)
    in_place: bool = False
    backup: str | None = None
    force: bool = False

    @property
    def directory(self) -> str:
        return os.path.dirname(os.path.abspath(self.output)) or "."


def resolve_target(
    input_path: str | os.PathLike[str],
    output: str | os.PathLike[str] | None,
    *,
    in_place: bool = False,
    backup: str | os.PathLike[str] | None = None,
    force: bool = False,
) -> Target:
    """Apply the safety rules; raises :class:`WriteRefused` with a one-line reason."""
    inp = os.fspath(input_path)
    if in_place and output is not None:
        raise WriteRefused("give either -o OUT or --in-place, not both")
    if not in_place and output is None:
        raise WriteRefused("an output is needed: -o OUT (or --in-place with a kept backup)")
    if backup is not None and not in_place:
        raise WriteRefused("--backup only goes with --in-place")
    if in_place:
        st = os.lstat(inp)
        if stat.S_ISLNK(st.st_mode):
            raise WriteRefused(f"{inp} is a symlink: --in-place never follows one (write with -o instead)")
        if not stat.S_ISREG(st.st_mode):
            raise WriteRefused(f"{inp} is not a regular file")
        bak = os.fspath(backup) if backup is not None else inp + ".bak"
        if os.path.lexists(bak):
            if not force:
                raise WriteRefused(f"backup {bak} exists (pass --force to overwrite it)")
            if stat.S_ISDIR(os.lstat(bak).st_mode):
                raise WriteRefused(f"backup {bak} is a directory")
        if _same(bak, inp):
            raise WriteRefused("the backup cannot be the input itself")
        return Target(inp, inp, True, bak, force)
    out = os.fspath(output)  # type: ignore[arg-type]
    if os.path.islink(out):
        raise WriteRefused(f"{out} is a symlink: slotfile neither writes through nor replaces one")
    if os.path.lexists(out):
        if os.path.isdir(out) and not os.path.islink(out):
            raise WriteRefused(f"{out} is a directory")
        if _same(out, inp):
            raise WriteRefused(f"{out} is the input file (use --in-place, which keeps a backup)")
        if not force:
            raise WriteRefused(f"{out} exists (pass --force to replace it)")
    parent = os.path.dirname(os.path.abspath(out)) or "."
    if not os.path.isdir(parent):
        raise WriteRefused(f"directory {parent} does not exist")
    _writable(parent)
    return Target(inp, out, False, None, force)


def _writable(directory: str) -> None:
    """Refuse a directory no temp file can be created in (read-only mount, no permission),
    before anything is planned: a dry run is refused the same way as the write would be."""
    why = None
    try:
        if os.statvfs(directory).f_flag & os.ST_RDONLY:
            why = errno.EROFS
    except OSError:
        pass
    if why is None and not os.access(directory, os.W_OK | os.X_OK):
        why = errno.EACCES
    if why is not None:
        raise WriteRefused(f"cannot write in {directory}: {os.strerror(why)}")


def _same(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


# --------------------------------------------------------------------------------------- commit


@dataclass(slots=True)
class CommitResult:
    output: str
    size: int
    backup: str | None = None
    written: bool = True
    cleaned: list[str] = field(default_factory=list)  # stale temps of killed runs, removed


_TEMP_RE = re.compile(r"^\.(?P<name>.+)\.slotfile-(?P<pid>\d+)-[0-9a-f]{12}\.(tmp|bak-tmp)$")


def clean_stale_temps(directory: str | os.PathLike[str], name: str) -> list[str]:
    """Remove the temp files an earlier, killed run left for ``name`` in ``directory``.

    Only files of our own naming scheme whose writing process no longer exists are touched
    (a live pid may be a concurrent run); returns the paths removed."""
    removed: list[str] = []
    try:
        entries = os.listdir(directory)
    except OSError:
        return removed
    for entry in entries:
        m = _TEMP_RE.match(entry)
        if m is None or m.group("name") != name:
            continue
        pid = int(m.group("pid"))
        if pid == os.getpid() or _alive(pid):
            continue
        path = os.path.join(os.fspath(directory), entry)
        try:
            if stat.S_ISREG(os.lstat(path).st_mode):
                os.unlink(path)
                removed.append(path)
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def commit(
    plan: Plan,
    target: Target,
    check: Callable[[str], tuple[bool, str]] | None = None,
    *,
    mode: int | None = None,
    writer: Callable[[Plan, int], int] | None = None,
) -> CommitResult:
    """Write ``plan`` to ``target`` through a checked temp file; see the module docstring.

    ``check(temp_path) -> (ok, reason)`` runs on the complete, fsynced temp file; when it
    fails the temp file is removed and :class:`CheckFailed` carries the reason.
    """
    if mode is None:
        try:
            mode = stat.S_IMODE(os.stat(target.input).st_mode) if target.in_place else _default_mode()
        except OSError:
            mode = _default_mode()
    cleaned = clean_stale_temps(target.directory, os.path.basename(target.output))
    try:
        tmp, fd = create_temp(target.directory, os.path.basename(target.output))
    except OSError as e:
        if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise WriteRefused(f"cannot write in {target.directory}: {e.strerror}") from None
        raise
    try:
        try:
            n = (writer or write_plan)(plan, fd)
            os.fchmod(fd, mode)
            os.fsync(fd)
        finally:
            os.close(fd)
        if n != plan.size or os.path.getsize(tmp) != plan.size:
            raise OSError(errno.EIO, f"wrote {n} bytes where {plan.size} were planned")
        if check is not None:
            ok, reason = check(tmp)
            if not ok:
                raise CheckFailed(reason)
        if target.in_place:
            _keep_backup(target)
            os.replace(tmp, target.output)
        elif target.force:
            os.replace(tmp, target.output)
        else:
            try:
                os.link(tmp, target.output)  # no-clobber: fails if OUT appeared meanwhile
            except FileExistsError:
                raise WriteRefused(f"{target.output} appeared while writing (pass --force to replace it)") from None
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOTSUP):
                    raise
                if os.path.lexists(target.output):
                    raise WriteRefused(f"{target.output} appeared while writing") from None
                os.replace(tmp, target.output)  # a file system without hard links
            unlink_quiet(tmp)
        tmp = ""
        fsync_dir(target.directory)
        return CommitResult(target.output, plan.size, target.backup, cleaned=cleaned)
    finally:
        unlink_quiet(tmp)


def _default_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _keep_backup(target: Target) -> None:
    """Preserve the input as the backup before it is replaced.

    A hard link keeps the very inode of the input (nothing copied, the input is untouched);
    across file systems the input is copied to a temp file beside the backup first.
    """
    bak = target.backup
    assert bak is not None
    bdir = os.path.dirname(os.path.abspath(bak)) or "."
    tmp = temp_path(bdir, os.path.basename(bak), ".bak-tmp")
    try:
        os.link(target.input, tmp)
    except OSError:
        tmp2, fd = create_temp(bdir, os.path.basename(bak), ".bak-tmp")
        tmp = tmp2
        try:
            size = os.path.getsize(target.input)
            with open(target.input, "rb") as src:
                copy_range(src.fileno(), fd, 0, size)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            unlink_quiet(tmp)
            raise
        os.close(fd)
        shutil.copystat(target.input, tmp)
    try:
        if os.path.lexists(bak) and not target.force:
            raise WriteRefused(f"backup {bak} appeared while writing")
        os.replace(tmp, bak)
    except BaseException:
        unlink_quiet(tmp)
        raise
    fsync_dir(bdir)


def describe_plan(plan: Plan) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    pos = 0
    for piece in plan.pieces:
        if isinstance(piece, Range):
            out.append({"out_offset": pos, "length": piece.length, "from": piece.path, "offset": piece.offset})
        else:
            out.append(
                {
                    "out_offset": pos,
                    "length": piece.length,
                    "literal": piece.data.hex() if piece.length <= 64 else f"{piece.length} bytes",
                }
            )
        pos += piece.length
    return out
