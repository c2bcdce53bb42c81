"""The llama-server flags that decide whether a slot file restores, read from its command line.

``parse_server_args("llama-server -m m.gguf -c 8192 -np 2 -fa off")`` gives a
:class:`ServerSettings`.  Spellings, defaults and value words are those of ``common/arg.cpp``
(``common_params_parser_init``) and ``tools/server/server.cpp`` in the llama.cpp tree vendored by
llama-cpp-python 0.3.36:

* ``-m/--model FNAME``: the model the server runs (the file has no model identity; it is
  checked against this model's layout);
* ``-c/--ctx-size N`` (default 0 = the model's n_ctx_train); llama_context pads n_ctx to 256
  and, without a unified cache, gives each slot ``n_ctx_seq = pad256(n_ctx / n_parallel)``
  cells (``llama_context::llama_context``); a slot's context is ``min(n_ctx_seq,
  --kv-unified-per-slot, n_ctx_train)`` (``server_context::n_ctx_slot``), and a restore of more
  tokens fails with "Restored prompt does not fit in the slot context";
* ``-np/--parallel N`` (default -1 = auto: 4 slots *and* a unified cache, server.cpp);
* ``-kvu/--kv-unified``, ``-no-kvu/--no-kv-unified`` (default off, on with ``-np`` auto):
  one KV stream for all slots; otherwise one stream per slot, and a file restores only into
  a cache with its stream count (``llama_kv_cache::state_read``: "n_stream mismatch");
* ``--kv-unified-per-slot N``: caps the slot context; without ``-c`` the pool is
  ``n_parallel * N``;
* ``-fa/--flash-attn on|off|auto`` (also enabled/true/1, disabled/false/0, -1; default auto).
  The KV cache is created with ``v_trans = !flash_attn`` *before* auto is resolved, and auto
  starts as enabled, so auto stores V as rows like ``on``;
* ``-ctk/--cache-type-k``, ``-ctv/--cache-type-v TYPE`` (f32 f16 bf16 q8_0 q4_0 q4_1 iq4_nl
  q5_0 q5_1; default f16); a quantized V cache needs flash attention;
* ``--swa-full`` and ``-ub/--ubatch-size N`` (default 512): size the SWA cache of iSWA models
  (``pad256(min(n_ctx, n_swa * (unified ? n_parallel : 1) + n_ubatch))`` cells);
* ``-md/--model-draft``, ``-ctkd/-ctvd``: the draft model and its cache types (SDFT state);
* ``-ctxcp/--ctx-checkpoints N`` (default 32; 0: the server keeps no context checkpoints);
* ``-ngl/--n-gpu-layers``, ``-b/--batch-size``, ``--slot-save-path``, ``-nkvo``, ``--fit``:
  read and reported, they do not change what a file must look like.

Every other llama-server flag (the table below, extracted from arg.cpp) is accepted and
ignored; an unknown flag is an error.  As in llama.cpp, ``_`` in a ``--long_flag`` reads as
``-`` and the first word may be the binary's path.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from slotfile.format.types import BY_NAME, KV_CACHE_TYPES, TRANSPOSABLE
from slotfile.llama.worker.settings import CTX_PAD, LoadSettings

__all__ = ["ServerArgsError", "ServerSettings", "parse_server_args"]

AUTO_SLOTS = 4  # server.cpp: -np auto = 4 slots with a unified KV cache
DEFAULT_UBATCH = 512
TRUTHY = ("on", "enabled", "true", "1")
FALSEY = ("off", "disabled", "false", "0")
AUTOY = ("auto", "-1")


class ServerArgsError(ValueError):
    """The command line cannot be read: one line naming the flag."""


@dataclass(frozen=True)
class ServerSettings:
    """What a llama-server started with these flags offers a slot file."""

    model: str | None = None
    draft_model: str | None = None
    n_ctx: int = 0  # -c as given; 0: the model's n_ctx_train
    n_parallel: int = AUTO_SLOTS  # resolved: auto is 4
    parallel_auto: bool = True
    kv_unified: bool = True  # resolved
    flash_attn: str = "auto"  # on | off | auto
    type_k: str = "f16"
    type_v: str = "f16"
    type_k_draft: str = "f16"
    type_v_draft: str = "f16"
    swa_full: bool = False
    n_ubatch: int = DEFAULT_UBATCH
    n_batch: int = 2048
    kv_unified_per_slot: int = 0
    ctx_checkpoints: int = 32
    n_gpu_layers: int | None = None
    slot_save_path: str | None = None
    ignored: tuple[str, ...] = ()  # known flags that do not decide restorability
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def n_stream(self) -> int:
        """KV streams of the server's cache: one per slot, or one shared."""
        return 1 if self.kv_unified else self.n_parallel

    @property
    def fa_on(self) -> bool:
        """Flash attention as the V layout sees it (auto stores V as rows, see the module doc)."""
        return self.flash_attn != "off"

    def pool_ctx(self, n_ctx_train: int) -> int:
        """llama_context's n_ctx: -c (0: n_ctx_train; with --kv-unified-per-slot and no -c,
        n_parallel * N), padded to 256."""
        n = self.n_ctx
        if n == 0 and self.kv_unified_per_slot > 0:
            n = self.n_parallel * self.kv_unified_per_slot
        if n == 0:
            n = n_ctx_train
        return -(-n // CTX_PAD) * CTX_PAD

    def n_ctx_seq(self, n_ctx_train: int) -> int:
        """Cells of one stream (llama_context: n_ctx with a unified cache, else pad256(n_ctx / n_seq))."""
        n = self.pool_ctx(n_ctx_train)
        if self.kv_unified:
            return n
        return -(-(n // self.n_parallel) // CTX_PAD) * CTX_PAD

    def slot_ctx(self, n_ctx_train: int) -> int:
        """server_context::n_ctx_slot: the most tokens a slot holds (and restores)."""
        res = self.n_ctx_seq(n_ctx_train)
        if self.kv_unified_per_slot > 0:
            res = min(res, self.kv_unified_per_slot)
        return min(res, n_ctx_train) if n_ctx_train > 0 else res

    def type_id(self, which: str) -> int:
        return BY_NAME[self.type_k if which == "k" else self.type_v].id

    def load_settings(self, n_ctx_train: int, need_cells: int, n_gpu_layers: int = 0) -> LoadSettings:
        """A context with this server's streams, cache types and V layout for a test-load.
        Its size is the server's, capped at what the file needs (``need_cells`` per stream,
        padded): the size check itself is arithmetic (:meth:`slot_ctx`), and a real server
        context can be too large to allocate just to load one file."""
        per = min(self.n_ctx_seq(n_ctx_train), -(-(need_cells + 1) // CTX_PAD) * CTX_PAD)
        per = max(per, CTX_PAD)
        n_ctx = per if self.kv_unified else per * self.n_parallel
        return LoadSettings(
            n_ctx=n_ctx,
            n_seq_max=self.n_parallel,
            kv_unified=self.kv_unified,
            flash_attn=self.fa_on,
            type_k=self.type_id("k"),
            type_v=self.type_id("v"),
            n_gpu_layers=n_gpu_layers if self.n_gpu_layers is None else self.n_gpu_layers,
            seq_id=0,
        )

    def describe(self) -> str:
        np_ = f"{self.n_parallel} slots" + (" (auto)" if self.parallel_auto else "")
        cache = "unified cache" if self.kv_unified else f"{self.n_stream} streams"
        ctx = f"-c {self.n_ctx}" if self.n_ctx else "-c 0 (n_ctx_train)"
        return f"{np_}, {cache}, {ctx}, flash attention {self.flash_attn}, K {self.type_k}, V {self.type_v}" + (
            ", --swa-full" if self.swa_full else ""
        )

    def problems(self) -> list[str]:
        """Flag combinations the server itself refuses to start with."""
        out = []
        if self.flash_attn == "off" and BY_NAME[self.type_v].id not in TRANSPOSABLE:
            out.append(
                f"-ctv {self.type_v} with -fa off: llama.cpp refuses a quantized V cache without flash "
                "attention (llama_init_from_model), the server does not start"
            )
        return out


# Flags that decide restorability: spelling -> field.  Every spelling llama-server accepts.
_VALUE_FLAGS = {
    "-m": "model",
    "--model": "model",
    "-md": "draft_model",
    "--model-draft": "draft_model",
    "--spec-draft-model": "draft_model",
    "-c": "n_ctx",
    "--ctx-size": "n_ctx",
    "-np": "n_parallel",
    "--parallel": "n_parallel",
    "--kv-unified-per-slot": "kv_unified_per_slot",
    "-fa": "flash_attn",
    "--flash-attn": "flash_attn",
    "-ctk": "type_k",
    "--cache-type-k": "type_k",
    "-ctv": "type_v",
    "--cache-type-v": "type_v",
    "-ctkd": "type_k_draft",
    "--cache-type-k-draft": "type_k_draft",
    "--spec-draft-type-k": "type_k_draft",
    "-ctvd": "type_v_draft",
    "--cache-type-v-draft": "type_v_draft",
    "--spec-draft-type-v": "type_v_draft",
    "-ub": "n_ubatch",
    "--ubatch-size": "n_ubatch",
    "-b": "n_batch",
    "--batch-size": "n_batch",
    "-ctxcp": "ctx_checkpoints",
    "--ctx-checkpoints": "ctx_checkpoints",
    "--swa-checkpoints": "ctx_checkpoints",
    "-ngl": "n_gpu_layers",
    "--gpu-layers": "n_gpu_layers",
    "--n-gpu-layers": "n_gpu_layers",
    "--slot-save-path": "slot_save_path",
}
_SWITCHES = {
    "-kvu": ("kv_unified", True),
    "--kv-unified": ("kv_unified", True),
    "-no-kvu": ("kv_unified", False),
    "--no-kv-unified": ("kv_unified", False),
    "--swa-full": ("swa_full", True),
}
_INT_FIELDS = ("n_ctx", "n_parallel", "kv_unified_per_slot", "n_ubatch", "n_batch", "ctx_checkpoints")
UNDERSTOOD = (
    "-m",
    "-c",
    "-np",
    "-kvu/-no-kvu",
    "--kv-unified-per-slot",
    "-fa",
    "-ctk",
    "-ctv",
    "--swa-full",
    "-ub",
    "-b",
    "-md",
    "-ctkd",
    "-ctvd",
    "-ctxcp",
    "-ngl",
    "--slot-save-path",
)


def _norm(arg: str) -> str:
    # common_params_parse_ex: "--long_name" reads as "--long-name"
    return arg.replace("_", "-") if arg.startswith("--") else arg


def _int(flag: str, value: str) -> int:
    try:
        return int(value, 10)
    except ValueError:
        raise ServerArgsError(f"{flag} takes a whole number, not {value!r}") from None


def _cache_type(flag: str, value: str) -> str:
    if value not in KV_CACHE_TYPES:  # kv_cache_type_from_str compares exactly (lower case)
        raise ServerArgsError(f"{flag} {value!r} is not a KV cache type ({', '.join(KV_CACHE_TYPES)})")
    return value


def _fa(flag: str, value: str) -> str:
    if value in TRUTHY:
        return "on"
    if value in FALSEY:
        return "off"
    if value in AUTOY:
        return "auto"
    raise ServerArgsError(f"{flag} takes on, off or auto, not {value!r}")


def _split(text: str) -> list[str]:
    try:
        words = shlex.split(text, comments=False)
    except ValueError as e:
        raise ServerArgsError(f"--server-args cannot be split like a shell line: {e}") from None
    if words and not words[0].startswith("-"):
        words = words[1:]  # the binary (llama-server, /opt/llama/bin/llama-server, ...)
    return words


def parse_server_args(text: str) -> ServerSettings:
    """Read a llama-server command line; raises :class:`ServerArgsError` (a usage error)."""
    words = _split(text)
    vals: dict[str, object] = {}
    ignored: list[str] = []
    i = 0
    while i < len(words):
        flag = _norm(words[i])
        i += 1
        if flag in _SWITCHES:
            name, v = _SWITCHES[flag]
            vals[name] = v
            continue
        if flag in _VALUE_FLAGS:
            if i >= len(words):
                raise ServerArgsError(f"{flag} needs a value")
            vals[_VALUE_FLAGS[flag]] = (flag, words[i])
            i += 1
            continue
        arity = _known_arity(flag)
        if arity is None:
            what = "a stray value" if not flag.startswith("-") else "not a llama-server flag"
            raise ServerArgsError(
                f"{words[i - 1]!r} is {what}; understood: {', '.join(UNDERSTOOD)} "
                "(and every other llama-server flag, ignored)"
            )
        if i + arity > len(words):
            raise ServerArgsError(f"{flag} needs {arity} value(s)")
        ignored.append(" ".join([flag, *words[i : i + arity]]))
        i += arity
    return _settle(vals, tuple(ignored))


def _settle(vals: dict[str, object], ignored: tuple[str, ...]) -> ServerSettings:
    kw: dict[str, object] = {}
    for name, raw in vals.items():
        if not isinstance(raw, tuple):
            kw[name] = raw
            continue
        flag, value = raw
        if name in _INT_FIELDS or name == "n_gpu_layers":
            kw[name] = _ngl(flag, value) if name == "n_gpu_layers" else _int(flag, value)
        elif name.startswith("type_"):
            kw[name] = _cache_type(flag, value)
        elif name == "flash_attn":
            kw[name] = _fa(flag, value)
        else:
            kw[name] = value
    n_par = int(kw.pop("n_parallel", -1))  # type: ignore[call-overload]
    if n_par == 0:
        raise ServerArgsError("-np 0 is refused by llama-server (invalid value for n_parallel)")
    notes = []
    if n_par < 0:  # server.cpp: auto = 4 slots and a unified cache, whatever -kvu says
        if kw.get("kv_unified") is False:
            notes.append("-np auto turns the unified cache on even with --no-kv-unified (server.cpp)")
        kw["kv_unified"] = True
        s = ServerSettings(n_parallel=AUTO_SLOTS, parallel_auto=True, ignored=ignored, **kw)  # type: ignore[arg-type]
    else:
        kw.setdefault("kv_unified", False)
        s = ServerSettings(n_parallel=n_par, parallel_auto=False, ignored=ignored, **kw)  # type: ignore[arg-type]
    for k in ("n_ctx", "n_ubatch", "n_batch", "kv_unified_per_slot", "ctx_checkpoints"):
        if getattr(s, k) < 0:
            raise ServerArgsError(f"{k.replace('_', '-')} cannot be negative")
    if s.n_parallel > 256:
        raise ServerArgsError(f"-np {s.n_parallel}: llama.cpp allows at most 256 sequences (LLAMA_MAX_SEQ)")
    if s.n_ubatch != DEFAULT_UBATCH:
        notes.append(f"-ub {s.n_ubatch}: the SWA cache of iSWA models is sized with it; the test-load uses 512")
    if s.swa_full:
        notes.append(
            "--swa-full: the server's SWA cache holds every cell; the test-load uses a windowed one "
            "(stricter: what loads there loads on the server)"
        )
    object.__setattr__(s, "notes", tuple(notes))
    return s


def _ngl(flag: str, value: str) -> int:
    if value in ("auto", "all"):
        return 999
    return _int(flag, value)


def _known_arity(flag: str) -> int | None:
    if flag in NO_VALUE:
        return 0
    if flag in ONE_VALUE:
        return 1
    if flag in TWO_VALUES:
        return 2
    return None


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


# Every other flag llama-server accepts (common/arg.cpp, options for LLAMA_EXAMPLE_SERVER), by
# how many values follow it.  Generated from the vendored arg.cpp (handler_void/bool: none,
# handler_int/string: one, handler_str_str: two).
NO_VALUE = _words(
    """
    --agent --backend-sampling --cache-idle-slots --cache-list --cache-prompt --check-tensors --completion-bash
    --cont-batching --context-shift --cors-credentials --cpu-moe --cpu-moe-draft --embd-gemma-default --embedding
    --embeddings --escape --fim-qwen-1.5b-default --fim-qwen-14b-spec --fim-qwen-30b-default --fim-qwen-3b-default
    --fim-qwen-7b-default --fim-qwen-7b-spec --gpt-oss-120b-default --gpt-oss-20b-default --ignore-eos --jinja
    --kv-offload --kv-unified --list-devices --log-disable --log-jsonl --log-prefix --log-timestamps --log-verbose
    --lora-init-without-apply --metrics --mmproj-auto --mmproj-offload --models-autoload --no-agent
    --no-cache-idle-slots --no-cache-prompt --no-cont-batching --no-context-shift --no-cors-credentials --no-escape
    --no-host --no-jinja --no-kv-offload --no-kv-unified --no-log-jsonl --no-log-prefix --no-log-timestamps
    --no-mmproj --no-mmproj-auto --no-mmproj-offload --no-models-autoload --no-op-offload --no-perf
    --no-prefill-assistant --no-reasoning-preserve --no-repack --no-skip-chat-parsing --no-slots
    --no-spec-draft-backend-sampling --no-ui --no-ui-mcp-proxy --no-warmup --no-webui --no-webui-mcp-proxy
    --op-offload --perf --prefill-assistant --props --reasoning-preserve --repack --rerank --reranking --reuse-port
    --skip-chat-parsing --slots --spec-default --spec-draft-backend-sampling --spec-draft-cpu-moe --special
    --spm-infill --swa-full --ui --ui-mcp-proxy --verbose --version --vision-gemma-12b-default
    --vision-gemma-4b-default --warmup --webui --webui-mcp-proxy -ag -bs -cb -cl -cmoe -cmoed -e -kvo -kvu -nkvo
    -no-ag -no-kvu -nocb -nr -sp -v
    """
)
ONE_VALUE = _words(
    """
    --adaptive-decay --adaptive-target --alias --api-key --api-key-file --api-prefix --batch-size --cache-ram
    --cache-reuse --cache-type-k --cache-type-k-draft --cache-type-v --cache-type-v-draft --chat-template
    --chat-template-file --chat-template-kwargs --checkpoint-min-step --control-vector --control-vector-scaled
    --cors-headers --cors-methods --cors-origins --cpu-mask --cpu-mask-batch --cpu-mask-batch-draft --cpu-mask-draft
    --cpu-range --cpu-range-batch --cpu-range-draft --cpu-strict --cpu-strict-batch --cpu-strict-batch-draft
    --cpu-strict-draft --ctx-checkpoints --ctx-size --defrag-thold --device --device-draft --draft --draft-max
    --draft-min --draft-n --draft-n-min --draft-p-min --draft-p-split --dry-allowed-length --dry-base
    --dry-multiplier --dry-penalty-last-n --dry-sequence-breaker --dynatemp-exp --dynatemp-range --embd-normalize
    --fit --fit-ctx --fit-target --flash-attn --frequency-penalty --gpu-layers --gpu-layers-draft --grammar
    --grammar-file --hf-repo-draft --host --image-max-tokens --image-min-tokens --json-schema --json-schema-file
    --keep --kv-unified-per-slot --lazy-mode --load-mode --log-colors --log-file --log-prompts-dir --log-verbosity
    --logit-bias --lookup-cache-dynamic --lookup-cache-static --main-gpu --mcp-servers-config --mcp-servers-json
    --media-path --min-p --mirostat --mirostat-ent --mirostat-lr --mmproj --mmproj-device --mmproj-url --model-draft
    --models-dir --models-max --models-preset --mtmd-batch-max-tokens --n-cpu-ffn --n-cpu-moe --n-cpu-moe-draft
    --n-gpu-layers --n-gpu-layers-draft --n-predict --numa --override-kv --override-tensor --override-tensor-draft
    --parallel --path --poll --poll-batch --poll-batch-draft --poll-draft --pooling --port --predict
    --presence-penalty --prio --prio-batch --prio-batch-draft --prio-draft --reasoning --reasoning-budget
    --reasoning-budget-message --reasoning-effort --reasoning-format --repeat-last-n --repeat-penalty
    --reverse-prompt --rope-freq-base --rope-freq-scale --rope-scale --rope-scaling --rpc --sampler-seq --samplers
    --sampling-seq --seed --sleep-idle-seconds --slot-prompt-similarity --slot-save-path --spec-draft-cpu-mask
    --spec-draft-cpu-mask-batch --spec-draft-cpu-range --spec-draft-cpu-strict --spec-draft-cpu-strict-batch
    --spec-draft-device --spec-draft-hf --spec-draft-model --spec-draft-n-cpu-moe --spec-draft-n-max
    --spec-draft-n-min --spec-draft-ncmoe --spec-draft-ngl --spec-draft-override-tensor --spec-draft-p-min
    --spec-draft-p-split --spec-draft-poll --spec-draft-poll-batch --spec-draft-prio --spec-draft-prio-batch
    --spec-draft-threads --spec-draft-threads-batch --spec-draft-type-k --spec-draft-type-v
    --spec-ngram-map-k-min-hits --spec-ngram-map-k-size-m --spec-ngram-map-k-size-n --spec-ngram-map-k4v-min-hits
    --spec-ngram-map-k4v-size-m --spec-ngram-map-k4v-size-n --spec-ngram-min-hits --spec-ngram-mod-n-match
    --spec-ngram-mod-n-max --spec-ngram-mod-n-min --spec-ngram-simple-min-hits --spec-ngram-simple-size-m
    --spec-ngram-simple-size-n --spec-ngram-size-m --spec-ngram-size-n --spec-synth-len --spec-synth-rates
    --spec-type --split-mode --sse-ping-interval --ssl-cert-file --ssl-key-file --swa-checkpoints --tags --temp
    --temperature --tensor-split --threads --threads-batch --threads-batch-draft --threads-draft --threads-http
    --timeout --tools --tools-runtime --top-k --top-n-sigma --top-nsigma --top-p --typical --typical-p --ubatch-size
    --ui-config --ui-config-file --verbosity --video-ffmpeg-dir --video-fps --video-timestamp-interval
    --webui-config --webui-config-file --xtc-probability --xtc-threshold --yarn-attn-factor --yarn-beta-fast
    --yarn-beta-slow --yarn-ext-factor --yarn-orig-ctx -C -Cb -Cbd -Cd -Cr -Crb -Crd -a -b -c -cms -cram -ctk -ctkd
    -ctv -ctvd -ctxcp -dev -devd -dt -fa -fit -fitc -fitt -hfd -hfrd -j -jf -l -lcd -lcs -lm -lv -lzm -md -mg -mm
    -mmdev -mmu -n -ncffn -ncmoe -ncmoed -ngl -ngld -np -ot -otd -r -rea -s -sm -sps -t -tb -tbd -td -to -ts -ub
    """
)
TWO_VALUES = _words(
    """
    --control-vector-layer-range
    """
)
