"""Level 3, test-load: the real llama.cpp loader in a worker process
(:class:`slotfile.llama.loader.LoaderPool`) restores the body, every checkpoint's ``data_tgt``
and the draft state; a file of another state or session version than the loader's is skipped
with a sentence naming the llama.cpp line that loads it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from slotfile.format import versions
from slotfile.format.records import FileFormat, SlotFile
from slotfile.problems import CheckLevel, ProblemCode
from slotfile.verify.records import Level, SkipKind

if TYPE_CHECKING:  # the loader is imported once a file was loaded: a structure-only run needs none of it
    from slotfile.llama.loader import LoaderPool, LoadResult


def version_message(sf: SlotFile, loader_version: int | None, loader_name: str, tried: str | None = None) -> str | None:
    """A plain sentence when the file's state version is not the loader's.  ``tried``: what
    the search for another library found (the llama-server on PATH)."""
    if sf.format != FileFormat.GGSQ or sf.version is None or loader_version is None or sf.version == loader_version:
        return None
    v = sf.version
    info = versions.version_info(FileFormat.GGSQ, v)
    who = info.writer if info else None
    line = info.loaders if info else None
    msg = f"this file has state version {v}, the loader ({loader_name}) only loads version {loader_version}"
    msg += f" ({tried})" if tried else ""
    if who:
        msg += f": pass --llama-lib DIR with a version {v} build of llama.cpp (version {v}: {who}"
        msg += f"; also {line})" if line and v < int(loader_version) else ")"
    else:
        msg += f"; no known llama.cpp line writes version {v}"
    return msg


def level_load(
    sf: SlotFile, res: LoadResult | None, pool: LoaderPool | None, draft_model: bool, tried: str | None = None
) -> Level:
    """``pool``: the loader that test-loaded the file; ``tried``: what the search for a library
    of the file's version found when that loader's version differs (for the message)."""
    lv = Level(CheckLevel.LOAD)
    if pool is None or res is None:
        return lv.skip("no --model")
    from slotfile.llama.loader import LIB_ENV

    info = pool.info
    vmsg = _load_version_message(sf, info, tried)
    lv.details = {
        "library": info.get("library"),
        "body_bytes": res.body_bytes,
        "crashed": res.crashed,
        "message": res.message,
        "checkpoints": [list(c) for c in res.checkpoints],
        "draft": list(res.draft) if res.draft else None,
        "checkpoint_drafts": [list(c) for c in res.checkpoint_drafts],
        "log": res.log,
    }
    if not res.ok:
        # The loader slotfile found by itself cannot judge a file of another version: skipped,
        # not failed.  A library the user named (--llama-lib, $SLOTFILE_LLAMA_LIB) that cannot
        # load the file is the run's failure: the user asked for exactly that load.
        explicit = info.get("library_source") in ("--llama-lib", LIB_ENV)
        if vmsg and not res.crashed and not explicit:
            return lv.skip(vmsg, SkipKind.CANNOT_CHECK)
        if vmsg and not res.crashed:
            lv.error(ProblemCode.VERSION_MISMATCH, "header", 4, f"{vmsg} (llama.cpp: {res.message})")
        else:
            lv.error(
                ProblemCode.CRASHED if res.crashed else ProblemCode.LOAD_FAILED,
                "body",
                sf.body.offset if sf.body else None,
                ("llama.cpp crashed: " if res.crashed else "llama.cpp refused the file: ") + res.message,
            )
        return lv.finish()
    if (
        sf.format == FileFormat.GGSQ
        and sf.body is not None
        and sf.body.layout is not None
        and res.body_bytes != sf.body.end
    ):
        lv.error(
            ProblemCode.LOADER_DISAGREES,
            "body",
            sf.body.offset,
            f"llama.cpp's loader stopped at offset {res.body_bytes}; the reader's body ends at {sf.body.end}",
        )
    _appendix_load_problems(lv, sf, res, draft_model)
    return lv.finish()


def _load_version_message(sf: SlotFile, info: dict[str, Any], tried: str | None) -> str | None:
    """Why the loader's llama.cpp cannot judge a file of another state or session version."""
    from slotfile.llama.loader import library_label

    if sf.format == FileFormat.GGSN and sf.version is not None and sf.version != info.get("session_version"):
        ginfo = versions.version_info(FileFormat.GGSN, sf.version)
        known = ginfo.writer if ginfo else "no known llama.cpp line"
        return (
            f"this session file has version {sf.version}, the loader ({library_label(info)}) only loads session "
            f"version {info.get('session_version')}"
            + (f" ({tried})" if tried else "")
            + f": pass --llama-lib DIR with a llama.cpp build that writes session version {sf.version}; "
            f"version {sf.version} is written by {known}."
        )
    return version_message(sf, info.get("state_seq_version"), library_label(info), tried)


def _appendix_load_problems(lv: Level, sf: SlotFile, res: LoadResult, draft_model: bool) -> None:
    """What the loader said of the SCKP checkpoints and the SDFT draft state of a file whose
    body restored."""
    for note in res.notes:
        lv.warn(
            ProblemCode.APPENDIX_IGNORED,
            "sckp" if "SCKP" in note or "checkpoint" in note else "sdft",
            None,
            f"{note} (the restore itself succeeds)",
        )
    for i, (ok, msg) in enumerate(res.checkpoints):
        if not ok:
            off = sf.checkpoints[i].tgt.data_offset if i < len(sf.checkpoints) else None
            lv.error(ProblemCode.CHECKPOINT_REJECTED, f"sckp.checkpoint[{i}].data_tgt", off, msg)
    for i, (ok, msg) in enumerate(res.checkpoint_drafts):
        if not ok:
            off = sf.checkpoints[i].dft.data_offset if i < len(sf.checkpoints) else None
            lv.error(ProblemCode.CHECKPOINT_DRAFT_REJECTED, f"sckp.checkpoint[{i}].data_dft", off, msg)
    if res.draft is not None and not res.draft[0]:
        off = sf.draft.dft.data_offset if sf.draft is not None and sf.draft.dft is not None else None
        lv.error(ProblemCode.DRAFT_REJECTED, "sdft.data_dft", off, res.draft[1])
    has_dft = (sf.draft is not None and sf.draft.dft is not None and sf.draft.dft.length) or any(
        ck.dft.length for ck in sf.checkpoints
    )
    if has_dft and not draft_model:
        lv.warn(
            ProblemCode.DRAFT_NOT_LOADED,
            "sdft" if sf.draft is not None else "sckp",
            None,
            "the file holds draft state; give --draft-model to test-load it",
        )
