"""Test-load slot files with the real llama.cpp loader, in a separate process.

``llama_cpp`` is never imported here: every llama.cpp call runs in a worker process
(``python -m slotfile.llama.worker``, started with ``subprocess`` and spoken to in JSON lines; the
repairs' prefill and re-save use the same program through :mod:`slotfile.llama.requests`), so an abort
or a segfault inside llama.cpp on a bad file costs one worker, never the caller.  The pool
notices the death, reports the file as ``crashed`` with the signal's name and the last lines
llama.cpp wrote, and starts a fresh worker for the next file.  Each worker loads its model(s)
once and keeps up to two contexts (keyed by settings) for all the files it is given.

    with LoaderPool("model.gguf") as pool:
        r = pool.load("slot0.bin")          # settings derived from the file
        if not r.ok: print(r.message, r.log)

A slot file only loads into a context that mirrors the one that saved it (slot-format.md
§10, facts.md): ``n_seq_max`` = the file's ``n_stream`` with a non-unified cache, a unified
cache when one stream served several slots, flash attention on exactly when ``v_trans == 0``,
and the same K/V cache types.  :func:`settings_for` reads those from the file.
"""

from __future__ import annotations

from slotfile.llama.library import (
    LIB_ENV,
    Library,
    LoaderError,
    library_dir,
    library_label,
    resolve_library,
    server_library,
)
from slotfile.llama.pool import (
    DeepResult,
    LoaderPool,
    LoadResult,
    WorkerProcess,
    telling_line,
    test_load,
)
from slotfile.llama.settings import settings_for
from slotfile.llama.worker.settings import LoadSettings

# The loader in three modules: slotfile.llama.library (which libllama), slotfile.llama.settings
# (the context a file needs) and slotfile.llama.pool (the worker processes); this module is the
# one entry callers import from.
__all__ = [
    "LIB_ENV",
    "DeepResult",
    "Library",
    "LoadResult",
    "LoadSettings",
    "LoaderError",
    "LoaderPool",
    "WorkerProcess",
    "library_dir",
    "library_label",
    "resolve_library",
    "server_library",
    "settings_for",
    "telling_line",
    "test_load",
]
