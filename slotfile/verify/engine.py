"""The engine of ``slotfile verify``: one :class:`Verifier` per run holds the models and the
loader workers every file shares, and runs the four levels on each file, ``jobs`` at a time.

A level that cannot judge a file is skipped with the reason: a file that is not a slot file
blocks every level after structure; a file that does not load blocks the deep level.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slotfile.diagnosis import Cause, facts_of
from slotfile.format.records import SlotFile
from slotfile.problems import CheckLevel
from slotfile.slotdir.forked import ordered_map
from slotfile.text import count
from slotfile.verify.load import level_load
from slotfile.verify.model import level_model, model_side, read
from slotfile.verify.options import VerifyOptions, required_levels
from slotfile.verify.records import LEVELS, NO_DEEP, FileReport, Level, SkipKind, VerifyError
from slotfile.verify.structure import level_structure, scan_into

if TYPE_CHECKING:
    from slotfile.llama.loader import LoaderPool
    from slotfile.verify.judge import Caches

# The loader (slotfile.llama) and the deep level are imported where a model is in play: a
# structure-only run never needs them, and a directory's worth is read by forked workers while
# this process writes the rows (~0.05 s of its start before the workers can be forked).


class Verifier:
    """Models and loader workers shared by every file of a run."""

    def __init__(self, opts: VerifyOptions, pool: LoaderPool | None = None) -> None:
        """``pool``: workers the caller started early (``LoaderPool.start``) so that they load
        the model while this process imports and parses; a failure to start surfaces at the
        first load, as a VerifyError from :meth:`run`."""
        self.opts = opts
        self.pool: LoaderPool | None = pool
        self.side = model_side(opts.model)
        self.dside = model_side(opts.draft_model)
        self.caches: Caches = {}
        if self.side is not None and self.side.expect is not None:
            from slotfile.verify.judge import caches_of

            self.caches = caches_of(self.side.expect)
        if opts.model is not None and self.pool is None:
            from slotfile.llama.loader import LoaderError, LoaderPool

            try:
                self.pool = LoaderPool(
                    opts.model, opts.draft_model, opts.n_gpu_layers, opts.jobs, llama_lib=opts.llama_lib
                )
            except LoaderError as e:
                raise VerifyError(str(e)) from e
        self._server: tuple[LoaderPool | None, str] | None = None  # the llama-server's library, once looked for
        self._server_lock = threading.Lock()
        self.used: dict[int, int] = {}  # id(pool) -> files test-loaded with it

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if self._server is not None and self._server[0] is not None:
            self._server[0].close()
            self._server = None

    def loaders(self) -> list[dict[str, Any]]:
        """Every loader this run used (the first: the one it started with), as --json shows them."""
        pools = [p for p in (self.pool, self._server[0] if self._server else None) if p is not None]
        if not pools:
            return []
        from slotfile.llama.loader import LoaderError

        try:
            return [dict(p.describe(), files=self.used.get(id(p), 0)) for p in pools]
        except LoaderError as e:
            raise VerifyError(str(e)) from e

    def pool_for(self, sf: SlotFile) -> tuple[LoaderPool | None, str | None]:
        """The loader for ``sf``: the run's own, or, when its version is not the file's and no
        library was named (--llama-lib, $SLOTFILE_LLAMA_LIB), the library beside the
        llama-server on PATH if that one's version is the file's.  Also what the search found."""
        pool = self.pool
        if pool is None or pool.loads_version_of(sf.format, sf.version):
            return pool, None
        from slotfile.llama.loader import LIB_ENV

        if pool.library.source in ("--llama-lib", LIB_ENV):
            return pool, None
        server, note = self._server_pool()
        if server is not None and server.loads_version_of(sf.format, sf.version):
            return server, None
        return pool, note

    def _server_pool(self) -> tuple[LoaderPool | None, str]:
        with self._server_lock:
            if self._server is None:
                self._server = self._start_server_pool()
            return self._server

    def _start_server_pool(self) -> tuple[LoaderPool | None, str]:
        assert self.opts.model is not None and self.pool is not None
        from slotfile.llama.loader import Library, LoaderError, LoaderPool, server_library

        folder, where = server_library()
        if folder is None:
            return None, where
        if folder == self.pool.info.get("library_dir"):
            return None, f"{where} is this very library"
        try:
            pool = LoaderPool(
                self.opts.model,
                self.opts.draft_model,
                self.opts.n_gpu_layers,
                self.opts.jobs,
                llama_lib=Library(folder, "llama-server on PATH"),
            )
        except LoaderError as e:
            return None, f"{where} does not load: {e}"
        return pool, f"{where} writes state version {pool.state_seq_version}, session version {pool.session_version}"

    def __enter__(self) -> Verifier:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def verify(self, path: Path) -> FileReport:
        """Every level on one file; a file that cannot be read gets its report's ``error``."""
        t0 = time.monotonic()
        rep = FileReport(str(path))
        try:
            if path.is_dir():
                raise IsADirectoryError(21, "is a directory")
            sf = read(path, self.side, self.dside)
        except OSError as e:
            rep.error = f"{path}: {e.strerror or e}"
            return rep
        rep.size, rep.n_tokens, rep.format, rep.version = sf.size, sf.n_tokens, sf.format, sf.version
        try:
            self._levels(rep, sf, path)
        finally:
            sf.close()  # now, not when the garbage collector finds the cycle: a DIR run maps every file
        rep.unmet = unmet_requirements(rep, self.opts.require)
        rep.seconds = time.monotonic() - t0
        return rep

    def _levels(self, rep: FileReport, sf: SlotFile, path: Path) -> None:
        rep.facts = facts_of(sf, self.opts.model)
        lv = rep.levels
        t = time.monotonic()
        lv["structure"] = level_structure(sf)
        if self.opts.scan:
            scan_into(lv["structure"], sf, max(2, self.opts.jobs))
        lv["structure"].seconds = time.monotonic() - t
        if any(p.cls == Cause.NOT_SLOT_FILE for p in lv["structure"].problems):
            for name in LEVELS[1:]:  # nothing for a model or a loader to judge
                lv[name].skip("not a slot file", SkipKind.BLOCKED)
        else:
            self._model_load_deep(rep, sf, path)

    def _model_load_deep(self, rep: FileReport, sf: SlotFile, path: Path) -> None:
        """Levels 2 to 4 of a slot file, each timed into its level."""
        lv = rep.levels
        t = time.monotonic()
        lv["model"] = level_model(sf, self.side, self.dside)
        lv["model"].seconds = time.monotonic() - t
        settings = None
        res = None
        t = time.monotonic()
        pool, tried = self.pool_for(sf)
        if pool is not None:
            from slotfile.llama.loader import settings_for

            settings = settings_for(sf, self.opts.n_gpu_layers)
            if self.opts.settings_hook is not None:
                settings = self.opts.settings_hook(sf, settings)
            res = pool.load(str(path), settings, timeout=self.opts.timeout, sf=sf)
            with self._server_lock:
                self.used[id(pool)] = self.used.get(id(pool), 0) + 1
        lv["load"] = level_load(sf, res, pool, self.opts.draft_model is not None, tried)
        lv["load"].seconds = time.monotonic() - t
        if settings is not None:
            lv["load"].details["settings"] = settings.to_dict()
        if not self.opts.deep:  # without importing the deep level (its loader side, numpy's linalg)
            lv["deep"] = Level(CheckLevel.DEEP).skip(NO_DEEP, SkipKind.NOT_REQUESTED)
            return
        from slotfile.verify.deep import level_deep

        t = time.monotonic()
        lv["deep"] = level_deep(sf, str(path), pool, lv["load"], self.opts, settings, self.caches)
        lv["deep"].seconds = time.monotonic() - t

    def run(self, paths: Sequence[Path], on_done: Callable[[FileReport], None] | None = None) -> list[FileReport]:
        """Every file, ``jobs`` at a time; results in the order of ``paths``.  Raises
        VerifyError when the loader cannot start (model unloadable)."""
        from slotfile.llama.loader import LoaderError

        try:
            return self._run(paths, on_done)
        except LoaderError as e:
            raise VerifyError(str(e)) from e

    def _run(self, paths: Sequence[Path], on_done: Callable[[FileReport], None] | None) -> list[FileReport]:
        if self.pool is None and self.opts.model is None:  # structure only: on forked processes for many files
            out = []
            for r in self.stream((p, -1) for p in paths):
                out.append(r)
                if on_done:
                    on_done(r)
            return out
        if self.opts.jobs <= 1 or len(paths) <= 1:
            out = []
            for p in paths:
                r = self.verify(p)
                out.append(r)
                if on_done:
                    on_done(r)
            return out
        results: list[FileReport | None] = [None] * len(paths)
        from concurrent.futures import ThreadPoolExecutor, as_completed  # --jobs > 1 only

        with ThreadPoolExecutor(max_workers=self.opts.jobs) as ex:
            futs = {ex.submit(self.verify, p): i for i, p in enumerate(paths)}

            for f in as_completed(futs):
                r = f.result()
                results[futs[f]] = r
                if on_done:
                    on_done(r)
        return [r for r in results if r is not None]

    def stream(
        self, files: Iterable[tuple[str | Path, int]], digest: Callable[[FileReport], Any] | None = None
    ) -> Iterator[Any]:
        """Structure only (no model, no loader): each file's report, or ``digest(report)`` made
        where the file was read, yielded in the order of ``files`` (path, size as walked or -1:
        asked) as they are made; for a directory's worth on forked processes
        (slotfile.slotdir.forked, ``opts.read_jobs``), each reading its files with this
        Verifier.  ``files`` is taken as it is needed (a walk as it goes); the workers are
        forked once the first files are in, before this returns."""
        assert self.pool is None and self.opts.model is None

        def some(chunk: list[str | Path]) -> list[Any]:
            return [self.verify(Path(p)) if digest is None else digest(self.verify(Path(p))) for p in chunk]

        sized = ((p, n if n >= 0 else _size(Path(p))) for p, n in files)  # asked of files no walk saw
        return ordered_map(some, sized, self.opts.read_jobs)


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0


