"""``verify --deep`` names damage that moves data (issue 25): two layers exchanged, a layer's K
and V exchanged, two cells' rows exchanged or one copied over another leave a stored block
nearer another recomputed block than its own (``decided_by: misplaced``), before any
difference is excused as drift.  Drift (rows scaled or noised in place) never does.

The unit tests judge damaged copies of the committed tiny Gemma 3 fixture against the fixture
itself (its recompute agrees bit for bit); the ``llama`` tests run the real worker, state v3
through the installed llama-cpp-python and v4 through the v4 library."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from slotfile.format.reader import parse_buffer
from slotfile.problems import ProblemCode
from slotfile.verify.judge import DeepInputs, judge_layers
from slotfile.verify.misplaced import MATCH, find_misplaced, sample
from slotfile.verify.shape import Schedule, judge_with_schedules

from .conftest import MODELS, SLOTS

GEMMA = SLOTS / "gemma3_iswa_nofa.slot"  # tiny Gemma 3 iSWA, f16, V transposed (flash attention off)
GEMMA_V4 = SLOTS / "v4" / "gemma3_iswa_fa.slot"  # the same model, state v4, V as rows


def _stream(data: bytes, role: str = "kv-base"):
    sf = parse_buffer(data)
    return next(b for b in sf.body.blocks if b.role == role).active_streams()[0]


def _swap(data: bytes, pieces: list[tuple[int, int, int]]) -> bytes:
    """The bytes at (offset a, offset b, length) exchanged, for each piece."""
    out = bytearray(data)
    for a, b, n in pieces:
        out[a : a + n], out[b : b + n] = data[b : b + n], data[a : a + n]
    return bytes(out)


def layer_swap(data: bytes, la: int = 0, lb: int = 1) -> bytes:
    """Layers ``la`` and ``lb`` of the global block exchanged, K and V."""
    st = _stream(data)
    return _swap(
        data,
        [(p[la].data.offset, p[lb].data.offset, p[la].n_cells * p[la].row_size) for p in (st.k, st.v)],
    )


def cell_swap(data: bytes, layer: int = 1, c1: int = 7, c2: int = 30) -> bytes:
    """Two cells' K rows of one layer of the global block exchanged."""
    k = _stream(data).k[layer]
    return _swap(data, [(k.data.offset + c1 * k.row_size, k.data.offset + c2 * k.row_size, k.row_size)])


def row_copy(data: bytes, layer: int = 1, src: int = 12, dst: int = 40) -> bytes:
    """One cell's K row copied over another's (the other keeps its own)."""
    k = _stream(data).k[layer]
    out = bytearray(data)
    a, b = k.data.offset + src * k.row_size, k.data.offset + dst * k.row_size
    out[b : b + k.row_size] = data[a : a + k.row_size]
    return bytes(out)


def kv_swap(data: bytes, layer: int = 1) -> bytes:
    """One layer's K and V exchanged (V transposed in this file: the same bytes, another order)."""
    st = _stream(data)
    k, v = st.k[layer], st.v[layer]
    assert k.n_cells * k.row_size == v.n_cells * v.row_size and v.transposed
    return _swap(data, [(k.data.offset, v.data.offset, k.n_cells * k.row_size)])


def noised(data: bytes, scale: float, seed: int = 25) -> bytes:
    """Every f16 K/V value of every layer moved in place: each value times (1 + scale * N(0,1)),
    the model-space drift of another build magnified far past its floors."""
    sf = parse_buffer(data)
    out = np.frombuffer(bytearray(data), np.uint8)
    rng = np.random.default_rng(seed)
    for blk in sf.body.blocks:
        st = blk.active_streams()[0]
        for run in (*st.k, *st.v):
            a = out[run.data.offset : run.data.offset + run.n_cells * run.row_size].view(np.float16)
            a[:] = (a * (1 + scale * rng.standard_normal(a.size))).astype(np.float16)
    return out.tobytes()


@pytest.fixture(scope="module")
def gemma_bytes() -> bytes:
    return GEMMA.read_bytes()


def _judge(damaged: bytes, clean: bytes):
    inputs = DeepInputs(n_tokens=54)
    return judge_with_schedules(
        parse_buffer(damaged).body, inputs, (Schedule(2048, 512), parse_buffer(clean).body), None
    )


# ------------------------------------------------------------------ without llama.cpp


