"""Every problem code slotfile reports, defined once, and the one :class:`Problem` type.

A problem's code says what was found; :data:`REGISTRY` says, for each code, the severity it is
raised with, the level that raises it, its class and a one-line meaning.  The class is what
:mod:`slotfile.diagnosis` decides a file's cause from, so it goes by code, never by message:

* ``damaged``: the bytes are wrong (cut, overwritten, lengths that do not add up, a state that
  llama.cpp refuses or that differs from a recompute);
* ``mismatch``: a file that reads cleanly but was checked against another model (arch, layout,
  vocabulary, context), or a library named with ``--llama-lib`` that does not load its version;
* ``not-a-slot-file``: a recognised wrong input (a GGUF model, an empty, compressed or text file);
* ``unsupported``: a layout slotfile cannot read yet (the bytes may be fine);
* ``cannot-check``: something this run could not check: never a failure;
* ``notice``: any other warning.

A code of class ``damaged`` raised as a warning is a ``notice`` (``invalid`` is both: an error
for a value llama.cpp refuses, a warning for cells of several seq ids in a single-sequence save).

The codes are a :class:`~enum.StrEnum` whose values are the strings of the JSON reports, so the
reports read the same.  ``ProblemCode("no-such-code")`` raises ``ValueError``: a misspelt or new
code that is not registered here fails where it is raised, never passes as "damaged".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Any

__all__ = [
    "REGISTRY",
    "CheckLevel",
    "CodeInfo",
    "Problem",
    "ProblemClass",
    "ProblemCode",
    "Severity",
    "cause_of",
    "codes",
    "info",
]


class Severity(StrEnum):
    ERROR = "error"
    WARNING = "warning"


class ProblemClass(StrEnum):
    """What a problem says about the file (see the module doc); also a failing file's cause."""

    DAMAGED = "damaged"
    MISMATCH = "mismatch"
    NOT_SLOT_FILE = "not-a-slot-file"
    UNSUPPORTED = "unsupported"
    CANNOT_CHECK = "cannot-check"
    NOTICE = "notice"


class CheckLevel(StrEnum):
    """Where a problem is found.  ``scan`` is ``verify --scan`` (reported in the structure level);
    the other four are verify's levels, and ``inspect``/``dump`` report the first two."""

    STRUCTURE = "structure"
    SCAN = "scan"
    MODEL = "model"
    LOAD = "load"
    DEEP = "deep"

    @property
    def reported_in(self) -> CheckLevel:
        """The verify level whose problems list holds this level's problems."""
        return CheckLevel.STRUCTURE if self == CheckLevel.SCAN else self


class ProblemCode(StrEnum):
    # the reader (structure): errors
    NOT_SLOT_FILE = "not-slot-file"
    TRUNCATED = "truncated"
    TRAILING_BYTES = "trailing-bytes"
    BAD_MAGIC = "bad-magic"
    BAD_VERSION = "bad-version"
    UNSUPPORTED_VERSION = "unsupported-version"
    VERSION_LAYOUT = "version-layout"
    BAD_TYPE = "bad-type"
    BAD_ROW_SIZE = "bad-row-size"
    BAD_ROTATION = "bad-rotation"
    OVER_CAP = "over-cap"
    INVALID = "invalid"
    BAD_POSITION = "bad-position"
    EMPTY_BLOB = "empty-blob"
    UNKNOWN_LAYOUT = "unknown-layout"
    UNSUPPORTED_LAYOUT = "unsupported-layout"
    INTERNAL = "internal"
    # the reader (structure): warnings
    AMBIGUOUS_LAYOUT = "ambiguous-layout"
    K_ONLY = "k-only"
    UNKNOWN_TYPE = "unknown-type"
    UNEXPECTED_LAYOUT = "unexpected-layout"
    TOKEN_MISMATCH = "token-mismatch"
    CHECKPOINT_ORDER = "checkpoint-order"
    EMPTY_BODY = "empty-body"
    EMPTY_SLOT = "empty-slot"
    LEGACY_LAYOUT = "legacy-layout"
    TRIAL_VERSION = "trial-version"
    # the model check (slotfile.model.check) and verify's model level
    WRONG_ARCH = "wrong-arch"
    MODEL_MISMATCH = "model-mismatch"
    TOKEN_OUT_OF_VOCAB = "token-out-of-vocab"
    POSITION_BEYOND_CONTEXT = "position-beyond-context"
    NOT_MODELLED = "not-modelled"
    NOT_CHECKED = "not-checked"
    DRAFT_NOT_CHECKED = "draft-not-checked"
    # verify --scan
    NON_FINITE = "non-finite"
    UNSCANNED_TYPE = "unscanned-type"
    # verify's load level
    LOAD_FAILED = "load-failed"
    CRASHED = "crashed"
    VERSION_MISMATCH = "version-mismatch"
    LOADER_DISAGREES = "loader-disagrees"
    CHECKPOINT_REJECTED = "checkpoint-rejected"
    CHECKPOINT_DRAFT_REJECTED = "checkpoint-draft-rejected"
    DRAFT_REJECTED = "draft-rejected"
    APPENDIX_IGNORED = "appendix-ignored"
    DRAFT_NOT_LOADED = "draft-not-loaded"
    # verify's deep level
    DEEP_FAILED = "deep-failed"
    DEEP_INTERNAL = "deep-internal"
    DEEP_ROTATION = "deep-rotation"
    DEEP_MISMATCH = "deep-mismatch"
    DEEP_LOGITS = "deep-logits"
    DEEP_LAYOUT = "deep-layout"
    DEEP_CELLS = "deep-cells"
    DEEP_POSITIONS = "deep-positions"
    DEEP_NONFINITE = "deep-nonfinite"
    DEEP_DRIFT = "deep-drift"
    DEEP_SHIFTED = "deep-shifted"
    DEEP_UNREPLAYED = "deep-unreplayed"
    RECOMPUTE_CRASHED = "recompute-crashed"


