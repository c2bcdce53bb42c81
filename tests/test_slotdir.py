"""A slot directory as a whole: what counts as a slot file, what is left alone, prune plans
on files of known ages and sizes, and restore verdicts proven by real loads."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slotfile.slotdir.prune import carry_out, plan_prune
from slotfile.slotdir.restore import Checker, Fate
from slotfile.slotdir.serverargs import parse_server_args
from slotfile.slotdir.walk import parse_age, parse_size, scan_dir, settle_problem, summarize, wait_for_settle

from .conftest import MODELS, SLOTS

DAY = 86400.0
LLAMA = MODELS / "llama.gguf"


def _put(d: Path, name: str, src: str, age: float, now: float) -> Path:
    p = d / name
    p.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(SLOTS / src, p)
    os.utime(p, (now - age, now - age))
    return p


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, float]:
    """Five slot files 1..5 days old, one cut (damaged), one fresh (being written), a temp file of
    a safe write, a plain text file, and symlinks to a file and a directory outside."""
    now = time.time()
    d = tmp_path / "slots"
    for i in range(1, 6):
        _put(d, f"s{i}.slot", "llama_f16_fa.slot", i * DAY, now)
    cut = d / "sub" / "cut.bin"
    cut.parent.mkdir(parents=True)
    cut.write_bytes((SLOTS / "llama_f16_fa.slot").read_bytes()[:5000])
    os.utime(cut, (now - 3600, now - 3600))
    _put(d, "fresh.slot", "llama_f16_fa.slot", 1.0, now)
    (d / ".s1.slot.slotfile-4242-0123456789ab.tmp").write_bytes(b"qsgg")
    (d / "notes.txt").write_text("not a slot")
    outside = tmp_path / "outside"
    outside.mkdir()
    _put(outside, "victim.slot", "llama_f16_fa.slot", 30 * DAY, now)
    (d / "link.slot").symlink_to(outside / "victim.slot")
    (d / "linkdir").symlink_to(outside)
    return d, now


def test_wait_for_settle_takes_what_settles_and_names_the_rest(tmp_path: Path):
    """A fake clock: a.slot stops changing, b.slot keeps changing through the whole wait, c.slot
    vanishes while waited for.  What settled joins the slot files in walk order (the paths'
    order, part by part: "sub/x.slot" between "b.slot" and "z.slot"), the rest stays busy or is
    an error line."""
    t0 = time.time()
    for rel in ("a.slot", "z.slot", "sub/x.slot", "b.slot", "c.slot"):
        _put(tmp_path, rel, "llama_f16_fa.slot", 0.0, t0)
    for rel in ("z.slot", "sub/x.slot"):
        os.utime(tmp_path / rel, (t0 - DAY, t0 - DAY))
    os.utime(tmp_path / "a.slot", (t0 - 1, t0 - 1))
    scan = scan_dir(tmp_path, settle=5.0, now=t0)
    assert [e.rel for e in scan.busy] == ["a.slot", "b.slot", "c.slot"]
    assert [e.rel for e in scan.slots] == ["sub/x.slot", "z.slot"]
    clock = [t0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        clock[0] += s
        os.utime(tmp_path / "b.slot", (clock[0], clock[0]))  # still being written
        (tmp_path / "c.slot").unlink(missing_ok=True)

    wait_for_settle(scan, 8.0, clock=lambda: clock[0], sleep=sleep)
    assert [e.rel for e in scan.slots] == ["a.slot", "sub/x.slot", "z.slot"]
    assert [e.rel for e in scan.busy] == ["b.slot"] and scan.settled == 1
    assert [e for e in scan.errors if "c.slot" in e] == [f"{tmp_path / 'c.slot'}: vanished while it was being written"]
    assert slept == pytest.approx([4.0, 4.0]) and scan.waited == pytest.approx(8.0)  # due at a's settle, then the bound
    scan.settle_wait = 8.0
    (line,) = scan.busy_lines()
    assert line.startswith(f"{tmp_path / 'b.slot'}: still being written") and "--settle-wait 8" in line


def test_scan_dir_waits_for_a_real_file_and_does_not_wait_without_a_bound(tmp_path: Path):
    _put(tmp_path, "old.slot", "llama_f16_fa.slot", DAY, time.time())
    _put(tmp_path, "new.slot", "llama_f16_fa.slot", 0.0, time.time())
    told: list[tuple[list[str], float]] = []
    t = time.monotonic()
    scan = scan_dir(tmp_path, settle=0.5, settle_wait=10, on_wait=lambda fs, b: told.append(([e.rel for e in fs], b)))
    assert time.monotonic() - t < 5 and 0.2 < scan.waited < 5
    assert [e.rel for e in scan.slots] == ["new.slot", "old.slot"] and not scan.busy and told == [(["new.slot"], 10)]
    os.utime(tmp_path / "new.slot", (time.time() - DAY, time.time() - DAY))
    _put(tmp_path, "newer.slot", "llama_f16_fa.slot", 0.0, time.time())
    scan = scan_dir(tmp_path, settle=60)  # settle_wait 0: nothing waited for, the file stays busy
    assert [e.rel for e in scan.busy] == ["newer.slot"] and scan.waited == 0.0


@pytest.mark.parametrize(
    ("settle", "wait", "bad"),
    [(5, 30, None), (0, 0, None), (-1, 30, "--settle"), (5, -1, "--settle-wait"), (5, float("nan"), "--settle-wait"),
     (5, 1e9, "--settle-wait"), (float("inf"), 0, "--settle")],
)  # fmt: skip
def test_settle_values_out_of_range(settle, wait, bad):
    why = settle_problem(settle, wait)
    assert (why is None) if bad is None else why.startswith(bad + " takes")


def test_scan_sorts_files_by_kind(tree):
    d, now = tree
    scan = scan_dir(d, now=now)
    assert sorted(e.rel for e in scan.slots) == ["s1.slot", "s2.slot", "s3.slot", "s4.slot", "s5.slot", "sub/cut.bin"]
    assert [e.rel for e in scan.busy] == ["fresh.slot"]
    assert [e.rel for e in scan.temps] == [".s1.slot.slotfile-4242-0123456789ab.tmp"]
    assert sorted(os.path.basename(p) for p in scan.symlinks) == ["link.slot", "linkdir"]
    assert not scan.errors


def test_summary_is_structure_level(tree):
    d, now = tree
    scan = scan_dir(d, now=now)
    by = {e.rel: summarize(e) for e in scan.slots}
    s = by["s1.slot"]
    assert (s.n_tokens, s.version, s.memory_class, s.n_stream, s.type_k, s.type_v, s.flash_attn, s.checkpoints) == (
        54,
        3,
        "kv-cache",
        1,
        "f16",
        "f16",
        True,
        2,
    )
    assert by["sub/cut.bin"].damaged and "truncated" in (by["sub/cut.bin"].first_problem or "")
    two = summarize(type(scan.slots[0])("", str(SLOTS / "llama_2stream.slot"), 0, 0))  # root "": rel is the path
    assert (two.n_stream, two.active_streams) == (2, 1)


@pytest.mark.parametrize(
    ("text", "n"),
    [("10G", 10 << 30), ("500M", 500 << 20), ("4096", 4096), ("1.5KiB", 1536), ("2k", 2048), ("1T", 1 << 40)],
)
def test_sizes(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize(("text", "s"), [("7d", 7 * DAY), ("12h", 43200), ("30m", 1800), ("90s", 90), ("2w", 14 * DAY)])
def test_ages(text, s):
    assert parse_age(text) == s


@pytest.mark.parametrize("bad", ["", "10X", "G", "-5M", "7 days"])
def test_bad_sizes_and_ages(bad):
    with pytest.raises(ValueError):
        parse_size(bad)
    with pytest.raises(ValueError):
        parse_age(bad)


def _plan(d: Path, now: float, **kw):
    scan = scan_dir(d, now=now)
    sums = {e.path: summarize(e) for e in scan.slots}
    return plan_prune(scan, sums, now=now, **kw)


def test_prune_oldest_first_to_meet_the_quota(tree):
    d, now = tree
    size = (SLOTS / "llama_f16_fa.slot").stat().st_size
    # 5 whole files, the cut one (5000 bytes, 1 h old); the fresh file and the 4-byte temp file
    # count towards the quota but are never removed: the two oldest whole files go
    quota = 3 * size + 5000 + size + 4
    plan = _plan(d, now, max_total=quota)
    assert [r.entry.rel for r in plan.remove] == ["s5.slot", "s4.slot"]
    assert plan.quota_met and plan.total_after == 3 * size + 5000
    assert [r.entry.rel for r in _plan(d, now, max_total=quota - 1).remove] == ["s5.slot", "s4.slot", "s3.slot"]


def test_prune_damaged_first_then_age_then_keep(tree):
    d, now = tree
    plan = _plan(d, now, damaged=True, older_than=3.5 * DAY)
    assert [r.entry.rel for r in plan.remove] == ["sub/cut.bin", "s5.slot", "s4.slot"]
    assert plan.remove[0].why.startswith("damaged")
    plan = _plan(d, now, keep=2)
    assert [r.entry.rel for r in plan.remove] == ["s5.slot", "s4.slot", "s3.slot", "s2.slot"]


def test_prune_cannot_meet_a_quota_below_what_it_may_touch(tree):
    d, now = tree
    plan = _plan(d, now, max_total=10)
    assert not plan.quota_met and len(plan.remove) == 6  # every slot file, never the fresh or the temp one


def test_delete_removes_exactly_the_plan(tree):
    d, now = tree
    before = {p.relative_to(d).as_posix() for p in d.rglob("*")}
    plan = _plan(d, now, older_than=2.5 * DAY, damaged=True)
    carry_out(plan, str(d), settle=5.0)
    assert all(r.done and r.error is None for r in plan.remove)
    after = {p.relative_to(d).as_posix() for p in d.rglob("*")}
    assert before - after == {r.entry.rel for r in plan.remove} == {"s3.slot", "s4.slot", "s5.slot", "sub/cut.bin"}
    assert (d.parent / "outside" / "victim.slot").exists()


def test_delete_leaves_a_file_that_changed_since_the_plan(tree):
    d, now = tree
    plan = _plan(d, now, older_than=4.5 * DAY)
    assert [r.entry.rel for r in plan.remove] == ["s5.slot"]
    with open(d / "s5.slot", "ab") as f:  # a server writes it again meanwhile
        f.write(b"x")
    carry_out(plan, str(d), settle=5.0)
    assert (d / "s5.slot").exists() and plan.remove[0].error and not plan.remove[0].done


def test_delete_never_follows_a_directory_swapped_for_a_symlink(tree, tmp_path):
    d, now = tree
    plan = _plan(d, now, damaged=True)
    assert [r.entry.rel for r in plan.remove] == ["sub/cut.bin"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copyfile(d / "sub" / "cut.bin", elsewhere / "cut.bin")
    os.utime(elsewhere / "cut.bin", (now - 3600, now - 3600))
    st = os.stat(d / "sub" / "cut.bin")
    os.utime(elsewhere / "cut.bin", ns=(st.st_atime_ns, st.st_mtime_ns))
    shutil.rmtree(d / "sub")
    (d / "sub").symlink_to(elsewhere)
    carry_out(plan, str(d), settle=5.0)
    assert (elsewhere / "cut.bin").exists() and "symlink" in (plan.remove[0].error or "")


# ---------------------------------------------------------------------------------------
# restore verdicts, each "as is" proven by a real load under the server's settings


def _dir_of_saves(tmp_path: Path) -> Path:
    """Files saved under different settings: 1 and 2 streams, unified, fa on/off, f16/q8_0."""
    d = tmp_path / "saves"
    d.mkdir()
    for name in (
        "llama_f16_fa",
        "llama_f16_nofa",
        "llama_2stream",
        "llama_unified_2seq",
        "llama_q8_0_fa",
        "llama_draft_sdft",
        "gemma3_iswa_fa",
    ):
        shutil.copyfile(SLOTS / f"{name}.slot", d / f"{name}.slot")
    return d


def _verdicts(d: Path, args: str) -> dict[str, object]:
    server = parse_server_args(args)
    c = Checker(server, server.model)
    try:
        out = {}
        for e in scan_dir(d, settle=0).slots:
            _, r = c.check(e.path, e.rel, e.size, e.mtime)
            assert r is not None
            out[e.rel.removesuffix(".slot")] = r
        return out
    finally:
        c.close()


CASES = {
    # saved with -np 1 -fa on (the default-like single slot)
    f"llama-server -m {LLAMA} -c 256 -np 1 -fa on": {
        "llama_f16_fa": Fate.AS_IS,
        "llama_f16_nofa": Fate.EXACT,
        "llama_2stream": Fate.EXACT,
        "llama_unified_2seq": Fate.AS_IS,
        "llama_q8_0_fa": Fate.LOSSY,
        "llama_draft_sdft": Fate.AS_IS,
        "gemma3_iswa_fa": Fate.CANNOT,
    },
    f"llama-server -m {LLAMA} -c 512 -np 2 -fa on": {
        "llama_f16_fa": Fate.EXACT,
        "llama_2stream": Fate.AS_IS,
        "llama_q8_0_fa": Fate.LOSSY,
    },
    f"llama-server -m {LLAMA} -c 1024 -fa off": {  # -np auto: 4 slots, unified
        "llama_f16_fa": Fate.EXACT,
        "llama_f16_nofa": Fate.AS_IS,
        "llama_2stream": Fate.EXACT,
        "llama_unified_2seq": Fate.EXACT,
        "llama_q8_0_fa": Fate.LOSSY,
    },
    f"llama-server -m {LLAMA} -c 256 -np 1 -ctk q8_0 -ctv q8_0 -fa on": {
        "llama_f16_fa": Fate.LOSSY,
        "llama_q8_0_fa": Fate.AS_IS,
    },
    f"llama-server -m {LLAMA} -c 256 -np 4 -kvu --kv-unified-per-slot 32": {
        "llama_f16_fa": Fate.CANNOT
    },  # 54 tokens, a slot holds 32
}


@pytest.mark.llama
@pytest.mark.parametrize("args", list(CASES))
def test_verdicts_against_several_servers(tmp_path, args):
    got = _verdicts(_dir_of_saves(tmp_path), args)
    for name, fate in CASES[args].items():
        r = got[name]
        assert r.fate == fate, (name, r.reason)
        if fate == Fate.AS_IS:  # proven: llama.cpp loaded it under the server's settings
            assert r.proven and r.load and r.load["ok"], r.reason
        elif fate in (Fate.EXACT, Fate.LOSSY):  # and llama.cpp's refusal of the file as it is
            assert r.load and not r.load["ok"] and "llama.cpp says" in r.reason
    if "kv-unified-per-slot 32" in args:
        assert "does not fit in the slot context" in str(got["llama_f16_fa"].reason)
    if "-np 1 -fa on" in args:
        assert "another model" in got["gemma3_iswa_fa"].reason
        assert "n_stream mismatch" in got["llama_2stream"].reason
        assert "incompatible V transposition" in got["llama_f16_nofa"].reason
        assert "mismatched key type" in got["llama_q8_0_fa"].reason


@pytest.mark.llama
def test_an_unreadable_file_is_an_error_not_a_verdict(tmp_path):
    server = parse_server_args(f"llama-server -m {LLAMA} -np 1")
    c = Checker(server, server.model)
    try:
        s, r = c.check(str(tmp_path / "gone.slot"), "gone.slot", 0, 0)
    finally:
        c.close()
    assert r is None and s.error and "No such file" in s.error


@pytest.mark.llama
@pytest.mark.parametrize("src", ["llama_2stream", "llama_f16_fa", "llama_draft_sdft", "llama_unified_2seq"])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_stream_rewrite_loads_with_that_many_streams(tmp_path, src, n):
    from slotfile.format.reader import open_slot_file
    from slotfile.llama.loader import LoaderPool
    from slotfile.llama.worker.settings import LoadSettings
    from slotfile.repair.streams import plan_streams
    from slotfile.safewrite import write_plan

    sf = open_slot_file(SLOTS / f"{src}.slot")
    out = tmp_path / "out.slot"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT, 0o644)
    write_plan(plan_streams(sf, n), fd)
    os.close(fd)
    o = open_slot_file(out)
    assert not o.errors and o.body is not None and o.body.blocks[0].n_stream == n
    assert len(o.checkpoints) == len(sf.checkpoints)
    # the K/V bytes of the saved stream are unchanged
    a = next(s for s in sf.body.blocks[0].streams if s.cell_count)  # type: ignore[union-attr]
    b = next(s for s in o.body.blocks[0].streams if s.cell_count)
    assert a.k[0].array().tobytes() == b.k[0].array().tobytes()
    with LoaderPool(str(LLAMA), str(MODELS / "draft.gguf")) as pool:
        ls = LoadSettings(n_ctx=256 * n, n_seq_max=n, kv_unified=n == 1, flash_attn=True, type_k=1, type_v=1)
        res = pool.load(str(out), ls)
        assert res.ok and all(ok for ok, _ in res.checkpoints), res.message
        if n != sf.body.blocks[0].n_stream:  # type: ignore[union-attr]
            assert not pool.load(str(SLOTS / f"{src}.slot"), ls).ok  # the original does not


def test_an_entry_keeps_its_root_once_and_its_path_is_the_walks(tmp_path: Path, monkeypatch):
    """A DirEntry holds the walked root (one string shared by the walk's entries) and its
    relative path; its path is what the walk opened (os.path.join of the folder and the
    name), however the root was given: relative, with "./" or a trailing slash, absolute."""
    (tmp_path / "s" / "sub").mkdir(parents=True)
    for rel in ("a.slot", "sub/b.slot"):
        (tmp_path / "s" / rel).write_bytes(b"GGSQ")
    monkeypatch.chdir(tmp_path)
    for top in ("s", "s/", "./s", str(tmp_path / "s"), str(tmp_path / "s") + "/"):
        scan = scan_dir(top, settle=0)
        got = {e.rel: e.path for e in scan.slots}
        want = {}
        for d, _dirs, names in os.walk(top):
            for n in names:
                want[os.path.relpath(os.path.join(d, n), top)] = os.path.join(d, n)
        assert got == want, top
        assert len({id(e.root) for e in scan.slots}) == 1 and scan.slots[0].root == top


def test_a_walk_holds_its_entries_as_columns(tmp_path: Path):
    """scan_dir keeps its slot files in an EntryList: the relative paths (the walk's strings),
    sizes and times in arrays, a DirEntry made when asked.  It reads as a sequence of entries
    (index, slice, iteration, +), sorts by a key of the relative path without making entries, refuses an
    entry of another root, and holds 5,000 files in well under the ~190 bytes a file that
    entry objects took."""
    import gc
    import tracemalloc

    from slotfile.slotdir.walk import DirEntry, EntryList

    for d in range(10):
        (tmp_path / f"d{d}").mkdir()
        for i in range(500):
            (tmp_path / f"d{d}" / f"slot-{i:05d}.bin").write_bytes(b"")
    (tmp_path / "d3" / "slot-00007.bin").write_bytes(b"GGSQ" * 3)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        scan = scan_dir(tmp_path, settle=0)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    slots = scan.slots
    assert isinstance(slots, EntryList) and len(slots) == 5000
    assert held / len(slots) < 120, f"{held / len(slots):.0f} B a file"
    walked = [
        os.path.relpath(os.path.join(d, n), tmp_path) for d, _s, ns in sorted(os.walk(tmp_path)) for n in sorted(ns)
    ]
    assert [e.rel for e in slots] == walked and slots[-1].rel == walked[-1]
    e = slots[1507]
    assert (e.rel, e.size, e.path) == ("d3/slot-00007.bin", 12, str(tmp_path / "d3" / "slot-00007.bin"))
    assert [x.rel for x in slots[10:13]] == walked[10:13] and isinstance(slots[10:13], EntryList)
    assert list(slots.sizes()) == [x.size for x in slots]
    both = slots + [DirEntry(str(tmp_path), "extra.bin", 1, 0.0)]  # noqa: RUF005 - EntryList.__add__
    assert len(both) == 5001 and both[-1].rel == "extra.bin"
    slots.sort_by_rel(lambda rel: rel.split("/")[1])  # by name: stable, so d0's file first
    assert [x.rel for x in slots[:2]] == ["d0/slot-00000.bin", "d1/slot-00000.bin"]
    with pytest.raises(ValueError, match="not this walk's root"):
        slots.append(DirEntry("/elsewhere", "x.bin", 1, 0.0))


def _tree(top: Path, folders: int, per: int) -> None:
    for d in range(folders):
        (top / f"d{d:03d}").mkdir(parents=True)
        for i in range(per):
            (top / f"d{d:03d}" / f"slot-{i:05d}.bin").write_bytes(b"")


def _peak(walk: Any) -> int:
    """The traced peak, in bytes above the start, of ``walk()``."""
    import gc
    import tracemalloc

    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        walk()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_a_walk_taken_as_it_goes_holds_no_file(tmp_path: Path):
    """walk_dir yields a store's files as it reaches them, in scan_dir's order, holding none
    (only the folder being walked's names): its peak memory is the same for 4,000 files as
    for 400, where scan_dir's (every file held) grows with them.  A file still being written
    holds the files after it until the wait; what settles takes its place in the order."""
    from slotfile.slotdir.walk import walk_dir

    small, big = tmp_path / "small", tmp_path / "big"
    _tree(small, 4, 100)
    _tree(big, 40, 100)

    def taken(top: Path) -> int:
        return sum(1 for _ in walk_dir(top, settle=0)[1])

    assert taken(small) == 400 and taken(big) == 4000
    flat = _peak(lambda: taken(big)) - _peak(lambda: taken(small))
    held = _peak(lambda: scan_dir(big, settle=0)) - _peak(lambda: scan_dir(small, settle=0))
    assert flat < 16 * 1024 < 200 * 1024 < held, (flat, held)
    scan, found = walk_dir(big, settle=0)
    assert [e.rel for e in found] == [e.rel for e in scan_dir(big, settle=0).slots]
    # one flat folder (a server's store): its names are held while it is walked, as their
    # characters (batches sorted and merged), not as ~70-byte string objects in a list
    _tree(tmp_path / "flat-small", 1, 800)
    _tree(tmp_path / "flat-big", 1, 8000)
    names = _peak(lambda: taken(tmp_path / "flat-big")) - _peak(lambda: taken(tmp_path / "flat-small"))
    assert names / 7200 < 32, f"{names / 7200:.0f} B a name"
    got = [e.rel for e in walk_dir(tmp_path / "flat-big", settle=0)[1]]
    assert got == sorted(got) and len(got) == 8000

    now = time.time()
    for rel, age in (("a.slot", DAY), ("b.slot", 0.0), ("c/x.slot", DAY), ("d.slot", DAY)):
        _put(tmp_path / "w", rel, "llama_f16_fa.slot", age, now)
    scan, found = walk_dir(tmp_path / "w", settle=0.3, settle_wait=10)
    assert next(found).rel == "a.slot" and not scan.busy  # yielded before the walk goes on
    assert [e.rel for e in found] == ["b.slot", "c/x.slot", "d.slot"] and scan.settled == 1 and scan.waited > 0


def test_ordered_map_takes_the_items_as_it_needs_them():
    """The items (each with its size) are taken a window ahead of the results: the first
    result comes with at most the head (PARALLEL_MIN, the workers' fork) and a window of
    chunks taken, on forked workers and in one process alike; every result in order."""
    from slotfile.slotdir import forked

    for jobs in (1, 2):
        taken: list[int] = []
        got = forked.ordered_map(_squares, _counted(2000, taken), jobs)
        first = next(got)
        assert first == 0 and len(taken) <= forked.PARALLEL_MIN + (forked.WINDOW + 1) * forked.CHUNK, (jobs, len(taken))
        assert [first, *got] == [i * i for i in range(2000)] and len(taken) == 2000


def _counted(n: int, taken: list[int]) -> Iterator[tuple[int, int]]:
    for i in range(n):
        taken.append(i)
        yield i, i % 7


def _squares(items: list[int]) -> list[int]:
    return [i * i for i in items]
