"""What the model says the state must look like, from GGUF metadata only.

A slot body is a concatenation of KV and REC blocks whose number, order, layers and row
sizes are fixed by the model (``llama_model::create_memory``) and by the cache types chosen
at run time.  This module mirrors, for the archs it models, exactly what the vendored
llama.cpp (llama-cpp-python 0.3.36) computes:

* ``llama_model_base::load_hparams`` plus the arch's ``load_arch_hparams`` (src/models/*.cpp)
  for the per-layer head counts, head sizes, SWA and recurrent layer maps;
* ``llama_model::create_memory`` for the memory class and the layer filters of each cache;
* ``llama_kv_cache::llama_kv_cache`` (which layers a cache holds), ``state_write_data``
  (``ggml_row_size(type, n_embd_k_gqa(il))`` per K row, ``n_embd_v_gqa(il)`` per V row) and
  ``llama_memory_recurrent::state_write_data`` (the R/S entries and the ``n_layer`` word).

Metadata is read through :class:`slotfile.model.bridge.ModelInfo` (the ``gguf`` package); weights
are never touched.  An arch that is not modelled gives ``memory_class == "unknown"`` with a
note; a class that is known but whose blocks are not modelled (DSA, MSA, DSV4, ...) gives that
class, no blocks and a note.  Nothing is guessed silently.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from slotfile.format.layout import BlockSpec, Layout, MemoryKind
from slotfile.format.records import BlockExpect, CacheExpect, ModelExpect, RecExpect
from slotfile.format.types import TYPES
from slotfile.model.bridge import ModelInfo

# The expectation records live in slotfile.format.records (the reader's SlotFile carries them); they are
# re-exported here, where they are built.
__all__ = [
    "BlockExpect",
    "CacheExpect",
    "ModelExpect",
    "RecExpect",
    "block_spec",
    "describe_blocks",
    "expect_from_model",
    "layout_of",
    "rotation_widths",
]

MEMORY_CLASSES = (
    "none",
    "kv-cache",
    "iswa",
    "recurrent",
    "hybrid",
    "hybrid-iswa",
    "hybrid-idx",
    "dsa",
    "dsa-iswa",
    "msa",
    "dsv4",
    "unknown",
)

CELL_EXT = 12  # sizeof(llama_kv_cell_ext): i32 x, y, tok (src/llama-kv-cells.h)


class _Refused(Exception):
    """The metadata is one llama.cpp itself would refuse to load (or we cannot model)."""


_MISSING: Any = object()


# ---------------------------------------------------------------------------------------
# metadata access with llama_model_loader semantics
# ---------------------------------------------------------------------------------------


class _Keys:
    def __init__(self, info: ModelInfo) -> None:
        self.info = info

    def _full(self, key: str) -> str:
        return f"{self.info.arch}.{key}"

    def raw(self, key: str) -> Any:
        return self.info.get(key, _MISSING)

    def has(self, key: str) -> bool:
        return self.raw(key) is not _MISSING

    def scalar(self, key: str, default: Any = None, *, required: bool = False) -> Any:
        """``get_key``: an array where a scalar is expected is an error in llama.cpp."""
        v = self.raw(key)
        if v is _MISSING:
            if required:
                raise _Refused(f"key not found in model: {self._full(key)}")
            return default
        if isinstance(v, (list, tuple)):
            raise _Refused(f"{self._full(key)} is an array where llama.cpp reads a scalar")
        return v

    def key_or_arr(self, key: str, n: int, default: list[int], *, required: bool = False) -> list[int]:
        """``get_key_or_arr``: a scalar fills all n entries, an array must have exactly n."""
        v = self.raw(key)
        if v is _MISSING:
            if required:
                raise _Refused(f"key not found in model: {self._full(key)}")
            return list(default)
        if isinstance(v, (list, tuple)):
            if len(v) != n:
                raise _Refused(f"key {self._full(key)} has wrong array length; expected {n}, got {len(v)}")
            return [int(x) for x in v]
        return [int(v)] * n

    def arr(self, key: str, *, required: bool = False) -> list[int] | None:
        """``get_arr`` into a std::array: any length, the rest keeps its previous value."""
        v = self.raw(key)
        if not isinstance(v, (list, tuple)):
            if required:
                raise _Refused(f"array key not found in model: {self._full(key)}")
            return None
        return [int(x) for x in v]


# ---------------------------------------------------------------------------------------
# llama_hparams, reduced to what shapes the state
# ---------------------------------------------------------------------------------------


@dataclass
class _HParams:
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


def _base_hparams(info: ModelInfo, k: _Keys) -> _HParams:
    """The arch-independent part of ``llama_model_base::load_hparams``."""
    n = int(k.scalar("block_count", required=True))
    if not 0 < n <= 512:  # LLAMA_MAX_LAYERS
        raise _Refused(f"block_count {n} out of range (llama.cpp asserts 0 < n_layer <= 512)")
    nextn = int(k.scalar("nextn_predict_layers", 0))
    if nextn > n:
        raise _Refused(f"nextn_predict_layers {nextn} > block_count {n}")
    n_embd = int(k.scalar("embedding_length", required=True))
    n_head = k.key_or_arr("attention.head_count", n, [0] * n)
    # n_head_kv defaults to n_head, then may be a scalar or a per-layer array
    n_head_kv = k.key_or_arr("attention.head_count_kv", n, n_head)
    if n_head[0] > 0:  # "non-transformer models do not have attention heads": n_head() is layer 0
        hk = int(k.scalar("attention.key_length", n_embd // n_head[0]))
        hv = int(k.scalar("attention.value_length", n_embd // n_head[0]))
    else:
        hk = hv = 0
    return _HParams(
        arch=info.arch,
        n_layer_all=n,
        n_layer_nextn=nextn,
        n_embd=n_embd,
        n_ctx_train=int(k.scalar("context_length", required=True)),
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_ff=k.key_or_arr("feed_forward_length", n, [0] * n),
        head_k_full=hk,
        head_v_full=hv,
        head_k_swa=int(k.scalar("attention.key_length_swa", hk)),
        head_v_swa=int(k.scalar("attention.value_length_swa", hv)),
        is_swa=[False] * n,
        # std::fill(is_recr_impl, llm_arch_is_recurrent(arch))
        is_recr=[info.arch in RECURRENT] * n,
    )


# ---------------------------------------------------------------------------------------
# per-arch load_arch_hparams (only what shapes the state)
# ---------------------------------------------------------------------------------------

Hook = Callable[[_HParams, _Keys], None]


def _load_swa_pattern(hp: _HParams, k: _Keys, n_pattern: int, dense_first: bool = False) -> None:
    """llama_model_base::load_swa_pattern: a per-layer array wins, else a scalar period."""
    arr = k.arr("attention.sliding_window_pattern")
    if arr is not None:
        if len(arr) > 512:
            raise _Refused("sliding_window_pattern longer than LLAMA_MAX_LAYERS")
        for il, v in enumerate(arr[: hp.n_layer_all]):
            hp.is_swa[il] = bool(v)
        if len(arr) < hp.n_layer_all:
            hp.notes.append(
                f"sliding_window_pattern has {len(arr)} entries for {hp.n_layer_all} layers: "
                "the rest are dense (as llama.cpp reads it)"
            )
        return
    hp.set_swa_pattern(int(k.scalar("attention.sliding_window_pattern", n_pattern)), dense_first)


def _swa_always(n_pattern: int, *, dense_first: bool = False, n_swa: int | None = None) -> Hook:
    """gemma2 / cohere2 / gpt-oss style: SWA type set unconditionally, pattern with a default."""

    def hook(hp: _HParams, k: _Keys) -> None:
        hp.swa_type = "standard"
        hp.n_swa = int(k.scalar("attention.sliding_window", n_swa, required=n_swa is None))
        _load_swa_pattern(hp, k, n_pattern, dense_first)

    return hook


def _swa_if_window(n_pattern: int) -> Hook:
    """gemma3 / olmo2 style: SWA only when attention.sliding_window is present and > 0."""

    def hook(hp: _HParams, k: _Keys) -> None:
        n_swa = k.scalar("attention.sliding_window")
        if n_swa is not None and int(n_swa) > 0:
            hp.swa_type, hp.n_swa = "standard", int(n_swa)
            _load_swa_pattern(hp, k, n_pattern)

    return hook


def _hook_gemma3n(hp: _HParams, k: _Keys) -> None:
    _swa_always(5)(hp, k)
    hp.n_layer_kv_from_start = 20  # later layers reuse the KV of layer 18/19 (create_memory reuse)


def _hook_gemma4(hp: _HParams, k: _Keys) -> None:
    hp.swa_type = "standard"
    for il, v in enumerate((k.arr("attention.sliding_window_pattern", required=True) or [])[: hp.n_layer_all]):
        hp.is_swa[il] = bool(v)
    shared = int(k.scalar("attention.shared_kv_layers", 0))
    hp.n_layer_kv_from_start = hp.n_layer_all - shared
    hp.n_swa = int(k.scalar("attention.sliding_window", required=True))
    hp.head_k_swa = int(k.scalar("attention.key_length_swa", required=True))
    hp.head_v_swa = int(k.scalar("attention.value_length_swa", required=True))


def _hook_llama4(hp: _HParams, k: _Keys) -> None:
    n_swa = k.scalar("attention.sliding_window")
    if n_swa is not None and int(n_swa) == 0:
        return
    # no key at all means chunked attention with the Llama-4 defaults
    hp.swa_type, hp.n_swa = "chunked", 8192
    _load_swa_pattern(hp, k, 4)


def _hook_exaone4(hp: _HParams, k: _Keys) -> None:
    if hp.n_layer() == 64:  # only the 32B uses SWA
        hp.swa_type, hp.n_swa = "standard", 4096
        _load_swa_pattern(hp, k, 4)
    hp.n_swa = int(k.scalar("attention.sliding_window", hp.n_swa))


def _hook_swa_array(hp: _HParams, k: _Keys) -> None:
    """granite_swa: a required per-layer array."""
    hp.swa_type = "standard"
    for il, v in enumerate((k.arr("attention.sliding_window_pattern", required=True) or [])[: hp.n_layer_all]):
        hp.is_swa[il] = bool(v)
    hp.n_swa = int(k.scalar("attention.sliding_window", required=True))


def _hook_phi3(hp: _HParams, k: _Keys) -> None:
    n_swa = k.scalar("attention.sliding_window")
    if n_swa is not None and int(n_swa) > 0:
        hp.notes.append("phi3: the GGUF asks for SWA, but llama.cpp disables it (one plain KV cache)")
        hp.set_swa_pattern(1)


def _ssm(hp: _HParams, k: _Keys, *, groups: bool) -> None:
    hp.ssm_d_conv = int(k.scalar("ssm.conv_kernel", required=True))
    hp.ssm_d_inner = int(k.scalar("ssm.inner_size", required=True))
    hp.ssm_d_state = int(k.scalar("ssm.state_size", required=True))
    k.scalar("ssm.time_step_rank", required=True)
    if groups:
        hp.ssm_n_group = int(k.scalar("ssm.group_count", required=True))


def _recr_where_no_kv_heads(hp: _HParams) -> None:
    """jamba / granitehybrid / lfm2 / plamo2: a layer is recurrent iff n_head_kv(il) == 0
    (trunk layers only; NextN layers keep the default, i.e. attention)."""
    for il in range(hp.n_layer()):
        hp.is_recr[il] = hp.n_head_kv[il] == 0


def _hook_mamba(hp: _HParams, k: _Keys) -> None:
    _ssm(hp, k, groups=False)


def _hook_mamba2(hp: _HParams, k: _Keys) -> None:
    _ssm(hp, k, groups=True)


def _hook_rwkv(hp: _HParams, k: _Keys) -> None:
    hp.wkv_head_size = int(k.scalar("wkv.head_size", required=True))
    hp.token_shift_count = int(k.scalar("token_shift_count", 2))


def _hook_jamba(hp: _HParams, k: _Keys) -> None:
    _ssm(hp, k, groups=False)
    _recr_where_no_kv_heads(hp)


def _hook_granite_hybrid(hp: _HParams, k: _Keys) -> None:
    _ssm(hp, k, groups=True)
    _recr_where_no_kv_heads(hp)


def _hook_plamo2(hp: _HParams, k: _Keys) -> None:
    _ssm(hp, k, groups=True)
    # plamo2 re-reads the head sizes even when head_count is 0
    hp.head_k_full = int(k.scalar("attention.key_length", hp.head_k_full))
    hp.head_v_full = int(k.scalar("attention.value_length", hp.head_v_full))
    hp.head_k_swa, hp.head_v_swa = hp.head_k_full, hp.head_v_full
    _recr_where_no_kv_heads(hp)


def _hook_falcon_h1(hp: _HParams, k: _Keys) -> None:
    _ssm(hp, k, groups=True)
    hp.is_recr = [True] * hp.n_layer_all  # every layer is both attention and SSM


def _hook_lfm2(hp: _HParams, k: _Keys) -> None:
    hp.n_shortconv_l_cache = int(k.scalar("shortconv.l_cache", required=True))
    _recr_where_no_kv_heads(hp)
    n_swa = k.scalar("attention.sliding_window")
    if hp.arch == "lfm2" and n_swa is not None and int(n_swa) > 0:
        hp.swa_type, hp.n_swa = "standard", int(n_swa)
        for il in range(hp.n_layer()):  # every attention layer is SWA
            hp.is_swa[il] = not hp.is_recr[il]


def _hook_nemotron_h(hp: _HParams, k: _Keys) -> None:
    _ssm(hp, k, groups=True)
    # recurrent iff no KV heads and no FFN (MLP-only layers are neither); MTP blocks are dense
    for il in range(hp.n_layer_all):
        hp.is_recr[il] = il < hp.n_layer() and hp.n_head_kv[il] == 0 and hp.n_ff[il] == 0


def _hook_qwen3next(hp: _HParams, k: _Keys) -> None:
    if hp.arch in ("qwen35", "qwen35moe"):
        hp.rope_sections = k.key_or_arr("rope.dimension_sections", 4, [0] * 4, required=True)
    _ssm(hp, k, groups=True)
    if k.has("attention.recurrent_layers"):
        hp.is_recr = [bool(v) for v in k.key_or_arr("attention.recurrent_layers", hp.n_layer_all, [])]
        return
    interval = int(k.scalar("full_attention_interval", 4))
    if interval == 0:
        raise _Refused("full_attention_interval 0 (llama.cpp would divide by zero)")
    for il in range(hp.n_layer_all):
        hp.is_recr[il] = il < hp.n_layer() and (il + 1) % interval != 0


def _hook_deepseek2(hp: _HParams, k: _Keys) -> None:
    hp.head_k_mla = int(k.scalar("attention.key_length_mla", 0))
    hp.head_v_mla = int(k.scalar("attention.value_length_mla", 0))
    if (hp.head_k_mla == 0) != (hp.head_v_mla == 0):
        raise _Refused("only one of key_length_mla / value_length_mla is set (llama.cpp asserts both or none)")
    if hp.is_mla():
        hp.notes.append(
            "MLA: the KV cache holds the compressed latent + rope key only, no V (llama_kv_cache ctor: has_v = !is_mla)"
        )
    else:
        hp.notes.append("no key_length_mla/value_length_mla: an older non-MLA conversion, so K and V are both cached")


def _rope_sections(required: bool) -> Hook:
    def hook(hp: _HParams, k: _Keys) -> None:
        hp.rope_sections = k.key_or_arr("rope.dimension_sections", 4, [0] * 4, required=required)

    return hook


def _noop(hp: _HParams, k: _Keys) -> None:
    return None


# Archs whose load_arch_hparams touches none of the fields above (checked against the vendored
# src/models/*.cpp): one plain KV cache over every layer (NextN layers filtered out).
PLAIN = frozenset(
    {
        "llama",
        "llama-embed",
        "mistral3",
        "deci",
        "baichuan",
        "falcon",
        "grok",
        "gpt2",
        "gptneox",
        "mpt",
        "starcoder",
        "starcoder2",
        "refact",
        "bloom",
        "stablelm",
        "qwen",
        "qwen2",
        "qwen2moe",
        "qwen3",
        "qwen3moe",
        "phi2",
        "phimoe",
        "plamo",
        "codeshell",
        "orion",
        "internlm2",
        "minicpm",
        "minicpm3",
        "gemma",
        "xverse",
        "command-r",
        "dbrx",
        "olmo",
        "olmoe",
        "openelm",
        "arctic",
        "deepseek",
        "deepseek2-ocr",
        "chatglm",
        "bitnet",
        "jais",
        "jais2",
        "nemotron",
        "exaone",
        "granite",
        "granitemoe",
        "chameleon",
        "plm",
        "bailingmoe",
        "bailingmoe2",
        "seed_oss",
        "dots1",
        "arcee",
        "hunyuan-moe",
        "hy_v3",
        "smollm3",
        "grovemoe",
        "apertus",
        "minimax-m2",
        "cogvlm",
        "pangu-embedded",
        "maincoder",
        "talkie",
    }
)

HOOKS: dict[str, Hook] = {a: _noop for a in PLAIN}
HOOKS.update(
    {
        "phi3": _hook_phi3,
        "gemma2": _swa_always(2, n_swa=4096),
        "gemma3": _swa_if_window(6),
        "gemma3n": _hook_gemma3n,
        "gemma4": _hook_gemma4,
        "cohere2": _swa_always(4),
        "cohere2moe": _swa_always(4, dense_first=True),
        "gpt-oss": _swa_always(2),
        "olmo2": _swa_if_window(4),
        "exaone4": _hook_exaone4,
        "llama4": _hook_llama4,
        "granite_swa": _hook_swa_array,
        "qwen2vl": _rope_sections(True),
        "qwen3vl": _rope_sections(True),
        "qwen3vlmoe": _rope_sections(True),
        "paddleocr": _rope_sections(False),
        "ernie4_5": _rope_sections(False),
        "ernie4_5-moe": _rope_sections(False),
        "glm4": _rope_sections(False),
        "glm4moe": _rope_sections(False),
        "deepseek2": _hook_deepseek2,
        "mistral4": _hook_deepseek2,  # llama_model_mistral4 derives from llama_model_deepseek2
        "mamba": _hook_mamba,
        "mamba2": _hook_mamba2,
        "rwkv6": _hook_rwkv,
        "rwkv6qwen2": _hook_rwkv,
        "rwkv7": _hook_rwkv,
        "arwkv7": _hook_rwkv,
        "jamba": _hook_jamba,
        "granitehybrid": _hook_granite_hybrid,
        "plamo2": _hook_plamo2,
        "falcon-h1": _hook_falcon_h1,
        "lfm2": _hook_lfm2,
        "lfm2moe": _hook_lfm2,
        "nemotron_h": _hook_nemotron_h,
        "nemotron_h_moe": _hook_nemotron_h,
        "qwen3next": _hook_qwen3next,
        "qwen35": _hook_qwen3next,
        "qwen35moe": _hook_qwen3next,
    }
)

# llm_arch_is_recurrent / llm_arch_is_hybrid (src/llama-arch.cpp)
RECURRENT = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})
HYBRID = frozenset(
    {
        "jamba",
        "falcon-h1",
        "plamo2",
        "granitehybrid",
        "lfm2",
        "lfm2moe",
        "nemotron_h",
        "nemotron_h_moe",
        "qwen3next",
        "kimi-linear",
        "bailingmoe3",
        "kimi-k3",
        "glm5-next",
        "qwen35",
        "qwen35moe",
        "qwen4exp",
        "deepseek4",
        "minimax-01",
    }
)
# create_memory: res = nullptr
NO_MEMORY = frozenset(
    {
        "bert",
        "jina-bert-v2",
        "jina-bert-v3",
        "nomic-bert",
        "nomic-bert-moe",
        "neo-bert",
        "eurobert",
        "wavtokenizer-dec",
        "modern-bert",
        "gemma-embedding",
        "dream",
        "llada",
        "llada-moe",
        "rnd1",
    }
)
# create_memory's explicit cases whose caches are not modelled here
SPECIAL_CLASS = {
    "minimax-m3": "msa",
    "glm-dsa": "dsa",
    "deepseek32": "dsa",
    "hy_v4": "dsa",
    "dots3note": "dsa-iswa",
    "deepseek4": "dsv4",
    "glm5-next": "hybrid-idx",
    "qwen4exp": "hybrid-idx",
}

# llama_model_rope_type: M-RoPE / IMRoPE archs carry the 12-byte cell ext (n_pos_per_embd() == 4)
MROPE_ALWAYS = frozenset(
    {"qwen2vl", "paddleocr", "qwen3vl", "qwen3vlmoe", "qwen35", "qwen35moe", "qwen4exp", "qwen3tts"}
)
MROPE_IF_SECTIONS = frozenset({"glm4", "glm4moe", "hunyuan_vl", "bailingmoe3"})  # hparams.use_mrope()


# ---------------------------------------------------------------------------------------
# create_memory
# ---------------------------------------------------------------------------------------


def _kv(hp: _HParams, role: str, keep: Callable[[int], bool]) -> CacheExpect:
    """The layers a ``llama_kv_cache`` holds: has_kv(il) and the filter; reused layers
    (gemma3n/gemma4 ``reuse``) have no KV of their own and are not written again."""
    layers = tuple(il for il in range(hp.n_layer_all) if hp.has_kv(il) and keep(il))
    k = tuple(hp.n_embd_k_gqa(il) for il in layers)
    v = () if hp.is_mla() else tuple(hp.n_embd_v_gqa(il) for il in layers)
    return CacheExpect(
        role,
        layers,
        k,
        v,
        head_k=_head_all([hp.head_k(il) for il in layers]),
        head_v=0 if hp.is_mla() else _head_all([hp.head_v(il) for il in layers]),
        head_k_first=hp.head_k(0),
        head_v_first=hp.head_v(0),
    )


def _head_all(heads: list[int]) -> int:
    """``n_embd_head_k_all`` / ``_v_all`` of the llama_kv_cache ctor: the head size every layer of
    the cache shares, -1 when they differ, 0 when the cache has no layer."""
    if not heads:
        return 0
    return heads[0] if all(h == heads[0] for h in heads) else -1


# llama_kv_cache ctor (llama.cpp 2026-10-06): the archs whose DeepSeek/GLM lightning indexer
# cache (n_embd_head_k_full == indexer_head_size) is always rotated, whatever its type.  Their
# memory classes (DSA, DSV4, DSA-iSWA) are not modelled here, so no CacheExpect sets it yet.
ROT_K_ALWAYS_ARCHS = frozenset({"deepseek32", "deepseek4", "glm-dsa", "dots3note"})
ROT_MIN = 64  # the smallest Hadamard rotation llama.cpp applies


def attn_rot_disabled() -> bool:
    """``LLAMA_ATTN_ROT_DISABLE`` as llama.cpp reads it (``atoi(getenv(...))``): a llama.cpp run
    with it set writes, and expects, 0 for every rotation width but the indexers'."""
    raw = os.environ.get("LLAMA_ATTN_ROT_DISABLE")
    if raw is None:
        return False
    m = re.match(r"\s*([+-]?\d+)", raw)
    return bool(m and int(m.group(1)))