@dataclass(frozen=True, slots=True)
class CodeInfo:
    """What a code means.  ``severity``: the severity it is raised with (``invalid`` is also
    raised as a warning, see the module doc); ``levels``: the levels that raise it, first the
    main one."""

    code: ProblemCode
    severity: Severity
    levels: tuple[CheckLevel, ...]
    cls: ProblemClass
    meaning: str

    @property
    def level(self) -> CheckLevel:
        return self.levels[0]


_E, _W = Severity.ERROR, Severity.WARNING
_S, _SC, _M, _L, _D = CheckLevel.STRUCTURE, CheckLevel.SCAN, CheckLevel.MODEL, CheckLevel.LOAD, CheckLevel.DEEP
_DMG, _MIS, _NSF = ProblemClass.DAMAGED, ProblemClass.MISMATCH, ProblemClass.NOT_SLOT_FILE
_UNS, _CC, _NOT = ProblemClass.UNSUPPORTED, ProblemClass.CANNOT_CHECK, ProblemClass.NOTICE
_C = ProblemCode

_TABLE: tuple[tuple[ProblemCode, Severity, tuple[CheckLevel, ...], ProblemClass, str], ...] = (
    (_C.NOT_SLOT_FILE, _E, (_S,), _NSF, "a recognised wrong input (a GGUF model, an empty, compressed or text file)"),
    (_C.TRUNCATED, _E, (_S,), _DMG, "the file ends inside a section or field it announces"),
    (_C.TRAILING_BYTES, _E, (_S,), _DMG, "bytes after the last section the loader reads"),
    (_C.BAD_MAGIC, _E, (_S,), _DMG, "a header or appendix magic is not the expected one"),
    (_C.BAD_VERSION, _E, (_S,), _DMG, "a header, appendix or token-payload version slotfile does not know"),
    (_C.UNSUPPORTED_VERSION, _E, (_S,), _DMG, "a version newer than slotfile knows whose body no trial layout fits"),
    (_C.VERSION_LAYOUT, _E, (_S,), _DMG, "the header's version disagrees with the body's rotation words"),
    (_C.BAD_TYPE, _E, (_S,), _DMG, "a ggml type id no build has"),
    (_C.BAD_ROW_SIZE, _E, (_S,), _DMG, "a row size that is not a whole number of the type's blocks"),
    (_C.BAD_ROTATION, _E, (_S,), _DMG, "n_rot_k or n_rot_v is not a rotation width (0, or a power of two from 64)"),
    (_C.OVER_CAP, _E, (_S,), _DMG, "a count or length over its cap (streams, layers, checkpoints, arch name)"),
    (_C.INVALID, _E, (_S,), _DMG, "a field value llama.cpp refuses (as a warning: cells of several seq ids)"),
    (_C.BAD_POSITION, _E, (_S,), _DMG, "a negative cell position or an impossible checkpoint position range"),
    (_C.EMPTY_BLOB, _E, (_S,), _DMG, "an empty checkpoint data_tgt blob (the server drops the whole appendix)"),
    (_C.UNKNOWN_LAYOUT, _E, (_S,), _DMG, "no known block layout parses the body"),
    (_C.UNSUPPORTED_LAYOUT, _E, (_S,), _UNS, "a layout slotfile cannot read yet (a DeepSeek-V4 frame)"),
    (_C.INTERNAL, _E, (_S,), _DMG, "the reader failed on these bytes (a slotfile bug the bytes trigger)"),
    (_C.AMBIGUOUS_LAYOUT, _W, (_S,), _NOT, "the body parses in more than one layout (give --model to decide)"),
    (_C.K_ONLY, _W, (_S,), _NOT, "a KV block without V: an MLA or indexer cache, or a file cut where V starts"),
    (_C.UNKNOWN_TYPE, _W, (_S,), _NOT, "a ggml type id this build does not know (newer llama.cpp or a fork)"),
    (_C.UNEXPECTED_LAYOUT, _W, (_S,), _NOT, "a checkpoint or draft blob holds other blocks than a PARTIAL_ONLY save"),
    (_C.TOKEN_MISMATCH, _W, (_S,), _NOT, "the token count and the cell count or checkpoint range disagree"),
    (_C.CHECKPOINT_ORDER, _W, (_S,), _NOT, "checkpoints not written oldest first"),
    (_C.EMPTY_BODY, _W, (_S,), _NOT, "no memory state: a model without memory, or a file cut after the tokens"),
    (_C.EMPTY_SLOT, _W, (_S,), _NOT, "no tokens and no cells: the save of an empty (or cleared idle) slot"),
    (_C.LEGACY_LAYOUT, _W, (_S,), _NOT, "a body in the layout of llama.cpp before mid-2025 (current builds refuse it)"),
    (_C.TRIAL_VERSION, _W, (_S,), _NOT, "a version a little newer than slotfile knows, read by trial"),
    (_C.WRONG_ARCH, _E, (_M,), _MIS, "the GGSN session's architecture is not the model's"),
    (_C.MODEL_MISMATCH, _E, (_M,), _MIS, "the body, a checkpoint or the draft state is not the layout the model gives"),
    (_C.TOKEN_OUT_OF_VOCAB, _E, (_M,), _MIS, "a token id outside the model's vocabulary"),
    (_C.POSITION_BEYOND_CONTEXT, _W, (_M,), _MIS, "a cell position at or past the model's training context"),
    (_C.NOT_MODELLED, _W, (_M,), _CC, "the model's memory layout is not modelled: the body is not compared"),
    (_C.NOT_CHECKED, _W, (_M,), _CC, "the body does not parse, so its layout is not compared with the model"),
    (_C.DRAFT_NOT_CHECKED, _W, (_M,), _CC, "draft blobs not compared (no --draft-model)"),
    (_C.NON_FINITE, _E, (_SC,), _DMG, "a K/V/R/S value that is NaN or infinite"),
    (_C.UNSCANNED_TYPE, _W, (_SC,), _CC, "values of a type the scan cannot check"),
    (_C.LOAD_FAILED, _E, (_L,), _DMG, "llama.cpp refuses the file"),
    (_C.CRASHED, _E, (_L,), _DMG, "the llama.cpp worker crashed or timed out restoring the file"),
    (_C.VERSION_MISMATCH, _E, (_L,), _MIS, "the library named with --llama-lib does not load the file's state version"),
    (_C.LOADER_DISAGREES, _E, (_L,), _DMG, "llama.cpp's loader stops at another offset than the reader's body end"),
    (_C.CHECKPOINT_REJECTED, _E, (_L,), _DMG, "llama.cpp refuses a checkpoint's data_tgt blob"),
    (_C.CHECKPOINT_DRAFT_REJECTED, _E, (_L,), _DMG, "llama.cpp refuses a checkpoint's data_dft blob"),
    (_C.DRAFT_REJECTED, _E, (_L,), _DMG, "llama.cpp refuses the SDFT draft state"),
    (_C.APPENDIX_IGNORED, _W, (_L,), _NOT, "the server would drop an appendix (the restore itself succeeds)"),
    (_C.DRAFT_NOT_LOADED, _W, (_L,), _CC, "the file holds draft state and no --draft-model was given"),
    (_C.DEEP_FAILED, _E, (_D,), _DMG, "prefilling the stored tokens failed"),
    (_C.DEEP_INTERNAL, _E, (_D,), _DMG, "the recomputed state does not parse"),
    (_C.DEEP_ROTATION, _E, (_D,), _DMG, "the stored rotation widths are not those of the recompute"),
    (_C.DEEP_MISMATCH, _E, (_D,), _DMG, "stored K/V values differ from a recompute of the tokens"),
    (_C.DEEP_LOGITS, _E, (_D,), _DMG, "next-token logits after restoring differ from those after recomputing"),
    (_C.DEEP_LAYOUT, _E, (_D,), _DMG, "the file holds other blocks or layers than the recompute"),
    (_C.DEEP_CELLS, _E, (_D,), _DMG, "another cell count than the recompute"),
    (_C.DEEP_POSITIONS, _E, (_D,), _DMG, "other cell positions than the recompute"),
    (_C.DEEP_NONFINITE, _E, (_D,), _DMG, "non-finite stored values where the recompute has finite ones"),
    (_C.DEEP_DRIFT, _W, (_D,), _NOT, "stored K/V differ from every recompute tried as another split or build makes"),
    (_C.DEEP_SHIFTED, _W, (_D,), _CC, "cells the server shifted (context shift, reused chunk): not compared by value"),
    (
        _C.DEEP_UNREPLAYED,
        _W,
        (_D,),
        _CC,
        "a slot's share of batches with other slots: drift no split replays, not verified",
    ),
    (_C.RECOMPUTE_CRASHED, _W, (_D,), _CC, "llama.cpp crashed or timed out recomputing tokens of a file that restored"),
)

