"""One decision for the model problems of a file, the same in inspect, dump and verify.

Token -1 (LLAMA_TOKEN_NULL) is valid only in a run of -1 that a non-TEXT media chunk of the
packed form starts (server_tokens::validate); any other id outside [0, n_vocab) is an error.  A
position at or past n_ctx_train is a warning (llama.cpp only warns about n_ctx > n_ctx_train).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from slotfile import verify as V
from slotfile.format.reader import open_slot_file, parse_buffer
from slotfile.format.records import FileFormat, Problem, Severity, TokenForm
from slotfile.model.bridge import load_model_info
from slotfile.model.check import check_against_model
from slotfile.model.expect import expect_from_model
from slotfile.problems import cause_of
from slotfile.report import to_json

from .conftest import MODELS, SLOTS

BASE = SLOTS / "llama_f16_fa.slot"  # packed tokens (54 ids in 58 words), llama.gguf: n_vocab 320, n_ctx_train 256


@pytest.fixture(scope="module")
def llama() -> V.ModelSide:
    side = V.model_side(str(MODELS / "llama.gguf"))
    assert side is not None and side.expect is not None
    return side


def _with_tokens(data: bytes, ids: list[int], media: list[tuple[int, int]] | None) -> bytes:
    """``data`` (a GGSQ file with a packed payload) with its payload replaced: the packed form
    with ``media`` [(key, chunk type)], or the plain form when ``media`` is None."""
    n_words = struct.unpack_from("<I", data, 8)[0]
    rest = data[12 + 4 * n_words :]
    if media is None:
        payload = struct.pack(f"<{len(ids)}i", *ids)
    else:
        payload = struct.pack("<iII", -1, 1, len(ids)) + struct.pack(f"<{len(ids)}i", *ids)
        payload += struct.pack("<I", len(media)) + struct.pack(f"<{len(media)}I", *(k for k, _ in media))
        for _, kind in media:
            # an mtmd chunk (mtmd_input_chunk::serialize): version 2, type, no text tokens,
            # no image block, no audio block
            chunk = struct.pack("<QIQBB", 2, kind, 0, 0, 0)
            payload += struct.pack("<I", len(chunk)) + chunk
        payload += bytes(-len(payload) % 4)
    return data[:8] + struct.pack("<I", len(payload) // 4) + payload + rest


def _ids() -> list[int]:
    sf = open_slot_file(BASE)
    return [int(t) for t in sf.tokens.tokens]


def _token_problems(sf) -> list[Problem]:
    return [p for p in sf.problems if p.code == "token-out-of-vocab"]


def _all_three(data: bytes, side: V.ModelSide, tmp_path: Path) -> tuple[list[dict], list[dict], list[dict]]:
    """The model problems as inspect/dump (the reader), dump --json and verify's model level see them."""
    path = tmp_path / "f.slot"
    path.write_bytes(data)
    sf = open_slot_file(path, model=side.info)
    reader = [p.to_dict() for p in sf.model_problems]
    # dump and verify add each problem's class (slotfile.diagnosis): the same for the same code
    dumped = [_unclassed(p) for p in json.loads(json.dumps(to_json(sf)))["problems"] if _unclassed(p) in reader]
    verified = [
        _unclassed(p.to_dict(with_class=True)) for p in V.level_model(V.read(path, side, None), side, None).problems
    ]
    return reader, dumped, verified


def _unclassed(p: dict) -> dict:
    assert p["class"] == cause_of(p["code"], p["severity"])
    return {k: v for k, v in p.items() if k != "class"}


