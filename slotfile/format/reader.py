"""Read a slot or session file into friendly, lazy objects (one place for meaning).

``open_slot_file(path)`` maps the file read-only and never copies bulk data: every K/V/R/S
run, every blob and every token array is a zero-copy numpy view over the mmap.  Parsing never
raises on bad input: every problem becomes a :class:`Problem` naming the section and the
byte offset, and everything that could be read before and after it is still described.
"""

from __future__ import annotations

import mmap
import os
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from construct import ConstructError

from slotfile.format import appendix as ap
from slotfile.format import grammar as g
from slotfile.format.layout import (
    ARCH_SEQUENCES,
    PARTIAL_OF,
    SEQUENCES,
    Confidence,
    Detection,
    Failure,
    Kinds,
    MemoryKind,
    appendix_at,
    detect,
    failure_of,
)
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
from slotfile.format.types import TYPES

if TYPE_CHECKING:
    from slotfile.model.bridge import ModelInfo

# The records used to live here; other modules still import them from the reader.
__all__ = [
    "GGSN_VERSIONS",
    "GGSQ_VERSIONS",
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
    "open_slot_file",
    "parse_buffer",
]

# Which llama.cpp line writes and loads each state version (slot-format.md §12).
GGSQ_VERSIONS = {
    2: "llama.cpp builds of mid-2024 to 2026-08 (KV blocks without n_stream until mid-2025; an 8-byte M-RoPE "
    "cell ext (x, y) in 2026 builds; llama-cpp-python 0.3.35 vendors the last)",
    3: "llama.cpp of 2026 up to about October (llama-cpp-python 0.3.36 vendors this)",
    4: "llama.cpp from 2026-10-05 on (every KV stream records its K/V rotation widths n_rot_k, n_rot_v)",
}
GGSN_VERSIONS = {
    9: "llama.cpp builds of 2025 to 2026-08 (until some point of 2026 the session body carried output ids, "
    "logits, embeddings; KV blocks without n_stream until mid-2025)",
    10: "llama.cpp of 2026 up to about October (llama-cpp-python 0.3.36)",
    11: "llama.cpp from 2026-10-05 on (as state version 4: every KV stream records n_rot_k, n_rot_v)",
}
# How far past the newest known version a file is still read by trial (as the newest layout
# with a few unknown words per KV stream, with a warning); anything further is refused.
TRIAL_AHEAD = 2


# ---------------------------------------------------------------------------------------


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
    with open(p, "rb") as f:
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
        sf.problem("error", "internal", "file", 0, f"reader error: {type(e).__name__}: {e}")
    return sf


def _expectation(model: ModelInfo | None, given: ModelExpect | None) -> ModelExpect | None:
    if given is not None or model is None:
        return given
    from slotfile.model.expect import (
        expect_from_model,  # imported only with a model: start-up without one does not pay for it
    )

    return expect_from_model(model)


NOT_SLOT_FILE = "not-slot-file"  # the problem code of a recognised wrong input (a model, an archive, text)

# Files people pass by mistake, recognised by their first bytes: (magic, what it is, what to do).
FOREIGN_MAGICS: tuple[tuple[bytes, str, str], ...] = (
    (b"GGUF", "a GGUF model", "pass it with --model, and the slot file as the argument"),
    (b"\x1f\x8b", "a gzip-compressed file", "decompress it first (gunzip -k {file}) and pass the result"),
    (b"\x28\xb5\x2f\xfd", "a zstd-compressed file", "decompress it first (zstd -d {file}) and pass the result"),
    (b"\xfd7zXZ\x00", "an xz-compressed file", "decompress it first (xz -dk {file}) and pass the result"),
    (b"BZh", "a bzip2-compressed file", "decompress it first (bunzip2 -k {file}) and pass the result"),
    (b"PK\x03\x04", "a zip archive", "extract the slot file from it first (unzip {file})"),
    (b"\x7fELF", "an executable (ELF)", "pass the file llama-server wrote under --slot-save-path"),
)
TEXT_SAMPLE = 4096  # bytes looked at to call a file text


def recognise_foreign(head: bytes, size: int, path: str = "FILE") -> str | None:
    """A one-line description of a file that is clearly not a slot or session file (a GGUF
    model, a compressed file, text), with what to pass instead; None when it is not one of
    these (then a wrong magic means damage).  An empty file is not one of them: it is a slot
    file cut at 0 (a save that failed before writing), reported as truncated."""
    for magic, what, todo in FOREIGN_MAGICS:
        if head.startswith(magic):
            return f"this is {what}, not a slot file: {todo.format(file=shlex.quote(path))}"
    if _is_text(head):
        start = head[:40].decode("utf-8", "replace").split("\n")[0]
        return (
            f"this is a text file (it starts {start!r}), not a slot file: slot files are binary, "
            "written by llama-server's POST /slots/{id}?action=save"
        )
    return None


