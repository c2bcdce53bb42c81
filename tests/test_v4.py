"""State version 4 / session version 11: the fixtures a real v4 libllama wrote (fixtures/slots/v4,
make_v4_fixtures.py) read by the grammar, checked against the model, and repaired."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from slotfile.format.reader import open_slot_file, parse_buffer
from slotfile.model.bridge import load_model_info
from slotfile.model.expect import expect_from_model, rotation_widths
from slotfile.repair import RepairOptions, run
from slotfile.safewrite import resolve_target

from .conftest import FIXTURES, SLOTS, slotfile_cli

V4 = SLOTS / "v4"
V4_MANIFEST = json.loads((V4 / "manifest.json").read_text())
V4_EXTRA = json.loads((V4 / "extra-manifest.json").read_text())
# (file, model, draft model) of every version-4 fixture
V4_FILES: list[tuple[Path, Path, Path | None]] = [
    (FIXTURES / e["file"], FIXTURES / e["model"], FIXTURES / e["draft_model"] if e["draft_model"] else None)
    for e in V4_MANIFEST["slots"]
] + [(FIXTURES / e["file"], FIXTURES / e["model"], None) for e in V4_EXTRA["files"]]
IDS = [p.name for p, _, _ in V4_FILES]


def _streams(body: Any) -> list[Any]:
    return [st for b in body.blocks if b.kind == "KV" for st in b.active_streams()] if body else []


def test_every_memory_kind_is_covered():
    kinds = {e["memory"] for e in V4_EXTRA["files"]} | {
        "iswa" if "gemma3" in e["file"] else "kv" for e in V4_MANIFEST["slots"]
    }
    assert kinds >= {"kv", "iswa", "recurrent", "hybrid"}
    assert any(e["arch"] == "deepseek2" for e in V4_EXTRA["files"])  # MLA
    assert any(e["kind"] == "session" for e in V4_EXTRA["files"])  # GGSN 11
    assert any(e["sdft"] for e in V4_MANIFEST["slots"]) and any(e["sckp"] for e in V4_MANIFEST["slots"])
    assert any(e["n_stream"] == 2 for e in V4_MANIFEST["slots"])
    rotated = [b for e in V4_MANIFEST["slots"] for b in e["body_blocks"] if b.get("n_rot_k")]
    assert rotated and {(b["n_rot_k"], b["n_rot_v"]) for b in rotated} == {(128, 64), (128, 0)}


@pytest.mark.parametrize(("path", "model", "draft"), V4_FILES, ids=IDS)
def test_v4_fixture_reads_by_the_grammar(path: Path, model: Path, draft: Path | None):
    sf = open_slot_file(path)
    assert sf.version in (4, 11)
    assert all(p.code in ("empty-body", "empty-slot") for p in sf.problems), [p.line() for p in sf.problems]
    assert sf.body is not None and sf.body.layout is not None and sf.body.layout.rot
    for st in _streams(sf.body):
        assert st.rot_offset is not None and st.n_rot_k is not None


@pytest.mark.parametrize(("path", "model", "draft"), V4_FILES, ids=IDS)
def test_v4_fixture_passes_the_model_level(path: Path, model: Path, draft: Path | None):
    exp = expect_from_model(load_model_info(model))
    dexp = expect_from_model(load_model_info(draft)) if draft else None
    sf = open_slot_file(path, expect=exp, draft_expect=dexp)
    assert sf.errors == [], [p.line() for p in sf.errors]


def test_the_rotation_words_are_where_the_manifest_says():
    e = next(e for e in V4_MANIFEST["slots"] if e["file"].endswith("llama128_q8_0_fa.slot"))
    sf = open_slot_file(FIXTURES / e["file"])
    (st,) = _streams(sf.body)
    assert (st.n_rot_k, st.n_rot_v) == (e["body_blocks"][0]["n_rot_k"], e["body_blocks"][0]["n_rot_v"]) == (128, 64)
    data = (FIXTURES / e["file"]).read_bytes()
    assert struct.unpack_from("<II", data, st.rot_offset) == (128, 64)


def test_rotation_widths_follow_llama_cpp():
    exp = expect_from_model(load_model_info(FIXTURES / "models" / "llama128.gguf"))
    (cache,) = exp.blocks
    q8, f16 = 8, 1
    assert rotation_widths(cache, q8, q8) == (128, 64)
    assert rotation_widths(cache, q8, f16) == (128, 0)
    assert rotation_widths(cache, f16, f16) == (0, 0)
    assert rotation_widths(cache, q8, q8, disabled=True) == (0, 0)
    small = expect_from_model(load_model_info(FIXTURES / "models" / "llama.gguf")).blocks[0]
    assert rotation_widths(small, q8, q8) == (0, 0)  # head 32: not a multiple of 64


def test_llama_attn_rot_disable_is_read_like_atoi(monkeypatch: pytest.MonkeyPatch):
    from slotfile.model.expect import attn_rot_disabled

    for raw, want in (("1", True), ("0", False), ("yes", False), (" 2x", True), ("", False)):
        monkeypatch.setenv("LLAMA_ATTN_ROT_DISABLE", raw)
        assert attn_rot_disabled() is want, raw


def _patched(path: Path, word: int, value: int) -> bytes:
    sf = open_slot_file(path)
    (st,) = _streams(sf.body)
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, st.rot_offset + 4 * word, value)
    return bytes(data)


def test_a_wrong_width_is_a_model_error_naming_both_values():
    path = V4 / "llama128_q8_0_fa.slot"
    exp = expect_from_model(load_model_info(FIXTURES / "models" / "llama128.gguf"))
    sf = parse_buffer(_patched(path, 0, 256), str(path), expect=exp)
    (err,) = [p for p in sf.errors if p.section == "body.kv.stream[0]"]
    assert "incompatible key rotation (stored 256, this model and a q8_0 K cache give 128)" in err.message
    assert "refuse the load" in err.message and err.offset == _streams(sf.body)[0].rot_offset


def test_a_zero_width_mentions_llama_attn_rot_disable(monkeypatch: pytest.MonkeyPatch):
    path = V4 / "llama128_q8_0_fa.slot"
    exp = expect_from_model(load_model_info(FIXTURES / "models" / "llama128.gguf"))
    sf = parse_buffer(_patched(path, 1, 0), str(path), expect=exp)
    (err,) = [p for p in sf.errors if p.section == "body.kv.stream[0]"]
    assert "incompatible value rotation (stored 0" in err.message and "LLAMA_ATTN_ROT_DISABLE" in err.message
    # a llama.cpp run with the variable set expects 0 everywhere: the same file then matches
    monkeypatch.setenv("LLAMA_ATTN_ROT_DISABLE", "1")
    sf = parse_buffer(_patched(path, 1, 0), str(path), expect=exp)
    body = [p.message for p in sf.errors if p.section == "body.kv.stream[0]"]
    assert len(body) == 1 and "incompatible key rotation (stored 128, this model and a q8_0 K cache give 0)" in body[0]
    assert "LLAMA_ATTN_ROT_DISABLE is set here" in body[0]


def test_a_damaged_rotation_word_is_a_structure_error_with_its_offset():
    path = V4 / "llama_f16_fa.slot"
    sf0 = open_slot_file(path)
    st = _streams(sf0.body)[0]
    sf = parse_buffer(_patched(path, 0, 0xDEADBEEF))
    (err,) = sf.errors
    assert err.code == "bad-rotation" and err.offset == st.rot_offset and "\n" not in err.message
    assert "n_rot_k 3735928559" in err.message


def test_dump_and_inspect_name_the_rotation_words():
    path = V4 / "llama128_q8_0_fa.slot"
    st = _streams(open_slot_file(path).body)[0]
    doc = json.loads(slotfile_cli("dump", path, "--json").stdout)
    s0 = doc["body"]["blocks"][0]["streams"][0]
    assert s0["n_rot_k"] == {"offset": st.rot_offset, "value": 128}
    assert s0["n_rot_v"] == {"offset": st.rot_offset + 4, "value": 64}
    text = slotfile_cli("dump", path).stdout
    assert f"{st.rot_offset}  body.blocks[0].streams[0].n_rot_k" in text
    out = _inspect(path)
    assert "K rotated, width 128; V rotated, width 64" in out
    assert "K rotated, width 128; V not rotated" in _inspect(V4 / "llama128_q8_0_k_nofa.slot")
    assert "no rotation" in _inspect(V4 / "llama_f16_fa.slot")
    assert "rotation" not in _inspect(SLOTS / "llama_f16_fa.slot")


def _inspect(path: Path) -> str:
    """``slotfile inspect`` in its own process (its rich console writes to the real stdout)."""
    r = subprocess.run(
        [sys.executable, "-m", "slotfile", "inspect", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
        cwd=FIXTURES.parent,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_a_v3_body_labelled_4_is_told_apart():
    data = (SLOTS / "gemma3_iswa_fa.slot").read_bytes()
    sf = parse_buffer(data[:4] + struct.pack("<I", 4) + data[8:])
    (err,) = sf.errors
    assert err.code == "version-layout" and err.offset == 4 and "no KV stream carries the rotation words" in err.message
    assert sf.body is not None and sf.body.layout is not None and not sf.body.layout.rot


def test_a_v4_body_labelled_3_is_told_apart():
    data = (V4 / "gemma3_iswa_fa.slot").read_bytes()
    sf = parse_buffer(data[:4] + struct.pack("<I", 3) + data[8:])
    assert [p.code for p in sf.errors] == ["version-layout"]
    assert "rotation words of version 4" in sf.errors[0].message


def _repair(command: str, src: Path, out: Path, **kw: Any) -> Any:
    return run(command, str(src), resolve_target(src, out), RepairOptions(**kw))


@pytest.mark.parametrize("name", ["llama_draft_sdft.slot", "gemma3_iswa_nofa.slot", "extra-jamba.slot"])
def test_repairs_keep_version_4(tmp_path: Path, name: str):
    src = V4 / name
    out = tmp_path / "stripped.slot"
    rep = _repair("strip-draft", src, out)
    assert rep.outcome in ("repaired", "nothing-to-do"), rep.reason
    assert open_slot_file(out).version == 4 and open_slot_file(out).errors == []
    # a cut SCKP: truncate-recover keeps the body and the intact checkpoints, still version 4
    sf = open_slot_file(src)
    if sf.sckp is None:
        return
    cut = tmp_path / "cut.slot"
    cut.write_bytes(src.read_bytes()[: sf.checkpoints[-1].tgt.data_offset + 40])
    rep = _repair("truncate-recover", cut, tmp_path / "fixed.slot")
    assert rep.outcome == "repaired", rep.reason
    fixed = open_slot_file(tmp_path / "fixed.slot")
    assert fixed.version == 4 and fixed.errors == [] and len(fixed.checkpoints) == len(sf.checkpoints) - 1
    assert (tmp_path / "fixed.slot").read_bytes()[12 : sf.body.end] == src.read_bytes()[12 : sf.body.end]


def test_probe_of_a_cut_v4_body_skips_the_rotation_words():
    from slotfile.repair.settings import probe_body

    src = V4 / "llama128_q8_0_fa.slot"
    sf = open_slot_file(src)
    view = memoryview(src.read_bytes()[: sf.body.offset + sf.body.size // 2])
    got = probe_body(view, sf.body.offset, len(view), rot=True)
    st = _streams(sf.body)[0]
    assert got["type_k"] == 8 and got["k_row"] == st.k[0].row_size and got["n_layer"] == 2


# ---------------------------------------------------------------------------------------
# the v4 fixtures through a real v4 llama.cpp (scripts/build-llama-v4.sh; CI builds it)
# ---------------------------------------------------------------------------------------

MODELS = SLOTS.parent / "models"


@pytest.mark.llama
@pytest.mark.parametrize(
    ("name", "model"),
    [("llama_draft_sdft.slot", "llama.gguf"), ("gemma3_iswa_nofa.slot", "gemma3.gguf"),
     ("llama128_q8_0_fa.slot", "llama128.gguf"), ("extra-jamba.slot", "extra-jamba.gguf")],
)  # fmt: skip
def test_v4_fixture_passes_every_level_through_the_v4_library(name: str, model: str, llama_v4_lib: Path):
    r = slotfile_cli("verify", V4 / name, "--model", MODELS / model, "--deep", "--llama-lib", llama_v4_lib, "--json")
    doc = json.loads(r.stdout)
    f = doc["files"][0]
    assert r.exit_code == 0, (f["first_problem"], r.stderr)
    assert {k: v["status"] for k, v in f["levels"].items()} == dict.fromkeys(
        ("structure", "model", "load", "deep"), "pass"
    )
    assert doc["loader"]["state_seq_version"] == 4


@pytest.mark.llama
def test_v4_body_cut_is_rebuilt_through_the_v4_library(tmp_path: Path, llama_v4_lib: Path):
    """truncate-recover --model on a v4 file whose body is cut: the body is rebuilt by prefill
    through the v4 library, stays version 4 and is test-loaded through it."""
    src = V4 / "llama_f16_fa.slot"
    sf = open_slot_file(src)
    cut = tmp_path / "cut.slot"
    cut.write_bytes(src.read_bytes()[: sf.body.offset + (sf.body.end - sf.body.offset) // 2])
    out = tmp_path / "fixed.slot"
    r = slotfile_cli(
        "truncate-recover", cut, "-o", out, "--model", MODELS / "llama.gguf", "--llama-lib", llama_v4_lib, "--json"
    )
    assert r.exit_code == 0, r.stdout + r.stderr
    rep = json.loads(r.stdout)
    assert rep["test_load"]["ok"] is True and rep["test_load"]["state_seq_version"] == 4
    fixed = open_slot_file(out)
    assert fixed.version == 4 and not fixed.errors
    assert fixed.body.blocks[0].streams[0].n_rot_k == 0


@pytest.mark.llama
def test_v4_resave_keeps_the_version_through_the_v4_library(tmp_path: Path, llama_v4_lib: Path):
    out = tmp_path / "nofa.slot"
    r = slotfile_cli(
        "re-save", V4 / "llama_f16_fa.slot", "-o", out, "--model", MODELS / "llama.gguf", "--flash-attn", "off",
        "--llama-lib", llama_v4_lib, "--json",
    )  # fmt: skip
    assert r.exit_code == 0, r.stdout + r.stderr
    new = open_slot_file(out)
    assert new.version == 4 and not new.errors
    assert new.body.blocks[0].streams[0].v_trans == 1
