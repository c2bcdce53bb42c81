"""How the reader treats a file's version word: which versions it knows, which carry the
rotation words, and the trial reading of a version a little newer than the newest known.

A version word and a body can disagree (a header edited without converting the body); these
helpers tell that apart from damage and describe it."""

from __future__ import annotations

from slotfile.format import versions
from slotfile.format.layout import (
    Detection,
)
from slotfile.format.records import (
    FileFormat,
    Section,
    SlotFile,
)
from slotfile.problems import ProblemCode, Severity
from slotfile.text import count

# ---------------------------------------------------------------------------------------


TRIAL_EXTRAS = ((0, 0), (1, 0), (2, 0), (0, 1), (0, 2), (1, 1), (2, 2))


def may_be_legacy(sf: SlotFile) -> bool:
    """State version 2 and session version 9 were written both before and after llama.cpp
    added n_stream to the KV block (mid-2025), without a version bump."""
    info = versions.version_info(str(sf.format), sf.version)
    return info is not None and info.n_stream is versions.NStream.SOMETIMES


def _newest(sf: SlotFile) -> int:
    return versions.newest(sf.format)


def has_rot(sf: SlotFile) -> bool:
    """Whether the file's KV streams carry n_rot_k / n_rot_v: state version 4 and session version
    11 on (llama_kv_cache::state_write_data of llama.cpp 2026-10-06); a version read by trial is
    read as the newest known layout, so it has them too."""
    if sf.version is None:
        return False
    if sf.format not in (FileFormat.GGSQ, FileFormat.GGSN):
        return False
    return sf.version >= versions.first_with_rotation(str(sf.format))


def body_rot(sf: SlotFile) -> bool:
    """Whether blobs carry the rotation words: as the body was read (their version is the
    file's), or as the version says when there is no readable body."""
    if sf.body is not None and sf.body.layout is not None and sf.body.blocks:
        return sf.body.layout.rot
    return has_rot(sf)


def rot_matters(sf: SlotFile) -> bool:
    """Versions around the rotation words' arrival (state 3/4, session 10/11, and trial ones),
    where a body with the other layout is told apart rather than called damaged."""
    if sf.version is None or sf.format not in (FileFormat.GGSQ, FileFormat.GGSN):
        return False
    return sf.version >= versions.first_with_rotation(sf.format) - 1


def report_version_layout(sf: SlotFile, body_rot: bool) -> None:
    first = versions.first_with_rotation(sf.format)
    what = (
        f"every KV stream carries the rotation words of version {first}"
        if body_rot
        else f"no KV stream carries the rotation words version {sf.version} has"
    )
    sf.problem(
        Severity.ERROR,
        ProblemCode.VERSION_LAYOUT,
        "header",
        4,
        f"the header says {sf.format} version {sf.version}, but {what}: the version word was changed "
        f"without converting the body, and a llama.cpp of version {sf.version} would misread it "
        "(slotfile migrate converts between versions)",
    )


def trial_version(sf: SlotFile) -> bool:
    """A version a little newer than the newest slotfile knows: read by trial, with a warning."""
    if sf.format not in (FileFormat.GGSQ, FileFormat.GGSN) or sf.version is None:
        return False
    return _newest(sf) < sf.version <= _newest(sf) + versions.TRIAL_AHEAD


def report_trial(sf: SlotFile, det: Detection, start: int, end: int) -> bool:
    """The warning (or, when nothing fits, the error) of a trial-read body; False: unreadable."""
    newest = _newest(sf)
    if det.layout is None:
        f = det.failure
        sf.problem(
            Severity.ERROR,
            ProblemCode.UNSUPPORTED_VERSION,
            "body",
            f.offset if f else start,
            f"{sf.format} version {sf.version} is newer than slotfile knows (up to {newest}) and no trial "
            f"layout fits this body; refused" + (f" (deepest parse: {f.message})" if f else ""),
        )
        sf.sections.append(Section("body", start, end - start, f"version {sf.version}, unreadable"))
        return False
    x = det.layout.extra
    like = newest if det.layout.rot else newest - 1  # without the rotation words: the layout before them
    after = "after the rotation words" if det.layout.rot else "after n_layer"
    how = (
        f"like version {like} with {count(x[0], 'unknown u32 word')} before v_trans and {x[1]} {after} in each stream"
        if x != (0, 0)
        else f"exactly like version {like}"
    )
    sf.problem(
        Severity.WARNING,
        ProblemCode.TRIAL_VERSION,
        "body",
        start,
        f"{sf.format} version {sf.version} parsed by trial, {how} (slotfile knows versions up to {newest}); "
        "the meaning of any new fields is unknown",
    )
    return True
