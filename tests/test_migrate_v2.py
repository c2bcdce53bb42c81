"""slotfile migrate between state versions 2, 3 and 4 (session 9, 10, 11): against the files a real
version-2 libllama wrote (fixtures/slots/v2, fixtures/make_v2_fixtures.py), the version-3 fixtures and
the ones a real version-4 libllama wrote for the same recipes; and test-loads through real libraries
of the target version."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from slotfile.format.reader import open_slot_file
from slotfile.repair import Outcome, RepairOptions, run
from slotfile.safewrite import resolve_target

from .conftest import FIXTURES, SLOT_FILES, SLOTS, slotfile_cli
from .test_migrate import V3_MODELS, _structure_mask
from .test_v4 import V4, V4_FILES

V2 = SLOTS / "v2"
V2_MANIFEST = json.loads((V2 / "manifest.json").read_text())
V2_EXTRA = json.loads((V2 / "extra-manifest.json").read_text())
# (file, model, draft model) of every version-2 fixture
V2_FILES: list[tuple[Path, Path, Path | None]] = [
    (FIXTURES / e["file"], FIXTURES / e["model"], FIXTURES / e["draft_model"] if e["draft_model"] else None)
    for e in V2_MANIFEST["slots"]
] + [(FIXTURES / e["file"], FIXTURES / e["model"], None) for e in V2_EXTRA["files"]]
IDS = [p.name for p, _, _ in V2_FILES]
QWEN = FIXTURES / "models" / "extra-qwen2vl.gguf"


def _migrate(
    src: Path, out: Path, to: int, model: Path | None = None, draft: Path | None = None, lib: Path | None = None
) -> Any:
    opts = RepairOptions(
        model=str(model) if model else None,
        draft_model=str(draft) if draft else None,
        to_version=to,
        llama_lib=str(lib) if lib else None,
    )
    return run("migrate", str(src), resolve_target(src, out), opts)


def test_every_memory_kind_the_v2_library_has_is_covered():
    assert {e["state_version"] for e in V2_MANIFEST["slots"]} == {2}
    assert V2_EXTRA["state_seq_version"] == 2 and V2_EXTRA["session_version"] == 9
    kinds = {e["memory"] for e in V2_EXTRA["files"]}
    assert kinds >= {"recurrent", "hybrid"}
    assert any("gemma3" in e["file"] for e in V2_MANIFEST["slots"])  # iSWA: the SWA cache
    assert any(e["arch"] == "qwen2vl" for e in V2_EXTRA["files"])  # M-RoPE: the 8-byte cell ext
    assert any(e["arch"] == "deepseek2" for e in V2_EXTRA["files"])  # MLA
    assert any(e["kind"] == "session" for e in V2_EXTRA["files"])  # GGSN 9
    for p, _, _ in V2_FILES:
        sf = open_slot_file(p)
        assert sf.errors == [], (p.name, sf.errors[:1])
        assert sf.version == (9 if p.suffix == ".session" else 2)


def test_the_v2_m_rope_cell_ext_has_no_tok():
    sf = open_slot_file(V2 / "extra-qwen2vl.slot")
    assert sf.body is not None and sf.body.layout is not None and sf.body.layout.ext == 8
    v3 = open_slot_file(SLOTS / "extra-qwen2vl.slot")
    assert v3.body is not None and v3.body.layout is not None and v3.body.layout.ext == 12


@pytest.mark.parametrize(("path", "model", "draft"), V2_FILES, ids=IDS)
def test_v2_to_v4_to_v2_is_byte_identical(tmp_path: Path, path: Path, model: Path, draft: Path | None):
    v4, back = tmp_path / "v4", tmp_path / "v2"
    up = _migrate(path, v4, 4, model, draft)
    assert up.outcome == Outcome.REPAIRED, up.reason
    sf = open_slot_file(v4)
    assert sf.version in (4, 11) and sf.errors == [] and sf.body is not None and sf.body.layout.rot
    assert up.checked[:2] == ["structure", "model"]
    down = _migrate(v4, back, 2, model, draft)
    assert down.outcome == Outcome.REPAIRED, down.reason
    assert back.read_bytes() == path.read_bytes()


@pytest.mark.parametrize(("path", "model", "draft"), V2_FILES, ids=IDS)
def test_migrated_v2_fixture_matches_what_the_v3_and_v4_libraries_wrote(
    tmp_path: Path, path: Path, model: Path, draft: Path | None
):
    """The same recipe through the v2 and the v4 (and v3) library, the v2 file migrated: every byte
    that is not a cached value is identical (cell tables with their tok, rotation words, blob
    lengths, the session's arch and layout), the values agree to the float rounding of the builds."""
    for to, want_path in ((4, V4 / path.name), (3, (V4 / "v3" if "llama128" in path.name else SLOTS) / path.name)):
        out = tmp_path / f"m{to}"
        rep = _migrate(path, out, to, model, draft)
        assert rep.outcome == Outcome.REPAIRED, rep.reason
        want = open_slot_file(want_path)
        a, b = np.frombuffer(out.read_bytes(), np.uint8), np.frombuffer(want_path.read_bytes(), np.uint8)
        assert a.size == b.size, (to, want_path)
        mask, runs = _structure_mask(want)
        assert (a[mask] == b[mask]).all(), f"v{to}: structure differs at {np.flatnonzero(mask & (a != b))[:8]}"
        got_runs = _structure_mask(open_slot_file(out))[1]
        for (r, name), (r2, _) in zip(runs, got_runs, strict=True):
            assert (r.offset, r.type_id, r.data.length) == (r2.offset, r2.type_id, r2.data.length), name


@pytest.mark.parametrize(("path", "model", "draft"), V2_FILES, ids=IDS)
def test_migrated_v2_fixture_is_the_v4_librarys_file(tmp_path: Path, path: Path, model: Path, draft: Path | None):
    """v2 -> 4 gives, byte for byte, the file the real v4 library wrote for the same recipe (both
    builds portable, GGML_NATIVE=OFF), rotated q8_0 caches and M-RoPE cell tables included.  The
    mamba and jamba recipes differ only inside their values: the recurrent kernels changed between
    the two llama.cpp versions."""
    out = tmp_path / "m4"
    assert _migrate(path, out, 4, model, draft).outcome == Outcome.REPAIRED
    got, want = out.read_bytes(), (V4 / path.name).read_bytes()
    if "mamba" in path.name or ("jamba" in path.name and "empty" not in path.name):
        mask, _ = _structure_mask(open_slot_file(V4 / path.name))
        a, b = np.frombuffer(got, np.uint8), np.frombuffer(want, np.uint8)
        assert a.size == b.size and (a[mask] == b[mask]).all()
    else:
        assert got == want


def test_v3_and_v4_fixtures_go_to_v2_and_back(tmp_path: Path):
    """Every v3 fixture and every real-v4 one goes down to version 2 and back byte for byte (text
    only: each M-RoPE tok is the token at its position)."""
    for src in [*SLOT_FILES, *(p for p, _, _ in V4_FILES)]:
        model, draft = V3_MODELS.get(src.name, (None, None))
        if src.parent == V4:
            model, draft = next((m, d) for p, m, d in V4_FILES if p == src)
        v2, back = tmp_path / f"{src.parent.name}-{src.name}.v2", tmp_path / f"{src.parent.name}-{src.name}.back"
        down = _migrate(src, v2, 2, model, draft)
        assert down.outcome == Outcome.REPAIRED, (src, down.reason)
        assert open_slot_file(v2).version in (2, 9)
        to = open_slot_file(src).version
        up = _migrate(v2, back, to, model, draft)
        assert up.outcome == Outcome.REPAIRED, (src, up.reason)
        assert back.read_bytes() == src.read_bytes(), src


def _set_tok(path: Path, out: Path, cell: int, tok: int) -> int:
    sf = open_slot_file(path)
    st = sf.body.blocks[0].streams[0]
    at = st.cells.offset + cell * st.cells.cells.dtype.itemsize + 16  # pos, n_seq_id, x, y, tok
    data = bytearray(path.read_bytes())
    struct.pack_into("<i", data, at, tok)
    out.write_bytes(bytes(data))
    return st.cells.offset


def test_a_tok_version_2_cannot_record_is_refused(tmp_path: Path):
    """An image cell's tok (LLAMA_TOKEN_NULL) is not the token at its position: 3 -> 2 would lose it."""
    bad = tmp_path / "img.slot"
    table = _set_tok(SLOTS / "extra-qwen2vl.slot", bad, 3, -1)
    rep = _migrate(bad, tmp_path / "v2", 2, QWEN)
    assert rep.outcome == Outcome.REFUSED and "cell ext.tok" in rep.reason and f"offset {table}" in rep.reason
    assert "\n" not in rep.reason and not (tmp_path / "v2").exists()


def test_v2_m_rope_with_media_is_refused(tmp_path: Path):
    """2 -> 3 fills each tok from the token list; a payload with media cannot say it."""
    src = V2 / "extra-qwen2vl.slot"
    sf = open_slot_file(src)
    n = sf.n_token_count or 0
    data = bytearray(src.read_bytes())
    words = np.frombuffer(bytes(data[12 : 12 + 4 * n]), "<i4").copy()
    assert words[0] == -1  # packed: marker, version, T, tokens..., media count
    words[3 + 2] = -1  # a non-text entry in the token list
    data[12 : 12 + 4 * n] = words.tobytes()
    bad = tmp_path / "media.slot"
    bad.write_bytes(bytes(data))
    rep = _migrate(bad, tmp_path / "v3", 3)  # (with the model its check refuses the -1 first)
    assert rep.outcome == Outcome.REFUSED and "cell ext.tok" in rep.reason, rep.reason


def test_session_9_10_11(tmp_path: Path):
    src = V2 / "extra-jamba.session"
    for to, want in ((10, SLOTS / "extra-jamba.session"), (11, V4 / "extra-jamba.session"), (3, None)):
        rep = _migrate(src, tmp_path / f"s{to}", to)
        assert rep.outcome == Outcome.REPAIRED, rep.reason
        if want is not None:
            assert (tmp_path / f"s{to}").stat().st_size == want.stat().st_size
    assert open_slot_file(tmp_path / "s3").version == 10
    assert _migrate(src, tmp_path / "bad", 12).outcome == Outcome.REFUSED


def test_cli_migrate_to_2(tmp_path: Path):
    out = tmp_path / "v2.slot"
    r = slotfile_cli("migrate", V4 / "llama_f16_fa.slot", "-o", out, "--to", "2")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert "header: version 4 -> 2" in r.stdout
    assert open_slot_file(out).version == 2


# ---------------------------------------------------------------------------------------
# test-loads through real libraries of the target version


@pytest.mark.llama
@pytest.mark.slow
def test_v4_files_migrated_to_2_load_in_the_v2_library(tmp_path: Path, llama_v2_lib: Path):
    """What was proven: the real v2 llama.cpp loads migrate's version-2 output (and its checkpoints)."""
    picks = [f for f in V4_FILES if f[0].name in ("llama_f16_fa.slot", "gemma3_iswa_nofa.slot", "extra-jamba.slot")]
    picks += [f for f in V4_FILES if f[0].name in ("extra-qwen2vl.slot", "extra-lfm2.session")]
    assert len(picks) == 5
    for path, model, draft in picks:
        out = tmp_path / f"{path.name}.v2"
        rep = _migrate(path, out, 2, model, draft, lib=llama_v2_lib)
        assert rep.outcome == Outcome.REPAIRED, (path.name, rep.reason, rep.test_load)
        assert rep.test_load is not None and rep.test_load["ok"] is True, (path.name, rep.test_load)
        assert rep.test_load["state_seq_version"] == 2
        assert "test-load" in rep.to_json()["checked"]


@pytest.mark.llama
@pytest.mark.slow
def test_v2_files_migrated_to_4_load_in_the_v4_library(tmp_path: Path, llama_v4_lib: Path):
    picks = [f for f in V2_FILES if f[0].name in ("llama_q8_0_fa.slot", "extra-qwen2vl.slot", "extra-llama.session")]
    assert len(picks) == 3
    for path, model, draft in picks:
        out = tmp_path / f"{path.name}.v4"
        rep = _migrate(path, out, 4, model, draft, lib=llama_v4_lib)
        assert rep.outcome == Outcome.REPAIRED, (path.name, rep.reason, rep.test_load)
        assert rep.test_load is not None and rep.test_load["ok"] is True, (path.name, rep.test_load)


@pytest.mark.llama
def test_the_v2_library_loads_its_own_fixture(llama_v2_lib: Path):
    """The worker drives the older library (abi.py): it loads a v2 file and says it writes version 2."""
    from slotfile.llama.loader import LoaderPool, settings_for

    path, model, _ = next(f for f in V2_FILES if f[0].name == "llama_f16_nofa.slot")
    with LoaderPool(str(model), threads=1, llama_lib=str(llama_v2_lib)) as pool:
        assert pool.state_seq_version == 2 and pool.info.get("session_version") == 9
        sf = open_slot_file(path)
        res = pool.load(str(path), settings_for(sf), sf=sf)
        assert res.ok, res.message


@pytest.mark.llama
@pytest.mark.slow
def test_regenerated_v2_fixtures_match(tmp_path: Path, llama_v2_lib: Path):
    """fixtures/make_v2_fixtures.py over the v2 library writes the committed files again: byte for
    byte where the library reports the same CPU features, else the same structure with values equal
    to float rounding (tests/test_fixtures.py's rule)."""
    import shutil
    import subprocess
    import sys

    from .test_fixtures import _value_mismatch

    shutil.copytree(FIXTURES / "models", tmp_path / "models")
    subprocess.run(
        [sys.executable, str(FIXTURES / "make_v2_fixtures.py"), "--lib", str(llama_v2_lib), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    out = tmp_path / "slots" / "v2"
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(p.name for p in V2.iterdir())
    strict = (out / "generated-on.txt").read_text() == (V2 / "generated-on.txt").read_text()
    for n in names:
        got, want = (out / n).read_bytes(), (V2 / n).read_bytes()
        if got == want:
            continue
        assert not strict and n.endswith((".slot", ".session")), f"{n} differs from the committed fixture"
        assert _value_mismatch(V2 / n, got) is None, n


@pytest.mark.llama
def test_a_found_v2_library_test_loads_without_llama_lib(
    tmp_path: Path, llama_v2_lib: Path, monkeypatch: pytest.MonkeyPatch
):
    """Without --llama-lib, migrate --to 2 finds the v2 build (SLOTFILE_LLAMA_V2 or the build cache)."""
    monkeypatch.setenv("SLOTFILE_LLAMA_V2", str(llama_v2_lib))
    monkeypatch.delenv("SLOTFILE_LLAMA_LIB", raising=False)
    path, model, _ = next(f for f in V4_FILES if f[0].name == "llama_f16_nofa.slot")
    rep = _migrate(path, tmp_path / "v2", 2, model)
    assert rep.outcome == Outcome.REPAIRED, rep.reason
    assert rep.test_load is not None and rep.test_load["ok"] is True, rep.test_load
    assert rep.test_load["state_seq_version"] == 2 and "test-load" in rep.to_json()["checked"]


def test_what_version_2_cannot_hold_is_refused_naming_it():
    """Memory classes new in version 3 and PLE's recurrent P rows (no fixture of either exists: the
    refusals are checked on the records the reader would produce)."""
    from types import SimpleNamespace as NS

    from slotfile.format.records import MemoryKind
    from slotfile.repair.common import Refused
    from slotfile.repair.migrate_versions import v2_refusal

    def sf(cls: str, blocks: list[Any]) -> Any:
        body = NS(memory_class=cls, layout=NS(legacy=False), blocks=blocks)
        return NS(body=body, checkpoints=[], draft=None)

    for cls, name in (("hybrid-idx", "llama_memory_hybrid_idx"), ("dsa-iswa", "llama_kv_cache_dsa_iswa")):
        with pytest.raises(Refused, match=name):
            v2_refusal(sf(cls, []))
    rec = NS(kind=MemoryKind.REC, role="rec", p=[NS(offset=1234)])
    with pytest.raises(Refused, match="offset 1234: recurrent P rows"):
        v2_refusal(sf("hybrid", [rec]))
    v2_refusal(sf("hybrid", [NS(kind=MemoryKind.REC, role="rec", p=[])]))  # no P rows: fine


def test_the_pre_2025_layout_is_refused(tmp_path: Path):
    """A version-2 body without n_stream (llama.cpp before mid-2025) is read, but no conversion."""
    from .test_versions import _legacy_body, _with_version

    src = open_slot_file(SLOTS / "llama_f16_fa.slot")
    data = (SLOTS / "llama_f16_fa.slot").read_bytes()
    legacy = tmp_path / "old.slot"
    legacy.write_bytes(_with_version(data[: src.body.offset] + _legacy_body(src, data) + data[src.body.end :], 2))
    for to in (3, 4):
        rep = _migrate(legacy, tmp_path / f"v{to}", to)
        assert rep.outcome == Outcome.REFUSED and "without n_stream" in rep.reason, rep.reason
