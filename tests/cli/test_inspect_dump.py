"""The commands as a user runs them: exit codes, stdout/stderr split, escaping."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import MODELS, SLOT_FILES, SLOTS


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "slotfile", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def test_version():
    r = run("--version")
    assert r.returncode == 0 and r.stdout.startswith("slotfile ")


def test_inspect_every_fixture_at_once():
    r = run("inspect", *SLOT_FILES)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("verdict: ok") == len(SLOT_FILES)


def test_inspect_shows_layout_and_text():
    r = run("inspect", SLOTS / "gemma3_iswa_nofa.slot", "--model", MODELS / "gemma3.gguf")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "iswa: KV + KV" in out
    assert "flash attention  off" in out
    assert "The quick brown fox" in out
    assert "context checkpoints" in out


def test_dump_json_is_pure_json_on_stdout():
    r = run("dump", SLOTS / "llama_draft_sdft.slot", "--json", "--tokens")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["schema"] == "slotfile.dump/1"
    assert doc["header"]["n_token_count"] == {"offset": 8, "value": 58}
    assert len(doc["tokens"]["ids"]["values"]) == 54
    assert doc["sckp"]["count"]["value"] == 3
    assert doc["sdft"]["data_dft"]["body"]["memory_class"] == "kv-cache"
    k0 = doc["body"]["blocks"][0]["streams"][0]["k"][0]
    assert k0["type"] == "f16" and k0["data_offset"] == k0["offset"] + 12
    assert doc["verdict"] == "ok" and doc["problems"] == []


def test_dump_without_tokens_omits_ids():
    doc = json.loads(run("dump", SLOTS / "llama_f16_fa.slot", "--json").stdout)
    assert "values" not in doc["tokens"]["ids"]


def test_dump_text_lists_offsets():
    r = run("dump", SLOTS / "extra-mamba.slot")
    assert r.returncode == 0
    assert any(line.split()[:2] == ["8", "header.n_token_count"] for line in r.stdout.splitlines())


def test_damaged_file_exits_4_with_section_and_offset(tmp_path: Path):
    data = (SLOTS / "llama_f16_fa.slot").read_bytes()
    bad = tmp_path / "cut.slot"
    bad.write_bytes(data[:20000])  # inside the second checkpoint's target blob
    r = run("inspect", bad)
    assert r.returncode == 4
    assert "error: sckp.checkpoint[1].data_tgt at offset 19216: checkpoint 1 of 2: blob needs 8648 bytes" in r.stdout
    doc = json.loads(run("dump", bad, "--json").stdout)
    assert doc["verdict"] == "damaged"
    assert doc["problems"][0]["section"] == "sckp.checkpoint[1].data_tgt"
    assert len(doc["sckp"]["checkpoints"]) == 1  # the complete one is still described
    assert bad.read_bytes() == data[:20000]  # never modified


def test_missing_file_and_model_exit_8():
    assert run("inspect", "/nonexistent.slot").returncode == 8
    r = run("inspect", SLOTS / "llama_f16_fa.slot", "--model", "/nonexistent.gguf")
    assert r.returncode == 8 and "model not found" in r.stderr
    assert run("dump", "/nonexistent.slot", "--json").stdout == ""


def test_not_a_slot_file_exits_4(tmp_path: Path):
    p = tmp_path / "x.slot"
    p.write_bytes(b"GGUF" + bytes(100))
    r = run("inspect", p)
    assert r.returncode == 4 and "neither GGSQ" in r.stdout


def test_usage_error_exits_2():
    assert run("inspect").returncode == 2
    assert run("frobnicate").returncode == 2


def test_control_characters_are_escaped(tmp_path: Path):
    # a session file whose arch name carries an escape sequence
    src = (SLOTS / "extra-llama.session").read_bytes()
    sf_arch_off = 12 + 4 * int.from_bytes(src[8:12], "little")
    evil = b"ll\x1b[2Jma"
    data = src[:sf_arch_off] + len(evil).to_bytes(4, "little") + evil + src[sf_arch_off + 4 + 5:]
    p = tmp_path / "evil.session"
    p.write_bytes(data)
    r = run("inspect", p)
    assert "\x1b" not in r.stdout
    assert "ll\\x1b[2Jma" in r.stdout


def test_dump_json_imports_neither_rich_nor_pydantic():
    """Start-up is part of every command's cost: dump --json prints no rich output, and typer
    is pinned below the release that coerces parameters through pydantic (README, Performance)."""
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "slotfile", "dump", "--json",
                        str(SLOTS / "llama_f16_fa.slot")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "numpy" in imported  # the check sees real imports
    assert not {m for m in imported if m.split(".")[0] in ("rich", "pydantic")}
