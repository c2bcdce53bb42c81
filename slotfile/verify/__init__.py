"""``slotfile verify``: four levels of evidence that a slot file is what it claims to be.

Each level is reported on its own, per file (status ``pass``, ``fail`` or ``skipped``):

1. **structure**: the reader's problems (no model needed);
2. **model** (``--model``): the body and every checkpoint blob against the layout the GGUF
   implies (:mod:`slotfile.model.expect`), token ids below ``n_vocab``, positions below
   ``n_ctx_train``, the draft blobs against ``--draft-model``;
3. **load** (``--model``): the real llama.cpp loader in a worker process
   (:class:`slotfile.llama.loader.LoaderPool`), every checkpoint's ``data_tgt`` and the draft state;
4. **deep** (``--deep``): the stored tokens prefilled again in a fresh context with the same
   settings; the recomputed K/V (R/S) compared with the file's, layer by layer, and the
   next-token logits after restoring the file compared with those after the recompute.

The deep check judges every layer against the recompute's own noise (:func:`judge_run`):
the stored tokens are prefilled with the server's batch sizes (state A), then the last
:data:`TAIL` of them are decoded again one per call, as the server decodes generated tokens
(state B).  Per layer, A against B over those cells is the noise floor; the stored rows
against A give the worst head angle, the worst head norm ratio and the median head angle,
each divided by its floor (raised to :data:`MIN_FLOOR` for the cache type).  A layer fails
above :data:`MARGIN_LIMIT` floors.  On Gemma 3 270M (bench/deep_noise.py, deep_noise.json)
prefills with n_ubatch 512 or 32, 1 or 2 threads are bit-identical; the stored-vs-recomputed
difference comes from the tokens the server generated one per call and grows with depth.
"""

from __future__ import annotations

import functools
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np

from slotfile.diagnosis import Cause, Facts, NextStep, ProblemRef, facts_of, file_cause, next_step, problem_class
from slotfile.format.reader import GGSN_VERSIONS, GGSQ_VERSIONS, open_slot_file
from slotfile.format.records import Body, LayerRun, MemoryBlock, ModelExpect, Severity, SlotFile
from slotfile.format.types import TypeId
from slotfile.llama.loader import (
    LIB_ENV,
    DeepResult,
    Library,
    LoaderError,
    LoaderPool,
    LoadResult,
    LoadSettings,
    library_label,
    server_library,
    settings_for,
)
from slotfile.model.bridge import ModelError, ModelInfo, load_model_info
from slotfile.model.check import check_against_model
from slotfile.model.expect import expect_from_model

SCHEMA = "slotfile.verify/1"
LEVELS = ("structure", "model", "load", "deep")
SLOT_SUFFIXES = (".slot", ".bin")
MAGICS = (b"qsgg", b"nsgg")

FLOAT_TYPES = (TypeId.F32, TypeId.F16, TypeId.BF16)
EIGHT_BIT = (TypeId.Q8_0, TypeId.Q8_1)
CHUNK_CELLS = 4096  # cells dequantized at a time (bounded memory on big files)

# What llama-cpp-python releases vendor which state version, for the version message.
LOADER_LINES = {
    2: "llama-cpp-python releases of 2025 (before 0.3.36)",
    3: "llama-cpp-python 0.3.36 (vendors llama.cpp of 2026-10-01)",
    4: "llama-cpp-python releases after 0.3.36 that vendor llama.cpp from October 2026 on",
}


def tolerance_class(type_id: int) -> str:
    if type_id in FLOAT_TYPES:
        return "float"
    if type_id in EIGHT_BIT:
        return "8-bit"
    return "low-bit"


# ---------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------


class Status(StrEnum):
    """A level's outcome."""

    PASS = "pass"
    FAIL = "fail"
    SKIPPED = "skipped"


class SkipKind(StrEnum):
    """Why a level was skipped: not asked for (no --model, no --deep), cannot be checked here (a
    state version the installed loader does not load, tokens that cannot be recomputed), or an
    earlier level failed.  None of them is a failure."""

    NOT_REQUESTED = "not-requested"
    CANNOT_CHECK = "cannot-check"
    BLOCKED = "blocked"


class Verdict(StrEnum):
    """A file's outcome: every level that ran passed, one failed, or the file could not be read."""

    PASS = "pass"
    FAIL = "fail"
    ERROR = "error"


@dataclass
class Level:
    status: Status = Status.SKIPPED
    problems: list[dict[str, Any]] = field(default_factory=list)
    reason: str = ""  # why it was skipped
    skip_kind: SkipKind | None = None
    details: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def add(self, severity: Severity, code: str, section: str, offset: int | None, message: str) -> None:
        self.problems.append(
            {
                "severity": severity,
                "code": code,
                "section": section,
                "offset": offset,
                "message": message,
                "class": problem_class(code, severity),
            }
        )

    def error(self, code: str, section: str, offset: int | None, message: str) -> None:
        self.add(Severity.ERROR, code, section, offset, message)

    def warn(self, code: str, section: str, offset: int | None, message: str) -> None:
        self.add(Severity.WARNING, code, section, offset, message)

    def finish(self) -> Level:
        self.status = Status.FAIL if any(p["severity"] == Severity.ERROR for p in self.problems) else Status.PASS
        return self

    def skip(self, reason: str, kind: SkipKind = SkipKind.NOT_REQUESTED) -> Level:
        self.status, self.reason, self.skip_kind = Status.SKIPPED, reason, kind
        return self

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"status": self.status, "problems": self.problems}
        if self.reason:
            d["reason"] = self.reason
        if self.skip_kind is not None:
            d["skip_kind"] = self.skip_kind
        if self.details:
            d["details"] = self.details
        d["seconds"] = round(self.seconds, 4)
        return d


