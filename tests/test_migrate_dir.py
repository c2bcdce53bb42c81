"""``migrate DIR -o OUTDIR --to N`` and ``ls DIR --llama-lib LIB`` over a directory of real v2, v3 and
v4 files (the committed fixtures written by the three libraries)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from slotfile.format.reader import open_slot_file

from .conftest import FIXTURES, SLOTS, slotfile_cli
from .test_migrate_v2 import V2
from .test_v4 import V4

LLAMA = FIXTURES / "models" / "llama.gguf"
NAMES = ("llama_f16_fa.slot", "llama_f16_nofa.slot", "llama_2stream.slot")


def _tree(tmp_path: Path) -> Path:
    """A slot directory as an operator has it after two upgrades: files of versions 2, 3 and 4."""
    root = tmp_path / "slots"
    for sub, src in (("v2", V2), ("v3", SLOTS), ("v4", V4)):
        (root / sub).mkdir(parents=True)
        for n in NAMES:
            shutil.copy2(src / n, root / sub / n)
            os.utime(root / sub / n, (1_700_000_000, 1_700_000_000))
    (root / "v4" / "broken.slot").write_bytes((V4 / "llama_f16_fa.slot").read_bytes()[:-100])
    os.utime(root / "v4" / "broken.slot", (1_700_000_000, 1_700_000_000))
    return root


def test_migrate_dir_to_4(tmp_path: Path):
    root = _tree(tmp_path)
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    out = tmp_path / "out"
    r = slotfile_cli("migrate", root, "-o", out, "--to", "4", "--json")
    doc = json.loads(r.stdout)
    assert doc["schema"] == "slotfile.migrate-dir/1" and r.exit_code == 4  # the broken file is refused
    rows = {f["file"]: f for f in doc["files"]}
    assert rows["v4/broken.slot"]["action"] == "skipped" and "truncate-recover" in rows["v4/broken.slot"]["reason"]
    for n in NAMES:
        assert rows[f"v2/{n}"]["action"] == "converted" and rows[f"v2/{n}"]["fate"] == "GGSQ 2 -> 4"
        assert rows[f"v3/{n}"]["action"] == "converted"
        assert rows[f"v4/{n}"]["action"] == "copied"
        assert (out / "v4" / n).read_bytes() == (V4 / n).read_bytes()  # byte for byte
        for sub in ("v2", "v3"):
            sf = open_slot_file(out / sub / n)
            assert sf.version == 4 and sf.errors == []
            assert (out / sub / n).stat().st_mtime == 1_700_000_000  # keeps the input's age
    assert not (out / "v4" / "broken.slot").exists()
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before  # inputs untouched


def test_migrate_dir_only_changed_and_dry_run(tmp_path: Path):
    root = _tree(tmp_path)
    (root / "v4" / "broken.slot").unlink()
    out = tmp_path / "out"
    r = slotfile_cli("migrate", root, "-o", out, "--to", "2", "--dry-run", "--json")
    assert r.exit_code == 0, r.stdout
    assert not out.exists()
    acts = {f["file"]: f["action"] for f in json.loads(r.stdout)["files"]}
    assert acts["v2/llama_f16_fa.slot"] == "would-copy" and acts["v4/llama_f16_fa.slot"] == "would-convert"
    r = slotfile_cli("migrate", root, "-o", out, "--to", "2", "--only-changed")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert not (out / "v2").exists() and (out / "v3" / "llama_f16_fa.slot").is_file()
    assert open_slot_file(out / "v4" / "llama_f16_fa.slot").version == 2
    assert "left-out" in r.stdout
    # a second run does not replace what is there without --force
    again = slotfile_cli("migrate", root, "-o", out, "--to", "2", "--only-changed", "--json")
    assert again.exit_code == 4
    assert all(f["action"] in ("failed", "left-out") for f in json.loads(again.stdout)["files"])


def test_migrate_dir_usage(tmp_path: Path):
    root = _tree(tmp_path)
    assert slotfile_cli("migrate", root, "--to", "4").exit_code == 2  # no -o
    assert slotfile_cli("migrate", root, "-o", root / "sub", "--to", "4").exit_code == 2  # inside DIR


@pytest.mark.llama
@pytest.mark.slow
def test_ls_llama_lib_says_what_breaks(tmp_path: Path, llama_v2_lib: Path):
    root = _tree(tmp_path)
    r = slotfile_cli("ls", root, "--llama-lib", llama_v2_lib, "-m", LLAMA, "--json")
    doc = json.loads(r.stdout)
    assert r.exit_code == 4 and doc["library"]["state_seq_version"] == 2
    v = {f["rel"]: f["llama_lib"] for f in doc["files"]}
    for n in NAMES:
        assert v[f"v2/{n}"]["verdict"] == "as-is", v[f"v2/{n}"]
        assert v[f"v3/{n}"]["verdict"] == "after-migrate", v[f"v3/{n}"]
        assert v[f"v4/{n}"]["verdict"] == "after-migrate", v[f"v4/{n}"]
    assert v["v4/broken.slot"]["verdict"] == "no"
    text = slotfile_cli("ls", root, "--llama-lib", llama_v2_lib, "-m", LLAMA)
    assert "loads as is" in text.stdout and "after migrate" in text.stdout and "not at all" in text.stdout
