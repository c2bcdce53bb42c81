"""The grammars: round trips, bulk data never copied, caps and length checks."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from construct import ConstructError

from slotfile.format import grammar as g
from slotfile.format.reader import open_slot_file, parse_buffer
from slotfile.format.types import TYPES
from slotfile.format.writer import to_bytes

from .conftest import SLOT_FILES


@pytest.mark.parametrize("path", SLOT_FILES, ids=lambda p: p.name)
def test_round_trip_is_byte_identical(path):
    sf = open_slot_file(path)
    assert sf.errors == [], [p.line() for p in sf.errors]
    assert to_bytes(sf) == path.read_bytes()


def test_type_table_matches_gguf():
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    # gguf-py still says 40 bytes for q8_1 (two f32); ggml-common.h has two ggml_half + 32
    # (static_assert 2*sizeof(ggml_half) + QK8_1 = 36): the C source wins.
    stale = {9: (32, 36)}
    for qt, (blck, size) in GGML_QUANT_SIZES.items():
        if int(qt) in stale:
            blck, size = stale[int(qt)]
        t = TYPES.get(int(qt))
        assert t is not None, qt
        assert (t.blck_size, t.type_size) == (blck, size), qt
        assert t.name.lower() == GGMLQuantizationType(int(qt)).name.lower()


def test_type_ids_are_gguf_names():
    """ggml_types.TypeId spells each id as gguf.GGMLQuantizationType does; only ids gguf does
    not know yet (q2_0) are its own, and every id in the size table is a TypeId."""
    from gguf.constants import GGMLQuantizationType

    from slotfile.format.types import TypeId

    for t in TypeId:
        if t.name in GGMLQuantizationType.__members__:
            assert GGMLQuantizationType[t.name] == t, t
        else:
            assert t.name == "Q2_0" and int(t) not in {int(q) for q in GGMLQuantizationType}, t
        assert TYPES[t].name.lower() == t.name.lower()
    assert set(TYPES) == {int(t) for t in TypeId}


def test_bulk_runs_are_views_not_copies():
    path = next(p for p in SLOT_FILES if p.name == "llama_f16_fa.slot")
    sf = open_slot_file(path)
    run = sf.body.blocks[0].streams[0].k[0]
    arr = run.array()
    assert arr.base is not None and not arr.flags.owndata
    assert not arr.flags.writeable  # a read-only mmap: the input cannot be modified
    raw = path.read_bytes()[run.data.offset : run.data.offset + run.data.length]
    assert arr.tobytes() == raw
    assert arr.shape == (run.n_cells, run.elements)


def test_cell_metadata_is_one_structured_array():
    path = next(p for p in SLOT_FILES if p.name == "extra-qwen2vl.slot")
    # twice: the second open takes the layout from the per-shape cache (format/layout_cache),
    # which must give a zero-copy view over the file too, not the cached copy
    for _ in range(2):
        sf = open_slot_file(path)
        cells = sf.body.blocks[0].streams[0].cells.cells
        assert cells.dtype.names == ("pos", "n_seq_id", "x", "y", "tok", "seq_id")
        assert not cells.flags.owndata
        assert (cells["pos"] == np.arange(cells.size)).all()


def _kv_bytes(n_cells: int, n_layer: int, row: int, ext: int = 0) -> bytes:
    cells = np.zeros(n_cells, g.kv_cell_dtype(ext))
    cells["pos"] = np.arange(n_cells)
    cells["n_seq_id"] = 1
    meta = g.CellTable(0, cells, cells["seq_id"], cells.tobytes())
    layer = {"type": 1, "row_size": row, "data": g.Run.of(bytes(n_cells * row))}
    obj = {
        "n_stream": 1,
        "streams": [
            {
                "cell_count": n_cells,
                "data": {
                    "meta": meta,
                    "v_trans": 0,
                    "n_layer": n_layer,
                    "k": [layer] * n_layer,
                    "v": [layer] * n_layer,
                },
            }
        ],
    }
    return g.build(g.KV_BLOCK, obj, ext=ext)


def test_kv_block_builds_the_documented_length():
    c, n_layer, row = 7, 3, 64
    data = _kv_bytes(c, n_layer, row)
    # slot-format.md §13: 4 (n_stream) + 4 + C*(8+4) + 8 + 2 * L * (12 + C*row)
    assert len(data) == 4 + 4 + c * 12 + 8 + 2 * n_layer * (12 + c * row)
    s = g.ViewStream(data)
    blk = g.KV_BLOCK.parse_stream(s, ext=0)
    assert blk.end == len(data)
    assert g.build(g.KV_BLOCK, blk, ext=0) == data


def _hdr(n_words: int) -> bytes:
    return struct.pack("<III", g.GGSQ_MAGIC, 3, n_words)


def test_huge_counts_are_refused_before_allocation():
    # n_stream 1, cell_count 2^32-1: the metadata alone would need 48 GiB
    body = struct.pack("<II", 1, 0xFFFFFFFF) + bytes(64)
    sf = parse_buffer(_hdr(0) + body)
    assert sf.errors
    assert any("metadata of 4294967295 cells" in p.message for p in sf.errors)


def test_layer_count_over_cap():
    cells = struct.pack("<iIi", 0, 1, 0)
    body = struct.pack("<II", 1, 1) + cells + struct.pack("<II", 0, 1 << 20)
    sf = parse_buffer(_hdr(0) + body)
    assert any("n_layer" in p.message and p.section == "body" for p in sf.errors)


def test_view_stream_records_short_reads():
    s = g.ViewStream(b"\x01\x02", 0)
    with pytest.raises(ConstructError):
        g.FileHeader.parse_stream(s)
    assert s.short == (0, 4, 2)