@pytest.mark.parametrize(
    ("name", "kinds"),
    [
        ("gemma3_iswa_nofa.slot", {("f16", False), ("f16", True)}),
        ("v4/gemma3_iswa_fa.slot", {("f16", False)}),
        ("llama_q8_0_fa.slot", {("q8_0", False)}),
    ],
)
def test_a_whole_layer_is_sampled_as_the_spaced_sample_gathers_it(name, kinds):
    """A layer of at most SAMPLE values is read as its rows lie (no gather); it must give the
    values the gathering path gives, in the file's byte order, for V transposed and as rows,
    f16 and q8_0, with the recompute's cells in another order."""
    sf = parse_buffer((SLOTS / name).read_bytes())
    rng = np.random.default_rng(25)
    seen = set()
    for blk in sf.body.blocks:
        st = blk.active_streams()[0]
        for run in (*st.k, *st.v):
            size = run.n_cells * int(run.elements)
            align = rng.permutation(run.n_cells)
            for al in (None, align):
                whole = sample(run, np.arange(size), al)
                gathered = sample(run, np.arange(size - 1), al)  # one short: the gathering path
                assert whole.shape == (size,) and np.array_equal(whole[:-1], gathered), (run.part, run.index)
            seen.add((run.type_name, run.transposed))
    assert seen == kinds  # (type, V transposed) of the layers read


def test_layer_swap_matches_the_other_layer(gemma_bytes):
    out = _judge(layer_swap(gemma_bytes), gemma_bytes)
    assert out.decided_by == "misplaced" and not out.drift
    code, sec, off, msg = out.judgment.problems[0]
    st = _stream(gemma_bytes)
    assert code == ProblemCode.DEEP_MISMATCH and sec == "body.kv-base.stream[0]" and off == st.k[0].data.offset
    assert msg.startswith("K layer 0 (f16) matches the recompute of K layer 1 (distance 0 vs")
    assert msg.endswith("and the file's K layer 1 matches the recompute of K layer 0: layers exchanged")
    assert "(+3 more)" in out.evidence  # K and V of both layers


def test_kv_swap_matches_across_a_transposed_v(gemma_bytes):
    out = _judge(kv_swap(gemma_bytes), gemma_bytes)
    assert out.decided_by == "misplaced"
    msg = out.judgment.problems[0][3]
    assert msg.startswith("K layer 1 (f16) matches the recompute of V layer 1") and msg.endswith("K and V exchanged")


@pytest.mark.parametrize("damage", [cell_swap, row_copy])
def test_moved_rows_match_another_position(gemma_bytes, damage):
    out = _judge(damage(gemma_bytes), gemma_bytes)
    assert out.decided_by == "misplaced", out.evidence
    code, sec, off, msg = out.judgment.problems[0]
    assert code == ProblemCode.DEEP_MISMATCH and sec == "body.kv-base.stream[0]"
    k = _stream(gemma_bytes).k[1]
    if damage is cell_swap:
        assert msg.startswith("K layer 1 (f16): cell 7 (position 7) holds the row recomputed for position 30")
        assert off == k.data.offset + 7 * k.row_size and "2 cell(s)" in msg and msg.endswith("rows exchanged")
    else:
        assert msg.startswith("K layer 1 (f16): cell 40 (position 40) holds the row recomputed for position 12")
        assert off == k.data.offset + 40 * k.row_size and "1 cell(s)" in msg and msg.endswith("rows copied")


@pytest.mark.parametrize("scale", [0.05, 0.3, 1.0])
def test_drift_in_place_is_never_misplaced(gemma_bytes, scale):
    """Values moved in place (every layer, every cell, up to the size of the values themselves)
    fail their floors but stay nearest their own recompute: the rule stays silent."""
    damaged = noised(gemma_bytes, scale)
    j = judge_layers(parse_buffer(damaged).body, parse_buffer(gemma_bytes).body)
    assert j.problems  # far over the floors
    assert find_misplaced(parse_buffer(damaged).body, parse_buffer(gemma_bytes).body, j) == []
    assert _judge(damaged, gemma_bytes).decided_by != "misplaced"


def test_rows_moved_in_several_layers_are_not_named(gemma_bytes):
    """Two positions whose rows look exchanged in more than one layer: the shape of a drifting
    row tipped towards another position's recompute (two near-tied attention targets in a long
    repetitive prompt; seen on clean real-server files), which carries into every layer above.
    Moved bytes live in one layer: the cell rule names only those."""
    both = cell_swap(cell_swap(gemma_bytes, layer=1), layer=0)
    body, clean = parse_buffer(both).body, parse_buffer(gemma_bytes).body
    j = judge_layers(body, clean)
    assert len(j.problems) == 2 and find_misplaced(body, clean, j) == []
    assert _judge(both, gemma_bytes).decided_by != "misplaced"


