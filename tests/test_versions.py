"""State versions 2-5 (5 by trial), session versions 9-12, and the older 8-byte cell ext."""

from __future__ import annotations

import struct

import numpy as np

from slotfile.format import grammar as g
from slotfile.format.reader import open_slot_file, parse_buffer

from .conftest import SLOTS


def _with_version(data: bytes, v: int) -> bytes:
    return data[:4] + struct.pack("<I", v) + data[8:]


def test_version_2_parses_like_3():
    data = (SLOTS / "llama_f16_fa.slot").read_bytes()
    sf = parse_buffer(_with_version(data, 2))
    assert sf.version == 2 and sf.problems == []


def test_version_4_is_read_by_the_grammar_not_by_trial():
    sf = open_slot_file(SLOTS / "v4" / "gemma3_iswa_fa.slot")
    assert sf.version == 4 and sf.problems == [] and sf.body.layout.rot


def test_version_5_with_a_v4_body_parses_by_trial():
    data = (SLOTS / "v4" / "gemma3_iswa_fa.slot").read_bytes()
    sf = parse_buffer(_with_version(data, 5))
    assert not sf.errors
    assert [p.code for p in sf.problems] == ["trial-version"]
    assert "GGSQ version 5 parsed by trial" in sf.problems[0].message
    assert "slotfile knows versions up to 4" in sf.problems[0].message
    assert "exactly like version 4" in sf.problems[0].message


def test_version_5_with_a_v3_body_parses_by_trial():
    data = (SLOTS / "gemma3_iswa_fa.slot").read_bytes()
    sf = parse_buffer(_with_version(data, 5))
    assert not sf.errors and "exactly like version 3" in sf.problems[0].message


def test_version_5_with_extra_words_parses_by_trial():
    src = open_slot_file(SLOTS / "v4" / "llama_f16_fa.slot")
    data = bytearray((SLOTS / "v4" / "llama_f16_fa.slot").read_bytes()[: src.body.end])
    vt = src.body.blocks[0].raw.streams[0].data.v_trans_offset
    data[vt:vt] = struct.pack("<I", 32)  # a made-up word before v_trans
    sf = parse_buffer(_with_version(bytes(data), 5))
    assert not sf.errors, [p.line() for p in sf.errors]
    assert sf.body.layout.extra == (1, 0)
    assert any("1 unknown u32 word before v_trans" in p.message for p in sf.problems)


def test_version_5_that_no_trial_fits_is_refused_in_one_line():
    src = open_slot_file(SLOTS / "llama_f16_fa.slot")
    data = bytearray((SLOTS / "llama_f16_fa.slot").read_bytes()[: src.body.end])
    vt = src.body.blocks[0].raw.streams[0].data.v_trans_offset
    data[vt:vt] = bytes(range(1, 41))  # 40 unknown bytes: more than any trial allows
    sf = parse_buffer(_with_version(bytes(data), 5))
    (err,) = sf.errors
    assert err.code == "unsupported-version" and "version 5" in err.message and "\n" not in err.message


def test_session_version_12_parses_by_trial():
    data = (SLOTS / "v4" / "extra-llama.session").read_bytes()
    sf = parse_buffer(_with_version(data, 12))
    assert not sf.errors and [p.code for p in sf.problems] == ["trial-version"]


def test_unknown_version_is_refused():
    data = (SLOTS / "llama_f16_fa.slot").read_bytes()
    sf = parse_buffer(_with_version(data, 7))
    assert [p.code for p in sf.errors] == ["bad-version"]
    assert sf.errors[0].offset == 4


def test_eight_byte_cell_ext_of_older_trees():
    src = open_slot_file(SLOTS / "extra-qwen2vl.slot")
    data = (SLOTS / "extra-qwen2vl.slot").read_bytes()[: src.body.end]
    st = src.body.blocks[0].streams[0]
    cells = st.cells.cells
    old = np.zeros(cells.size, g.kv_cell_dtype(8))
    for name in ("pos", "n_seq_id", "x", "y", "seq_id"):
        old[name] = cells[name]
    start, end = st.cells.offset, st.cells.offset + st.cells.size
    sf = parse_buffer(data[:start] + old.tobytes() + data[end:])
    assert not sf.errors, [p.line() for p in sf.errors]
    assert sf.body.layout.ext == 8
    assert (sf.body.blocks[0].streams[0].cells.cells["x"] == cells["x"]).all()


