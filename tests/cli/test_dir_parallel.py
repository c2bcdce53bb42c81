"""``ls DIR``, ``verify DIR`` (structure) and ``prune --damaged`` over 200+ files, read on two
forked processes and streamed (slotfile.slotdir.forked): every output, text and JSON, is byte
for byte the one a single process writes (timings masked), damaged files and a file that is no
slot file among them; and what the runs call damaged is what a cold read of each file (empty
layout cache) calls damaged, no more and no fewer, so the plan of ``prune --damaged`` is too.

Each command runs as ``python -m slotfile`` in a fresh process (one thread: the workers fork;
SLOTFILE_DIR_JOBS=1 keeps the other run in one process)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ..conftest import SLOTS

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = sorted(p for d in (SLOTS, SLOTS / "v4") for p in d.glob("*.slot"))
_TIMING = re.compile(
    r'("(?:seconds|files_per_second|age_s)": )[0-9.e+-]+|[0-9]+ files/s|in [0-9.]+ s\b|age [0-9.]+[smhd]\b'
)


def _slotfile(args: list[str], jobs: int) -> tuple[int, str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), SLOTFILE_DIR_JOBS=str(jobs))
    for k in ("COLUMNS", "TTY_COMPATIBLE", "FORCE_COLOR"):
        env.pop(k, None)
    r = subprocess.run(
        [sys.executable, "-m", "slotfile", *args], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    return r.returncode, _TIMING.sub(lambda m: (m.group(1) or "") + "0", r.stdout), r.stderr


def _directory(tmp: Path) -> Path:
    """~230 slot files in three folders: every fixture copied over and over, damaged copies
    (cut short, a count set huge, a flipped magic, empty) and a file with a slot magic and
    junk after it, all aged an hour."""
    d = tmp / "slots"
    for sub in ("a", "b", "b/deep"):
        (d / sub).mkdir(parents=True)
    folders = ("", "a", "b", "b/deep")
    for i in range(200):
        src = FIXTURES[i % len(FIXTURES)]
        shutil.copyfile(src, d / folders[i % 4] / f"s{i:03d}.slot")
    for i, src in enumerate(FIXTURES[:8]):
        data = src.read_bytes()
        (d / "a" / f"cut{i}.slot").write_bytes(data[: len(data) // 2])
        big = bytearray(data)
        big[8:12] = (10**6).to_bytes(4, "little")  # the token count
        (d / "b" / f"count{i}.bin").write_bytes(bytes(big))
        flipped = bytearray(data)
        flipped[24] ^= 0xFF
        (d / "b/deep" / f"flip{i}.slot").write_bytes(bytes(flipped))
    (d / "empty.slot").write_bytes(b"")
    (d / "junk.dat").write_bytes(b"qsgg" + b"\x07" * 99)  # found by its magic, not by its name
    old = time.time() - 3600
    for p in d.rglob("*"):
        if p.is_file():
            os.utime(p, (old, old))
    return d


@pytest.mark.slow
def test_two_processes_write_what_one_writes_and_damage_stays_damage(tmp_path: Path) -> None:
    d = _directory(tmp_path)
    common = ["--settle", "0", "--settle-wait", "0"]
    runs = [
        ["ls", str(d), "--json"],
        ["ls", str(d)],
        ["verify", str(d), "--json"],
        ["verify", str(d)],
        ["verify", str(d), "-q"],
        ["prune", str(d), "--damaged", "--json"],
        ["prune", str(d), "--damaged"],
    ]
    got = {}
    for args in runs:
        one, two = _slotfile(args + common, 1), _slotfile(args + common, 2)
        assert two == one, f"slotfile {' '.join(args[:1] + args[2:])}: two processes wrote otherwise"
        got[" ".join(args[:1] + args[2:])] = one
    assert _slotfile(["verify", str(d), "--json", "--jobs", "2", *common], 1) == got["verify --json"]
    ls = json.loads(got["ls --json"][1])
    assert ls["totals"]["files"] == len(ls["files"]) >= 226 and got["ls --json"][0] == 4
    damaged = sorted(f["path"] for f in ls["files"] if f["damaged"])
    assert damaged == _cold_damaged(d)
    names = {Path(p).name for p in damaged}
    # (half of the 72-byte empty jamba state is a valid empty KV state: not every cut is damage)
    assert {f"count{i}.bin" for i in range(8)} | {"empty.slot"} <= names and len(names) >= 16
    assert not any(n.startswith("s") for n in names)  # no clean copy
    plan = json.loads(got["prune --damaged --json"][1])
    assert sorted(r["path"] for r in plan["remove"]) == damaged
    assert {r["rule"] for r in plan["remove"]} == {"damaged"}
    ver = json.loads(got["verify --json"][1])
    failed = sorted(f["path"] for f in ver["files"] if f["levels"]["structure"]["status"] == "fail")
    assert failed == damaged and ver["summary"]["fail"] == len(damaged) and ver["exit_code"] == 4


def _cold_damaged(d: Path) -> list[str]:
    """The files a fresh read of each (empty layout cache) calls damaged."""
    from slotfile.format import layout_cache
    from slotfile.slotdir.walk import scan_dir, summarize

    out = []
    for e in scan_dir(d, settle=0).slots:
        layout_cache.SHAPES.clear()
        if summarize(e).damaged:
            out.append(e.path)
    layout_cache.SHAPES.clear()
    return sorted(out)


def test_ls_and_verify_write_each_row_before_reading_far_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Memory flat in the files: ``ls DIR --json`` and ``verify DIR --json`` write a file's row
    before they have read more than a chunk ahead of it (here in one process: 120 files; the
    forked workers hold at most WINDOW chunks more), and the summary after the rows still
    counts them all."""
    from slotfile.cli.ls_cmd import LsArgs, run_ls
    from slotfile.cli.verify_cmd import VerifyRequest, run_verify
    from slotfile.slotdir import forked, walk
    from slotfile.verify import engine

    d = tmp_path / "slots"
    d.mkdir()
    for i in range(120):
        shutil.copyfile(FIXTURES[i % len(FIXTURES)], d / f"s{i:03d}.slot")
        os.utime(d / f"s{i:03d}.slot", (time.time() - 3600,) * 2)
    read: list[int] = []
    ahead: list[int] = []
    summarize, to_dict = walk.summarize, walk.FileSummary.to_dict

    def counted(entry: Any) -> Any:
        read.append(1)
        return summarize(entry)

    def written(self: Any, now: float) -> Any:
        ahead.append(len(read) - len(ahead))
        return to_dict(self, now)

    monkeypatch.setattr(walk, "summarize", counted)
    monkeypatch.setattr(walk.FileSummary, "to_dict", written)
    assert run_ls(LsArgs(d, json_out=True, settle=0, settle_wait=0)) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["totals"]["files"] == len(doc["files"]) == 120 == len(read)
    assert 0 < max(ahead) <= forked.CHUNK  # never the whole directory read before the first row

    import slotfile.cli.verify_output as vo

    verified: list[int] = []
    taken: list[int] = []
    verify, add = engine.Verifier.verify, vo.Counts.add

    def one(self: Any, path: Path) -> Any:
        verified.append(1)
        return verify(self, path)

    def counted_row(self: Any, d: Any) -> None:  # as the row is taken to be written
        taken.append(len(verified) - len(taken))
        add(self, d)

    monkeypatch.setattr(engine.Verifier, "verify", one)
    monkeypatch.setattr(vo.Counts, "add", counted_row)
    assert run_verify(VerifyRequest((d,), json_out=True, settle=0, settle_wait=0)) == 0
    ver = json.loads(capsys.readouterr().out)
    assert ver["summary"]["files"] == len(ver["files"]) == 120 == len(verified)
    assert 0 < max(taken) <= forked.CHUNK