@pytest.mark.parametrize("scale", [0.05, 0.1])
def test_cell_swap_among_drifting_layers_is_named(gemma_bytes, scale, monkeypatch):
    """Every layer over the limit at every position (a GPU-written file judged on a CPU: 6-104
    floors): no cell is confined by "no other layer differs there", yet the two swapped rows
    stand out of their layer (STAND_OUT) while the other layers' cells there do not stand out
    of theirs, so the move is still named.  Without that second reading it is not."""
    import slotfile.verify.misplaced as mp

    damaged = cell_swap(noised(gemma_bytes, scale))
    out = _judge(damaged, gemma_bytes)
    assert out.decided_by == "misplaced", out.evidence
    assert out.judgment.problems[0][3].startswith("K layer 1 (f16): cell 7 (position 7) holds the row recomputed")
    monkeypatch.setattr(mp, "_outstanding_by_position", lambda j: None)
    assert _judge(damaged, gemma_bytes).decided_by != "misplaced"


@pytest.mark.parametrize("scale", [0.05, 0.1])
def test_rows_moved_in_several_drifting_layers_are_not_named(gemma_bytes, scale):
    """The tipped-row shape of the test above, among drifting layers: the rows stand out at the
    same positions in two layers, so neither is confined to its layer."""
    both = cell_swap(cell_swap(noised(gemma_bytes, scale), layer=1), layer=0)
    body, clean = parse_buffer(both).body, parse_buffer(gemma_bytes).body
    assert find_misplaced(body, clean, judge_layers(body, clean)) == []


def test_kv_swap_among_noisy_layers_is_named(gemma_bytes, monkeypatch):
    """A layer's K and V exchanged where every value is also far from its recompute (noise of
    0.4 of each value: the stored V sits 0.37 of its norm from the recomputed V, a third of its
    distance to its own recompute, as a q4_0 layer of a CUDA-written file did): a whole layer
    matches from half its own distance (MATCH_LAYER), and the same noise alone matches nothing.
    At the cells' quarter it would pass."""
    import slotfile.verify.misplaced as mp

    clean = parse_buffer(gemma_bytes).body
    body = parse_buffer(kv_swap(noised(gemma_bytes, 0.4))).body
    j = judge_layers(body, clean)
    found = find_misplaced(body, clean, j)
    assert found and found[0][3].startswith("K layer 1 (f16) matches the recompute of V layer 1")
    noisy = parse_buffer(noised(gemma_bytes, 0.4)).body
    assert find_misplaced(noisy, clean, judge_layers(noisy, clean)) == []
    monkeypatch.setattr(mp, "MATCH_LAYER", MATCH)
    assert find_misplaced(body, clean, j) == []


def test_cell_swap_far_from_its_recompute_is_named_as_an_exchange(gemma_bytes, monkeypatch):
    """Two cells' rows exchanged where every value is also far from its recompute (noise of 0.3 of
    each value: the moved row sits 0.3 from the other cell's recompute, a quarter of its distance
    to its own, as a q4_0 K swap in another build's file sat at 0.27 and 0.32): two rows each
    nearer the other's recompute match from half their own distance (MATCH_EXCHANGE), and the same
    noise alone matches nothing.  At a quarter it would pass, and so it would if the rows were not
    each distinctly nearest the other's recompute (DISTINCT: a near-tie of several rows)."""
    import slotfile.verify.misplaced as mp

    clean = parse_buffer(gemma_bytes).body
    body = parse_buffer(cell_swap(noised(gemma_bytes, 0.3))).body
    j = judge_layers(body, clean)
    found = find_misplaced(body, clean, j)
    assert found and found[0][3].startswith(
        "K layer 1 (f16): cell 7 (position 7) holds the row recomputed for position 30"
    )
    assert found[0][3].endswith("rows exchanged")
    noisy = parse_buffer(noised(gemma_bytes, 0.3)).body
    assert find_misplaced(noisy, clean, judge_layers(noisy, clean)) == []
    monkeypatch.setattr(mp, "DISTINCT", 0.0)
    assert find_misplaced(body, clean, j) == []
    monkeypatch.setattr(mp, "DISTINCT", 0.7)
    monkeypatch.setattr(mp, "MATCH_EXCHANGE", MATCH)
    assert find_misplaced(body, clean, j) == []


def test_clean_file_has_nothing_misplaced(gemma_bytes):
    body = parse_buffer(gemma_bytes).body
    j = judge_layers(body, body)
    assert not j.problems and find_misplaced(body, body, j) == []
    # even with every layer taken as failing (limit -1), each block is nearest its own recompute
    assert find_misplaced(body, body, j, suspect=-1.0) == []
    assert MATCH < 1


# ------------------------------------------------------------------ the real worker


