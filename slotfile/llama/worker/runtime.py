"""The worker's runtime: the llama.cpp bindings (``L``, bound by :func:`bind_library`), the
protocol pipe, llama.cpp's log, the model and its contexts, and the library's versions.  Only
the worker process imports this (see :mod:`slotfile.llama.worker.program`)."""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import struct
import sys
import threading
import time
from typing import Any

from slotfile.format.magics import GGSN_MAGIC, GGSQ_MAGIC
from slotfile.llama.cpu import use_extra_bufts
from slotfile.llama.worker.settings import LoadSettings, pad_ctx

BATCH = 512  # tokens per llama_decode call (n_batch = n_ubatch) unless a request says otherwise
DEEP_N_BATCH, DEEP_N_UBATCH = 2048, 512  # the deep recompute: llama-server's defaults (common/common.h)
TINY_MODEL = 64 << 20  # below this ggml's spinning threads only cost: one thread
F16_NAME = "f16"  # what an attention-free model's (unused) cache types default to

proto: Any = None
# start-up phases (CLOCK_MONOTONIC, the parent's clock too)
startup: dict[str, float] = {"python": time.monotonic()}
L: Any = None  # the llama_cpp bindings, bound by bind_library()
_last_level = 0
recent: list[str] = []  # the latest error lines, for messages about one call


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
                recent.append(text.decode("utf-8", "replace").strip())
                del recent[:-20]
    except Exception:  # never raise into C
        pass


_log_callback: Any = None


def send(obj: dict[str, Any]) -> None:
    proto.write(json.dumps(obj) + "\n")
    proto.flush()


def mark(text: str) -> None:
    """A marker line in the log so that lines can be told apart per request."""
    os.write(2, f"@@slotfile {text}\n".encode())


def import_beside(module: str) -> None:
    """Import ``module`` on a thread while the caller goes on: llama.cpp's calls release the
    GIL (ctypes), so the import runs beside them instead of before them.  Whoever imports it
    next waits for this import to finish (the import lock); a failure is raised there again."""
    if module not in sys.modules:
        threading.Thread(target=_import_quietly, args=(module,), daemon=True).start()


def _import_quietly(module: str) -> None:
    with contextlib.suppress(Exception):
        importlib.import_module(module)


def logged_errors(n: int = 3) -> str:
    """The last error lines llama.cpp logged during this request."""
    return " / ".join(x for x in recent[-n:] if x)


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
    return use_extra_bufts(p)  # off on an AMX CPU, where llama.cpp's AMX kernels crash (slotfile.llama.cpu)


def context_params(s: LoadSettings, threads: int, n_batch: int, n_ubatch: int = 0, swa_full: bool = False) -> Any:
    """The one place settings become a llama_context_params (``n_ubatch`` 0: ``n_batch``;
    ``swa_full``: a sliding-window cache of the whole context, llama-server's ``--swa-full``)."""
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
    p.swa_full = swa_full  # llama-server's default: off
    p.no_perf = True
    return p


def request_settings(d: dict[str, Any]) -> LoadSettings:
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

    def context(self, s: LoadSettings, n_batch: int = BATCH, n_ubatch: int = 0, swa_full: bool = False) -> Any:
        """A context with these settings, memory cleared (cached: creating one is not free)."""
        key = (s.n_ctx, s.n_seq_max, s.kv_unified, s.flash_attn, s.type_k, s.type_v, n_batch, n_ubatch, swa_full)
        ctx = self.contexts.get(key)
        if ctx is None:
            while len(self.contexts) >= 2:
                _, old = self.contexts.popitem()
                L.llama_free(old)
            ctx = L.llama_init_from_model(self.ptr, context_params(s, self.threads, n_batch, n_ubatch, swa_full))
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


def request_context(model: Model, s: dict[str, Any], n_batch: int) -> Any:
    """A context for a one-shot request; a refusal carries llama.cpp's own reason."""
    try:
        return model.context(request_settings(s), n_batch)
    except ContextError as e:
        reason = logged_errors()
        raise ContextError(f"{e}: {reason}" if reason else str(e)) from None


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
            + (" setting" if len(missing) == 1 else " settings")
            + "; give them (--flash-attn, --cache-type-k, --cache-type-v)"
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
# which library, which versions
# ---------------------------------------------------------------------------------------


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


def header_version(path: str, magic: int) -> int | None:
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
        out["error"] = "llama.cpp could not create a context to save a test state: " + (
            logged_errors() or "no reason logged"
        )
        out["seconds"] = time.monotonic() - t0
        return out
    fd, tmp = tempfile.mkstemp(prefix="slotfile-version-", suffix=".bin")
    os.close(fd)
    try:
        none = (L.llama_token * 1)()
        if int(L.llama_state_seq_save_file(ctx, tmp.encode(), 0, none, 0)):
            out["state_seq_version"] = header_version(tmp, GGSQ_MAGIC)
        if bool(L.llama_state_save_file(ctx, tmp.encode(), none, 0)):
            out["session_version"] = header_version(tmp, GGSN_MAGIC)
        if out["state_seq_version"] is None:
            out["error"] = "the library's llama_state_seq_save_file wrote no GGSQ header: " + (logged_errors() or "?")
    finally:
        L.llama_free(ctx)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    out["seconds"] = time.monotonic() - t0
    return out


def open_protocol() -> None:
    """The protocol gets the original stdout; fd 1 then goes to the log (stderr), so that
    nothing llama.cpp prints can corrupt the protocol."""
    global proto
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr


def bind_library() -> str | None:
    """Import the bindings into ``L``, route llama.cpp's log through :func:`_log_cb` and init
    the backend; a library that does not load gives the one-line message for the parent."""
    global L, _log_callback
    lib_dir = os.environ.get("LLAMA_CPP_LIB_PATH")
    try:
        bindings = import_bindings()
    except Exception as e:  # a missing, broken or incompatible library: one line for the parent
        where = f"the llama.cpp library in {lib_dir}" if lib_dir else "llama-cpp-python's own llama.cpp library"
        why = " ".join(str(e).split()) or type(e).__name__
        return f"{where} cannot be loaded: {why}"
    mark("library loaded")
    startup["library"] = time.monotonic()
    L = bindings
    _log_callback = L.llama_log_callback(_log_cb)
    L.llama_log_set(_log_callback, ctypes.c_void_p(0))
    L.llama_backend_init()
    return None