def unmet_requirements(rep: FileReport, require: tuple[str, ...]) -> list[dict[str, str]]:
    """The required levels that were skipped for this file, each with why and what would make
    it checkable (the option to pass), for the report, the JSON and the JUnit failure."""
    out = []
    for name in required_levels(require):
        lv = rep.levels[name]
        if lv.status != "skipped":
            out += _unmet_parts(name, lv.unchecked_parts)
            continue
        out.append(
            {"level": name, "reason": lv.reason, "skip_kind": str(lv.skip_kind or ""), "hint": _hint(rep, name, lv)}
        )
    return out


def _unmet_parts(name: str, parts: list[dict[str, Any]]) -> list[dict[str, str]]:
    """A required level that ran but left parts unchecked (deep: blobs it cannot recompute
    here) is not met: one entry naming the first such part, its reason and what to pass."""
    if not parts:
        return []
    first = parts[0]
    more = f" ({count(len(parts) - 1, 'more blob')} not recomputed: see unchecked_parts)" if len(parts) > 1 else ""
    # the body is always recomputed; what it leaves unchecked is named by the reason itself
    verb = "" if first["section"] == "body" else " not recomputed"
    reason = f"{first['section']}{verb}: {first['reason']}{more}"
    return [{"level": name, "reason": reason, "skip_kind": str(SkipKind.CANNOT_CHECK), "hint": first["hint"]}]


def _hint(rep: FileReport, name: str, lv: Any) -> str:
    """The option that would let this level run on this file."""
    if lv.skip_kind == SkipKind.BLOCKED:
        return "an earlier level failed: repair the file first"
    if lv.skip_kind == SkipKind.NOT_REQUESTED:
        return "--deep" if name == "deep" and "deep" in lv.reason else "--model M.gguf"
    if name == "load" or (name == "deep" and rep.levels["load"].status == "skipped"):
        kind = "session" if rep.format == "GGSN" else "state"
        return f"--llama-lib DIR with a llama.cpp build that loads {kind} version {rep.version}"
    return "none: the stored tokens cannot be recomputed (the reason above); drop --require deep for this file"