def _is_text(head: bytes) -> bool:
    """Mostly printable: no NUL, and at least 95 % printable ASCII, whitespace or UTF-8 text
    (a slot file starts with a binary magic and little-endian integers full of zero bytes)."""
    sample = head[:TEXT_SAMPLE]
    if not sample or b"\x00" in sample:
        return False
    text = sample.decode("utf-8", "replace")
    printable = sum(1 for ch in text if ch.isprintable() or ch in "\n\r\t")
    return printable >= 0.95 * len(text)


def _parse_file(sf: SlotFile, view: memoryview) -> None:
    size = len(view)
    magic = bytes(view[:4])
    slot_magics = (g.GGSQ_MAGIC.to_bytes(4, "little"), g.GGSN_MAGIC.to_bytes(4, "little"))
    if size and not any(m.startswith(magic) for m in slot_magics):  # a cut magic ("qs") is a cut slot file
        foreign = recognise_foreign(bytes(view[:TEXT_SAMPLE]), size, sf.path)
        if foreign is not None:
            sf.problem("error", NOT_SLOT_FILE, "header", 0, foreign)
            return
    if size == 0:
        sf.problem(
            "error",
            "truncated",
            "header",
            0,
            "empty file (0 bytes): nothing was saved in it (a save that "
            "failed before writing, or a file created empty); there is nothing to recover",
        )
        return
    if size < 12:
        sf.problem("error", "truncated", "header", size, f"file of {size} bytes: a header needs 12")
        if magic in (b"qsgg", b"nsgg"):
            sf.format = FileFormat.GGSQ if magic == b"qsgg" else FileFormat.GGSN
        return
    hdr = g.FileHeader.parse(bytes(view[:12]))
    sf.version, sf.n_token_count = hdr.version, hdr.n_token_count
    sf.sections.append(Section("header", 0, 12))
    if hdr.magic == g.GGSQ_MAGIC:
        sf.format = FileFormat.GGSQ
        known = GGSQ_VERSIONS
    elif hdr.magic == g.GGSN_MAGIC:
        sf.format = FileFormat.GGSN
        known = GGSN_VERSIONS
    else:
        zeros = (
            " (all its first bytes are zero: the data was never written, or was wiped)"
            if not any(view[:TEXT_SAMPLE])
            else ""
        )
        sf.problem(
            "error",
            "bad-magic",
            "header",
            0,
            f"magic 0x{hdr.magic:08x} is neither GGSQ (slot file) nor GGSN (session file){zeros}",
        )
        return
    if hdr.version not in known and not _trial_version(sf):
        sf.problem(
            "error",
            "bad-version",
            "header",
            4,
            f"{sf.format} version {hdr.version} is unknown (known: {', '.join(map(str, known))})",
        )
        return
    n = hdr.n_token_count
    if n > (size - 12) // 4:  # the same check as llama_context::state_seq_load_file
        sf.problem(
            "error",
            "truncated",
            "tokens",
            12,
            f"header declares {n} token words ({4 * n} bytes), {size - 12} bytes remain",
        )
        return
    body_start = 12 + 4 * n
    _parse_tokens(sf, view, n, packed_allowed=sf.format == FileFormat.GGSQ)
    if sf.format == FileFormat.GGSN:
        body_start = _parse_session_prefix(sf, view, body_start)
        if body_start is None:
            return
    _parse_body(sf, view, body_start)
    if sf.body is None or sf.body.layout is None:
        return
    end = sf.body.end
    if sf.format == FileFormat.GGSN:
        if end != size:  # llama_context::state_load_file demands exact consumption
            sf.trailing = (end, size - end)
            sf.sections.append(Section("trailing", end, size - end))
            sf.problem(
                "error",
                "trailing-bytes",
                "trailing",
                end,
                f"{size - end} bytes after the session state (the loader refuses them)",
            )
        _check_semantics(sf)
        return
    _parse_appendices(sf, view, end)
    _check_semantics(sf)


def _parse_tokens(sf: SlotFile, view: memoryview, n: int, packed_allowed: bool) -> None:
    start, end = 12, 12 + 4 * n
    sf.sections.append(Section("tokens", start, 4 * n))
    words = np.frombuffer(view, dtype="<i4", count=n, offset=start)
    if n == 0:
        sf.tokens = TokenPayload(TokenForm.EMPTY, start, 0, words)
        return
    if not packed_allowed or int(words[0]) != g.PACKED_MARKER:
        sf.tokens = TokenPayload(TokenForm.PLAIN, start, n, words)
        return
    s = g.ViewStream(view, start, end)
    try:
        c = g.PackedTokens.parse_stream(s)
    except ConstructError as e:
        f = failure_of(e, s)
        where = f" ({f.loc})" if f.loc else ""
        sf.problem("error", f.code, "tokens", f.offset, f"packed server_tokens payload{where}: {f.message}")
        sf.tokens = TokenPayload(
            TokenForm.PACKED, start, n, np.empty(0, np.int32), version=int(words[1]) if n > 1 else None
        )
        return
    media = [
        {
            "key": int(k),
            "offset": m["offset"],
            "length": m["length"],
            "type": int(m["chunk"].type),
            "n_text": int(m["chunk"].n_text),
        }
        for k, m in zip(c.media_keys, c.media, strict=False)
    ]
    sf.tokens = TokenPayload(TokenForm.PACKED, start, n, c.tokens, c.version, media, c.padding.length, raw=c)


