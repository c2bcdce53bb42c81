"""The model bridge: what a GGUF file says about the state a slot file should hold.

Read through :mod:`slotfile.model.gguf` (memory-mapped, no weights, no whole vocabulary: the token
strings are decoded when a preview asks for them).  Used for the detokenised preview and for the
model-side checks of later stages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

# llama_vocab token types (gguf TokenType): 1 normal, 2 unknown, 3 control, 4 user, 5 unused, 6 byte
CONTROL, BYTE = 3, 6


@lru_cache(maxsize=1)
def _gpt2_byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the byte-level BPE alphabet back to bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=False)}


class ModelError(Exception):
    """The model file cannot be read as GGUF (an operational error, not a verdict)."""


@dataclass(slots=True)
class ModelInfo:
    path: str
    arch: str
    metadata: dict[str, Any]
    # a list, or a lazy StringArray over the GGUF's mmap (len() and indexing decode on demand)
    tokens: Sequence[str] = field(default_factory=list)
    token_types: np.ndarray | None = None
    tokenizer: str = ""

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def get(self, key: str, default: Any = None) -> Any:
        """An arch-scoped key (``block_count``) or a full key (``general.name``)."""
        if key in self.metadata:
            return self.metadata[key]
        return self.metadata.get(f"{self.arch}.{key}", default)

    def detokenize(self, ids: np.ndarray | list[int]) -> str:
        """Token ids to text, the way llama.cpp's detokenizer renders them (control tokens kept
        verbatim, ids outside the vocabulary as ``<?id>``)."""
        out = bytearray()
        dec = _gpt2_byte_decoder()
        n_vocab = len(self.tokens)
        n_types = len(self.token_types) if self.token_types is not None else 0
        for t in np.asarray(ids, dtype=np.int64).tolist():
            if t < 0 or t >= n_vocab:
                out += f"<?{t}>".encode()
                continue
            piece = self.tokens[t]
            ttype = int(self.token_types[t]) if self.token_types is not None and t < n_types else 1
            if ttype == CONTROL:
                out += piece.encode()
            elif self.tokenizer == "gpt2":
                out += (
                    bytes(dec.get(ch, ord("?")) for ch in piece) if all(ch in dec for ch in piece) else piece.encode()
                )
            elif ttype == BYTE and piece.startswith("<0x") and piece.endswith(">"):
                out.append(int(piece[3:-1], 16))
            else:  # SentencePiece-style: the meta space stands for a space
                out += piece.replace("\u2581", " ").encode()
        return out.decode("utf-8", "replace")


# left in the file: the vocabulary (read lazily into ModelInfo.tokens / token_types) and the two
# per-token arrays nothing here uses
_VOCAB_KEYS = frozenset(
    ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.scores")
)


def load_model_info(path: str | Path, *, vocab: bool = True) -> ModelInfo:
    """Read a GGUF's metadata (and its vocabulary when ``vocab``), never its weights.

    ``metadata`` holds every key but the vocabulary arrays, plus ``GGUF.version``,
    ``GGUF.tensor_count`` and ``GGUF.kv_count`` (as ``gguf.GGUFReader`` listed them): scalars as
    Python numbers, strings as ``str`` (None when not UTF-8), arrays of up to
    ``gguf_meta.SHORT_ARRAY`` elements as lists; a longer array as a lazy ``gguf_meta.GGUFArray``.
    """
    from slotfile.model import gguf as gguf_meta

    p = Path(path)
    if not p.is_file():
        raise ModelError(f"model not found: {p}")
    try:
        g = gguf_meta.scan(p)
    except gguf_meta.GGUFError as e:
        raise ModelError(f"cannot read {p} as GGUF: {e}") from e
    except OSError as e:
        raise ModelError(f"cannot read {p}: {e.strerror or e}") from e
    except Exception as e:  # any parse failure of a model is operational
        raise ModelError(f"cannot read {p} as GGUF: {type(e).__name__}: {e}") from e
    meta: dict[str, Any] = {"GGUF.version": g.version, "GGUF.tensor_count": g.tensor_count, "GGUF.kv_count": g.kv_count}
    meta.update((k, v) for k, v in g.fields.items() if k not in _VOCAB_KEYS)
    tokens: Sequence[str] = []
    types: np.ndarray | None = None
    if vocab:
        tok = g.array("tokenizer.ggml.tokens")
        if tok is not None and tok.item_type == gguf_meta.STRING:
            tokens = tok.strings(errors="replace")
        tt = g.array("tokenizer.ggml.token_type")
        if tt is not None and tt.item_type == gguf_meta.INT32 and g.order == "<":
            types = tt.view()  # zero-copy over the mmap
        elif tt is not None and tt.item_type not in (gguf_meta.STRING, gguf_meta.ARRAY):
            types = tt.view().astype(np.int32)
    arch = str(meta.get("general.architecture", ""))
    return ModelInfo(str(p), arch, meta, tokens, types, str(meta.get("tokenizer.ggml.model", "")))
