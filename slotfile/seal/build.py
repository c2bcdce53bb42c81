"""``slotfile seal``: checksum every slot file of a store and write the manifest.

Each file is verified before it is sealed (structure; with ``--model`` also the model check and
the test-load, with ``--deep`` the recompute): a file that fails is left out unless ``force``,
and then its verdict is recorded with it.  ``update`` re-seals against the manifest already
there: entries of unchanged files are kept as they are, new and changed files are sealed,
entries of files that are gone are dropped, and the result says which.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slotfile.seal.fingerprint import Fingerprint, fingerprint
from slotfile.seal.manifest import (
    ALGORITHM,
    DEFAULT_NAME,
    HASH_THREADS,
    Entry,
    Manifest,
    ManifestError,
    cache_types,
    collect_slot_files,
    file_checksum,
    load,
    now_iso,
    relative_to,
    render,
    tokens_digest,
)

if TYPE_CHECKING:
    from slotfile.safewrite import Target


class SealError(Exception):
    """Operational (exit 8): a path cannot be read, the model cannot be read or loaded."""


class SealUsage(Exception):
    """The command line cannot be carried out as given (exit 2): no place for the manifest,
    a file outside its directory, a manifest already there without --update or --force."""


@dataclass
class SealOptions:
    output: Path | None = None
    model: str | None = None
    draft_model: str | None = None
    deep: bool = False
    force: bool = False
    update: bool = False
    jobs: int = 1
    timeout: float = 300.0
    llama_lib: str | None = None
    n_gpu_layers: int = 0


@dataclass
class Refused:
    path: str
    reason: str


@dataclass
class SealResult:
    manifest: Manifest
    output: str
    added: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    refused: list[Refused] = field(default_factory=list)
    forced: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    written: bool = False
    bytes_hashed: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": "slotfile.seal/1",
            "manifest": self.output,
            "written": self.written,
            "files": len(self.manifest.entries),
            "added": self.added,
            "changed": self.changed,
            "unchanged": self.unchanged,
            "removed": self.removed,
            "forced": self.forced,
            "refused": [{"path": r.path, "reason": r.reason} for r in self.refused],
            "errors": self.errors,
            "bytes_hashed": self.bytes_hashed,
            "seconds": round(self.seconds, 4),
        }


def manifest_path(paths: list[Path], output: Path | None) -> Path:
    """Where the manifest goes: ``output``, else DEFAULT_NAME in the one directory given (or the
    one directory holding every file given)."""
    if output is not None:
        return output
    dirs = {p if p.is_dir() else p.parent for p in paths}
    if len(dirs) != 1:
        raise SealUsage("the files lie in more than one directory: say where the manifest goes with -o MANIFEST")
    return next(iter(dirs)) / DEFAULT_NAME


def model_fingerprint(path: str, what: str = "--model") -> Fingerprint:
    from slotfile.model.gguf import GGUFError

    try:
        return fingerprint(path)
    except OSError as e:
        raise SealError(f"{what} {path}: {e.strerror or e}") from None
    except GGUFError as e:
        raise SealError(f"{what} {path}: {e}") from None


def model_record(fp: Fingerprint, path: str) -> dict[str, Any]:
    d = fp.to_dict()
    d["path"] = os.path.abspath(path)
    return d


def _hash_all(
    files: list[Path], jobs: int, on_done: Callable[[Path], None] | None = None
) -> dict[Path, tuple[str, int, os.stat_result] | str]:
    """checksum, size and the stat taken before reading, per file; an error line instead when
    the file cannot be read or changed while it was read."""

    def one(p: Path) -> tuple[str, int, os.stat_result] | str:
        try:
            st = os.stat(p, follow_symlinks=False)
            digest, size = file_checksum(p, ALGORITHM)
            st2 = os.stat(p, follow_symlinks=False)
        except OSError as e:
            return f"{p}: {e.strerror or e}"
        finally:
            if on_done is not None:
                on_done(p)
        if (st2.st_size, st2.st_mtime_ns) != (st.st_size, st.st_mtime_ns) or size != st.st_size:
            return f"{p}: changed while it was read (a server still writing it?)"
        return digest, size, st

    if jobs <= 1 or len(files) <= 1:
        return {p: one(p) for p in files}
    from concurrent.futures import ThreadPoolExecutor  # only here: verify imports this module

    with ThreadPoolExecutor(max_workers=jobs) as ex:
        return dict(zip(files, ex.map(one, files), strict=True))


def _describe(entry: Entry, sf: Any) -> None:
    entry.format = str(sf.format)
    entry.version = sf.version
    entry.n_tokens = sf.n_tokens
    entry.tokens_digest = tokens_digest(sf.tokens.tokens) if sf.tokens is not None else None
    entry.memory_class = sf.body.memory_class if sf.body is not None else None
    entry.cache_types = cache_types(sf)


Verdict = tuple[dict[str, str], str | None, str | None]  # levels, first problem (None: passed), error


def _verdicts(todo: list[tuple[Path, Entry]], opts: SealOptions) -> list[Verdict]:
    """Per file: verify's level statuses, the first problem of a failing file, or an operational
    error; each entry is described (format, tokens, memory, types) from one parse of its file."""
    if opts.model is None:
        return [_structure_only(f, e) for f, e in todo]
    for f, e in todo:
        _describe_file(f, e)
    files = [f for f, _ in todo]
    from slotfile.verify import Verifier, VerifyError, VerifyOptions

    vopts = VerifyOptions(
        model=opts.model,
        draft_model=opts.draft_model,
        deep=opts.deep,
        jobs=max(1, opts.jobs),
        timeout=opts.timeout,
        llama_lib=opts.llama_lib,
        n_gpu_layers=opts.n_gpu_layers,
    )
    try:
        with Verifier(vopts) as v:
            reports = v.run(files)
    except VerifyError as e:
        raise SealError(str(e)) from None
    out: list[Verdict] = []
    for rep in reports:
        if rep.error is not None:
            out.append(({}, None, rep.error))
            continue
        levels = {k: str(lv.status) for k, lv in rep.levels.items()}
        out.append((levels, None if str(rep.verdict) == "pass" else (rep.first_problem or "failed"), None))
    return out


def _describe_file(f: Path, entry: Entry) -> None:
    from slotfile.format.reader import open_slot_file

    try:
        sf = open_slot_file(f)
    except OSError:
        return  # verify reports it
    try:
        _describe(entry, sf)
    finally:
        sf.close()


def _structure_only(f: Path, entry: Entry) -> Verdict:
    """verify's structure level without a model: the reader's own problems."""
    from slotfile.format.reader import open_slot_file
    from slotfile.format.records import Severity

    try:
        sf = open_slot_file(f)
    except OSError as e:
        return {}, None, f"{f}: {e.strerror or e}"
    try:
        _describe(entry, sf)
        errors = [p for p in sf.file_problems if p.severity == Severity.ERROR]
    finally:
        sf.close()
    levels = {"structure": "fail" if errors else "pass", "model": "skipped", "load": "skipped", "deep": "skipped"}
    return levels, (f"structure: {errors[0].line()}" if errors else None), None


def _old_manifest(out: Path, opts: SealOptions) -> Manifest | None:
    """The manifest already at ``out`` when ``--update`` re-seals it; refuses to overwrite one
    without --update or --force, and an --update with nothing to update."""
    if os.path.lexists(out):
        if opts.update:
            return load(out)
        if not opts.force:
            raise SealUsage(f"{out} exists: --update re-seals new and changed files, --force replaces it")
    elif opts.update:
        raise SealUsage(f"{out} does not exist: nothing to --update (seal without it)")
    return None


def _relative_paths(files: list[Path], directory: Path) -> dict[Path, str]:
    """Each file's path as the manifest records it (relative to its directory)."""
    rels: dict[Path, str] = {}
    for f in files:
        try:
            rels[f] = relative_to(directory, f)
        except ValueError:
            raise SealUsage(f"{f} is not under the manifest's directory {directory} (-o MANIFEST places it)") from None
    return rels


