"""The commands as a user runs them: exit codes, stdout/stderr split, escaping.

In-process (typer's CliRunner) where only the output and the exit code matter; a separate
process where the start-up itself is what a test checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ..conftest import MODELS, ROOT, SLOT_FILES, SLOTS
from ..conftest import slotfile_cli as run

COMMANDS = ["inspect", "dump", "verify", "truncate-recover", "strip-draft", "re-save"]


def test_python_dash_m_slotfile_runs_from_the_checkout():
    """``python -m slotfile`` from the repository root, with nothing on PYTHONPATH: the CLI is a
    plain subpackage, not an installed mapping."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run(
        [sys.executable, "-m", "slotfile", "--version"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and r.stdout.startswith("slotfile "), r.stderr
    where = subprocess.run(
        [sys.executable, "-c", "import slotfile.cli.app as a; print(a.__file__)"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert Path(where.stdout.strip()).is_relative_to(ROOT / "slotfile" / "cli"), where.stdout + where.stderr


def test_version():
    r = run("--version")
    assert r.exit_code == 0 and r.stdout.startswith("slotfile ")


def test_short_help_on_every_command():
    root = run("-h")
    assert root.exit_code == 0 and "Usage: slotfile" in root.stdout and "-h, --help" in root.stdout
    for cmd in COMMANDS:
        short, long = run(cmd, "-h"), run(cmd, "--help")
        assert short.exit_code == 0 and short.stdout == long.stdout, cmd
        assert f"Usage: slotfile {cmd}" in short.stdout and "-h, --help" in short.stdout, cmd


def test_every_command_help_ends_with_examples():
    for cmd in COMMANDS:
        text = run(cmd, "--help").stdout
        assert "Examples:" in text, cmd
        examples = text.split("Examples:", 1)[1].strip().splitlines()
        assert len(examples) >= 2, (cmd, examples)
        for line in examples:  # one example a line, not re-wrapped, inside 80 columns
            assert line.strip().startswith(f"slotfile {cmd} ") and len(line) <= 80, (cmd, line)


def test_inspect_every_fixture_at_once():
    r = run("inspect", *SLOT_FILES)
    assert r.exit_code == 0, r.stdout + r.stderr
    assert r.stdout.count("verdict: ok") == len(SLOT_FILES)


def test_inspect_shows_layout_and_text():
    r = run("inspect", SLOTS / "gemma3_iswa_nofa.slot", "--model", MODELS / "gemma3.gguf")
    assert r.exit_code == 0, r.stderr
    out = r.stdout
    assert "iswa: KV + KV" in out
    assert "flash attention  off" in out
    assert "The quick brown fox" in out
    assert "context checkpoints" in out


def test_dump_json_is_pure_json_on_stdout():
    r = run("dump", SLOTS / "llama_draft_sdft.slot", "--json", "--tokens")
    assert r.exit_code == 0, r.stderr
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
    assert r.exit_code == 0
    assert any(line.split()[:2] == ["8", "header.n_token_count"] for line in r.stdout.splitlines())


def test_dump_text_is_in_file_order(tmp_path: Path):
    lines = run("dump", SLOTS / "llama_f16_fa.slot").stdout.splitlines()
    fields = [ln.split()[:2] for ln in lines[:-1]]
    offsets = [int(off) for off, _ in fields]
    assert offsets == sorted(offsets)
    names = [name for _, name in fields]
    assert names.index("tokens.marker") < names.index("tokens.n_tokens")  # 12 before 20
    assert lines[-1].split() == ["verdict", "ok"] and not any("problems[" in ln for ln in lines)


def test_dump_text_ends_with_each_problem_and_the_verdict(tmp_path: Path):
    bad = tmp_path / "cut.slot"
    bad.write_bytes((SLOTS / "llama_f16_fa.slot").read_bytes()[:20000])
    r = run("dump", bad)
    assert r.exit_code == 4
    *_, problem, verdict, cause, step = r.stdout.splitlines()
    assert cause.split() == ["cause", "damaged"]
    # the body is whole: keep it and the whole checkpoint, drop the cut one
    assert step.split()[:1] == ["next_step"] and f"slotfile truncate-recover {bad} -o " in step
    assert problem.split()[:4] == ["19216", "problems[0]", "error", "truncated:"]
    assert problem.endswith(
        "sckp.checkpoint[1].data_tgt: checkpoint 1 of 2: blob needs 8648 bytes, 784 remain "
        "(the server drops the whole appendix)"
    )
    assert verdict.split() == ["verdict", "damaged"]


def test_damaged_file_exits_4_with_section_and_offset(tmp_path: Path):
    data = (SLOTS / "llama_f16_fa.slot").read_bytes()
    bad = tmp_path / "cut.slot"
    bad.write_bytes(data[:20000])  # inside the second checkpoint's target blob
    r = run("inspect", bad)
    assert r.exit_code == 4
    assert "error: sckp.checkpoint[1].data_tgt at offset 19216: checkpoint 1 of 2: blob needs 8648 bytes" in r.stdout
    doc = json.loads(run("dump", bad, "--json").stdout)
    assert doc["verdict"] == "damaged"
    assert doc["problems"][0]["section"] == "sckp.checkpoint[1].data_tgt"
    assert len(doc["sckp"]["checkpoints"]) == 1  # the complete one is still described
    assert bad.read_bytes() == data[:20000]  # never modified


def test_missing_file_and_model_exit_8():
    assert run("inspect", "/nonexistent.slot").exit_code == 8
    r = run("inspect", SLOTS / "llama_f16_fa.slot", "--model", "/nonexistent.gguf")
    assert r.exit_code == 8 and "model not found" in r.stderr
    assert run("dump", "/nonexistent.slot", "--json").stdout == ""


def test_not_a_slot_file_exits_4(tmp_path: Path):
    p = tmp_path / "x.slot"
    p.write_bytes(b"GGUF" + bytes(100))
    r = run("inspect", p)
    assert r.exit_code == 4 and "verdict: not a slot file" in r.stdout
    assert "this is a GGUF model, not a slot file: pass it with --model" in r.stdout


def test_usage_error_exits_2():
    assert run("inspect").exit_code == 2
    assert run("frobnicate").exit_code == 2


def test_control_characters_are_escaped(tmp_path: Path):
    # a session file whose arch name carries an escape sequence
    src = (SLOTS / "extra-llama.session").read_bytes()
    sf_arch_off = 12 + 4 * int.from_bytes(src[8:12], "little")
    evil = b"ll\x1b[2Jma"
    data = src[:sf_arch_off] + len(evil).to_bytes(4, "little") + evil + src[sf_arch_off + 4 + 5 :]
    p = tmp_path / "evil.session"
    p.write_bytes(data)
    r = run("inspect", p)
    assert "\x1b" not in r.stdout
    assert "ll\\x1b[2Jma" in r.stdout


def test_dump_json_imports_neither_rich_nor_pydantic():
    """Start-up is part of every command's cost: dump --json prints no rich output, and typer
    is pinned below the release that coerces parameters through pydantic (README, Performance)."""
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "slotfile", "dump", "--json", str(SLOTS / "llama_f16_fa.slot")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "numpy" in imported  # the check sees real imports
    assert not {m for m in imported if m.split(".")[0] in ("rich", "pydantic")}
