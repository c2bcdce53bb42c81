"""The pre-commit hook as pre-commit runs it: its definition, and its entry on the files a
commit in a real repository hands it (a slot file, a GGUF and an unrelated ``.bin``)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

from ..conftest import MODELS, SLOTS, slotfile_cli

ROOT = Path(__file__).resolve().parents[2]
GOOD = SLOTS / "llama_f16_fa.slot"


def _hook() -> dict:
    hooks = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())
    (hook,) = [h for h in hooks if h["id"] == "slotfile-verify"]
    return hook


def _repo(tmp_path: Path) -> Path:
    """What a repository commits next to its sessions: firmware and weights named *.bin."""
    d = tmp_path / "repo"
    (d / "sessions").mkdir(parents=True)
    (d / "sessions" / "slot0.bin").write_bytes(GOOD.read_bytes())
    (d / "weights.bin").write_bytes((MODELS / "llama.gguf").read_bytes()[:4096])  # a GGUF
    (d / "firmware.bin").write_bytes(bytes(range(256)) * 16)
    (d / "empty.bin").write_bytes(b"")
    (d / "README.md").write_text("not matched by the hook\n")
    return d


def test_pre_commit_hook_definition():
    hook = _hook()
    assert hook["language"] == "python" and hook["pass_filenames"] is True
    assert shlex.split(hook["entry"]) == ["slotfile", "precommit"]
    files = re.compile(hook["files"])
    assert files.search("slots/slot0.bin") and files.search("a/b.slot") and not files.search("model.gguf")


def _run_hook(repo: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """The entry as pre-commit runs it: the command, its args, then every file whose name
    matches ``files`` (relative to the repository root, the hook's working directory)."""
    hook = _hook()
    files = re.compile(hook["files"])
    names = sorted(p.relative_to(repo).as_posix() for p in repo.rglob("*") if p.is_file())
    argv = shlex.split(hook["entry"])
    cmd = [sys.executable, "-m", "slotfile", *argv[1:], *extra, *[n for n in names if files.search(n)]]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=120)


def test_the_hook_judges_slot_files_and_passes_over_other_bins(tmp_path: Path):
    repo = _repo(tmp_path)
    r = _run_hook(repo)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("1 file: 1 pass, 0 fail") and "firmware" not in r.stdout + r.stderr
    v = _run_hook(repo, "-v")
    assert v.returncode == 0, v.stdout + v.stderr
    for name in ("empty.bin", "firmware.bin", "weights.bin"):
        assert f"{name}: no slot magic (GGSQ/GGSN): not a slot file, passed over" in v.stdout
    assert "1 slot file to verify, 3 passed over" in v.stdout


def test_the_hook_fails_a_damaged_slot_file(tmp_path: Path):
    repo = _repo(tmp_path)
    (repo / "sessions" / "cut.slot").write_bytes(GOOD.read_bytes()[:9000])
    r = _run_hook(repo)
    assert r.returncode == 4 and "sessions/cut.slot: fail: structure: body at offset 7856" in r.stdout, r.stdout


def test_precommit_on_no_slot_file_and_on_an_unreadable_path(tmp_path: Path):
    other = tmp_path / "firmware.bin"
    other.write_bytes(b"\x7fELF" + bytes(100))
    r = slotfile_cli("precommit", other)
    assert r.exit_code == 0 and r.stdout == "", r.stdout  # nothing to verify, nothing said without -v
    (tmp_path / "link.bin").symlink_to(GOOD)
    r = slotfile_cli("precommit", "-v", tmp_path / "link.bin", tmp_path / "gone.bin")
    assert r.exit_code == 8 and "gone.bin: cannot be read" in r.stderr
    assert "link.bin: a symlink: passed over" in r.stdout
