"""The model bridge: what a GGUF file says about the state a slot file should hold.

Read through the ``gguf`` package (memory-mapped, no weights loaded).  Used for the
detokenised preview and for the model-side checks of later stages.
"""

from __future__ import annotations

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
    return {chr(c): b for b, c in zip(bs, cs)}


class ModelError(Exception):
    """The model file cannot be read as GGUF (an operational error, not a verdict)."""


@dataclass(slots=True)
class ModelInfo:
    path: str
    arch: str
    metadata: dict[str, Any]
    tokens: list[str] = field(default_factory=list)
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
        for t in np.asarray(ids, dtype=np.int64).tolist():
            if t < 0 or t >= len(self.tokens):
                out += f"<?{t}>".encode()
                continue
            piece = self.tokens[t]
            ttype = int(self.token_types[t]) if self.token_types is not None and t < len(self.token_types) else 1
            if ttype == CONTROL:
                out += piece.encode()
            elif self.tokenizer == "gpt2":
                out += bytes(dec.get(ch, ord("?")) for ch in piece) if all(ch in dec for ch in piece) else piece.encode()
            elif ttype == BYTE and piece.startswith("<0x") and piece.endswith(">"):
                out.append(int(piece[3:-1], 16))
            else:  # SentencePiece-style: the meta space stands for a space
                out += piece.replace("\u2581", " ").encode()
        return out.decode("utf-8", "replace")


def _field_value(f: Any) -> Any:
    try:
        v = f.contents()
    except Exception:  # noqa: BLE001 - an odd field must not stop the rest
        return None
    if isinstance(v, np.generic):
        return v.item()
    return v


def load_model_info(path: str | Path, *, vocab: bool = True) -> ModelInfo:
    """Read a GGUF's metadata (and its vocabulary when ``vocab``), never its weights."""
    try:
        from gguf import GGUFReader
    except ImportError as e:  # pragma: no cover - gguf is a dependency
        raise ModelError(f"the gguf package is missing: {e}") from e
    p = Path(path)
    if not p.is_file():
        raise ModelError(f"model not found: {p}")
    try:
        reader = GGUFReader(str(p), "r")
    except Exception as e:  # noqa: BLE001 - any parse failure of a model is operational
        raise ModelError(f"cannot read {p} as GGUF: {e}") from e
    meta: dict[str, Any] = {}
    tokens: list[str] = []
    types: np.ndarray | None = None
    for name, f in reader.fields.items():
        if name == "tokenizer.ggml.tokens":
            if vocab:
                tokens = list(f.contents())
            continue
        if name == "tokenizer.ggml.token_type":
            if vocab:
                types = np.asarray(f.contents(), dtype=np.int32)
            continue
        if name in ("tokenizer.ggml.merges", "tokenizer.ggml.scores"):
            continue
        meta[name] = _field_value(f)
    arch = str(meta.get("general.architecture", ""))
    return ModelInfo(str(p), arch, meta, tokens, types, str(meta.get("tokenizer.ggml.model", "")))


def escape_text(text: str, limit: int | None = None) -> str:
    """Printable form of text taken from a file: control characters escaped, length capped."""
    out = []
    for ch in text:
        o = ord(ch)
        if ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\\":
            out.append("\\\\")
        elif o < 0x20 or 0x7F <= o < 0xA0 or o in (0x2028, 0x2029) or 0x202A <= o <= 0x202E or 0x2066 <= o <= 0x2069:
            out.append(f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}")
        else:
            out.append(ch)
    s = "".join(out)
    if limit is not None and len(s) > limit:
        s = s[: limit - 1] + "…"
    return s
