"""Read a slot or session file into friendly, lazy objects (one place for meaning).

``open_slot_file(path)`` maps the file read-only and never copies bulk data: every K/V/R/S
run, every blob and every token array is a zero-copy numpy view over the mmap.  Parsing never
raises on bad input: every problem becomes a :class:`Problem` naming the section and the
byte offset, and everything that could be read before and after it is still described.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from construct import ConstructError

from slotfile.format import grammar as g
from slotfile.format import versions
from slotfile.format.foreign import TEXT_SAMPLE, recognise_foreign
from slotfile.format.read_appendix import parse_appendices
from slotfile.format.read_body import parse_body, parse_session_prefix, parse_tokens
from slotfile.format.read_checks import check_semantics
from slotfile.format.read_version import has_rot, trial_version
from slotfile.format.records import (
    Appendix,
    BlobInfo,
    Body,
    Checkpoint,
    FileFormat,
    KVStream,
    LayerRun,
    MemoryBlock,
    ModelExpect,
    Problem,
    Section,
    Severity,
    SlotFile,
    TokenForm,
    TokenPayload,
)
from slotfile.problems import ProblemCode

if TYPE_CHECKING:
    from slotfile.model.bridge import ModelInfo

# The records are re-exported: ``from slotfile.format.reader import SlotFile`` is the public path
# next to open_slot_file, and the version tables and has_rot are the reader's word on versions.
__all__ = [
    "Appendix",
    "BlobInfo",
    "Body",
    "Checkpoint",
    "FileFormat",
    "KVStream",
    "LayerRun",
    "MemoryBlock",
    "Problem",
    "Section",
    "Severity",
    "SlotFile",
    "TokenForm",
    "TokenPayload",
    "has_rot",
    "open_slot_file",
    "parse_buffer",
    "recognise_foreign",
]


def open_slot_file(
    path: str | os.PathLike[str],
    model: ModelInfo | None = None,
    draft_model: ModelInfo | None = None,
    *,
    expect: ModelExpect | None = None,
    draft_expect: ModelExpect | None = None,
) -> SlotFile:
    """Map ``path`` read-only and parse it.  Raises OSError only for an unreadable path.

    ``model`` / ``draft_model``: :class:`slotfile.model.bridge.ModelInfo` of the target and draft
    GGUF (or ``expect`` / ``draft_expect``, their expectation already built); the layout then
    comes from the model and every disagreement is a problem (:mod:`slotfile.model.check`)."""
    p = Path(path)
    with open(p, "rb", buffering=0) as f:  # unbuffered: nothing is read through it
        size = os.fstat(f.fileno()).st_size
        buf: Any = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    return parse_buffer(buf, str(p), model=model, draft_model=draft_model, expect=expect, draft_expect=draft_expect)


def parse_buffer(
    buf: Any,
    path: str = "<buffer>",
    model: ModelInfo | None = None,
    draft_model: ModelInfo | None = None,
    *,
    expect: ModelExpect | None = None,
    draft_expect: ModelExpect | None = None,
) -> SlotFile:
    """Parse a whole file held in ``buf`` (bytes, mmap or anything with the buffer protocol)."""
    view = memoryview(buf).cast("B") if not isinstance(buf, memoryview) else buf
    sf = SlotFile(path=path, size=len(view), format=FileFormat.UNKNOWN, buffer=buf)
    try:
        sf.expect, sf.draft_expect = _expectation(model, expect), _expectation(draft_model, draft_expect)
        _parse_file(sf, view)
        if sf.expect is not None or sf.draft_expect is not None:
            from slotfile.model.check import check_against_model  # only with a model, like the expectation

            sf.problems += check_against_model(sf, sf.expect, sf.draft_expect)
    except (ConstructError, ValueError, OverflowError, IndexError) as e:  # a reader bug, never a crash
        sf.problem(Severity.ERROR, ProblemCode.INTERNAL, "file", 0, f"reader error: {type(e).__name__}: {e}")
    return sf


def _expectation(model: ModelInfo | None, given: ModelExpect | None) -> ModelExpect | None:
    if given is not None or model is None:
        return given
    from slotfile.model.expect import (
        expect_from_model,  # imported only with a model: start-up without one does not pay for it
    )

    return expect_from_model(model)


def _parse_file(sf: SlotFile, view: memoryview) -> None:
    """The whole file in order: header, tokens, a session's prefix, body, appendices, checks.
    Each step that finds the rest unreadable reports why and stops the walk."""
    if not _parse_header(sf, view):
        return
    size, n = len(view), sf.n_token_count or 0
    if n > (size - 12) // 4:  # the same check as llama_context::state_seq_load_file
        sf.problem(
            Severity.ERROR,
            ProblemCode.TRUNCATED,
            "tokens",
            12,
            f"header declares {n} token words ({4 * n} bytes), {size - 12} bytes remain",
        )
        return
    parse_tokens(sf, view, n, packed_allowed=sf.format == FileFormat.GGSQ)
    body_start = parse_session_prefix(sf, view, 12 + 4 * n) if sf.format == FileFormat.GGSN else 12 + 4 * n
    if body_start is None:
        return
    parse_body(sf, view, body_start)
    if sf.body is None or sf.body.layout is None:
        return
    end = sf.body.end
    if sf.format == FileFormat.GGSN:
        if end != size:  # llama_context::state_load_file demands exact consumption
            sf.trailing = (end, size - end)
            sf.sections.append(Section("trailing", end, size - end))
            sf.problem(
                Severity.ERROR,
                ProblemCode.TRAILING_BYTES,
                "trailing",
                end,
                f"{size - end} bytes after the session state (the loader refuses them)",
            )
    else:
        parse_appendices(sf, view, end)
    check_semantics(sf)


_FILE_HEADER = g.fixed_reader(g.FileHeader)  # the grammar's header at struct's speed (read once per file)


def _parse_header(sf: SlotFile, view: memoryview) -> bool:
    """Magic, version and token count (llama_state_seq_save_file's first 12 bytes); False when
    nothing after them can be read: a foreign or empty file, a cut header, a wrong magic or an
    unknown version."""
    size = len(view)
    magic = bytes(view[:4])
    slot_magics = (g.GGSQ_MAGIC.to_bytes(4, "little"), g.GGSN_MAGIC.to_bytes(4, "little"))
    if size and not any(m.startswith(magic) for m in slot_magics):  # a cut magic ("qs") is a cut slot file
        foreign = recognise_foreign(bytes(view[:TEXT_SAMPLE]), size, sf.path)
        if foreign is not None:
            sf.problem(Severity.ERROR, ProblemCode.NOT_SLOT_FILE, "header", 0, foreign)
            return False
    if size == 0:
        sf.problem(
            Severity.ERROR,
            ProblemCode.TRUNCATED,
            "header",
            0,
            "empty file (0 bytes): nothing was saved in it (a save that "
            "failed before writing, or a file created empty); there is nothing to recover",
        )
        return False
    if size < 12:
        sf.problem(Severity.ERROR, ProblemCode.TRUNCATED, "header", size, f"file of {size} bytes: a header needs 12")
        if magic in (b"qsgg", b"nsgg"):
            sf.format = FileFormat.GGSQ if magic == b"qsgg" else FileFormat.GGSN
        return False
    magic_word, sf.version, sf.n_token_count = _FILE_HEADER.unpack_from(view, 0)
    sf.sections.append(Section("header", 0, 12))
    return _check_magic_version(sf, view, magic_word, sf.version)


def _check_magic_version(sf: SlotFile, view: memoryview, magic: int, version: int) -> bool:
    """Set the format from the magic; False (with the problem) for a wrong magic or a version
    neither known nor readable by trial."""
    if magic == g.GGSQ_MAGIC:
        sf.format = FileFormat.GGSQ
    elif magic == g.GGSN_MAGIC:
        sf.format = FileFormat.GGSN
    else:
        zeros = (
            " (all its first bytes are zero: the data was never written, or was wiped)"
            if not any(view[:TEXT_SAMPLE])
            else ""
        )
        sf.problem(
            Severity.ERROR,
            ProblemCode.BAD_MAGIC,
            "header",
            0,
            f"magic 0x{magic:08x} is neither GGSQ (slot file) nor GGSN (session file){zeros}",
        )
        return False
    known = versions.known(sf.format)
    if version not in known and not trial_version(sf):
        sf.problem(
            Severity.ERROR,
            ProblemCode.BAD_VERSION,
            "header",
            4,
            f"{sf.format} version {version} is unknown (known: {', '.join(map(str, known))})",
        )
        return False
    return True