def _parse_session_prefix(sf: SlotFile, view: memoryview, off: int) -> int | None:
    s = g.ViewStream(view, off, len(view))
    try:
        a = g.ArchString.parse_stream(s)
    except ConstructError as e:
        f = failure_of(e, s)
        sf.problem("error", f.code, "arch", f.offset, f"architecture name: {f.message}")
        return None
    sf.arch = bytes(a.data.view).decode("utf-8", "replace")
    sf.sections.append(Section("arch", off, s.tell() - off, sf.arch))
    if sf.version == 9:
        start = s.tell()
        try:
            g.GgsnV9Extra.parse_stream(s)
        except ConstructError:
            # llama.cpp stopped writing outputs/logits/embeddings into the session without bumping
            # GGSN 9: the version-9 llama.cpp of 2026-08 (llama-cpp-python 0.3.35,
            # llama_context::state_write_data) writes the arch and then the memory, as version 10
            # does. Such a file's first body word (n_stream) never parses as a v9 outputs section
            # (its logits size would be a cell's pos | n_seq_id << 32), so read the body right here.
            return start
        sf.sections.append(Section("outputs", start, s.tell() - start, "v9 output ids, logits, embeddings"))
    return s.tell()


def _parse_body(sf: SlotFile, view: memoryview, start: int) -> None:
    whole = sf.format == FileFormat.GGSN
    end = len(view)
    if _is_dsv4(view, start, end):
        sf.problem("error", "unsupported-layout", "body", start, "DeepSeek-V4 (DSV4) state frame: not supported yet")
        sf.body = Body(start, end, None, Confidence.NONE)
        return
    extras = TRIAL_EXTRAS if _trial_version(sf) else ((0, 0),)

    def attempt(rot: bool) -> Detection:
        return _detect_with_model(
            sf,
            view,
            start,
            end,
            sf.expect,
            False,
            "body",
            whole=whole,
            exact=whole,
            sequences=_sequences_for(sf),
            extras=extras,
            legacy=_may_be_legacy(sf),
            rot=rot,
        )

    det = attempt(has_rot(sf))
    if (det.layout is None or det.confidence == Confidence.TRAILING) and _rot_matters(sf):
        # the version word and the body disagree: read the body the other way to describe it
        other = attempt(not has_rot(sf))
        if other.layout is not None and other.confidence != Confidence.TRAILING:
            det = other
            if not _trial_version(sf):
                _report_version_layout(sf, other.layout.rot)
    sf.body = _body_from(det, start)
    if det.layout is not None and det.layout.legacy:
        sf.problem(
            "warning",
            "legacy-layout",
            "body",
            start,
            f"{sf.format} {sf.version} body in the layout of llama.cpp before mid-2025 (KV blocks without "
            "n_stream, single-sequence cells without seq id); current llama.cpp cannot load it"
            + ("; the model comparison covers current layouts only" if sf.expect is not None else ""),
        )
    if _trial_version(sf) and not _report_trial(sf, det, start, end):
        return
    if det.layout is None:
        f = det.failure
        if f is None:
            sf.problem("error", "unknown-layout", "body", start, "no known block layout parses this body")
        else:
            where = f"{f.layout}, {f.loc}" if f.loc else f.layout
            sev = "truncated" if f.code == "truncated" else f.code
            msg = f"{'truncated' if f.code == 'truncated' else 'damaged'} inside the body ({where}): {f.message}"
            sf.problem("error", sev, "body", f.offset, msg)
        sf.sections.append(Section("body", start, end - start, "unreadable"))
        return
    sf.sections.append(Section("body", start, det.end - start, det.layout.describe()))
    for b in sf.body.blocks:
        sf.sections.append(Section(f"body.{b.role}", b.offset, b.size, b.kind))
    # A KV block without V is an MLA or indexer cache, or a file cut where V starts.  Only the
    # second reading needs a word: not when the model decides (it reports its own mismatch), and
    # not when an appendix follows the body (nothing was cut there).
    at_eof = det.end == end
    for b in sf.body.blocks:
        if b.kind == MemoryKind.KV and not b.has_v and b.n_cells() and sf.expect is None and at_eof:
            sf.problem(
                "warning",
                "k-only",
                f"body.{b.role}",
                b.end,
                "KV block without V (an MLA or indexer cache); for any other model the file "
                f"was cut at offset {b.end}, where V should start (give --model to decide)",
            )
    if det.confidence == Confidence.AMBIGUOUS:
        alts = "; ".join(a.describe() for a in det.alternatives)
        sf.problem(
            "warning",
            "ambiguous-layout",
            "body",
            start,
            f"the bytes also parse as {alts}; chose {det.layout.describe()} (give --model to decide)",
        )


