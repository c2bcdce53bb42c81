"""A file cut anywhere is reported with the right section and offset, never an exception.

Cut points: every section boundary, every block, stream, layer entry and blob boundary, and
points inside each (one byte in, the middle, one byte short).  A cut that lands exactly where
the prefix is itself a complete file (the end of the body, of SCKP, of SDFT; between the
blocks of a multi-block body, which only the model can tell apart) is not an error: those
prefixes must parse as clean files instead.
"""

from __future__ import annotations

import pytest

from slotfile.format.layout import ARCH_SEQUENCES
from slotfile.format.reader import open_slot_file, parse_buffer
from slotfile.format.records import SlotFile

from .conftest import SLOT_FILES


def _boundaries(sf: SlotFile) -> set[int]:
    pts = {0, 4, 8, 12}
    for s in sf.sections:
        pts |= {s.offset, s.offset + s.size}
    bodies = [sf.body] + [b.body for c in sf.checkpoints for b in (c.tgt, c.dft) if b.body]
    if sf.draft and sf.draft.dft and sf.draft.dft.body:
        bodies.append(sf.draft.dft.body)
    for body in bodies:
        for blk in body.blocks:
            pts |= {blk.offset, blk.end}
            for st in blk.streams:
                pts.add(st.offset)
                if st.cells is not None:
                    pts |= {st.cells.offset, st.cells.offset + st.cells.size}
            for r in blk.runs():
                pts |= {r.offset, r.data.offset, r.data.offset + r.data.length}
    for c in sf.checkpoints:
        for b in (c.tgt, c.dft, c.spec):
            pts |= {b.offset, b.data_offset, b.data_offset + b.length}
    return pts


def _clean_cuts(sf: SlotFile) -> set[int]:
    """Prefixes that are complete files on their own."""
    ok = {sf.body.end}
    # a block boundary ends a valid shorter body, unless a session's arch rules that layout out
    allowed = ARCH_SEQUENCES.get(sf.arch or "")
    kinds = sf.body.layout.kinds
    for i, blk in enumerate(sf.body.blocks):
        if allowed is None or kinds[: i + 1] in allowed:
            ok.add(blk.end)
    if sf.format == "GGSQ":
        if sf.sckp:
            ok.add(sf.sckp.end)
        if sf.draft:
            ok.add(sf.draft.end)
    return ok


def _expected_section(sf: SlotFile, cut: int) -> str:
    if cut < 12:
        return "header"
    if cut < sf.body.offset:
        return "tokens" if sf.format == "GGSQ" or cut < sf.tokens.offset + sf.tokens.size else "arch"
    if cut < sf.body.end:
        return "body"
    if sf.sckp and cut < sf.sckp.end:
        return "sckp"
    return "sdft"


def _cuts(sf: SlotFile) -> list[int]:
    pts = set()
    for b in _boundaries(sf):
        pts |= {b - 1, b, b + 1}
    for s in sf.sections:
        pts.add(s.offset + s.size // 2)
    return sorted(p for p in pts if 0 <= p < sf.size)


@pytest.mark.parametrize("path", SLOT_FILES, ids=lambda p: p.name)
def test_every_cut_is_reported_at_its_section(path):
    data = path.read_bytes()
    full = open_slot_file(path)
    clean = _clean_cuts(full)
    v_starts = {st.v[0].offset for blk in full.body.blocks for st in blk.streams if st.v}
    for cut in _cuts(full):
        sf = parse_buffer(data[:cut], f"{path.name}[:{cut}]")
        assert not [p for p in sf.problems if p.code == "internal"], (cut, [p.line() for p in sf.problems])
        if cut in clean or cut == full.body.offset:  # an empty body: a model without memory
            assert not sf.errors, (cut, [p.line() for p in sf.errors])
            continue
        if cut in v_starts and not sf.errors:  # reads as a K-only (MLA) cache: must say so
            assert any(p.code == "k-only" for p in sf.problems), (cut, [p.line() for p in sf.problems])
            continue
        assert sf.errors, f"cut at {cut} of {len(data)} not reported"
        first = sf.errors[0]
        want = _expected_section(full, cut)
        if first.section == "trailing":  # a cut between blocks or inside an appendix magic
            assert first.offset in clean | {blk.end for blk in full.body.blocks}, (cut, first.line())
            continue
        got = first.section.split(".")[0]
        assert got == want or (got == "appendix" and want in ("sckp", "sdft")), (cut, want, first.line())
        assert first.offset <= cut, (cut, first.line())
        assert first.code in ("truncated", "trailing-bytes", "invalid", "over-cap"), (cut, first.line())


def test_cut_body_names_the_layer():
    path = next(p for p in SLOT_FILES if p.name == "llama_f16_fa.slot")
    full = open_slot_file(path)
    v1 = full.body.blocks[0].streams[0].v[1]
    cut = v1.data.offset + 100
    sf = parse_buffer(path.read_bytes()[:cut])
    (err,) = sf.errors
    assert err.section == "body" and err.code == "truncated"
    assert err.offset == v1.data.offset
    assert "stream[0].V[1]" in err.message


def test_cut_checkpoint_keeps_the_complete_ones():
    path = next(p for p in SLOT_FILES if p.name == "llama_draft_sdft.slot")
    full = open_slot_file(path)
    last = full.checkpoints[-1]
    sf = parse_buffer(path.read_bytes()[: last.tgt.data_offset + 10])
    assert len(sf.checkpoints) == len(full.checkpoints) - 1
    assert sf.errors[0].section == f"sckp.checkpoint[{last.index}].data_tgt"
    assert sf.errors[0].offset == last.tgt.data_offset
    assert not sf.sckp.complete
