"""The damage generator of the detection-power benchmark (bench/damage.py) and one damaged copy
through the real verify engine (bench/detect.py's path)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from bench import damage, detect_report
from slotfile.format.reader import open_slot_file

from .conftest import MODELS, SLOTS

GEMMA = SLOTS / "gemma3_iswa_fa.slot"  # f16, iSWA (kv-base + kv-swa), 2 checkpoints
Q8 = SLOTS / "llama_q8_0_fa.slot"  # q8_0 K/V, 1 checkpoint
NOFA = SLOTS / "v4" / "gemma3_iswa_nofa.slot"  # transposed V, state v4


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.mark.parametrize("src", [GEMMA, Q8, NOFA])
def test_deterministic_per_seed(src: Path) -> None:
    a, na_a = damage.generate(src, 7)
    b, na_b = damage.generate(src, 7)
    c, _ = damage.generate(src, 8)
    assert [(x.kind, x.size, x.edits, x.where) for x in a] == [(x.kind, x.size, x.edits, x.where) for x in b]
    assert na_a == na_b
    assert [x.edits for x in a] != [x.edits for x in c]  # another seed, other damage


def test_same_name_in_another_folder_gets_other_damage(tmp_path: Path) -> None:
    """v3-native/x.bin and v4-native/x.bin hold the same rows at the same offsets: they must not draw
    the same damage (the seed's key holds the folder)."""
    for d in ("v3-native", "v4-native"):
        (tmp_path / d).mkdir()
        shutil.copyfile(GEMMA, tmp_path / d / "x.bin")
    a, _ = damage.generate(tmp_path / "v3-native" / "x.bin", 25)
    b, _ = damage.generate(tmp_path / "v4-native" / "x.bin", 25)
    assert [c.edits for c in a] != [c.edits for c in b]


def test_selection_spreads_over_strata() -> None:
    """Gemma and fixture-model strata alternate, each giving its smallest file first; files over the
    token limit are left out."""
    from bench import detect

    def src(name: str, model: str, types: str, n: int) -> detect.Source:
        return detect.Source(Path(name), model, 3, "corpus", n, ("v3", model, types, "V rows", "kv"))

    pool = [
        src("g-big", "gemma-3-270m", "f16", 150),
        src("g-small", "gemma-3-270m", "f16", 38),
        src("g-q4", "gemma-3-270m", "q4_0", 38),
        src("g-huge", "gemma-3-270m", "q8_0", 2048),
        src("f-llama", "llama", "f16", 47),
        src("f-mamba", "extra-mamba", "f32", 47),
    ]
    got = [s.path.name for s in detect.select(pool, 5, max_tokens=200)]
    assert got == ["g-small", "f-mamba", "g-q4", "f-llama", "g-big"]


def _inside(off: int, n: int, ranges: list[tuple[int, int]]) -> bool:
    return any(lo <= off and off + n <= lo + ln for lo, ln in ranges)


@pytest.mark.parametrize("src", [GEMMA, Q8, NOFA])
def test_edits_stay_inside_their_data(src: Path) -> None:
    """Body damage inside the body's K/V rows, checkpoint damage inside the checkpoints' rows, a
    token change inside the token ids: never a header, a cell table or a length field."""
    sf = open_slot_file(src)
    body = [(t.offset, t.length) for t in damage.body_targets(sf)]
    ckpt = [(t.offset, t.length) for t in damage.checkpoint_targets(sf)]
    assert sf.tokens is not None
    ids = [(sf.tokens.ids_offset, 4 * int(sf.tokens.tokens.size))]
    sf.close()
    cases, _ = damage.generate(src, 3, per_kind=3)
    for case in cases:
        allowed = ckpt if case.kind.startswith("ckpt-") else ids if case.kind == "token" else body
        for off, n in case.ranges():
            assert _inside(off, n, allowed), (case.kind, case.size, off, n)
        if case.kind.endswith("span"):
            assert sum(len(b) for _o, b in case.edits) == int(case.size)


def test_every_kind_is_produced() -> None:
    """Every kind and size on these fixtures, except 64 KiB spans (the fixtures hold less row data:
    said as the reason) and flip-quant on float caches."""
    made: set[tuple[str, str]] = set()
    for src in (GEMMA, Q8, NOFA):
        cases, na = damage.generate(src, 1)
        made |= {(c.kind, c.size) for c in cases}
        for x in na:
            if x["size"] == "65536":
                assert "< 65536 B" in x["why"]
    wanted = {(k, s) for k, sizes in damage.KINDS.items() for s in sizes if s != "65536"}
    assert wanted <= made, wanted - made


def test_span_of_64k_crosses_runs_in_file_order() -> None:
    """A span longer than one layer's rows continues in the next layer's rows, skipping the header."""
    ts = [damage.Target("body", "kv", 0, "K", i, 1, 512, 40, False, 1000 + i * 30000, 20480) for i in range(4)]
    pieces = damage._span_pieces(ts, 10000, 65536)
    assert sum(n for _t, _o, n in pieces) == 65536
    assert [t.layer for t, _o, _n in pieces] == [0, 1, 2, 3]
    for t, off, n in pieces:
        assert t.offset <= off and off + n <= t.offset + t.length


def test_write_damaged_never_touches_the_source(tmp_path: Path) -> None:
    src = tmp_path / "src.slot"
    shutil.copyfile(GEMMA, src)
    before = _sha(src)
    cases, _ = damage.generate(src, 5)
    for case in cases:
        out = damage.write_damaged(case, src.parent)  # even into the source's own folder
        assert out != src and out.parent == src.parent
        assert _sha(src) == before
        got, orig = out.read_bytes(), src.read_bytes()
        assert len(got) == len(orig) and got != orig
        for off, data in case.edits:
            assert got[off : off + len(data)] == data
        out.unlink()


@pytest.mark.llama
def test_zeroed_4k_span_is_detected_by_deep(tmp_path: Path) -> None:
    """One damaged copy through the real loader and judge: 4 KiB of zeros in the rows fails --deep,
    while the clean file passes."""
    from bench import detect
    from slotfile.verify import Verifier, VerifyOptions

    cases, _ = damage.generate(GEMMA, 25, kinds=["zero-span"])
    case = next(c for c in cases if c.size == "4096")
    out = damage.write_damaged(case, tmp_path)
    with Verifier(VerifyOptions(model=str(MODELS / "gemma3.gguf"), deep=True)) as v:
        clean = detect.outcome(v.verify(GEMMA))
        hit = detect.outcome(v.verify(out))
    assert clean["verdict"] == "pass" and clean["deep"] == "pass"
    assert hit["verdict"] == "fail" and "deep" in hit["failed_levels"]
    assert hit["margin"] > 4


def test_report_counts_detections() -> None:
    rec = {
        "file": "f.slot",
        "origin": "fixture",
        "model": "m.gguf",
        "version": 3,
        "clean": {"verdict": "pass", "deep": "pass", "margin": 0.5, "first_problem": None, "logits_rel": 0.01},
        "not_applicable": [],
        "cases": [
            {
                "file": "f.slot",
                "kind": "zero-span",
                "size": "512",
                "verdict": "fail",
                "margin": 50.0,
                "region": "body",
                "type": "f16",
            },
            {
                "file": "f.slot",
                "kind": "zero-span",
                "size": "512",
                "verdict": "pass",
                "margin": 1.0,
                "logits_rel": 0.02,
                "region": "body",
            },
        ],
    }
    meta = {"date": "d", "commit": "c", "seed": 1, "cases_per_kind": 1, "seconds": 60}
    md = detect_report.markdown(meta, [rec])
    assert "| zero-span | 512 B | 1/2 (50%) |" in md
    assert "every span >= 512 B: 1/2 (50%) **not met**" in md
