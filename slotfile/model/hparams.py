"""``llama_hparams`` reduced to what shapes the state, and GGUF metadata read with
``llama_model_loader`` semantics (required keys, per-layer arrays, scalar-or-array keys).
:mod:`slotfile.model.archs` fills these per arch; :mod:`slotfile.model.expect` turns them into
the expected blocks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slotfile.model.bridge import ModelInfo

CELL_EXT = 12  # sizeof(llama_kv_cell_ext): i32 x, y, tok (src/llama-kv-cells.h)


class Refused(Exception):
    """The metadata is one llama.cpp itself would refuse to load (or we cannot model)."""


MISSING: Any = object()


# ---------------------------------------------------------------------------------------
# metadata access with llama_model_loader semantics
# ---------------------------------------------------------------------------------------


class Keys:
    def __init__(self, info: ModelInfo) -> None:
        self.info = info

    def _full(self, key: str) -> str:
        return f"{self.info.arch}.{key}"

    def raw(self, key: str) -> Any:
        return self.info.get(key, MISSING)

    def has(self, key: str) -> bool:
        return self.raw(key) is not MISSING

    def scalar(self, key: str, default: Any = None, *, required: bool = False) -> Any:
        """``get_key``: an array where a scalar is expected is an error in llama.cpp."""
        v = self.raw(key)
        if v is MISSING:
            if required:
                raise Refused(f"key not found in model: {self._full(key)}")
            return default
        if isinstance(v, (list, tuple)):
            raise Refused(f"{self._full(key)} is an array where llama.cpp reads a scalar")
        return v

    def key_or_arr(self, key: str, n: int, default: list[int], *, required: bool = False) -> list[int]:
        """``get_key_or_arr``: a scalar fills all n entries, an array must have exactly n."""
        v = self.raw(key)
        if v is MISSING:
            if required:
                raise Refused(f"key not found in model: {self._full(key)}")
            return list(default)
        if isinstance(v, (list, tuple)):
            if len(v) != n:
                raise Refused(f"key {self._full(key)} has wrong array length; expected {n}, got {len(v)}")
            return [int(x) for x in v]
        return [int(v)] * n

    def arr(self, key: str, *, required: bool = False) -> list[int] | None:
        """``get_arr`` into a std::array: any length, the rest keeps its previous value."""
        v = self.raw(key)
        if not isinstance(v, (list, tuple)):
            if required:
                raise Refused(f"array key not found in model: {self._full(key)}")
            return None
        return [int(x) for x in v]


# ---------------------------------------------------------------------------------------
# llama_hparams, reduced to what shapes the state
# ---------------------------------------------------------------------------------------


@dataclass
class HParams:
    arch: str
    n_layer_all: int
    n_layer_nextn: int
    n_embd: int
    n_ctx_train: int
    n_head: list[int]
    n_head_kv: list[int]
    n_ff: list[int]
    head_k_full: int
    head_v_full: int
    head_k_swa: int
    head_v_swa: int
    is_swa: list[bool]
    is_recr: list[bool]
    swa_type: str = "none"  # none, standard, chunked, symmetric
    n_swa: int = 0
    n_layer_kv_from_start: int = -1
    head_k_mla: int = 0
    head_v_mla: int = 0
    rope_sections: list[int] = field(default_factory=lambda: [0, 0, 0, 0])
    ssm_d_conv: int = 0
    ssm_d_inner: int = 0
    ssm_d_state: int = 0
    ssm_n_group: int = 0
    wkv_head_size: int = 0
    token_shift_count: int = 2
    n_shortconv_l_cache: int = 0
    notes: list[str] = field(default_factory=list)

    def n_layer(self) -> int:  # llama_hparams::n_layer
        return self.n_layer_all - self.n_layer_nextn

    def is_mla(self) -> bool:
        return self.head_k_mla != 0 and self.head_v_mla != 0

    def head_k(self, il: int) -> int:  # llama_hparams::n_embd_head_k(il)
        return self.head_k_swa if self.is_swa[il] else self.head_k_full

    def head_v(self, il: int) -> int:
        return self.head_v_swa if self.is_swa[il] else self.head_v_full

    def n_embd_k_gqa(self, il: int) -> int:  # n_embd_head_k(il) * n_head_kv(il)
        return self.head_k(il) * self.n_head_kv[il]

    def n_embd_v_gqa(self, il: int) -> int:
        return self.head_v(il) * self.n_head_kv[il]

    def has_kv(self, il: int) -> bool:
        return self.n_layer_kv_from_start < 0 or il < self.n_layer_kv_from_start

    def n_embd_r(self) -> int:  # llama_hparams::n_embd_r (KDA branch: archs not modelled)
        if self.wkv_head_size:
            return self.token_shift_count * self.n_embd
        if self.n_shortconv_l_cache:
            return self.n_embd * (self.n_shortconv_l_cache - 1)
        return max(self.ssm_d_conv - 1, 0) * (self.ssm_d_inner + 2 * self.ssm_n_group * self.ssm_d_state)

    def n_embd_s(self) -> int:  # llama_hparams::n_embd_s
        if self.wkv_head_size:
            return self.n_embd * self.wkv_head_size
        return self.ssm_d_state * self.ssm_d_inner

    def set_swa_pattern(self, n_pattern: int, dense_first: bool = False) -> None:
        """llama_hparams::set_swa_pattern: over the trunk layers; NextN layers stay dense."""
        for il in range(self.n_layer_all):
            if il >= self.n_layer():
                self.is_swa[il] = False
            elif dense_first:
                self.is_swa[il] = n_pattern == 0 or il % n_pattern != 0
            else:
                self.is_swa[il] = n_pattern == 0 or il % n_pattern < n_pattern - 1