def _sort_hashed(
    res: SealResult,
    files: list[Path],
    rels: dict[Path, str],
    hashed: dict[Path, tuple[str, int, os.stat_result] | str],
    old_entries: dict[str, Entry],
    model_fp: Fingerprint | None,
) -> list[tuple[Path, Entry]]:
    """Keep the entries of unchanged files, note the unreadable ones; the new and changed files
    (with a fresh entry each) are returned to be verified."""
    to_seal: list[tuple[Path, Entry]] = []
    for f in files:
        h = hashed[f]
        rel = rels[f]
        if isinstance(h, str):
            res.errors.append(h)
            if rel in old_entries:  # unreadable now: keep what was sealed, check will say so
                res.manifest.entries.append(old_entries[rel])
            continue
        digest, size, st = h
        res.bytes_hashed += size
        prev = old_entries.get(rel)
        same = prev is not None and (prev.checksum, prev.size, prev.algorithm) == (digest, size, ALGORITHM)
        if prev is not None and same and (model_fp is None or prev.model == model_fp.value):
            res.unchanged.append(rel)
            res.manifest.entries.append(prev)
            continue
        entry = Entry(rel, size, st.st_mtime_ns, digest, ALGORITHM)
        (res.changed if prev is not None else res.added).append(rel)
        to_seal.append((f, entry))
    return to_seal


