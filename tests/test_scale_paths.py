"""The fast paths of a directory run give the verdicts of a plain full parse per file.

A directory of many same-shape clean files with damaged copies (header, tokens, body cells,
checkpoint blobs, SDFT) is read with the per-shape cache warm, and every file's summary, its
structure verdict and ``prune --damaged``'s plan must be those of a fresh read (empty cache).
The struct/numpy readers of hot fixed-size pieces (file header, a text-only packed token
payload) must give what the construct grammar gives, or decline.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from slotfile.format import grammar as g
from slotfile.format import layout_cache
from slotfile.format.read_body import packed_without_media
from slotfile.format.reader import parse_buffer
from slotfile.slotdir.prune import plan_prune
from slotfile.slotdir.walk import scan_dir, summarize
from slotfile.verify.options import VerifyOptions

from .conftest import SLOTS
from .test_scale import _verdict

FIXTURES = sorted(p for d in (SLOTS, SLOTS / "v4") for p in d.glob("*.slot"))
CORPUS = Path(os.path.expanduser("~/.cache/slotfile/corpus"))
REAL = sorted(p for p in CORPUS.glob("*-native/*.bin") if p.stat().st_size < 256 * 1024)[:40]
# the shapes with every section a directory run reads: checkpoints, SDFT, iSWA, REC, two streams
TARGETS = [
    pytest.param("llama_draft_sdft.slot", marks=pytest.mark.slow),
    pytest.param("v4/llama_draft_sdft.slot", marks=pytest.mark.slow),
    "gemma3_iswa_fa.slot",
    "v4/extra-jamba.slot",
    "extra-lfm2.slot",
    "llama_unified_2seq.slot",
    "v4/llama_plain_tokens.slot",
]


def _cell_offsets(blocks: Any) -> list[int]:
    """Where the cell tables of ``blocks`` start (pos of cell 0, n_seq_id, a later cell)."""
    out = []
    for b in blocks:
        tables = [st.cells for st in b.streams] + [b.cells]
        for t in tables:
            if t is not None and len(t.raw):
                out += [t.offset, t.offset + 4, t.offset + len(t.raw) - t.cells.dtype.itemsize]
    return out


def _places(data: bytes) -> list[int]:
    """Offsets in every section of a clean file: its start, first words, middle and end, and
    the cell tables of the body, the checkpoint blobs and the draft."""
    sf = parse_buffer(data)
    out = set()
    for s in sf.sections:
        for off in (s.offset, s.offset + 4, s.offset + 8, s.offset + s.size // 2, s.offset + s.size - 4):
            if 0 <= off < len(data) - 3:
                out.add(off)
    assert sf.body is not None
    out.update(_cell_offsets(sf.body.blocks))
    for ck in sf.checkpoints:
        for b in (ck.tgt, ck.dft):
            if b.body is not None:
                out.update(_cell_offsets(b.body.blocks))
    if sf.draft is not None and sf.draft.dft is not None and sf.draft.dft.body is not None:
        out.update(_cell_offsets(sf.draft.dft.body.blocks))
    return sorted(o for o in out if 0 <= o <= len(data) - 4)


def _damaged(data: bytes) -> list[bytes]:
    """Same-length damage at every place (a byte flipped, a word set to -1, 0, a big count,
    one more) and a cut in the middle."""
    out = []
    for off in _places(data):
        word = int.from_bytes(data[off : off + 4], "little")
        for new in (word ^ 0xFF, 0xFFFFFFFF, 0, 10**6, (word + 1) & 0xFFFFFFFF):
            b = bytearray(data)
            b[off : off + 4] = new.to_bytes(4, "little")
            out.append(bytes(b))
    out.append(data[: len(data) // 2])
    return out


@pytest.mark.parametrize("name", TARGETS)
def test_damage_in_any_section_reads_as_a_fresh_parse_reads_it(name: str) -> None:
    data = (SLOTS / name).read_bytes()
    variants = _damaged(data)
    cold = []
    for v in variants:
        layout_cache.SHAPES.clear()
        cold.append(_verdict(v))
    layout_cache.SHAPES.clear()
    clean = _verdict(data)  # the clean file primes the cache; then the copies come in a row, as in a DIR
    for v, want in zip(variants, cold, strict=True):
        assert _verdict(v) == want, f"{name}: the cache changed the verdict of a damaged copy"
        assert _verdict(data) == clean


def _dir_with_damage(tmp: Path, name: str, copies: int) -> list[Path]:
    """``copies`` clean copies of ``name`` and a damaged copy at every place of every section."""
    data = (SLOTS / name).read_bytes()
    paths = []
    for i in range(copies):
        p = tmp / f"clean{i:03d}.slot"
        shutil.copyfile(SLOTS / name, p)
        paths.append(p)
    for i, v in enumerate(_damaged(data)[::3]):
        p = tmp / f"hurt{i:03d}.slot"
        p.write_bytes(v)
        paths.append(p)
    old = time.time() - 3600
    for p in paths:
        os.utime(p, (old, old))
    return paths


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama_draft_sdft.slot", "v4/gemma3_iswa_fa.slot"])
def test_ls_prune_and_verify_of_a_directory_match_fresh_reads(tmp_path: Path, name: str) -> None:
    _dir_with_damage(tmp_path, name, 30)
    layout_cache.SHAPES.clear()
    scan = scan_dir(tmp_path, settle=0)
    warm = {e.path: summarize(e) for e in scan.slots}
    fresh = {}
    for e in scan.slots:
        layout_cache.SHAPES.clear()
        fresh[e.path] = summarize(e)
    assert {p: s.to_dict(0) for p, s in warm.items()} == {p: s.to_dict(0) for p, s in fresh.items()}
    hurt = sorted(p for p, s in fresh.items() if s.damaged)
    assert hurt and all("hurt" in p for p in hurt)  # the copies are found, and no clean file is
    plan = plan_prune(scan, warm, now=time.time(), damaged=True)
    assert sorted(r.entry.path for r in plan.remove) == hurt
    # verify DIR's structure level (no --model): the same problems warm as fresh
    from slotfile.verify.engine import Verifier

    with Verifier(VerifyOptions()) as v:
        layout_cache.SHAPES.clear()
        runs = {e.path: v.verify(Path(e.path)).levels["structure"] for e in scan.slots}
        for e in scan.slots:
            layout_cache.SHAPES.clear()
            lv = v.verify(Path(e.path)).levels["structure"]
            got = runs[e.path]
            assert (got.status, [p.line() for p in got.problems]) == (lv.status, [p.line() for p in lv.problems])


def _same(a: Any, b: Any) -> bool:
    """Two values of a parsed container alike: arrays by dtype and items, runs and streams by
    place, the rest by value."""
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, g.Run):
        return (a.offset, a.length, bytes(a.view)) == (b.offset, b.length, bytes(b.view))
    if isinstance(a, g.ViewStream):
        return (a.start, a.end, a.tell(), a.loc, a.short) == (b.start, b.end, b.tell(), b.loc, b.short)
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _payloads() -> list[tuple[str, bytes, int]]:
    out = []
    for p in [*FIXTURES, *REAL]:
        data = p.read_bytes()
        sf = parse_buffer(data)
        if sf.tokens is not None and sf.tokens.form == "packed":
            out.append((p.name, data, sf.n_token_count or 0))
    return out


def test_the_packed_token_reader_gives_the_grammars_container_or_declines() -> None:
    hits = 0
    for name, data, n in _payloads():
        start, end = 12, 12 + 4 * n
        variants = [data]
        for w in sorted({0, 1, 2, 3, n - 2, n - 1, max(0, n - 5)}):
            for new in (0, 1, 0xFFFFFFFF, n - 4, n - 3, n):
                b = bytearray(data)
                b[start + 4 * w : start + 4 * w + 4] = (new & 0xFFFFFFFF).to_bytes(4, "little")
                variants.append(bytes(b))
        for v in variants:
            view = memoryview(v)
            fast = packed_without_media(view, start, end)
            if fast is None:
                continue
            hits += 1
            slow = g.PackedTokens.parse_stream(g.ViewStream(view, start, end))
            assert _same(fast, slow), name
            assert fast["tokens"].base is not None  # a view over the file, as the grammar gives
    assert hits >= 30  # the text-only payloads do take the fast path


def test_the_header_reader_is_the_grammars_header() -> None:
    from slotfile.format.reader import _FILE_HEADER

    for p in FIXTURES:
        head = p.read_bytes()[:12]
        c = g.FileHeader.parse(head)
        assert _FILE_HEADER.unpack_from(head, 0) == (c.magic, c.version, c.n_token_count)
    assert _FILE_HEADER.size == g.FileHeader.sizeof()


def test_a_file_whose_cells_differ_takes_the_cached_shape_with_its_own_cells(monkeypatch: pytest.MonkeyPatch) -> None:
    """Files of one shape differ in their cells (positions, seq ids, the token in the ext):
    such a file gets the cached blocks over its own cell bytes, without the re-parse, and the
    verdict of a fresh parse; a cell the grammar refuses (n_seq_id, negative position) does not."""
    from slotfile.format import layout

    data = (SLOTS / "v4" / "llama_f16_fa.slot").read_bytes()
    sf = parse_buffer(data)
    assert sf.body is not None
    ct = sf.body.blocks[0].streams[0].cells
    assert ct is not None and len(ct.cells) > 3
    moved = bytearray(data)
    cell = ct.cells.dtype.itemsize
    moved[ct.offset + cell : ct.offset + cell + 4] = (77).to_bytes(4, "little")  # cell 1's position
    layout_cache.SHAPES.clear()
    want = _verdict(bytes(moved))
    layout_cache.SHAPES.clear()
    _verdict(data)

    def no_reparse(*a: Any, **k: Any) -> None:
        raise AssertionError("re-parsed")

    monkeypatch.setattr(layout, "_reparse", no_reparse)
    assert _verdict(bytes(moved)) == want
    got = parse_buffer(bytes(moved)).body
    assert got is not None and int(got.blocks[0].streams[0].positions[1]) == 77
    for field, value in (("n_seq_id", 2), ("pos", -5)):
        bad = bytearray(data)
        at = ct.offset + 2 * cell + ct.cells.dtype.fields[field][1]
        bad[at : at + 4] = value.to_bytes(4, "little", signed=True)
        with pytest.raises(AssertionError, match="re-parsed"):
            _verdict(bytes(bad))


def test_the_streamed_json_is_the_one_text_json_dumps_gives(capsys: pytest.CaptureFixture[str]) -> None:
    from slotfile.cli.common import write_json
    from slotfile.cli.jsonout import ITEM_INDENT, Encoded, Later, LazyList, encode
    from slotfile.format.records import FileFormat, Severity
    from slotfile.problems import ProblemCode

    doc = {"files": [{"path": f"d/{i}", "size": i, "ok": i % 2 == 0, "r": 0.5 * i, "x": None} for i in range(9000)]}
    doc["é"] = ["\n", float("inf"), float("nan"), -0.0, 10**30, [], {}, [[{}]], ("t", (1,))]
    doc["keys"] = {3: "int", 2.5: "float", False: "bool", None: "none", "s\u2028": {"deep": [None, False]}}
    doc["enums"] = [ProblemCode.TRUNCATED, Severity.ERROR, FileFormat.GGSQ]
    write_json(doc)
    assert capsys.readouterr().out == json.dumps(doc, indent=2) + "\n"
    for odd in ({}, [], "x", 3, None, {"a": {}}):
        write_json(odd)
        assert capsys.readouterr().out == json.dumps(odd, indent=2) + "\n"
    rows = [{"i": i, "x": [i] * (i % 3)} for i in range(50)]
    write_json({"n": 1, "files": LazyList(lambda: iter(rows)), "empty": LazyList(list), "z": 2})
    assert capsys.readouterr().out == json.dumps({"n": 1, "files": rows, "empty": [], "z": 2}, indent=2) + "\n"
    # rows encoded elsewhere (a forked worker's), and values made once the rows are written
    seen: list[int] = []

    def made() -> Any:
        for r in rows:
            seen.append(r["i"])
            yield Encoded(encode(r, ITEM_INDENT)) if r["i"] % 2 else r

    doc2 = {"files": LazyList(made), "n": Later(lambda: {"seen": len(seen)}), "rc": Later(lambda: 4)}
    write_json(doc2)
    assert capsys.readouterr().out == json.dumps({"files": rows, "n": {"seen": 50}, "rc": 4}, indent=2) + "\n"
    with pytest.raises(TypeError):
        write_json({"x": object()})


def test_a_large_directory_on_two_processes_reads_as_on_one(tmp_path: Path) -> None:
    """ls, prune and verify (structure) read a large DIR on forked processes: every file's
    summary and structure verdict, in order, are those of one process reading them all, and
    the rows really came from two other processes.  Where this process may not fork (other
    tests left threads running: forked.can_fork says no and a directory run reads in one
    process), the same check runs in a freshly spawned interpreter, where it can: the test
    never skips."""
    import multiprocessing

    from slotfile.slotdir import forked

    if forked.can_fork():
        _two_processes_read_as_one(str(tmp_path))
        return
    proc = multiprocessing.get_context("spawn").Process(target=_two_processes_read_as_one, args=(str(tmp_path),))
    proc.start()
    proc.join(600)
    assert proc.exitcode == 0, f"the check in a spawned process exited {proc.exitcode}"


def _pids(items: list[Any]) -> list[int]:
    return [os.getpid()] * len(items)


def _two_processes_read_as_one(tmp: str) -> None:
    from slotfile.slotdir import forked, walk
    from slotfile.verify.engine import Verifier

    assert forked.can_fork()
    tmp_path = Path(tmp)
    saved = (forked.PARALLEL_MIN, forked.CHUNK, os.environ.pop(forked.JOBS_ENV, None))
    forked.PARALLEL_MIN, forked.CHUNK = 40, 8  # several chunks, each split between the workers
    try:
        _dir_with_damage(tmp_path, "v4/llama_q8_0_fa.slot", 40)
        shutil.copyfile(SLOTS / "gemma3_iswa_fa.slot", tmp_path / "other.slot")
        (tmp_path / "empty.slot").write_bytes(b"")
        scan = scan_dir(tmp_path, settle=0)
        assert len(scan.slots) >= 80
        pids = list(forked.ordered_map(_pids, ((e, e.size) for e in scan.slots)))
        assert len(set(pids)) == 2 and os.getpid() not in pids  # the default: two workers
        one = [summarize(e) for e in scan.slots]
        two = walk.summarize_all(scan.slots, jobs=3)
        assert [s.to_dict(0) for s in two] == [s.to_dict(0) for s in one]
        assert any(s.damaged for s in one) and not all(s.damaged for s in one)
        paths = [Path(e.path) for e in scan.slots]
        with Verifier(VerifyOptions()) as v:
            seen: list[str] = []
            forked_reports = v.run(paths, on_done=lambda r: seen.append(r.path))
            alone = [v.verify(p) for p in paths]
        assert seen == [str(p) for p in paths]
        assert [_facts(r) for r in forked_reports] == [_facts(r) for r in alone]
    finally:
        forked.PARALLEL_MIN, forked.CHUNK = saved[0], saved[1]
        if saved[2] is not None:
            os.environ[forked.JOBS_ENV] = saved[2]


def test_a_chunk_is_split_by_size_bands_within_a_quarter_of_an_even_share() -> None:
    from slotfile.slotdir.forked import split_chunk

    sizes = [100] * 10 + [200] * 10 + [300] * 12
    parts = split_chunk(range(32), sizes, [200], 2)
    assert parts == [list(range(10)), list(range(10, 32))]  # the sizes below the cut; the rest (within 16 +- 8)
    skewed = [5] * 30 + [9] * 2
    parts = split_chunk(range(32), skewed, [9], 2)
    assert [len(p) for p in parts] == [24, 8]  # 30 below the cut, held to 16 + 8
    assert sorted(parts[0] + parts[1]) == list(range(32))
    three = split_chunk(range(12), list(range(12)), [4, 8], 3)
    assert three == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_the_size_bands_come_from_a_bounded_seeded_sample() -> None:
    """The bounds a chunk is split at are the quantiles of at most SAMPLE sizes (a reservoir:
    memory bounded whatever the directory), the same on every run, followed as the sizes
    change (taken again once an eighth more came in, not for every chunk)."""
    from slotfile.slotdir.forked import SAMPLE, SizeSample

    def sample(sizes: list[int]) -> SizeSample:
        got = SizeSample(2)
        for x in sizes:
            got.add(x)
        return got

    small = sample([100] * 300 + [300] * 300)
    assert small.bounds() == [300]
    sizes = [i % 1000 for i in range(5 * SAMPLE)]
    a, b = sample(sizes), sample(sizes)
    assert len(a.kept) == SAMPLE and list(a.kept) == list(b.kept) and a.bounds() == b.bounds()
    assert abs(a.bounds()[0] - 500) < 50  # the median of 0..999
    first = a.bounds()
    for _ in range(10):
        a.add(10**9)
    assert a.bounds() is first  # ten more of 20,490: not taken again
    for _ in range(15 * SAMPLE):
        a.add(10**9)
    assert a.bounds()[0] == 10**9  # three quarters of the sizes now that large: the median followed


def _facts(r: Any) -> tuple[object, ...]:
    lv = r.levels["structure"]
    return (r.path, r.size, r.n_tokens, r.error, r.verdict, lv.status, [p.line() for p in lv.problems], lv.details)


@pytest.mark.parametrize("name", ["llama_draft_sdft.slot", "v4/extra-jamba.slot", "v4/llama_2stream.slot"])
def test_checkpoint_entries_read_with_struct_are_the_grammars(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from slotfile.format import appendix

    data = (SLOTS / name).read_bytes()
    sckp = next(s for s in parse_buffer(data).sections if s.name == "sckp")
    start = sckp.offset + 12
    hits = 0

    def read(v: bytes) -> list[Any]:
        view = memoryview(v)
        got: list[Any] = []
        for kw in ({"stop_at_sdft": True}, {"count": 2}):
            for item in appendix.entries(view, start, len(v), **kw):
                got.append(item)
                if isinstance(item, appendix.EntryFrame):
                    got += [appendix.blob_seq_id(view, b.data.offset, b.data.offset + b.length) for b in (item.tgt,)]
        return got

    for v in [data, *_damaged(data)]:
        fast = read(v)
        hits += sum(isinstance(x, appendix.EntryFrame) for x in fast)
        with monkeypatch.context() as m:
            m.setattr(appendix, "entry_fast", lambda *a: None)
            m.setattr(appendix, "seq_id_fast", lambda *a: None)
            assert read(v) == fast
    assert hits > 100


def _counting_other_size(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """layout._other_size wrapped: [bodies it read, bodies it sent to the search]."""
    from slotfile.format import layout

    seen = [0, 0]
    real = layout._other_size

    def counted(*a: Any, **k: Any) -> Any:
        det = real(*a, **k)
        seen[det is None] += 1
        return det

    monkeypatch.setattr(layout, "_other_size", counted)
    return seen


def test_files_of_many_sizes_read_in_a_row_read_as_fresh_parses(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every fixture and real-server file, read in a row (each size new, its layout often one a
    file of another size had: layout._other_size), reads as it does with an empty cache."""
    paths = [*FIXTURES, *REAL[:24]]
    cold = {}
    for p in paths:
        layout_cache.SHAPES.clear()
        cold[p] = _verdict(p.read_bytes())
    seen = _counting_other_size(monkeypatch)
    layout_cache.SHAPES.clear()
    for p in paths:
        assert _verdict(p.read_bytes()) == cold[p], f"{p.name}: read after other sizes of its layout"
    assert seen[0] >= 10, f"the other-size path read only {seen[0]} bodies"


@pytest.mark.parametrize(
    ("prime", "name"),
    [("llama_2stream.slot", "llama_f16_fa.slot"), ("v4/llama128_q8_0_fa.slot", "v4/llama_draft_sdft.slot")],
)
def test_damage_in_a_size_new_to_a_cached_layout_reads_as_a_fresh_parse(
    prime: str, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file of a size the cache has not seen, in the layout of a cached shape of another size,
    damaged in every section: the same verdict as with an empty cache (the clean file itself
    takes the other-size path, not the search)."""
    data, other = (SLOTS / name).read_bytes(), (SLOTS / prime).read_bytes()
    variants = [data, *_damaged(data)[::2]]
    cold = []
    for v in variants:
        layout_cache.SHAPES.clear()
        cold.append(_verdict(v))
    seen = _counting_other_size(monkeypatch)
    for i, (v, want) in enumerate(zip(variants, cold, strict=True)):
        layout_cache.SHAPES.clear()
        _verdict(other)  # only the other size is cached
        seen[:] = [0, 0]
        assert _verdict(v) == want, f"{name}: variant {i} read after {prime}"
        if i == 0:
            assert seen[0] >= 1 and seen[1] == 0, f"the clean file did not take the other-size path: {seen}"
