"""What a failed check means and what to do next: the cause of a file's failure and the repair
command that fits, shared by ``verify`` (table, JSON, JUnit), ``inspect`` and ``dump``.

Every problem falls in one class, decided by its code, never by its message: the registry
(:mod:`slotfile.problems`, :func:`slotfile.problems.cause_of`) holds each code's class and says
what the classes mean.

A failing file's cause (:func:`file_cause`) is the first that applies of: not a slot file,
damaged structure, unsupported structure, a model mismatch, damage found by the loader or the
recompute (a test-load that fails after a model mismatch is the mismatch's consequence).

The next step (:func:`next_step`) follows from where the damage is: the header or the tokens
(nothing can be saved), the body (``truncate-recover --model``: rebuilt from the tokens), the
checkpoint appendix or trailing bytes (``truncate-recover``: kept whole, the rest dropped), only
the draft state as judged by the loader (``strip-draft``), checkpoints whose V layout is not the
body's (``re-save --flash-attn``), values that differ from a recompute (nothing repairs them).
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from slotfile.format.records import FileFormat, MemoryKind, SlotFile
from slotfile.problems import CheckLevel, Problem, ProblemClass, ProblemCode, Severity

__all__ = [
    "Cause",
    "Facts",
    "NextStep",
    "facts_of",
    "file_cause",
    "next_step",
]


# A failing file's cause is the class of the problem that decides it (see file_cause).
Cause = ProblemClass

# the words a person reads for each cause (inspect's verdict line, verify's table)
CAUSE_WORDS = {
    Cause.DAMAGED: "damaged",
    Cause.MISMATCH: "does not match this model",
    Cause.NOT_SLOT_FILE: "not a slot file",
    Cause.UNSUPPORTED: "not readable by this slotfile",
}
CAUSE_SHORT = {
    Cause.DAMAGED: "damaged",
    Cause.MISMATCH: "wrong model",
    Cause.NOT_SLOT_FILE: "not a slot file",
    Cause.UNSUPPORTED: "unsupported",
}

# the loader's refusals that concern only the draft state (strip-draft removes it)
DRAFT_LOAD_CODES = frozenset({ProblemCode.DRAFT_REJECTED, ProblemCode.CHECKPOINT_DRAFT_REJECTED})


def file_cause(problems: Iterable[Problem]) -> Cause | None:
    """Why the file fails, None when it has no error (see the module doc for the order)."""
    errors = [p for p in problems if p.severity == Severity.ERROR]
    if not errors:
        return None
    classes = {(p.level.reported_in == CheckLevel.STRUCTURE, p.cls) for p in errors}
    if any(c == Cause.NOT_SLOT_FILE for _, c in classes):
        return Cause.NOT_SLOT_FILE
    if (True, Cause.DAMAGED) in classes:
        return Cause.DAMAGED
    if (True, Cause.UNSUPPORTED) in classes:
        return Cause.UNSUPPORTED
    if any(c == Cause.MISMATCH for _, c in classes):
        return Cause.MISMATCH
    return Cause.DAMAGED


# ---------------------------------------------------------------------------------------
# the next step
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Facts:
    """What the next step depends on besides the problems."""

    path: str
    format: str | None = None  # GGSQ | GGSN | unknown
    model: str | None = None  # the --model of this run
    media: bool = False  # the tokens include media chunks (a rebuild cannot prefill them)
    body_v_trans: int | None = None  # v_trans of the body's first KV stream
    v_trans_differs: bool = False  # a checkpoint or draft blob has another v_trans than the body


@dataclass(frozen=True, slots=True)
class NextStep:
    text: str  # one sentence for a person
    command: str | None = None  # the command line to run, when a repair fits


def facts_of(sf: SlotFile, model: str | None = None) -> Facts:
    body_vt = _v_trans(sf.body)
    others = [_v_trans(b.body) for ck in sf.checkpoints for b in (ck.tgt,)]
    others = [v for v in others if v is not None]
    media = bool(sf.tokens is not None and sf.tokens.media)
    return Facts(
        sf.path, str(sf.format), model, media, body_vt, body_vt is not None and any(v != body_vt for v in others)
    )


def _v_trans(body: object) -> int | None:
    blocks = getattr(body, "blocks", None) or []
    for blk in blocks:
        if blk.kind == MemoryKind.KV and blk.has_v:
            for st in blk.active_streams():
                if st.v_trans is not None:
                    return int(st.v_trans)
    return None


def _q(s: str) -> str:
    return shlex.quote(s)


def _out_name(path: str) -> str:
    p = Path(path)
    return str(p.with_name(f"{p.stem}.fixed{p.suffix or '.slot'}"))


def _area(section: str) -> str:
    """header | tokens | body | sckp | draft | trailing | other, from a problem's section."""
    head = section.split(".", 1)[0].split("[", 1)[0]
    if head == "sdft" or ".data_dft" in section or ".data_spec" in section:
        return "draft"
    if head in ("header", "tokens", "arch", "file"):
        return "header"
    return head if head in ("body", "sckp", "trailing") else "other"


