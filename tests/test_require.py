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
