"""Read the appendices after a slot file's body (SCKP checkpoints, SDFT draft state) and the
per-sequence blobs inside them into records; what follows the last one is trailing bytes."""

from __future__ import annotations

from typing import Any

from slotfile.format import appendix as ap
from slotfile.format import grammar as g
from slotfile.format.layout import (
    PARTIAL_OF,
    SEQUENCES,
    Detection,
    Failure,
)
from slotfile.format.read_body import body_from, detect_with_model, is_dsv4
from slotfile.format.read_version import TRIAL_EXTRAS, body_rot, trial_version
from slotfile.format.records import (
    Appendix,
    BlobInfo,
    Body,
    Checkpoint,
    ModelExpect,
    Section,
    SlotFile,
)
from slotfile.problems import ProblemCode, Severity


def parse_appendices(sf: SlotFile, view: memoryview, off: int) -> None:
    end = len(view)
    while off < end:
        magic = bytes(view[off : off + 4])
        if len(magic) < 4 and any(m.startswith(magic) for m in (g.SCKP_MAGIC, g.SDFT_MAGIC)):
            names = [m.decode() for m in (g.SCKP_MAGIC, g.SDFT_MAGIC) if m.startswith(magic)]
            name = names[0].lower() if len(names) == 1 else "appendix"
            sf.sections.append(Section(name, off, end - off, "cut inside the magic"))
            sf.problem(
                Severity.ERROR,
                ProblemCode.TRUNCATED,
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
            Severity.ERROR,
            ProblemCode.TRAILING_BYTES,
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
        sf.problem(Severity.ERROR, head.code, name, head.offset, f"{name.upper()} header: {head.message}")
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
            Severity.ERROR,
            ProblemCode.BAD_VERSION,
            "sckp",
            off + 4,
            f"SCKP version {h.version} (only 1 is known; the server ignores the appendix)",
        )
        app.complete = False
        return None
    if h.count > g.MAX_CHECKPOINTS:
        sf.sections.append(Section("sckp", off, end - off, "count over cap"))
        sf.problem(
            Severity.ERROR,
            ProblemCode.OVER_CAP,
            "sckp",
            off + 8,
            f"checkpoint count {h.count} over the cap {g.MAX_CHECKPOINTS} (the server drops the appendix)",
        )
        app.complete = False
        return None
    if not _parse_checkpoints(sf, view, app, h):
        return None
    sf.sections.append(Section("sckp", off, app.end - off, f"{h.count} checkpoints"))
    for ck in sf.checkpoints:
        sf.sections.append(Section(f"sckp.checkpoint[{ck.index}]", ck.offset, ck.end - ck.offset))
    _parse_checkpoint_blobs(sf, view)
    return app.end


def _parse_checkpoints(sf: SlotFile, view: memoryview, app: Appendix, h: Any) -> bool:
    """The checkpoint entries after the SCKP header ``h`` into ``sf.checkpoints``; False when one
    is cut or damaged (the server then drops the whole appendix)."""
    off, end = app.offset, len(view)
    for it in ap.entries(view, h.end, end, count=h.count):
        if isinstance(it, ap.Stop):
            if it.failure is not None:
                f, i = it.failure, it.index
                app.complete, app.end = False, end
                sf.sections.append(Section("sckp", off, end - off, f"{i} of {h.count} checkpoints complete"))
                sf.problem(
                    Severity.ERROR,
                    f.code,
                    f"sckp.{f.loc or f'checkpoint[{i}]'}",
                    f.offset,
                    f"checkpoint {i} of {h.count}: {f.message} (the server drops the whole appendix)",
                )
                return False
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
    return True


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
        sf.problem(
            Severity.ERROR, ProblemCode.BAD_VERSION, "sdft", off + 4, f"SDFT version {h.version} (only 1 is known)"
        )
        return None
    b = ap.sdft_body(view, h, end)
    if isinstance(b, Failure):
        app.complete = False
        sf.sections.append(Section("sdft", off, end - off, "damaged"))
        sf.problem(
            Severity.ERROR,
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
        parse_seq_blob(sf, view, app.dft, "sdft.data_dft", partial=None, exp=sf.draft_expect)
    return app.end


def _parse_checkpoint_blobs(sf: SlotFile, view: memoryview) -> None:
    body_class = sf.body.memory_class if sf.body else "unknown"
    partial = PARTIAL_OF.get(body_class)
    for ck in sf.checkpoints:
        sec = f"sckp.checkpoint[{ck.index}]"
        if ck.tgt.length == 0:
            sf.problem(
                Severity.ERROR,
                ProblemCode.EMPTY_BLOB,
                sec,
                ck.tgt.offset,
                "data_tgt is empty (the server drops the whole appendix)",
            )
        else:
            parse_seq_blob(sf, view, ck.tgt, f"{sec}.data_tgt", partial=partial, exp=sf.expect, exp_partial=True)
        if ck.dft.length:
            dl = sf.draft.dft.body.layout if sf.draft and sf.draft.dft and sf.draft.dft.body else None
            parse_seq_blob(
                sf,
                view,
                ck.dft,
                f"{sec}.data_dft",
                partial=PARTIAL_OF.get(dl.memory_class) if dl else None,
                exp=sf.draft_expect,
                exp_partial=True,
            )


def parse_seq_blob(
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
        sf.problem(Severity.ERROR, seq_id.code, section, seq_id.offset, f"blob prefix: {seq_id.message}")
        return
    blob.seq_id = seq_id
    if is_dsv4(view, start + 8, end):
        blob.body = Body(start + 8, end, None, "none")
        sf.problem(
            Severity.ERROR,
            ProblemCode.UNSUPPORTED_LAYOUT,
            section,
            start + 8,
            "DeepSeek-V4 (DSV4) state frame: not supported yet",
        )
        return
    seqs = [partial] + [q for q in SEQUENCES if q != partial] if partial else list(SEQUENCES)
    det = detect_with_model(
        sf,
        view,
        start + 8,
        end,
        exp,
        exp_partial,
        section,
        exact=True,
        sequences=seqs,
        extras=TRIAL_EXTRAS if trial_version(sf) else ((0, 0),),
        rot=body_rot(sf),
    )
    blob.body = body_from(det, start + 8)
    if exp is not None and blob.body.layout is not None:
        return  # read in the model's layout: modelcheck.check_against_model judges it
    _judge_blob_body(sf, det, section, start + 8, partial)


def _judge_blob_body(sf: SlotFile, det: Detection, section: str, at: int, partial: tuple[str, ...] | None) -> None:
    """The problems of a blob body detected without the model: none fills the blob, or a
    PARTIAL_ONLY blob holds other blocks than its body's partial ones (``at``: the body's start)."""
    if det.layout is None:
        f = det.failure
        msg = f"{f.message} ({f.layout}{', ' + f.loc if f.loc else ''})" if f else "no known layout fills the blob"
        sf.problem(
            Severity.ERROR,
            f.code if f else ProblemCode.UNKNOWN_LAYOUT,
            section,
            f.offset if f else at,
            f"blob body does not parse: {msg}",
        )
    elif partial is not None and det.layout.kinds != partial:
        sf.problem(
            Severity.WARNING,
            ProblemCode.UNEXPECTED_LAYOUT,
            section,
            at,
            f"blob holds {det.layout.describe()}; a PARTIAL_ONLY blob of this body should be "
            f"{' + '.join(partial) or 'empty'}",
        )


# ---------------------------------------------------------------------------------------
# consistency checks across sections
# ---------------------------------------------------------------------------------------
