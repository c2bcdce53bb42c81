"""The manifest of a sealed slot store (schema ``slotfile.manifest/1``), after PostgreSQL's
``backup_manifest``: one entry per file with its size and checksum, the manifest's own
checksum at its end, paths relative to the manifest's directory.

Reading a manifest (:func:`load`) refuses, with one line, anything but what :func:`render`
writes: not JSON, another schema or version, a wrong own checksum, duplicate entries, absolute
paths or paths that leave the directory, entries that are symlinks on disk.  Nothing is ever
modified by reading.

The checksum of every file (:func:`file_checksum`) runs over a read-only mapping in
:data:`CHUNK`-byte pieces, so no byte is copied into Python; hashlib releases the GIL for each
piece, so ``jobs`` files hash at once.  SHA-256 (:data:`ALGORITHM`): on x86 CPUs with the SHA
extensions OpenSSL's SHA-256 is the fastest of hashlib's cryptographic hashes (bench/seal.py
measures it against BLAKE2b, SHA-1, SHA-512 and ``sha256sum`` on the same files).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import stat
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np  # imported where tokens are digested: ls DIR asks find_manifest without numpy

SCHEMA = "slotfile.manifest/1"
DEFAULT_NAME = "slotfile-manifest.json"  # in the sealed directory; JSON, never a slot file
ALGORITHM = "sha256"
ALGORITHMS = ("sha256", "blake2b", "sha512", "sha1")  # what a manifest may name
CHUNK = 1 << 24  # bytes handed to hashlib at a time
HASH_THREADS = min(4, os.cpu_count() or 1)  # files hashed at once (hashlib releases the GIL)
CHECKSUM_KEY = "manifest_checksum"
_CHECKSUM_LINE = re.compile(rb'\n *"manifest_checksum": "(?:sha256:)?[0-9a-f]*"\n}\n?\Z')


class ManifestError(Exception):
    """The manifest cannot be used; the message is one line naming the manifest and the cause."""


# --------------------------------------------------------------------------------------- checksums


def file_checksum(path: str | os.PathLike[str], algorithm: str = ALGORITHM) -> tuple[str, int]:
    """(hex digest, size) of a file's bytes, read through a read-only mapping."""
    h = hashlib.new(algorithm)
    fd = os.open(os.fspath(path), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return h.hexdigest(), 0
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as m:
            if hasattr(m, "madvise"):
                m.madvise(mmap.MADV_SEQUENTIAL)
            mv = memoryview(m)
            try:
                for i in range(0, size, CHUNK):
                    h.update(mv[i : i + CHUNK])
            finally:
                mv.release()
    finally:
        os.close(fd)
    return h.hexdigest(), size


def tokens_digest(tokens: np.ndarray | None) -> str | None:
    """BLAKE2b-128 of the token ids as little-endian u32 (None: the file holds no token list)."""
    import numpy as np

    if tokens is None:
        return None
    arr = np.ascontiguousarray(np.asarray(tokens, dtype="<u4"))
    return hashlib.blake2b(arr.tobytes(), digest_size=16).hexdigest()


# --------------------------------------------------------------------------------------- entries


@dataclass
class Entry:
    """One sealed file."""

    path: str  # relative to the manifest's directory, '/'-separated
    size: int
    mtime_ns: int
    checksum: str
    algorithm: str = ALGORITHM
    format: str | None = None
    version: int | None = None
    n_tokens: int | None = None
    tokens_digest: str | None = None
    memory_class: str | None = None
    cache_types: dict[str, dict[str, str]] = field(default_factory=dict)
    model: str | None = None  # fingerprint value of the model it was verified with
    draft_model: str | None = None
    levels: dict[str, str] = field(default_factory=dict)  # verify level -> pass|fail|skipped
    passed: list[str] = field(default_factory=list)  # the levels that passed at sealing
    forced: bool = False  # sealed although a level failed (--force)
    first_problem: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "size": self.size,
            "mtime": datetime.fromtimestamp(self.mtime_ns / 1e9, UTC).isoformat(timespec="microseconds"),
            "mtime_ns": self.mtime_ns,
            "checksum": self.checksum,
            "algorithm": self.algorithm,
            "format": self.format,
            "version": self.version,
            "n_tokens": self.n_tokens,
            "tokens_digest": self.tokens_digest,
            "memory_class": self.memory_class,
            "cache_types": self.cache_types,
            "model": self.model,
            "draft_model": self.draft_model,
            "levels": self.levels,
            "passed": self.passed,
            "forced": self.forced,
            "first_problem": self.first_problem,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str) -> Entry:
        try:
            e = cls(
                path=_str(d["path"]),
                size=_int(d["size"]),
                mtime_ns=_int(d["mtime_ns"]),
                checksum=_str(d["checksum"]),
                algorithm=_str(d["algorithm"]),
                format=_opt_str(d.get("format")),
                version=d.get("version"),
                n_tokens=d.get("n_tokens"),
                tokens_digest=_opt_str(d.get("tokens_digest")),
                memory_class=_opt_str(d.get("memory_class")),
                cache_types=dict(d.get("cache_types") or {}),
                model=_opt_str(d.get("model")),
                draft_model=_opt_str(d.get("draft_model")),
                levels=dict(d.get("levels") or {}),
                passed=list(d.get("passed") or []),
                forced=bool(d.get("forced", False)),
                first_problem=_opt_str(d.get("first_problem")),
            )
        except KeyError as k:
            raise ManifestError(f"{where}: field {k} is missing") from None
        except (TypeError, ValueError) as x:
            raise ManifestError(f"{where}: {x}") from None
        if e.algorithm not in ALGORITHMS:
            raise ManifestError(f"{where}: unknown checksum algorithm {e.algorithm!r} (known: {', '.join(ALGORITHMS)})")
        if not re.fullmatch(r"[0-9a-f]+", e.checksum):
            raise ManifestError(f"{where}: checksum is not a hex digest")
        return e


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError(f"expected a string, got {type(v).__name__}")
    return v