def _detect_with_model(
    sf: SlotFile,
    view: memoryview,
    start: int,
    end: int,
    exp: ModelExpect | None,
    partial: bool,
    section: str,
    **kw: Any,
) -> Detection:
    """Detect with the model's layout when there is one; when the bytes do not fit it, fall
    back to what the bytes alone say (so the rest can still be described; the model check
    then names each disagreement).  The model's layout that leaves bytes over loses to a
    layout that explains them all: that is a wrong model, not a damaged file."""
    if exp is None or not exp.modelled:
        return detect(view, start, end, **kw)
    from slotfile.model.expect import layout_of

    want = layout_of(exp, partial=partial)
    fixed = detect(view, start, end, fixed=want, **{k: v for k, v in kw.items() if k in ("whole", "exact", "rot")})
    if fixed.layout is not None and fixed.confidence != Confidence.TRAILING:
        return fixed
    free = detect(view, start, end, **kw)
    if free.layout is not None and (fixed.layout is None or free.confidence != Confidence.TRAILING):
        return free
    return fixed  # its failure says where the model's layout stops fitting


# Trial shapes for a version newer than slotfile knows: (unknown u32 words before v_trans,
# after the rotation words) in each KV stream, on top of the newest known layout.
TRIAL_EXTRAS = ((0, 0), (1, 0), (2, 0), (0, 1), (0, 2), (1, 1), (2, 2))


def _is_dsv4(view: memoryview, start: int, end: int) -> bool:
    """A llama_kv_cache_dsv4 frame (DeepSeek-V4) starts here: its own magic, not a KV block."""
    return start + 4 <= end and int.from_bytes(view[start : start + 4], "little") == g.DSV4_MAGIC


def _may_be_legacy(sf: SlotFile) -> bool:
    """State version 2 and session version 9 were written both before and after llama.cpp
    added n_stream to the KV block (mid-2025), without a version bump."""
    return (sf.format, sf.version) in ((FileFormat.GGSQ, 2), (FileFormat.GGSN, 9))


def _newest(sf: SlotFile) -> int:
    return max(GGSN_VERSIONS if sf.format == FileFormat.GGSN else GGSQ_VERSIONS)


def has_rot(sf: SlotFile) -> bool:
    """Whether the file's KV streams carry n_rot_k / n_rot_v: state version 4 and session version
    11 on (llama_kv_cache::state_write_data of llama.cpp 2026-10-06); a version read by trial is
    read as the newest known layout, so it has them too."""
    if sf.version is None:
        return False
    first = g.ROT_SESSION_VERSION if sf.format == FileFormat.GGSN else g.ROT_STATE_VERSION
    return sf.format in (FileFormat.GGSQ, FileFormat.GGSN) and sf.version >= first


def _body_rot(sf: SlotFile) -> bool:
    """Whether blobs carry the rotation words: as the body was read (their version is the
    file's), or as the version says when there is no readable body."""
    if sf.body is not None and sf.body.layout is not None and sf.body.blocks:
        return sf.body.layout.rot
    return has_rot(sf)


def _rot_matters(sf: SlotFile) -> bool:
    """Versions around the rotation words' arrival (state 3/4, session 10/11, and trial ones),
    where a body with the other layout is told apart rather than called damaged."""
    if sf.version is None or sf.format not in (FileFormat.GGSQ, FileFormat.GGSN):
        return False
    first = g.ROT_SESSION_VERSION if sf.format == FileFormat.GGSN else g.ROT_STATE_VERSION
    return sf.version >= first - 1


def _report_version_layout(sf: SlotFile, body_rot: bool) -> None:
    first = g.ROT_SESSION_VERSION if sf.format == FileFormat.GGSN else g.ROT_STATE_VERSION
    what = (
        f"every KV stream carries the rotation words of version {first}"
        if body_rot
        else f"no KV stream carries the rotation words version {sf.version} has"
    )
    sf.problem(
        "error",
        "version-layout",
        "header",
        4,
        f"the header says {sf.format} version {sf.version}, but {what}: the version word was changed "
        f"without converting the body, and a llama.cpp of version {sf.version} would misread it "
        "(slotfile migrate converts between versions)",
    )


