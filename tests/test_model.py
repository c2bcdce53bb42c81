"""The model bridge: GGUF metadata and detokenisation against the real tokenizer."""

from __future__ import annotations

import pytest

from slotfile.format.reader import open_slot_file
from slotfile.model.bridge import ModelError, load_model_info

from .conftest import MANIFEST, MODELS, SLOTS


def test_metadata_through_gguf():
    info = load_model_info(MODELS / "gemma3.gguf")
    assert info.arch == "gemma3"
    assert info.get("block_count") == 4
    assert info.n_vocab > 256


@pytest.mark.parametrize("entry", MANIFEST["slots"][:3], ids=lambda e: e["file"])
def test_detokenize_matches_the_text_the_fixture_was_made_from(entry):
    info = load_model_info(SLOTS.parent / entry["model"])
    sf = open_slot_file(SLOTS.parent / entry["file"])
    text = info.detokenize(sf.tokens.tokens)
    assert text.replace("<s>", "") == entry["text"]


@pytest.mark.llama
def test_detokenize_agrees_with_llama_cpp():
    llama_cpp = pytest.importorskip("llama_cpp")
    path = str(MODELS / "llama.gguf")
    llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    text = "Hello, world! 1+1=2\tcafé ✓"
    ids = llm.tokenize(text.encode(), add_bos=False, special=False)
    assert load_model_info(path).detokenize(ids) == llm.detokenize(ids).decode("utf-8", "replace")


def test_missing_model():
    with pytest.raises(ModelError):
        load_model_info("/nonexistent.gguf")
