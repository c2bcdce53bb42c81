"""Cells a llama-server shifted (issue 25): a context shift (``--context-shift``: the server drops
half the tokens after ``n_keep`` and moves the rest back with ``llama_kv_cache::seq_add``) or a
reused chunk (``--cache-reuse``: a chunk of the cached prompt moved to where the new prompt has
it) leaves cells computed over tokens the file no longer holds.  No recompute of the stored
tokens gives them, so deep passes such a file with a ``deep-shifted`` warning when the
difference has that shape (slotfile.verify.shape.shifted_from), and still fails damage in it.

The files were written by the pinned llama-servers (bench/corpus.py configurations
f-llama-ctx-shift, f-deepseek2-ctx-shift and f-llama-cache-reuse-trim; the server's argv, build,
requests and save response are in the .json beside each)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from slotfile.format.reader import parse_buffer
from slotfile.format.records import Body
from slotfile.problems import ProblemCode
from slotfile.verify.judge import Judgment, RunCells
from slotfile.verify.shape import shifted_from

from .conftest import MODELS
from .test_spikes import _big_element, _run, flip_f16

REAL = Path(__file__).resolve().parent.parent / "fixtures" / "real"
CTX_SHIFT = REAL / "v4-ctx-shift-llama.bin"  # 209 cells: position 0 at cell 0, positions 1.. from cell 82
CTX_SHIFT_MLA = REAL / "v4-ctx-shift-deepseek2.bin"  # the same on an MLA cache (K only)
REUSE = REAL / "v3-cache-reuse-llama.bin"  # a v3 server's reused chunk: positions 1.. from cell 53


# ------------------------------------------------------------------ without llama.cpp


def _body(path: Path) -> Body:
    body = parse_buffer(path.read_bytes()).body
    assert body is not None
    return body


def _judgment(body: Body, ratios: dict[tuple[str, int], np.ndarray], problems: int = 1) -> Judgment:
    """A judgment of ``body``'s runs with per-position ratios (default 0), problems as its layers'."""
    j = Judgment()
    (blk,) = body.blocks
    st = blk.active_streams()[0]
    pos = st.positions
    for run in (*st.k, *st.v):
        by_pos = ratios.get((run.part, run.index), np.zeros(int(pos.max()) + 1))
        j.cells.append(RunCells(blk.role, run.part, run.index, pos, by_pos[pos]))
    j.problems = [(ProblemCode.DEEP_MISMATCH, "body.kv.stream[0]", 0, "x")] * problems
    return j


def _from(n: int, p: int, value: float) -> np.ndarray:
    out = np.zeros(n)
    out[p:] = value
    return out


def test_the_shifted_shape_needs_every_part_of_it():
    body = _body(CTX_SHIFT)
    n = 209
    both = {("K", 1): _from(n, 1, 100.0), ("V", 1): _from(n, 1, 120.0)}
    assert shifted_from(_judgment(body, both), body, "kv") == 1
    # one part of the layer: damage in its bytes
    assert shifted_from(_judgment(body, {("K", 1): _from(n, 1, 100.0)}), body, "kv") is None
    # the first layer differs: a changed token
    assert shifted_from(_judgment(body, {**both, ("V", 0): _from(n, 1, 6.0)}), body, "kv") is None
    # zeros or outliers in the bytes
    j = _judgment(body, both)
    j.byte_damage = ["V layer 1: a run of zeros"]
    assert shifted_from(j, body, "kv") is None
    # another error than a value's
    j = _judgment(body, both)
    j.problems.append((ProblemCode.DEEP_CELLS, "body", 0, "x"))
    assert shifted_from(j, body, "kv") is None
    # from position 0: nothing before it agrees (K/V or two layers swapped)
    assert shifted_from(_judgment(body, {("K", 1): _from(n, 0, 9.0), ("V", 1): _from(n, 0, 9.0)}), body, "kv") is None
    # an onset where the cells follow each other (positions 4 and 5 are cells 85 and 86) and the
    # first layer's K agrees exactly: nothing moved there
    late = {("K", 1): _from(n, 5, 100.0), ("V", 1): _from(n, 5, 120.0)}
    assert shifted_from(_judgment(body, late), body, "kv") is None
    # ... unless the first layer's K differs by rounding from there on and not before: a second
    # rotation of K (build_graph_shift) where the cells did not move in the file's order
    assert shifted_from(_judgment(body, {**late, ("K", 0): _from(n, 5, 0.3)}), body, "kv") == 5
    assert shifted_from(_judgment(body, {**late, ("K", 0): _from(n, 2, 0.3)}), body, "kv") is None


def test_the_fixtures_hold_what_their_servers_did():
    for f, flag in ((CTX_SHIFT, "--context-shift"), (CTX_SHIFT_MLA, "--context-shift"), (REUSE, "--cache-reuse")):
        side = json.loads(f.with_suffix(".json").read_text())
        assert flag in side["server_argv"] and side["save_response"]["n_saved"] > 0
        st = _body(f).blocks[0].active_streams()[0]
        # position 1 is not in the cell after position 0's: the server moved the cells holding it
        cells = {int(p): i for i, p in enumerate(st.positions)}
        assert cells[1] != cells[0] + 1, f.name


# ------------------------------------------------------------------ through the real loader


@pytest.mark.llama
def test_shifted_files_of_real_servers_pass_with_a_warning(llama_v4_lib):
    from slotfile.verify import Verifier, VerifyOptions
    from slotfile.verify.engine import unmet_requirements

    cases = [
        (CTX_SHIFT, "llama.gguf", str(llama_v4_lib)),
        (CTX_SHIFT_MLA, "extra-deepseek2.gguf", str(llama_v4_lib)),
        (REUSE, "llama.gguf", None),
    ]
    for f, model, lib in cases:
        with Verifier(VerifyOptions(model=str(MODELS / model), deep=True, llama_lib=lib)) as ver:
            rep = ver.verify(f)
        d = rep.levels["deep"]
        assert d.status == "pass", (f.name, [p.message for p in d.problems])
        # not fully checked, and said so: the summary's "not fully checkable", and --require deep fails it
        n = rep.n_tokens
        assert (
            rep.unchecked == [f"deep: body: {d.unchecked_parts[0]['reason']}"]
            and f"positions 1-{n - 1} " in rep.unchecked[0]
        )
        (unmet,) = unmet_requirements(rep, ("deep",))
        assert unmet["level"] == "deep" and unmet["reason"].startswith("body: positions 1-")
        assert d.details["decided_by"] == "shifted" and d.details["shifted"] == 1, f.name
        assert [p.code for p in d.problems] == [ProblemCode.DEEP_SHIFTED], f.name
        assert d.details["margin"] > 20  # far beyond any drift: the cells saw other tokens


@pytest.mark.llama
def test_damage_in_a_shifted_file_still_fails(llama_v4_lib, tmp_path: Path):
    from slotfile.verify import Verifier, VerifyOptions

    data = CTX_SHIFT.read_bytes()
    sf = parse_buffer(data)
    assert sf.tokens is not None
    k1, v1 = _run(data, "kv", "K", 1), _run(data, "kv", "V", 1)
    cell = 120  # a shifted cell (position 39)
    zeroed = bytearray(data)
    at = k1.data.offset + cell * k1.row_size
    zeroed[at : at + 512] = bytes(512)
    token = bytearray(data)
    t_at = sf.tokens.ids_offset + 4 * 40  # position 40's token, in the shifted part
    token[t_at : t_at + 4] = (int(sf.tokens.tokens[40]) ^ 1).to_bytes(4, "little")
    cases = {
        "zeroed 512 B of K layer 1": bytes(zeroed),
        "an exponent bit of V layer 1": flip_f16(data, v1, *_big_element(data, v1), 14)[0],
        "a changed token": bytes(token),
    }
    with Verifier(VerifyOptions(model=str(MODELS / "llama.gguf"), deep=True, llama_lib=str(llama_v4_lib))) as ver:
        for what, bad in cases.items():
            p = tmp_path / "damaged.bin"
            p.write_bytes(bad)
            d = ver.verify(p).levels["deep"]
            assert d.status == "fail", (what, d.details.get("decided_by"), d.details.get("evidence"))
            assert d.details["decided_by"] != "shifted", what