def next_step(cause: Cause | None, problems: Iterable[Problem], facts: Facts) -> NextStep | None:
    """The next step for a file that failed with ``cause`` (None: it passed, nothing to do)."""
    if cause is None:
        return None
    errors = [p for p in problems if p.severity == Severity.ERROR]
    if cause == Cause.NOT_SLOT_FILE:
        said = next((p.message for p in errors if p.cls == Cause.NOT_SLOT_FILE), "")
        todo = said.split("not a slot file: ", 1)[1] if "not a slot file: " in said else ""
        return NextStep(todo or "pass the slot file llama-server wrote (under --slot-save-path)")
    if cause == Cause.UNSUPPORTED:
        return NextStep("nothing to repair: this slotfile cannot read the layout (the bytes may be fine)")
    if cause == Cause.MISMATCH:
        return NextStep(
            "nothing to repair: the file reads cleanly but was saved with another model; "
            "verify it with the GGUF that saved it (--model), or discard it"
        )
    return _repair_for(errors, facts)


def _repair_for(errors: list[Problem], facts: Facts) -> NextStep:
    path, out = _q(facts.path), _q(_out_name(facts.path))
    model = _q(facts.model) if facts.model else "MODEL.gguf"
    damaged = [p for p in errors if p.cls == Cause.DAMAGED]
    if damaged and all(p.level == CheckLevel.DEEP for p in damaged):
        return NextStep(
            "nothing can be repaired: the stored values differ from a recompute of the tokens "
            "(damaged values, or saved by another model of this shape); discard the file and let "
            "the server recompute the prompt"
        )
    areas = {_area(p.section) for p in damaged if p.level != CheckLevel.DEEP}
    if facts.format == FileFormat.GGSN:
        return NextStep(
            "nothing can be repaired: the repair commands handle slot files (GGSQ), not whole-context session files"
        )
    if "header" in areas or ("other" in areas and not ({"body", "sckp", "draft", "trailing"} & areas)):
        return NextStep(
            "nothing can be repaired: the header or the token payload is damaged, and without "
            "the tokens nothing that would load can be saved"
        )
    if "body" in areas:
        if facts.media:
            return NextStep(
                "nothing can be repaired: the body is damaged and the tokens include media chunks, "
                "which cannot be prefilled again"
            )
        return NextStep(
            "rebuild the body from the stored tokens (keeps every intact checkpoint and draft state)",
            f"slotfile truncate-recover {path} -o {out} --model {model}",
        )
    structural = {_area(p.section) for p in damaged if p.level.reported_in == CheckLevel.STRUCTURE}
    if structural:  # the body is intact: keep it, drop the damaged appendix parts and trailing bytes
        cmd = f"slotfile truncate-recover {path} -o {out}" + (f" --model {model}" if facts.model else "")
        return NextStep("keep the intact body and every whole checkpoint; drop the damaged rest", cmd)
    loader = [p for p in damaged if p.level == CheckLevel.LOAD]
    if loader and all(p.code in DRAFT_LOAD_CODES for p in loader):
        return NextStep(
            "only the draft state is refused: remove it (the target state stays byte-identical)",
            f"slotfile strip-draft {path} -o {out}",
        )
    if any(p.code == ProblemCode.CHECKPOINT_REJECTED for p in loader) and facts.v_trans_differs:
        fa = "on" if facts.body_v_trans == 0 else "off"
        return NextStep(
            "the checkpoints' V layout is not the body's: write every part with one flash-attention setting",
            f"slotfile re-save {path} -o {out} --model {model} --flash-attn {fa}",
        )
    if loader:
        return NextStep(
            "llama.cpp refuses part of the state: rebuild what it refuses (checkpoints that fail "
            "their test-load are dropped, a refused body is prefilled again from the tokens)",
            f"slotfile truncate-recover {path} -o {out} --model {model}",
        )
    return NextStep("nothing can be repaired automatically")
