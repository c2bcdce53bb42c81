"""Read the part of a file before its appendices: the token payload, a session's prefix and
the body (the memory blocks written by llama_memory::state_write), into records."""

from __future__ import annotations

from typing import Any

import numpy as np
from construct import ConstructError, Container, Struct

from slotfile.format import grammar as g
from slotfile.format import versions
from slotfile.format.layout import (
    ARCH_SEQUENCES,
    SEQUENCES,
    Confidence,
    Detection,
    Kinds,
    MemoryKind,
    detect,
    failure_of,
)
from slotfile.format.read_version import (
    TRIAL_EXTRAS,
    has_rot,
    may_be_legacy,
    report_trial,
    report_version_layout,
    rot_matters,
    trial_version,
)
from slotfile.format.records import (
    Body,
    FileFormat,
    KVStream,
    LayerRun,
    MemoryBlock,
    ModelExpect,
    Section,
    SlotFile,
    TokenForm,
    TokenPayload,
)
from slotfile.problems import ProblemCode, Severity


def parse_tokens(sf: SlotFile, view: memoryview, n: int, packed_allowed: bool) -> None:
    start, end = 12, 12 + 4 * n
    sf.sections.append(Section("tokens", start, 4 * n))
    words = np.frombuffer(view, dtype="<i4", count=n, offset=start)
    if n == 0:
        sf.tokens = TokenPayload(TokenForm.EMPTY, start, 0, words)
        return
    if not packed_allowed or int(words[0]) != g.PACKED_MARKER:
        sf.tokens = TokenPayload(TokenForm.PLAIN, start, n, words)
        return
    c = packed_without_media(view, start, end)
    s = g.ViewStream(view, start, end)
    try:
        c = g.PackedTokens.parse_stream(s) if c is None else c
    except ConstructError as e:
        f = failure_of(e, s)
        where = f" ({f.loc})" if f.loc else ""
        sf.problem(Severity.ERROR, f.code, "tokens", f.offset, f"packed server_tokens payload{where}: {f.message}")
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


# marker, version, n_tokens: the grammar's own fields at struct's speed
_PACKED_HEAD = g.fixed_reader(
    Struct(*(f for f in g.PackedTokens.subcons if getattr(f, "name", None) in ("marker", "version", "n_tokens")))
)


def packed_without_media(view: memoryview, start: int, end: int) -> Any | None:
    """What ``PackedTokens.parse_stream`` gives for ``view[start:end]`` when it holds what the
    server writes for a text-only prompt (server_tokens::serialize: -1, version 1, n, the n
    ids, 0 media, no padding), read with struct and numpy; None for any other payload, which
    the grammar reads (and names what is wrong).  tests/test_scale.py holds the two equal."""
    n = (end - start - 16) // 4
    if n < 0 or end - start != 16 + 4 * n:
        return None
    marker, version, n_tokens = _PACKED_HEAD.unpack_from(view, start)
    at = start + 12 + 4 * n  # n_media
    if marker != g.PACKED_MARKER or version != g.SERVER_TOKENS_VERSION or n_tokens != n or any(view[at:end]):
        return None
    stream = g.ViewStream(view, start, end)
    stream.seek(end)
    c = Container()
    c["_io"], c["offset"], c["marker"], c["version"], c["n_tokens"] = stream, start, marker, version, n_tokens
    c["tokens"] = np.frombuffer(view[start + 12 : at], dtype="<i4", count=n)
    c["n_media"], c["media_keys"], c["media"] = 0, np.frombuffer(view[end:end], dtype="<u4", count=0), []
    c["padding_offset"], c["padding"] = end, g.Run(end, 0, view[end:end])
    return c


def parse_session_prefix(sf: SlotFile, view: memoryview, off: int) -> int | None:
    s = g.ViewStream(view, off, len(view))
    try:
        a = g.ArchString.parse_stream(s)
    except ConstructError as e:
        f = failure_of(e, s)
        sf.problem(Severity.ERROR, f.code, "arch", f.offset, f"architecture name: {f.message}")
        return None
    sf.arch = bytes(a.data.view).decode("utf-8", "replace")
    sf.sections.append(Section("arch", off, s.tell() - off, sf.arch))
    vinfo = versions.version_info(sf.format, sf.version)
    if vinfo is not None and vinfo.session_outputs:  # session version 9 (slot-format.md §7)
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


