"""``migrate DIR -o OUTDIR --to N`` and ``ls DIR --llama-lib LIB``: state versions across a whole
``--slot-save-path`` directory.

``migrate DIR`` walks DIR as ``re-save DIR`` does (:func:`slotfile.slotdir.walk.scan_dir`: recursive,
symlinks, temps and files still being written left out) and writes every slot and session file under
OUTDIR at the same relative path, with the same safe writes: the single-file ``migrate`` (its check:
a clean re-read, the model check and, with a model, a test-load through a library of the target
version) for a file of another version; a file already at N is copied byte for byte (through the
same checked commit), or left out with ``only_changed``.  The output keeps the input's mtime.  The
per-file results are :class:`slotfile.repair.batch.FileResult` rows, as ``re-save DIR`` reports them.

``ls --llama-lib`` answers "what breaks if I upgrade to this build?": per file, whether that
llama.cpp loads it as is, after ``migrate --to`` its version (the converted bytes go to a temp
file that is test-loaded, then removed), or not at all, with the reason.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slotfile.repair.batch import FileResult
from slotfile.repair.common import RepairOptions
from slotfile.repair.report import Outcome, Report
from slotfile.slotdir.walk import DirEntry, DirScan

if TYPE_CHECKING:
    from slotfile.llama.loader import LoaderPool

__all__ = ["LibVerdict", "library_verdicts", "migrate_entry"]

SCHEMA = "slotfile.migrate-dir/1"


def _version_of(path: str) -> tuple[str | None, int | None]:
    """(format, header version) from the first 8 bytes; (None, None) when neither magic."""
    import struct

    from slotfile.format import grammar as g

    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) < 8:
        return None, None
    magic, version = struct.unpack("<II", head)
    fmt = {g.GGSQ_MAGIC: "GGSQ", g.GGSN_MAGIC: "GGSN"}.get(magic)
    return fmt, (int(version) if fmt else None)


def _changes(rep: Report) -> list[str]:
    return [f"{c['section']}: {c['field']} {c['from']} -> {c['to']}" for c in rep.changed]


def migrate_entry(
    entry: DirEntry, outdir: str, opts: RepairOptions, *, force: bool, dry_run: bool, only_changed: bool
) -> FileResult:
    """One file of the walk; never raises for an expected failure."""
    from slotfile.repair.migrate_versions import file_version, to_state
    from slotfile.repair.runner import run
    from slotfile.safewrite import Target

    out = os.path.join(outdir, entry.rel)
    try:
        fmt, version = _version_of(entry.path)
    except OSError as e:
        return FileResult(entry.rel, None, "error", f"{entry.path}: {e.strerror or e}")
    if fmt is None:
        return FileResult(entry.rel, None, "skipped", "not a slot (GGSQ) or session (GGSN) file")
    from slotfile.format.records import FileFormat
    from slotfile.repair.common import Refused

    try:
        to = file_version(FileFormat(fmt), to_state(FileFormat(fmt), opts.to_version))
    except Refused as e:
        return FileResult(entry.rel, f"{fmt} {version}", "failed", str(e))
    fate = f"{fmt} {version} -> {to}"
    if version == to:
        if only_changed:
            return FileResult(entry.rel, fate, "left-out", f"already {fmt} version {to} (--only-changed)")
        if dry_run:
            return FileResult(entry.rel, fate, "would-copy", f"already {fmt} version {to}", out)
    if not dry_run:
        if os.path.lexists(out) and not force:
            return FileResult(entry.rel, fate, "failed", f"{out} exists (pass --force to replace it)")
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    target = Target(entry.path, out, False, None, force)
    rep = run("migrate", entry.path, target, opts, dry_run=dry_run)
    res = FileResult(entry.rel, fate, "", rep.reason or "", out, _changes(rep))
    proven = ", ".join(rep._checked()) if rep.checked is not None else "structure"
    if rep.outcome == Outcome.DRY_RUN:
        res.action = "would-copy" if version == to else "would-convert"
        res.reason = "; ".join(rep.notes[-1:]) or "would convert"
    elif rep.outcome in (Outcome.REPAIRED, Outcome.NOTHING_TO_DO):
        res.action = "copied" if version == to else "converted"
        res.reason = f"already version {to}; copied byte for byte" if version == to else f"converted; checked: {proven}"
        if rep.test_load is not None and rep.test_load.get("ok") is None:
            res.reason += f" ({rep.test_load.get('message')})"
        try:
            os.utime(out, (entry.mtime, entry.mtime), follow_symlinks=False)
        except OSError:
            pass
    elif rep.outcome == Outcome.REFUSED:
        res.action, res.output = "skipped", None
    else:
        res.action, res.output = ("error" if rep.outcome == Outcome.OPERATIONAL else "failed"), None
    return res


# ---------------------------------------------------------------------------------------
# ls --llama-lib: which files a given llama.cpp loads


@dataclass(slots=True)
class LibVerdict:
    rel: str
    verdict: str  # "as-is" | "after-migrate" | "no"
    reason: str
    version: int | None = None
    to: int | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "reason": self.reason, "version": self.version, "to": self.to}


def library_verdicts(
    scan: DirScan, model: str, llama_lib: str, n_gpu_layers: int = 0
) -> tuple[int | None, list[LibVerdict]]:
    """(the library's state version, a verdict per slot file).  Each file is test-loaded through
    ``llama_lib`` with the settings the file implies; a file of another version is migrated into
    a temp file first (``migrate --to`` the library's version, with ``model``) and that is loaded."""
    from slotfile.llama.loader import LoaderPool

    tiny = os.path.getsize(model) < 64 << 20
    out: list[LibVerdict] = []
    with LoaderPool(model, n_gpu_layers=n_gpu_layers, threads=1 if tiny else None, llama_lib=llama_lib) as pool:
        state = pool.state_seq_version
        with tempfile.TemporaryDirectory(prefix="slotfile-ls-") as tmp:
            for e in scan.slots:
                verdict, version = _as_is_verdict(e, pool, state, n_gpu_layers)
                if verdict is None:
                    opts = RepairOptions(model=model, to_version=state, n_gpu_layers=n_gpu_layers, llama_lib=llama_lib)
                    verdict = _migrated_verdict(
                        e, version, state, os.path.join(tmp, Path(e.rel).name + ".migrated"), opts
                    )
                out.append(verdict)
    return state, out


def _as_is_verdict(
    e: DirEntry, pool: LoaderPool, state: int | None, n_gpu_layers: int
) -> tuple[LibVerdict | None, int | None]:
    """The verdict of a file that is damaged, not a slot file or of the library's own state
    version (test-loaded as it is); None when it is of another version.  With its version."""
    from slotfile.format.reader import open_slot_file
    from slotfile.llama.loader import settings_for
    from slotfile.repair.migrate_versions import state_of

    sf = open_slot_file(e.path)
    try:
        fmt, version = str(sf.format), sf.version
        if sf.errors:
            return LibVerdict(e.rel, "no", f"damaged: {sf.errors[0].line()}", version), version
        if fmt not in ("GGSQ", "GGSN"):
            return LibVerdict(e.rel, "no", "not a slot or session file", version), version
        if state_of(sf.format, version) != state:
            return None, version
        res = pool.load(e.path, settings_for(sf, n_gpu_layers=n_gpu_layers), sf=sf)
        if res.ok:
            return LibVerdict(e.rel, "as-is", "loads as is (test-loaded)", version, version), version
        return LibVerdict(e.rel, "no", f"does not load: {res.message}", version), version
    finally:
        sf.close()


def _migrated_verdict(
    e: DirEntry, version: int | None, state: int | None, conv: str, opts: RepairOptions
) -> LibVerdict:
    """Migrate the file into ``conv`` (a temp file, removed after) and test-load that."""
    from slotfile.repair.runner import run
    from slotfile.safewrite import Target, unlink_quiet

    rep = run("migrate", e.path, Target(e.path, conv, False, None, True), opts)
    try:
        if rep.outcome != Outcome.REPAIRED:
            why = rep.reason or str(rep.outcome)
            return LibVerdict(e.rel, "no", f"version {version}; migrate --to {state}: {why}", version)
        tl = rep.test_load or {}
        if tl.get("ok"):
            return LibVerdict(
                e.rel,
                "after-migrate",
                f"version {version}: loads after `slotfile migrate --to {state}` (test-loaded)",
                version,
                state,
            )
        return LibVerdict(e.rel, "no", f"migrated, but: {tl.get('message') or 'not test-loaded'}", version)
    finally:
        unlink_quiet(conv)