def is_quantized(type_id: int) -> bool:
    """``ggml_is_quantized``: every type of more than one element per block."""
    t = TYPES.get(type_id)
    return t is not None and t.blck_size > 1


def rotation_widths(
    cache: CacheExpect, type_k: int, type_v: int | None, *, disabled: bool | None = None
) -> tuple[int, int]:
    """``(n_rot_k, n_rot_v)`` a llama.cpp of state version 4 computes for ``cache`` with these K/V
    cache types (the llama_kv_cache constructor; version 3 rotates with the same rule, it only
    does not record it).  ``disabled``: LLAMA_ATTN_ROT_DISABLE (default: this process's)."""
    off = attn_rot_disabled() if disabled is None else disabled
    rot_k = not off and cache.head_k > 0 and is_quantized(type_k) and cache.head_k_first % ROT_MIN == 0
    rot_k = rot_k or cache.rot_k_always
    rot_v = (
        not off
        and cache.head_v > 0
        and type_v is not None
        and is_quantized(type_v)
        and cache.head_v_first % ROT_MIN == 0
    )
    n_rot_k = 0
    if rot_k:
        n_rot_k = ROT_MIN
        # `n_embd_head_k_all % (2*n_rot_k)` is an int modulo an unsigned: -1 (mixed heads) stops at 64
        while cache.head_k > 0 and cache.head_k % (2 * n_rot_k) == 0:
            n_rot_k *= 2
    return n_rot_k, ROT_MIN if rot_v else 0


