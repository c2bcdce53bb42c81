"""``verify --deep`` on what follows the body: every SCKP checkpoint's data_tgt against a
recompute of its first n_tokens, and with ``--draft-model`` the checkpoints' data_dft and the
SDFT draft state (slotfile/verify/deep_blobs.py), through the real llama.cpp worker.

The damaged copies keep every framing field intact (lengths, counts, headers): only values
inside one blob change, which structure, model and load cannot see.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from slotfile.format.reader import parse_buffer
from slotfile.verify import Verifier, VerifyOptions

from .conftest import MODELS, SLOTS

pytestmark = pytest.mark.llama

LLAMA, GEMMA, DRAFT = MODELS / "llama.gguf", MODELS / "gemma3.gguf", MODELS / "draft.gguf"


@pytest.fixture(scope="module")
def llama_v():
    with Verifier(VerifyOptions(model=str(LLAMA), deep=True)) as v:
        yield v


@pytest.fixture(scope="module")
def draft_v():
    with Verifier(VerifyOptions(model=str(LLAMA), draft_model=str(DRAFT), deep=True)) as v:
        yield v


def _deep(v: Verifier, path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    r = v.verify(path).to_dict()
    return r, r["levels"]["deep"]


def _blob_stream(data: bytes, which: str, index: int = 0):
    """The first active KV stream of a blob's body: ``which`` "tgt"/"dft" of checkpoint
    ``index``, or "sdft" for the SDFT data_dft."""
    sf = parse_buffer(data)
    blob = sf.draft.dft if which == "sdft" else getattr(sf.checkpoints[index], which)
    return blob, blob.body.blocks[0].active_streams()[0]


def _zero_v_row(data: bytes, which: str, index: int = 0, layer: int = 1, cell: int = 3) -> tuple[bytes, int]:
    """One cell's V row of one layer of a blob set to zero bytes: (new bytes, its offset)."""
    _, st = _blob_stream(data, which, index)
    v = st.v[layer]
    off = v.data.offset + cell * v.row_size
    b = bytearray(data)
    b[off : off + v.row_size] = bytes(v.row_size)
    return bytes(b), off