# ls DIR with the reading workers' function replaced: the worker that gets b/s101.slot is
# killed (as the kernel's out-of-memory killer would), or ends with an exception's exit
_DYING = r"""
import os, signal, sys
import slotfile.slotdir.walk as W
read, how = W._summarize_list, sys.argv[1]
def dying(entries):
    if any(e.rel.endswith("s101.slot") for e in entries):
        os.kill(os.getpid(), signal.SIGKILL) if how == "kill" else os._exit(3)
    return read(entries)
W._summarize_list = dying
from slotfile.cli.app import main
sys.argv = ["slotfile", "ls", sys.argv[2], "--json", "--settle", "0"]
main()
"""


@pytest.mark.parametrize(("how", "said"), [("kill", "killed by SIGKILL"), ("exit", "exit status 3")])
def test_a_lost_directory_worker_is_an_operational_error_naming_its_files(tmp_path: Path, how: str, said: str) -> None:
    """A reading worker that dies mid-listing (killed, out of memory) ends the command with
    exit 8 and one line naming how it ended and the files it held, not a traceback and exit 1."""
    d = _directory(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(ROOT), SLOTFILE_DIR_JOBS="2")
    r = subprocess.run(
        [sys.executable, "-c", _DYING, how, str(d)], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert r.returncode == 8, r.stderr[-2000:]
    (line,) = [x for x in r.stderr.splitlines() if "directory worker" in x]
    assert f"a directory worker process ended ({said}) while it held " in line, line
    assert "more; the listing above is incomplete" in line and "Traceback" not in r.stderr