REGISTRY: Mapping[ProblemCode, CodeInfo] = MappingProxyType({c: CodeInfo(c, s, lv, k, m) for c, s, lv, k, m in _TABLE})
if set(REGISTRY) != set(ProblemCode) or len(_TABLE) != len(ProblemCode):  # pragma: no cover - import-time guard
    raise RuntimeError("slotfile.problems: every ProblemCode needs exactly one REGISTRY entry")


def info(code: ProblemCode | str) -> CodeInfo:
    """The registry entry of ``code``; ValueError for a string that is not a registered code."""
    return REGISTRY[ProblemCode(code)]


def codes(*, level: CheckLevel | None = None, cls: ProblemClass | None = None) -> tuple[ProblemCode, ...]:
    """The registered codes (in registry order), optionally those raised at ``level`` or of class ``cls``."""
    return tuple(
        c for c, i in REGISTRY.items() if (level is None or level in i.levels) and (cls is None or i.cls == cls)
    )


def cause_of(code: ProblemCode | str, severity: Severity | str) -> ProblemClass:
    """The class of a problem: the code's, except that a ``damaged`` code raised as a warning is
    a ``notice`` and a ``notice`` code raised as an error is ``damaged``."""
    cls = info(code).cls
    sev = Severity(severity)
    if cls == ProblemClass.DAMAGED and sev == Severity.WARNING:
        return ProblemClass.NOTICE
    if cls == ProblemClass.NOTICE and sev == Severity.ERROR:
        return ProblemClass.DAMAGED
    return cls