def _trial_version(sf: SlotFile) -> bool:
    """A version a little newer than the newest slotfile knows: read by trial, with a warning."""
    if sf.format not in (FileFormat.GGSQ, FileFormat.GGSN) or sf.version is None:
        return False
    return _newest(sf) < sf.version <= _newest(sf) + TRIAL_AHEAD


def _report_trial(sf: SlotFile, det: Detection, start: int, end: int) -> bool:
    """The warning (or, when nothing fits, the error) of a trial-read body; False: unreadable."""
    newest = _newest(sf)
    if det.layout is None:
        f = det.failure
        sf.problem(
            "error",
            "unsupported-version",
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
        f"like version {like} with {x[0]} unknown u32 word(s) before v_trans and {x[1]} {after} in each stream"
        if x != (0, 0)
        else f"exactly like version {like}"
    )
    sf.problem(
        "warning",
        "trial-version",
        "body",
        start,
        f"{sf.format} version {sf.version} parsed by trial, {how} (slotfile knows versions up to {newest}); "
        "the meaning of any new fields is unknown",
    )
    return True


def _sequences_for(sf: SlotFile) -> list[Kinds]:
    """Candidate block sequences: those a session's arch name allows, when it names one."""
    return list(ARCH_SEQUENCES.get(sf.arch or "", SEQUENCES))


def _body_from(det: Detection, start: int) -> Body:
    body = Body(start, det.end, det.layout, det.confidence, alternatives=det.alternatives)
    if det.layout is None:
        return body
    for role, spec, raw in zip(det.layout.roles(), det.layout.blocks, det.blocks, strict=False):
        body.blocks.append(_kv_from(role, raw, spec.has_v) if spec.kind == MemoryKind.KV else _rec_from(role, raw))
    return body


def _kv_from(role: str, c: Any, has_v: bool) -> MemoryBlock:
    blk = MemoryBlock(role, MemoryKind.KV, c.offset, c.end, has_v=has_v, n_stream=c.n_stream, raw=c)
    for i, sc in enumerate(c.streams):
        st = KVStream(i, sc.offset, sc.cell_count)
        d = sc.data
        if d is not None:
            st.cells, st.v_trans, st.n_layer = d.meta, d.v_trans, d.n_layer
            if d.n_rot_k is not None:
                st.n_rot_k, st.n_rot_v, st.rot_offset = d.n_rot_k, d.n_rot_v, int(d.v_trans_offset) + 8
            st.k = [LayerRun("K", j, L.offset, L.type, L.row_size, sc.cell_count, L.data) for j, L in enumerate(d.k)]
            for j, L in enumerate(d.v):
                if d.v_trans:
                    st.v.append(
                        LayerRun(
                            "V",
                            j,
                            L.offset,
                            L.type,
                            L.n_embd * L.el_size,
                            sc.cell_count,
                            L.data,
                            transposed=True,
                            n_embd=L.n_embd,
                        )
                    )
                else:
                    st.v.append(LayerRun("V", j, L.offset, L.type, L.row_size, sc.cell_count, L.data))
        blk.streams.append(st)
    return blk


def _rec_from(role: str, c: Any) -> MemoryBlock:
    blk = MemoryBlock(
        role, MemoryKind.REC, c.offset, c.end, cell_count=c.cell_count, cells=c.meta, n_layer=c.n_layer, raw=c
    )
    for j, e in enumerate(c.r):
        if "r" in e:  # an R entry followed by its PLE conv rows
            blk.r.append(LayerRun("R", j, e.r.offset, e.r.type, e.r.row_size, c.cell_count, e.r.data))
            blk.p.append(LayerRun("P", j, e.p.offset, e.r.type, e.p.row_size, c.cell_count, e.p.data))
        else:
            blk.r.append(LayerRun("R", j, e.offset, e.type, e.row_size, c.cell_count, e.data))
    blk.s = [LayerRun("S", j, e.offset, e.type, e.row_size, c.cell_count, e.data) for j, e in enumerate(c.s)]
    return blk


# ---------------------------------------------------------------------------------------
# appendices
# ---------------------------------------------------------------------------------------


def _parse_appendices(sf: SlotFile, view: memoryview, off: int) -> None:
    end = len(view)
    while off < end:
        magic = bytes(view[off : off + 4])
        if len(magic) < 4 and any(m.startswith(magic) for m in (g.SCKP_MAGIC, g.SDFT_MAGIC)):
            names = [m.decode() for m in (g.SCKP_MAGIC, g.SDFT_MAGIC) if m.startswith(magic)]
            name = names[0].lower() if len(names) == 1 else "appendix"
            sf.sections.append(Section(name, off, end - off, "cut inside the magic"))
            sf.problem(
                "error",
                "truncated",
                name,
                off,
                f"{' or '.join(names)} appendix cut after {len(magic)} bytes of its magic",
            )
            return
        if magic == g.SCKP_MAGIC and sf.sckp is None and sf.draft is None:
            nxt = _parse_sckp(sf, view, off)
        elif magic == g.SDFT_MAGIC and sf.draft is None:
            nxt = _parse_sdft(sf, view, off)
        else:
            break
        if nxt is None:
            return
        off = nxt
    if off < end:
        sf.trailing = (off, end - off)
        sf.sections.append(Section("trailing", off, end - off))
        magic = bytes(view[off : off + 4])
        what = {g.SCKP_MAGIC: "a second or misplaced SCKP appendix", g.SDFT_MAGIC: "a second SDFT appendix"}.get(
            magic, "unexplained bytes"
        )
        # The loader ignores these bytes, so the body still restores; but they are no known
        # appendix, which is how a cut or overwritten SCKP/SDFT looks: an error to report.
        sf.problem(
            "error",
            "trailing-bytes",
            "trailing",
            off,
            f"{end - off} bytes after the last section ({what}); the loader ignores them",
        )