@dataclass
class FileReport:
    path: str
    size: int | None = None
    n_tokens: int | None = None
    format: str | None = None
    version: int | None = None
    levels: dict[str, Level] = field(default_factory=lambda: {k: Level() for k in LEVELS})
    error: str | None = None  # operational: the file could not be read at all
    seconds: float = 0.0
    facts: Facts | None = None  # what the next step depends on (set once the file is read)

    @property
    def verdict(self) -> Verdict:
        if self.error is not None:
            return Verdict.ERROR
        return Verdict.FAIL if any(lv.status == Status.FAIL for lv in self.levels.values()) else Verdict.PASS

    @property
    def level_reached(self) -> int:
        """The highest level n such that levels 1..n all ran and passed (0: structure failed)."""
        n = 0
        for i, name in enumerate(LEVELS, start=1):
            if self.levels[name].status != Status.PASS:
                break
            n = i
        return n

    @property
    def first_problem(self) -> str | None:
        if self.error is not None:
            return self.error
        for name in LEVELS:
            for p in self.levels[name].problems:
                if p["severity"] == Severity.ERROR:
                    return f"{name}: {_where(p)}{p['message']}"
        return None

    def problem_refs(self) -> list[ProblemRef]:
        return [
            ProblemRef(name, p["severity"], p["code"], p["section"] or "", p["message"])
            for name in LEVELS
            for p in self.levels[name].problems
        ]

    @property
    def cause(self) -> Cause | None:
        """Why the file fails (damaged, mismatch, not-a-slot-file, unsupported); None when it
        passes or could not be read."""
        return None if self.error is not None else file_cause(self.problem_refs())

    @property
    def next_step(self) -> NextStep | None:
        if self.error is not None or self.facts is None:
            return None
        return next_step(self.cause, self.problem_refs(), self.facts)

    @property
    def unchecked(self) -> list[str]:
        """Levels that could not be checked here (skipped, not failed), with the reason."""
        return [f"{name}: {lv.reason}" for name, lv in self.levels.items() if lv.skip_kind == SkipKind.CANNOT_CHECK]

    def to_dict(self) -> dict[str, Any]:
        step = self.next_step
        return {
            "path": self.path,
            "size": self.size,
            "n_tokens": self.n_tokens,
            "format": self.format,
            "version": self.version,
            "levels": {k: v.to_dict() for k, v in self.levels.items()},
            "level_reached": self.level_reached,
            "verdict": self.verdict,
            "first_problem": self.first_problem,
            "cause": self.cause,
            "next_step": step.text if step else None,
            "repair_command": step.command if step else None,
            "unchecked": self.unchecked,
            "error": self.error,
            "seconds": round(self.seconds, 4),
        }


def _where(p: dict[str, Any]) -> str:
    sec, off = p.get("section"), p.get("offset")
    if sec and off is not None:
        return f"{sec} at offset {off}: "
    return f"{sec}: " if sec else ""


class VerifyError(Exception):
    """Operational: the model is missing or the loader cannot start."""


@dataclass
class Options:
    model: str | None = None
    draft_model: str | None = None
    deep: bool = False
    n_gpu_layers: int = 0
    jobs: int = 1
    timeout: float = 300.0
    scan: bool = False  # structure level also checks every K/V/R/S value is finite
    llama_lib: str | None = None  # a folder holding libllama.so for the workers (--llama-lib)
    n_batch: int = 0  # the deep recompute's n_batch / n_ubatch (0: llama-server's 2048 / 512)
    n_ubatch: int = 0
    # tests and callers: change the derived load settings (e.g. to mirror a given server)
    settings_hook: Callable[[SlotFile, LoadSettings], LoadSettings] | None = None


# ---------------------------------------------------------------------------------------
# which files
# ---------------------------------------------------------------------------------------


def _has_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) in MAGICS
    except OSError:
        return True  # unreadable: report it rather than hide it


def _what_is_there(d: Path) -> str:
    """For a directory without slot files: a hint when it holds models instead."""
    models = sum(1 for _ in d.rglob("*.gguf"))
    if models:
        return f" (it holds {models} GGUF model(s): give one with --model and the slot files as arguments)"
    return ""


def collect(args: list[Path]) -> tuple[list[Path], list[str]]:
    """Files to verify, and operational errors for paths that do not exist and for directories
    with no slot file under them (a run that checks nothing must not pass).

    A file argument is taken as is.  A directory contributes every regular file under it
    (recursively, sorted, symlinks not followed) named ``*.slot`` or ``*.bin``, and every other
    regular file that starts with a GGSQ or GGSN magic (the server saves slots under any name)."""
    files: list[Path] = []
    errors: list[str] = []
    for a in args:
        if a.is_dir():
            found: list[Path] = []
            for root, dirs, names in os.walk(a, followlinks=False):
                dirs.sort()
                for n in names:
                    p = Path(root) / n
                    if p.is_symlink() or not p.is_file():
                        continue
                    if p.suffix.lower() in SLOT_SUFFIXES or _has_magic(p):
                        found.append(p)
            if not found:
                errors.append(f"no slot files found under {a}{_what_is_there(a)}")
            files += sorted(found)
        elif a.exists():
            files.append(a)
        else:
            errors.append(f"{a}: no such file or directory")
    return files, errors


# ---------------------------------------------------------------------------------------
# level 1: structure
# ---------------------------------------------------------------------------------------


def level_structure(sf: SlotFile) -> Level:
    """The reader's problems, less the model check's (the model level reports those)."""
    lv = Level()
    for p in sf.file_problems:
        lv.add(p.severity, p.code, p.section, p.offset, p.message)
    lv.details = {
        "format": sf.format,
        "version": sf.version,
        "layout": sf.body.layout.describe() if sf.body and sf.body.layout else None,
        "checkpoints": len(sf.checkpoints),
        "draft": sf.draft is not None,
    }
    return lv.finish()


def scan_into(lv: Level, sf: SlotFile, jobs: int) -> None:
    """The full data scan (slotfile.format.scan) as part of the structure level."""
    from slotfile.format.scan import scan

    found, scanned, unchecked = scan(sf, jobs=jobs)
    for f in found:
        lv.error("non-finite", f.section, f.offset, f.message())
    lv.details["scanned_bytes"] = scanned
    if unchecked:
        lv.warn("unscanned-type", "body", None, f"values of type {', '.join(unchecked)} cannot be checked")
    lv.finish()


# ---------------------------------------------------------------------------------------
# level 2: model metadata
# ---------------------------------------------------------------------------------------


@dataclass
class ModelSide:
    info: ModelInfo
    expect: ModelExpect | None = None  # None when the expectation code cannot read this model
    note: str = ""


