"""What ``slotfile verify`` reports: a :class:`Level` per check and a :class:`FileReport` per file.

A level's problems are :class:`~slotfile.problems.Problem` values, raised at the level's
:class:`~slotfile.problems.CheckLevel`; the JSON schema ``slotfile.verify/1`` writes each as
:meth:`Problem.to_dict` with its ``class`` (:func:`slotfile.problems.cause_of`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from slotfile.diagnosis import Cause, Facts, NextStep, file_cause, next_step
from slotfile.problems import CheckLevel, Problem, ProblemCode, Severity

SCHEMA = "slotfile.verify/1"
LEVELS = ("structure", "model", "load", "deep")


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


NO_DEEP = "no --deep"  # the deep level's skip reason when it was not asked for (engine, deep)


class Verdict(StrEnum):
    """A file's outcome: every level that ran passed, one failed, or the file could not be read."""

    PASS = "pass"
    FAIL = "fail"
    ERROR = "error"


@dataclass
class Level:
    check: CheckLevel  # which level this is: its problems are raised at it
    status: Status = Status.SKIPPED
    problems: list[Problem] = field(default_factory=list)
    reason: str = ""  # why it was skipped
    skip_kind: SkipKind | None = None
    details: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    # parts of a level that ran but could not check them (deep: a checkpoint or draft blob that
    # cannot be recomputed here): {"section", "offset", "reason", "hint"}; the level's status says
    # only what was checked, these say what was not (``--require`` fails on them)
    unchecked_parts: list[dict[str, Any]] = field(default_factory=list)

    def add(self, severity: Severity, code: ProblemCode, section: str, offset: int | None, message: str) -> None:
        self.problems.append(Problem(severity, code, section, offset, message, self.check))

    def error(self, code: ProblemCode, section: str, offset: int | None, message: str) -> None:
        self.add(Severity.ERROR, code, section, offset, message)

    def warn(self, code: ProblemCode, section: str, offset: int | None, message: str) -> None:
        self.add(Severity.WARNING, code, section, offset, message)

    def has(self, code: ProblemCode) -> bool:
        return any(p.code == code for p in self.problems)

    def finish(self) -> Level:
        self.status = Status.FAIL if any(p.severity == Severity.ERROR for p in self.problems) else Status.PASS
        return self

    def skip(self, reason: str, kind: SkipKind = SkipKind.NOT_REQUESTED) -> Level:
        self.status, self.reason, self.skip_kind = Status.SKIPPED, reason, kind
        return self

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"status": self.status, "problems": [p.to_dict(with_class=True) for p in self.problems]}
        if self.reason:
            d["reason"] = self.reason
        if self.skip_kind is not None:
            d["skip_kind"] = self.skip_kind
        if self.details:
            d["details"] = self.details
        if self.unchecked_parts:
            d["unchecked_parts"] = self.unchecked_parts
        d["seconds"] = round(self.seconds, 4)
        return d


@dataclass
class FileReport:
    path: str
    size: int | None = None
    n_tokens: int | None = None
    format: str | None = None
    version: int | None = None
    levels: dict[str, Level] = field(default_factory=lambda: {k: Level(CheckLevel(k)) for k in LEVELS})
    error: str | None = None  # operational: the file could not be read at all
    seconds: float = 0.0
    facts: Facts | None = None  # what the next step depends on (set once the file is read)
    # levels --require asked for that were skipped: {"level", "reason", "skip_kind", "hint"}
    # (slotfile.verify.engine.unmet_requirements); any of them fails the file
    unmet: list[dict[str, str]] = field(default_factory=list)

    @property
    def verdict(self) -> Verdict:
        if self.error is not None:
            return Verdict.ERROR
        failed = any(lv.status == Status.FAIL for lv in self.levels.values())
        return Verdict.FAIL if failed or self.unmet else Verdict.PASS

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
                if p.severity == Severity.ERROR:
                    return f"{name}: {p.where()}{p.message}"
        for u in self.unmet:
            return f"{u['level']}: required (--require) but not checked: {u['reason']}"
        return None

    def problems(self) -> list[Problem]:
        """Every level's problems, in level order."""
        return [p for name in LEVELS for p in self.levels[name].problems]

    @property
    def cause(self) -> Cause | None:
        """Why the file fails (damaged, mismatch, not-a-slot-file, unsupported); None when it
        passes or could not be read."""
        return None if self.error is not None else file_cause(self.problems())

    @property
    def next_step(self) -> NextStep | None:
        if self.error is not None or self.facts is None:
            return None
        return next_step(self.cause, self.problems(), self.facts)

    @property
    def unchecked(self) -> list[str]:
        """Levels, and parts of levels that ran, that could not be checked here (skipped, not
        failed), with the reason."""
        out = [f"{name}: {lv.reason}" for name, lv in self.levels.items() if lv.skip_kind == SkipKind.CANNOT_CHECK]
        for name, lv in self.levels.items():
            out += [f"{name}: {u['section']}: {u['reason']}" for u in lv.unchecked_parts]
        return out

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
            "unmet_requirements": self.unmet,
            "error": self.error,
            "seconds": round(self.seconds, 4),
        }


class VerifyError(Exception):
    """Operational: the model is missing or the loader cannot start."""