def _blob(name: str, c: Any) -> BlobInfo:
    return BlobInfo(name, c.offset, c.length, c.data)


def _appendix_header(sf: SlotFile, head: Any, name: str, off: int, end: int) -> Any | None:
    """An appendix header from the walker; a cut one is reported and gives None."""
    if isinstance(head, Failure):
        sf.sections.append(Section(name, off, end - off, "damaged"))
        sf.problem("error", head.code, name, head.offset, f"{name.upper()} header: {head.message}")
        return None
    return head


def _parse_sckp(sf: SlotFile, view: memoryview, off: int) -> int | None:
    end = len(view)
    h = _appendix_header(sf, ap.sckp_head(view, off, end), "sckp", off, end)
    if h is None:
        sf.sckp = Appendix("SCKP", off, end, 0, complete=False)
        return None
    app = Appendix("SCKP", off, end, h.version, h.count)
    sf.sckp = app
    if h.version != g.SCKP_VERSION:
        sf.sections.append(Section("sckp", off, end - off, f"version {h.version}"))
        sf.problem(
            "error",
            "bad-version",
            "sckp",
            off + 4,
            f"SCKP version {h.version} (only 1 is known; the server ignores the appendix)",
        )
        app.complete = False
        return None
    if h.count > g.MAX_CHECKPOINTS:
        sf.sections.append(Section("sckp", off, end - off, "count over cap"))
        sf.problem(
            "error",
            "over-cap",
            "sckp",
            off + 8,
            f"checkpoint count {h.count} over the cap {g.MAX_CHECKPOINTS} (the server drops the appendix)",
        )
        app.complete = False
        return None
    for it in ap.entries(view, h.end, end, count=h.count):
        if isinstance(it, ap.Stop):
            if it.failure is not None:
                f, i = it.failure, it.index
                app.complete, app.end = False, end
                sf.sections.append(Section("sckp", off, end - off, f"{i} of {h.count} checkpoints complete"))
                sf.problem(
                    "error",
                    f.code,
                    f"sckp.{f.loc or f'checkpoint[{i}]'}",
                    f.offset,
                    f"checkpoint {i} of {h.count}: {f.message} (the server drops the whole appendix)",
                )
                return None
            app.end = it.offset
            break
        sf.checkpoints.append(
            Checkpoint(
                it.index,
                it.offset,
                it.end,
                it.n_tokens,
                it.pos_min,
                it.pos_max,
                _blob("data_tgt", it.tgt),
                _blob("data_dft", it.dft),
                _blob("data_spec", it.spec),
            )
        )
    sf.sections.append(Section("sckp", off, app.end - off, f"{h.count} checkpoints"))
    for ck in sf.checkpoints:
        sf.sections.append(Section(f"sckp.checkpoint[{ck.index}]", ck.offset, ck.end - ck.offset))
    _parse_checkpoint_blobs(sf, view)
    return app.end


def _parse_sdft(sf: SlotFile, view: memoryview, off: int) -> int | None:
    end = len(view)
    h = _appendix_header(sf, ap.sdft_head(view, off, end), "sdft", off, end)
    if h is None:
        return None
    app = Appendix("SDFT", off, end, h.version)
    sf.draft = app
    if h.version != g.SDFT_VERSION:
        app.complete = False
        sf.sections.append(Section("sdft", off, end - off, f"version {h.version}"))
        sf.problem("error", "bad-version", "sdft", off + 4, f"SDFT version {h.version} (only 1 is known)")
        return None
    b = ap.sdft_body(view, h, end)
    if isinstance(b, Failure):
        app.complete = False
        sf.sections.append(Section("sdft", off, end - off, "damaged"))
        sf.problem(
            "error",
            b.code,
            f"sdft.{b.loc}" if b.loc else "sdft",
            b.offset,
            f"draft appendix: {b.message} (the server drops the draft state)",
        )
        return None
    app.end = b.end
    app.dft, app.spec = _blob("data_dft", b.dft), _blob("data_spec", b.spec)
    sf.sections.append(Section("sdft", off, app.end - off, "draft state"))
    if app.dft.length:
        _parse_seq_blob(sf, view, app.dft, "sdft.data_dft", partial=None, exp=sf.draft_expect)
    return app.end


