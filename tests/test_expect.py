"""slotfile.model.expect: the model's expectation agrees with every real fixture, and catches
deliberately wrong pairings by layer and row size."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest

from slotfile.format.reader import open_slot_file
from slotfile.format.records import SlotFile
from slotfile.model.bridge import ModelInfo, load_model_info
from slotfile.model.compare import compare
from slotfile.model.expect import CacheExpect, ModelExpect, RecExpect, expect_from_model, layout_of

from .conftest import EXTRA, FIXTURES, MANIFEST

# (slot file, target model, draft model or None) for every fixture file
PAIRS: list[tuple[str, str, str | None]] = [
    (e["file"], e["model"], e.get("draft_model")) for e in MANIFEST["slots"]
] + [(e["file"], e["model"], None) for e in EXTRA["files"]]


@cache
def _exp(model: str) -> ModelExpect:
    return expect_from_model(load_model_info(FIXTURES / model))


@cache
def _sf(name: str) -> SlotFile:
    return open_slot_file(FIXTURES / name)


def _ids(p: tuple[str, str, str | None]) -> str:
    return p[0].split("/")[-1]


# --------------------------------------------------------------------------- the fixture models


def _model_facts() -> list[tuple[str, dict[str, Any]]]:
    out = list(MANIFEST["models"].items()) + list(EXTRA["models"].items())
    return out


@pytest.mark.parametrize("model,facts", _model_facts(), ids=lambda x: x if isinstance(x, str) else "")
def test_model_expectation_matches_manifest(model: str, facts: dict[str, Any]) -> None:
    exp = _exp(model)
    assert exp.arch == facts["arch"]
    assert exp.n_vocab == facts["n_vocab"]
    assert exp.n_layer == facts["n_layer"]
    assert exp.n_ctx_train == 256
    kv = [b for b in exp.blocks if isinstance(b, CacheExpect)]
    rec = [b for b in exp.blocks if isinstance(b, RecExpect)]
    if "swa_layers" in facts:  # manifest.json
        swa = facts["swa_layers"]
        if swa:
            assert exp.memory_class == "iswa"
            assert [b.role for b in kv] == ["kv-base", "kv-swa"]
            assert list(kv[1].layers) == swa
            assert sorted(kv[0].layers + kv[1].layers) == list(range(facts["n_layer"]))
        else:
            assert exp.memory_class == "kv-cache"
            assert list(kv[0].layers) == list(range(facts["n_layer"]))
        for b in kv:
            assert set(b.n_embd_k) == set(b.n_embd_v) == {facts["n_embd_k_gqa"]}
        assert exp.cell_ext == 0
        return
    memory = {"kv": "kv-cache", "recurrent": "recurrent", "hybrid": "hybrid"}[facts["memory"]]
    assert exp.memory_class == memory
    assert [list(b.layers) for b in kv] == ([facts["attn_layers"]] if facts["attn_layers"] else [])
    if kv:
        assert set(kv[0].n_embd_k) == {facts["n_embd_k_gqa"]}
        if facts.get("kv_has_v", True):
            assert set(kv[0].n_embd_v) == {facts["n_embd_v_gqa"]}
        else:  # MLA: the cache holds K only
            assert kv[0].n_embd_v == () and not kv[0].has_v
        assert exp.cell_ext == facts["cell_ext"]
    if facts["recr_layers"]:
        assert len(rec) == 1
        assert list(rec[0].layers) == facts["recr_layers"]
        assert rec[0].n_layer_field == facts["n_layer"]
        assert (rec[0].n_embd_r, rec[0].n_embd_s) == (facts["n_embd_r"], facts["n_embd_s"])
    else:
        assert rec == []


# --------------------------------------------------------------------------- right pairings


@pytest.mark.parametrize("pair", PAIRS, ids=_ids)
def test_slot_body_agrees_with_its_model(pair: tuple[str, str, str | None]) -> None:
    name, model, _ = pair
    sf = _sf(name)
    exp = _exp(model)
    assert sf.body is not None and sf.body.layout is not None
    assert compare(exp, sf.body) == []
    got, want = sf.body.layout, layout_of(exp)
    assert got.kinds == want.kinds
    assert [b.has_v for b in got.blocks] == [b.has_v for b in want.blocks]
    assert [b.n_rec for b in got.blocks] == [b.n_rec for b in want.blocks]
    assert got.ext == want.ext
    assert got == want


@pytest.mark.parametrize("pair", PAIRS, ids=_ids)
def test_checkpoint_blobs_agree_with_their_models(pair: tuple[str, str, str | None]) -> None:
    name, model, draft = pair
    sf = _sf(name)
    exp = _exp(model)
    for ck in sf.checkpoints:
        body = ck.tgt.body
        assert body is not None and body.layout is not None
        assert compare(exp, body, partial=True) == [], f"checkpoint {ck.index} data_tgt"
        assert body.layout == layout_of(exp, partial=True)
        if ck.dft.length:
            assert draft is not None
            dexp = _exp(draft)
            assert ck.dft.body is not None
            assert compare(dexp, ck.dft.body, partial=True) == [], f"checkpoint {ck.index} data_dft"
            assert ck.dft.body.layout == layout_of(dexp, partial=True)
    if sf.draft is not None and sf.draft.dft is not None and sf.draft.dft.length:
        assert draft is not None
        dexp = _exp(draft)
        assert compare(dexp, sf.draft.dft.body) == []  # SDFT holds a full (flags 0) draft save
        assert sf.draft.dft.body.layout == layout_of(dexp)


def test_every_fixture_and_blob_was_checked() -> None:
    files = {p.name for p in (FIXTURES / "slots").iterdir() if p.suffix in (".slot", ".session")}
    assert files == {_ids(p) for p in PAIRS}
    n_ck = sum(len(_sf(p[0]).checkpoints) for p in PAIRS)
    assert n_ck >= 10


# --------------------------------------------------------------------------- wrong pairings


def _msgs(problems: list[tuple[str, int, str]]) -> str:
    return "\n".join(f"{s} @{o}: {m}" for s, o, m in problems)


def test_llama_slot_against_gemma3_names_layer_and_row_size() -> None:
    sf = _sf("slots/llama_f16_fa.slot")
    probs = compare(_exp("models/gemma3.gguf"), sf.body)
    text = _msgs(probs)
    assert any("writes KV + KV" in m for _, _, m in probs), text
    # the llama KV (64-byte f16 rows of 32) read against gemma3's kv-base (layers 1, 3 of 16)
    k0 = [p for p in probs if p[2].startswith("K layer 0 (model layer 1)")]
    assert k0 and "row size 64 B" in k0[0][2] and "32 B (f16 x 16)" in k0[0][2], text
    assert k0[0][0] == "body.kv.stream[0]"
    assert k0[0][1] == sf.body.blocks[0].streams[0].k[0].offset
    assert any(m.startswith("V layer 1 (model layer 3): row size 64 B") for _, _, m in probs), text


def test_llama_slot_against_draft_names_layer_count_and_row_size() -> None:
    sf = _sf("slots/llama_f16_fa.slot")
    probs = compare(_exp("models/draft.gguf"), sf.body)
    text = _msgs(probs)
    assert any("n_layer 2; the model's kv cache has 1 layer [0]" in m for _, _, m in probs), text
    assert any(m.startswith("K layer 0 (model layer 0): row size 64 B; the model needs 32 B") for _, _, m in probs), (
        text
    )
    # the kinds agree (one KV block), so no block-order complaint
    assert not any("writes" in m for _, _, m in probs), text


def test_transposed_v_against_wrong_model_names_n_embd() -> None:
    sf = _sf("slots/llama_f16_nofa.slot")  # v_trans 1: V entries carry n_embd_v_gqa = 32
    probs = compare(_exp("models/draft.gguf"), sf.body)
    assert any("V layer 0 (model layer 0): transposed n_embd_v_gqa 32; the model needs 16" in m for _, _, m in probs), (
        _msgs(probs)
    )


def test_gemma3_slot_against_llama() -> None:
    sf = _sf("slots/gemma3_iswa_nofa.slot")
    probs = compare(_exp("models/llama.gguf"), sf.body)
    text = _msgs(probs)
    assert probs[0][:2] == ("body", sf.body.offset)
    assert "blocks are KV + KV" in probs[0][2] and "writes KV" in probs[0][2], text
    assert any(
        s == "body.kv-base.stream[0]"
        and m.startswith("K layer 0 (model layer 0): row size 32 B; the model needs 64 B (f16 x 32)")
        for s, _, m in probs
    ), text
    assert any("transposed n_embd_v_gqa 16; the model needs 32" in m for _, _, m in probs), text


def test_gemma3_checkpoint_against_llama_partial() -> None:
    sf = _sf("slots/gemma3_iswa_fa.slot")
    body = sf.checkpoints[0].tgt.body
    probs = compare(_exp("models/llama.gguf"), body, partial=True, prefix="ck0")
    # kinds agree (one KV): the SWA half has 2 layers of 32-byte rows, llama's cache 2 of 64
    assert probs and all(s.startswith("ck0.") for s, _, _ in probs)
    assert any("row size 32 B; the model needs 64 B" in m for _, _, m in probs), _msgs(probs)


def test_hybrid_and_recurrent_mismatches() -> None:
    jamba = _sf("slots/extra-jamba.slot")
    probs = compare(_exp("models/extra-lfm2.gguf"), jamba.body)
    text = _msgs(probs)
    assert any("n_layer word 2; the model has 3 layers" in m for _, _, m in probs), text
    assert any("1 R entries; the model has recurrent state in 2 layers [0, 2]" in m for _, _, m in probs), text
    assert any(
        m.startswith("R layer 0 (model layer 0): row size 768 B; the model needs 256 B (f32 x 64)") for _, _, m in probs
    ), text
    assert any(m.startswith("S layer 0 (model layer 0): row size 2048 B; the model needs 0 B") for _, _, m in probs), (
        text
    )
    mamba = _sf("slots/extra-mamba.slot")
    probs = compare(_exp("models/extra-jamba.gguf"), mamba.body)
    assert any("writes KV + REC(1)" in m for _, _, m in probs), _msgs(probs)
    # a hybrid checkpoint (REC only) against the pure recurrent model
    probs = compare(_exp("models/extra-mamba.gguf"), jamba.checkpoints[0].tgt.body, partial=True)
    assert any("1 R entries; the model has recurrent state in 2 layers [0, 1]" in m for _, _, m in probs)


def test_cell_ext_mismatch() -> None:
    qwen = _sf("slots/extra-qwen2vl.slot")
    probs = compare(_exp("models/extra-llama.gguf"), qwen.body)
    assert any("cell ext 12 B per cell; the model needs 0 B" in m for _, _, m in probs), _msgs(probs)
    llama = _sf("slots/extra-llama.session")
    probs = compare(_exp("models/extra-qwen2vl.gguf"), llama.body)
    assert any("cell ext 0 B per cell; the model needs 12 B" in m for _, _, m in probs), _msgs(probs)


def test_empty_caches_are_not_over_checked() -> None:
    # an empty KV stream writes no layer data: only the REC headers can be checked
    sf = _sf("slots/extra-jamba-empty.slot")
    assert compare(_exp("models/extra-jamba.gguf"), sf.body) == []
    probs = compare(_exp("models/extra-lfm2.gguf"), sf.body)
    assert probs and all(s == "body.rec" for s, _, _ in probs), _msgs(probs)


# --------------------------------------------------------------------------- metadata -> expectation


def _info(arch: str, **kv: Any) -> ModelInfo:
    meta: dict[str, Any] = {"general.architecture": arch}
    base = {
        "context_length": 4096,
        "embedding_length": 64,
        "block_count": 4,
        "attention.head_count": 4,
        "attention.head_count_kv": 2,
    }
    base.update(kv)
    for k, v in base.items():
        if v is not None:
            meta[k if k.startswith(("general.", "tokenizer.")) else f"{arch}.{k}"] = v
    return ModelInfo("<synthetic>", arch, meta, ["a"] * 10)


def _kv(exp: ModelExpect) -> list[CacheExpect]:
    return [b for b in exp.blocks if isinstance(b, CacheExpect)]


def _rec(exp: ModelExpect) -> RecExpect:
    (r,) = [b for b in exp.blocks if isinstance(b, RecExpect)]
    return r


def test_per_layer_head_count_kv_and_key_length() -> None:
    exp = expect_from_model(
        _info(
            "llama",
            **{"attention.head_count_kv": [2, 1, 0, 4], "attention.key_length": 24, "attention.value_length": 8},
        )
    )
    (kv,) = _kv(exp)
    assert kv.layers == (0, 1, 2, 3)
    assert kv.n_embd_k == (48, 24, 0, 96)  # n_embd_head_k * n_head_kv(il)
    assert kv.n_embd_v == (16, 8, 0, 32)
    assert exp.n_vocab == 10 and exp.n_ctx_train == 4096


def test_wrong_array_length_is_refused_not_guessed() -> None:
    exp = expect_from_model(_info("llama", **{"attention.head_count_kv": [2, 1]}))
    assert exp.memory_class == "unknown" and not exp.blocks
    assert "wrong array length" in exp.notes[0]


def test_nextn_layers_are_filtered_from_the_trunk() -> None:
    exp = expect_from_model(_info("qwen3", block_count=5, nextn_predict_layers=1))
    assert _kv(exp)[0].layers == (0, 1, 2, 3)
    assert exp.n_layer == 4
    assert any("NextN" in n for n in exp.notes)


def test_swa_patterns() -> None:
    # gemma2: default period 2, the last of each period dense
    g2 = expect_from_model(_info("gemma2", block_count=6, **{"attention.sliding_window": 4096}))
    assert g2.memory_class == "iswa"
    assert [b.layers for b in _kv(g2)] == [(1, 3, 5), (0, 2, 4)]
    assert [b.role for b in g2.partial_blocks] == ["kv-swa"]
    # gemma3: SWA only with a window; a bool array wins over the period
    g3 = expect_from_model(
        _info(
            "gemma3",
            block_count=4,
            **{"attention.sliding_window": 512, "attention.sliding_window_pattern": [True, False, False, True]},
        )
    )
    assert [b.layers for b in _kv(g3)] == [(1, 2), (0, 3)]
    g3_plain = expect_from_model(_info("gemma3", block_count=4))
    assert g3_plain.memory_class == "kv-cache"
    # cohere2moe: dense first
    c = expect_from_model(
        _info("cohere2moe", block_count=8, **{"attention.sliding_window": 4096, "attention.sliding_window_pattern": 4})
    )
    assert [b.layers for b in _kv(c)] == [(0, 4), (1, 2, 3, 5, 6, 7)]
    # per-layer SWA head sizes (gemma4) and KV sharing: layers past n_layer_kv_from_start have no KV
    g4 = expect_from_model(
        _info(
            "gemma4",
            block_count=6,
            **{
                "attention.sliding_window": 512,
                "attention.sliding_window_pattern": [1, 1, 0, 1, 1, 0],
                "attention.shared_kv_layers": 2,
                "attention.key_length": 32,
                "attention.value_length": 32,
                "attention.key_length_swa": 16,
                "attention.value_length_swa": 16,
                "attention.head_count_kv": 1,
            },
        )
    )
    assert [b.layers for b in _kv(g4)] == [(2,), (0, 1, 3)]
    assert [b.n_embd_k for b in _kv(g4)] == [(32,), (16, 16, 16)]
    # phi3 disables SWA even when the GGUF has a window
    p3 = expect_from_model(_info("phi3", **{"attention.sliding_window": 2047}))
    assert p3.memory_class == "kv-cache" and p3.notes


def test_recurrent_and_hybrid_layer_maps() -> None:
    m2 = expect_from_model(
        _info(
            "mamba2",
            **{
                "attention.head_count": 0,
                "ssm.conv_kernel": 4,
                "ssm.inner_size": 128,
                "ssm.state_size": 16,
                "ssm.time_step_rank": 8,
                "ssm.group_count": 2,
            },
        )
    )
    r = _rec(m2)
    assert m2.memory_class == "recurrent" and r.layers == (0, 1, 2, 3)
    assert (r.n_embd_r, r.n_embd_s) == (3 * (128 + 2 * 2 * 16), 16 * 128)
    rw = expect_from_model(_info("rwkv6", **{"attention.head_count": 0, "wkv.head_size": 64}))
    assert (_rec(rw).n_embd_r, _rec(rw).n_embd_s) == (2 * 64, 64 * 64)
    # qwen3.5: IMRoPE ext; recurrent layers from full_attention_interval; NextN layer dense
    q = expect_from_model(
        _info(
            "qwen35",
            block_count=9,
            nextn_predict_layers=1,
            full_attention_interval=4,
            **{
                "rope.dimension_sections": [11, 11, 10, 0],
                "ssm.conv_kernel": 4,
                "ssm.inner_size": 32,
                "ssm.state_size": 8,
                "ssm.time_step_rank": 4,
                "ssm.group_count": 2,
            },
        )
    )
    assert q.memory_class == "hybrid" and q.cell_ext == 12
    assert _kv(q)[0].layers == (3, 7)
    assert _rec(q).layers == (0, 1, 2, 4, 5, 6) and _rec(q).n_layer_field == 8
    assert [type(b).__name__ for b in q.partial_blocks] == ["RecExpect"]
    # an explicit recurrent_layers array
    q2 = expect_from_model(
        _info(
            "qwen3next",
            **{
                "attention.recurrent_layers": [1, 0, 1, 0],
                "ssm.conv_kernel": 4,
                "ssm.inner_size": 32,
                "ssm.state_size": 8,
                "ssm.time_step_rank": 4,
                "ssm.group_count": 1,
            },
        )
    )
    assert _kv(q2)[0].layers == (1, 3) and _rec(q2).layers == (0, 2)
    # nemotron_h: mamba (no heads, no ffn), attention (heads, no ffn), MLP (no heads, ffn)
    nh = expect_from_model(
        _info(
            "nemotron_h",
            **{
                "attention.head_count_kv": [0, 2, 0, 0],
                "feed_forward_length": [0, 0, 256, 0],
                "ssm.conv_kernel": 4,
                "ssm.inner_size": 32,
                "ssm.state_size": 8,
                "ssm.time_step_rank": 4,
                "ssm.group_count": 1,
            },
        )
    )
    assert _kv(nh)[0].layers == (1,) and _rec(nh).layers == (0, 3)
    # falcon-h1: every layer in both caches
    fh = expect_from_model(
        _info(
            "falcon-h1",
            **{
                "ssm.conv_kernel": 4,
                "ssm.inner_size": 32,
                "ssm.state_size": 8,
                "ssm.time_step_rank": 4,
                "ssm.group_count": 1,
            },
        )
    )
    assert _kv(fh)[0].layers == _rec(fh).layers == (0, 1, 2, 3)
    # lfm2 with a window: hybrid-iswa, every attention layer SWA, an empty base cache
    lf = expect_from_model(
        _info(
            "lfm2", **{"attention.head_count_kv": [0, 2, 0, 2], "shortconv.l_cache": 3, "attention.sliding_window": 128}
        )
    )
    assert lf.memory_class == "hybrid-iswa"
    assert [b.layers for b in lf.blocks[:2]] == [(), (1, 3)]
    assert [b.role for b in lf.partial_blocks] == ["kv-swa", "rec"]
    assert layout_of(lf, partial=True).kinds == ("KV", "REC")


def test_mla_is_k_only() -> None:
    meta = {
        "attention.head_count": 16,
        "attention.head_count_kv": 1,
        "attention.key_length": 576,
        "attention.value_length": 512,
        "attention.key_length_mla": 192,
        "attention.value_length_mla": 128,
        "attention.kv_lora_rank": 512,
        "attention.q_lora_rank": 1536,
        "expert_shared_count": 1,
        "expert_feed_forward_length": 1408,
    }
    exp = expect_from_model(_info("deepseek2", **meta))
    (kv,) = _kv(exp)
    assert kv.n_embd_k == (576,) * 4 and kv.n_embd_v == ()
    assert layout_of(exp).blocks[0].has_v is False
    assert any("MLA" in n for n in exp.notes)
    old = dict(
        meta,
        **{
            "attention.key_length_mla": None,
            "attention.value_length_mla": None,
            "attention.head_count_kv": 16,
            "attention.key_length": 192,
            "attention.value_length": 128,
        },
    )
    (kv,) = _kv(expect_from_model(_info("deepseek2", **old)))
    assert kv.n_embd_k == (192 * 16,) * 4 and kv.n_embd_v == (128 * 16,) * 4


def test_unknown_and_unmodelled_archs_say_so() -> None:
    unk = expect_from_model(_info("some-future-arch"))
    assert unk.memory_class == "unknown" and unk.blocks == () and "not modelled" in unk.notes[0]
    dsa = expect_from_model(_info("deepseek32"))
    assert dsa.memory_class == "dsa" and dsa.blocks == () and dsa.notes
    bert = expect_from_model(_info("bert"))
    assert bert.memory_class == "none" and bert.notes
    body = _sf("slots/llama_f16_fa.slot").body
    probs = compare(unk, body)
    assert len(probs) == 1 and probs[0][2].startswith("not checked against the model")
    probs = compare(bert, body)
    assert any("writes an empty body" in m for _, _, m in probs)


def test_recurrent_block_still_checked_when_a_kv_block_is_missing() -> None:
    mamba = _sf("slots/extra-mamba.slot")
    probs = compare(_exp("models/extra-jamba.gguf"), mamba.body)
    text = _msgs(probs)
    assert probs[0][0] == "body" and "writes KV + REC(1)" in probs[0][2], text
    assert any(
        s == "body.rec" and "2 R entries; the model has recurrent state in 1 layer [0]" in m for s, _, m in probs
    ), text


def test_quantized_cache_for_a_row_that_is_not_whole_blocks() -> None:
    sf = _sf("slots/llama_q8_0_fa.slot")  # q8_0 rows of 32 elements; draft rows have 16
    probs = compare(_exp("models/draft.gguf"), sf.body)
    assert any(
        m.startswith("K layer 0 (model layer 0): row size 34 B of q8_0") and "not a whole number" in m
        for _, _, m in probs
    ), _msgs(probs)


# --------------------------------------------------------------------------- the real loader as oracle
# Fixture models with edited metadata (same tensors), loaded by the vendored llama.cpp: the blob
# it writes must agree with what expect_from_model derives from the edited metadata alone.

_ORACLE_CASES: dict[str, tuple[str, dict[str, tuple[str, Any]], tuple[str, ...], str]] = {
    # name: (source model, keys to set (kind, value), keys to drop, expected memory class)
    "gemma3-bool-array": (
        "gemma3.gguf",
        {"gemma3.attention.sliding_window_pattern": ("bools", [1, 0, 0, 1])},
        (),
        "iswa",
    ),
    "gemma3-period-4": ("gemma3.gguf", {"gemma3.attention.sliding_window_pattern": ("u32", 4)}, (), "iswa"),
    "gemma3-no-window": (
        "gemma3.gguf",
        {},
        ("gemma3.attention.sliding_window", "gemma3.attention.sliding_window_pattern"),
        "kv-cache",
    ),
    "lfm2-window": ("extra-lfm2.gguf", {"lfm2.attention.sliding_window": ("u32", 8)}, (), "hybrid-iswa"),
    "llama-kv-array": ("llama.gguf", {"llama.attention.head_count_kv": ("i32s", [1, 1])}, (), "kv-cache"),
}


def _rewrite_gguf(src: Any, dst: Any, new: dict[str, tuple[str, Any]], drop: tuple[str, ...]) -> None:
    import gguf

    vt = gguf.GGUFValueType
    kinds = {"u32": (vt.UINT32, None), "bools": (vt.ARRAY, vt.BOOL), "i32s": (vt.ARRAY, vt.INT32)}
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), str(r.get_field("general.architecture").contents()))
    for f in r.fields.values():
        if f.name == "general.architecture" or f.name.startswith("GGUF.") or f.name in drop or f.name in new:
            continue
        t = f.types[0]
        w.add_key_value(f.name, f.contents(), t, sub_type=f.types[-1] if t == vt.ARRAY else None)
    for key, (kind, value) in new.items():
        t, sub = kinds[kind]
        w.add_key_value(key, [bool(v) for v in value] if kind == "bools" else value, t, sub_type=sub)
    for ten in r.tensors:
        w.add_tensor_info(ten.name, ten.data.shape, ten.data.dtype, ten.data.nbytes, ten.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for ten in r.tensors:
        w.write_tensor_data(ten.data, tensor_endianess=r.endianess)
    w.close()


@pytest.mark.llama
@pytest.mark.parametrize("case", sorted(_ORACLE_CASES))
def test_expectation_matches_the_real_loader(case: str, tmp_path: Any) -> None:
    pytest.importorskip("llama_cpp")
    import struct

    from fixtures import make_extra_fixtures as mx
    from slotfile.format.reader import parse_buffer

    src, new, drop, cls = _ORACLE_CASES[case]
    path = tmp_path / f"{case}.gguf"
    _rewrite_gguf(FIXTURES / "models" / src, path, new, drop)
    exp = expect_from_model(load_model_info(path))
    assert exp.memory_class == cls
    model = mx.Model(path)
    try:
        toks = model.tokenize(mx.PROMPT)[:20]
        for fa in (True, False):
            ctx = mx.Context(model, flash_attn=fa)
            try:
                ctx.decode(toks, 0)
                for partial in (False, True):
                    blob = ctx.seq_blob(0, mx.PARTIAL_ONLY if partial else 0)
                    # a GGSQ file with no tokens around the blob's body (after io_magic + seq_id)
                    sf = parse_buffer(struct.pack("<III", 0x67677371, 3, 0) + blob[8:])
                    assert sf.body is not None and sf.body.end == sf.size, (fa, partial)
                    assert compare(exp, sf.body, partial=partial) == [], (fa, partial)
                    assert sf.body.layout == layout_of(exp, partial=partial), (fa, partial)
            finally:
                ctx.free()
    finally:
        model.free()
