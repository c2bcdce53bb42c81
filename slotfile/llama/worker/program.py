"""The llama.cpp worker: the one process that calls llama.cpp (started by slotfile.llama.loader).

    python -m slotfile.llama.worker --model M.gguf [--draft-model D.gguf] [--n-gpu-layers N] [--threads N]

It loads the model(s) once, says hello, then answers one JSON request per line on stdin with
one JSON line on its private protocol pipe (the original stdout; fd 1 is pointed at stderr so
that nothing llama.cpp prints can corrupt the protocol).  llama.cpp's log (warnings and
errors) is written to fd 2 as it happens, so it survives an abort: the parent reads it back
from the file it gave the worker as stderr.  The parent ends the worker with SIGKILL: freeing
the model and contexts costs time and leaves nothing behind that the kernel would not reclaim.

It imports llama-cpp-python's ctypes bindings alone (:func:`import_bindings`, not the package's
``Llama`` class), :mod:`slotfile.llama.worker.settings` and the standard library (the appendix reader
only for a file with an appendix, numpy only for ``deep``): an abort or a segfault inside
llama.cpp kills this process and nothing else, and its start-up overlaps the parent's own
imports.  The hello's ``startup`` gives the time each start-up phase ended.

Which llama.cpp: llama-cpp-python opens ``$LLAMA_CPP_LIB_PATH/libllama.so`` when the parent sets
that variable (``--llama-lib``), else its own build.  A library that does not load is one
``library_error`` line to the parent.  The hello reports the library's path and the state and
session versions it writes, read from the headers of two tiny files it saves
(:func:`detect_versions`, a few ms), never the Python package's constants.

Requests (``op``); every context comes from :func:`context_params`:

* ``load``: ``llama_state_seq_load_file`` the way the server restores a slot (a sizing pass
  with ``tokens_out = NULL``, then the real pass), then every SCKP ``data_tgt`` with
  ``llama_state_seq_set_data_ext(PARTIAL_ONLY)`` and, with a draft model, the SDFT
  ``data_dft`` (and each checkpoint's ``data_dft``) into a draft context.  GGSN files go
  through ``llama_state_load_file``.
* ``deep``: restore the file and decode a probe token (logits A); then prefill the given
  tokens in a cleared context with the same settings and the server's batch sizes, save the
  recomputed state as a GGSQ file for the parent to compare, and decode the same probe
  (logits B); then the last ``tail`` tokens again one per call, the noise floor (logits C).
* ``prefill``: decode the stored tokens into a fresh context with the file's settings (what a
  damaged file no longer shows is completed from the model or refused), taking PARTIAL_ONLY
  checkpoint blobs at the requested n_tokens on the way (and draft blobs with a draft model),
  then write header + tokens + body with ``llama_state_seq_save_file``.
* ``resave``: load a file with ``llama_state_seq_load_file`` and write it again with
  ``llama_state_seq_save_file`` (optionally with another token payload).
* ``quit``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import itertools
import json
import mmap
import os
import struct
import sys
import time
import traceback
from typing import Any

from slotfile.llama.worker.settings import LoadSettings, pad_ctx

BATCH = 512  # tokens per llama_decode call (n_batch = n_ubatch) unless a request says otherwise
DEEP_N_BATCH, DEEP_N_UBATCH = 2048, 512  # the deep recompute: llama-server's defaults (common/common.h)
TINY_MODEL = 64 << 20  # below this ggml's spinning threads only cost: one thread
F16_NAME = "f16"  # what an attention-free model's (unused) cache types default to

_proto: Any = None
_T: dict[str, float] = {"python": time.monotonic()}  # start-up phases (CLOCK_MONOTONIC, the parent's clock too)
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
    except Exception:  # never raise into C
        pass


_log_callback: Any = None


def _send(obj: dict[str, Any]) -> None:
    _proto.write(json.dumps(obj) + "\n")
    _proto.flush()


def _mark(text: str) -> None:
    """A marker line in the log so that lines can be told apart per request."""
    os.write(2, f"@@slotfile {text}\n".encode())


def _why(n: int = 3) -> str:
    """The last error lines llama.cpp logged during this request."""
    return " / ".join(x for x in _recent[-n:] if x)


class Failed(Exception):
    """A request llama.cpp (or its input) refuses: reported as ``ok: false``, not a crash."""


class ContextError(Failed):
    pass


# ---------------------------------------------------------------------------------------
# settings to llama.cpp parameters
# ---------------------------------------------------------------------------------------


def pick_threads(requested: int, model_size: int) -> int:
    """``requested`` when the parent gives one (the pool: its share of the CPUs); else
    SLOTFILE_THREADS; else 1 for a tiny model (ggml's spinning threads only cost there);
    else up to 8 of the CPUs."""
    if requested > 0:
        return requested
    env = os.environ.get("SLOTFILE_THREADS")
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    if model_size < TINY_MODEL:
        return 1
    return max(1, min(8, os.cpu_count() or 1))


def model_params(n_gpu_layers: int) -> Any:
    p = L.llama_model_default_params()
    p.n_gpu_layers = n_gpu_layers
    return p


def context_params(s: LoadSettings, threads: int, n_batch: int, n_ubatch: int = 0) -> Any:
    """The one place settings become a llama_context_params (``n_ubatch`` 0: ``n_batch``)."""
    p = L.llama_context_default_params()
    p.n_ctx = pad_ctx(s.n_ctx) if s.n_ctx > 0 else 0
    p.n_batch = n_batch
    p.n_ubatch = min(n_ubatch or n_batch, n_batch)
    p.n_seq_max = s.n_seq_max
    p.kv_unified = s.kv_unified
    p.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if s.flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    p.type_k = s.type_k
    p.type_v = s.type_v
    p.n_threads = threads
    p.n_threads_batch = threads
    p.swa_full = False  # llama-server's default
    p.no_perf = True
    return p


def _settings(d: dict[str, Any]) -> LoadSettings:
    try:
        return LoadSettings.from_dict(d)
    except (KeyError, ValueError) as e:
        raise Failed(f"bad settings: {e}") from None


class Model:
    def __init__(self, path: str, n_gpu_layers: int, threads: int) -> None:
        self.path = path
        self.ptr = L.llama_model_load_from_file(path.encode(), model_params(n_gpu_layers))
        if not self.ptr:
            raise RuntimeError(f"llama.cpp could not load the model {path}")
        self.threads = pick_threads(threads, os.path.getsize(path))
        self.vocab = L.llama_model_get_vocab(self.ptr)
        self.n_vocab = int(L.llama_vocab_n_tokens(self.vocab))
        self.n_ctx_train = int(L.llama_model_n_ctx_train(self.ptr))
        self.recurrent = bool(L.llama_model_is_recurrent(self.ptr))
        self.hybrid = bool(L.llama_model_is_hybrid(self.ptr))
        self.n_swa = int(L.llama_model_n_swa(self.ptr))
        self.contexts: dict[tuple[Any, ...], Any] = {}

    @property
    def attention_free(self) -> bool:
        return self.recurrent and not self.hybrid

    @property
    def needs_checkpoints(self) -> bool:
        """Memory that cannot be rolled back by dropping cells: REC state, or an SWA window."""
        return self.recurrent or self.hybrid or self.n_swa > 0

    def info(self) -> dict[str, Any]:
        return {
            "recurrent": self.recurrent,
            "hybrid": self.hybrid,
            "n_swa": self.n_swa,
            "n_vocab": self.n_vocab,
            "needs_checkpoints": self.needs_checkpoints,
        }

    def context(self, s: LoadSettings, n_batch: int = BATCH, n_ubatch: int = 0) -> Any:
        """A context with these settings, memory cleared (cached: creating one is not free)."""
        key = (s.n_ctx, s.n_seq_max, s.kv_unified, s.flash_attn, s.type_k, s.type_v, n_batch, n_ubatch)
        ctx = self.contexts.get(key)
        if ctx is None:
            while len(self.contexts) >= 2:
                _, old = self.contexts.popitem()
                L.llama_free(old)
            ctx = L.llama_init_from_model(self.ptr, context_params(s, self.threads, n_batch, n_ubatch))
            if not ctx:
                raise ContextError(
                    f"llama.cpp could not create a context with n_ctx {s.n_ctx}, n_seq_max {s.n_seq_max}, "
                    f"kv_unified {s.kv_unified}, flash_attn {s.flash_attn}, type_k {s.type_k}, type_v {s.type_v}"
                )
            self.contexts[key] = ctx
            return ctx  # llama.cpp zeroes a new cache's buffers: clearing them again costs a pass
        # a reused context: forget its cells and zero the buffers, so that nothing the last
        # file left (NaN in a damaged one) can leak into masked cells of the next
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        return ctx


def _context(model: Model, s: dict[str, Any], n_batch: int) -> Any:
    """A context for a one-shot request; a refusal carries llama.cpp's own reason."""
    try:
        return model.context(_settings(s), n_batch)
    except ContextError as e:
        why = _why()
        raise ContextError(f"{e}: {why}" if why else str(e)) from None


def complete_settings(model: Model, d: dict[str, Any], n_tokens: int) -> dict[str, Any]:
    """Fill what a damaged file could not tell where it does not matter; fail where it does.
    The dict keeps the caller's spelling (cache type names stay names) for its report."""
    s = dict(d)
    missing = []
    if model.attention_free:  # no KV cache: attention settings do not reach the state
        s["flash_attn"] = bool(s.get("flash_attn")) if s.get("flash_attn") is not None else False
        s["type_k"] = s.get("type_k") if s.get("type_k") is not None else F16_NAME
        s["type_v"] = s.get("type_v") if s.get("type_v") is not None else F16_NAME
    for key in ("flash_attn", "type_k", "type_v"):
        if s.get(key) is None:
            missing.append(key.replace("_", "-"))
    if missing:
        raise Failed(
            "the damaged file does not show its "
            + ", ".join(missing)
            + " setting(s); give them (--flash-attn, --cache-type-k, --cache-type-v)"
        )
    n_seq = int(s.get("n_seq_max") or 1)
    s["n_seq_max"] = n_seq
    s["kv_unified"] = bool(s.get("kv_unified") or False)
    s["seq_id"] = int(s.get("seq_id") or 0)
    if s["seq_id"] >= n_seq:
        raise Failed(f"seq_id {s['seq_id']} does not fit n_seq_max {n_seq}")
    per_seq = pad_ctx(n_tokens + 1)
    want = per_seq if s["kv_unified"] else per_seq * n_seq
    if not s.get("n_ctx") or int(s["n_ctx"]) < (n_tokens + 1 if s["kv_unified"] else (n_tokens + 1) * n_seq):
        s["n_ctx"] = want
    return s


def default_checkpoint_positions(n_tokens: int) -> list[int]:
    """Where to take a checkpoint when the damaged file does not say (one, near the end).

    A checkpoint at n_tokens itself would be useless (the body is that state), so the one
    checkpoint sits a little before the end, like the server's own end-of-prompt checkpoint:
    ``T - min(64, max(1, T // 4))``.
    """
    if n_tokens < 2:
        return []
    return [n_tokens - min(64, max(1, n_tokens // 4))]


# ---------------------------------------------------------------------------------------
# llama.cpp state calls
# ---------------------------------------------------------------------------------------


def _set_blob(ctx: Any, blob: bytes, seq: int, flags: int) -> tuple[bool, str]:
    buf = (ctypes.c_uint8 * max(1, len(blob))).from_buffer_copy(blob or b"\0")
    del _recent[:]
    n = int(L.llama_state_seq_set_data_ext(ctx, buf, len(blob), seq, flags))
    if n == len(blob):
        return True, f"consumed all {n} bytes"
    if n == 0:
        why = "; ".join(dict.fromkeys(x for x in _recent if x))
        return False, "llama_state_seq_set_data_ext rejected the blob" + (f": {why}" if why else "")
    return False, (
        f"consumed {n} of {len(blob)} bytes: the server's common_prompt_checkpoint::load_* "
        "would GGML_ABORT on this blob"
    )


def _get_blob(ctx: Any, seq: int, flags: int) -> bytes:
    size = int(L.llama_state_seq_get_size_ext(ctx, seq, flags))
    buf = (ctypes.c_uint8 * max(size, 1))()
    n = int(L.llama_state_seq_get_data_ext(ctx, buf, size, seq, flags))
    if n != size:
        raise Failed(f"llama_state_seq_get_data_ext wrote {n} of {size} bytes")
    return bytes(buf)[:size]


def _load_seq_file(ctx: Any, path: str, seq: int, capacity: int | None) -> tuple[int, int]:
    """llama_state_seq_load_file: (its return, tokens read); ``capacity`` None: a sizing
    pass with tokens_out = NULL, as the server makes before the real one."""
    n_out = ctypes.c_size_t(0)
    if capacity is None:
        ret = int(L.llama_state_seq_load_file(ctx, path.encode(), seq, None, 0, ctypes.byref(n_out)))
        return ret, int(n_out.value)
    toks = (L.llama_token * max(capacity, 1))()
    ret = int(L.llama_state_seq_load_file(ctx, path.encode(), seq, toks, max(capacity, 1), ctypes.byref(n_out)))
    return ret, int(n_out.value)


def _save_seq_file(ctx: Any, path: str, seq: int, words: list[int]) -> int:
    arr = (L.llama_token * max(len(words), 1))(*words)
    return int(L.llama_state_seq_save_file(ctx, path.encode(), seq, arr, len(words)))


def _decode(ctx: Any, tokens: list[int], pos0: int, seq: int, outputs: bool, batch: int = 0) -> None:
    """Decode ``tokens`` at positions from ``pos0`` in calls of up to ``batch`` tokens;
    ``outputs``: logits for the last token of each call."""
    step = max(1, min(batch or BATCH, int(L.llama_n_batch(ctx))))
    for start in range(0, len(tokens), step):
        part = tokens[start : start + step]
        b = L.llama_batch_init(len(part), 0, 1)
        try:
            b.n_tokens = len(part)
            for i, t in enumerate(part):
                b.token[i] = t
                b.pos[i] = pos0 + start + i
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = seq
                b.logits[i] = outputs and i == len(part) - 1
            rc = int(L.llama_decode(ctx, b))
        finally:
            L.llama_batch_free(b)
        if rc != 0:
            raise Failed(f"llama_decode returned {rc} at token {pos0 + start}")


def _decode_one_thread(ctx: Any, tokens: list[int], pos0: int, seq: int, outputs: bool = False) -> None:
    """Decode ``tokens`` one per llama_decode call on a single thread.  A one-token graph is too
    small to share: with two threads each of its few hundred ops ends at a barrier, and on a
    busy machine every barrier waits for the other thread to be scheduled (Gemma 3 270M with
    other processes running: 32 such decodes took 55.7 s on two threads, 2.7 s on one).  The
    thread count does not change the values (1 and 2 threads give bit-identical states)."""
    n_threads, n_batch_threads = int(L.llama_n_threads(ctx)), int(L.llama_n_threads_batch(ctx))
    L.llama_set_n_threads(ctx, 1, 1)
    try:
        _decode(ctx, tokens, pos0, seq, outputs, 1)
    finally:
        L.llama_set_n_threads(ctx, n_threads, n_batch_threads)


def _pos_range(ctx: Any, seq: int) -> tuple[int, int]:
    mem = L.llama_get_memory(ctx)
    return int(L.llama_memory_seq_pos_min(mem, seq)), int(L.llama_memory_seq_pos_max(mem, seq))


def _segments(n: int, cuts: list[int]) -> list[tuple[int, int]]:
    bounds = sorted({c for c in cuts if 0 < c < n} | {0, n})
    return list(itertools.pairwise(bounds))


# ---------------------------------------------------------------------------------------
# which library, which versions
# ---------------------------------------------------------------------------------------

GGSQ_MAGIC_WORD = 0x67677371  # 'ggsq' (LLAMA_STATE_SEQ_MAGIC)
GGSN_MAGIC_WORD = 0x6767736E  # 'ggsn' (LLAMA_SESSION_MAGIC)


def import_bindings() -> Any:
    """llama-cpp-python's ctypes bindings, ``llama_cpp.llama_cpp``, without running the package's
    ``__init__``: that also imports the high-level ``Llama`` class and with it numpy, jinja2 and
    the chat formats (a quarter of a second of CPU on every start), and the worker calls the C API
    only.  The package is entered as a bare namespace with the installed package's path; a
    llama-cpp-python laid out otherwise gets the plain ``import llama_cpp``.  A library that does
    not load raises here either way (llama_cpp.llama_cpp opens it on import)."""
    import importlib.util
    import types

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("No module named 'llama_cpp' (pip install llama-cpp-python)")
    pkg = types.ModuleType("llama_cpp")
    pkg.__path__ = list(spec.submodule_search_locations)
    pkg.__file__ = spec.origin
    pkg.__package__ = "llama_cpp"
    sys.modules["llama_cpp"] = pkg
    from slotfile.llama.worker import abi  # an older libllama (--llama-lib): its ABI differences

    try:
        abi.tolerate_missing_symbols()
        import llama_cpp.llama_cpp as bindings
    except ImportError:  # not the layout this expects: the whole package, the usual way
        for name in [m for m in sys.modules if m == "llama_cpp" or m.startswith("llama_cpp.")]:
            del sys.modules[name]
        import llama_cpp

        return llama_cpp
    abi.adapt_model_params(bindings)
    return bindings


def package_version() -> str:
    """llama-cpp-python's ``__version__`` as its ``__init__`` spells it (which
    :func:`import_bindings` does not run), read from the file: importlib.metadata costs more."""
    import re

    mod = sys.modules.get("llama_cpp")
    ver = getattr(mod, "__version__", None)
    if ver:
        return str(ver)
    try:
        with open(getattr(mod, "__file__", None) or "", encoding="utf-8") as f:
            m = re.search(r"""^__version__\s*=\s*["']([^"']+)["']""", f.read(), re.M)
    except OSError:
        return "?"
    return m.group(1) if m else "?"


def library_path() -> str:
    """The libllama the bindings actually opened (LLAMA_CPP_LIB_PATH or the package's own)."""
    import llama_cpp.llama_cpp as bindings

    name = getattr(getattr(bindings, "_lib", None), "_name", None)
    return os.path.abspath(name) if name else "?"


def _header_version(path: str, magic: int) -> int | None:
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) < 8:
        return None
    m, v = struct.unpack("<II", head)
    return int(v) if m == magic else None


def detect_versions(model: Model) -> dict[str, Any]:
    """The state and session versions the loaded library writes, read back from the headers
    of two tiny files it saves (llama_state_seq_save_file, llama_state_save_file) from an
    empty one-sequence context: llama.h's version macros are compile-time constants that no
    exported function returns (llama_version() is the release string), and the Python
    package's LLAMA_STATE_SEQ_VERSION describes the library it was built with, not this one."""
    import tempfile

    t0 = time.monotonic()
    out: dict[str, Any] = {"state_seq_version": None, "session_version": None, "error": None}
    p = L.llama_context_default_params()
    p.n_ctx = 256
    p.n_batch = p.n_ubatch = 8
    p.n_seq_max = 1
    p.n_threads = p.n_threads_batch = 1
    p.no_perf = True
    ctx = L.llama_init_from_model(model.ptr, p)
    if not ctx:
        out["error"] = "llama.cpp could not create a context to save a test state: " + (_why() or "no reason logged")
        out["seconds"] = time.monotonic() - t0
        return out
    fd, tmp = tempfile.mkstemp(prefix="slotfile-version-", suffix=".bin")
    os.close(fd)
    try:
        none = (L.llama_token * 1)()
        if int(L.llama_state_seq_save_file(ctx, tmp.encode(), 0, none, 0)):
            out["state_seq_version"] = _header_version(tmp, GGSQ_MAGIC_WORD)
        if bool(L.llama_state_save_file(ctx, tmp.encode(), none, 0)):
            out["session_version"] = _header_version(tmp, GGSN_MAGIC_WORD)
        if out["state_seq_version"] is None:
            out["error"] = "the library's llama_state_seq_save_file wrote no GGSQ header: " + (_why() or "?")
    finally:
        L.llama_free(ctx)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    out["seconds"] = time.monotonic() - t0
    return out


class Worker:
    def __init__(self, args: argparse.Namespace) -> None:
        self.model = Model(args.model, args.n_gpu_layers, args.threads)
        self.draft = Model(args.draft_model, args.n_gpu_layers, args.threads) if args.draft_model else None
        _T["model"] = time.monotonic()
        self.versions = detect_versions(self.model)
        _T["versions"] = time.monotonic()

    def hello(self) -> dict[str, Any]:
        return {
            "ok": True,
            "pid": os.getpid(),
            "llama_cpp_python": package_version(),
            # what the library itself writes (detect_versions), not the Python package's constants
            "state_seq_version": self.versions.get("state_seq_version"),
            "session_version": self.versions.get("session_version"),
            "version_error": self.versions.get("error"),
            "detect_seconds": self.versions.get("seconds"),
            "python_state_seq_version": int(L.LLAMA_STATE_SEQ_VERSION),
            "python_session_version": int(L.LLAMA_SESSION_VERSION),
            "library": library_path(),
            "n_vocab": self.model.n_vocab,
            "n_ctx_train": self.model.n_ctx_train,
            "draft_n_vocab": self.draft.n_vocab if self.draft else None,
            "model": self.model.info(),
            "startup": dict(_T),
        }

    def _state_version(self) -> int:
        """The state version this library writes (the header of a recomputed state must say it)."""
        v = self.versions.get("state_seq_version")
        return int(v) if v is not None else int(L.LLAMA_STATE_SEQ_VERSION)

    # ---------------------------------------------------------------- load

    def _restore(self, ctx: Any, path: str, seq: int, fmt: str) -> tuple[int, str, int]:
        """(body end offset or 0, message, number of token words)."""
        if fmt == "GGSN":
            with open(path, "rb") as f:
                head = f.read(12)
            n_words = struct.unpack_from("<I", head, 8)[0] if len(head) >= 12 else 0
            cap = max(1, n_words)
            toks = (L.llama_token * cap)()
            n_out = ctypes.c_size_t(0)
            ok = bool(L.llama_state_load_file(ctx, path.encode(), toks, cap, ctypes.byref(n_out)))
            if not ok:
                return 0, "llama_state_load_file failed", n_words
            return os.path.getsize(path), "", n_words
        # the server's two passes: first the token count only, then tokens and state
        ret, n_words = _load_seq_file(ctx, path, seq, None)
        if ret == 0:
            return 0, "llama_state_seq_load_file refused the header (sizing pass)", 0
        ret, _ = _load_seq_file(ctx, path, seq, n_words)
        if ret == 0:
            return 0, "llama_state_seq_load_file returned 0", n_words
        return ret, "", n_words

    def load(self, req: dict[str, Any]) -> dict[str, Any]:
        path, s = req["path"], _settings(req["settings"])
        seq = s.seq_id
        fmt = req.get("format", "GGSQ")
        out: dict[str, Any] = {
            "ok": False,
            "message": "",
            "body_bytes": 0,
            "checkpoints": [],
            "checkpoint_drafts": [],
            "draft": None,
            "notes": [],
        }
        try:
            ctx = self.model.context(s)
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
            if size <= ret:  # no appendix: the reader (numpy, construct) stays unimported
                return out
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        data = memoryview(mm)[ret:]
        # imported here, not at start-up: the worker must reach the model load cheaply
        from slotfile.format.appendix import server_read

        ckpts, sckp_note, sdft_dft, sdft_note = server_read(data, 0).astuple()  # blobs: views of the map
        for note in (sckp_note, sdft_note):
            if note:
                out["notes"].append(note)
        flags = int(L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
        for tgt, _dft in ckpts or []:
            out["checkpoints"].append(list(_set_blob(ctx, tgt, seq, flags)))
        if self.draft is not None and req.get("draft_settings") is not None:
            ds_raw = req["draft_settings"]
            ds = _settings(ds_raw)
            try:
                dctx = self.draft.context(ds)
            except ContextError as e:
                if sdft_dft is not None:
                    out["draft"] = [False, str(e)]
                return out
            dseq = int(ds_raw.get("seq_id", seq))
            for _tgt, dft in ckpts or []:
                if dft:
                    out["checkpoint_drafts"].append(list(_set_blob(dctx, dft, dseq, flags)))
                else:
                    out["checkpoint_drafts"].append([True, "no data_dft"])
            if sdft_dft is not None:
                out["draft"] = list(_set_blob(dctx, sdft_dft, dseq, 0)) if sdft_dft else [True, "empty data_dft"]
        return out

    # ---------------------------------------------------------------- deep

    def _logits(self, ctx: Any) -> Any:
        import numpy as np

        p = L.llama_get_logits_ith(ctx, -1)
        return np.ctypeslib.as_array(p, shape=(self.model.n_vocab,)).astype(np.float32, copy=True)

    def deep(self, req: dict[str, Any]) -> dict[str, Any]:
        """Restore the file and decode the probe (logits A); recompute the tokens in the same
        context, cleared, with the server's batch sizes (``n_batch``/``n_ubatch``, default
        2048/512 as common/common.h), write that state to ``out`` and decode the probe (logits
        B).  With ``tail`` > 0 and ``out_floor``: drop the last ``tail`` cells, decode those
        tokens again one per llama_decode call (the path the server's generated tokens take),
        write that state to ``out_floor`` and decode the probe (logits C): the parent's noise
        floor, at the cost of ``tail`` single-token decodes."""
        import numpy as np

        path, s, tokens = req["path"], _settings(req["settings"]), [int(t) for t in req["tokens"]]
        probe = int(req["probe"])
        n_batch = int(req.get("n_batch") or DEEP_N_BATCH)
        n_ubatch = int(req.get("n_ubatch") or DEEP_N_UBATCH)
        n = len(tokens)
        tail = min(int(req.get("tail") or 0), n // 2) if req.get("out_floor") else 0
        seq = s.seq_id
        out: dict[str, Any] = {"ok": False, "message": ""}
        try:
            ctx = self.model.context(s, n_batch, n_ubatch)
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
            _decode_one_thread(ctx, [probe], pos_next, seq, True)
            after_restore = self._logits(ctx)
            # recompute from the tokens in the same context, cleared
            L.llama_memory_clear(mem, True)
            _decode(ctx, tokens, 0, seq, False, n_batch)
            self._write_state(ctx, seq, req["out"])
            _decode_one_thread(ctx, [probe], n, seq, True)
            recomputed = self._logits(ctx)
            floor = None
            # a recurrent state cannot drop its last cells (llama_memory_seq_rm says no): no floor
            if tail > 0 and not (self.model.recurrent or self.model.hybrid):
                if not L.llama_memory_seq_rm(mem, seq, n - tail, -1):
                    raise Failed(f"llama_memory_seq_rm refused to drop positions {n - tail}..{n - 1}")
                _decode_one_thread(ctx, tokens[n - tail :], n - tail, seq)
                self._write_state(ctx, seq, req["out_floor"])
                _decode_one_thread(ctx, [probe], n, seq, True)
                floor = self._logits(ctx)
        except Failed as e:
            out["message"] = str(e)
            return out
        finally:
            L.llama_memory_clear(mem, True)
        d = after_restore.astype(np.float64) - recomputed.astype(np.float64)
        norm = float(np.linalg.norm(recomputed.astype(np.float64)))
        top_r = np.argsort(-after_restore)[:5].tolist()
        top_c = np.argsort(-recomputed)[:5].tolist()
        lg: dict[str, Any] = {
            "max_abs": float(np.max(np.abs(d))) if d.size else 0.0,
            "mean_abs": float(np.mean(np.abs(d))) if d.size else 0.0,
            "rel": float(np.linalg.norm(d) / norm) if norm > 0 else float(np.linalg.norm(d)),
            "scale": float(np.std(recomputed)) if recomputed.size else 0.0,
            "top5_restored": top_r,
            "top5_recomputed": top_c,
            "all_finite": bool(np.all(np.isfinite(after_restore))),
        }
        if floor is not None:
            fd = floor.astype(np.float64) - recomputed.astype(np.float64)
            lg["floor_rel"] = float(np.linalg.norm(fd) / norm) if norm > 0 else float(np.linalg.norm(fd))
        tail = tail if floor is not None else 0
        out.update(ok=True, message="recomputed", logits=lg, n_batch=n_batch, n_ubatch=n_ubatch, tail=tail)
        return out

    def _write_state(self, ctx: Any, seq: int, path: str) -> None:
        """The sequence's state as a GGSQ file with no tokens: header + body."""
        blob = _get_blob(ctx, seq, 0)
        from slotfile.format.grammar import GGSQ_MAGIC, file_header  # lazily: start-up stays cheap

        with open(path, "wb") as f:
            f.write(file_header(GGSQ_MAGIC, self._state_version(), 0))
            f.write(blob[8:])

    # ---------------------------------------------------------------- prefill

    def prefill(self, req: dict[str, Any]) -> dict[str, Any]:
        tokens: list[int] = [int(t) for t in req["tokens"]]
        words: list[int] = [int(w) for w in req["words"]]
        n = len(tokens)
        model = self.model
        bad = [t for t in tokens if not 0 <= t < model.n_vocab]
        if bad:
            raise Failed(
                f"token {bad[0]} is outside the model's vocabulary of {model.n_vocab} "
                "(a different model, or media positions that cannot be prefilled)"
            )
        s = complete_settings(model, req.get("settings") or {}, n)
        seq = s["seq_id"]
        at = req.get("checkpoints_at")
        if at is None:
            at = default_checkpoint_positions(n) if model.needs_checkpoints else []
        at = sorted({int(a) for a in at if 0 < int(a) <= n})
        n_batch = int(req.get("n_batch") or BATCH)
        ctx = _context(model, s, n_batch)
        dctx = ds = None
        if self.draft is not None:
            ds = dict(s)
            ds.update({k: v for k, v in (req.get("draft_settings") or {}).items() if v is not None})
            ds.setdefault("type_k", F16_NAME)
            ds = complete_settings(self.draft, ds, n)
            dctx = _context(self.draft, ds, n_batch)
        flags = L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        cps: list[dict[str, Any]] = []
        with open(req["blobs"], "wb") as bf:
            for a, b in _segments(n, at):
                _decode(ctx, tokens[a:b], a, seq, True, n_batch)
                if dctx is not None:
                    _decode(dctx, tokens[a:b], a, seq, True, n_batch)
                if b in at:
                    pmin, pmax = _pos_range(ctx, seq)
                    item: dict[str, Any] = {"n_tokens": b, "pos_min": pmin, "pos_max": pmax}
                    tgt = _get_blob(ctx, seq, flags)
                    item["tgt"] = [bf.tell(), len(tgt)]
                    bf.write(tgt)
                    if dctx is not None:
                        dft = _get_blob(dctx, seq, flags)
                        item["dft"] = [bf.tell(), len(dft)]
                        bf.write(dft)
                    cps.append(item)
            draft = None
            if dctx is not None:
                full = _get_blob(dctx, seq, 0)
                draft = [bf.tell(), len(full)]
                bf.write(full)
            bf.flush()
            os.fsync(bf.fileno())
        written = _save_seq_file(ctx, req["out"], seq, words)
        if written == 0:
            raise Failed("llama_state_seq_save_file wrote nothing: " + _why())
        size = os.path.getsize(req["out"])
        if written != size:
            raise Failed(f"llama_state_seq_save_file reported {written} bytes, the file has {size}")
        return {
            "ok": True,
            "message": f"prefilled {n} tokens",
            "model": model.info(),
            "settings": s,
            "draft_settings": ds,
            "file_size": size,
            "checkpoints": cps,
            "draft": draft,
            "n_batch": n_batch,
        }

    # ---------------------------------------------------------------- resave

    def resave(self, req: dict[str, Any]) -> dict[str, Any]:
        model = self.model
        s = complete_settings(model, dict(req["settings"]), int(req.get("n_tokens") or 0))
        ctx = _context(model, s, int(req.get("n_batch") or BATCH))
        seq = s["seq_id"]
        ret, n_words = _load_seq_file(ctx, req["in"], seq, int(req["capacity"]))
        if ret == 0:
            raise Failed(f"llama_state_seq_load_file refused the file: {_why(4) or 'no reason logged'}")
        pmin, pmax = _pos_range(ctx, seq)
        words = [int(w) for w in req["words"]]
        written = _save_seq_file(ctx, req["out"], seq, words)
        if written == 0:
            raise Failed("llama_state_seq_save_file wrote nothing: " + _why())
        return {
            "ok": True,
            "message": f"loaded {ret} bytes and saved {written}",
            "load_ret": ret,
            "n_words_loaded": n_words,
            "file_size": os.path.getsize(req["out"]),
            "settings": s,
            "pos_range": [pmin, pmax],
            "model": model.info(),
        }

    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req.get("op")
        fn = {"load": self.load, "deep": self.deep, "prefill": self.prefill, "resave": self.resave}.get(str(op))
        if fn is None:
            return {"ok": False, "message": f"unknown op {op!r}"}
        t0 = time.monotonic()
        del _recent[:]
        try:
            res = fn(req)
        except Failed as e:
            res = {"ok": False, "message": str(e)}
        res["seconds"] = time.monotonic() - t0
        return res


def main() -> int:
    global _proto, L, _log_callback
    ap = argparse.ArgumentParser(prog="python -m slotfile.llama.worker")
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft-model")
    ap.add_argument("--n-gpu-layers", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="0: SLOTFILE_THREADS, else by model size")
    args = ap.parse_args()

    # the protocol gets the original stdout; fd 1 now goes to the log (stderr)
    _proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    lib_dir = os.environ.get("LLAMA_CPP_LIB_PATH")
    try:
        bindings = import_bindings()
    except Exception as e:  # a missing, broken or incompatible library: one line for the parent
        where = f"the llama.cpp library in {lib_dir}" if lib_dir else "llama-cpp-python's own llama.cpp library"
        why = " ".join(str(e).split()) or type(e).__name__
        _send({"ok": False, "library_error": True, "message": f"{where} cannot be loaded: {why}"})
        return 1
    _mark("library loaded")
    _T["library"] = time.monotonic()

    L = bindings
    _log_callback = L.llama_log_callback(_log_cb)
    L.llama_log_set(_log_callback, ctypes.c_void_p(0))
    L.llama_backend_init()
    try:
        worker = Worker(args)
    except Exception as e:  # reported to the parent as an operational error
        _send({"ok": False, "message": str(e)})
        return 1
    _send(worker.hello())
    for line in sys.stdin:
        if not line.strip():
            continue
        req: Any = None
        try:
            req = json.loads(line)
            op = req.get("op")
            _mark(f"{op} {req.get('id', '')}")
            if op == "quit":
                break
            res = worker.handle(req)
        except Exception as e:  # a Python-side failure is reported, not fatal
            res = {"ok": False, "message": f"worker error: {type(e).__name__}: {e}", "trace": traceback.format_exc()}
        res["id"] = req.get("id") if isinstance(req, dict) else None
        _send(res)
    return 0