def test_null_token_only_at_a_media_run(llama, tmp_path):
    data = BASE.read_bytes()
    ids = _ids()
    ids[10:14] = [-1] * 4
    ok = _with_tokens(data, ids, [(10, 1)])  # an image chunk at 10: -1 stands for its tokens
    sf = parse_buffer(ok, model=llama.info)
    assert sf.tokens.form == TokenForm.PACKED and len(sf.tokens.media) == 1
    assert _token_problems(sf) == []
    assert V.level_model(parse_buffer(ok), llama, None).status == V.Status.PASS
    # a TEXT chunk has real token ids: validate() refuses -1 there
    (p,) = _token_problems(parse_buffer(_with_tokens(data, ids, [(10, 0)]), model=llama.info))
    assert p.severity == Severity.ERROR and "token 10 is -1" in p.message and "(4 such tokens)" in p.message
    # the run must start at the media key: find_chunk(9) finds nothing
    ids[9] = -1
    (p,) = _token_problems(parse_buffer(_with_tokens(data, ids, [(10, 1)]), model=llama.info))
    assert "token 9 is -1" in p.message and "such tokens" not in p.message
    assert p.offset == 12 + 12 + 4 * 9  # header, marker/version/count, 9 ids


@pytest.mark.parametrize("media", [None, []], ids=["plain", "packed-without-media"])
def test_null_token_without_media_is_an_error_everywhere(llama, tmp_path, media):
    ids = _ids()
    ids[7] = -1
    data = _with_tokens(BASE.read_bytes(), ids, media)
    reader, dumped, verified = _all_three(data, llama, tmp_path)
    assert reader == dumped == verified
    (p,) = reader
    assert p["code"] == "token-out-of-vocab" and p["severity"] == "error" and "token 7 is -1" in p["message"]
    first = 12 + (12 if media is not None else 0)
    assert p["offset"] == first + 4 * 7


def test_token_outside_the_vocabulary(llama, tmp_path):
    ids = _ids()
    ids[3] = ids[5] = 320  # n_vocab is 320: ids run 0..319
    reader, dumped, verified = _all_three(_with_tokens(BASE.read_bytes(), ids, []), llama, tmp_path)
    assert reader == dumped == verified
    (p,) = reader
    assert p["message"] == "token 3 is id 320, outside the model's vocabulary [0, 320) (2 such tokens)"


def test_position_past_the_training_context_is_a_warning(llama, tmp_path):
    data = BASE.read_bytes()
    sf = parse_buffer(data)
    cells = sf.body.blocks[0].active_streams()[0].cells
    off = cells.offset + (cells.cells.size - 1) * cells.cells.dtype.itemsize
    moved = data[:off] + struct.pack("<i", 256) + data[off + 4 :]  # n_ctx_train 256: positions 0..255
    reader, dumped, verified = _all_three(moved, llama, tmp_path)
    assert reader == dumped == verified
    (p,) = reader
    assert (p["severity"], p["code"], p["section"]) == ("warning", "position-beyond-context", "body.kv")
    assert "highest position 256" in p["message"] and "training context 256" in p["message"]
    lv = V.level_model(parse_buffer(moved), llama, None)
    assert lv.status == V.Status.PASS and lv.status == "pass"
    # 255 is the last position inside the training context
    ok = data[:off] + struct.pack("<i", 255) + data[off + 4 :]
    assert check_against_model(parse_buffer(ok), llama.expect, None) == []


def test_layout_problems_are_the_same_for_every_command(tmp_path):
    """The draft model taken as the target: every layer's row size is wrong, in the body and
    in each checkpoint, and inspect, dump and verify list the same problems."""
    side = V.model_side(str(MODELS / "draft.gguf"))
    reader, dumped, verified = _all_three(BASE.read_bytes(), side, tmp_path)
    assert reader and reader == dumped == verified
    assert {p["code"] for p in reader} == {"model-mismatch"}
    assert {p["section"].split(".")[0] for p in reader} == {"body", "sckp"}
    # verify's structure level leaves them to the model level
    assert V.level_structure(V.read(tmp_path / "f.slot", side, None)).problems == []


def test_session_arch_is_checked_everywhere(tmp_path):
    side = V.model_side(str(MODELS / "llama.gguf"))
    data = (SLOTS / "extra-jamba.session").read_bytes()
    path = tmp_path / "s.session"
    path.write_bytes(data)
    sf = open_slot_file(path, model=side.info)
    assert sf.format == FileFormat.GGSN
    (p,) = [p for p in sf.model_problems if p.code == "wrong-arch"]
    assert "'jamba'" in p.message and "'llama'" in p.message
    lv = V.level_model(V.read(path, side, None), side, None)
    assert any(q.code == "wrong-arch" for q in lv.problems) and lv.status == "fail"


