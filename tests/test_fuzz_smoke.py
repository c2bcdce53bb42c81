"""A short run of every fuzz harness (tests/fuzz/harnesses.py), so that a change that breaks
a harness, or an input the campaign already survived, fails here and not months later in
bench/fuzz_atheris.py: every seed and a fixed set of mutations of them, each within the time
bound and with a peak allocation bounded by its size; the findings of past campaigns
(tests/fuzz/regressions/) with what they must report."""

from __future__ import annotations

import importlib.util
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slotfile.format.reader import parse_buffer
from slotfile.problems import ProblemCode, Severity
from tests.fuzz.harnesses import HARNESSES, ContractError, traced_peak
from tests.fuzz.seeds import corpora
from tests.fuzzing import random_mutation

ROOT = Path(__file__).resolve().parent.parent
REGRESSIONS = ROOT / "tests" / "fuzz" / "regressions"
TIME_BOUND_S = 1.0
ALLOC_BASE, ALLOC_PER_BYTE = 4 << 20, 16  # as bench/fuzz_atheris.py
MUTATIONS = {
    "parse": 200,
    "dump_json": 100,
    "inspect": 30,
    "repair": 15,
    "gguf": 300,
    "appendix": 300,
    "slot": 40,
    "manifest": 300,
}
QUICK_SEEDS, QUICK_MUTATIONS = 3, 20

_CORPORA = corpora()


def _run_bounded(name: str, data: bytes, what: str, traced: bool = True) -> None:
    harness = HARNESSES[name]
    if not traced:
        t0 = time.perf_counter()
        harness(data)
        took = time.perf_counter() - t0
        assert took < TIME_BOUND_S, f"{name}: {what} took {took:.2f} s"
        return
    t0 = time.perf_counter()
    peak = traced_peak(harness, data)
    took = time.perf_counter() - t0
    assert took < TIME_BOUND_S * 3, f"{name}: {what} took {took:.2f} s (tracemalloc on)"
    bound = ALLOC_BASE + ALLOC_PER_BYTE * len(data)
    assert peak <= bound, f"{name}: {what}: peak allocation {peak} for a {len(data)}-byte input"


def _smoke(name: str, seeds: list[tuple[str, bytes]], n_mutations: int) -> None:
    assert seeds, f"{name}: no seeds"
    for seed, data in seeds:
        _run_bounded(name, data, f"seed {seed}")
    rng = random.Random(15)
    for i in range(n_mutations):
        seed, data = seeds[i % len(seeds)]
        how, mutated = random_mutation(data, rng) if data else ("empty", b"")
        _run_bounded(name, mutated, f"{seed} {how}", traced=i % 4 == 0)


@pytest.mark.parametrize("name", sorted(HARNESSES))
def test_harness_quick(name: str) -> None:
    """The smallest seeds and a few mutations: a harness the library no longer fits fails here."""
    seeds = sorted(_CORPORA[name].items(), key=lambda kv: (len(kv[1]), kv[0]))
    _smoke(name, seeds[:QUICK_SEEDS], QUICK_MUTATIONS)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(HARNESSES))
def test_harness_survives_its_seeds_and_mutations(name: str) -> None:
    _smoke(name, sorted(_CORPORA[name].items()), MUTATIONS[name])


def test_the_seeds_cover_every_version_and_appendix() -> None:
    slots = _CORPORA["parse"]
    kinds = set()
    for data in slots.values():
        sf = parse_buffer(data)
        assert not sf.errors, [p.line() for p in sf.errors]
        kinds.add((sf.format.value, sf.version))
        if sf.body is not None and sf.body.layout is not None and sf.body.layout.legacy:
            kinds.add(("legacy", sf.version))
        if sf.sckp is not None:
            kinds.add(("SCKP", None))
        if sf.draft is not None:
            kinds.add(("SDFT", None))
    for k in [("GGSQ", 2), ("GGSQ", 3), ("GGSQ", 4), ("GGSN", 9), ("GGSN", 10), ("GGSN", 11), ("legacy", 2)]:
        assert k in kinds, k
    assert ("SCKP", None) in kinds and ("SDFT", None) in kinds
    assert max(len(d) for d in slots.values()) <= 16384


def test_harness_flags_a_contract_violation() -> None:
    """The harness is not blind: a problem offset outside the file is caught."""
    from tests.fuzz import harnesses

    sf = parse_buffer(b"not a slot file at all")
    sf.problem(Severity.ERROR, ProblemCode.INVALID, "file", sf.size + 1, "made up")
    with pytest.raises(ContractError):
        harnesses.walk(sf)


# --- findings of the campaigns (bench/fuzz-campaign.md), each with what it must report ---------


def test_rec_block_of_zero_cells_with_a_huge_row_size() -> None:
    """Campaign finding 1: a REC block of 0 cells whose S row size (1.4e19) no byte backs;
    LayerRun.array() raised numpy's 'array is too big'.  Nothing in the bytes is wrong without
    the model, so the file reads clean and every run gives an empty array."""
    data = (REGRESSIONS / "rec-zero-cells-huge-row-size.slot").read_bytes()
    sf = parse_buffer(data)
    assert sf.verdict == "ok" and sf.body is not None
    (rec,) = [b for b in sf.body.blocks if b.kind == "REC"]
    assert rec.s[0].row_size > 2**63 and rec.cell_count == 0
    assert rec.s[0].array().size == 0
    for name in HARNESSES:
        HARNESSES[name](data)


def test_every_regression_input_passes_every_harness() -> None:
    files = sorted(REGRESSIONS.iterdir())
    assert files
    for p in files:
        for harness in HARNESSES.values():
            harness(p.read_bytes())


@pytest.mark.skipif(importlib.util.find_spec("atheris") is None, reason="atheris not installed")
def test_atheris_driver_runs(tmp_path: Path) -> None:
    """bench/fuzz_atheris.py's libFuzzer process itself: a few hundred instrumented runs of
    the appendix harness with no finding."""
    corpus, artifacts = tmp_path / "corpus", tmp_path / "artifacts"
    corpus.mkdir()
    artifacts.mkdir()
    for seed, data in _CORPORA["appendix"].items():
        (corpus / seed).write_bytes(data)
    cmd = [sys.executable, str(ROOT / "bench" / "fuzz_atheris.py"), "--worker", "appendix"]
    cmd += ["--corpus", str(corpus), "--artifacts", str(artifacts), "--", "-runs=300", "-seed=1", "-timeout=10"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Done 300 runs" in res.stderr
    assert not [p for p in artifacts.iterdir() if not p.name.startswith("slow-")]


def test_the_cell_console_catches_what_escape_text_would_have_escaped() -> None:
    """The slot harness checks inspect's cells instead of rich's output for most inputs: the
    check must see a control character in a title, a header or a cell, as Text or str."""
    from rich.table import Table
    from rich.text import Text

    from tests.fuzz.harnesses import _CellConsole

    con = _CellConsole()
    clean = Table(title="memory layers")
    clean.add_column("block")
    clean.add_row(Text("kv \\x1b"), "rows")
    con.print(clean, Text("slot.bin"), "plain")
    for bad in ("\x1b[31m", "\x07", "\u202e", "a\nb", "\x9b"):
        table = Table(title="sections")
        table.add_column("name")
        table.add_row(f"x{bad}")  # a str cell (rich's Text drops BEL, BS, VT, FF, CR itself)
        with pytest.raises(ContractError):
            con.print(table)
        with pytest.raises(ContractError):
            con.print(f"x{bad}")
