"""``slotfile verify --require LEVEL``: a level that was skipped for a file fails it (exit 4),
naming why and the option that would check it; a level the arguments can never run is a
usage error (exit 2).  The loads go through the real llama.cpp (installed v3, built v4)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from .conftest import MODELS, SLOTS, slotfile_cli

V3 = SLOTS / "llama_f16_fa.slot"
V4 = SLOTS / "v4" / "llama_f16_fa.slot"
MODEL = MODELS / "llama.gguf"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--require", "load"], "--require load needs --model"),
        (["--require", "model"], "--require model needs --model"),
        (["--require", "deep", "-m", str(MODEL)], "--require deep needs --deep"),
        (["--require", "bogus"], "not 'bogus'"),
        (["--require", "structure,lod"], "not 'lod'"),
        (["--require", ","], "not ''"),
    ],
)
def test_a_level_these_arguments_never_run_is_a_usage_error(args: list[str], says: str) -> None:
    r = slotfile_cli("verify", str(V3), *args)
    assert r.exit_code == 2, r.output
    assert says in r.output


def test_require_structure_passes_a_sound_file_without_a_model() -> None:
    r = slotfile_cli("verify", str(V3), "--require", "structure", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["require"] == ["structure"] and doc["summary"]["unmet_requirements"] == 0
    assert doc["files"][0]["unmet_requirements"] == []


@pytest.mark.llama
def test_a_v4_file_with_the_v3_loader_fails_require_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no llama-server on PATH to borrow a v4 library from
    junit = tmp_path / "v.xml"
    plain = slotfile_cli("verify", str(V4), str(V3), "-m", str(MODEL))
    assert plain.exit_code == 0, plain.output  # without --require: "not checked here" passes
    r = slotfile_cli("verify", str(V4), str(V3), "-m", str(MODEL), "--require", "load", "--json", "--junit", junit)
    assert r.exit_code == 4, r.output
    doc = json.loads(r.stdout)
    assert doc["exit_code"] == 4 and doc["require"] == ["structure", "model", "load"]
    v4, v3 = doc["files"]
    assert v3["verdict"] == "pass" and v3["unmet_requirements"] == []
    assert v4["verdict"] == "fail" and v4["levels"]["load"]["status"] == "skipped"  # existing fields unchanged
    (m,) = v4["unmet_requirements"]
    assert m["level"] == "load" and m["skip_kind"] == "cannot-check"
    assert m["hint"].startswith("--llama-lib DIR") and "version 4" in m["hint"]
    assert v4["first_problem"].startswith("load: required (--require) but not checked")
    assert doc["summary"]["unmet_requirements"] == 1 and doc["summary"]["fail"] == 1
    case = next(c for c in ET.parse(junit).getroot().iter("testcase") if c.get("name") == str(V4))
    failure = case.find("failure")
    assert failure is not None and failure.get("type") == "require"
    assert "--llama-lib DIR" in (failure.text or "")
    text = slotfile_cli("verify", str(V4), "-m", str(MODEL), "--require", "load")
    assert text.exit_code == 4
    assert "not checked" in text.stdout and "to check load: pass --llama-lib DIR" in text.stdout
    assert "with a required level not checked (--require)" in text.stdout


@pytest.mark.llama
def test_the_v4_library_makes_require_load_pass(llama_v4_lib: Path) -> None:
    r = slotfile_cli("verify", str(V4), "-m", str(MODEL), "--llama-lib", llama_v4_lib, "--require", "load", "--json")
    assert r.exit_code == 0, r.output
    f = json.loads(r.stdout)["files"][0]
    assert f["levels"]["load"]["status"] == "pass" and f["unmet_requirements"] == []


DRAFT_FILE = SLOTS / "llama_draft_sdft.slot"  # SCKP with draft blobs and one data_spec, and SDFT with both
DRAFT_ONLY = SLOTS / "llama_draft_sdft_only.slot"  # SDFT with a draft state and no speculative state
DRAFT_MODEL = MODELS / "draft.gguf"


def _deep_json(*args: str) -> tuple[int, dict]:
    r = slotfile_cli("verify", *args, "--model", str(MODEL), "--deep", "--json")
    return r.exit_code, json.loads(r.stdout)["files"][0]


def test_blobs_deep_cannot_recompute_are_named_and_fail_require_deep() -> None:
    # the body passes deep, but the draft blobs need the draft model and data_spec is never recomputed:
    # the level says what it checked, unchecked_parts what it did not, and --require deep fails on them
    code, f = _deep_json(str(DRAFT_FILE))
    assert code == 0 and f["verdict"] == "pass" and f["levels"]["deep"]["status"] == "pass"
    parts = f["levels"]["deep"]["unchecked_parts"]
    assert [u["section"] for u in parts] == [
        "sckp.checkpoint[0].data_dft",
        "sckp.checkpoint[1].data_dft",
        "sckp.checkpoint[2].data_dft",
        "sckp.checkpoint[2].data_spec",
        "sdft.data_dft",
        "sdft.data_spec",
    ]
    assert all(u["offset"] > 0 for u in parts) and parts[0]["hint"].startswith("--draft-model")
    assert "deep: sdft.data_dft: no --draft-model" in f["unchecked"]
    code, f = _deep_json(str(DRAFT_FILE), "--require", "deep")
    assert code == 4 and f["verdict"] == "fail"
    (unmet,) = f["unmet_requirements"]
    assert unmet["level"] == "deep" and unmet["hint"].startswith("--draft-model D.gguf")
    assert unmet["reason"].startswith("sckp.checkpoint[0].data_dft not recomputed: no --draft-model (5 more blobs")


def test_the_draft_model_checks_the_draft_blobs_and_data_spec_stays_unchecked() -> None:
    code, f = _deep_json(str(DRAFT_FILE), "--draft-model", str(DRAFT_MODEL), "--require", "deep")
    assert code == 4 and [u["section"] for u in f["levels"]["deep"]["unchecked_parts"]] == [
        "sckp.checkpoint[2].data_spec",
        "sdft.data_spec",
    ]
    assert f["unmet_requirements"][0]["hint"].startswith("none: speculative state")
    code, f = _deep_json(str(DRAFT_ONLY), "--draft-model", str(DRAFT_MODEL), "--require", "deep")
    assert code == 0 and f["verdict"] == "pass" and "unchecked_parts" not in f["levels"]["deep"], f


def test_the_text_report_says_which_blobs_were_not_checked_and_what_to_pass() -> None:
    r = slotfile_cli("verify", str(DRAFT_FILE), "--model", str(MODEL), "--deep")
    assert r.exit_code == 0, r.output
    assert (
        "not checked here: deep: 4 blobs (sckp.checkpoint[0].data_dft, ...): no --draft-model; pass --draft-model"
        in r.stdout
    )
    assert "1 file: 1 pass, 0 fail, 1 not fully checkable here" in r.stdout


@pytest.mark.llama
@pytest.mark.parametrize("where", ["body", "blobs"])
def test_a_recompute_that_crashes_is_not_damage_and_fails_require_deep(monkeypatch, where: str) -> None:
    """The worker dying while it recomputes the stored tokens of a file that restored at the load
    level (llama-cpp-python's AMX kernels segfault on a Xeon: slotfile/llama/cpu.py) says nothing
    about the file: a cannot-check warning and an unchecked part, never "damaged"; --require deep
    fails on it. The load level and the rest run through the real loader; only the recompute's
    answer is the dead worker's (what LoaderPool reads when the pipe closes)."""
    from slotfile.llama import pool as P

    died = "the loader process died with SIGSEGV (signal 11)"
    if where == "body":
        monkeypatch.setattr(P.LoaderPool, "deep", lambda self, *a, **k: P.DeepResult(False, died, crashed=True))
    else:
        monkeypatch.setattr(P.LoaderPool, "deep_blobs", lambda self, *a, **k: (None, died, True))
    path = SLOTS / "gemma3_iswa_fa.slot"  # two checkpoints
    r = slotfile_cli("verify", path, "--model", MODELS / "gemma3.gguf", "--deep", "--json")
    f = json.loads(r.stdout)["files"][0]
    assert r.exit_code == 0 and f["verdict"] == "pass", f
    deep = f["levels"]["deep"]
    assert deep["status"] == "pass" and f["levels"]["load"]["status"] == "pass"
    (p,) = deep["problems"]
    assert p["code"] == "recompute-crashed" and p["class"] == "cannot-check" and p["severity"] == "warning"
    assert p["section"] == ("body" if where == "body" else "sckp") and "SIGSEGV" in p["message"]
    (part,) = deep["unchecked_parts"]
    assert part["section"] == p["section"] and part["offset"] == p["offset"] and "crashed" in part["reason"]
    if where == "body":
        assert "appendix blobs are not recomputed either" in part["reason"]
    r = slotfile_cli("verify", path, "--model", MODELS / "gemma3.gguf", "--deep", "--require", "deep", "--json")
    f = json.loads(r.stdout)["files"][0]
    assert r.exit_code == 4 and f["verdict"] == "fail"
    (unmet,) = f["unmet_requirements"]
    assert unmet["level"] == "deep" and "crashed" in unmet["reason"] and "--llama-lib" in unmet["hint"]
