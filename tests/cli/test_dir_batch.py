"""cli.dir_batch: what re-save DIR and migrate DIR share (output-directory checks, exit code,
tally, JSON report), tested once here; the commands' own tests run it end to end."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from slotfile.cli.dir_batch import outdir_usage, report_batch, settle_batch
from slotfile.exitcodes import OK, OPERATIONAL, PROBLEMS, USAGE
from slotfile.repair.batch import FileResult
from slotfile.slotdir.walk import DirScan


def test_outdir_usage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "in"
    root.mkdir()
    assert outdir_usage(root, tmp_path / "out", "migrate") is None  # not there yet: made later
    assert outdir_usage(root, root / "sub", "migrate") == USAGE
    assert "lies inside" in capsys.readouterr().err
    (tmp_path / "file").write_bytes(b"x")
    assert outdir_usage(root, tmp_path / "file", "re-save") == USAGE
    assert capsys.readouterr().err.startswith("slotfile re-save: ")


@pytest.mark.parametrize(
    ("actions", "errors", "rc", "tally"),
    [
        (["converted", "copied", "left-out"], [], OK, (2, 1, 0)),
        (["would-convert", "skipped"], [], PROBLEMS, (1, 1, 0)),
        (["converted", "failed"], [], PROBLEMS, (1, 0, 1)),
        (["error"], [], OPERATIONAL, (0, 0, 1)),
        (["converted"], ["x: unreadable"], OPERATIONAL, (1, 0, 1)),
    ],
)
def test_settle_batch(actions: list[str], errors: list[str], rc: int, tally: tuple[int, int, int]) -> None:
    results = [FileResult(f"f{i}", "GGSQ 2 -> 4", a, "why") for i, a in enumerate(actions)]
    o = settle_batch(results, DirScan("/r"), errors, time.monotonic(), "migrate")
    assert o.rc == rc
    assert (o.tally.handled, o.tally.skipped, o.tally.failed) == tally
    assert sum(o.counts.values()) == len(actions)


def test_report_batch_json_keys(capsys: pytest.CaptureFixture[str]) -> None:
    results = [FileResult("a.slot", "GGSQ 2 -> 4", "converted", "ok", "/o/a.slot")]
    scan = DirScan("/r")
    o = settle_batch(results, scan, [], time.monotonic(), "migrate")
    report_batch(results, scan, o, {"schema": "s/1", "root": "/r"}, dry_run=False, json_out=True)
    doc = json.loads(capsys.readouterr().out)
    assert list(doc) == [
        "schema",
        "root",
        "files",
        "errors",
        "still_being_written",
        "summary",
        "tally",
        "exit_code",
    ]
    assert doc["files"][0]["action"] == "converted" and doc["exit_code"] == OK
