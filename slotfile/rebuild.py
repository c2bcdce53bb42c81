"""llama.cpp work for the repairs, always run in a worker process.

An abort inside llama.cpp (``GGML_ABORT`` on a bad blob, an assertion) ends the process it
runs in; it must never end slotfile.  So every function here that touches llama.cpp runs in
``python -m slotfile.rebuild``: the parent sends one JSON request on stdin and reads one
JSON result line from stdout; a worker that dies by a signal, exits without a result or
runs past its timeout gives ``{"ok": false, "crashed": true, ...}``.  llama.cpp's log is
collected in the worker (nothing is printed) and its tail comes back as ``log``.

Operations:

``prefill``  decode the stored tokens into a fresh context with the file's settings (cache
             types, flash attention, n_seq_max / kv_unified), taking PARTIAL_ONLY checkpoint
             blobs at the requested n_tokens on the way (and draft blobs with a draft model),
             then write header + tokens + body with ``llama_state_seq_save_file``.
``resave``   load a file with ``llama_state_seq_load_file`` and write it again with
             ``llama_state_seq_save_file`` (optionally with another token payload).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, is_dataclass
from typing import Any

RESULT_MARK = "SLOTFILE-RESULT "
DEFAULT_BATCH = 512


@dataclass(slots=True)
class WorkerResult:
    ok: bool
    message: str
    data: dict[str, Any]
    crashed: bool = False
    log: str = ""
    seconds: float = 0.0


def settings_dict(settings: Any) -> dict[str, Any] | None:
    """A LoadSettings (or a dict, or None) as a plain JSON-able dict."""
    if settings is None:
        return None
    if is_dataclass(settings):
        return asdict(settings)  # type: ignore[arg-type]
    return dict(settings)


def run_worker(request: dict[str, Any], timeout: float = 600.0) -> WorkerResult:
    """Run one request in ``python -m slotfile.rebuild``; never raises for a worker failure."""
    t0 = time.monotonic()
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "slotfile.rebuild"],
            input=json.dumps(request), capture_output=True, text=True, timeout=timeout, env=env,
        )
    except subprocess.TimeoutExpired as e:
        log = (e.stderr or b"")
        log = log.decode("utf-8", "replace") if isinstance(log, bytes) else log
        return WorkerResult(False, f"llama.cpp worker ran past {timeout:.0f} s and was stopped", {}, True,
                            log[-4000:], time.monotonic() - t0)
    except OSError as e:
        return WorkerResult(False, f"could not start the llama.cpp worker: {e}", {}, True, "", time.monotonic() - t0)
    dt = time.monotonic() - t0
    result = None
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            try:
                result = json.loads(line[len(RESULT_MARK):])
            except json.JSONDecodeError:
                result = None
            break
    if result is None:
        how = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit status {proc.returncode}"
        tail = proc.stderr.strip().splitlines()[-1:] if proc.stderr.strip() else []
        why = f": {tail[0]}" if tail else ""
        return WorkerResult(False, f"llama.cpp worker crashed ({how}){why}", {}, True, proc.stderr[-4000:], dt)
    log = result.pop("log", "")
    if proc.stderr:
        log = (log + "\n" + proc.stderr)[-4000:]
    return WorkerResult(bool(result.pop("ok", False)), str(result.pop("message", "")), result, False, log, dt)


def default_checkpoint_positions(n_tokens: int) -> list[int]:
    """Where to take a checkpoint when the damaged file does not say (one, near the end).

    A checkpoint at n_tokens itself would be useless (the body is that state), so the one
    checkpoint sits a little before the end, like the server's own end-of-prompt checkpoint:
    ``T - min(64, max(1, T // 4))``.
    """
    if n_tokens < 2:
        return []
    return [n_tokens - min(64, max(1, n_tokens // 4))]


# ======================================================================================
# everything below runs only inside the worker process
# ======================================================================================

_LOG: list[str] = []
_partial = ""


def _worker_main() -> int:
    import ctypes

    import llama_cpp as L

    def collect(level: int, text: bytes, user_data: Any) -> None:
        global _partial
        try:
            _partial += text.decode("utf-8", "replace")
            while "\n" in _partial:
                line, _partial = _partial.split("\n", 1)
                _LOG.append(line)
                if len(_LOG) > 4000:
                    del _LOG[:2000]
        except Exception:
            pass

    cb = L.llama_log_callback(collect)
    L.llama_log_set(cb, ctypes.c_void_p(0))
    L.llama_backend_init()
    req = json.loads(sys.stdin.read())
    t0 = time.monotonic()
    try:
        op = {"prefill": _prefill, "resave": _resave}[req["op"]]
        out = op(L, req)
    except _Fail as e:
        out = {"ok": False, "message": str(e)}
    except Exception as e:  # a bug or an unexpected llama.cpp return: report, do not hang
        out = {"ok": False, "message": f"{type(e).__name__}: {e}"}
    out["seconds"] = time.monotonic() - t0
    out["log"] = "\n".join(_LOG[-60:])
    sys.stdout.write(RESULT_MARK + json.dumps(out) + "\n")
    sys.stdout.flush()
    return 0


class _Fail(Exception):
    pass


def _type_id(value: Any) -> int:
    if isinstance(value, int):
        return value
    from .ggml_types import BY_NAME

    t = BY_NAME.get(str(value).lower()) or BY_NAME.get(str(value))
    if t is None:
        raise _Fail(f"unknown cache type {value!r}")
    return t.id


class _Model:
    def __init__(self, L: Any, path: str, n_gpu_layers: int = 0) -> None:
        self.L = L
        p = L.llama_model_default_params()
        p.n_gpu_layers = int(n_gpu_layers or 0)
        self.ptr = L.llama_model_load_from_file(path.encode(), p)
        if not self.ptr:
            raise _Fail(f"llama.cpp could not load the model {path}")
        self.size = os.path.getsize(path)
        self.vocab = L.llama_model_get_vocab(self.ptr)
        self.n_vocab = int(L.llama_vocab_n_tokens(self.vocab))
        self.recurrent = bool(L.llama_model_is_recurrent(self.ptr))
        self.hybrid = bool(L.llama_model_is_hybrid(self.ptr))
        self.n_swa = int(L.llama_model_n_swa(self.ptr))

    @property
    def attention_free(self) -> bool:
        return self.recurrent and not self.hybrid

    @property
    def needs_checkpoints(self) -> bool:
        """Memory that cannot be rolled back by dropping cells: REC state, or an SWA window."""
        return self.recurrent or self.hybrid or self.n_swa > 0

    def info(self) -> dict[str, Any]:
        return {"recurrent": self.recurrent, "hybrid": self.hybrid, "n_swa": self.n_swa,
                "n_vocab": self.n_vocab, "needs_checkpoints": self.needs_checkpoints}

    def close(self) -> None:
        if self.ptr:
            self.L.llama_model_free(self.ptr)
            self.ptr = None


def _fill_settings(model: _Model, s: dict[str, Any], n_tokens: int) -> dict[str, Any]:
    """Fill what the damaged file could not tell where it does not matter; fail where it does."""
    s = dict(s)
    missing = []
    if model.attention_free:  # no KV cache: attention settings do not reach the state
        s["flash_attn"] = bool(s.get("flash_attn")) if s.get("flash_attn") is not None else False
        s["type_k"] = s.get("type_k") if s.get("type_k") is not None else "f16"
        s["type_v"] = s.get("type_v") if s.get("type_v") is not None else "f16"
    for key in ("flash_attn", "type_k", "type_v"):
        if s.get(key) is None:
            missing.append(key.replace("_", "-"))
    if missing:
        raise _Fail("the damaged file does not show its " + ", ".join(missing) +
                    " setting(s); give them (--flash-attn, --cache-type-k, --cache-type-v)")
    n_seq = int(s.get("n_seq_max") or 1)
    s["n_seq_max"] = n_seq
    s["kv_unified"] = bool(s.get("kv_unified") or False)
    s["seq_id"] = int(s.get("seq_id") or 0)
    if s["seq_id"] >= n_seq:
        raise _Fail(f"seq_id {s['seq_id']} does not fit n_seq_max {n_seq}")
    per_seq = max(256, -(-(n_tokens + 1) // 256) * 256)
    want = per_seq if s["kv_unified"] else per_seq * n_seq
    if not s.get("n_ctx") or int(s["n_ctx"]) < (n_tokens + 1 if s["kv_unified"] else (n_tokens + 1) * n_seq):
        s["n_ctx"] = want
    return s


def _threads(model: "_Model") -> int:
    """SLOTFILE_THREADS, else 1 for a tiny model (ggml's spinning threads only cost there),
    else up to 8 of the CPUs."""
    env = os.environ.get("SLOTFILE_THREADS")
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    if model.size < 64 << 20:
        return 1
    return max(1, min(8, os.cpu_count() or 1))


class _Context:
    def __init__(self, L: Any, model: _Model, s: dict[str, Any], n_batch: int) -> None:
        self.L = L
        p = L.llama_context_default_params()
        p.n_ctx = int(s["n_ctx"])
        p.n_batch = n_batch
        p.n_ubatch = n_batch
        p.n_seq_max = int(s["n_seq_max"])
        p.kv_unified = bool(s["kv_unified"])
        threads = _threads(model)
        p.n_threads = threads
        p.n_threads_batch = threads
        p.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if s["flash_attn"] else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        p.type_k = _type_id(s["type_k"])
        p.type_v = _type_id(s["type_v"])
        p.swa_full = False  # llama-server's default
        p.no_perf = True
        self.ptr = L.llama_init_from_model(model.ptr, p)
        if not self.ptr:
            tail = " / ".join(_LOG[-3:])
            raise _Fail(f"llama.cpp refused the context (n_ctx {s['n_ctx']}, flash attention "
                        f"{'on' if s['flash_attn'] else 'off'}, K {s['type_k']}, V {s['type_v']}): {tail}")
        self.mem = L.llama_get_memory(self.ptr)
        self.n_batch = n_batch
        self.n_past = 0

    def decode(self, tokens: list[int], seq_id: int) -> None:
        L = self.L
        for i in range(0, len(tokens), self.n_batch):
            part = tokens[i : i + self.n_batch]
            batch = L.llama_batch_init(len(part), 0, 1)
            try:
                batch.n_tokens = len(part)
                for j, tok in enumerate(part):
                    batch.token[j] = tok
                    batch.pos[j] = self.n_past + j
                    batch.n_seq_id[j] = 1
                    batch.seq_id[j][0] = seq_id
                    batch.logits[j] = j == len(part) - 1
                rc = L.llama_decode(self.ptr, batch)
            finally:
                L.llama_batch_free(batch)
            if rc != 0:
                raise _Fail(f"llama_decode returned {rc} at token {self.n_past}")
            self.n_past += len(part)

    def blob(self, seq_id: int, flags: int) -> bytes:
        import ctypes

        L = self.L
        size = int(L.llama_state_seq_get_size_ext(self.ptr, seq_id, flags))
        buf = (ctypes.c_uint8 * max(size, 1))()
        n = int(L.llama_state_seq_get_data_ext(self.ptr, buf, size, seq_id, flags))
        if n != size:
            raise _Fail(f"llama_state_seq_get_data_ext wrote {n} of {size} bytes")
        return bytes(buf)[:size]

    def pos_range(self, seq_id: int) -> tuple[int, int]:
        L = self.L
        return int(L.llama_memory_seq_pos_min(self.mem, seq_id)), int(L.llama_memory_seq_pos_max(self.mem, seq_id))

    def save(self, path: str, seq_id: int, words: list[int]) -> int:
        L = self.L
        arr = (L.llama_token * max(len(words), 1))(*words)
        return int(L.llama_state_seq_save_file(self.ptr, path.encode(), seq_id, arr, len(words)))

    def load(self, path: str, seq_id: int, capacity: int) -> tuple[int, int]:
        import ctypes

        L = self.L
        arr = (L.llama_token * max(capacity, 1))()
        n_out = ctypes.c_size_t(0)
        ret = int(L.llama_state_seq_load_file(self.ptr, path.encode(), seq_id, arr, max(capacity, 1), ctypes.byref(n_out)))
        return ret, int(n_out.value)

    def close(self) -> None:
        if self.ptr:
            self.L.llama_free(self.ptr)
            self.ptr = None


def _segments(n: int, cuts: list[int]) -> list[tuple[int, int]]:
    bounds = sorted({c for c in cuts if 0 < c < n} | {0, n})
    return list(zip(bounds[:-1], bounds[1:]))


def _prefill(L: Any, req: dict[str, Any]) -> dict[str, Any]:
    tokens: list[int] = [int(t) for t in req["tokens"]]
    words: list[int] = [int(w) for w in req["words"]]
    n = len(tokens)
    model = _Model(L, req["model"], int((req.get("settings") or {}).get("n_gpu_layers") or 0))
    dmodel = None
    ctx = dctx = None
    try:
        bad = [t for t in tokens if not 0 <= t < model.n_vocab]
        if bad:
            raise _Fail(f"token {bad[0]} is outside the model's vocabulary of {model.n_vocab} "
                        "(a different model, or media positions that cannot be prefilled)")
        s = _fill_settings(model, req.get("settings") or {}, n)
        seq = s["seq_id"]
        at = req.get("checkpoints_at")
        if at is None:
            at = default_checkpoint_positions(n) if model.needs_checkpoints else []
        at = sorted({int(a) for a in at if 0 < int(a) <= n})
        n_batch = int(req.get("n_batch") or DEFAULT_BATCH)
        ctx = _Context(L, model, s, n_batch)
        ds = None
        if req.get("draft_model"):
            dmodel = _Model(L, req["draft_model"], int(s.get("n_gpu_layers") or 0))
            ds = dict(s)
            ds.update({k: v for k, v in (req.get("draft_settings") or {}).items() if v is not None})
            ds.setdefault("type_k", "f16")
            ds = _fill_settings(dmodel, ds, n)
            dctx = _Context(L, dmodel, ds, n_batch)
        flags = L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        cps: list[dict[str, Any]] = []
        blob_path = req["blobs"]
        with open(blob_path, "wb") as bf:
            for a, b in _segments(n, at):
                ctx.decode(tokens[a:b], seq)
                if dctx is not None:
                    dctx.decode(tokens[a:b], seq)
                if b in at:
                    pmin, pmax = ctx.pos_range(seq)
                    item: dict[str, Any] = {"n_tokens": b, "pos_min": pmin, "pos_max": pmax}
                    tgt = ctx.blob(seq, flags)
                    item["tgt"] = [bf.tell(), len(tgt)]
                    bf.write(tgt)
                    if dctx is not None:
                        dft = dctx.blob(seq, flags)
                        item["dft"] = [bf.tell(), len(dft)]
                        bf.write(dft)
                    cps.append(item)
            draft = None
            if dctx is not None:
                full = dctx.blob(seq, 0)
                draft = [bf.tell(), len(full)]
                bf.write(full)
            bf.flush()
            os.fsync(bf.fileno())
        written = ctx.save(req["out"], seq, words)
        if written == 0:
            raise _Fail("llama_state_seq_save_file wrote nothing: " + " / ".join(_LOG[-3:]))
        size = os.path.getsize(req["out"])
        if written != size:
            raise _Fail(f"llama_state_seq_save_file reported {written} bytes, the file has {size}")
        return {"ok": True, "message": f"prefilled {n} tokens", "model": model.info(),
                "settings": s, "draft_settings": ds, "file_size": size, "checkpoints": cps,
                "draft": draft, "n_batch": n_batch}
    finally:
        for c in (ctx, dctx):
            if c is not None:
                c.close()
        for m in (model, dmodel):
            if m is not None:
                m.close()


def _resave(L: Any, req: dict[str, Any]) -> dict[str, Any]:
    s = dict(req["settings"])
    model = _Model(L, req["model"], int(s.get("n_gpu_layers") or 0))
    ctx = None
    try:
        s = _fill_settings(model, s, int(req.get("n_tokens") or 0))
        ctx = _Context(L, model, s, int(req.get("n_batch") or DEFAULT_BATCH))
        seq = s["seq_id"]
        ret, n_words = ctx.load(req["in"], seq, int(req["capacity"]))
        if ret == 0:
            tail = " / ".join(line for line in _LOG[-4:] if line.strip())
            raise _Fail(f"llama_state_seq_load_file refused the file: {tail or 'no reason logged'}")
        pmin, pmax = ctx.pos_range(seq)
        words = [int(w) for w in req["words"]]
        written = ctx.save(req["out"], seq, words)
        if written == 0:
            raise _Fail("llama_state_seq_save_file wrote nothing: " + " / ".join(_LOG[-3:]))
        return {"ok": True, "message": f"loaded {ret} bytes and saved {written}", "load_ret": ret,
                "n_words_loaded": n_words, "file_size": os.path.getsize(req["out"]), "settings": s,
                "pos_range": [pmin, pmax], "model": model.info()}
    finally:
        if ctx is not None:
            ctx.close()
        model.close()


if __name__ == "__main__":
    sys.exit(_worker_main())
