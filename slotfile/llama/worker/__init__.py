"""The llama.cpp worker: one program that owns every llama.cpp call slotfile makes.

* :mod:`slotfile.llama.worker.settings`: the context settings record both sides share
  (:class:`LoadSettings`, its dict form, the n_ctx rounding, cache type names to ids).
* :mod:`slotfile.llama.worker.program`: the program run in the child (``python -m slotfile.llama.worker``);
  it imports llama.cpp, the settings module and the standard library, nothing else of slotfile.
* The parent side lives in :mod:`slotfile.llama.loader` (the pool of long-lived workers, crash
  handling, settings from a file) and :mod:`slotfile.llama.requests` (one request, one worker).

Nothing here imports llama_cpp: that happens in the child's ``main`` only.
"""
