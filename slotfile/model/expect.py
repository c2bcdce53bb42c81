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

from slotfile.format.layout import BlockSpec, Layout, MemoryKind
from slotfile.format.records import BlockExpect, CacheExpect, ModelExpect, RecExpect
from slotfile.format.types import TYPES
from slotfile.model.archs import (
    HOOKS,
    HYBRID,
    MROPE_ALWAYS,
    MROPE_IF_SECTIONS,
    NO_MEMORY,
    RECURRENT,
    SPECIAL_CLASS,
    base_hparams,
)
from slotfile.model.bridge import ModelInfo
from slotfile.model.hparams import CELL_EXT, HParams, Keys, Refused
from slotfile.text import count

# The expectation records are defined in slotfile.format.records (the reader's SlotFile carries
# them) and re-exported here, where they are built.  The per-arch hparams are in
# slotfile.model.archs and slotfile.model.hparams.
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

# ---------------------------------------------------------------------------------------
# create_memory
# ---------------------------------------------------------------------------------------


def _kv(hp: HParams, role: str, keep: Callable[[int], bool]) -> CacheExpect:
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


# The llama_kv_cache ctor (llama.cpp 2026-10-06) also always rotates the lightning indexer cache
# of the DeepSeek/GLM DSA archs; those memory classes are not modelled, so no CacheExpect needs it.
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


def _rec(hp: HParams, keep: Callable[[int], bool]) -> RecExpect:
    # llama_memory_recurrent iterates hparams.n_layer(), not n_layer_all
    layers = tuple(il for il in range(hp.n_layer()) if keep(il))
    return RecExpect(hp.n_layer(), layers, hp.n_embd_r(), hp.n_embd_s(), has_p=False)


def _iswa(hp: HParams, keep: Callable[[int], bool]) -> tuple[CacheExpect, CacheExpect]:
    """llama_kv_cache_iswa: kv_base (!is_swa) then kv_swa (is_swa), both behind ``keep``."""
    if not any(hp.is_swa[il] for il in range(hp.n_layer_all)):
        raise Refused("SWA is enabled but no layer is SWA (llama.cpp asserts is_swa_any())")
    base = _kv(hp, "kv-base", lambda il: keep(il) and not hp.is_swa[il])
    swa = _kv(hp, "kv-swa", lambda il: keep(il) and hp.is_swa[il])
    return base, swa


def _hybrid_filters(hp: HParams) -> tuple[Callable[[int], bool], Callable[[int], bool]]:
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


def _plan(hp: HParams) -> tuple[str, tuple[BlockExpect, ...], tuple[BlockExpect, ...]]:
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
        raise Refused("SWA layers without an SWA type (llama.cpp asserts !is_swa_any())")
    kv = _kv(hp, "kv", keep)
    return "kv-cache", (kv,), (kv,)  # plain llama_kv_cache ignores PARTIAL_ONLY


def _cell_ext(hp: HParams) -> int:
    """llama_kv_cache::has_cell_ext: n_pos_per_embd() > 1 (M-RoPE / IMRoPE) or PLE heads."""
    s = hp.rope_sections
    if hp.arch in MROPE_ALWAYS or (hp.arch in MROPE_IF_SECTIONS and s[0] > 0 and s[1] > 0):
        return CELL_EXT
    return 0


def _n_vocab(info: ModelInfo, k: Keys) -> int:
    if info.n_vocab:
        return info.n_vocab  # llama_vocab::n_tokens(): the tokenizer list
    v = k.scalar("vocab_size")
    return int(v) if v is not None else 0


def expect_from_model(info: ModelInfo) -> ModelExpect:
    """What ``info``'s model makes llama.cpp write for one sequence of the target context."""
    k = Keys(info)
    arch = info.arch

    def plain(cls: str, note: str, n_layer: int = 0, n_ctx: int = 0) -> ModelExpect:
        return ModelExpect(arch, cls, (), (), 0, _n_vocab(info, k), n_ctx, n_layer, (note,))

    def sizes() -> tuple[int, int]:
        try:
            nl = int(k.scalar("block_count", 0)) - int(k.scalar("nextn_predict_layers", 0))
            return nl, int(k.scalar("context_length", 0))
        except (Refused, TypeError, ValueError):
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
        hp = base_hparams(info, k)
        hook(hp, k)
        cls, blocks, partial = _plan(hp)
    except Refused as e:
        return plain("unknown", f"{arch}: {e}", *sizes())
    except (TypeError, ValueError) as e:
        return plain("unknown", f"{arch}: unreadable metadata ({e})", *sizes())
    notes = list(hp.notes)
    if hp.n_layer_nextn:
        notes.append(
            f"{count(hp.n_layer_nextn, 'NextN/MTP layer')} excluded from the trunk caches; a draft (MTP) "
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
