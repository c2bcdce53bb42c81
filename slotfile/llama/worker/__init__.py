"""The llama.cpp worker: one program that owns every llama.cpp call slotfile makes.

* :mod:`slotfile.llama.worker.settings`: the context settings record both sides share
  (:class:`LoadSettings`, its dict form, the n_ctx rounding, cache type names to ids).
* :mod:`slotfile.llama.worker.pieces`: how a recompute cuts its prompt into llama_decode calls, which
  both sides share (the worker decodes them, the deep check derives a schedule's micro-batches).
* :mod:`slotfile.llama.worker.program`: the program run in the child (``python -m slotfile.llama.worker``):
  the requests and ``main``; :mod:`~slotfile.llama.worker.runtime` (bindings, protocol, log,
  model, contexts, versions) and :mod:`~slotfile.llama.worker.calls` (the llama.cpp state
  calls) are its parts.  It imports llama.cpp, these modules, the settings module, the magics
  and the standard library, nothing else of slotfile before a request needs it.
* The parent side lives in :mod:`slotfile.llama.loader` (re-exporting :mod:`~slotfile.llama.library`,
  :mod:`~slotfile.llama.settings` and :mod:`~slotfile.llama.pool`: the library, the settings from
  a file, the pool of long-lived workers and crash handling) and :mod:`slotfile.llama.requests`
  (one request, one worker).

Nothing here imports llama_cpp: that happens in the child's ``main`` only.
"""
