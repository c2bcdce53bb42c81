"""The check every written file passes before it is moved into place: a clean re-read and,
with a model, a real test-load through llama.cpp."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from slotfile.format.reader import open_slot_file
from slotfile.format.records import FileFormat, SlotFile
from slotfile.repair.common import Operational, RepairOptions
from slotfile.repair.report import Report


def make_check(
    opts: RepairOptions, test_draft: bool, report: Report, model_level: bool = False
) -> Callable[[str], tuple[bool, str]]:
    """The check of a written temp file.  ``model_level``: also read it against --model /
    --draft-model (migrate), and list the checks that ran in ``report.checked``."""

    def check(path: str) -> tuple[bool, str]:
        t0 = time.monotonic()
        sf = open_slot_file(path, **(_expectations(opts) if model_level else {}))
        try:
            errs = sf.errors
            if errs:
                return False, f"the output still reads with errors: {errs[0].line()}"
            if model_level:
                report.checked = ["structure"] + (["model"] if sf.expect or sf.draft_expect else [])
            if opts.model is None:
                return True, ""
            used: dict[str, Any] = {}  # which library test-loaded it
            res = _test_load(sf, path, opts, test_draft, report, used)
            if res is None:
                return True, ""
        finally:
            sf.close()
        report.timings["test-load"] = time.monotonic() - t0
        verdict = _judge(res, report)
        if report.test_load is not None:
            report.test_load.update(used)
        return verdict

    return check


def _expectations(opts: RepairOptions) -> dict[str, Any]:
    from slotfile.model.bridge import ModelError, load_model_info
    from slotfile.model.expect import expect_from_model

    try:
        return {
            "expect": expect_from_model(load_model_info(opts.model)) if opts.model else None,
            "draft_expect": expect_from_model(load_model_info(opts.draft_model)) if opts.draft_model else None,
        }
    except ModelError as e:
        raise Operational(str(e)) from None


def _test_load(
    sf: SlotFile, path: str, opts: RepairOptions, test_draft: bool, report: Report, used: dict[str, Any]
) -> Any:
    """The loader's result, or None when no llama.cpp at hand loads this state version (the
    test-load is skipped, with a note).  The library: --llama-lib, else $SLOTFILE_LLAMA_LIB,
    else llama-cpp-python's own and, when that one's version is not the file's, the one beside
    the llama-server on PATH."""
    from slotfile.llama.loader import LIB_ENV, Library, LoaderError, server_library

    t = _TestLoad(sf, path, opts, test_draft, report, used)
    try:
        with t.pool_over(opts.llama_lib) as pool:
            have = t.version_of(pool)
            if have is None or sf.version is None or sf.version == have:
                return t.load(pool)
            tried = ""
            lib = getattr(pool, "library", None)
            if lib is not None and lib.source not in ("--llama-lib", LIB_ENV):
                folder, where = server_library()
                tried = f" ({where})"
                if folder is not None and folder != pool.info.get("library_dir"):
                    with t.pool_over(Library(folder, "llama-server on PATH")) as alt:
                        if t.version_of(alt) == sf.version:
                            return t.load(alt)
                        tried = f" ({where} loads version {t.version_of(alt)})"
                # the build scripts' cache (scripts/build-llama-v2.sh, -v4.sh): a "found" library
                from slotfile.llama.builds import cached_library

                state = sf.version - 7 if sf.format == "GGSN" else sf.version
                built = cached_library(state)
                if built is not None and str(built) != pool.info.get("library_dir"):
                    with t.pool_over(Library(str(built), "slotfile's build cache")) as alt:
                        if t.version_of(alt) == sf.version:
                            return t.load(alt)
            t.skip(pool, have, tried)
            return None
    except LoaderError as e:
        raise Operational(str(e)) from None


class _TestLoad:
    """One written file's test-load: the pools it may use, and what it tells the report."""

    def __init__(
        self, sf: SlotFile, path: str, opts: RepairOptions, test_draft: bool, report: Report, used: dict[str, Any]
    ) -> None:
        assert opts.model is not None
        self.sf, self.path, self.opts, self.report, self.used = sf, path, opts, report, used
        self.model = opts.model
        self.draft = opts.draft_model if test_draft else None
        self.tiny = os.path.getsize(self.model) < 64 << 20  # ggml's spinning threads only cost there

    def pool_over(self, lib: Any) -> Any:
        from slotfile.llama.loader import LoaderPool

        return LoaderPool(
            self.model,
            self.draft,
            n_gpu_layers=self.opts.n_gpu_layers,
            threads=1 if self.tiny else None,
            llama_lib=lib,
        )

    def version_of(self, pool: Any) -> int | None:
        """The version of the pool's library that this file's kind needs (session files: GGSN)."""
        return pool.info.get("session_version") if self.sf.format == FileFormat.GGSN else pool.state_seq_version

    def load(self, pool: Any) -> Any:
        from slotfile.llama.loader import library_label, settings_for

        opts, sf = self.opts, self.sf
        res = pool.load(self.path, settings_for(sf, n_gpu_layers=opts.n_gpu_layers), timeout=opts.timeout, sf=sf)
        info = getattr(pool, "info", None)
        if isinstance(info, dict) and info.get("library"):
            self.used.update(
                library=info.get("library"),
                library_source=info.get("library_source"),
                state_seq_version=info.get("state_seq_version"),
            )
            if info.get("library_source") != "installed":  # the default library goes unmentioned
                self.report.notes.append(
                    f"test-loaded with {library_label(info)} (state version "
                    f"{info.get('state_seq_version')}, chosen by {info.get('library_source')})"
                )
        return res

    def skip(self, pool: Any, have: int, tried: str) -> None:
        """No library at hand loads the file's version: the test-load is skipped, with a note."""
        from slotfile.llama.loader import library_label

        sf = self.sf
        kind = "session" if sf.format == FileFormat.GGSN else "state"
        self.report.test_load = {
            "ok": None,
            "message": f"skipped: the file has {kind} version {sf.version}, the "
            f"loader ({library_label(pool.info)}) loads version {have} only{tried}; pass "
            f"--llama-lib DIR with a version {sf.version} build of llama.cpp to test-load it",
        }
        self.report.notes.append(self.report.test_load["message"])


def _judge(res: Any, report: Report) -> tuple[bool, str]:
    report.test_load = {
        "ok": bool(res.ok),
        "message": res.message,
        "body_bytes": res.body_bytes,
        "checkpoints": [list(c) for c in res.checkpoints],
        "draft": list(res.draft) if res.draft is not None else None,
        "checkpoint_drafts": [list(c) for c in res.checkpoint_drafts],
        "crashed": bool(res.crashed),
    }
    if not res.ok:
        return False, f"test-load through llama.cpp failed: {res.message}"
    bad = [f"checkpoint {i}: {m}" for i, (ok, m) in enumerate(res.checkpoints) if not ok]
    bad += [f"checkpoint {i} data_dft: {m}" for i, (ok, m) in enumerate(res.checkpoint_drafts) if not ok]
    if res.draft is not None and not res.draft[0]:
        bad.append(f"SDFT data_dft: {res.draft[1]}")
    if bad:
        report.test_load["ok"] = False
        return False, "test-load through llama.cpp failed: " + "; ".join(bad)
    return True, ""
