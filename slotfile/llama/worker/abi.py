"""Let llama-cpp-python's ctypes bindings drive an older libllama (``--llama-lib``): the worker's
ABI shim.

The bindings slotfile runs with (llama-cpp-python 0.3.36, llama.cpp of 2026-10-01) describe that
llama.cpp's public API.  A library of another state version has a slightly different one, and two
differences matter to the worker:

* **symbols the older library lacks.**  The bindings bind every function when they are imported
  (``llama_cpp._ctypes_extensions.ctypes_function_for_shared_library`` does ``getattr(lib, name)``),
  so one missing symbol (``llama_batch_ext_init``, new in the 2026-10 llama.h) makes the whole
  import fail.  :func:`tolerate_missing_symbols` binds a missing one to a function that raises
  when called instead; the worker calls none of them.
* **``struct llama_model_params``.**  llama.cpp of 2026-10 inserted ``enum llama_lazy_mode lazy_mode``
  after ``load_mode``; the version-2 llama.cpp (2026-08-16, vendored by llama-cpp-python 0.3.35,
  ``scripts/build-llama-v2.sh``) has ``main_gpu`` there.  The struct is returned and passed by
  value, so the bindings' layout would shift every later field (a boolean would land in
  ``kv_overrides``, a pointer).  :func:`adapt_model_params` asks the library which layout it has
  and rebinds ``llama_model_default_params`` / ``llama_model_load_from_file`` to a matching struct.
  ``llama_context_params`` is the same in both.

The layout test calls the library's own ``llama_model_default_params`` into a buffer larger than
either struct (a struct this size is returned through a caller-provided pointer on every ABI
llama.cpp supports, so the callee writes its own size only) and reads the int at the offset of
``lazy_mode`` in the new layout: ``LLAMA_LAZY_MODE_AUTO`` (1) there, where the old layout has
``main_gpu``, whose default is 0 (``llama_model_default_params`` in ``src/llama-model.cpp`` of both).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

__all__ = ["adapt_model_params", "has_lazy_mode", "tolerate_missing_symbols"]

LAZY_MODE_OFFSET = 28  # devices (8), tensor_buft_overrides (8), n_gpu_layers, split_mode, load_mode (4 each)
LAZY_MODE_AUTO = 1


def tolerate_missing_symbols() -> None:
    """Patch ``llama_cpp._ctypes_extensions`` (before ``llama_cpp.llama_cpp`` is imported) so that a
    function the library does not export is bound to a stub that raises when called."""
    import llama_cpp._ctypes_extensions as ext

    if getattr(ext, "_slotfile_tolerant", False):
        return
    original = ext.ctypes_function_for_shared_library

    def tolerant(lib: ctypes.CDLL) -> Any:
        strict = original(lib)

        def ctypes_function(name: str, argtypes: list[Any], restype: Any, enabled: bool = True) -> Any:
            if not enabled or hasattr(lib, name):
                return strict(name, argtypes, restype, enabled)

            def decorator(f: Any) -> Any:
                @functools.wraps(f)
                def missing(*_a: Any, **_k: Any) -> Any:
                    raise NotImplementedError(f"{name} is not exported by this libllama (an older llama.cpp)")

                return missing

            return decorator

        return ctypes_function

    ext.ctypes_function_for_shared_library = tolerant
    ext._slotfile_tolerant = True  # type: ignore[attr-defined]


class _Probe(ctypes.Structure):
    _fields_ = [("raw", ctypes.c_uint8 * 512)]


def has_lazy_mode(lib: ctypes.CDLL) -> bool:
    """Whether this library's ``llama_model_params`` has ``lazy_mode`` after ``load_mode``."""
    fn = ctypes.CFUNCTYPE(_Probe)(("llama_model_default_params", lib))
    raw = bytes(fn().raw)
    return int.from_bytes(raw[LAZY_MODE_OFFSET : LAZY_MODE_OFFSET + 4], "little", signed=True) == LAZY_MODE_AUTO


def adapt_model_params(bindings: Any) -> bool:
    """Rebind the model-params functions to the library's own layout when it lacks ``lazy_mode``;
    True when it did (the library is older than the bindings)."""
    lib = getattr(bindings, "_lib", None)
    new = getattr(bindings, "llama_model_params", None)
    if lib is None or new is None or "lazy_mode" not in [f[0] for f in new._fields_]:
        return False
    if has_lazy_mode(lib):
        return False
    fields = [f for f in new._fields_ if f[0] != "lazy_mode"]
    old = type("llama_model_params_v2", (ctypes.Structure,), {"_fields_": fields})
    lib.llama_model_default_params.restype = old  # the very objects the bindings' names refer to
    lib.llama_model_default_params.argtypes = []
    for name in ("llama_model_load_from_file", "llama_load_model_from_file"):
        if hasattr(lib, name):
            getattr(lib, name).argtypes = [ctypes.c_char_p, old]
    return True
