#!/usr/bin/env python3
"""Measure the batch-shape numerics behind ``slotfile verify --deep``'s tolerances.

    .venv/bin/python bench/calibrate_deep.py [--out DIR] [--tokens N]

Writes a 4-layer llama-shaped GGUF with head size 64 (n_embd 512, 8 heads, 4 KV heads; big
enough for ggml's batched kernels and, for quantized caches, the Hadamard rotation), saves a
slot file per cache type (f32, f16, bf16, q8_0, q4_0; flash attention on and off) after a
prefill in mixed ``llama_decode`` calls (1/3/17/64/5 tokens, n_ubatch 16), then re-prefills
each file through the loader worker with one call of up to 512 tokens and with one token per
call, and prints the worst per-cell relative error per cache type (the quantity the deep check
compares with ``slotfile.verify.ROW_TOLERANCE``) and the next-token logits difference.

The committed tiny fixtures re-prefill bit-identically, so they cannot calibrate anything;
this script is where the numbers in slotfile/verify.py come from (2 CPU cores, 2026-12-02):
f32 2e-6, f16 8e-3, bf16 2.4e-3, q8_0 6.4e-3, q4_0 4.6e-2; logits 2.4e-3 at most.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CONFIGS = (
    ("f32_nofa", False, 0),
    ("f16_fa", True, 1),
    ("f16_nofa", False, 1),
    ("bf16_fa", True, 30),
    ("q8_0_fa", True, 8),
    ("q4_0_fa", True, 2),
)
CHUNKS = (1, 3, 17, 64, 5)


def write_files(out: Path, n_tokens: int) -> Path:
    """The model and one slot file per cache configuration (llama_cpp imported here only)."""
    import llama_cpp as L
    import numpy as np

    from fixtures import models

    spec = replace(models.LLAMA, n_layer=4, n_embd=512, n_head=8, n_head_kv=4, n_ff=1024, n_ctx_train=2048, seed=7)
    model_path = out / "calib.gguf"
    models._write(model_path, spec, "slotfile-calibration")
    quiet = L.llama_log_callback(lambda level, text, data: None)
    L.llama_log_set(quiet, ctypes.c_void_p(0))
    L.llama_backend_init()
    model = L.llama_model_load_from_file(str(model_path).encode(), L.llama_model_default_params())
    rng = np.random.default_rng(0)
    toks = [models.BOS_ID, *rng.integers(0, 318, n_tokens - 1).tolist()]
    for name, fa, t in CONFIGS:
        p = L.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_threads, p.n_threads_batch = 512, 512, 16, 1, 1
        p.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if fa else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        p.type_k = p.type_v = t
        ctx = L.llama_init_from_model(model, p)
        i = k = 0
        while i < len(toks):
            part = toks[i : i + CHUNKS[k % len(CHUNKS)]]
            k += 1
            b = L.llama_batch_init(len(part), 0, 1)
            b.n_tokens = len(part)
            for j, tok in enumerate(part):
                b.token[j], b.pos[j], b.n_seq_id[j] = tok, i + j, 1
                b.seq_id[j][0] = 0
                b.logits[j] = j == len(part) - 1
            assert L.llama_decode(ctx, b) == 0
            L.llama_batch_free(b)
            i += len(part)
        words = [-1, 1, len(toks), *toks, 0]
        arr = (L.llama_token * len(words))(*words)
        assert L.llama_state_seq_save_file(ctx, str(out / f"{name}.slot").encode(), 0, arr, len(words))
        L.llama_free(ctx)
    L.llama_model_free(model)
    return model_path


def measure(out: Path, model_path: Path) -> None:
    from slotfile.loader import LoaderPool
    from slotfile.reader import open_slot_file
    from slotfile.verify import compare_run

    print(f"{'file':<12} {'prefill':>8} {'worst cell K':>13} {'worst cell V':>13} {'layer rel':>10} {'logits rel':>10}")
    with LoaderPool(str(model_path), threads=1) as pool:
        for name, _, _ in CONFIGS:
            f = out / f"{name}.slot"
            sf = open_slot_file(f)
            toks = [int(t) for t in sf.tokens.tokens]
            for batch, label in ((512, "512/call"), (1, "1/call")):
                with tempfile.NamedTemporaryFile(suffix=".slot", dir=out) as tmp:
                    r = pool.deep(str(f), toks, toks[-1], tmp.name, batch=batch)
                    assert r.ok, r.message
                    rec = open_slot_file(tmp.name)
                    worst = {"K": 0.0, "V": 0.0}
                    rel = 0.0
                    for fb, rb in zip(sf.body.blocks, rec.body.blocks, strict=False):
                        for a, b in zip(fb.runs(), rb.runs(), strict=False):
                            m = compare_run(a, b)
                            worst[a.part] = max(worst[a.part], m["worst_cell_rel"])
                            rel = max(rel, m["rel"])
                    print(
                        f"{name:<12} {label:>8} {worst['K']:>13.3g} {worst['V']:>13.3g} {rel:>10.3g} "
                        f"{r.logits['rel']:>10.3g}"
                    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="folder for the model and files (default: a temp dir)")
    ap.add_argument("--tokens", type=int, default=400)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="slotfile-calib-") as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        measure(out, write_files(out, args.tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