def _admit(
    res: SealResult,
    to_seal: list[tuple[Path, Entry]],
    verdicts: list[Verdict],
    old_entries: dict[str, Entry],
    models: tuple[Fingerprint | None, Fingerprint | None],
    opts: SealOptions,
    on_progress: Callable[[str, Path], None] | None,
) -> None:
    """Enter each verified file into the manifest; a failing one is refused (its old entry kept)
    unless ``force``, and an operational error drops it."""
    model_fp, draft_fp = models
    for (f, entry), (levels, first, error) in zip(to_seal, verdicts, strict=True):
        if on_progress is not None:
            on_progress("verified", f)
        if error is not None:
            res.errors.append(error)
            _drop(res, entry.path)
            continue
        entry.levels = levels
        entry.passed = [k for k, v in levels.items() if v == "pass"]
        entry.model = model_fp.value if model_fp is not None else None
        entry.draft_model = draft_fp.value if draft_fp is not None else None
        if first is not None:
            entry.first_problem = first
            if not opts.force:
                res.refused.append(Refused(entry.path, first))
                _drop(res, entry.path)
                if entry.path in old_entries:  # keep the sealed entry: check reports the change
                    res.manifest.entries.append(old_entries[entry.path])
                continue
            entry.forced = True
            res.forced.append(entry.path)
        res.manifest.entries.append(entry)


def seal(paths: list[Path], opts: SealOptions, on_progress: Callable[[str, Path], None] | None = None) -> SealResult:
    """Seal ``paths`` (files and directories); writes the manifest unless nothing could be
    sealed.  Raises SealUsage, SealError, ManifestError (an --update of a bad manifest)."""
    import time

    from slotfile.safewrite import WriteRefused, resolve_target

    t0 = time.monotonic()
    out = manifest_path(paths, opts.output)
    directory = Path(os.path.abspath(out)).parent
    old = _old_manifest(out, opts)
    try:
        target = resolve_target(os.devnull, out, force=True)
    except WriteRefused as e:
        raise SealUsage(str(e)) from None
    files, errors = collect_slot_files(paths)
    if not files and errors:
        raise SealError(errors[0])  # nothing to seal: no manifest is written
    files = [f for f in files if os.path.abspath(f) != os.path.abspath(out)]
    rels = _relative_paths(files, directory)
    model_fp = model_fingerprint(opts.model) if opts.model else None
    draft_fp = model_fingerprint(opts.draft_model, "--draft-model") if opts.draft_model else None
    res = SealResult(Manifest(path=str(out), generator=_generator(), created=now_iso()), str(out), errors=errors)
    if old is not None:
        res.manifest.models = dict(old.models)
    for fp, path in ((model_fp, opts.model), (draft_fp, opts.draft_model)):
        if fp is not None and path is not None:
            res.manifest.models[fp.value] = model_record(fp, path)
    hashed = _hash_all(files, HASH_THREADS, (lambda p: on_progress("hashed", p)) if on_progress else None)
    old_entries = old.by_path() if old is not None else {}
    to_seal = _sort_hashed(res, files, rels, hashed, old_entries, model_fp)
    if old is not None:
        res.removed = sorted(set(old_entries) - set(rels.values()))
    verdicts = _verdicts(to_seal, opts) if to_seal else []
    _admit(res, to_seal, verdicts, old_entries, (model_fp, draft_fp), opts, on_progress)
    _write_manifest(res.manifest, target)
    res.written = True
    res.seconds = time.monotonic() - t0
    return res


def _write_manifest(m: Manifest, target: Target) -> None:
    """Drop the model records no entry uses and write ``m`` through the safe-write path; the
    temporary copy must load back as a manifest before it replaces the target."""
    from slotfile.safewrite import Plan, commit

    used = {e.model for e in m.entries} | {e.draft_model for e in m.entries}
    m.models = {k: v for k, v in m.models.items() if k in used}
    plan = Plan()
    plan.literal(render(m))
    commit(plan, target, _loads, mode=0o644)


def _drop(res: SealResult, rel: str) -> None:
    for lst in (res.added, res.changed):
        if rel in lst:
            lst.remove(rel)


def _generator() -> str:
    from slotfile import __version__

    return f"slotfile {__version__}"


def drop_entries(manifest: str | os.PathLike[str], removed: list[str]) -> list[str]:
    """Remove the entries of files that were deleted (``prune --delete``) from a manifest,
    rewritten through the safe-write path; returns the entries dropped.  Raises ManifestError
    for a manifest that cannot be read (it is then left as it is)."""
    from slotfile.safewrite import resolve_target

    m = load(manifest)
    directory = m.directory
    rels = set()
    for r in removed:
        try:
            rels.add(relative_to(directory, Path(r)))
        except ValueError:
            continue
    gone = sorted(e.path for e in m.entries if e.path in rels)
    if not gone:
        return []
    m.entries = [e for e in m.entries if e.path not in rels]
    _write_manifest(m, resolve_target(os.devnull, manifest, force=True))
    return gone


def _loads(tmp: str) -> tuple[bool, str]:
    try:
        load(tmp)
    except ManifestError as e:
        return False, str(e)
    return True, ""
