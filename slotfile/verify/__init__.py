"""``slotfile verify``: four levels of evidence that a slot file is what it claims to be.

Each level is reported on its own, per file (status ``pass``, ``fail`` or ``skipped``):

1. **structure** (:mod:`.structure`): the reader's problems (no model needed);
2. **model** (:mod:`.model`, ``--model``): the body and every checkpoint blob against the
   layout the GGUF implies, token ids below ``n_vocab``, positions below ``n_ctx_train``, the
   draft blobs against ``--draft-model``;
3. **load** (:mod:`.load`, ``--model``): the real llama.cpp loader in a worker process, every
   checkpoint's ``data_tgt`` and the draft state;
4. **deep** (:mod:`.deep`, ``--deep``): the stored tokens prefilled again in a fresh context
   with the same settings; the recomputed K/V (R/S) compared with the file's layer by layer
   against the recompute's own noise (:mod:`.judge`, statistics in :mod:`.stats`), and the
   next-token logits after restoring the file compared with those after the recompute.

:mod:`.collect` picks the files (a directory through the walker of ``ls`` and ``prune``),
:mod:`.engine` runs the levels, :mod:`.records` holds what they report.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# The names below are imported on first use (PEP 562), not with the package: a structure-only
# directory run imports slotfile.verify.records and .engine's reader side in the process that
# forks the workers, and the judge, the loader and the model bridge only where a model is in
# play (each ~10-40 ms of start-up before the workers can fork).
# collect is also a submodule's name: imported here, or importing the submodule first would
# leave the package attribute the module, never reaching __getattr__
from slotfile.verify.collect import collect

if TYPE_CHECKING:
    from slotfile.verify.engine import Verifier
    from slotfile.verify.judge import DEEP_JUDGMENT, MARGIN_LIMIT, MIN_FLOOR, STEPWISE_TOKENS
    from slotfile.verify.load import level_load, version_message
    from slotfile.verify.model import ModelSide, level_model, model_side, read
    from slotfile.verify.options import VerifyOptions
    from slotfile.verify.records import LEVELS, SCHEMA, FileReport, Level, SkipKind, Status, Verdict, VerifyError
    from slotfile.verify.structure import level_structure

_WHERE = {
    "Verifier": "slotfile.verify.engine",
    "DEEP_JUDGMENT": "slotfile.verify.judge",
    "MARGIN_LIMIT": "slotfile.verify.judge",
    "MIN_FLOOR": "slotfile.verify.judge",
    "STEPWISE_TOKENS": "slotfile.verify.judge",
    "level_load": "slotfile.verify.load",
    "version_message": "slotfile.verify.load",
    "ModelSide": "slotfile.verify.model",
    "level_model": "slotfile.verify.model",
    "model_side": "slotfile.verify.model",
    "read": "slotfile.verify.model",
    "VerifyOptions": "slotfile.verify.options",
    "LEVELS": "slotfile.verify.records",
    "SCHEMA": "slotfile.verify.records",
    "FileReport": "slotfile.verify.records",
    "Level": "slotfile.verify.records",
    "SkipKind": "slotfile.verify.records",
    "Status": "slotfile.verify.records",
    "Verdict": "slotfile.verify.records",
    "VerifyError": "slotfile.verify.records",
    "level_structure": "slotfile.verify.structure",
}


def __getattr__(name: str) -> Any:
    try:
        where = _WHERE[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value
    return value


__all__ = [
    "DEEP_JUDGMENT",
    "LEVELS",
    "MARGIN_LIMIT",
    "MIN_FLOOR",
    "SCHEMA",
    "STEPWISE_TOKENS",
    "FileReport",
    "Level",
    "ModelSide",
    "SkipKind",
    "Status",
    "Verdict",
    "Verifier",
    "VerifyError",
    "VerifyOptions",
    "collect",
    "level_load",
    "level_model",
    "level_structure",
    "model_side",
    "read",
    "version_message",
]
