"""The context settings the parent sends and the worker turns into llama.cpp parameters.

Standard library and :mod:`slotfile.format.types` only: the worker imports this before
llama.cpp, and its start-up overlaps the parent's own imports.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from slotfile.format.types import BY_NAME

CTX_PAD = 256  # llama.cpp pads n_ctx (and n_ctx_seq) to a multiple of 256 anyway


@dataclass(frozen=True)
class LoadSettings:
    """A context that mirrors the one that saved a file (slot-format.md §10)."""

    n_ctx: int
    n_seq_max: int
    kv_unified: bool
    flash_attn: bool
    type_k: int  # ggml type ids
    type_v: int
    n_gpu_layers: int = 0
    seq_id: int = 0

    @property
    def n_stream(self) -> int:
        """The KV streams: one per sequence in a non-unified cache of several, else one."""
        return self.n_seq_max if not self.kv_unified and self.n_seq_max > 1 else 1

    @property
    def n_ctx_seq(self) -> int:
        """The cells of each stream."""
        return self.n_ctx // self.n_stream

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoadSettings:
        """From the dict form; cache types may be ids or names (``"f16"``, ``"q8_0"``).
        Raises ValueError for an unknown type name, KeyError for a missing field."""
        return cls(
            n_ctx=int(d["n_ctx"]),
            n_seq_max=int(d["n_seq_max"]),
            kv_unified=bool(d["kv_unified"]),
            flash_attn=bool(d["flash_attn"]),
            type_k=type_id(d["type_k"]),
            type_v=type_id(d["type_v"]),
            n_gpu_layers=int(d.get("n_gpu_layers") or 0),
            seq_id=int(d.get("seq_id") or 0),
        )


def pad_ctx(n: int) -> int:
    """Room for ``n`` cells, rounded up the way llama.cpp rounds n_ctx."""
    return max(CTX_PAD, -(-n // CTX_PAD) * CTX_PAD)


def type_id(value: int | str) -> int:
    """A cache type as its ggml id, given an id or a name (``--cache-type-k`` spelling)."""
    if isinstance(value, int):
        return value
    t = BY_NAME.get(str(value).lower()) or BY_NAME.get(str(value))
    if t is None:
        raise ValueError(f"unknown cache type {value!r}")
    return t.id
