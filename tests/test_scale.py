"""Directory speed must not hide damage: the layout-detection cache (slotfile.format.layout,
one detection per file shape, re-checked against each file's bytes) gives exactly the verdicts
of a full search, for intact files and for damaged copies of the same shape."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from slotfile.format import layout_cache
from slotfile.format.reader import parse_buffer
from slotfile.slotdir.prune import plan_prune
from slotfile.slotdir.walk import scan_dir, summarize

from .conftest import SLOTS

FIXTURES = sorted(p for d in (SLOTS, SLOTS / "v4") for p in d.glob("*.slot"))


def _verdict(data: bytes) -> tuple[object, ...]:
    """Everything the structure level says about ``data``: problems, sections, layout."""
    sf = parse_buffer(data)
    body = sf.body
    return (
        tuple(p.line() for p in sf.problems),
        tuple(repr(s) for s in sf.sections),
        (body.layout.describe(), body.confidence, tuple(a.describe() for a in body.alternatives))
        if body is not None and body.layout is not None
        else None,
    )


def _variants(data: bytes) -> list[bytes]:
    """Same-length damage (a byte flipped at spread offsets, header words included) and cuts."""
    n = len(data)
    out = []
    for off in sorted({*range(0, n, max(1, n // 12)), *range(8, min(n, 400), 37)}):
        b = bytearray(data)
        b[off] ^= 0xFF
        out.append(bytes(b))
    out += [data[: n * k // 5] for k in (1, 3, 4)]
    return out


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_the_cache_reads_damaged_copies_exactly_as_a_full_search(path: Path) -> None:
    data = path.read_bytes()
    for v in [data, *_variants(data)]:
        layout_cache.SHAPES.clear()
        cold = _verdict(v)
        layout_cache.SHAPES.clear()
        _verdict(data)  # the intact file of this shape primes the cache
        assert _verdict(v) == cold, f"{path.name}: a cached shape changed the verdict of a damaged copy"


def test_prune_damaged_still_finds_damaged_copies_among_many_clean_ones(tmp_path: Path) -> None:
    src = SLOTS / "llama_f16_fa.slot"
    data = src.read_bytes()
    for i in range(60):
        shutil.copyfile(src, tmp_path / f"s{i:03d}.slot")
    sf = parse_buffer(data)
    assert sf.body is not None and sf.checkpoints
    # same length, same shape key as the clean files: the cached layout must not fit them
    b = bytearray(data)
    b[sf.body.offset : sf.body.offset + 4] = (7).to_bytes(4, "little")  # the body's n_stream
    (tmp_path / "s030.slot").write_bytes(bytes(b))
    (tmp_path / "s045.slot").write_bytes(data[: len(data) - 100])  # cut
    b = bytearray(data)
    at = sf.checkpoints[0].tgt.data_offset + 8 + 4  # checkpoint 0's first cell count
    b[at : at + 4] = (10**6).to_bytes(4, "little")
    (tmp_path / "s059.slot").write_bytes(bytes(b))
    now = time.time() + 3600
    for p in tmp_path.iterdir():
        os.utime(p, (now - 7200, now - 7200))
    layout_cache.SHAPES.clear()
    scan = scan_dir(tmp_path, now=now)
    sums = {e.path: summarize(e) for e in scan.slots}
    damaged = sorted(Path(p).name for p, s in sums.items() if s.damaged)
    assert damaged == ["s030.slot", "s045.slot", "s059.slot"]
    plan = plan_prune(scan, sums, now=now, damaged=True)
    assert sorted(Path(r.entry.path).name for r in plan.remove) == damaged
    # and each verdict is the one a fresh process (empty cache) gives
    for p, s in sums.items():
        layout_cache.SHAPES.clear()
        assert summarize(next(e for e in scan.slots if e.path == p)).first_problem == s.first_problem


def test_the_cache_is_bounded_and_holds_no_file_open(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Memory stays flat in the number of files: at most SHAPES_MAX sizes are kept, and no
    cached shape keeps a file's buffer (every file is closed after its summary)."""
    monkeypatch.setattr(layout_cache, "SHAPES_MAX", 3)
    layout_cache.SHAPES.clear()
    for i, p in enumerate(FIXTURES):
        shutil.copyfile(p, tmp_path / f"{i:02d}.slot")
    old = time.time() - 3600
    for p in tmp_path.iterdir():
        os.utime(p, (old, old))
    scan = scan_dir(tmp_path, settle=0)
    for e in scan.slots:
        s = summarize(e)  # opens, reads and closes the file (an mmap with a live export would raise)
        assert s.error is None
    assert 0 < len(layout_cache.SHAPES) <= 3
    assert all(len(v) <= layout_cache.SHAPES_PER_KEY for v in layout_cache.SHAPES.values())