def _rec(hp: _HParams, keep: Callable[[int], bool]) -> RecExpect:
    # llama_memory_recurrent iterates hparams.n_layer(), not n_layer_all
    layers = tuple(il for il in range(hp.n_layer()) if keep(il))
    return RecExpect(hp.n_layer(), layers, hp.n_embd_r(), hp.n_embd_s(), has_p=False)


def _iswa(hp: _HParams, keep: Callable[[int], bool]) -> tuple[CacheExpect, CacheExpect]:
    """llama_kv_cache_iswa: kv_base (!is_swa) then kv_swa (is_swa), both behind ``keep``."""
    if not any(hp.is_swa[il] for il in range(hp.n_layer_all)):
        raise _Refused("SWA is enabled but no layer is SWA (llama.cpp asserts is_swa_any())")
    base = _kv(hp, "kv-base", lambda il: keep(il) and not hp.is_swa[il])
    swa = _kv(hp, "kv-swa", lambda il: keep(il) and hp.is_swa[il])
    return base, swa


def _hybrid_filters(hp: _HParams) -> tuple[Callable[[int], bool], Callable[[int], bool]]:
    """The (filter_attn, filter_recr) pair create_memory picks for a hybrid arch."""
    a = hp.arch
    if a == "falcon-h1":
        return (lambda il: True), (lambda il: True)
    if a in ("nemotron_h", "nemotron_h_moe"):
        return (lambda il: not hp.is_recr[il] and hp.n_ff[il] == 0), (lambda il: hp.is_recr[il] and hp.n_ff[il] == 0)
    if a in ("qwen3next", "qwen35", "qwen35moe", "qwen4exp", "minimax-01"):
        n = hp.n_layer()
        return (lambda il: il < n and not hp.is_recr[il]), (lambda il: il < n and hp.is_recr[il])
    # llama_memory_hybrid's defaults for a null filter
    return (lambda il: not hp.is_recr[il]), (lambda il: hp.is_recr[il])


