"""The model problems of a parsed file: the one place that decides them.

:func:`check_against_model` is what ``inspect --model``, ``dump --model`` (through the reader,
:func:`slotfile.format.reader.parse_buffer`) and ``verify --model`` (its model level) all report:

* the GGSN session's arch name against the model's;
* the body, every checkpoint's ``data_tgt`` and the draft blobs against the layout the GGUF
  implies (:func:`slotfile.model.compare.compare`); an arch whose layout is not modelled gives one
  ``not-modelled`` warning per body instead;
* token ids against the vocabulary;
* cell positions against the training context.

Token ids (``server_tokens::validate``, tools/server/server-common.cpp, what the server runs on
every restored slot): an id must be in ``[0, n_vocab)``, except ``LLAMA_TOKEN_NULL`` (-1), which
is accepted only where ``find_chunk(i)`` finds a media chunk (not of type TEXT) at the start of
the run of -1 it stands in: the media positions of the packed form.  A plain token list has no
media map, so -1 there is refused like any other id outside the vocabulary.  What is not checked
here: that each run of -1 is exactly as long as its chunk's ``mtmd_input_chunk_get_n_tokens``
(that needs the image/audio encoder's token count, which the stored chunk does not carry).

Positions (``llama_context::llama_context``, src/llama-context.cpp): llama.cpp only warns when
the context is larger than the training context (``n_ctx_seq > n_ctx_train -- possible training
context overflow``) and nothing in a state load compares positions with ``n_ctx_train``, which
YaRN scaling may even re-adjust at run time; so a position at or past ``n_ctx_train`` is a
warning, never an error.
"""

from __future__ import annotations

import numpy as np

from slotfile.format.records import Body, FileFormat, ModelExpect, Problem, Severity, SlotFile, TokenForm, TokenPayload
from slotfile.model.compare import compare, not_modelled_message
from slotfile.problems import CheckLevel, ProblemCode

__all__ = ["check_against_model", "null_token_allowed"]

# This module's problem codes and their classes are in slotfile.problems (level "model"):
# callers that must tell a healthy file checked against another model (class "mismatch":
# another arch, layout, vocabulary or context) from damaged bytes go by those, never by messages.
LLAMA_TOKEN_NULL = -1
MTMD_INPUT_CHUNK_TYPE_TEXT = 0


def check_against_model(sf: SlotFile, exp: ModelExpect | None, draft_exp: ModelExpect | None) -> list[Problem]:
    """Every model problem of ``sf`` (at level ``model``: ``from_model``), in file order within each kind:
    arch, layouts (body, checkpoints, draft), tokens, positions.  ``exp``/``draft_exp``: the
    target and draft model's expectation; a missing one skips what it would check."""
    out: list[Problem] = []
    if exp is not None:
        out += _arch_problems(sf, exp)
        body = sf.body
        # a body read in the layout of llama.cpp before mid-2025 is not compared: the model
        # comparison covers current layouts (the reader says so in its legacy-layout warning)
        if body is not None and body.layout is not None and not body.layout.legacy:
            out += _layout_problems(exp, body, False, "body")
    for ck in sf.checkpoints:
        sec = f"sckp.checkpoint[{ck.index}]"
        for blob, e in ((ck.tgt, exp), (ck.dft, draft_exp)):
            if e is not None and blob.body is not None and blob.body.layout is not None:
                out += _layout_problems(e, blob.body, True, f"{sec}.{blob.name}")
    dft = sf.draft.dft if sf.draft is not None else None
    if draft_exp is not None and dft is not None and dft.body is not None and dft.body.layout is not None:
        out += _layout_problems(draft_exp, dft.body, False, "sdft.data_dft")  # SDFT holds a full (flags 0) save
    if exp is not None:
        if sf.tokens is not None and exp.n_vocab:
            out += _token_problems(sf.tokens, exp.n_vocab)
        if sf.body is not None and exp.n_ctx_train:
            out += _position_problems(sf.body, exp.n_ctx_train)
    for p in out:
        p.level = CheckLevel.MODEL
    return out


def _arch_problems(sf: SlotFile, exp: ModelExpect) -> list[Problem]:
    """A session file names the arch that wrote it (slot files do not)."""
    if sf.format != FileFormat.GGSN or sf.arch is None or not exp.arch or sf.arch == exp.arch:
        return []
    return [
        Problem(
            Severity.ERROR,
            ProblemCode.WRONG_ARCH,
            "arch",
            12 + 4 * (sf.n_token_count or 0),
            f"the session was written by a {sf.arch!r} model; --model is {exp.arch!r}",
        )
    ]


def _layout_problems(exp: ModelExpect, body: Body, partial: bool, section: str) -> list[Problem]:
    if not exp.modelled:
        return [Problem(Severity.WARNING, ProblemCode.NOT_MODELLED, section, body.offset, not_modelled_message(exp))]
    return [
        Problem(Severity.ERROR, ProblemCode.MODEL_MISMATCH, m.section, m.offset, m.message)
        for m in compare(exp, body, partial=partial, prefix=section)
    ]


def null_token_allowed(tp: TokenPayload) -> np.ndarray:
    """Per token: may it be -1?  True from a media key whose chunk is not TEXT to the end of
    the run of -1 that starts there (``server_tokens::validate``'s ``find_chunk``)."""
    ids = np.asarray(tp.tokens)
    ok = np.zeros(ids.size, dtype=bool)
    if tp.form != TokenForm.PACKED:
        return ok
    for m in tp.media:
        i = int(m["key"])
        if m["type"] == MTMD_INPUT_CHUNK_TYPE_TEXT or not 0 <= i < ids.size or ok[i]:
            continue
        while i < ids.size and ids[i] == LLAMA_TOKEN_NULL:
            ok[i] = True
            i += 1
    return ok


def _token_problems(tp: TokenPayload, n_vocab: int) -> list[Problem]:
    ids = np.asarray(tp.tokens)
    if not ids.size:
        return []
    bad = (ids < 0) | (ids >= n_vocab)
    if tp.media and bool((ids == LLAMA_TOKEN_NULL).any()):
        bad &= ~((ids == LLAMA_TOKEN_NULL) & null_token_allowed(tp))
    where = np.flatnonzero(bad)
    if not where.size:
        return []
    i = int(where[0])
    t = int(ids[i])
    what = (
        "-1 (LLAMA_TOKEN_NULL) where no media chunk starts a run of -1"
        if t == LLAMA_TOKEN_NULL
        else f"id {t}, outside the model's vocabulary [0, {n_vocab})"
    )
    more = f" ({where.size} such tokens)" if where.size > 1 else ""
    msg = f"token {i} is {what}{more}"
    return [Problem(Severity.ERROR, ProblemCode.TOKEN_OUT_OF_VOCAB, "tokens", tp.ids_offset + 4 * i, msg)]


def _position_problems(body: Body, n_ctx_train: int) -> list[Problem]:
    out: list[Problem] = []
    for blk in body.blocks:
        pos = blk.positions()
        if pos.size and int(pos.max()) >= n_ctx_train:
            out.append(
                Problem(
                    Severity.WARNING,
                    ProblemCode.POSITION_BEYOND_CONTEXT,
                    f"body.{blk.role}",
                    blk.offset,
                    f"highest position {int(pos.max())} is beyond the model's training context "
                    f"{n_ctx_train} (llama.cpp only warns about a context this long; without rope "
                    "scaling the output may degrade)",
                )
            )
    return out