def _verify(v, tmp_path: Path, name: str, data: bytes) -> dict:
    p = tmp_path / name
    p.write_bytes(data)
    return v.verify(p).to_dict()


@pytest.fixture(scope="module")
def verifier():
    from slotfile.verify import Verifier, VerifyOptions

    with Verifier(VerifyOptions(model=str(MODELS / "gemma3.gguf"), deep=True)) as v:
        yield v


@pytest.mark.llama
def test_real_loader_names_moved_data(verifier, gemma_bytes, tmp_path):
    r = verifier.verify(GEMMA).to_dict()
    assert r["verdict"] == "pass" and r["levels"]["deep"]["details"]["decided_by"] == "statistics"
    for name, damage in (("layer", layer_swap), ("cell", cell_swap)):
        r = _verify(verifier, tmp_path, f"{name}.slot", damage(gemma_bytes))
        deep = r["levels"]["deep"]
        assert deep["status"] == "fail" and deep["details"]["decided_by"] == "misplaced", deep["details"]["evidence"]
        assert r["levels"]["load"]["status"] == "pass"
        assert deep["problems"][0]["code"] == "deep-mismatch"
        assert ("matches the recompute of K layer 1" if name == "layer" else "holds the row recomputed") in (
            deep["problems"][0]["message"]
        )


@pytest.mark.llama
@pytest.mark.slow
def test_real_v4_loader_names_moved_data(llama_v4_lib, tmp_path):
    from slotfile.verify import Verifier, VerifyOptions

    data = GEMMA_V4.read_bytes()
    opts = VerifyOptions(model=str(MODELS / "gemma3.gguf"), deep=True, llama_lib=str(llama_v4_lib))
    with Verifier(opts) as v:
        r = v.verify(GEMMA_V4).to_dict()
        assert r["verdict"] == "pass" and r["version"] == 4, r["first_problem"]
        for name, damage in (("layer", layer_swap), ("cell", cell_swap)):
            r = _verify(v, tmp_path, f"v4-{name}.slot", damage(data))
            deep = r["levels"]["deep"]
            assert deep["status"] == "fail" and deep["details"]["decided_by"] == "misplaced", deep["details"]


def test_repeat_ids_group_positions_by_their_last_tokens():
    """Positions share an id exactly when their last REPEAT tokens (the token and those before
    it) are the same; positions near the start count the missing tokens as none."""
    from slotfile.verify.misplaced import repeat_ids

    loop = [5, 6, 7]
    t = np.array([1, 2] + loop * 6 + [9])
    ids = repeat_ids(t, width=4)
    assert ids.shape == t.shape
    # 2+3k, 3+3k, 4+3k repeat once a whole window lies in the loop (from position 5 on)
    assert ids[5] == ids[8] == ids[11] == ids[14] == ids[17]
    assert ids[6] == ids[9] and ids[7] == ids[10]
    assert ids[2] != ids[5]  # its window reaches back to the tokens before the loop
    assert ids[19] == ids[16] and ids[20] != ids[17] and len(set(ids[:5].tolist())) == 5
    assert repeat_ids(np.zeros(0, dtype=np.int32)).size == 0


def test_rows_moved_between_repeats_of_a_looping_reply_are_not_named(gemma_bytes):
    """A drifting row nearer another position's recompute than its own, where both positions end
    the same run of tokens (a small model's reply looping at temperature 0: a -t 4 -fa on server's
    V row of position 2146 lay 0.07 from the recompute of 2153, one period on, and 0.17 from its
    own): the rows there come from near-equal contexts, so the move cannot be told from the drift.
    Given the tokens, the rule leaves such a pair alone; the same rows between positions that do
    not repeat are still named."""
    from slotfile.verify.misplaced import REPEAT

    clean = parse_buffer(gemma_bytes).body
    body = parse_buffer(cell_swap(noised(gemma_bytes, 0.3))).body  # cells 7 and 30 exchanged
    j = judge_layers(body, clean)
    n = max(int(s.positions.max()) for b in clean.blocks for s in b.active_streams()) + 1
    plain = np.arange(1000, 1000 + n)
    assert find_misplaced(body, clean, j, plain)  # no repeats: named, as without tokens
    looping = plain.copy()
    looping[30 - REPEAT + 1 : 31] = looping[7 - REPEAT + 1 : 8]  # 30 ends the same 8 tokens as 7
    assert find_misplaced(body, clean, j, looping) == []
    shorter = plain.copy()
    shorter[30 - REPEAT + 2 : 31] = shorter[7 - REPEAT + 2 : 8]  # one token fewer: not a repeat
    assert find_misplaced(body, clean, j, shorter)