def _plan(hp: _HParams) -> tuple[str, tuple[BlockExpect, ...], tuple[BlockExpect, ...]]:
    """(memory class, full-save blocks, PARTIAL_ONLY blocks) for the main (target) context."""
    if hp.arch in RECURRENT:
        rec = _rec(hp, lambda il: True)  # the pure recurrent memory has no filter
        return "recurrent", (rec,), (rec,)
    if hp.arch in HYBRID:
        f_attn, f_recr = _hybrid_filters(hp)
        rec = _rec(hp, f_recr)
        if hp.swa_type != "none":
            base, swa = _iswa(hp, f_attn)
            # hybrid_iswa passes the flags on: the iSWA part drops kv_base under PARTIAL_ONLY
            return "hybrid-iswa", (base, swa, rec), (swa, rec)
        # llama_memory_hybrid::state_write skips the attention KV under PARTIAL_ONLY
        return "hybrid", (_kv(hp, "kv", f_attn), rec), (rec,)
    # the non-hybrid default branch: NextN layers are filtered out of the trunk's cache
    n = hp.n_layer()
    keep: Callable[[int], bool] = (lambda il: il < n) if hp.n_layer_nextn > 0 and n > 0 else (lambda il: True)
    if hp.swa_type != "none":
        base, swa = _iswa(hp, keep)
        return "iswa", (base, swa), (swa,)
    if any(hp.is_swa):
        raise _Refused("SWA layers without an SWA type (llama.cpp asserts !is_swa_any())")
    kv = _kv(hp, "kv", keep)
    return "kv-cache", (kv,), (kv,)  # plain llama_kv_cache ignores PARTIAL_ONLY