def _negate_v_row(data: bytes, which: str, index: int = 0, layer: int = 1, cell: int = 3) -> tuple[bytes, int]:
    """One cell's f16 V row of one layer of a blob with every sign bit flipped: (new bytes, its offset)."""
    _, st = _blob_stream(data, which, index)
    v = st.v[layer]
    off = v.data.offset + cell * v.row_size
    vals = np.frombuffer(data, dtype="<u2", count=v.row_size // 2, offset=off)
    b = bytearray(data)
    b[off : off + v.row_size] = (vals ^ np.uint16(0x8000)).astype("<u2").tobytes()
    return bytes(b), off


def _scale_k_row(data: bytes, which: str, index: int, layer: int, cell: int, factor: float) -> bytes:
    """One cell's f16 K row of one layer of a blob multiplied by ``factor``."""
    _, st = _blob_stream(data, which, index)
    k = st.k[layer]
    off = k.data.offset + cell * k.row_size
    vals = np.frombuffer(data, dtype="<f2", count=k.row_size // 2, offset=off).astype(np.float32)
    b = bytearray(data)
    b[off : off + k.row_size] = (vals * factor).astype("<f2").tobytes()
    return bytes(b)


def _write(tmp_path: Path, name: str, data: bytes) -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


@pytest.mark.parametrize(("name", "model"), [("llama_f16_fa", LLAMA), ("gemma3_iswa_nofa", GEMMA)])
def test_clean_checkpoints_pass_deep(name, model):
    with Verifier(VerifyOptions(model=str(model), deep=True)) as v:
        r, deep = _deep(v, SLOTS / f"{name}.slot")
    assert r["verdict"] == "pass" and r["level_reached"] == 4, r["first_problem"]
    cks = deep["details"]["checkpoints"]
    assert [c["n_tokens"] for c in cks] == [16, 32]
    for c in cks:
        assert c["status"] == "pass" and c["margin"] <= deep["details"]["limit"]
        assert c["worst"]["section"].startswith(f"sckp.checkpoint[{c['index']}].data_tgt.")
        assert c["layers"] > 0 and c["draft"] is None
        assert c["stepwise"] == 0  # recomputed exactly: no noise-floor pass
    assert deep["details"]["draft"] is None


def test_zeroed_row_in_checkpoint_fails_deep(llama_v, tmp_path):
    data = (SLOTS / "llama_f16_fa.slot").read_bytes()
    bad, off = _zero_v_row(data, "tgt", index=1, layer=1, cell=20)
    r, deep = _deep(llama_v, _write(tmp_path, "ck-zeroed.slot", bad))
    assert r["levels"]["structure"]["status"] == "pass" and r["levels"]["load"]["status"] == "pass"
    assert r["verdict"] == "fail" and deep["status"] == "fail"
    (p,) = deep["problems"]
    assert p["code"] == "deep-mismatch" and p["section"] == "sckp.checkpoint[1].data_tgt.kv.stream[0]"
    assert p["offset"] == off and "checkpoint 1 (n_tokens 32)" in p["message"]
    cks = deep["details"]["checkpoints"]
    assert [c["status"] for c in cks] == ["pass", "fail"] and cks[1]["margin"] > 4
    # judged again against its stepwise floor: the last 16 tokens of its segment one per call
    assert cks[0]["stepwise"] == 0 and cks[1]["stepwise"] == 16
    assert all(not row["section"].startswith("sckp") for row in deep["details"]["layers"])


def test_scaled_k_row_in_gemma_checkpoint_fails_deep(tmp_path):
    data = (SLOTS / "gemma3_iswa_fa.slot").read_bytes()
    bad = _scale_k_row(data, "tgt", index=1, layer=0, cell=4, factor=1.5)
    with Verifier(VerifyOptions(model=str(GEMMA), deep=True)) as v:
        r, deep = _deep(v, _write(tmp_path, "ck-scaled.slot", bad))
    assert r["levels"]["load"]["status"] == "pass" and deep["status"] == "fail"
    role = parse_buffer(data).checkpoints[1].tgt.body.blocks[0].role  # the SWA cells (PARTIAL_ONLY)
    assert {p["section"] for p in deep["problems"]} == {f"sckp.checkpoint[1].data_tgt.{role}.stream[0]"}
    assert deep["details"]["checkpoints"][0]["status"] == "pass"


@pytest.mark.slow
def test_scaled_recurrent_state_in_checkpoint_fails_deep(tmp_path):
    """Mamba: the checkpoint blob is the REC block; its noise floor comes from the stepwise
    decode in a context that is never rolled back (recurrent memory cannot drop cells)."""
    data = (SLOTS / "extra-mamba.slot").read_bytes()
    s = parse_buffer(data).checkpoints[1].tgt.body.blocks[0].s[1].data
    vals = np.frombuffer(data, dtype="<f4", count=s.length // 4, offset=s.offset)
    bad = data[: s.offset] + (vals * 1.5).astype("<f4").tobytes() + data[s.offset + s.length :]
    with Verifier(VerifyOptions(model=str(MODELS / "extra-mamba.gguf"), deep=True)) as v:
        r, deep = _deep(v, SLOTS / "extra-mamba.slot")
        assert r["verdict"] == "pass", r["first_problem"]
        r, deep = _deep(v, _write(tmp_path, "mamba-scaled.slot", bad))
    assert r["levels"]["load"]["status"] == "pass" and deep["status"] == "fail"
    (p,) = deep["problems"]
    assert p["code"] == "deep-mismatch" and p["section"] == "sckp.checkpoint[1].data_tgt.rec"
    assert p["offset"] == s.offset
    c = deep["details"]["checkpoints"][1]
    assert c["status"] == "fail" and c["stepwise"] == 9  # the 9 tokens since the last checkpoint


def test_checkpoint_past_the_tokens_is_skipped_with_a_reason(llama_v, tmp_path):
    data = bytearray((SLOTS / "llama_f16_fa.slot").read_bytes())
    ck = parse_buffer(bytes(data)).checkpoints[1]
    data[ck.offset : ck.offset + 8] = struct.pack("<q", 60)  # n_tokens past the 54 stored tokens
    r, deep = _deep(llama_v, _write(tmp_path, "ck-past.slot", bytes(data)))
    assert deep["status"] == "pass", r["first_problem"]
    cks = deep["details"]["checkpoints"]
    assert cks[0]["status"] == "pass"
    assert cks[1]["status"] == "skipped" and "not within the 54 stored tokens" in cks[1]["reason"]


def test_draft_blobs_without_draft_model_are_skipped(llama_v):
    r, deep = _deep(llama_v, SLOTS / "llama_draft_sdft.slot")
    assert r["verdict"] == "pass", r["first_problem"]
    d = deep["details"]
    assert d["draft"]["status"] == "skipped" and d["draft"]["reason"] == "no --draft-model"
    assert all(c["status"] == "pass" and c["draft"]["status"] == "skipped" for c in d["checkpoints"])


@pytest.mark.parametrize("name", ["llama_draft_sdft", "llama_draft_sdft_only"])
def test_clean_draft_state_passes_deep(draft_v, name):
    r, deep = _deep(draft_v, SLOTS / f"{name}.slot")
    assert r["verdict"] == "pass" and r["level_reached"] == 4, r["first_problem"]
    d = deep["details"]
    assert d["draft"]["status"] == "pass" and d["draft"]["worst"]["section"].startswith("sdft.data_dft.")
    assert all(c["draft"]["status"] == "pass" for c in d["checkpoints"])


@pytest.mark.parametrize("damage", ["zeroed", "negated"])
def test_damaged_row_in_sdft_fails_deep(draft_v, tmp_path, damage):
    data = (SLOTS / "llama_draft_sdft.slot").read_bytes()
    bad, off = (_zero_v_row if damage == "zeroed" else _negate_v_row)(data, "sdft", layer=0, cell=40)
    r, deep = _deep(draft_v, _write(tmp_path, f"sdft-{damage}.slot", bad))
    assert r["levels"]["load"]["status"] == "pass" and deep["status"] == "fail"
    (p,) = deep["problems"]
    assert p["code"] == "deep-mismatch" and p["section"] == "sdft.data_dft.kv.stream[0]" and p["offset"] == off
    d = deep["details"]["draft"]
    assert d["status"] == "fail"
    if damage == "zeroed":
        # the row's 16 f16 values zeroed: a float zero run (judge.ZERO_RUN_FLOAT), damage whatever the floors
        assert d["decided_by"] == "bytes" and "exactly zero, 16 of them" in p["message"]
    else:
        # every other layer recomputes cell 40 exactly: a lone cell, damage without a floor pass
        # (the floor pass of a draft state: test_deep_blobs_damage.py)
        assert d["stepwise"] == 0 and d["decided_by"] == "lone-layer"


@pytest.mark.parametrize("damage", ["zeroed", "negated"])
def test_damaged_row_in_checkpoint_draft_blob_fails_deep(draft_v, tmp_path, damage):
    data = (SLOTS / "llama_draft_sdft.slot").read_bytes()
    bad, off = (_zero_v_row if damage == "zeroed" else _negate_v_row)(data, "dft", index=2, layer=0, cell=30)
    r, deep = _deep(draft_v, _write(tmp_path, f"ckdft-{damage}.slot", bad))
    assert r["levels"]["load"]["status"] == "pass" and deep["status"] == "fail"
    (p,) = deep["problems"]
    assert p["section"] == "sckp.checkpoint[2].data_dft.kv.stream[0]" and p["offset"] == off
    assert "checkpoint 2 (n_tokens 32), draft" in p["message"]
    c = deep["details"]["checkpoints"][2]
    assert c["status"] == "pass" and c["draft"]["status"] == "fail"
    assert c["draft"]["decided_by"] == ("bytes" if damage == "zeroed" else "lone-layer")


@pytest.mark.slow
def test_v4_checkpoints_and_draft_state(llama_v4_lib, tmp_path):
    """Version-4 files (rotation words in every blob) through the v4 library: clean passes,
    a zeroed row in a checkpoint's data_dft fails naming it."""
    opts = VerifyOptions(model=str(LLAMA), draft_model=str(DRAFT), deep=True, llama_lib=str(llama_v4_lib))
    data = (SLOTS / "v4" / "llama_draft_sdft.slot").read_bytes()
    bad, off = _zero_v_row(data, "dft", index=1, layer=0, cell=12)
    with Verifier(opts) as v:
        r, deep = _deep(v, SLOTS / "v4" / "llama_draft_sdft.slot")
        assert r["verdict"] == "pass" and r["level_reached"] == 4, r["first_problem"]
        assert r["version"] == 4 and deep["details"]["draft"]["status"] == "pass"
        assert [c["status"] for c in deep["details"]["checkpoints"]] == ["pass"] * 3
        r, deep = _deep(v, _write(tmp_path, "v4-ckdft-zeroed.slot", bad))
    (p,) = deep["problems"]
    assert p["section"] == "sckp.checkpoint[1].data_dft.kv.stream[0]" and p["offset"] == off