def _model_side(path: str | None) -> ModelSide | None:
    if path is None:
        return None
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
    lv = Level()
    if side is None:
        return lv.skip("no --model")
    info, exp = side.info, side.expect
    dexp = dside.expect if dside is not None else None
    for s in (side, dside):
        if s is not None and s.note:
            lv.warn("not-modelled", "body", sf.body.offset if sf.body else None, s.note)
    for p in check_against_model(sf, exp, dexp):
        lv.add(p.severity, p.code, p.section, p.offset, p.message)
    if exp is not None and sf.body is not None and sf.body.layout is None:
        lv.warn(
            "not-checked",
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
            "draft-not-checked",
            dft_blobs[0][1],
            dft_blobs[0][0].offset,
            f"{len(dft_blobs)} draft blob(s) not checked (no --draft-model)",
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


# ---------------------------------------------------------------------------------------
# level 3: test-load
# ---------------------------------------------------------------------------------------


def version_message(sf: SlotFile, loader_version: int | None, loader_name: str, tried: str | None = None) -> str | None:
    """A plain sentence when the file's state version is not the loader's.  ``tried``: what
    the search for another library found (the llama-server on PATH)."""
    if sf.format != "GGSQ" or sf.version is None or loader_version is None or sf.version == loader_version:
        return None
    v = sf.version
    who = GGSQ_VERSIONS.get(v)
    line = LOADER_LINES.get(v)
    msg = f"this file has state version {v}, the loader ({loader_name}) only loads version {loader_version}"
    msg += f" ({tried})" if tried else ""
    if who:
        msg += f": pass --llama-lib DIR with a version {v} build of llama.cpp (version {v}: {who}"
        msg += f"; also {line})" if line and v < int(loader_version) else ")"
    else:
        msg += f"; no known llama.cpp line writes version {v}"
    return msg


def level_load(
    sf: SlotFile, res: LoadResult | None, pool: LoaderPool | None, draft_model: bool, tried: str | None = None
) -> Level:
    """``pool``: the loader that test-loaded the file; ``tried``: what the search for a library
    of the file's version found when that loader's version differs (for the message)."""
    lv = Level()
    if pool is None or res is None:
        return lv.skip("no --model")
    info = pool.info
    vmsg = _load_version_message(sf, info, tried)
    lv.details = {
        "library": info.get("library"),
        "body_bytes": res.body_bytes,
        "crashed": res.crashed,
        "message": res.message,
        "checkpoints": [list(c) for c in res.checkpoints],
        "draft": list(res.draft) if res.draft else None,
        "checkpoint_drafts": [list(c) for c in res.checkpoint_drafts],
        "log": res.log,
    }
    if not res.ok:
        # The loader slotfile found by itself cannot judge a file of another version: skipped,
        # not failed.  A library the user named (--llama-lib, $SLOTFILE_LLAMA_LIB) that cannot
        # load the file is the run's failure: the user asked for exactly that load.
        explicit = info.get("library_source") in ("--llama-lib", LIB_ENV)
        if vmsg and not res.crashed and not explicit:
            return lv.skip(vmsg, SkipKind.CANNOT_CHECK)
        if vmsg and not res.crashed:
            lv.error("version-mismatch", "header", 4, f"{vmsg} (llama.cpp: {res.message})")
        else:
            lv.error(
                "crashed" if res.crashed else "load-failed",
                "body",
                sf.body.offset if sf.body else None,
                ("llama.cpp crashed: " if res.crashed else "llama.cpp refused the file: ") + res.message,
            )
        return lv.finish()
    if sf.format == "GGSQ" and sf.body is not None and sf.body.layout is not None and res.body_bytes != sf.body.end:
        lv.error(
            "loader-disagrees",
            "body",
            sf.body.offset,
            f"llama.cpp's loader stopped at offset {res.body_bytes}; the reader's body ends at {sf.body.end}",
        )
    _appendix_load_problems(lv, sf, res, draft_model)
    return lv.finish()


def _load_version_message(sf: SlotFile, info: dict[str, Any], tried: str | None) -> str | None:
    """Why the loader's llama.cpp cannot judge a file of another state or session version."""
    if sf.format == "GGSN" and sf.version is not None and sf.version != info.get("session_version"):
        known = GGSN_VERSIONS.get(sf.version, "no known llama.cpp line")
        return (
            f"this session file has version {sf.version}, the loader ({library_label(info)}) only loads session "
            f"version {info.get('session_version')}"
            + (f" ({tried})" if tried else "")
            + f": pass --llama-lib DIR with a llama.cpp build that writes session version {sf.version}; "
            f"version {sf.version} is written by {known}."
        )
    return version_message(sf, info.get("state_seq_version"), library_label(info), tried)


def _appendix_load_problems(lv: Level, sf: SlotFile, res: LoadResult, draft_model: bool) -> None:
    """What the loader said of the SCKP checkpoints and the SDFT draft state of a file whose
    body restored."""
    for note in res.notes:
        lv.warn(
            "appendix-ignored",
            "sckp" if "SCKP" in note or "checkpoint" in note else "sdft",
            None,
            f"{note} (the restore itself succeeds)",
        )
    for i, (ok, msg) in enumerate(res.checkpoints):
        if not ok:
            off = sf.checkpoints[i].tgt.data_offset if i < len(sf.checkpoints) else None
            lv.error("checkpoint-rejected", f"sckp.checkpoint[{i}].data_tgt", off, msg)
    for i, (ok, msg) in enumerate(res.checkpoint_drafts):
        if not ok:
            off = sf.checkpoints[i].dft.data_offset if i < len(sf.checkpoints) else None
            lv.error("checkpoint-draft-rejected", f"sckp.checkpoint[{i}].data_dft", off, msg)
    if res.draft is not None and not res.draft[0]:
        off = sf.draft.dft.data_offset if sf.draft is not None and sf.draft.dft is not None else None
        lv.error("draft-rejected", "sdft.data_dft", off, res.draft[1])
    has_dft = (sf.draft is not None and sf.draft.dft is not None and sf.draft.dft.length) or any(
        ck.dft.length for ck in sf.checkpoints
    )
    if has_dft and not draft_model:
        lv.warn(
            "draft-not-loaded",
            "sdft" if sf.draft is not None else "sckp",
            None,
            "the file holds draft state; give --draft-model to test-load it",
        )


# ---------------------------------------------------------------------------------------
# level 4: deep
# ---------------------------------------------------------------------------------------


def _dequant_rows(run: LayerRun, c0: int, c1: int) -> np.ndarray:
    """Cells c0..c1 of a run as float64 (cells, elements)."""
    t = run.type_id
    if run.n_cells == 0 or run.row_size == 0:
        return np.zeros((c1 - c0, 0))
    if run.transposed:
        a = run.array()[:, c0:c1]
        a = (a.astype(np.uint32) << 16).view(np.float32) if t == TypeId.BF16 else a
        return np.asarray(a, dtype=np.float64).T
    if t in (TypeId.F32, TypeId.F16):
        return np.asarray(run.array()[c0:c1], dtype=np.float64)
    if t == TypeId.BF16:
        return (run.array()[c0:c1].astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    import gguf.quants as gq
    from gguf import GGMLQuantizationType

    raw = run.data.array(np.uint8).reshape(run.n_cells, run.row_size)[c0:c1]
    return gq.dequantize(np.ascontiguousarray(raw), GGMLQuantizationType(t)).astype(np.float64).reshape(c1 - c0, -1)


LNORM_CAP = 10.0  # |ln(norm ratio)| given for a head whose norm is zero on one side only
TINY = 1e-20


@dataclass
class CellStats:
    """Per-cell statistics of a file run against a recomputed run.

    ``angle``: per cell, the largest angle in degrees between a stored and a recomputed head
    vector; ``lnorm``: the largest ``|ln(||stored head|| / ||recomputed head||)|``; ``rel``:
    ``||stored row - recomputed row|| / max norm`` (the statistic slotfile 0.2 judged)."""

    angle: np.ndarray
    lnorm: np.ndarray
    rel: np.ndarray
    max_abs: float = 0.0
    layer_rel: float = 0.0
    first_bad: int = -1  # first cell with a non-finite stored value

    def summary(self, cells: np.ndarray | None = None) -> RowStats:
        """The worst cell of each statistic and the median angle, over ``cells`` (default all)."""
        idx = np.arange(self.angle.size) if cells is None else np.asarray(cells)
        st = RowStats(max_abs=self.max_abs, layer_rel=self.layer_rel, finite=self.first_bad < 0)
        st.first_bad = self.first_bad
        if not idx.size:
            return st
        for name, arr in (("angle", self.angle), ("lnorm", self.lnorm), ("rel", self.rel)):
            i = int(idx[int(np.argmax(arr[idx]))])
            setattr(st, name, float(arr[i]))
            setattr(st, f"{name}_cell", i)
        st.median_angle = float(np.median(self.angle[idx]))
        return st


@dataclass
class RowStats:
    """The worst cell of each :class:`CellStats` statistic (and its cell), the median angle."""

    angle: float = 0.0
    angle_cell: int = -1
    lnorm: float = 0.0
    lnorm_cell: int = -1
    rel: float = 0.0
    rel_cell: int = -1
    median_angle: float = 0.0
    max_abs: float = 0.0
    layer_rel: float = 0.0
    finite: bool = True
    first_bad: int = -1

    def as_dict(self) -> dict[str, Any]:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def hadamard(n: int) -> np.ndarray:
    """The orthonormal Walsh-Hadamard matrix llama.cpp rotates quantized K/V with
    (``ggml_gen_hadamard``, src/llama-kv-cache.cpp; symmetric, its own inverse)."""
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def rot_width(part: str, head: int) -> int:
    """The rotation width llama.cpp uses for a quantized cache with this head size (0: none):
    K the largest power of two >= 64 dividing the head size, V 64 (``build_input_k_rot`` /
    ``build_input_v_rot``, src/llama-kv-cache.cpp)."""
    if head <= 0 or head % 64:
        return 0
    if part != "K":
        return 64
    n = 64
    while head % (2 * n) == 0:
        n *= 2
    return n


def _head_stats(x: np.ndarray, y: np.ndarray, head: int) -> tuple[np.ndarray, np.ndarray]:
    """Per cell: the largest head angle (degrees) and the largest |ln norm ratio|."""
    c = x.shape[0]
    hs = head if head > 0 and x.shape[1] % head == 0 else x.shape[1]
    xh, yh = x.reshape(c, -1, hs), y.reshape(c, -1, hs)
    nx, ny = np.linalg.norm(xh, axis=2), np.linalg.norm(yh, axis=2)
    zx, zy = nx <= TINY, ny <= TINY
    cos = np.einsum("chk,chk->ch", xh, yh) / np.maximum(nx * ny, TINY * TINY)
    ang = np.degrees(np.arccos(np.clip(cos, -1.0, 1.0)))
    ang = np.where(zx & zy, 0.0, np.where(zx | zy, 90.0, ang))
    ln = np.abs(np.log(np.maximum(nx, TINY) / np.maximum(ny, TINY)))
    ln = np.where(zx & zy, 0.0, np.where(zx | zy, LNORM_CAP, np.minimum(ln, LNORM_CAP)))
    return np.max(ang, axis=1), np.max(ln, axis=1)


def cell_stats(a: LayerRun, b: LayerRun, head: int = 0, rotate: int = 0) -> CellStats:
    """File run ``a`` against recomputed run ``b`` (same cells, same type), in chunks of cells.
    ``head``: elements per head (0: the whole row is one head); ``rotate``: apply llama.cpp's
    Hadamard rotation of this width to ``b`` first (comparing against the other rotation
    setting: the rotation is its own inverse)."""
    n = a.n_cells
    st = CellStats(np.zeros(n), np.zeros(n), np.zeros(n))
    ss_d = ss_b = 0.0
    h_mat = hadamard(rotate) if rotate else None
    for c0 in range(0, n, CHUNK_CELLS):
        c1 = min(n, c0 + CHUNK_CELLS)
        x, y = _dequant_rows(a, c0, c1), _dequant_rows(b, c0, c1)
        if not x.size:
            continue
        if h_mat is not None and y.shape[1] % rotate == 0:
            y = (y.reshape(c1 - c0, -1, rotate) @ h_mat).reshape(c1 - c0, -1)
        ok = np.isfinite(x).all(axis=1)
        if not ok.all():
            if st.first_bad < 0:
                st.first_bad = c0 + int(np.flatnonzero(~ok)[0])
            x = np.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
        d = x - y
        st.max_abs = max(st.max_abs, float(np.max(np.abs(d))))
        ss_d += float(np.sum(d * d))
        ss_b += float(np.sum(y * y))
        den = np.maximum(np.maximum(np.linalg.norm(x, axis=1), np.linalg.norm(y, axis=1)), 1e-30)
        st.rel[c0:c1] = np.linalg.norm(d, axis=1) / den
        st.angle[c0:c1], st.lnorm[c0:c1] = _head_stats(x, y, head)
    st.layer_rel = (ss_d**0.5) / (ss_b**0.5) if ss_b > 0 else (0.0 if ss_d == 0 else float("inf"))
    return st


def compare_rows(a: LayerRun, b: LayerRun, head: int = 0, rotate: int = 0) -> RowStats:
    """:func:`cell_stats` summarised over every cell."""
    return cell_stats(a, b, head, rotate).summary()


def compare_run(a: LayerRun, b: LayerRun) -> dict[str, Any]:
    """The statistics of slotfile 0.2 (whole rows): kept for callers that print them."""
    st = compare_rows(a, b)
    return {
        "max_abs": st.max_abs,
        "rel": st.layer_rel,
        "worst_cell_rel": float("inf") if not st.finite else st.rel,
        "worst_cell": st.first_bad if not st.finite else st.rel_cell,
        "finite": st.finite,
    }


# The smallest noise floor per cache type (bench/deep_noise.py): what re-rounding into the
# type alone does to a head.  A floor from two recomputes that agree exactly (every
# committed tiny fixture; layers before the first difference) must not turn a last-bit
# difference into a failure.
MIN_FLOOR = {
    "float": {"angle": 0.5, "lnorm": 0.03, "median": 0.05},
    "8-bit": {"angle": 2.0, "lnorm": 0.05, "median": 0.5},
    "low-bit": {"angle": 10.0, "lnorm": 0.1, "median": 3.0},
}
MARGIN_LIMIT = 4.0  # a layer fails when a statistic is more than this many noise floors
LOGITS_MIN_FLOOR = {"float": 0.01, "8-bit": 0.03, "low-bit": 0.15}
TAIL = 32  # tokens recomputed one per llama_decode call for the noise floor
# what --json shows as "tolerances": how the deep level judges
DEEP_JUDGMENT = {"limit": MARGIN_LIMIT, "min_floor": MIN_FLOOR, "logits_min_floor": LOGITS_MIN_FLOOR, "tail": TAIL}


def judge_run(s: RowStats, f: RowStats | None, tol_class: str) -> dict[str, Any]:
    """One layer: the stored-vs-recomputed statistics ``s`` against the noise floor ``f`` (the
    recompute against its tail decoded one token per call), each raised to the type's minimum."""
    mf = MIN_FLOOR[tol_class]
    fl = {
        "angle": max(f.angle if f else 0.0, mf["angle"]),
        "lnorm": max(f.lnorm if f else 0.0, mf["lnorm"]),
        # the median over all cells against the worst single-token drift: stored generated cells
        # carry their context's drift too (median 1.5x the tail's in bench/deep_noise.json)
        "median": max(f.angle if f else 0.0, mf["median"]),
    }
    ratios = {"angle": s.angle / fl["angle"], "lnorm": s.lnorm / fl["lnorm"], "median": s.median_angle / fl["median"]}
    by = max(ratios, key=lambda k: ratios[k])
    return {
        "angle": round(s.angle, 4),
        "lnorm": round(s.lnorm, 5),
        "median_angle": round(s.median_angle, 4),
        "rel": round(s.rel, 5),
        "floor": {k: round(v, 5) for k, v in fl.items()},
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
        "ratio": round(ratios[by], 3),
        "by": by,
        "cell": {"angle": s.angle_cell, "lnorm": s.lnorm_cell, "median": s.angle_cell}[by],
    }


def _tail_cells(run: LayerRun, pos: np.ndarray | None, n_tokens: int, tail: int) -> np.ndarray:
    if not tail:
        return np.arange(0)
    if pos is None:  # a recurrent state: one cell, the state after the last token
        return np.arange(run.n_cells)
    return np.flatnonzero(pos[: run.n_cells] >= n_tokens - tail)


def judge_body(
    file_body: Body, rec_a: Body, rec_b: Body | None, head: int = 0, n_tokens: int = 0, tail: int = 0
) -> dict[str, Any]:
    """Every K/V layer of ``file_body`` against recompute ``rec_a``, the floor from ``rec_a``
    against ``rec_b`` over its last ``tail`` positions (bench/deep_noise.py)."""
    layers = []
    for fb, ab, bb in zip(file_body.blocks, rec_a.blocks, (rec_b.blocks if rec_b else rec_a.blocks), strict=False):
        for (_sec, fr, ar, _pos), (_s2, _a2, br, bpos) in zip(_pairs(fb, ab), _pairs(ab, bb), strict=False):
            if fr is None or ar is None:
                continue
            s = cell_stats(fr, ar, head).summary()
            f = None
            if rec_b is not None and br is not None:
                f = cell_stats(ar, br, head).summary(_tail_cells(ar, bpos, n_tokens, tail))
            j = judge_run(s, f, tolerance_class(fr.type_id))
            layers.append({"block": fb.role, "part": fr.part, "layer": fr.index, **j})
    worst = max(layers, key=lambda r: r["ratio"], default=None)
    return {"margin": worst["ratio"] if worst else 0.0, "worst": worst, "layers": layers}


def _pairs(
    fb: MemoryBlock, rb: MemoryBlock
) -> Iterator[tuple[str, LayerRun | None, LayerRun | None, np.ndarray | None]]:
    """(section, file run, recomputed run, positions) for every layer entry of two blocks."""
    if fb.kind == "KV":
        for fs, rs in zip(fb.streams, rb.streams, strict=False):
            if not fs.cell_count and not rs.cell_count:
                continue
            sec = f"body.{fb.role}.stream[{fs.index}]"
            for part_f, part_r in ((fs.k, rs.k), (fs.v, rs.v)):
                for j in range(max(len(part_f), len(part_r))):
                    yield (
                        sec,
                        part_f[j] if j < len(part_f) else None,
                        part_r[j] if j < len(part_r) else None,
                        fs.positions,
                    )
    else:
        sec = f"body.{fb.role}"
        for part_f, part_r in ((fb.r, rb.r), (fb.p, rb.p), (fb.s, rb.s)):
            for j in range(max(len(part_f), len(part_r))):
                yield sec, part_f[j] if j < len(part_f) else None, part_r[j] if j < len(part_r) else None, None


@dataclass
class DeepInputs:
    """What a layer is judged against: the noise-floor state (the recompute with its last
    ``tail`` tokens decoded one per call), head sizes (K, V) and the token count."""

    floor_body: Body | None = None
    head_k: int = 0
    head_v: int = 0
    n_tokens: int = 0
    tail: int = 0


def compare_bodies(
    lv: Level, file_body: Body, rec_body: Body, inputs: DeepInputs | None = None
) -> list[dict[str, Any]]:
    """Per-layer statistics of the file's state against the recomputed one, each against the
    noise floor (:func:`judge_run`); problems into ``lv``."""
    inp = inputs or DeepInputs()
    rows: list[dict[str, Any]] = []
    if rec_body.layout is None or file_body.layout is None:
        lv.error("deep-internal", "body", file_body.offset, "the recomputed state does not parse")
        return rows
    if file_body.layout.kinds != rec_body.layout.kinds:
        lv.error(
            "deep-layout",
            "body",
            file_body.offset,
            f"the file holds {file_body.layout.describe()}; recomputing gives {rec_body.layout.describe()}",
        )
        return rows
    floors = _floor_runs(rec_body, inp.floor_body)
    for fb, rb in zip(file_body.blocks, rec_body.blocks, strict=False):
        if _cells_differ(lv, fb, rb):
            continue  # different cells: a row-by-row comparison means nothing
        for sec, fr, rr, pos in _pairs(fb, rb):
            if fr is None or rr is None:
                run = fr or rr
                assert run is not None  # _pairs yields at least one side
                lv.error(
                    "deep-layout",
                    sec,
                    fr.offset if fr else None,
                    f"{run.part} layer {run.index} present in only one of file and recomputed state",
                )
            elif (fr.type_id, fr.row_size, fr.transposed) != (rr.type_id, rr.row_size, rr.transposed):
                lv.error(
                    "deep-layout",
                    sec,
                    fr.offset,
                    f"{fr.part} layer {fr.index}: {fr.type_name} rows of "
                    f"{fr.row_size} B; the recomputed state has {rr.type_name} rows of {rr.row_size} B",
                )
            else:
                rows.append(_compare_run(lv, inp, sec, fb.role, fr, rr, pos, floors.get((fb.role, rr.part, rr.index))))
    return rows


_Floors = dict[tuple[str, str, int], tuple[LayerRun, np.ndarray | None]]


def _floor_runs(rec_body: Body, floor_body: Body | None) -> _Floors:
    """The noise-floor state's run for each (block role, part, layer) of the recomputed state."""
    floors: _Floors = {}
    if floor_body is not None and floor_body.layout is not None:
        for rb, bb in zip(rec_body.blocks, floor_body.blocks, strict=False):
            for _sec, ar, br, bpos in _pairs(rb, bb):
                if ar is not None and br is not None:
                    floors[(rb.role, ar.part, ar.index)] = (br, bpos)
    return floors


def _cells_differ(lv: Level, fb: MemoryBlock, rb: MemoryBlock) -> bool:
    """Cell counts or positions of the file's block differ from the recomputed block's:
    problems into ``lv``; True when any was found."""
    before = len(lv.problems)
    if fb.kind == "KV":
        for fs, rs in zip(fb.streams, rb.streams, strict=False):
            if fs.cell_count != rs.cell_count:
                lv.error(
                    "deep-cells",
                    f"body.{fb.role}.stream[{fs.index}]",
                    fs.offset,
                    f"{fs.cell_count} cells; recomputing the tokens gives {rs.cell_count}",
                )
            elif fs.cell_count and not np.array_equal(fs.positions, rs.positions):
                lv.error(
                    "deep-positions",
                    f"body.{fb.role}.stream[{fs.index}]",
                    fs.offset,
                    "cell positions differ from those of the recomputed state",
                )
    elif fb.cell_count != rb.cell_count:
        lv.error(
            "deep-cells",
            f"body.{fb.role}",
            fb.offset,
            f"{fb.cell_count} cells; recomputing the tokens gives {rb.cell_count}",
        )
    return len(lv.problems) > before


def _compare_run(
    lv: Level,
    inp: DeepInputs,
    sec: str,
    role: str,
    fr: LayerRun,
    rr: LayerRun,
    pos: np.ndarray | None,
    floor: tuple[LayerRun, np.ndarray | None] | None,
) -> dict[str, Any]:
    """One layer's rows of the file against the recomputed ones, judged against the noise
    floor between two recomputations: the layer's report row; a problem into ``lv`` when the
    values are not finite or differ by more than MARGIN_LIMIT floors."""
    head = inp.head_k if fr.part == "K" else inp.head_v
    s_st = cell_stats(fr, rr, head).summary()
    f_st = None
    if floor is not None:
        f_st = cell_stats(rr, floor[0], head).summary(_tail_cells(rr, floor[1], inp.n_tokens, inp.tail))
    j = judge_run(s_st, f_st, tolerance_class(fr.type_id))
    cell = j["cell"] if s_st.finite else s_st.first_bad
    p = int(pos[cell]) if pos is not None and 0 <= cell < len(pos) else None
    row = {
        "section": sec,
        "block": role,
        "part": fr.part,
        "layer": fr.index,
        "type": fr.type_name,
        "cells": fr.n_cells,
        "max_abs": s_st.max_abs,
        "rel": s_st.layer_rel,
        "worst_cell_rel": s_st.rel,
        **{k: v for k, v in j.items() if k != "cell"},
        "worst_cell": cell,
        "worst_pos": p,
        "limit": MARGIN_LIMIT,
    }
    if not s_st.finite:
        lv.error(
            "deep-nonfinite",
            sec,
            fr.data.offset,
            f"{fr.part} layer {fr.index}: non-finite values (first in cell {cell})",
        )
    elif j["ratio"] > MARGIN_LIMIT:
        lv.error(
            "deep-mismatch",
            sec,
            fr.data.offset + (cell * fr.row_size if not fr.transposed and cell >= 0 else 0),
            _mismatch_message(fr, j, cell, p, s_st.rel),
        )
    return row


def _mismatch_message(fr: LayerRun, j: dict[str, Any], cell: int, p: int | None, rel: float) -> str:
    at = f"cell {cell}" + (f" (position {p})" if p is not None else "")
    what = {
        "angle": f"a head at {j['angle']:.3g} degrees from the recomputed one",
        "lnorm": f"a head norm off by a factor {np.exp(j['lnorm']):.3g}",
        "median": f"a median head angle of {j['median_angle']:.3g} degrees over all cells",
    }[j["by"]]
    fl = {
        "angle": f"{j['floor']['angle']:.3g} degrees",
        "lnorm": f"a factor {np.exp(j['floor']['lnorm']):.3g}",
        "median": f"{j['floor']['median']:.3g} degrees",
    }[j["by"]]
    return (
        f"{fr.part} layer {fr.index} ({fr.type_name}): {at} differs from the recomputed value by "
        f"{j['ratio']:.3g} noise floors ({what}; the floor is {fl}; limit {MARGIN_LIMIT:g} floors, "
        f"relative difference {100 * rel:.3g}%)"
    )


def _deep_preconditions(sf: SlotFile, n_vocab: int) -> str | None:
    """Why the stored tokens cannot reproduce the state (None: they should)."""
    if sf.format != "GGSQ":
        return "session files (GGSN) hold every sequence; the deep check covers slot files"
    if sf.body is None or sf.body.layout is None or not sf.body.blocks:
        return "the body does not parse" if sf.body is None or sf.body.layout is None else "the file holds no state"
    tp = sf.tokens
    if tp is None or not tp.tokens.size:
        return "the file stores no tokens"
    if tp.media or np.any(tp.tokens < 0):
        return "the prompt has media chunks (image/audio embeddings cannot be recomputed from token ids)"
    if n_vocab and np.any(tp.tokens >= n_vocab):
        return "token ids outside the model's vocabulary (see the model level)"
    n = int(tp.tokens.size)
    first = sf.body.blocks[0]
    if first.kind == "KV":
        act = first.active_streams()
        if len(act) != 1 or not np.array_equal(act[0].positions, np.arange(n)):
            return (
                f"the cache does not hold positions 0..{n - 1} of the {n} stored tokens (context shift, "
                "a partial prompt or cache reuse): nothing to recompute it from"
            )
    else:
        pos = first.positions()
        if pos.size != 1 or int(pos[0]) != n - 1:
            return f"the recurrent state is not at position {n - 1} of the {n} stored tokens"
    return None


@functools.lru_cache(maxsize=8)
def head_sizes(model_path: str | None) -> tuple[int, int]:
    """Elements per K and per V head from the GGUF metadata ((0, 0): unknown, whole rows)."""
    if not model_path:
        return 0, 0
    try:
        info = load_model_info(model_path)
    except (ModelError, OSError):
        return 0, 0

    def num(key: str) -> int:
        v = info.get(key)
        try:
            return int(v if not isinstance(v, list) else max(v))
        except (TypeError, ValueError):
            return 0

    n_embd, n_head = num("embedding_length"), num("attention.head_count")
    k = num("attention.key_length") or (n_embd // n_head if n_head else 0)
    v = num("attention.value_length") or k
    return k, v


def rotation_disabled_here() -> bool:
    """Whether the workers (which inherit this environment) run with LLAMA_ATTN_ROT_DISABLE
    (read with atoi in llama_kv_cache's constructor)."""
    raw = os.environ.get("LLAMA_ATTN_ROT_DISABLE", "")
    digits = raw.strip()
    sign = -1 if digits.startswith("-") else 1
    digits = digits.lstrip("+-")
    n = ""
    for ch in digits:
        if not ch.isdigit():
            break
        n += ch
    return bool(n) and sign * int(n) != 0


def rotation_check(file_body: Body, rec_body: Body, head_k: int, head_v: int) -> dict[str, Any] | None:
    """For quantized caches that llama.cpp rotates (head size a multiple of 64): which rotation
    setting the stored values were computed with.  The stored rows are compared with the
    recompute as it is and with the recompute's Hadamard rotation undone (the transform is its
    own inverse); the setting whose median head angle is smaller is the file's.  None when no
    layer is rotatable."""
    direct: list[float] = []
    other: list[float] = []
    for fb, rb in zip(file_body.blocks, rec_body.blocks, strict=False):
        if fb.kind != "KV":
            continue
        for _sec, fr, rr, _pos in _pairs(fb, rb):
            if fr is None or rr is None or fr.type_id in FLOAT_TYPES or fr.type_id != rr.type_id:
                continue
            head = head_k if fr.part == "K" else head_v
            w = rot_width(fr.part, head)
            if not w or fr.row_size != rr.row_size:
                continue
            direct.append(cell_stats(fr, rr, head).summary().median_angle)
            other.append(cell_stats(fr, rr, head, rotate=w).summary().median_angle)
    if not direct:
        return None
    here_off = rotation_disabled_here()
    d, o = float(np.median(direct)), float(np.median(other))
    same = d <= o
    stored_off = here_off if same else not here_off
    return {
        "stored": "disabled (LLAMA_ATTN_ROT_DISABLE)" if stored_off else "rotated (as this llama.cpp does)",
        "recompute": "disabled (LLAMA_ATTN_ROT_DISABLE)" if here_off else "rotated",
        "matches": same,
        "median_angle_as_recomputed": round(d, 3),
        "median_angle_other_setting": round(o, 3),
        "layers": len(direct),
    }


def level_deep(
    sf: SlotFile, path: str, pool: LoaderPool | None, load: Level, opts: Options, settings: LoadSettings | None
) -> Level:
    """Recompute the stored tokens the way the server did (n_batch/n_ubatch: ``opts``, default
    the server's 2048/512), and the last :data:`TAIL` of them once more one per call, as the
    server decodes generated tokens: that second state's difference from the first, per layer,
    is the noise floor each stored layer is judged against (:func:`judge_run`)."""
    lv = Level()
    if not opts.deep:
        return lv.skip("no --deep")
    if pool is None:
        return lv.skip("no --model")
    if load.status == Status.SKIPPED:
        return lv.skip("the file could not be test-loaded here", SkipKind.CANNOT_CHECK)
    if load.status != Status.PASS:
        return lv.skip("the file does not load", SkipKind.BLOCKED)
    why = _deep_preconditions(sf, int(pool.info.get("n_vocab") or 0))
    if why:
        return lv.skip(why, SkipKind.CANNOT_CHECK)
    tokens = [int(t) for t in sf.tokens.tokens]  # type: ignore[union-attr]
    body: Body = sf.body  # type: ignore[assignment]  # _deep_preconditions: a parsed body
    outs: list[str] = []
    for _ in range(2):
        fd, out = tempfile.mkstemp(prefix="slotfile-deep-", suffix=".slot")
        os.close(fd)
        outs.append(out)
    try:
        res = pool.deep(
            path,
            tokens,
            tokens[-1],
            outs[0],
            settings,
            timeout=opts.timeout,
            batch=opts.n_batch,
            n_ubatch=opts.n_ubatch,
            tail=TAIL,
            out_floor=outs[1],
        )
        if res.ok:
            _judge_deep(lv, body, tokens, res, outs[0], opts.model)
        else:
            lv.error(
                "crashed" if res.crashed else "deep-failed",
                "body",
                body.offset,
                ("llama.cpp crashed: " if res.crashed else "recompute failed: ") + res.message,
            )
    finally:
        for o in outs:
            try:
                os.unlink(o)
            except OSError:
                pass
    return lv.finish()


def _judge_deep(lv: Level, body: Body, tokens: list[int], res: DeepResult, rec_path: str, model: str | None) -> None:
    """The file's state against the recomputed one (rotation, then every layer against the
    noise floor) and the next-token logits: problems into ``lv``, the figures into its details."""
    rec = open_slot_file(rec_path)
    flo = open_slot_file(res.floor) if res.floor else None
    try:
        hk, hv = head_sizes(model)
        inputs = DeepInputs(flo.body if flo else None, hk, hv, len(tokens), res.tail)
        rot = rotation_check(body, rec.body, hk, hv) if rec.body is not None else None
        rows: list[dict[str, Any]] = []
        if rot is not None and not rot["matches"]:
            lv.error("deep-rotation", "body", body.offset, _rotation_message(rot))
        else:
            rows = compare_bodies(lv, body, rec.body, inputs)  # type: ignore[arg-type]
    finally:
        rec.close()
        if flo is not None:
            flo.close()
    lg = res.logits or {}
    lfloor, lratio = _check_logits(lv, body, lg)
    worst = max(rows, key=lambda r: r["ratio"], default=None)
    lv.details = {
        "layers": rows,
        "logits": dict(lg, floor=lfloor, ratio=round(lratio, 3)),
        "probe_token": tokens[-1],
        "n_batch": res.n_batch,
        "n_ubatch": res.n_ubatch,
        "tail": res.tail,
        "limit": MARGIN_LIMIT,
        "margin": worst["ratio"] if worst else 0.0,
        "worst": {k: worst[k] for k in ("section", "part", "layer", "ratio", "by", "worst_pos")} if worst else None,
        "rotation": rot,
        "min_floor": MIN_FLOOR,
    }


def _rotation_message(rot: dict[str, Any]) -> str:
    fix = (
        "load it with LLAMA_ATTN_ROT_DISABLE=1"
        if rot["stored"].startswith("disabled")
        else "load it without LLAMA_ATTN_ROT_DISABLE"
    )
    return (
        f"the stored K/V were computed with rotation {rot['stored']}; this llama.cpp's recompute is "
        f"{rot['recompute']} (median head angle {rot['median_angle_as_recomputed']:.3g} degrees as "
        f"recomputed, {rot['median_angle_other_setting']:.3g} with the rotation undone): restored here, "
        f"attention reads the cache in the wrong basis; {fix}"
    )


def _check_logits(lv: Level, body: Body, lg: dict[str, Any]) -> tuple[float, float]:
    """Next-token logits after restoring the file against those after recomputing, judged
    against their floor (at least LOGITS_MIN_FLOOR of the body's coarsest type): (floor, ratio)."""
    tol_class = max(
        (tolerance_class(r.type_id) for b in body.blocks for r in b.runs()),
        key=lambda c: LOGITS_MIN_FLOOR[c],
        default="float",
    )
    lfloor = max(float(lg.get("floor_rel", 0.0)), LOGITS_MIN_FLOOR[tol_class])
    lratio = float(lg.get("rel", 0.0)) / lfloor
    if not lg.get("all_finite", True):
        lv.error("deep-logits", "body", body.offset, "non-finite next-token logits after restoring the file")
    elif lratio > MARGIN_LIMIT and not any(p["code"] == "deep-rotation" for p in lv.problems):
        lv.error(
            "deep-logits",
            "body",
            body.offset,
            f"next-token logits after restoring differ from those after recomputing the tokens by "
            f"{lratio:.3g} noise floors ({100 * lg['rel']:.3g}%; floor {100 * lfloor:.3g}%, limit "
            f"{MARGIN_LIMIT:g}; top token {lg['top5_restored'][0]} vs {lg['top5_recomputed'][0]})",
        )
    return lfloor, lratio


# ---------------------------------------------------------------------------------------
# the engine
# ---------------------------------------------------------------------------------------


class Verifier:
    """Models and loader workers shared by every file of a run."""

    def __init__(self, opts: Options, pool: LoaderPool | None = None) -> None:
        """``pool``: workers the caller started early (``LoaderPool.start``) so that they load
        the model while this process imports and parses; a failure to start surfaces at the
        first load, as a VerifyError from :meth:`run`."""
        self.opts = opts
        self.pool: LoaderPool | None = pool
        self.side = _model_side(opts.model)
        self.dside = _model_side(opts.draft_model)
        if opts.model is not None and self.pool is None:
            try:
                self.pool = LoaderPool(
                    opts.model, opts.draft_model, opts.n_gpu_layers, opts.jobs, llama_lib=opts.llama_lib
                )
            except LoaderError as e:
                raise VerifyError(str(e)) from e
        self._server: tuple[LoaderPool | None, str] | None = None  # the llama-server's library, once looked for
        self._server_lock = threading.Lock()
        self.used: dict[int, int] = {}  # id(pool) -> files test-loaded with it

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if self._server is not None and self._server[0] is not None:
            self._server[0].close()
            self._server = None

    def loaders(self) -> list[dict[str, Any]]:
        """Every loader this run used (the first: the one it started with), as --json shows them."""
        pools = [p for p in (self.pool, self._server[0] if self._server else None) if p is not None]
        try:
            return [dict(p.describe(), files=self.used.get(id(p), 0)) for p in pools]
        except LoaderError as e:
            raise VerifyError(str(e)) from e

    def pool_for(self, sf: SlotFile) -> tuple[LoaderPool | None, str | None]:
        """The loader for ``sf``: the run's own, or, when its version is not the file's and no
        library was named (--llama-lib, $SLOTFILE_LLAMA_LIB), the library beside the
        llama-server on PATH if that one's version is the file's.  Also what the search found."""
        pool = self.pool
        if pool is None or pool.loads_version_of(sf.format, sf.version):
            return pool, None
        if pool.library.source in ("--llama-lib", LIB_ENV):
            return pool, None
        server, note = self._server_pool()
        if server is not None and server.loads_version_of(sf.format, sf.version):
            return server, None
        return pool, note

    def _server_pool(self) -> tuple[LoaderPool | None, str]:
        with self._server_lock:
            if self._server is None:
                self._server = self._start_server_pool()
            return self._server

    def _start_server_pool(self) -> tuple[LoaderPool | None, str]:
        assert self.opts.model is not None and self.pool is not None
        folder, where = server_library()
        if folder is None:
            return None, where
        if folder == self.pool.info.get("library_dir"):
            return None, f"{where} is this very library"
        try:
            pool = LoaderPool(
                self.opts.model,
                self.opts.draft_model,
                self.opts.n_gpu_layers,
                self.opts.jobs,
                llama_lib=Library(folder, "llama-server on PATH"),
            )
        except LoaderError as e:
            return None, f"{where} does not load: {e}"
        return pool, f"{where} writes state version {pool.state_seq_version}, session version {pool.session_version}"

    def __enter__(self) -> Verifier:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def verify(self, path: Path) -> FileReport:
        t0 = time.monotonic()
        rep = FileReport(str(path))
        try:
            if path.is_dir():
                raise IsADirectoryError(21, "is a directory")
            sf = read(path, self.side, self.dside)
        except OSError as e:
            rep.error = f"{path}: {e.strerror or e}"
            return rep
        rep.size, rep.n_tokens, rep.format, rep.version = sf.size, sf.n_tokens, sf.format, sf.version
        rep.facts = facts_of(sf, self.opts.model)
        lv = rep.levels
        t = time.monotonic()
        lv["structure"] = level_structure(sf)
        if self.opts.scan:
            scan_into(lv["structure"], sf, max(2, self.opts.jobs))
        lv["structure"].seconds = time.monotonic() - t
        if any(p["class"] == Cause.NOT_SLOT_FILE for p in lv["structure"].problems):
            for name in LEVELS[1:]:  # nothing for a model or a loader to judge
                lv[name].skip("not a slot file", SkipKind.BLOCKED)
            rep.seconds = time.monotonic() - t0
            return rep
        t = time.monotonic()
        lv["model"] = level_model(sf, self.side, self.dside)
        lv["model"].seconds = time.monotonic() - t
        settings = None
        res = None
        t = time.monotonic()
        pool, tried = self.pool_for(sf)
        if pool is not None:
            settings = settings_for(sf, self.opts.n_gpu_layers)
            if self.opts.settings_hook is not None:
                settings = self.opts.settings_hook(sf, settings)
            res = pool.load(str(path), settings, timeout=self.opts.timeout, sf=sf)
            with self._server_lock:
                self.used[id(pool)] = self.used.get(id(pool), 0) + 1
        lv["load"] = level_load(sf, res, pool, self.opts.draft_model is not None, tried)
        lv["load"].seconds = time.monotonic() - t
        if settings is not None:
            lv["load"].details["settings"] = settings.to_dict()
        t = time.monotonic()
        lv["deep"] = level_deep(sf, str(path), pool, lv["load"], self.opts, settings)
        lv["deep"].seconds = time.monotonic() - t
        rep.seconds = time.monotonic() - t0
        return rep

    def run(self, paths: list[Path], on_done: Callable[[FileReport], None] | None = None) -> list[FileReport]:
        """Every file, ``jobs`` at a time; results in the order of ``paths``.  Raises
        VerifyError when the loader cannot start (model unloadable)."""
        try:
            return self._run(paths, on_done)
        except LoaderError as e:
            raise VerifyError(str(e)) from e

    def _run(self, paths: list[Path], on_done: Callable[[FileReport], None] | None) -> list[FileReport]:
        if self.opts.jobs <= 1 or len(paths) <= 1:
            out = []
            for p in paths:
                r = self.verify(p)
                out.append(r)
                if on_done:
                    on_done(r)
            return out
        results: list[FileReport | None] = [None] * len(paths)
        from concurrent.futures import ThreadPoolExecutor, as_completed  # --jobs > 1 only

        with ThreadPoolExecutor(max_workers=self.opts.jobs) as ex:
            futs = {ex.submit(self.verify, p): i for i, p in enumerate(paths)}

            for f in as_completed(futs):
                r = f.result()
                results[futs[f]] = r
                if on_done:
                    on_done(r)
        return [r for r in results if r is not None]


def verify_paths(
    args: list[Path], opts: Options, on_done: Callable[[FileReport], None] | None = None
) -> tuple[list[FileReport], list[str]]:
    """Collect and verify; returns (reports, operational errors for missing paths and empty directories).
    Raises VerifyError when the model is missing or the loader cannot start."""
    files, errors = collect(args)
    with Verifier(opts) as v:
        return v.run(files, on_done), errors