def parse_body(sf: SlotFile, view: memoryview, start: int) -> None:
    """The body from ``start``: detect its layout, record its blocks and sections, and report
    what is odd about it (legacy layout, trial version, unreadable, K-only, ambiguous)."""
    end = len(view)
    if is_dsv4(view, start, end):
        sf.problem(
            Severity.ERROR,
            ProblemCode.UNSUPPORTED_LAYOUT,
            "body",
            start,
            "DeepSeek-V4 (DSV4) state frame: not supported yet",
        )
        sf.body = Body(start, end, None, Confidence.NONE)
        return
    det = _detect_body(sf, view, start, end)
    sf.body = body_from(det, start)
    if det.layout is not None and det.layout.legacy:
        sf.problem(
            Severity.WARNING,
            ProblemCode.LEGACY_LAYOUT,
            "body",
            start,
            f"{sf.format} {sf.version} body in the layout of llama.cpp before mid-2025 (KV blocks without "
            "n_stream, single-sequence cells without seq id); current llama.cpp cannot load it"
            + ("; the model comparison covers current layouts only" if sf.expect is not None else ""),
        )
    if trial_version(sf) and not report_trial(sf, det, start, end):
        return
    if det.layout is None:
        f = det.failure
        if f is None:
            sf.problem(
                Severity.ERROR, ProblemCode.UNKNOWN_LAYOUT, "body", start, "no known block layout parses this body"
            )
        else:
            where = f"{f.layout}, {f.loc}" if f.loc else f.layout
            what = "truncated" if f.code == ProblemCode.TRUNCATED else "damaged"
            msg = f"{what} inside the body ({where}): {f.message}"
            sf.problem(Severity.ERROR, f.code, "body", f.offset, msg)
        sf.sections.append(Section("body", start, end - start, "unreadable"))
        return
    sf.sections.append(Section("body", start, det.end - start, det.layout.describe()))
    for b in sf.body.blocks:
        sf.sections.append(Section(f"body.{b.role}", b.offset, b.size, b.kind))
    _warn_k_only(sf, at_eof=det.end == end)
    if det.confidence == Confidence.AMBIGUOUS:
        alts = "; ".join(a.describe() for a in det.alternatives)
        sf.problem(
            Severity.WARNING,
            ProblemCode.AMBIGUOUS_LAYOUT,
            "body",
            start,
            f"the bytes also parse as {alts}; chose {det.layout.describe()} (give --model to decide)",
        )


def _warn_k_only(sf: SlotFile, at_eof: bool) -> None:
    """A KV block without V is an MLA or indexer cache, or a file cut where V starts.  Only the
    second reading needs a word: not when the model decides (it reports its own mismatch), and
    not when an appendix follows the body (nothing was cut there)."""
    if sf.body is None or sf.expect is not None or not at_eof:
        return
    for b in sf.body.blocks:
        if b.kind == MemoryKind.KV and not b.has_v and b.n_cells():
            sf.problem(
                Severity.WARNING,
                ProblemCode.K_ONLY,
                f"body.{b.role}",
                b.end,
                "KV block without V (an MLA or indexer cache); for any other model the file "
                f"was cut at offset {b.end}, where V should start (give --model to decide)",
            )


def _detect_body(sf: SlotFile, view: memoryview, start: int, end: int) -> Detection:
    """The body's layout read as its version says; when that fails around the rotation words'
    arrival, read the other way too, and a fit there means the version word was changed."""
    whole = sf.format == FileFormat.GGSN
    extras = TRIAL_EXTRAS if trial_version(sf) else ((0, 0),)

    def attempt(rot: bool) -> Detection:
        return detect_with_model(
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
            legacy=may_be_legacy(sf),
            rot=rot,
        )

    det = attempt(has_rot(sf))
    if (det.layout is None or det.confidence == Confidence.TRAILING) and rot_matters(sf):
        # the version word and the body disagree: read the body the other way to describe it
        other = attempt(not has_rot(sf))
        if other.layout is not None and other.confidence != Confidence.TRAILING:
            det = other
            if not trial_version(sf):
                report_version_layout(sf, other.layout.rot)
    return det


def detect_with_model(
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


def is_dsv4(view: memoryview, start: int, end: int) -> bool:
    """A llama_kv_cache_dsv4 frame (DeepSeek-V4) starts here: its own magic, not a KV block."""
    return start + 4 <= end and int.from_bytes(view[start : start + 4], "little") == g.DSV4_MAGIC


def _sequences_for(sf: SlotFile) -> list[Kinds]:
    """Candidate block sequences: those a session's arch name allows, when it names one."""
    return list(ARCH_SEQUENCES.get(sf.arch or "", SEQUENCES))


def body_from(det: Detection, start: int) -> Body:
    body = Body(start, det.end, det.layout, det.confidence, alternatives=det.alternatives)
    if det.layout is None:
        return body
    for role, spec, raw in zip(det.layout.roles(), det.layout.blocks, det.blocks, strict=False):
        body.blocks.append(_kv_from(role, raw, spec.has_v) if spec.kind == MemoryKind.KV else _rec_from(role, raw))
    return body


def _kv_from(role: str, c: Any, has_v: bool) -> MemoryBlock:
    # item access, not construct's attribute access (a Python __getattr__ per field): this runs
    # for every layer of every file of a directory
    blk = MemoryBlock(role, MemoryKind.KV, c["offset"], c["end"], has_v=has_v, n_stream=c["n_stream"], raw=c)
    for i, sc in enumerate(c["streams"]):
        n = sc["cell_count"]
        st = KVStream(i, sc["offset"], n)
        d = sc["data"]
        if d is not None:
            st.cells, st.v_trans, st.n_layer = d["meta"], d["v_trans"], d["n_layer"]
            if d["n_rot_k"] is not None:
                st.n_rot_k, st.n_rot_v, st.rot_offset = d["n_rot_k"], d["n_rot_v"], int(d["v_trans_offset"]) + 8
            st.k = [LayerRun("K", j, L["offset"], L["type"], L["row_size"], n, L["data"]) for j, L in enumerate(d["k"])]
            if d["v_trans"]:
                st.v = [
                    LayerRun(
                        "V", j, L["offset"], L["type"], L["n_embd"] * L["el_size"], n, L["data"], True, L["n_embd"]
                    )
                    for j, L in enumerate(d["v"])
                ]
            else:
                st.v = [
                    LayerRun("V", j, L["offset"], L["type"], L["row_size"], n, L["data"]) for j, L in enumerate(d["v"])
                ]
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