def _parse_checkpoint_blobs(sf: SlotFile, view: memoryview) -> None:
    body_class = sf.body.memory_class if sf.body else "unknown"
    partial = PARTIAL_OF.get(body_class)
    for ck in sf.checkpoints:
        sec = f"sckp.checkpoint[{ck.index}]"
        if ck.tgt.length == 0:
            sf.problem(
                "error", "empty-blob", sec, ck.tgt.offset, "data_tgt is empty (the server drops the whole appendix)"
            )
        else:
            _parse_seq_blob(sf, view, ck.tgt, f"{sec}.data_tgt", partial=partial, exp=sf.expect, exp_partial=True)
        if ck.dft.length:
            dl = sf.draft.dft.body.layout if sf.draft and sf.draft.dft and sf.draft.dft.body else None
            _parse_seq_blob(
                sf,
                view,
                ck.dft,
                f"{sec}.data_dft",
                partial=PARTIAL_OF.get(dl.memory_class) if dl else None,
                exp=sf.draft_expect,
                exp_partial=True,
            )


def _parse_seq_blob(
    sf: SlotFile,
    view: memoryview,
    blob: BlobInfo,
    section: str,
    partial: tuple[str, ...] | None,
    exp: ModelExpect | None = None,
    exp_partial: bool = False,
) -> None:
    """A ``llama_state_seq_get_data`` blob: io_magic, seq_id, then a body that fills the blob."""
    start, end = blob.data_offset, blob.data_offset + blob.length
    seq_id = ap.blob_seq_id(view, start, end)
    if isinstance(seq_id, Failure):
        sf.problem("error", seq_id.code, section, seq_id.offset, f"blob prefix: {seq_id.message}")
        return
    blob.seq_id = seq_id
    if _is_dsv4(view, start + 8, end):
        blob.body = Body(start + 8, end, None, "none")
        sf.problem(
            "error", "unsupported-layout", section, start + 8, "DeepSeek-V4 (DSV4) state frame: not supported yet"
        )
        return
    seqs = [partial] + [q for q in SEQUENCES if q != partial] if partial else list(SEQUENCES)
    det = _detect_with_model(
        sf,
        view,
        start + 8,
        end,
        exp,
        exp_partial,
        section,
        exact=True,
        sequences=seqs,
        extras=TRIAL_EXTRAS if _trial_version(sf) else ((0, 0),),
        rot=_body_rot(sf),
    )
    blob.body = _body_from(det, start + 8)
    if exp is not None and blob.body.layout is not None:
        return  # read in the model's layout: modelcheck.check_against_model judges it
    if det.layout is None:
        f = det.failure
        msg = f"{f.message} ({f.layout}{', ' + f.loc if f.loc else ''})" if f else "no known layout fills the blob"
        sf.problem(
            "error",
            f.code if f else "unknown-layout",
            section,
            f.offset if f else start + 8,
            f"blob body does not parse: {msg}",
        )
    elif partial is not None and det.layout.kinds != partial:
        sf.problem(
            "warning",
            "unexpected-layout",
            section,
            start + 8,
            f"blob holds {det.layout.describe()}; a PARTIAL_ONLY blob of this body should be "
            f"{' + '.join(partial) or 'empty'}",
        )


# ---------------------------------------------------------------------------------------
# consistency checks across sections
# ---------------------------------------------------------------------------------------


def _check_semantics(sf: SlotFile) -> None:
    body = sf.body
    if body is None or body.layout is None:
        return
    if not body.blocks:
        sf.problem(
            "warning",
            "empty-body",
            "body",
            body.offset,
            "no memory state: a model without memory, or a file cut right after the tokens",
        )
    for blk in body.blocks:
        _check_block(sf, blk, f"body.{blk.role}")
    for ck in sf.checkpoints:
        for b in (ck.tgt, ck.dft):
            if b.body is not None:
                for blk in b.body.blocks:
                    _check_block(sf, blk, f"sckp.checkpoint[{ck.index}].{b.name}.{blk.role}")
    if sf.draft and sf.draft.dft and sf.draft.dft.body:
        for blk in sf.draft.dft.body.blocks:
            _check_block(sf, blk, f"sdft.data_dft.{blk.role}")
    _check_tokens_vs_cells(sf)
    _check_checkpoints(sf)


