"""slotfile diff: two files compared in file order (headers and settings, tokens, layers over the
shared cells, appendices), exit codes like cmp (0 identical, 1 different, 8 cannot read), against
the committed fixtures written by real llama.cpp libraries and copies of them damaged here."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from slotfile.diff import SCHEMA, Status, Verdict, diff_files
from slotfile.diff.rawbytes import bytes_equal
from slotfile.format.reader import open_slot_file
from slotfile.model.bridge import load_model_info
from slotfile.repair import Outcome, RepairOptions, run
from slotfile.safewrite import resolve_target

from .conftest import MODELS, SLOTS, slotfile_cli

LLAMA = MODELS / "llama.gguf"
F16 = SLOTS / "llama_f16_fa.slot"  # 54 tokens, V row-major, two checkpoints
F16_T = SLOTS / "llama_f16_nofa.slot"  # the same prompt with V transposed (flash attention off)
Q8 = SLOTS / "llama_q8_0_fa.slot"
DRAFT = SLOTS / "llama_draft_sdft.slot"
GEMMA = SLOTS / "gemma3_iswa_fa.slot"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copyfile(src, dst)
    return dst


def _flip(path: Path, offset: int, mask: int = 0x40) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


def _stream(path: Path, block: int = 0) -> Any:
    sf = open_slot_file(path)
    return sf.body.blocks[block].active_streams()[0]


def _bad(rep: Any) -> list[Any]:
    return [r for r in rep.runs if r.status != Status.IDENTICAL]


def _migrate(src: Path, out: Path, to: int, model: Path | None = None) -> Path:
    rep = run(
        "migrate", str(src), resolve_target(src, out), RepairOptions(model=str(model) if model else None, to_version=to)
    )
    assert rep.outcome == Outcome.REPAIRED, rep.reason
    return out


# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "src", [F16, F16_T, Q8, DRAFT, GEMMA, SLOTS / "extra-llama.session", SLOTS / "extra-jamba.slot"]
)
def test_identical_copy_exits_0(tmp_path: Path, src: Path):
    b = _copy(src, tmp_path / "b.slot")
    rep = diff_files(src, b)
    assert rep.verdict == Verdict.IDENTICAL and rep.exit_code == 0, rep.differences()
    assert rep.runs and all(r.status == Status.IDENTICAL for r in rep.runs)
    assert all(r.stats is None for r in rep.runs)  # equal bytes: no statistics computed
    res = slotfile_cli("diff", src, b)
    assert res.exit_code == 0, res.stdout + res.stderr
    assert "result: identical" in res.stdout


def test_flipped_byte_in_a_v_row_names_layer_part_and_cell(tmp_path: Path):
    b = _copy(F16, tmp_path / "b.slot")
    st = _stream(F16)
    v1 = st.v[1]
    cell = 17
    _flip(b, v1.data.offset + cell * v1.row_size + 5)
    rep = diff_files(F16, b)
    assert rep.exit_code == 1 and rep.verdict == Verdict.DIFFERENT
    bad = _bad(rep)
    assert [(r.container, r.part, r.layer) for r in bad] == [("body", "V", 1)]
    r = bad[0]
    assert r.first_cell == cell and r.differing_cells == 1 and r.first_pos == int(st.positions[cell])
    assert r.first_offset_a == v1.data.offset + cell * v1.row_size + 5
    assert r.stats is not None and r.stats["worst_cell"] == cell and r.stats["rel"] > 0 and r.stats["angle"] > 0
    # the checkpoints hold their own copies of the cache: untouched
    assert all(c.status == Status.IDENTICAL for c in rep.checkpoints)
    res = slotfile_cli("diff", F16, b)
    assert res.exit_code == 1
    assert "body.kv.stream[0] V layer 1 (f16): 1 of 54 cells differ; first cell 17" in res.stdout
    assert "worst cell 17" in res.stdout and "relative difference" in res.stdout


def test_flipped_byte_in_a_transposed_v_column(tmp_path: Path):
    b = _copy(F16_T, tmp_path / "b.slot")
    st = _stream(F16_T)
    v0 = st.v[0]
    assert v0.transposed
    elem, cell = 9, 30
    _flip(b, v0.data.offset + (elem * st.cell_count + cell) * 2 + 1)
    rep = diff_files(F16_T, b)
    (r,) = _bad(rep)
    assert (r.part, r.layer, r.first_cell, r.differing_cells) == ("V", 0, cell, 1)
    assert r.first_offset_a == v0.data.offset + (elem * st.cell_count + cell) * 2 + 1
    assert r.stats["worst_cell"] == cell


def test_quantized_rows_are_dequantized(tmp_path: Path):
    b = _copy(Q8, tmp_path / "b.slot")
    k0 = _stream(Q8).k[0]
    cell = 40
    _flip(b, k0.data.offset + cell * k0.row_size + 10, 0x7F)  # a quant, not the block scale
    rep = diff_files(Q8, b, load_model_info(LLAMA))
    (r,) = _bad(rep)
    assert (r.part, r.layer, r.first_cell, r.type_a) == ("K", 0, cell, "q8_0")
    assert r.stats["head"] == 32 and 0 < r.stats["angle"] < 90 and r.stats["max_abs"] > 0


def test_different_tokens_give_the_first_index_and_the_shared_count(tmp_path: Path):
    b = _copy(F16, tmp_path / "b.slot")
    sf = open_slot_file(F16)
    at = 20
    data = bytearray(b.read_bytes())
    old = int(sf.tokens.tokens[at])
    struct.pack_into("<i", data, sf.tokens.ids_offset + 4 * at, (old + 1) % 320)
    b.write_bytes(bytes(data))
    rep = diff_files(F16, b)
    t = rep.tokens
    assert (t.first_diff, t.shared, t.n_a, t.n_b) == (at, at, 54, 54)
    assert (t.token_a, t.token_b) == (old, (old + 1) % 320)
    # only the cells of the shared prefix are compared (positions 0..19)
    body_cells = [c for c in rep.cells if c.container == "body"]
    assert body_cells and all(c.compared == at and c.pos_last == at - 1 for c in body_cells)
    assert rep.exit_code == 1 and "tokens" in rep.differences()
    res = slotfile_cli("diff", F16, b, "--model", LLAMA)
    assert res.exit_code == 1
    assert f"tokens: differ from index {at} ({at} shared; A holds 54, B 54)" in res.stdout
    assert "A from there:" in res.stdout and "B from there:" in res.stdout
    js = json.loads(slotfile_cli("diff", F16, b, "--model", LLAMA, "--json").stdout)
    assert js["tokens"]["context"]["text_a"] != js["tokens"]["context"]["text_b"]


def _prefix_file(src: Path, out: Path) -> Path:
    """A slot file of the first checkpoint's tokens and state: a plain KV cache's checkpoint blob
    is its whole cache at that point (PARTIAL_ONLY is ignored by llama_kv_cache), so header +
    packed tokens + the blob's body is what a save taken then would hold."""
    sf = open_slot_file(src)
    ck = sf.checkpoints[0]
    n = ck.n_tokens
    payload = struct.pack("<iII", -1, 1, n) + sf.tokens.tokens[:n].astype("<i4").tobytes() + struct.pack("<I", 0)
    out.write_bytes(struct.pack("<III", 0x67677371, 3, len(payload) // 4) + payload + bytes(ck.tgt.data.view[8:]))
    b = open_slot_file(out)
    assert b.verdict == "ok" and b.n_tokens == n
    return out


def test_a_save_taken_earlier_shares_a_prefix(tmp_path: Path):
    b = _prefix_file(F16, tmp_path / "early.slot")
    rep = diff_files(F16, b)
    t = rep.tokens
    assert (t.shared, t.first_diff, t.n_a, t.n_b, t.token_b) == (16, 16, 54, 16, None)
    (cells,) = [c for c in rep.cells if c.container == "body"]
    assert (cells.cells_a, cells.cells_b, cells.compared, cells.pos_first, cells.pos_last) == (54, 16, 16, 0, 15)
    assert all(r.status == Status.IDENTICAL and r.cells == 16 for r in rep.runs)  # the shared cells agree
    assert rep.exit_code == 1
    res = slotfile_cli("diff", F16, b)
    assert "tokens: differ from index 16 (16 shared; A holds 54, B 16): B ends there" in res.stdout
    assert "54 cells in A, 16 in B; 16 compared (positions 0..15)" in res.stdout


def test_align_finds_a_shifted_window():
    """An SWA cache keeps only its last window: the shared cells start at different cells."""
    from slotfile.diff.cells import align
    from slotfile.format import grammar as g

    def table(start: int, n: int) -> g.CellTable:
        cells = np.zeros(n, g.kv_cell_dtype(0))
        cells["pos"], cells["n_seq_id"] = np.arange(start, start + n), 1
        return g.CellTable(0, cells, cells["seq_id"], cells.tobytes())

    al = align(table(46, 8), table(40, 8), None)
    assert (al.a0, al.b0, al.m, al.meta_same) == (0, 6, 2, True)
    al = align(table(40, 8), table(46, 8), None)
    assert (al.a0, al.b0, al.m) == (6, 0, 2)
    assert align(table(40, 8), table(40, 8), 44).m == 4  # below the first diverging token only
    assert align(table(0, 4), table(10, 4), None).m == 0


@pytest.mark.parametrize("src", [F16, F16_T, DRAFT, GEMMA, SLOTS / "llama_2stream.slot", SLOTS / "extra-jamba.slot"])
def test_v3_and_its_v4_migration_are_identical_but_for_the_rotation_words(tmp_path: Path, src: Path):
    v4 = _migrate(src, tmp_path / "v4.slot", 4)
    assert open_slot_file(v4).version == 4
    rep = diff_files(src, v4)
    assert rep.verdict == Verdict.ROTATION_ONLY, rep.differences()
    assert rep.exit_code == 0
    names = {f.name for f in rep.rotation_fields}
    assert "version" in names
    if any(b.kind == "KV" for b in open_slot_file(src).body.blocks):
        assert {"n_rot_k", "n_rot_v"} <= names
    res = slotfile_cli("diff", src, v4)
    assert res.exit_code == 0
    assert "result: identical but for the rotation words (state version 3 / 4)" in res.stdout
    # and back the other way
    assert diff_files(v4, src).verdict == Verdict.ROTATION_ONLY


def test_rotated_q8_0_migration_and_real_v4_file(tmp_path: Path):
    """A q8_0 cache of head 128: the migrated file is identical but for the rotation words
    (128, 64); against what a real v4 library wrote for the same recipe, diff names the few
    cells whose rounding differs."""
    src = SLOTS / "v4" / "v3" / "llama128_q8_0_fa.slot"
    model = MODELS / "llama128.gguf"
    v4 = _migrate(src, tmp_path / "v4.slot", 4, model)
    rep = diff_files(src, v4)
    assert rep.verdict == Verdict.ROTATION_ONLY, rep.differences()
    rot = {(f.name, f.b) for f in rep.rotation_fields}
    assert ("n_rot_k", 128) in rot and ("n_rot_v", 64) in rot
    real = diff_files(v4, SLOTS / "v4" / "llama128_q8_0_fa.slot")
    if real.verdict == Verdict.DIFFERENT:
        assert all(r.status in (Status.IDENTICAL, Status.DIFFERENT) for r in real.runs)
        assert all(r.first_cell is not None and r.differing_cells >= 1 for r in _bad(real))


def test_two_rotation_settings_are_a_real_difference(tmp_path: Path):
    """Rotation words on both sides that disagree (one writer ran with LLAMA_ATTN_ROT_DISABLE):
    not "identical but for the rotation words"."""
    v4 = _migrate(SLOTS / "v4" / "v3" / "llama128_q8_0_fa.slot", tmp_path / "v4.slot", 4, MODELS / "llama128.gguf")
    zero = _copy(v4, tmp_path / "zero.slot")
    st = _stream(v4)
    data = bytearray(zero.read_bytes())
    struct.pack_into("<II", data, st.rot_offset, 0, 0)
    zero.write_bytes(bytes(data))
    rep = diff_files(v4, zero)
    assert rep.verdict == Verdict.DIFFERENT and rep.exit_code == 1
    assert any(f.name == "n_rot_k" and not f.same and not f.rotation for f in rep.fields)


def _drop_last_checkpoint(src: Path, out: Path) -> Path:
    sf = open_slot_file(src)
    last = sf.checkpoints[-1]
    data = src.read_bytes()
    new = bytearray(data[: last.offset] + data[last.end :])
    struct.pack_into("<I", new, sf.sckp.offset + 8, len(sf.checkpoints) - 1)  # SCKP: magic, version, count
    out.write_bytes(bytes(new))
    assert len(open_slot_file(out).checkpoints) == len(sf.checkpoints) - 1 and not open_slot_file(out).errors
    return out


def test_checkpoint_in_one_file_only(tmp_path: Path):
    b = _drop_last_checkpoint(F16, tmp_path / "b.slot")
    rep = diff_files(F16, b)
    assert rep.exit_code == 1
    only = [c for c in rep.checkpoints if c.status == Status.ONLY_A]
    sf = open_slot_file(F16)
    assert [(c.n_tokens, c.index_a) for c in only] == [(sf.checkpoints[-1].n_tokens, sf.checkpoints[-1].index)]
    assert all(c.status == Status.IDENTICAL for c in rep.checkpoints if c not in only)
    assert not _bad(rep)  # the body and the other checkpoint are untouched
    res = slotfile_cli("diff", b, F16)
    assert res.exit_code == 1 and "only in B" in res.stdout


def test_differing_checkpoint_blob_is_compared_like_the_body(tmp_path: Path):
    b = _copy(F16, tmp_path / "b.slot")
    ck = open_slot_file(F16).checkpoints[0]
    k = ck.tgt.body.blocks[0].active_streams()[0].k[0]
    _flip(b, k.data.offset + 3 * k.row_size + 1)
    rep = diff_files(F16, b)
    (r,) = _bad(rep)
    assert r.container == "sckp.checkpoint[0].data_tgt" and (r.part, r.layer, r.first_cell) == ("K", 0, 3)
    assert rep.checkpoints[0].status == Status.DIFFERENT and rep.checkpoints[1].status == Status.IDENTICAL


def test_draft_state_in_one_file_only_and_differing(tmp_path: Path):
    sf = open_slot_file(DRAFT)
    assert sf.draft is not None
    stripped = tmp_path / "nodraft.slot"
    stripped.write_bytes(DRAFT.read_bytes()[: sf.draft.offset])
    rep = diff_files(DRAFT, stripped)
    assert rep.draft is not None and rep.draft.status == Status.ONLY_A and rep.exit_code == 1
    b = _copy(DRAFT, tmp_path / "b.slot")
    v = sf.draft.dft.body.blocks[0].active_streams()[0].v[0]
    _flip(b, v.data.offset + 7 * v.row_size)
    rep = diff_files(DRAFT, b)
    (r,) = _bad(rep)
    assert r.container == "sdft.data_dft" and (r.part, r.first_cell) == ("V", 7)
    assert rep.draft.status == Status.DIFFERENT


def test_flash_attention_on_against_off_is_compared_by_value():
    rep = diff_files(F16, F16_T)
    assert rep.exit_code == 1  # v_trans differs
    assert any(f.name == "v_trans" and (f.a, f.b) == (0, 1) for f in rep.fields)
    v = [r for r in rep.runs if r.container == "body" and r.part == "V"]
    assert v and all(r.by_value and r.cells == 54 for r in v)
    k = [r for r in rep.runs if r.container == "body" and r.part == "K"]
    assert k and all(not r.by_value for r in k)


def test_unrelated_files_are_different_not_a_crash():
    rep = diff_files(F16, GEMMA)
    assert rep.exit_code == 1
    assert any(f.name == "memory class" and not f.same for f in rep.fields)
    res = slotfile_cli("diff", F16, GEMMA)
    assert res.exit_code == 1 and "result: different" in res.stdout


def test_unreadable_inputs_exit_8(tmp_path: Path):
    missing = tmp_path / "missing.slot"
    res = slotfile_cli("diff", F16, missing)
    assert res.exit_code == 8 and "cannot open" in res.stderr and "Traceback" not in res.stdout + res.stderr
    res = slotfile_cli("diff", LLAMA, F16)
    assert res.exit_code == 8 and "GGUF" in res.stderr
    cut = tmp_path / "cut.slot"
    cut.write_bytes(F16.read_bytes()[:9000])  # inside the body
    res = slotfile_cli("diff", F16, cut)
    assert res.exit_code == 8, res.stdout
    assert "cannot read B" in res.stdout and "truncated" in res.stderr.lower() + res.stdout.lower()
    assert "tokens: equal" in res.stdout  # what can be compared still is
    res = slotfile_cli("diff", F16, tmp_path)
    assert res.exit_code == 8 and "directory" in res.stderr
    res = slotfile_cli("diff", F16, F16, "--model", tmp_path / "none.gguf")
    assert res.exit_code == 8
    res = slotfile_cli("diff", F16)
    assert res.exit_code == 2


def test_json_schema(tmp_path: Path):
    b = _copy(F16, tmp_path / "b.slot")
    v1 = _stream(F16).v[1]
    _flip(b, v1.data.offset + 2 * v1.row_size)
    res = slotfile_cli("diff", F16, b, "--json")
    assert res.exit_code == 1
    js = json.loads(res.stdout)
    assert js["schema"] == SCHEMA == "slotfile.diff/1"
    assert {
        "a",
        "b",
        "verdict",
        "identical",
        "differences",
        "unreadable",
        "head_k",
        "head_v",
        "fields",
        "tokens",
        "cells",
        "layers",
        "checkpoints",
        "draft",
        "draft_spec",
        "other",
        "bytes_compared",
        "seconds",
        "exit_code",
    } <= set(js)
    assert js["verdict"] == "different" and js["identical"] is False and js["exit_code"] == 1
    assert {"path", "size", "format", "version", "verdict", "problems", "unreadable"} <= set(js["a"])
    assert {"section", "field", "a", "b", "same", "rotation"} <= set(js["fields"][0])
    assert {"same", "n_a", "n_b", "shared", "first_diff", "context"} <= set(js["tokens"])
    (bad,) = [r for r in js["layers"] if r["status"] != "identical"]
    assert {
        "section",
        "part",
        "layer",
        "status",
        "type_a",
        "type_b",
        "cells",
        "differing_cells",
        "first_cell",
        "first_pos",
        "first_offset_a",
        "stats",
    } <= set(bad)
    assert (bad["part"], bad["layer"], bad["first_cell"]) == ("V", 1, 2)
    assert {"angle", "rel", "lnorm", "median_angle", "max_abs", "worst_cell", "worst_pos", "head"} <= set(bad["stats"])
    assert {"n_tokens", "pos_min", "pos_max", "status", "index_a", "index_b", "blobs"} <= set(js["checkpoints"][0])
    same = json.loads(slotfile_cli("diff", F16, F16, "--json").stdout)
    assert same["verdict"] == "identical" and same["exit_code"] == 0 and same["identical"] is True


def test_bytes_equal_catches_the_last_bytes():
    a = bytes(range(256)) * 3 + b"xyz"
    b = bytearray(a)
    assert bytes_equal(memoryview(a), memoryview(bytes(b)))
    b[-1] ^= 1
    assert not bytes_equal(memoryview(a), memoryview(bytes(b)))
    b[-1] ^= 1
    b[13] ^= 1
    assert not bytes_equal(memoryview(a)[1:], memoryview(bytes(b))[1:])  # unaligned views
    assert not bytes_equal(memoryview(a), memoryview(a)[:-1])


def test_other_bytes_are_caught(tmp_path: Path):
    """A byte outside every compared field (the seq id of a cell: the slot it was saved from)."""
    b = _copy(F16, tmp_path / "b.slot")
    st = _stream(F16)
    cells = st.cells
    stride = cells.cells.dtype.itemsize
    off = cells.offset + 5 * stride + cells.cells.dtype.fields["seq_id"][1]
    data = bytearray(b.read_bytes())
    struct.pack_into("<i", data, off, 3)
    b.write_bytes(bytes(data))
    rep = diff_files(F16, b)
    assert rep.exit_code == 1
    assert any(not c.meta_same for c in rep.cells)
    assert np.all([r.status == Status.IDENTICAL for r in rep.runs])


def test_damaged_cell_position_is_named_and_rows_still_compared(tmp_path: Path):
    b = _copy(F16, tmp_path / "b.slot")
    cells = _stream(F16).cells
    off = cells.offset + 20 * cells.cells.dtype.itemsize  # pos is the first field of a cell
    data = bytearray(b.read_bytes())
    struct.pack_into("<i", data, off, 999)
    b.write_bytes(bytes(data))
    rep = diff_files(F16, b)
    (c,) = [c for c in rep.cells if c.container == "body"]
    assert not c.meta_same and c.compared == 54 and "cell 20" in c.note and "999" in c.note
    assert all(r.status == Status.IDENTICAL for r in rep.runs)
    assert rep.exit_code == 1
    assert "cell 20 differs: position 20 in A, 999 in B" in slotfile_cli("diff", F16, b).stdout


def test_non_finite_value_is_named(tmp_path: Path):
    b = _copy(F16, tmp_path / "b.slot")
    k1 = _stream(F16).k[1]
    data = bytearray(b.read_bytes())
    struct.pack_into("<H", data, k1.data.offset + 9 * k1.row_size + 4, 0x7E00)  # an f16 NaN
    b.write_bytes(bytes(data))
    rep = diff_files(F16, b)
    (r,) = _bad(rep)
    assert (r.part, r.layer, r.first_cell) == ("K", 1, 9) and r.stats["nonfinite_b_cell"] == 9
    js = json.loads(slotfile_cli("diff", F16, b, "--json").stdout)  # no NaN in the JSON
    (row,) = [x for x in js["layers"] if x["status"] != "identical"]
    assert row["stats"]["nonfinite_b_cell"] == 9
    back = diff_files(b, F16)
    assert _bad(back)[0].stats["nonfinite_a_cell"] == 9


def test_real_v3_and_v4_libraries_files():
    """The same recipe through the real v3 and v4 libraries: the q8_0 cache (head 32: no
    rotation) came out identical but for the rotation words; f16 files differ by the rounding of
    two builds, in a few cells, each named."""
    rep = diff_files(Q8, SLOTS / "v4" / Q8.name)
    assert rep.verdict == Verdict.ROTATION_ONLY and rep.exit_code == 0, rep.differences()
    rep = diff_files(F16, SLOTS / "v4" / F16.name)
    bad = _bad(rep)
    assert bad and all(r.status == Status.DIFFERENT and r.first_cell is not None for r in bad)
    assert all(r.stats["rel"] < 1e-3 for r in bad)  # rounding, not another state
    assert not [f for f in rep.fields if not f.same and not f.rotation]


def test_every_fixture_is_compared_without_an_error():
    """Every committed fixture against itself, its twin of the other state version and a file of
    another model or layout (memory kinds, versions, session files): a report, never an
    exception, and JSON without NaN.  (All 44 x 44 pairs pass too; 80 s, so not run here.)"""
    files = sorted(p for p in SLOTS.rglob("*") if p.suffix in (".slot", ".session"))
    for a in files:
        twins = [p for p in files if p.name == a.name and p != a]
        for b in [a, *twins, F16, SLOTS / "extra-jamba.session"]:
            rep = diff_files(a, b)
            json.dumps(rep.to_dict(), allow_nan=False)
            assert rep.exit_code in (0, 1), rep.unreadable
            if a == b:
                assert rep.verdict == Verdict.IDENTICAL, (a, rep.differences())


def test_model_layer_is_named_with_the_model(tmp_path: Path):
    """iSWA: the SWA cache holds model layers 0 and 2; with --model its cache layer 1 is named
    as model layer 2."""
    b = _copy(GEMMA, tmp_path / "b.slot")
    st = _stream(GEMMA, block=1)
    v1 = st.v[1]
    _flip(b, v1.data.offset + 2 * v1.row_size + 3)
    res = slotfile_cli("diff", GEMMA, b, "--model", MODELS / "gemma3.gguf")
    assert res.exit_code == 1
    assert "body.kv-swa.stream[0] V layer 1 (model layer 2) (f16): 1 of" in res.stdout
    js = json.loads(slotfile_cli("diff", GEMMA, b, "--json").stdout)
    (row,) = [x for x in js["layers"] if x["status"] != "identical"]
    assert (row["block"], row["layer"], row["model_layer"]) == ("kv-swa", 1, None)  # no model: cache index only


def test_only_the_version_word_differs(tmp_path: Path):
    """A recurrent-only state has no KV stream, so no rotation words: a file whose version word
    alone differs is "identical but for the version word" (exit 0), not different."""
    src = SLOTS / "extra-mamba.slot"
    b = _copy(src, tmp_path / "b.slot")
    data = bytearray(b.read_bytes())
    struct.pack_into("<I", data, 4, 2)
    b.write_bytes(bytes(data))
    rep = diff_files(src, b)
    assert rep.verdict == Verdict.VERSION_ONLY and rep.exit_code == 0 and not rep.differences()
    res = slotfile_cli("diff", src, b)
    assert res.exit_code == 0 and "result: identical but for the version word (3 / 2)" in res.stdout
    assert json.loads(slotfile_cli("diff", src, b, "--json").stdout)["verdict"] == "identical-but-version"


def test_the_damage_corpus_is_named(tmp_path: Path):
    """tests/damage.py's damaged copies against their originals: each one's damage named by
    layer and cell (or token index, checkpoint, or where a truncated copy was cut)."""
    from .damage import CORPUS, build

    got = {}
    for d in CORPUS:
        rep = diff_files(d.base, build(d, tmp_path))
        got[d.name] = rep
    bad = {k: [(r.part, r.layer, r.first_cell, r.differing_cells) for r in _bad(rep)] for k, rep in got.items()}
    assert bad["kv-swapped-layer0"] == [("K", 0, 0, 54), ("V", 0, 0, 54)]
    assert bad["v-row-zeroed"] == [("V", 1, 10, 1)]
    assert bad["k-layer1-scaled"] == [("K", 1, 0, 54)]
    assert got["k-layer1-scaled"].runs[1].stats["lnorm"] == pytest.approx(np.log(1.5), abs=0.01)
    assert got["token-changed"].tokens.first_diff == 20 and bad["token-changed"] == []
    assert [c.status for c in got["sckp-count-corrupt"].checkpoints] == [Status.ONLY_A, Status.ONLY_A]
    assert got["checkpoint-len-plus-one"].checkpoints[0].status == Status.DIFFERENT
    cut = got["body-truncated"]
    assert cut.exit_code == 8 and "inside body.kv K layer 1, cell 48 of 54" in cut.b.unreadable
    assert "a truncated copy" in cut.b.unreadable
    assert got["version-4"].verdict == Verdict.ROTATION_ONLY
    assert got["recurrent-two-cells"].exit_code == 8
    for name, rep in got.items():
        assert rep.exit_code in ((0,) if name == "version-4" else (1, 8)), name


def test_help_and_examples():
    short, long = slotfile_cli("diff", "-h"), slotfile_cli("diff", "--help")
    assert short.exit_code == 0 and short.stdout == long.stdout
    assert "Usage: slotfile diff" in short.stdout and "-h, --help" in short.stdout
    examples = short.stdout.split("Examples:", 1)[1].strip().splitlines()
    assert len(examples) >= 2
    for line in examples:  # one example a line, inside 80 columns (as tests/cli holds every command to)
        assert line.strip().startswith("slotfile diff ") and len(line) <= 80, line