def test_session_version_9_with_outputs_logits_embeddings():
    src = open_slot_file(SLOTS / "extra-llama.session")
    data = (SLOTS / "extra-llama.session").read_bytes()
    arch = next(s for s in src.sections if s.name == "arch")
    at = arch.offset + arch.size
    # v9 (llama_context::state_write_data before 2026) wrote outputs, logits and embeddings here
    extra = struct.pack("<I", 2) + struct.pack("<2i", 0, 1) + struct.pack("<Q", 3) + struct.pack("<3f", 0.5, 1, 2)
    extra += struct.pack("<Q", 0)
    sf = parse_buffer(_with_version(data[:at] + extra + data[at:], 9))
    assert not sf.errors, [p.line() for p in sf.errors]
    assert any(s.name == "outputs" and s.size == len(extra) for s in sf.sections)
    assert sf.body.offset == at + len(extra)


def _legacy_body(src, data: bytes) -> bytes:
    """The body of a one-stream file as llama.cpp wrote it before mid-2025: no n_stream word,
    and single-sequence cells of (pos, n_seq_id = 0) with no seq id."""
    out = b""
    for blk in src.body.blocks:
        (st,) = blk.raw.streams
        d = st.data
        cells = b"".join(struct.pack("<iI", int(p), 0) for p in d.meta.cells["pos"])
        if src.format == "GGSN":  # whole-context cells are unchanged: pos, n_seq_id, seq ids
            cells = bytes(d.meta.raw)
        out += struct.pack("<I", st.cell_count) + cells + data[d.v_trans_offset : blk.raw.end]
    return out


def test_version_2_without_n_stream_is_read_as_the_legacy_layout():
    from slotfile.format.writer import to_bytes

    src = open_slot_file(SLOTS / "llama_f16_fa.slot")
    data = (SLOTS / "llama_f16_fa.slot").read_bytes()
    legacy = _with_version(data[: src.body.offset] + _legacy_body(src, data) + data[src.body.end :], 2)
    sf = parse_buffer(legacy)
    assert not sf.errors, [p.line() for p in sf.errors]
    assert sf.body.layout.legacy and "without n_stream" in sf.body.layout.describe()
    assert [p.code for p in sf.problems] == ["legacy-layout"]
    st = sf.body.blocks[0].streams[0]
    assert st.cell_count == src.body.blocks[0].streams[0].cell_count
    assert (st.cells.cells["pos"] == src.body.blocks[0].streams[0].cells.cells["pos"]).all()
    assert len(sf.checkpoints) == len(src.checkpoints)
    assert to_bytes(sf) == legacy
    # a cut inside the legacy K rows is a truncation inside the body, not another layout
    k0 = st.k[0].data
    cut = parse_buffer(legacy[: k0.offset + k0.length // 2])
    assert cut.errors and cut.errors[0].section == "body" and cut.errors[0].code == "truncated"


def test_the_legacy_layout_is_only_tried_for_version_2():
    src = open_slot_file(SLOTS / "llama_f16_fa.slot")
    data = (SLOTS / "llama_f16_fa.slot").read_bytes()
    sf = parse_buffer(data[: src.body.offset] + _legacy_body(src, data) + data[src.body.end :])
    assert sf.errors and not (sf.body.layout and sf.body.layout.legacy)


def test_session_version_9_without_n_stream():
    src = open_slot_file(SLOTS / "extra-llama.session")
    data = (SLOTS / "extra-llama.session").read_bytes()
    arch = next(s for s in src.sections if s.name == "arch")
    at = arch.offset + arch.size
    extra = struct.pack("<I", 0) + struct.pack("<Q", 0) + struct.pack("<Q", 0)  # no outputs kept
    sf = parse_buffer(_with_version(data[:at] + extra + _legacy_body(src, data), 9))
    assert not sf.errors, [p.line() for p in sf.errors]
    assert sf.body.layout.legacy
    assert (np.unique(sf.body.blocks[0].streams[0].cells.seq_ids) == [0, 1]).all()