@dataclass(slots=True)
class Problem:
    """One problem: what was found (``code``), where (``section``, ``offset``: None where a
    level has no byte to point at) and a sentence for a person.  ``level``: where it was found
    (not in :meth:`to_dict`).  A plain string passed as ``code`` or ``severity`` is converted,
    and raises ``ValueError`` when it is not registered."""

    severity: Severity
    code: ProblemCode
    section: str
    offset: int | None
    message: str
    level: CheckLevel = CheckLevel.STRUCTURE

    def __post_init__(self) -> None:
        self.severity = Severity(self.severity)
        self.code = ProblemCode(self.code)
        self.level = CheckLevel(self.level)

    @property
    def from_model(self) -> bool:
        """Produced by the model check (slotfile.model.check), not by the bytes alone."""
        return self.level == CheckLevel.MODEL

    @property
    def cls(self) -> ProblemClass:
        return cause_of(self.code, self.severity)

    def line(self) -> str:
        return f"{self.section} at offset {self.offset}: {self.message}"

    def where(self) -> str:
        """'<section> at offset <o>: ', '<section>: ' without an offset, '' without a section."""
        if self.section and self.offset is not None:
            return f"{self.section} at offset {self.offset}: "
        return f"{self.section}: " if self.section else ""

    def to_dict(self, *, with_class: bool = False) -> dict[str, Any]:
        """The JSON form; ``with_class``: with the ``class`` key the reports carry (verify, inspect)."""
        d: dict[str, Any] = {
            "severity": self.severity,
            "code": self.code,
            "section": self.section,
            "offset": self.offset,
            "message": self.message,
        }
        if with_class:
            d["class"] = self.cls
        return d
