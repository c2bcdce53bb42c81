"""The write path: byte-range copies, temp files, no-clobber, backups, symlinks, checks."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from slotfile import safewrite as sw
from slotfile.safewrite import CheckFailed, Plan, WriteRefused, commit, resolve_target

from .conftest import MODELS, SLOTS


def _data(n: int, seed: int = 0) -> bytes:
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _dots(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith("."))


# ------------------------------------------------------------------------------- copies


@pytest.mark.parametrize("mode", ["cfr", "sendfile", "plain"])
def test_copy_range_every_path(tmp_path, monkeypatch, mode):
    src = tmp_path / "src"
    data = _data(300_001)
    src.write_bytes(data)
    monkeypatch.setattr(sw, "CHUNK", 4096 + 7)  # many short calls, odd sizes
    if mode != "cfr":

        def no_cfr(*a, **k):
            raise OSError(errno.EXDEV, "cross-device")

        monkeypatch.setattr(os, "copy_file_range", no_cfr)
    if mode == "plain":

        def no_sendfile(*a, **k):
            raise OSError(errno.EINVAL, "no sendfile")

        monkeypatch.setattr(os, "sendfile", no_sendfile)
    dst = tmp_path / "dst"
    with open(src, "rb") as s, open(dst, "wb") as d:
        d.write(b"head")
        d.flush()
        assert sw.copy_range(s.fileno(), d.fileno(), 1000, 200_000) == 200_000
        assert sw.copy_range(s.fileno(), d.fileno(), 0, 10) == 10
    assert dst.read_bytes() == b"head" + data[1000:201_000] + data[:10]


def test_copy_range_short_source_raises(tmp_path):
    src = tmp_path / "src"
    src.write_bytes(b"x" * 100)
    with open(src, "rb") as s, open(tmp_path / "dst", "wb") as d, pytest.raises(OSError):
        sw.copy_range(s.fileno(), d.fileno(), 50, 100)


def test_plan_merges_adjacent_ranges_and_reads_back(tmp_path):
    src = tmp_path / "src"
    data = _data(5000, 1)
    src.write_bytes(data)
    p = Plan()
    p.copy(src, 0, 100)
    p.copy(src, 100, 400)
    p.literal(b"LIT")
    p.copy(src, 1000, 10)
    p.copy(src, 2000, 0)  # nothing
    assert len(p.pieces) == 3 and p.size == 513
    assert p.read_range(0, 513) == data[:500] + b"LIT" + data[1000:1010]
    assert p.read_range(498, 6) == data[498:500] + b"LIT" + data[1000:1001]
    whole = Plan()
    whole.copy(src, 0, 2500)
    whole.copy(src, 2500, 2500)
    assert whole.is_identity(src, 5000)


# ------------------------------------------------------------------------------- targets


def test_output_must_not_exist_unless_force(tmp_path):
    inp, out = tmp_path / "in", tmp_path / "out"
    inp.write_bytes(b"abc")
    out.write_bytes(b"old")
    with pytest.raises(WriteRefused, match="exists"):
        resolve_target(inp, out)
    t = resolve_target(inp, out, force=True)
    p = Plan()
    p.copy(inp, 0, 3)
    commit(p, t)
    assert out.read_bytes() == b"abc"
    assert _dots(tmp_path) == []


def test_rules(tmp_path):
    inp = tmp_path / "in"
    inp.write_bytes(b"abc")
    with pytest.raises(WriteRefused):
        resolve_target(inp, None)  # neither -o nor --in-place
    with pytest.raises(WriteRefused):
        resolve_target(inp, tmp_path / "o", in_place=True)  # both
    with pytest.raises(WriteRefused, match="is the input"):
        resolve_target(inp, inp, force=True)
    link = tmp_path / "alias"
    link.symlink_to(inp)
    with pytest.raises(WriteRefused, match="is a symlink"):  # an alias of the input, or of anything
        resolve_target(inp, link, force=True)
    with pytest.raises(WriteRefused, match="symlink"):
        resolve_target(link, None, in_place=True)
    with pytest.raises(WriteRefused, match="does not exist"):
        resolve_target(inp, tmp_path / "nodir" / "out")
    with pytest.raises(WriteRefused, match="--backup only"):
        resolve_target(inp, tmp_path / "o", backup=tmp_path / "b")


def test_no_clobber_when_output_appears_meanwhile(tmp_path):
    inp, out = tmp_path / "in", tmp_path / "out"
    inp.write_bytes(b"abc")
    t = resolve_target(inp, out)
    out.write_bytes(b"someone else's")
    p = Plan()
    p.copy(inp, 0, 3)
    with pytest.raises(WriteRefused, match="appeared"):
        commit(p, t)
    assert out.read_bytes() == b"someone else's"
    assert _dots(tmp_path) == []


def test_in_place_keeps_the_original_inode_as_backup(tmp_path):
    inp = tmp_path / "in.slot"
    inp.write_bytes(b"original bytes")
    os.chmod(inp, 0o640)
    ino = inp.stat().st_ino
    t = resolve_target(inp, None, in_place=True)
    assert t.backup == str(inp) + ".bak"
    p = Plan()
    p.literal(b"new")
    commit(p, t)
    bak = Path(t.backup)
    assert inp.read_bytes() == b"new" and bak.read_bytes() == b"original bytes"
    assert bak.stat().st_ino == ino  # the input itself, untouched, now under the backup name
    assert stat.S_IMODE(inp.stat().st_mode) == 0o640
    # a second in-place run refuses to overwrite the backup without --force
    with pytest.raises(WriteRefused, match="backup"):
        resolve_target(inp, None, in_place=True)
    custom = tmp_path / "keep" / "copy.bak"
    custom.parent.mkdir()
    t2 = resolve_target(inp, None, in_place=True, backup=custom)
    p2 = Plan()
    p2.literal(b"newer")
    commit(p2, t2)
    assert custom.read_bytes() == b"new" and inp.read_bytes() == b"newer"
    assert _dots(tmp_path) == [] and _dots(custom.parent) == []


def test_check_failure_writes_nothing(tmp_path):
    inp, out = tmp_path / "in", tmp_path / "out"
    inp.write_bytes(b"abc" * 1000)
    seen = []

    def check(path: str) -> tuple[bool, str]:
        seen.append(path)
        assert Path(path).read_bytes() == b"abc" * 1000  # complete and fsynced when checked
        assert Path(path).name.startswith(".out.slotfile-")
        return False, "no good"

    p = Plan()
    p.copy(inp, 0, 3000)
    with pytest.raises(CheckFailed, match="no good"):
        commit(p, resolve_target(inp, out), check)
    assert seen and not out.exists() and _dots(tmp_path) == []


def test_temp_names_are_unique_and_hidden(tmp_path):
    names = {sw.temp_path(tmp_path, "x.slot") for _ in range(200)}
    assert len(names) == 200 and all(Path(n).name.startswith(".x.slot.slotfile-") for n in names)


# ------------------------------------------------------------------------------- the commands


def cli(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "slotfile", *map(str, args)], capture_output=True, text=True, timeout=300
    )


def test_input_is_only_opened_read_only(tmp_path, monkeypatch):
    """Every open of the input, by every command, is read-only; its bytes and mtime stay."""
    from slotfile import repair
    from slotfile.cli.repair_cmd import exit_code
    from slotfile.repair import RepairOptions

    src = tmp_path / "in.slot"
    cut = (SLOTS / "llama_draft_sdft.slot").read_bytes()[:30000]
    src.write_bytes(cut)
    before = (src.stat().st_mtime_ns, src.read_bytes())
    opened: list[tuple[str, object]] = []
    real_open, real_os_open = open, os.open

    def spy_open(file, mode="r", *a, **k):
        if str(file) == str(src):
            opened.append(("open", mode))
        return real_open(file, mode, *a, **k)

    def spy_os_open(path, flags, *a, **k):
        if str(path) == str(src):
            opened.append(("os.open", flags))
        return real_os_open(path, flags, *a, **k)

    monkeypatch.setattr("builtins.open", spy_open)
    monkeypatch.setattr(os, "open", spy_os_open)
    for cmd, out in (("truncate-recover", "a.slot"), ("strip-draft", "b.slot")):
        inp = src if cmd == "truncate-recover" else tmp_path / "a.slot"
        r = repair.run(cmd, str(inp), resolve_target(inp, tmp_path / out), RepairOptions())
        assert exit_code(r) == 0, r.reason
    monkeypatch.undo()
    assert opened
    for kind, mode in opened:
        if kind == "open":
            assert mode in ("rb", "r"), mode
        else:
            assert mode & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND) == 0
    assert (src.stat().st_mtime_ns, src.read_bytes()) == before


@pytest.mark.slow
def test_cli_exit_codes_and_dry_run(tmp_path):
    src = tmp_path / "cut.slot"
    src.write_bytes((SLOTS / "llama_draft_sdft.slot").read_bytes()[:30000])
    listing = sorted(os.listdir(tmp_path))
    # --dry-run: the plan, nothing written
    r = cli("truncate-recover", src, "-o", tmp_path / "out.slot", "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["status"] == "dry-run" and doc["plan"] and doc["output_size"] == sum(p["length"] for p in doc["plan"])
    assert sorted(os.listdir(tmp_path)) == listing
    # repaired: 0, then OUT exists: 2, --force: 0
    assert cli("truncate-recover", src, "-o", tmp_path / "out.slot").returncode == 0
    r = cli("truncate-recover", src, "-o", tmp_path / "out.slot")
    assert r.returncode == 2 and "exists" in r.stderr
    assert cli("truncate-recover", src, "-o", tmp_path / "out.slot", "--force").returncode == 0
    # usage: bad option values, both -o and --in-place
    assert cli("truncate-recover", src, "-o", tmp_path / "x", "--flash-attn", "maybe").returncode == 2
    assert cli("truncate-recover", src, "-o", tmp_path / "x", "--in-place").returncode == 2
    assert cli("re-save", src, "-o", tmp_path / "x").returncode == 2  # needs --model
    # operational: missing input, missing model
    assert cli("truncate-recover", tmp_path / "nope", "-o", tmp_path / "x").returncode == 8
    assert cli("truncate-recover", src, "-o", tmp_path / "x", "--model", tmp_path / "no.gguf").returncode == 8
    # cannot repair: a cut body without the model; one line on stderr
    body_cut = tmp_path / "body.slot"
    body_cut.write_bytes((SLOTS / "llama_f16_fa.slot").read_bytes()[:5000])
    r = cli("truncate-recover", body_cut, "-o", tmp_path / "y")
    assert r.returncode == 4 and len(r.stderr.strip().splitlines()) == 1 and "--model" in r.stderr
    assert not (tmp_path / "y").exists()
    assert _dots(tmp_path) == []


def test_cli_in_place_with_backup(tmp_path):
    src = tmp_path / "cut.slot"
    orig = (SLOTS / "llama_draft_sdft.slot").read_bytes()[:30000]
    src.write_bytes(orig)
    r = cli("truncate-recover", src, "--in-place", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["status"] == "repaired" and doc["backup"] == str(src) + ".bak"
    assert Path(doc["backup"]).read_bytes() == orig
    assert src.stat().st_size == doc["output_size"] < len(orig)
    # nothing to do in place: the file is left alone, no backup needed
    os.unlink(doc["backup"])
    st = src.stat()
    r = cli("truncate-recover", src, "--in-place", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["status"] == "nothing-to-do"
    assert not Path(doc["backup"]).exists() and src.stat().st_mtime_ns == st.st_mtime_ns
    # never through a symlink
    link = tmp_path / "link.slot"
    link.symlink_to(src)
    r = cli("strip-draft", link, "--in-place")
    assert r.returncode == 2 and "symlink" in r.stderr


@pytest.mark.llama
def test_failed_test_load_writes_nothing(tmp_path):
    """strip-draft checked against the wrong model: the output fails its test-load."""
    r = cli(
        "strip-draft",
        SLOTS / "llama_draft_sdft.slot",
        "-o",
        tmp_path / "o.slot",
        "--model",
        MODELS / "gemma3.gguf",
        "--json",
    )
    assert r.returncode == 4, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert doc["status"] == "check-failed" and "test-load" in doc["reason"]
    assert doc["test_load"]["ok"] is False
    assert not (tmp_path / "o.slot").exists() and _dots(tmp_path) == []


# ------------------------------------------------------------------------------- refusals, in-process


def _invoke(*args: object):
    from typer.testing import CliRunner

    from slotfile.cli.app import app

    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture
def unwritable(tmp_path, monkeypatch):
    """A directory no file can be created in (as root only a read-only mount is, so the
    permission check is what is made to fail here)."""
    d = tmp_path / "ro"
    d.mkdir()
    real = os.access
    monkeypatch.setattr(
        os, "access", lambda p, mode, *a, **k: False if os.fspath(p) == str(d) else real(p, mode, *a, **k)
    )
    return d


def test_unwritable_output_directory_is_a_usage_error_dry_run_too(tmp_path, unwritable):
    src = tmp_path / "cut.slot"
    src.write_bytes((SLOTS / "llama_draft_sdft.slot").read_bytes()[:30000])
    for extra in ([], ["--dry-run"]):
        r = _invoke("truncate-recover", src, "-o", unwritable / "out.slot", *extra)
        assert r.exit_code == 2, (extra, r.stdout, r.stderr)
        assert r.stdout == ""  # no plan that reads like a success
        assert len(r.stderr.strip().splitlines()) == 1 and "cannot write in" in r.stderr
        r = _invoke("truncate-recover", src, "-o", unwritable / "out.slot", "--json", *extra)
        doc = json.loads(r.stdout)
        assert r.exit_code == 2 and doc["exit_code"] == 2 and doc["status"] == "error"
        assert doc["input_size"] == 30000 and "cannot write in" in doc["reason"]
    assert os.listdir(unwritable) == []


def test_refused_repair_reports_real_size_and_no_stray_time_line(tmp_path):
    body_cut = tmp_path / "body.slot"
    body_cut.write_bytes((SLOTS / "llama_f16_fa.slot").read_bytes()[:5000])
    r = _invoke("truncate-recover", body_cut, "-o", tmp_path / "y")
    assert r.exit_code == 4 and "--model" in r.stderr
    assert "time:" not in r.stdout, r.stdout
    r = _invoke("truncate-recover", body_cut, "-o", tmp_path / "y", "--json")
    doc = json.loads(r.stdout)
    assert r.exit_code == 4 and doc["status"] == "refused" and doc["exit_code"] == 4 and doc["input_size"] == 5000
    # a missing model is operational; the input's size is still reported
    r = _invoke("truncate-recover", body_cut, "-o", tmp_path / "y", "--json", "--model", tmp_path / "no.gguf")
    doc = json.loads(r.stdout)
    assert r.exit_code == 8 and doc["exit_code"] == 8 and doc["input_size"] == 5000
    assert not (tmp_path / "y").exists()