def _int(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 1 << 63:
        raise TypeError(f"expected a non-negative 64-bit integer, got {v!r}")
    return v


def _opt_str(v: Any) -> str | None:
    if v is not None and not isinstance(v, str):
        raise TypeError(f"expected a string or null, got {type(v).__name__}")
    return v


def cache_types(sf: Any) -> dict[str, dict[str, str]]:
    """Per memory block (role): the type of each of its parts (K, V, R, S), '+'-joined when
    layers differ."""
    out: dict[str, dict[str, str]] = {}
    body = getattr(sf, "body", None)
    if body is None:
        return out
    for blk in body.blocks:
        parts: dict[str, list[str]] = {}
        for s in blk.streams:
            for name, runs in (("k", s.k), ("v", s.v)):
                for r in runs:
                    parts.setdefault(name, []).append(r.type_name)
        for name, runs in (("r", blk.r), ("s", blk.s)):
            for r in runs:
                parts.setdefault(name, []).append(r.type_name)
        out[blk.role] = {k: "+".join(dict.fromkeys(v)) for k, v in parts.items()}
    return out


# --------------------------------------------------------------------------------------- manifest


@dataclass
class Manifest:
    entries: list[Entry] = field(default_factory=list)
    models: dict[str, dict[str, Any]] = field(default_factory=dict)  # fingerprint value -> description
    created: str = ""
    generator: str = ""
    path: str | None = None  # where it was read from / will be written

    @property
    def directory(self) -> Path:
        assert self.path is not None
        return Path(self.path).resolve().parent

    def by_path(self) -> dict[str, Entry]:
        return {e.path: e for e in self.entries}

    def to_obj(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "generator": self.generator,
            "created": self.created,
            "algorithm": ALGORITHM,
            "models": self.models,
            "files": [e.to_dict() for e in sorted(self.entries, key=lambda e: e.path)],
        }


def render(m: Manifest) -> bytes:
    """The manifest's bytes: JSON whose last member is its own checksum, the SHA-256 of every
    byte before the line that holds it (as ``backup_manifest``'s ``Manifest-Checksum``)."""
    body = json.dumps(m.to_obj(), indent=1, ensure_ascii=True)
    assert body.endswith("\n}")
    prefix = (body[:-2] + ",\n").encode()
    digest = hashlib.sha256(prefix).hexdigest()
    return prefix + f' "{CHECKSUM_KEY}": "sha256:{digest}"\n}}\n'.encode()


def load(path: str | os.PathLike[str]) -> Manifest:
    """Read and check a manifest; raises ManifestError (one line) for anything wrong with it."""
    p = os.fspath(path)
    try:
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode):
            raise ManifestError(f"{p}: the manifest is a symlink (never followed)")
        if not stat.S_ISREG(st.st_mode):
            raise ManifestError(f"{p}: not a regular file")
        with open(p, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ManifestError(f"{p}: {e.strerror or e}") from None
    return parse(raw, p)


def parse(raw: bytes, where: str) -> Manifest:
    try:
        obj = json.loads(raw, object_pairs_hook=_no_duplicate_keys)
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestError(f"{where}: not a JSON manifest ({e})") from None
    if not isinstance(obj, dict):
        raise ManifestError(f"{where}: not a JSON manifest (a {type(obj).__name__}, not an object)")
    schema = obj.get("schema")
    if schema != SCHEMA:
        raise ManifestError(f"{where}: schema {schema!r}, slotfile reads {SCHEMA!r}")
    if list(obj)[-1] != CHECKSUM_KEY:
        raise ManifestError(f"{where}: the manifest does not end with its checksum ({CHECKSUM_KEY!r})")
    m = _CHECKSUM_LINE.search(raw)
    if m is None:
        raise ManifestError(f"{where}: the checksum line is not the manifest's last line")
    want = str(obj[CHECKSUM_KEY]).removeprefix("sha256:")
    got = hashlib.sha256(raw[: m.start() + 1]).hexdigest()
    if got != want:
        raise ManifestError(f"{where}: manifest checksum mismatch (recorded {want[:16]}..., computed {got[:16]}...)")
    files = obj.get("files")
    if not isinstance(files, list):
        raise ManifestError(f"{where}: 'files' is not a list")
    entries: list[Entry] = []
    seen: dict[str, int] = {}
    for i, d in enumerate(files):
        if not isinstance(d, dict):
            raise ManifestError(f"{where}: files[{i}] is not an object")
        ent = Entry.from_dict(d, f"{where}: files[{i}]")
        bad = bad_relative_path(ent.path)
        if bad:
            raise ManifestError(f"{where}: files[{i}] path {ent.path!r} {bad}")
        if ent.path in seen:
            raise ManifestError(
                f"{where}: files[{i}] path {ent.path!r} is listed twice (first as files[{seen[ent.path]}])"
            )
        seen[ent.path] = i
        entries.append(ent)
    models = obj.get("models") or {}
    if not isinstance(models, dict) or not all(isinstance(v, dict) for v in models.values()):
        raise ManifestError(f"{where}: 'models' is not an object of objects")
    man = Manifest(entries, models, str(obj.get("created", "")), str(obj.get("generator", "")), where)
    directory = man.directory
    for i, ent in enumerate(entries):
        if os.path.islink(directory / ent.path):
            raise ManifestError(f"{where}: files[{i}] {ent.path!r} is a symlink on disk (never followed)")
        for parent in PurePosixPath(ent.path).parents:
            if str(parent) != "." and os.path.islink(directory / str(parent)):
                raise ManifestError(f"{where}: files[{i}] {ent.path!r} lies under a symlink ({parent})")
    return man


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d: dict[str, Any] = {}
    for k, v in pairs:
        if k in d:
            raise ValueError(f"duplicate key {k!r}")
        d[k] = v
    return d


def bad_relative_path(rel: str) -> str | None:
    """Why ``rel`` is no path inside the manifest's directory (None when it is one)."""
    if not rel:
        return "is empty"
    if "\\" in rel or "\0" in rel:
        return "holds a backslash or NUL"
    if rel.startswith("/") or re.match(r"^[A-Za-z]:", rel):
        return "is absolute"
    parts = rel.split("/")
    if ".." in parts:
        return "leaves the directory ('..')"
    if any(p in ("", ".") for p in parts):
        return "is not normalised"
    return None


def relative_to(directory: Path, file: Path) -> str:
    """``file`` relative to ``directory`` ('/'-separated); ValueError when it is not under it."""
    rel = Path(os.path.abspath(file)).relative_to(Path(os.path.abspath(directory)))
    return rel.as_posix()


def collect_slot_files(args: list[Path]) -> tuple[list[Path], list[str]]:
    """The files ``verify`` takes, by the walker of ``ls``, ``prune`` and ``verify``
    (:func:`slotfile.slotdir.walk.scan_dir`): a file argument as is; under a directory every
    regular file (recursively, sorted, symlinks not followed) named ``*.slot`` / ``*.bin`` or
    starting with a GGSQ/GGSN magic, temp files set aside; nothing waits for files being
    written (a file that changes while it is hashed is refused).  Also the errors for paths
    that do not exist and directories without slot files."""
    from slotfile.slotdir.walk import scan_dir

    files: list[Path] = []
    errors: list[str] = []
    for a in args:
        if a.is_dir():
            scan = scan_dir(a, settle=0.0)
            errors += scan.errors
            found = sorted(Path(e.path) for e in scan.slots + scan.busy)
            if not found and not scan.errors:
                errors.append(f"no slot files found under {a}")
            files += found
        elif a.exists():
            files.append(a)
        else:
            errors.append(f"{a}: no such file or directory")
    return files, errors


def find_manifest(directory: str | os.PathLike[str]) -> Path | None:
    """The manifest a directory holds under the default name (None: not sealed)."""
    p = Path(directory) / DEFAULT_NAME
    return p if os.path.lexists(p) else None


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
