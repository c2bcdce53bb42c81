"""Per-arch hparams: the arch-independent part of ``llama_model_base::load_hparams`` and, for
each modelled arch, what its ``load_arch_hparams`` (src/models/*.cpp) sets that shapes the state
(SWA patterns, recurrent layer maps, head sizes); plus the arch tables of src/llama-arch.cpp
(recurrent, hybrid, no memory) and the M-RoPE archs that carry the 12-byte cell ext."""

from __future__ import annotations

from collections.abc import Callable

from slotfile.model.bridge import ModelInfo
from slotfile.model.hparams import HParams, Keys, Refused


def base_hparams(info: ModelInfo, k: Keys) -> HParams:
    """The arch-independent part of ``llama_model_base::load_hparams``."""
    n = int(k.scalar("block_count", required=True))
    if not 0 < n <= 512:  # LLAMA_MAX_LAYERS
        raise Refused(f"block_count {n} out of range (llama.cpp asserts 0 < n_layer <= 512)")
    nextn = int(k.scalar("nextn_predict_layers", 0))
    if nextn > n:
        raise Refused(f"nextn_predict_layers {nextn} > block_count {n}")
    n_embd = int(k.scalar("embedding_length", required=True))
    n_head = k.key_or_arr("attention.head_count", n, [0] * n)
    # n_head_kv defaults to n_head, then may be a scalar or a per-layer array
    n_head_kv = k.key_or_arr("attention.head_count_kv", n, n_head)
    if n_head[0] > 0:  # "non-transformer models do not have attention heads": n_head() is layer 0
        hk = int(k.scalar("attention.key_length", n_embd // n_head[0]))
        hv = int(k.scalar("attention.value_length", n_embd // n_head[0]))
    else:
        hk = hv = 0
    return HParams(
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

Hook = Callable[[HParams, Keys], None]


def _load_swa_pattern(hp: HParams, k: Keys, n_pattern: int, dense_first: bool = False) -> None:
    """llama_model_base::load_swa_pattern: a per-layer array wins, else a scalar period."""
    arr = k.arr("attention.sliding_window_pattern")
    if arr is not None:
        if len(arr) > 512:
            raise Refused("sliding_window_pattern longer than LLAMA_MAX_LAYERS")
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

    def hook(hp: HParams, k: Keys) -> None:
        hp.swa_type = "standard"
        hp.n_swa = int(k.scalar("attention.sliding_window", n_swa, required=n_swa is None))
        _load_swa_pattern(hp, k, n_pattern, dense_first)

    return hook


def _swa_if_window(n_pattern: int) -> Hook:
    """gemma3 / olmo2 style: SWA only when attention.sliding_window is present and > 0."""

    def hook(hp: HParams, k: Keys) -> None:
        n_swa = k.scalar("attention.sliding_window")
        if n_swa is not None and int(n_swa) > 0:
            hp.swa_type, hp.n_swa = "standard", int(n_swa)
            _load_swa_pattern(hp, k, n_pattern)

    return hook


def _hook_gemma3n(hp: HParams, k: Keys) -> None:
    _swa_always(5)(hp, k)
    hp.n_layer_kv_from_start = 20  # later layers reuse the KV of layer 18/19 (create_memory reuse)


def _hook_gemma4(hp: HParams, k: Keys) -> None:
    hp.swa_type = "standard"
    for il, v in enumerate((k.arr("attention.sliding_window_pattern", required=True) or [])[: hp.n_layer_all]):
        hp.is_swa[il] = bool(v)
    shared = int(k.scalar("attention.shared_kv_layers", 0))
    hp.n_layer_kv_from_start = hp.n_layer_all - shared
    hp.n_swa = int(k.scalar("attention.sliding_window", required=True))
    hp.head_k_swa = int(k.scalar("attention.key_length_swa", required=True))
    hp.head_v_swa = int(k.scalar("attention.value_length_swa", required=True))


def _hook_llama4(hp: HParams, k: Keys) -> None:
    n_swa = k.scalar("attention.sliding_window")
    if n_swa is not None and int(n_swa) == 0:
        return
    # no key at all means chunked attention with the Llama-4 defaults
    hp.swa_type, hp.n_swa = "chunked", 8192
    _load_swa_pattern(hp, k, 4)


def _hook_exaone4(hp: HParams, k: Keys) -> None:
    if hp.n_layer() == 64:  # only the 32B uses SWA
        hp.swa_type, hp.n_swa = "standard", 4096
        _load_swa_pattern(hp, k, 4)
    hp.n_swa = int(k.scalar("attention.sliding_window", hp.n_swa))


def _hook_swa_array(hp: HParams, k: Keys) -> None:
    """granite_swa: a required per-layer array."""
    hp.swa_type = "standard"
    for il, v in enumerate((k.arr("attention.sliding_window_pattern", required=True) or [])[: hp.n_layer_all]):
        hp.is_swa[il] = bool(v)
    hp.n_swa = int(k.scalar("attention.sliding_window", required=True))


def _hook_phi3(hp: HParams, k: Keys) -> None:
    n_swa = k.scalar("attention.sliding_window")
    if n_swa is not None and int(n_swa) > 0:
        hp.notes.append("phi3: the GGUF asks for SWA, but llama.cpp disables it (one plain KV cache)")
        hp.set_swa_pattern(1)


def _ssm(hp: HParams, k: Keys, *, groups: bool) -> None:
    hp.ssm_d_conv = int(k.scalar("ssm.conv_kernel", required=True))
    hp.ssm_d_inner = int(k.scalar("ssm.inner_size", required=True))
    hp.ssm_d_state = int(k.scalar("ssm.state_size", required=True))
    k.scalar("ssm.time_step_rank", required=True)
    if groups:
        hp.ssm_n_group = int(k.scalar("ssm.group_count", required=True))


def _recr_where_no_kv_heads(hp: HParams) -> None:
    """jamba / granitehybrid / lfm2 / plamo2: a layer is recurrent iff n_head_kv(il) == 0
    (trunk layers only; NextN layers keep the default, i.e. attention)."""
    for il in range(hp.n_layer()):
        hp.is_recr[il] = hp.n_head_kv[il] == 0


def _hook_mamba(hp: HParams, k: Keys) -> None:
    _ssm(hp, k, groups=False)


def _hook_mamba2(hp: HParams, k: Keys) -> None:
    _ssm(hp, k, groups=True)


def _hook_rwkv(hp: HParams, k: Keys) -> None:
    hp.wkv_head_size = int(k.scalar("wkv.head_size", required=True))
    hp.token_shift_count = int(k.scalar("token_shift_count", 2))


def _hook_jamba(hp: HParams, k: Keys) -> None:
    _ssm(hp, k, groups=False)
    _recr_where_no_kv_heads(hp)


def _hook_granite_hybrid(hp: HParams, k: Keys) -> None:
    _ssm(hp, k, groups=True)
    _recr_where_no_kv_heads(hp)


def _hook_plamo2(hp: HParams, k: Keys) -> None:
    _ssm(hp, k, groups=True)
    # plamo2 re-reads the head sizes even when head_count is 0
    hp.head_k_full = int(k.scalar("attention.key_length", hp.head_k_full))
    hp.head_v_full = int(k.scalar("attention.value_length", hp.head_v_full))
    hp.head_k_swa, hp.head_v_swa = hp.head_k_full, hp.head_v_full
    _recr_where_no_kv_heads(hp)


def _hook_falcon_h1(hp: HParams, k: Keys) -> None:
    _ssm(hp, k, groups=True)
    hp.is_recr = [True] * hp.n_layer_all  # every layer is both attention and SSM


def _hook_lfm2(hp: HParams, k: Keys) -> None:
    hp.n_shortconv_l_cache = int(k.scalar("shortconv.l_cache", required=True))
    _recr_where_no_kv_heads(hp)
    n_swa = k.scalar("attention.sliding_window")
    if hp.arch == "lfm2" and n_swa is not None and int(n_swa) > 0:
        hp.swa_type, hp.n_swa = "standard", int(n_swa)
        for il in range(hp.n_layer()):  # every attention layer is SWA
            hp.is_swa[il] = not hp.is_recr[il]


def _hook_nemotron_h(hp: HParams, k: Keys) -> None:
    _ssm(hp, k, groups=True)
    # recurrent iff no KV heads and no FFN (MLP-only layers are neither); MTP blocks are dense
    for il in range(hp.n_layer_all):
        hp.is_recr[il] = il < hp.n_layer() and hp.n_head_kv[il] == 0 and hp.n_ff[il] == 0


def _hook_qwen3next(hp: HParams, k: Keys) -> None:
    if hp.arch in ("qwen35", "qwen35moe"):
        hp.rope_sections = k.key_or_arr("rope.dimension_sections", 4, [0] * 4, required=True)
    _ssm(hp, k, groups=True)
    if k.has("attention.recurrent_layers"):
        hp.is_recr = [bool(v) for v in k.key_or_arr("attention.recurrent_layers", hp.n_layer_all, [])]
        return
    interval = int(k.scalar("full_attention_interval", 4))
    if interval == 0:
        raise Refused("full_attention_interval 0 (llama.cpp would divide by zero)")
    for il in range(hp.n_layer_all):
        hp.is_recr[il] = il < hp.n_layer() and (il + 1) % interval != 0


def _hook_deepseek2(hp: HParams, k: Keys) -> None:
    hp.head_k_mla = int(k.scalar("attention.key_length_mla", 0))
    hp.head_v_mla = int(k.scalar("attention.value_length_mla", 0))
    if (hp.head_k_mla == 0) != (hp.head_v_mla == 0):
        raise Refused("only one of key_length_mla / value_length_mla is set (llama.cpp asserts both or none)")
    if hp.is_mla():
        hp.notes.append(
            "MLA: the KV cache holds the compressed latent + rope key only, no V (llama_kv_cache ctor: has_v = !is_mla)"
        )
    else:
        hp.notes.append("no key_length_mla/value_length_mla: an older non-MLA conversion, so K and V are both cached")


def _rope_sections(required: bool) -> Hook:
    def hook(hp: HParams, k: Keys) -> None:
        hp.rope_sections = k.key_or_arr("rope.dimension_sections", 4, [0] * 4, required=required)

    return hook


def _noop(hp: HParams, k: Keys) -> None:
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
