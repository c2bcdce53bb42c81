"""Level 2, model metadata: the body and every checkpoint blob against the layout the GGUF
implies (:mod:`slotfile.model.expect`), token ids below ``n_vocab``, positions below
``n_ctx_train``, the draft blobs against ``--draft-model``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from slotfile.format.reader import open_slot_file
from slotfile.format.records import ModelExpect, SlotFile
from slotfile.problems import CheckLevel, ProblemCode
from slotfile.text import count
from slotfile.verify.records import Level, VerifyError

if TYPE_CHECKING:
    from slotfile.model.bridge import ModelInfo

# The model bridge (the GGUF reader) and the model check are imported where a model is given:
# a structure-only run reads files through read() and level_model()'s skip alone.


@dataclass
class ModelSide:
    """A model of the run (``--model`` or ``--draft-model``): its metadata, read once, and the
    state layout it implies."""

    info: ModelInfo
    expect: ModelExpect | None = None  # None when the expectation code cannot read this model
    note: str = ""


def model_side(path: str | None) -> ModelSide | None:
    """The model at ``path`` (None: not given).  Raises VerifyError when it cannot be read."""
    if path is None:
        return None
    from slotfile.model.bridge import ModelError, load_model_info
    from slotfile.model.expect import expect_from_model

    try:
        info = load_model_info(path)
    except ModelError as e:
        raise VerifyError(str(e)) from e
    side = ModelSide(info)
    try:
        side.expect = expect_from_model(info)
    except Exception as e:
        side.note = f"no expected layout for this model ({type(e).__name__}: {e}); not checked against it"
    return side


def read(path: Path, side: ModelSide | None, dside: ModelSide | None) -> SlotFile:
    """Open ``path`` the way ``inspect --model`` and ``dump --model`` read it: in the model's
    layout when there is one (:func:`slotfile.format.reader.open_slot_file`)."""
    return open_slot_file(
        path, expect=side.expect if side is not None else None, draft_expect=dside.expect if dside is not None else None
    )


def level_model(sf: SlotFile, side: ModelSide | None, dside: ModelSide | None) -> Level:
    """The model check (slotfile.model.check, the same problems ``inspect --model`` lists), and
    what this run could not check: a model without an expectation, draft blobs without
    ``--draft-model``."""
    lv = Level(CheckLevel.MODEL)
    if side is None:
        return lv.skip("no --model")
    info, exp = side.info, side.expect
    dexp = dside.expect if dside is not None else None
    for s in (side, dside):
        if s is not None and s.note:
            lv.warn(ProblemCode.NOT_MODELLED, "body", sf.body.offset if sf.body else None, s.note)
    from slotfile.model.check import check_against_model

    for p in check_against_model(sf, exp, dexp):
        lv.problems.append(p)  # raised at the model level (slotfile.model.check)
    if exp is not None and sf.body is not None and sf.body.layout is None:
        lv.warn(
            ProblemCode.NOT_CHECKED,
            "body",
            sf.body.offset,
            "the body does not parse (see the structure level), so its layout is not compared with the model",
        )
    dft_blobs = []
    if sf.draft is not None and sf.draft.dft is not None and sf.draft.dft.length:
        dft_blobs.append((sf.draft.dft, "sdft.data_dft"))
    dft_blobs += [(ck.dft, f"sckp.checkpoint[{ck.index}].data_dft") for ck in sf.checkpoints if ck.dft.length]
    if dft_blobs and dside is None:
        lv.warn(
            ProblemCode.DRAFT_NOT_CHECKED,
            dft_blobs[0][1],
            dft_blobs[0][0].offset,
            f"{count(len(dft_blobs), 'draft blob')} not checked (no --draft-model)",
        )
    n_vocab = (exp.n_vocab if exp is not None else 0) or info.n_vocab
    n_ctx_train = (exp.n_ctx_train if exp is not None else 0) or int(info.get("context_length", 0) or 0)
    lv.details = {
        "arch": info.arch,
        "n_vocab": n_vocab,
        "n_ctx_train": n_ctx_train,
        "memory_class": exp.memory_class if exp is not None else None,
    }
    return lv.finish()
