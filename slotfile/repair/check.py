"""The check every written file passes before it is moved into place: a clean re-read and,
with a model, a real test-load through llama.cpp."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from ..reader import open_slot_file
from ..records import SlotFile
from .common import Operational, Options, close
from .report import Report


def make_check(
    opts: Options, test_draft: bool, report: Report, model_level: bool = False
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
            res = _test_load(sf, path, opts, test_draft, report)
            if res is None:
                return True, ""
        finally:
            close(sf)
        report.timings["test-load"] = time.monotonic() - t0
        return _judge(res, report)

    return check


def _expectations(opts: Options) -> dict[str, Any]:
    from ..expect import expect_from_model
    from ..model import ModelError, load_model_info

    try:
        return {
            "expect": expect_from_model(load_model_info(opts.model)) if opts.model else None,
            "draft_expect": expect_from_model(load_model_info(opts.draft_model)) if opts.draft_model else None,
        }
    except ModelError as e:
        raise Operational(str(e)) from None


def _test_load(sf: SlotFile, path: str, opts: Options, test_draft: bool, report: Report) -> Any:
    """The loader's result, or None when the installed llama.cpp cannot load this state
    version at all (the test-load is skipped, with a note)."""
    from ..loader import LoaderError, LoaderPool, settings_for

    assert opts.model is not None
    try:
        tiny = os.path.getsize(opts.model) < 64 << 20  # ggml's spinning threads only cost there
        with LoaderPool(
            opts.model,
            opts.draft_model if test_draft else None,
            n_gpu_layers=opts.n_gpu_layers,
            threads=1 if tiny else None,
        ) as pool:
            # the hook for a llama.cpp of the file's own version: the pool's library decides
            have = pool.info.get("session_version") if sf.format == "GGSN" else pool.state_seq_version
            if have is not None and sf.version is not None and sf.version != have:
                report.test_load = {
                    "ok": None,
                    "message": f"the file has {'session' if sf.format == 'GGSN' else 'state'} version "
                    f"{sf.version}, the installed llama.cpp loads version {have} only",
                }
                report.notes.append(f"test-load skipped: {report.test_load['message']}")
                return None
            return pool.load(path, settings_for(sf, n_gpu_layers=opts.n_gpu_layers), timeout=opts.timeout, sf=sf)
    except LoaderError as e:
        raise Operational(str(e)) from None


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