def _check_block(sf: SlotFile, blk: MemoryBlock, sec: str) -> None:
    if blk.kind == MemoryKind.KV:
        active = blk.active_streams()
        if len(active) > 1 and sf.format == FileFormat.GGSQ:
            sf.problem(
                "error",
                "invalid",
                sec,
                blk.offset,
                f"{len(active)} non-empty streams in a single-sequence save (at most 1)",
            )
        for st in active:
            _check_rotation(sf, st, f"{sec}.stream[{st.index}]")
            ct = st.cells
            if ct is None:
                continue
            _check_positions(sf, ct.cells["pos"], ct.offset, ct.cells.dtype.itemsize, f"{sec}.stream[{st.index}]")
            seq = np.unique(ct.seq_ids)
            if sf.format == FileFormat.GGSQ and seq.size > 1:
                sf.problem(
                    "warning",
                    "invalid",
                    f"{sec}.stream[{st.index}]",
                    ct.offset,
                    f"cells carry {seq.size} different seq ids in a single-sequence save",
                )
    elif blk.cells is not None and blk.cell_count:
        _check_positions(sf, blk.cells.cells["pos"], blk.cells.offset, blk.cells.cells.dtype.itemsize, sec)
    for run in blk.runs():
        if run.type_id not in TYPES:
            sf.problem(
                "warning",
                "unknown-type",
                sec,
                run.offset,
                f"{run.part} layer {run.index}: ggml type id {run.type_id} is not known to this "
                "build (newer llama.cpp or a fork)",
            )


MAX_ROT = 1 << 16  # far above any head size: a Hadamard matrix of this width would be 16 GiB of f32


def _check_rotation(sf: SlotFile, st: KVStream, sec: str) -> None:
    """n_rot_k / n_rot_v of a version-4 stream: 0 (not rotated) or a power of two from 64 (the
    llama_kv_cache constructor starts at 64 and doubles); anything else is damage, and a
    llama.cpp would refuse the load ("incompatible key/value rotation")."""
    if st.rot_offset is None:
        return
    for i, (name, value) in enumerate((("n_rot_k", st.n_rot_k), ("n_rot_v", st.n_rot_v))):
        v = int(value or 0)
        if v and not (64 <= v <= MAX_ROT and v & (v - 1) == 0):
            sf.problem(
                "error",
                "bad-rotation",
                sec,
                st.rot_offset + 4 * i,
                f"{name} {v} is not a rotation width (0, or a power of two from 64); "
                f"llama.cpp would refuse the load (incompatible {'key' if i == 0 else 'value'} rotation)",
            )


def _check_positions(sf: SlotFile, pos: np.ndarray, off: int, stride: int, sec: str) -> None:
    if not pos.size:
        return
    neg = np.flatnonzero(pos < 0)
    if neg.size:
        i = int(neg[0])
        sf.problem("error", "bad-position", sec, off + i * stride, f"cell {i} has negative position {int(pos[i])}")
    # Cells are written in cell-index order (state_write_meta walks the cell ranges), not in
    # position order: after an SWA ring wraps or freed cells are reused, positions go back.
    # That is normal, so their order is not checked.


def _check_tokens_vs_cells(sf: SlotFile) -> None:
    if (
        sf.tokens is None
        or sf.body is None
        or not sf.body.blocks
        or (sf.tokens.form == TokenForm.PACKED and sf.tokens.raw is None)
    ):
        return
    t = sf.n_tokens
    first = sf.body.blocks[0]
    pos = first.positions()
    if first.kind == MemoryKind.KV and first.role in ("kv", "kv-base") and not (sf.tokens.media):
        n = first.n_cells()
        if n != t:
            sf.problem(
                "warning",
                "token-mismatch",
                f"body.{first.role}",
                first.offset,
                f"token payload holds {t} tokens but the cache holds {n} cells",
            )
    if pos.size and int(pos.max()) + 1 > t and not sf.tokens.media:
        sf.problem(
            "warning",
            "token-mismatch",
            "body",
            sf.body.offset,
            f"highest cell position {int(pos.max())} is beyond the {t} stored tokens",
        )


def _check_checkpoints(sf: SlotFile) -> None:
    t = sf.n_tokens
    prev = -1
    for ck in sf.checkpoints:
        sec = f"sckp.checkpoint[{ck.index}]"
        if ck.pos_min > ck.pos_max or ck.pos_min < 0:
            sf.problem("error", "bad-position", sec, ck.offset + 8, f"position range {ck.pos_min}..{ck.pos_max}")
        if ck.n_tokens < 0 or (t and ck.n_tokens > t):
            sf.problem(
                "warning", "token-mismatch", sec, ck.offset, f"n_tokens {ck.n_tokens} is beyond the {t} stored tokens"
            )
        if ck.n_tokens < prev:
            sf.problem(
                "warning",
                "checkpoint-order",
                sec,
                ck.offset,
                f"n_tokens {ck.n_tokens} after {prev} (checkpoints are written oldest first)",
            )
        prev = ck.n_tokens


def body_end_or_appendix(view: memoryview, off: int) -> bool:
    return appendix_at(view, off, len(view))
