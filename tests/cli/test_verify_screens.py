"""What a person reads from ``slotfile verify``: the listing at 80 and 120 columns and in a
pipe, the wrong inputs named for what they are, the next step; plus the shell completion
script.  The pre-commit hook: tests/cli/test_precommit.py."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import MODELS, SLOTS, slotfile_cli

ROOT = Path(__file__).resolve().parents[2]
GOOD = SLOTS / "llama_f16_fa.slot"


@pytest.fixture()
def mixed(tmp_path: Path) -> Path:
    """A directory like a real slot-save path after some accidents."""
    d = tmp_path / "saved-sessions-of-a-long-directory-name"
    (d / "deeper" / "still-deeper").mkdir(parents=True)
    data = GOOD.read_bytes()
    (d / "good.slot").write_bytes(data)
    (d / "deeper" / "still-deeper" / "a-rather-long-slot-file-name-0001.slot").write_bytes(data[:9000])
    (d / "empty.slot").write_bytes(b"")
    (d / "model.bin").write_bytes((MODELS / "llama.gguf").read_bytes()[:4096])
    (d / "response.slot").write_text('{"id_slot": 0, "filename": "slot0.bin", "n_saved": 54}\n')
    (d / "packed.slot").write_bytes(gzip.compress(data))
    for p in d.rglob("*"):  # written an hour ago: the walker sets files still being written aside
        t = p.stat().st_mtime - 3600
        os.utime(p, (t, t))
    return d


def _run(*args: object, columns: int | None = None):
    return slotfile_cli("verify", *args, env={"COLUMNS": str(columns)} if columns else {"COLUMNS": None})


@pytest.mark.parametrize("columns", [80, 120])
def test_listing_fits_the_terminal(mixed: Path, columns: int):
    r = _run(mixed, columns=columns)
    assert r.exit_code == 4
    lines = r.stdout.splitlines()
    cut = "deeper/still-deeper/a-rather-long-slot-file-name-0001.slot"
    # paths relative to the directory argument, whole (never folded mid-word)
    assert any(ln.endswith(f"  {cut}") for ln in lines), r.stdout
    rows = [ln for ln in lines if not ln.startswith(" ")][:-1]  # up to the summary
    assert len(rows) == 7 and not any(str(mixed) in ln for ln in rows)  # the header and one row per file
    # no table borders; every line but the summary and a command line fits the width (a line
    # longer than that is one unbreakable word: a path)
    assert not any(ch in r.stdout for ch in "┃│┏━")
    long = [
        ln
        for ln in lines[:-1]
        if len(ln) > columns and not ln.lstrip().startswith("slotfile ") and " " in ln.strip()[: columns - 4]
    ]
    assert not long, long
    # one row per file, problem and next step under a failing row
    assert len(lines) <= 2 + 6 * 5
    i = next(i for i, ln in enumerate(lines) if ln.endswith(cut))
    if columns == 80:  # the row would pass the edge: the path is on its own line under it
        assert lines[i] == f"    {cut}" and lines[i - 1].startswith("damaged ")
    else:
        assert lines[i].startswith("damaged ")
    assert lines[i + 1].startswith("    structure: body at offset 7856:")
    step = [ln for ln in lines[i + 1 : i + 6] if ln.strip().startswith("slotfile truncate-recover")]
    assert step and step[0].strip().endswith("--model MODEL.gguf")
    # the summary wrapped at word boundaries: the last lines, indented after the first
    tail = next(i for i, ln in enumerate(lines) if ln.startswith("6 files: "))
    assert all(ln.startswith("  ") and len(ln) < columns for ln in lines[tail + 1 :]), lines[tail:]
    assert " ".join(ln.strip() for ln in lines[tail:]).startswith(
        "6 files: 1 pass, 5 fail (2 damaged, 3 not a slot file) (structure only; add --model to test-load)"
    )


def test_pipe_one_line_per_file(mixed: Path):
    r = _run(mixed)
    assert r.exit_code == 4
    lines = r.stdout.splitlines()
    assert len(lines) == 7  # six files and the summary
    by_name = {ln.split(": ", 1)[0]: ln for ln in lines[:-1]}
    assert by_name["good.slot"] == "good.slot: pass [S:ok M:- L:- D:-]"
    assert "this is a GGUF model, not a slot file: pass it with --model" in by_name["model.bin"]
    assert by_name["model.bin"].startswith("model.bin: not a slot file [S:FAIL M:- L:- D:-] structure: header at")
    assert by_name["empty.slot"].startswith(
        "empty.slot: damaged [S:FAIL M:- L:- D:-] structure: header at offset 0: empty file (0 bytes)"
    )
    assert "this is a text file" in by_name["response.slot"]
    assert f"gunzip -k {mixed / 'packed.slot'}" in by_name["packed.slot"]
    cut = by_name["deeper/still-deeper/a-rather-long-slot-file-name-0001.slot"]
    assert "; next step: rebuild the body from the stored tokens" in cut and "slotfile truncate-recover " in cut


def test_json_cause_and_next_step(mixed: Path):
    doc = json.loads(_run(mixed, "--json").stdout)
    files = {Path(f["path"]).name: f for f in doc["files"]}
    assert doc["exit_code"] == 4
    assert files["good.slot"]["cause"] is None and files["good.slot"]["next_step"] is None
    assert files["empty.slot"]["cause"] == "damaged" and files["empty.slot"]["repair_command"] is None
    for name in ("model.bin", "response.slot", "packed.slot"):
        f = files[name]
        assert (f["verdict"], f["cause"], f["repair_command"]) == ("fail", "not-a-slot-file", None), f
        (p,) = f["levels"]["structure"]["problems"]
        assert (p["code"], p["class"]) == ("not-slot-file", "not-a-slot-file")
        assert {f["levels"][n]["status"] for n in ("model", "load", "deep")} == {"skipped"}
    cut = files["a-rather-long-slot-file-name-0001.slot"]
    assert cut["cause"] == "damaged" and cut["repair_command"].startswith("slotfile truncate-recover ")


def test_directory_of_models_says_so(tmp_path: Path):
    (tmp_path / "llama.gguf").write_bytes((MODELS / "llama.gguf").read_bytes()[:64])
    r = _run(tmp_path)
    assert r.exit_code == 8 and "it holds 1 GGUF model(s): give one with --model" in r.stderr


@pytest.mark.llama
def test_wrong_model_is_a_mismatch_not_damage():
    """A healthy KV file checked against a recurrent model: "wrong model", never "damaged";
    nothing to repair; still exit 4 (it will not restore with this model)."""
    r = _run(GOOD, "--model", MODELS / "extra-mamba.gguf", "--json")
    assert r.exit_code == 4
    (f,) = json.loads(r.stdout)["files"]
    assert f["cause"] == "mismatch" and f["repair_command"] is None
    assert "saved with another model" in f["next_step"]
    assert {p["class"] for p in f["levels"]["model"]["problems"]} == {"mismatch"}
    table = _run(GOOD, "--model", MODELS / "extra-mamba.gguf", columns=80)
    assert table.stdout.startswith("verdict ") and "\nwrong model " in table.stdout
    assert "(1 wrong model)" in table.stdout and "damaged" not in table.stdout
    inspect = slotfile_cli("inspect", GOOD, "--model", MODELS / "extra-mamba.gguf")
    assert "verdict: does not match this model" in inspect.stdout and inspect.exit_code == 4


# ---------------------------------------------------------------------------------------
# shell completion
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shell, marker",
    [
        ("bash", "complete -o default -F _slotfile_completion slotfile"),
        ("zsh", "compdef _slotfile_completion slotfile"),
        ("fish", "complete --command slotfile"),
    ],
)
def test_completion_script(shell: str, marker: str):
    r = slotfile_cli("completion", shell)
    assert r.exit_code == 0 and marker in r.stdout and "_SLOTFILE_COMPLETE=complete_" in r.stdout


def test_completion_unknown_shell():
    r = slotfile_cli("completion", "tcsh")
    assert r.exit_code == 2 and r.stdout == "" and "unknown shell 'tcsh'" in r.stderr


def test_completion_answers_as_the_script_asks():
    """What the bash script runs on TAB: the program with _SLOTFILE_COMPLETE set."""
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        _SLOTFILE_COMPLETE="complete_bash",
        COMP_WORDS="slotfile verify --dra",
        COMP_CWORD="2",
    )
    r = subprocess.run([sys.executable, "-m", "slotfile"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.split() == ["--draft-model"], r.stdout + r.stderr
    env.update(COMP_WORDS="slotfile strip", COMP_CWORD="1")
    r = subprocess.run([sys.executable, "-m", "slotfile"], env=env, capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["strip-draft"], r.stdout + r.stderr