def _cell_ext(hp: _HParams) -> int:
    """llama_kv_cache::has_cell_ext: n_pos_per_embd() > 1 (M-RoPE / IMRoPE) or PLE heads."""
    s = hp.rope_sections
    if hp.arch in MROPE_ALWAYS or (hp.arch in MROPE_IF_SECTIONS and s[0] > 0 and s[1] > 0):
        return CELL_EXT
    return 0


def _n_vocab(info: ModelInfo, k: _Keys) -> int:
    if info.n_vocab:
        return info.n_vocab  # llama_vocab::n_tokens(): the tokenizer list
    v = k.scalar("vocab_size")
    return int(v) if v is not None else 0


def expect_from_model(info: ModelInfo) -> ModelExpect:
    """What ``info``'s model makes llama.cpp write for one sequence of the target context."""
    k = _Keys(info)
    arch = info.arch

    def plain(cls: str, note: str, n_layer: int = 0, n_ctx: int = 0) -> ModelExpect:
        return ModelExpect(arch, cls, (), (), 0, _n_vocab(info, k), n_ctx, n_layer, (note,))

    def sizes() -> tuple[int, int]:
        try:
            nl = int(k.scalar("block_count", 0)) - int(k.scalar("nextn_predict_layers", 0))
            return nl, int(k.scalar("context_length", 0))
        except (_Refused, TypeError, ValueError):
            return 0, 0

    if not arch:
        return plain("unknown", "the GGUF has no general.architecture")
    if arch in NO_MEMORY:
        return plain("none", f"{arch}: create_memory makes no memory module, so the body is empty", *sizes())
    if arch in SPECIAL_CLASS:
        cls = SPECIAL_CLASS[arch]
        if arch == "hy_v4" and not k.scalar("attention.indexer.top_k", 0):
            cls = "kv-cache"  # a full-attention checkpoint: no indexer, one plain KV cache
        return plain(
            cls,
            f"{arch}: the per-layer shape of its {cls} memory is not modelled; "
            "blocks cannot be checked against the model",
            *sizes(),
        )
    hook = HOOKS.get(arch)
    if hook is None:
        return plain(
            "unknown",
            f"arch {arch!r} is not modelled by slotfile.model.expect; the block layout comes from the bytes alone",
            *sizes(),
        )
    try:
        hp = _base_hparams(info, k)
        hook(hp, k)
        cls, blocks, partial = _plan(hp)
    except _Refused as e:
        return plain("unknown", f"{arch}: {e}", *sizes())
    except (TypeError, ValueError) as e:
        return plain("unknown", f"{arch}: unreadable metadata ({e})", *sizes())
    notes = list(hp.notes)
    if hp.n_layer_nextn:
        notes.append(
            f"{hp.n_layer_nextn} NextN/MTP layer(s) excluded from the trunk caches; a draft (MTP) "
            "context would hold only those"
        )
    ext = _cell_ext(hp) if any(b.kind == MemoryKind.KV for b in blocks) else 0
    return ModelExpect(arch, cls, blocks, partial, ext, _n_vocab(info, k), hp.n_ctx_train, hp.n_layer(), tuple(notes))


# ---------------------------------------------------------------------------------------
# the expectation as a layout
# ---------------------------------------------------------------------------------------


def block_spec(b: BlockExpect) -> BlockSpec:
    if isinstance(b, CacheExpect):
        return BlockSpec(MemoryKind.KV, has_v=b.has_v)
    return BlockSpec(MemoryKind.REC, True, len(b.layers), b.has_p)


def layout_of(exp: ModelExpect, partial: bool = False) -> Layout:
    """The :class:`Layout` the model implies (what ``layout.detect(fixed=...)`` takes)."""
    blocks = exp.partial_blocks if partial else exp.blocks
    ext = exp.cell_ext if any(b.kind == MemoryKind.KV for b in blocks) else 0
    return Layout(tuple(block_spec(b) for b in blocks), ext)


def describe_blocks(blocks: tuple[BlockExpect, ...]) -> str:
    return " + ".join(block_spec(b).describe() for b in blocks) or "an empty body"