def _mla_body_only(tmp_path: Path) -> Path:
    """DeepSeek2 MLA: one K-only KV block, cut where a V section would start (no appendix)."""
    data = (SLOTS / "extra-deepseek2.slot").read_bytes()
    path = tmp_path / "mla-body-only.slot"
    path.write_bytes(data[: parse_buffer(data).body.end])
    return path


def test_verify_reads_in_the_model_layout(tmp_path):
    """The bytes alone warn that a K-only block may be a file cut where V starts; in the
    model's layout (as inspect and dump read it) there is nothing to warn about."""
    path = _mla_body_only(tmp_path)
    side = V.model_side(str(MODELS / "extra-deepseek2.gguf"))
    assert [p.code for p in V.level_structure(open_slot_file(path)).problems] == ["k-only"]
    sf = V.read(path, side, None)
    assert sf.body.confidence == "model"
    assert V.level_structure(sf).problems == []
    # a wrong model does not make the bytes look damaged: the structure still passes
    draft = V.model_side(str(MODELS / "draft.gguf"))
    wrong = V.read(SLOTS / "gemma3_iswa_fa.slot", draft, None)
    assert V.level_structure(wrong).status == "pass"
    assert V.level_model(wrong, draft, None).status == "fail"


def test_verify_opens_files_in_the_model_layout(tmp_path):
    """The same, through Verifier.verify (the llama.cpp loader runs too)."""
    pytest.importorskip("llama_cpp")
    path = _mla_body_only(tmp_path)
    with V.Verifier(V.VerifyOptions(model=str(MODELS / "extra-deepseek2.gguf"))) as v:
        r = v.verify(path)
    assert r.levels["structure"].problems == [] and r.levels["structure"].status == V.Status.PASS
    assert r.levels["model"].status == "pass"


def test_enums_stay_plain_strings_in_json():
    p = Problem(Severity.ERROR, "invalid", "body", 1, "m")
    assert (
        json.dumps(p.to_dict())
        == '{"severity": "error", "code": "invalid", "section": "body", "offset": 1, "message": "m"}'
    )
    with pytest.raises(ValueError):
        Problem(Severity.ERROR, "x", "body", 1, "m")  # an unregistered code is refused, never "damaged"
    assert json.dumps([FileFormat.GGSQ, TokenForm.PACKED, V.Status.SKIPPED]) == '["GGSQ", "packed", "skipped"]'
    assert f"{Severity.WARNING}" == "warning" and Severity("error") is Severity.ERROR
    sf = open_slot_file(BASE)
    assert sf.format == "GGSQ" and sf.body.blocks[0].kind == "KV"
    d = V.FileReport("f").to_dict()
    assert json.loads(json.dumps(d))["levels"]["model"]["status"] == "skipped"


def test_expectation_of_the_fixture_model():
    exp = expect_from_model(load_model_info(MODELS / "llama.gguf"))
    assert (exp.n_vocab, exp.n_ctx_train) == (320, 256)


def test_a_body_that_does_not_parse_is_reported_once(llama, tmp_path):
    """The structure names a cut body; the model check does not repeat it as a mismatch, and
    verify's model level says the layout went unchecked."""
    data = BASE.read_bytes()
    sf = parse_buffer(data)
    cut = data[: (sf.body.offset + sf.body.end) // 2]
    path = tmp_path / "cut.slot"
    path.write_bytes(cut)
    read = V.read(path, llama, None)
    assert read.body.layout is None and read.model_problems == []
    assert [p.code for p in read.problems] == ["truncated"]
    lv = V.level_model(read, llama, None)
    assert [(p.severity, p.code) for p in lv.problems] == [("warning", "not-checked")]
    assert V.level_structure(read).status == "fail"
