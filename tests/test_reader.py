"""Every fixture parses with the counts its generator recorded (the manifests)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from slotfile.format.reader import open_slot_file, parse_buffer
from slotfile.problems import ProblemCode
from slotfile.report import flash_attn_of

from .conftest import EXTRA, FIXTURES, MANIFEST, SLOTS

TYPE_IDS = {"f32": 0, "f16": 1, "q8_0": 8}


def _check_kv(blk, want: dict) -> None:
    assert blk.kind == "KV"
    assert blk.offset == want["offset"]
    assert blk.size == want["length"]
    assert blk.n_stream == want["n_stream"]
    assert [s.cell_count for s in blk.streams] == want["cell_count"]
    for st in blk.active_streams():
        assert st.v_trans == want["v_trans"]
        assert st.n_layer == want["n_layer"] == len(st.k) == len(st.v)
        assert {r.type_id for r in st.k} == {want["k_type_id"]}
        assert {r.row_size for r in st.k} == {want["k_size_row"]}
        assert {r.type_id for r in st.v} == {want["v_type_id"]}
        assert int(st.positions.min()) == want["cell_pos_min"]
        assert int(st.positions.max()) == want["cell_pos_max"]
        if want["v_trans"]:
            assert {r.n_embd for r in st.v} == {want["n_embd_v_gqa"]}
        else:
            assert {r.row_size for r in st.v} == {want["v_size_row"]}


@pytest.mark.parametrize("entry", MANIFEST["slots"], ids=lambda e: e["file"])
def test_fixture_matches_manifest(entry):
    sf = open_slot_file(SLOTS.parent / entry["file"])
    assert sf.problems == [], [p.line() for p in sf.problems]
    assert (sf.format, sf.version) == ("GGSQ", entry["state_version"])
    assert sf.size == entry["file_size"]
    assert sf.n_token_count == entry["n_token_words"]
    assert sf.n_tokens == entry["n_tokens"]
    assert list(sf.tokens.tokens) == entry["tokens"]
    assert sf.tokens.form == {"packed_v1": "packed", "plain": "plain"}[entry["token_format"]]
    assert (sf.body.offset, sf.body.end) == (entry["body_start"], entry["body_end"])
    assert len(sf.body.blocks) == len(entry["body_blocks"])
    for blk, want in zip(sf.body.blocks, entry["body_blocks"], strict=False):
        _check_kv(blk, want)
    assert flash_attn_of(sf) == ("on" if entry["flash_attn"] else "off")
    if entry["sckp"] is None:
        assert sf.sckp is None
    else:
        want = entry["sckp"]
        assert (sf.sckp.offset, sf.sckp.end - sf.sckp.offset) == (want["offset"], want["length"])
        assert sf.sckp.count == want["count"] == len(sf.checkpoints)
        for ck, wc in zip(sf.checkpoints, want["checkpoints"], strict=False):
            assert (ck.offset, ck.n_tokens, ck.pos_min, ck.pos_max) == (
                wc["offset"],
                wc["n_tokens"],
                wc["pos_min"],
                wc["pos_max"],
            )
            assert (ck.tgt.length, ck.dft.length, ck.spec.length) == (wc["len_tgt"], wc["len_dft"], wc["len_spec"])
            assert ck.tgt.data_offset == wc["tgt_offset"]
            assert ck.tgt.seq_id == entry["seq_id"]
            for blk, wb in zip(ck.tgt.body.blocks, wc["tgt_blocks"], strict=False):
                _check_kv(blk, wb)
            if wc["dft_blocks"]:
                for blk, wb in zip(ck.dft.body.blocks, wc["dft_blocks"], strict=False):
                    _check_kv(blk, wb)
    if entry["sdft"] is None:
        assert sf.draft is None
    else:
        want = entry["sdft"]
        assert sf.draft.offset == want["offset"]
        assert sf.draft.dft.length == want["len_dft"] and sf.draft.spec.length == want["len_spec"]
        for blk, wb in zip(sf.draft.dft.body.blocks, want["dft_blocks"], strict=False):
            _check_kv(blk, wb)


def _check_extra_block(blk, want: dict) -> None:
    assert blk.kind == want["type"]
    assert (blk.offset, blk.end) == (want["offset"], want["end"])
    if blk.kind == "KV":
        assert blk.has_v == want.get("has_v", True)  # the generator records only has_v False
        assert [s.cell_count for s in blk.streams] == want["cell_counts"]
        for st, ws in zip(blk.active_streams(), [s for s in want["streams"] if s["cell_count"]], strict=False):
            assert st.v_trans == ws["v_trans"] and st.n_layer == ws["n_layer"]
            assert len(st.k) == ws["n_k"] and len(st.v) == ws["n_v"]
    else:
        assert blk.cell_count == want["cell_count"]
        assert blk.n_layer == want["n_layer"]
        assert len(blk.r) == want["n_r"] and len(blk.s) == want["n_s"]
        assert [(r.type_id, r.row_size) for r in blk.r] == [(x["type"], x["row_size"]) for x in want["r"]]
        assert [(r.type_id, r.row_size) for r in blk.s] == [(x["type"], x["row_size"]) for x in want["s"]]


@pytest.mark.parametrize("entry", EXTRA["files"], ids=lambda e: e["file"])
def test_extra_fixture_matches_manifest(entry):
    sf = open_slot_file(SLOTS.parent / entry["file"])
    # a K-only (MLA) block followed by an appendix cannot be a file cut where V starts: no
    # fixture has a problem (the bare K-only body is in test_mla_fixture_is_one_k_only_block)
    # an empty slot's save is valid, and says so (empty-slot)
    want = [ProblemCode.EMPTY_SLOT] if entry["n_tokens"] == 0 and entry["kind"] == "slot" else []
    assert [p.code for p in sf.problems] == want, [p.line() for p in sf.problems]
    assert sf.format == ("GGSQ" if entry["kind"] == "slot" else "GGSN")
    assert sf.size == entry["size"]
    assert sf.n_tokens == entry["n_tokens"]
    assert list(sf.body.layout.kinds) == entry["block_sequence"]
    assert (sf.body.offset, sf.body.end) == (entry["body_offset"], entry["body_end"])
    for blk, want in zip(sf.body.blocks, entry["blocks"], strict=False):
        _check_extra_block(blk, want)
    kv = [w for w in entry["blocks"] if w["type"] == "KV"]
    if kv:
        assert sf.body.layout.ext == kv[0]["ext_size"]
    if entry["kind"] == "session":
        assert sf.arch == entry["arch_string"]
    apps = [a for a in entry["appendix"] if a["type"] == "SCKP"]
    assert (sf.sckp is not None) == bool(apps)
    for a in apps:
        assert len(sf.checkpoints) == a["count"]
        for ck, wc in zip(sf.checkpoints, a["checkpoints"], strict=False):
            assert (ck.n_tokens, ck.pos_min, ck.pos_max, ck.tgt.length) == (
                wc["n_tokens"],
                wc["pos_min"],
                wc["pos_max"],
                wc["len_tgt"],
            )
            assert list(ck.tgt.body.layout.kinds) == wc["tgt"]["block_sequence"]
            base = ck.tgt.data_offset
            for blk, wb in zip(ck.tgt.body.blocks, wc["tgt"]["blocks"], strict=False):
                shifted = dict(wb, offset=wb["offset"] + base, end=wb["end"] + base)
                _check_extra_block(blk, shifted)


def test_mla_fixture_is_one_k_only_block():
    """DeepSeek2 with MLA (llama.cpp writes the latent + rope key, no V tensors): the body is
    one KV block with K runs only; the model settles it, the bytes alone warn."""
    from slotfile.model.bridge import load_model_info

    path = SLOTS / "extra-deepseek2.slot"
    entry = next(e for e in EXTRA["files"] if e["file"] == "slots/extra-deepseek2.slot")
    facts = EXTRA["models"][entry["model"]]
    assert facts["mla"] and not facts["kv_has_v"]

    bare = open_slot_file(path)
    assert bare.body.layout.describe() == "KV(K-only)"
    (blk,) = bare.body.blocks
    assert blk.kind == "KV" and not blk.has_v
    (st,) = blk.active_streams()
    assert st.cell_count == entry["n_tokens"] == 28
    assert st.v == [] and len(st.k) == st.n_layer == facts["n_layer"]
    assert {(r.type_id, r.row_size) for r in st.k} == {(1, 2 * facts["n_embd_k_gqa"])}  # f16, 40 elements
    assert st.v_trans == 1  # flash attention off: llama.cpp still writes (and checks) the flag
    assert flash_attn_of(bare) == "off"  # read from a K-only cache's v_trans too
    assert blk.end == bare.body.end == entry["body_end"]  # the K rows end the body: no V section
    assert not [r for _, r in bare.value_runs() if r.part == "V"]
    assert {r.part for _, r in bare.value_runs()} == {"K"}
    assert len(bare.checkpoints) == 2
    for ck in bare.checkpoints:  # plain KV ignores PARTIAL_ONLY: each blob is the whole K-only block
        assert ck.tgt.body.layout.describe() == "KV(K-only)" and not ck.tgt.body.blocks[0].has_v
    assert bare.problems == []  # an SCKP appendix follows the K rows: nothing was cut there
    body_only = parse_buffer(path.read_bytes()[: blk.end])  # ends where V would start: it may be cut
    assert [p.code for p in body_only.problems] == ["k-only"]
    (warn,) = body_only.problems
    assert warn.severity == "warning" and warn.offset == blk.end

    sf = open_slot_file(path, model=load_model_info(FIXTURES / entry["model"]))
    assert sf.body.confidence == "model"
    assert sf.body.layout == bare.body.layout
    assert not [p for p in sf.problems if p.code == "k-only"]
    assert sf.problems == [], [p.line() for p in sf.problems]


def test_session_with_shared_cells_reads_every_seq_id():
    sf = open_slot_file(SLOTS / "extra-llama.session")
    st = sf.body.blocks[0].streams[0]
    counts = st.cells.cells["n_seq_id"]
    assert counts.max() == 2  # the shared prefix belongs to both sequences
    assert st.cells.seq_ids.size == int(counts.sum())


def test_model_settles_a_cut_between_blocks():
    from slotfile.format.reader import parse_buffer
    from slotfile.model.bridge import load_model_info

    path = SLOTS / "gemma3_iswa_fa.slot"
    full = open_slot_file(path)
    cut = path.read_bytes()[: full.body.blocks[0].end]  # only the base half survived
    assert not parse_buffer(cut).errors  # from the bytes alone: a valid plain-KV file
    sf = parse_buffer(cut, model=load_model_info(SLOTS.parent / "models" / "gemma3.gguf"))
    assert any(p.code == "model-mismatch" and "KV + KV" in p.message for p in sf.errors), [
        p.line() for p in sf.problems
    ]


def test_model_layout_is_used_and_wrong_models_are_named():
    from slotfile.model.bridge import load_model_info

    models = SLOTS.parent / "models"
    sf = open_slot_file(SLOTS / "llama_f16_fa.slot", model=load_model_info(models / "llama.gguf"))
    assert sf.body.confidence == "model" and sf.problems == []
    sf = open_slot_file(SLOTS / "llama_f16_fa.slot", model=load_model_info(models / "draft.gguf"))
    assert any(p.code == "model-mismatch" and "row size" in p.message for p in sf.errors)


def test_two_k_only_blocks_read_as_dsa():
    """llama_kv_cache_dsa writes an MLA cache then the lightning indexer, both K-only, and
    ignores PARTIAL_ONLY: the pair is DSA (not iSWA) and a blob holding both is expected."""
    src = open_slot_file(SLOTS / "extra-deepseek2.slot")
    data = (SLOTS / "extra-deepseek2.slot").read_bytes()
    body = data[src.body.offset : src.body.end]
    blob = struct.pack("<Ii", 0xAF143CD8, 0) + body + body
    sckp = b"SCKP" + struct.pack("<II", 1, 1) + struct.pack("<qii", src.n_tokens, 0, src.n_tokens - 1)
    sckp += struct.pack("<Q", len(blob)) + blob + struct.pack("<QQ", 0, 0)
    sf = parse_buffer(data[: src.body.offset] + body + body + sckp)
    assert sf.body.memory_class == "dsa"
    assert [b.role for b in sf.body.blocks] == ["kv-mla", "kv-index"]
    assert sf.problems == [], [p.line() for p in sf.problems]


@pytest.mark.parametrize("arch, ok", [("gemma3", True), ("llama", True), ("jamba", False)])
def test_session_arch_allows_its_memory_classes(arch, ok):
    """A session names its arch: gemma3 may be a single KV cache (no sliding window in its
    GGUF), jamba never is."""
    src = open_slot_file(SLOTS / "extra-llama.session")
    data = (SLOTS / "extra-llama.session").read_bytes()
    arch_sec = next(s for s in src.sections if s.name == "arch")
    name = arch.encode()
    sf = parse_buffer(
        data[: arch_sec.offset] + struct.pack("<I", len(name)) + name + data[arch_sec.offset + arch_sec.size :]
    )
    assert sf.arch == arch
    assert (not sf.errors) == ok, [p.line() for p in sf.problems]
    if ok:
        assert sf.body.layout.kinds == ("KV",)


def test_positions_out_of_cell_order_are_not_a_problem():
    """Cells are written in cell-index order: after an SWA ring wraps (or freed cells are
    reused) positions go backwards in a healthy file."""
    src = open_slot_file(SLOTS / "llama_f16_fa.slot")
    data = bytearray((SLOTS / "llama_f16_fa.slot").read_bytes())
    cells = src.body.blocks[0].streams[0].cells
    pos = cells.cells["pos"]
    stride = cells.cells.dtype.itemsize
    for i, p in enumerate(np.roll(pos, 5)):  # a ring that wrapped 5 cells ago
        struct.pack_into("<i", data, cells.offset + i * stride, int(p))
    sf = parse_buffer(bytes(data))
    assert sf.body.blocks[0].streams[0].cells.cells["pos"][0] == pos[-5]
    assert sf.problems == [], [p.line() for p in sf.problems]


def test_a_cleared_idle_slot_reads_as_an_empty_slot():
    """A real v4 server's save of a slot it had cleared (fixtures/real/v4-cleared-idle-slot.json:
    a 4-slot unified cache clears idle slots when another slot starts a task, and answered the
    save with n_saved 0 and success): valid, 44 bytes, and flagged ``empty-slot``, so a store
    holding it does not pass in silence."""
    real = Path(__file__).resolve().parent.parent / "fixtures" / "real"
    sf = parse_buffer((real / "v4-cleared-idle-slot.bin").read_bytes())
    assert json.loads((real / "v4-cleared-idle-slot.json").read_text())["save_response"]["n_saved"] == 0
    assert sf.n_tokens == 0 and sf.size == 44 and [b.role for b in sf.body.blocks] == ["kv-base", "kv-swa"]
    (p,) = sf.problems
    assert p.code == ProblemCode.EMPTY_SLOT and p.severity == "warning" and (p.section, p.offset) == ("tokens", 12)
    assert "--no-cache-idle-slots" in p.message
