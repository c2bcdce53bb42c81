"""Check a slot store against its manifest (``verify --manifest``), after ``pg_verifybackup``:
no model, no server; it keeps going and names every file.

Per file, one status:

* ``ok``: size and checksum as sealed (a new mtime alone is noted, not failed);
* ``missing``: in the manifest, not on disk;
* ``extra``: a slot file on disk that the manifest does not list;
* ``changed``: another size or checksum; the message says whether the token ids changed too
  (the token digest) or only the state bytes;
* ``model-mismatch``: sealed with another model than the ``--model`` given (fingerprints).

A renamed file is therefore ``missing`` under its old name and ``extra`` under the new one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from slotfile.seal.fingerprint import Fingerprint
from slotfile.seal.manifest import (
    HASH_THREADS,
    Entry,
    Manifest,
    collect_slot_files,
    file_checksum,
    relative_to,
    tokens_digest,
)


class Status(StrEnum):
    OK = "ok"
    MISSING = "missing"
    EXTRA = "extra"
    CHANGED = "changed"
    MODEL_MISMATCH = "model-mismatch"
    UNREADABLE = "unreadable"


# problem codes (verify --json lists them with the class "damaged", "mismatch" or "cannot-check")
CODES = {
    Status.MISSING: "manifest-missing",
    Status.EXTRA: "manifest-extra",
    Status.CHANGED: "manifest-changed",
    Status.MODEL_MISMATCH: "manifest-model",
    Status.UNREADABLE: "manifest-unreadable",
}


@dataclass
class FileCheck:
    path: str  # relative to the manifest's directory
    status: Status
    messages: list[str] = field(default_factory=list)
    entry: Entry | None = None
    size: int | None = None
    checksum: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == Status.OK

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "status": str(self.status),
            "code": CODES.get(self.status),
            "messages": self.messages,
            "sealed": self.entry is not None,
            "size": self.size,
            "checksum": self.checksum,
        }


@dataclass
class CheckResult:
    manifest: str
    files: list[FileCheck] = field(default_factory=list)
    bytes_hashed: int = 0
    seconds: float = 0.0

    @property
    def failed(self) -> list[FileCheck]:
        return [f for f in self.files if not f.ok]

    def counts(self) -> dict[str, int]:
        out = {str(s): 0 for s in Status}
        for f in self.files:
            out[str(f.status)] += 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "manifest": self.manifest,
            "files": [f.to_dict() for f in self.files],
            "counts": self.counts(),
            "bytes_hashed": self.bytes_hashed,
            "seconds": round(self.seconds, 4),
        }


def _compare(f: Path, e: Entry) -> FileCheck:
    fc = FileCheck(e.path, Status.OK, entry=e)
    try:
        st = os.stat(f, follow_symlinks=False)
        digest, size = file_checksum(f, e.algorithm)
    except FileNotFoundError:
        fc.status = Status.MISSING
        fc.messages.append("sealed, not on disk")
        return fc
    except OSError as x:
        fc.status = Status.UNREADABLE
        fc.messages.append(f"cannot be read: {x.strerror or x}")
        return fc
    fc.size, fc.checksum = size, digest
    if size != e.size or digest != e.checksum:
        fc.status = Status.CHANGED
        what = []
        if size != e.size:
            what.append(f"size {size} bytes, sealed {e.size}")
        if digest != e.checksum:
            what.append(f"{e.algorithm} {digest[:12]}..., sealed {e.checksum[:12]}...")
        fc.messages.append("changed since sealing: " + "; ".join(what))
        fc.messages.append(_tokens_note(f, e))
    elif st.st_mtime_ns != e.mtime_ns:
        fc.messages.append("modification time changed, bytes as sealed")
    return fc


def _tokens_note(f: Path, e: Entry) -> str:
    """Whether the stored token ids still match the sealed digest (the change is then in the state)."""
    if e.tokens_digest is None:
        return "no token digest was sealed"
    from slotfile.format.reader import open_slot_file

    try:
        sf = open_slot_file(f)
    except OSError as x:
        return f"tokens not read: {x.strerror or x}"
    try:
        now = tokens_digest(sf.tokens.tokens) if sf.tokens is not None else None
        n = sf.n_tokens
    finally:
        sf.close()
    if now == e.tokens_digest:
        return f"token ids as sealed ({n} tokens): the change is in the state bytes"
    return f"the token digest no longer matches ({n} tokens now, {e.n_tokens} sealed)"


def _slot_files_on_disk(manifest: Manifest, scope: list[Path]) -> dict[str, Path]:
    """The slot files under ``scope`` by the path the manifest would record (the manifest itself
    left out)."""
    directory = manifest.directory
    on_disk, _ = collect_slot_files([p for p in scope if p.exists()])
    own = Path(manifest.path or "").resolve()
    disk: dict[str, Path] = {}
    for f in on_disk:
        if f.resolve() == own:
            continue
        try:
            disk[relative_to(directory, f)] = f
        except ValueError:
            disk[os.path.abspath(f)] = f  # not under the manifest's directory: extra by definition
    return disk


def _check_models(
    fc: FileCheck, e: Entry, manifest: Manifest, model: Fingerprint | None, draft_model: Fingerprint | None
) -> None:
    """An entry whose bytes are as sealed but that was sealed with another (draft) model than
    the one given is a model mismatch."""
    if fc.status == Status.OK and model is not None and e.model is not None and e.model != model.value:
        fc.status = Status.MODEL_MISMATCH
        sealed = manifest.models.get(e.model, {})
        name = sealed.get("name") or sealed.get("path") or "another model"
        fc.messages.append(
            f"sealed with {name} (fingerprint {e.model[:16]}...), --model is {model.name or 'another model'} "
            f"({model.value[:16]}...)"
        )
    if fc.status == Status.OK and draft_model is not None and e.draft_model not in (None, draft_model.value):
        fc.status = Status.MODEL_MISMATCH
        fc.messages.append(f"sealed with another draft model (fingerprint {str(e.draft_model)[:16]}...)")


def check(
    manifest: Manifest,
    paths: list[Path] | None = None,
    model: Fingerprint | None = None,
    draft_model: Fingerprint | None = None,
    jobs: int = HASH_THREADS,
    on_done: Callable[[FileCheck], None] | None = None,
) -> CheckResult:
    """Every entry against the disk and every slot file on disk against the entries.  ``paths``:
    only these files and directories (None: the manifest's whole directory); an entry outside
    them is not looked at, a slot file inside them that the manifest lacks is ``extra``."""
    import time

    t0 = time.monotonic()
    directory = manifest.directory
    disk = _slot_files_on_disk(manifest, [directory] if paths is None else paths)
    entries = manifest.by_path()
    if paths is None:
        wanted = list(entries)
    else:
        wanted = [rel for rel in entries if _in_scope(directory / rel, paths)]
    res = CheckResult(str(manifest.path))

    def one(rel: str) -> FileCheck:
        e = entries[rel]
        fc = _compare(directory / rel, e)
        _check_models(fc, e, manifest, model, draft_model)
        if on_done is not None:
            on_done(fc)
        return fc

    if jobs <= 1:
        checks = [one(r) for r in wanted]
    else:
        from concurrent.futures import ThreadPoolExecutor  # only here: verify imports this module

        with ThreadPoolExecutor(max_workers=jobs) as ex:
            checks = list(ex.map(one, wanted))
    for fc in checks:
        res.files.append(fc)
        if fc.size is not None:
            res.bytes_hashed += fc.size
    for rel in sorted(set(disk) - set(entries)):
        fc = FileCheck(rel, Status.EXTRA, ["a slot file the manifest does not list (new, or renamed)"])
        res.files.append(fc)
        if on_done is not None:
            on_done(fc)
    res.files.sort(key=lambda f: f.path)
    res.seconds = time.monotonic() - t0
    return res


def _in_scope(p: Path, paths: list[Path]) -> bool:
    ap = os.path.abspath(p)
    for s in paths:
        a = os.path.abspath(s)
        if ap == a or ap.startswith(a.rstrip(os.sep) + os.sep):
            return True
    return False


def discover(paths: list[Path]) -> Path | None:
    """The manifest ``verify`` uses without ``--manifest``: the default one of the single
    directory given (None when there is none, or more than one path)."""
    from slotfile.seal.manifest import find_manifest

    if len(paths) != 1 or not paths[0].is_dir():
        return None
    return find_manifest(paths[0])


def problems_of(fc: FileCheck) -> list[dict[str, Any]]:
    """The file's manifest problems in verify's form (section ``file``, no offset)."""
    if fc.status == Status.OK:
        return []
    code = CODES[fc.status]
    return [{"severity": "error", "code": code, "section": "file", "offset": None, "message": "; ".join(fc.messages)}]


def sealed_state(entry: Entry | None, size: int, mtime_ns: int) -> str:
    """What ``ls`` shows without hashing: ``sealed`` (size and mtime as sealed), ``changed``
    (either differs: run verify to know whether the bytes did), ``unsealed`` (no entry)."""
    if entry is None:
        return "unsealed"
    return "sealed" if (entry.size, entry.mtime_ns) == (size, mtime_ns) else "changed"
