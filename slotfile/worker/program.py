"""The test-load worker: a separate process that owns llama.cpp (started by slotfile.loader).

    python loader_worker.py --model M.gguf [--draft-model D.gguf] [--n-gpu-layers N] [--threads N]

It loads the model(s) once, then answers one JSON request per line on stdin with one JSON
line on its private protocol pipe (the original stdout; fd 1 is pointed at stderr so that
nothing llama.cpp prints can corrupt the protocol).  llama.cpp's log (warnings and errors)
is written to fd 2 as it happens, so it survives an abort: the parent reads it back from
the file it gave the worker as stderr.

This file is self-contained on purpose (llama_cpp, numpy and the standard library only):
an abort or a segfault inside llama.cpp kills this process and nothing else.

Requests (``op``):

* ``load``: ``llama_state_seq_load_file`` the way the server restores a slot (a sizing pass
  with ``tokens_out = NULL``, then the real pass), then every SCKP ``data_tgt`` with
  ``llama_state_seq_set_data_ext(PARTIAL_ONLY)`` and, with a draft model, the SDFT
  ``data_dft`` (and each checkpoint's ``data_dft``) into a draft context.  GGSN files go
  through ``llama_state_load_file``.
* ``deep``: restore the file and decode a probe token (logits A); then prefill the given
  tokens in a cleared context with the same settings, save the recomputed state as a GGSQ
  file for the parent to compare, and decode the same probe (logits B).
* ``quit``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import struct
import sys
import traceback
from typing import Any

import numpy as np

GGSQ_MAGIC = 0x67677371
GGSN_MAGIC = 0x6767736E
IO_MAGIC = 0xAF143CD8
SCKP_MAGIC = 0x504B4353
SDFT_MAGIC = 0x54464453
MAX_CHECKPOINTS = 1024
PREFILL_BATCH = 512  # tokens per llama_decode call in the deep check (n_batch = n_ubatch)

_proto: Any = None
L: Any = None  # llama_cpp, imported in main()
_last_level = 0
_recent: list[str] = []  # the latest error lines, for messages about one call


def _log_cb(level: int, text: bytes, user_data: Any) -> None:  # pragma: no cover - C callback
    """Keep warnings and errors (and their continuation lines); write them out at once."""
    global _last_level
    try:
        if level == 5:  # GGML_LOG_LEVEL_CONT
            level = _last_level
        else:
            _last_level = level
        if level in (3, 4):  # GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR
            os.write(2, text)
            if level == 4:
                _recent.append(text.decode("utf-8", "replace").strip())
                del _recent[:-20]
    except Exception:  # noqa: BLE001 - never raise into C
        pass


_log_callback: Any = None


def _send(obj: dict[str, Any]) -> None:
    _proto.write(json.dumps(obj) + "\n")
    _proto.flush()


def _mark(text: str) -> None:
    """A marker line in the log so that lines can be told apart per request."""
    os.write(2, f"@@slotfile {text}\n".encode())


class Model:
    def __init__(self, path: str, n_gpu_layers: int) -> None:
        p = L.llama_model_default_params()
        p.n_gpu_layers = n_gpu_layers
        self.path = path
        self.ptr = L.llama_model_load_from_file(path.encode(), p)
        if not self.ptr:
            raise RuntimeError(f"llama.cpp could not load the model {path}")
        self.vocab = L.llama_model_get_vocab(self.ptr)
        self.n_vocab = int(L.llama_vocab_n_tokens(self.vocab))
        self.n_ctx_train = int(L.llama_model_n_ctx_train(self.ptr))
        self.contexts: dict[tuple[Any, ...], Any] = {}

    def context(self, s: dict[str, Any], threads: int) -> Any:
        """A context with these settings, memory cleared (cached: creating one is not free)."""
        key = (s["n_ctx"], s["n_seq_max"], bool(s["kv_unified"]), bool(s["flash_attn"]), s["type_k"], s["type_v"])
        ctx = self.contexts.get(key)
        if ctx is None:
            while len(self.contexts) >= 2:
                _, old = self.contexts.popitem()
                L.llama_free(old)
            p = L.llama_context_default_params()
            p.n_ctx = int(s["n_ctx"])
            p.n_batch = PREFILL_BATCH
            p.n_ubatch = PREFILL_BATCH
            p.n_seq_max = int(s["n_seq_max"])
            p.kv_unified = bool(s["kv_unified"])
            p.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if s["flash_attn"] else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
            p.type_k = int(s["type_k"])
            p.type_v = int(s["type_v"])
            p.n_threads = threads
            p.n_threads_batch = threads
            p.swa_full = False  # llama-server's default
            p.no_perf = True
            ctx = L.llama_init_from_model(self.ptr, p)
            if not ctx:
                raise ContextError(
                    f"llama.cpp could not create a context with n_ctx {s['n_ctx']}, n_seq_max {s['n_seq_max']}, "
                    f"kv_unified {bool(s['kv_unified'])}, flash_attn {bool(s['flash_attn'])}, "
                    f"type_k {s['type_k']}, type_v {s['type_v']}")
            self.contexts[key] = ctx
            return ctx  # llama.cpp zeroes a new cache's buffers: clearing them again costs a pass
        # a reused context: forget its cells and zero the buffers, so that nothing the last
        # file left (NaN in a damaged one) can leak into masked cells of the next
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        return ctx


class ContextError(Exception):
    pass


def _set_blob(ctx: Any, blob: bytes, seq: int, flags: int) -> tuple[bool, str]:
    buf = (ctypes.c_uint8 * max(1, len(blob))).from_buffer_copy(blob or b"\0")
    del _recent[:]
    n = int(L.llama_state_seq_set_data_ext(ctx, buf, len(blob), seq, flags))
    if n == len(blob):
        return True, f"consumed all {n} bytes"
    if n == 0:
        why = "; ".join(dict.fromkeys(x for x in _recent if x))
        return False, "llama_state_seq_set_data_ext rejected the blob" + (f": {why}" if why else "")
    return False, (f"consumed {n} of {len(blob)} bytes: the server's common_prompt_checkpoint::load_* "
                   "would GGML_ABORT on this blob")


def _walk_appendices(data: bytes, off: int) -> tuple[list[tuple[bytes, bytes]] | None, str, bytes | None, str]:
    """The SCKP and SDFT appendices the way the (patched) server reads them from ``off``.

    Returns (checkpoints as (data_tgt, data_dft) or None, SCKP note, SDFT data_dft or None,
    SDFT note).  Any SCKP damage drops the whole appendix, as load_slot_checkpoints does.
    """
    end = len(data)
    ckpts: list[tuple[bytes, bytes]] | None = None
    sckp_note = ""
    if off + 4 <= end and struct.unpack_from("<I", data, off)[0] == SCKP_MAGIC:
        p = off + 4
        if p + 8 > end:
            sckp_note = "SCKP header truncated: the server ignores the appendix"
            return [], sckp_note, None, ""
        version, count = struct.unpack_from("<II", data, p)
        p += 8
        if version != 1:
            return [], f"SCKP version {version}: the server ignores the appendix", None, ""
        if count > MAX_CHECKPOINTS:
            return [], f"SCKP count {count} over {MAX_CHECKPOINTS}: the server drops the appendix", None, ""
        items: list[tuple[bytes, bytes]] = []
        for i in range(count):
            if p + 16 > end:
                return [], f"checkpoint {i} of {count} truncated: the server drops the whole appendix", None, ""
            p += 16  # n_tokens, pos_min, pos_max
            blobs = []
            for _name in ("data_tgt", "data_dft", "data_spec"):
                if p + 8 > end:
                    return [], f"checkpoint {i} of {count} truncated: the server drops the whole appendix", None, ""
                n = struct.unpack_from("<Q", data, p)[0]
                p += 8
                if n > end - p:
                    return [], (f"checkpoint {i} of {count}: {_name} length {n} exceeds the {end - p} bytes left: "
                                "the server drops the whole appendix"), None, ""
                blobs.append(data[p : p + n])
                p += n
            if not blobs[0]:
                return [], f"checkpoint {i} has an empty data_tgt: the server drops the whole appendix", None, ""
            items.append((blobs[0], blobs[1]))
        ckpts = items
        off = p
    dft: bytes | None = None
    sdft_note = ""
    if off + 4 <= end and struct.unpack_from("<I", data, off)[0] == SDFT_MAGIC:
        p = off + 4
        try:
            version = struct.unpack_from("<I", data, p)[0]
            p += 4
            if version != 1:
                sdft_note = f"SDFT version {version}: the draft state is dropped"
            else:
                n = struct.unpack_from("<Q", data, p)[0]
                p += 8
                if n > end - p:
                    sdft_note = f"SDFT data_dft length {n} exceeds the {end - p} bytes left: the draft state is dropped"
                else:
                    dft = data[p : p + n]
        except struct.error:
            sdft_note = "SDFT header truncated: the draft state is dropped"
    return ckpts, sckp_note, dft, sdft_note


class Worker:
    def __init__(self, args: argparse.Namespace) -> None:
        self.threads = args.threads
        self.model = Model(args.model, args.n_gpu_layers)
        self.draft = Model(args.draft_model, args.n_gpu_layers) if args.draft_model else None

    def hello(self) -> dict[str, Any]:
        import llama_cpp

        return {
            "ok": True,
            "pid": os.getpid(),
            "llama_cpp_python": getattr(llama_cpp, "__version__", "?"),
            "state_seq_version": int(L.LLAMA_STATE_SEQ_VERSION),
            "session_version": int(L.LLAMA_SESSION_VERSION),
            "n_vocab": self.model.n_vocab,
            "n_ctx_train": self.model.n_ctx_train,
            "draft_n_vocab": self.draft.n_vocab if self.draft else None,
        }

    # ---------------------------------------------------------------- load

    def _restore(self, ctx: Any, path: str, seq: int, fmt: str) -> tuple[int, str, int]:
        """(body end offset or 0, message, number of token words)."""
        n_out = ctypes.c_size_t(0)
        if fmt == "GGSN":
            with open(path, "rb") as f:
                head = f.read(12)
            n_words = struct.unpack_from("<I", head, 8)[0] if len(head) >= 12 else 0
            cap = max(1, n_words)
            toks = (L.llama_token * cap)()
            ok = bool(L.llama_state_load_file(ctx, path.encode(), toks, cap, ctypes.byref(n_out)))
            if not ok:
                return 0, "llama_state_load_file failed", n_words
            return os.path.getsize(path), "", n_words
        # the server's two passes: first the token count only, then tokens and state
        ret = int(L.llama_state_seq_load_file(ctx, path.encode(), seq, None, 0, ctypes.byref(n_out)))
        if ret == 0:
            return 0, "llama_state_seq_load_file refused the header (sizing pass)", 0
        n_words = int(n_out.value)
        cap = max(1, n_words)
        toks = (L.llama_token * cap)()
        ret = int(L.llama_state_seq_load_file(ctx, path.encode(), seq, toks, cap, ctypes.byref(n_out)))
        if ret == 0:
            return 0, "llama_state_seq_load_file returned 0", n_words
        return ret, "", n_words

    def load(self, req: dict[str, Any]) -> dict[str, Any]:
        path, s = req["path"], req["settings"]
        seq = int(s.get("seq_id", 0))
        fmt = req.get("format", "GGSQ")
        out: dict[str, Any] = {"ok": False, "message": "", "body_bytes": 0, "checkpoints": [],
                               "checkpoint_drafts": [], "draft": None, "notes": []}
        try:
            ctx = self.model.context(s, self.threads)
        except ContextError as e:
            out["message"] = str(e)
            return out
        ret, msg, _ = self._restore(ctx, path, seq, fmt)
        if ret == 0:
            out["message"] = msg
            return out
        out.update(ok=True, body_bytes=ret, message=f"restored; the state ends at offset {ret}")
        if fmt != "GGSQ":
            return out
        with open(path, "rb") as f:  # only what follows the body, mapped, never read whole
            size = os.fstat(f.fileno()).st_size
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        data = memoryview(mm)[ret:] if mm is not None else memoryview(b"")
        ckpts, sckp_note, sdft_dft, sdft_note = _walk_appendices(data, 0)  # blobs: views of the map
        for note in (sckp_note, sdft_note):
            if note:
                out["notes"].append(note)
        flags = int(L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
        for tgt, _dft in ckpts or []:
            out["checkpoints"].append(list(_set_blob(ctx, tgt, seq, flags)))
        if self.draft is not None and req.get("draft_settings") is not None:
            ds = req["draft_settings"]
            try:
                dctx = self.draft.context(ds, self.threads)
            except ContextError as e:
                if sdft_dft is not None:
                    out["draft"] = [False, str(e)]
                return out
            dseq = int(ds.get("seq_id", seq))
            for _tgt, dft in ckpts or []:
                if dft:
                    out["checkpoint_drafts"].append(list(_set_blob(dctx, dft, dseq, flags)))
                else:
                    out["checkpoint_drafts"].append([True, "no data_dft"])
            if sdft_dft is not None:
                out["draft"] = list(_set_blob(dctx, sdft_dft, dseq, 0)) if sdft_dft else [True, "empty data_dft"]
        return out

    # ---------------------------------------------------------------- deep

    def _decode(self, ctx: Any, tokens: list[int], pos0: int, seq: int, want_logits: bool, batch: int = 0) -> None:
        step = max(1, min(batch or PREFILL_BATCH, int(L.llama_n_batch(ctx))))
        for start in range(0, len(tokens), step):
            part = tokens[start : start + step]
            batch = L.llama_batch_init(len(part), 0, 1)
            try:
                batch.n_tokens = len(part)
                for i, t in enumerate(part):
                    batch.token[i] = t
                    batch.pos[i] = pos0 + start + i
                    batch.n_seq_id[i] = 1
                    batch.seq_id[i][0] = seq
                    batch.logits[i] = want_logits and start + i == len(tokens) - 1
                rc = int(L.llama_decode(ctx, batch))
            finally:
                L.llama_batch_free(batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")

    def _logits(self, ctx: Any) -> np.ndarray:
        p = L.llama_get_logits_ith(ctx, -1)
        return np.ctypeslib.as_array(p, shape=(self.model.n_vocab,)).astype(np.float32, copy=True)

    def deep(self, req: dict[str, Any]) -> dict[str, Any]:
        path, s, tokens = req["path"], req["settings"], [int(t) for t in req["tokens"]]
        probe = int(req["probe"])
        seq = int(s.get("seq_id", 0))
        out: dict[str, Any] = {"ok": False, "message": ""}
        try:
            ctx = self.model.context(s, self.threads)
        except ContextError as e:
            out["message"] = str(e)
            return out
        ret, msg, _ = self._restore(ctx, path, seq, "GGSQ")
        if ret == 0:
            out["message"] = msg
            return out
        mem = L.llama_get_memory(ctx)
        pos_next = int(L.llama_memory_seq_pos_max(mem, seq)) + 1
        out["restored_pos_max"] = pos_next - 1
        try:
            self._decode(ctx, [probe], pos_next, seq, True)
            after_restore = self._logits(ctx)
            # recompute from the tokens in the same context, cleared
            L.llama_memory_clear(mem, True)
            self._decode(ctx, tokens, 0, seq, False, int(req.get("batch") or 0))
            flags = 0
            size = int(L.llama_state_seq_get_size_ext(ctx, seq, flags))
            buf = (ctypes.c_uint8 * size)()
            n = int(L.llama_state_seq_get_data_ext(ctx, buf, size, seq, flags))
            if n != size:
                raise RuntimeError(f"llama_state_seq_get_data_ext wrote {n} of {size} bytes")
            blob = bytes(buf)
            with open(req["out"], "wb") as f:  # a GGSQ file with no tokens: header + body
                f.write(struct.pack("<III", GGSQ_MAGIC, int(L.LLAMA_STATE_SEQ_VERSION), 0))
                f.write(blob[8:])
            self._decode(ctx, [probe], len(tokens), seq, True)
            recomputed = self._logits(ctx)
        except RuntimeError as e:
            out["message"] = str(e)
            return out
        finally:
            L.llama_memory_clear(mem, True)
        d = after_restore.astype(np.float64) - recomputed.astype(np.float64)
        norm = float(np.linalg.norm(recomputed.astype(np.float64)))
        top_r = np.argsort(-after_restore)[:5].tolist()
        top_c = np.argsort(-recomputed)[:5].tolist()
        out.update(
            ok=True,
            message="recomputed",
            logits={
                "max_abs": float(np.max(np.abs(d))) if d.size else 0.0,
                "mean_abs": float(np.mean(np.abs(d))) if d.size else 0.0,
                "rel": float(np.linalg.norm(d) / norm) if norm > 0 else float(np.linalg.norm(d)),
                "scale": float(np.std(recomputed)) if recomputed.size else 0.0,
                "top5_restored": top_r,
                "top5_recomputed": top_c,
                "all_finite": bool(np.all(np.isfinite(after_restore))),
            },
        )
        return out


def main() -> int:
    global _proto, L, _log_callback
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft-model")
    ap.add_argument("--n-gpu-layers", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    # the protocol gets the original stdout; fd 1 now goes to the log (stderr)
    _proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    import llama_cpp

    L = llama_cpp
    _log_callback = L.llama_log_callback(_log_cb)
    L.llama_log_set(_log_callback, ctypes.c_void_p(0))
    L.llama_backend_init()
    try:
        worker = Worker(args)
    except Exception as e:  # noqa: BLE001 - reported to the parent as an operational error
        _send({"ok": False, "message": str(e)})
        return 1
    _send(worker.hello())
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            op = req.get("op")
            _mark(f"{op} {req.get('id', '')}")
            if op == "quit":
                break
            if op == "load":
                res = worker.load(req)
            elif op == "deep":
                res = worker.deep(req)
            else:
                res = {"ok": False, "message": f"unknown op {op!r}"}
        except Exception as e:  # noqa: BLE001 - a Python-side failure is reported, not fatal
            res = {"ok": False, "message": f"worker error: {type(e).__name__}: {e}", "trace": traceback.format_exc()}
        res["id"] = req.get("id") if isinstance(req, dict) else None
        _send(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
