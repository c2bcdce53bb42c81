"""What a repair did: the outcome, and the section-by-section report (text and JSON)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

SCHEMA = "slotfile.repair/1"


class Outcome(StrEnum):
    """What happened; the CLI maps each to an exit code."""

    REPAIRED = "repaired"  # the output was written
    NOTHING_TO_DO = "nothing-to-do"  # the output is (or would be) the input byte for byte
    DRY_RUN = "dry-run"  # planned, nothing written
    REFUSED = "refused"  # the repair cannot be done (reason says why)
    CHECK_FAILED = "check-failed"  # the written temp file failed its check; nothing written
    UNUSABLE_OUTPUT = "unusable-output"  # a safety rule stops the write (OUT exists, symlink, read-only...)
    OPERATIONAL = "operational"  # an outside failure: input or model missing, worker crash, I/O error


# the report's "status" (schema slotfile.repair/1) of each outcome
_STATUS = {Outcome.UNUSABLE_OUTPUT: "error", Outcome.OPERATIONAL: "error"}
FAILED = (Outcome.REFUSED, Outcome.CHECK_FAILED, Outcome.UNUSABLE_OUTPUT, Outcome.OPERATIONAL)


@dataclass(slots=True)
class Report:
    command: str
    input: str
    output: str | None = None
    in_place: bool = False
    backup: str | None = None
    dry_run: bool = False
    outcome: Outcome = Outcome.REPAIRED
    reason: str | None = None
    input_size: int = 0
    output_size: int | None = None
    kept: list[dict[str, Any]] = field(default_factory=list)
    dropped: list[dict[str, Any]] = field(default_factory=list)
    changed: list[dict[str, Any]] = field(default_factory=list)
    rebuilt: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    test_load: dict[str, Any] | None = None
    checked: list[str] | None = None  # migrate: the checks the output passed before it landed
    plan: list[dict[str, Any]] | None = None
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def status(self) -> str:
        """repaired, nothing-to-do, dry-run, refused, check-failed or error."""
        return _STATUS.get(self.outcome, str(self.outcome))

    def fail(self, outcome: Outcome, reason: str) -> Report:
        self.outcome, self.reason = outcome, reason
        return self

    def keep(self, section: str, offset: int, nbytes: int, **extra: Any) -> None:
        self.kept.append({"section": section, "offset": offset, "bytes": nbytes, **extra})

    def drop(self, section: str, offset: int, nbytes: int, reason: str, **extra: Any) -> None:
        self.dropped.append({"section": section, "offset": offset, "bytes": nbytes, "reason": reason, **extra})

    def change(self, section: str, what: str, old: Any, new: Any, **extra: Any) -> None:
        self.changed.append({"section": section, "field": what, "from": old, "to": new, **extra})

    def rebuild(self, section: str, nbytes: int | None, how: str, **extra: Any) -> None:
        self.rebuilt.append({"section": section, "bytes": nbytes, "how": how, **extra})

    @property
    def bytes_saved(self) -> int | None:
        return None if self.output_size is None else self.input_size - self.output_size

    def to_json(self) -> dict[str, Any]:
        """The JSON report (schema slotfile.repair/1) less ``exit_code``, which the CLI adds."""
        d = {
            "schema": SCHEMA,
            "command": self.command,
            "input": self.input,
            "output": self.output,
            "in_place": self.in_place,
            "backup": self.backup,
            "dry_run": self.dry_run,
            "status": self.status,
            "reason": self.reason,
            "input_size": self.input_size,
            "output_size": self.output_size,
            "bytes_saved": self.bytes_saved,
            "kept": self.kept,
            "dropped": self.dropped,
            "changed": self.changed,
            "rebuilt": self.rebuilt,
            "notes": self.notes,
            "test_load": self.test_load,
            "timings": {k: round(v, 4) for k, v in self.timings.items()},
        }
        if self.checked is not None:
            d["checked"] = self._checked()
        if self.plan is not None:
            d["plan"] = self.plan
        return d

    def _checked(self) -> list[str]:
        """The checks the output passed: structure, model, and the test-load when it ran."""
        done = list(self.checked or [])
        t = self.test_load
        if t is not None and t.get("ok"):
            done.append("test-load")
        return done

    def lines(self) -> list[str]:
        """The human-readable report."""
        out = [self._head()]
        if self.reason:
            out.append(f"  reason: {self.reason}")
        out += [f"  kept     {_item_line(item)}" for item in self.kept]
        out += [f"  changed  {i['section']}: {i['field']} {i['from']} -> {i['to']}" for i in self.changed]
        out += [f"  rebuilt  {_item_line(item, 'how')}" for item in self.rebuilt]
        out += [f"  dropped  {_item_line(item, 'reason')}" for item in self.dropped]
        out += [f"  note: {note}" for note in self.notes]
        if self.output_size is not None:
            saved = self.input_size - self.output_size
            out.append(
                f"  size: {self.input_size} -> {self.output_size} bytes"
                + (f" ({saved} bytes saved)" if saved > 0 else (f" ({-saved} bytes more)" if saved < 0 else ""))
            )
        if self.test_load is not None:
            out.append(self._test_load_line())
        if self.checked is not None:
            out.append("  checked: " + ", ".join(self._checked()))
        if self.backup and self.outcome == Outcome.REPAIRED:
            out.append(f"  backup: {self.backup}")
        if self.plan:
            out += self._plan_lines()
        # a failure that timed nothing but itself has no time worth a line
        if self.timings and not (self.outcome in FAILED and set(self.timings) <= {"total"}):
            out.append("  time: " + ", ".join(f"{k} {v:.2f} s" for k, v in self.timings.items()))
        return out

    def _head(self) -> str:
        return {
            "repaired": f"{self.command}: {self.input} -> {self.output or '-'}",
            "nothing-to-do": f"{self.command}: {self.input}: nothing to do",
            "dry-run": f"{self.command}: {self.input}: dry run, nothing written",
            "refused": f"{self.command}: {self.input}: cannot repair",
            "check-failed": f"{self.command}: {self.input}: repaired output failed its check; nothing written",
            "error": f"{self.command}: {self.input}: error",
        }[self.status]

    def _test_load_line(self) -> str:
        t = self.test_load or {}
        state = {True: "ok", False: "FAILED", None: "skipped"}[t.get("ok")]
        extra = ""
        if t.get("checkpoints"):
            extra += f", {sum(1 for ok, _ in t['checkpoints'] if ok)}/{len(t['checkpoints'])} checkpoints"
        if t.get("draft"):
            extra += f", draft state {'ok' if t['draft'][0] else 'refused'}"
        return f"  test-load: {state}: {t.get('message', '')}{extra}"

    def _plan_lines(self) -> list[str]:
        plan = self.plan or []
        out = [f"  plan ({len(plan)} pieces, {self.output_size} bytes):"]
        for piece in plan[:40]:
            if "from" in piece:
                out.append(
                    f"    @{piece['out_offset']}: copy {piece['length']} bytes of {piece['from']} "
                    f"from offset {piece['offset']}"
                )
            else:
                out.append(f"    @{piece['out_offset']}: write {piece['length']} bytes ({piece['literal']})")
        if len(plan) > 40:
            out.append(f"    ... {len(plan) - 40} more")
        return out


def _item_line(item: dict[str, Any], tail: str | None = None) -> str:
    parts = [item["section"]]
    if item.get("offset") is not None:
        parts.append(f"at {item['offset']}")
    if item.get("bytes") is not None:
        parts.append(f"{item['bytes']} bytes")
    for key in ("tokens", "n_tokens", "count", "layout"):
        if item.get(key) is not None:
            parts.append(f"{key.replace('_', ' ')} {item[key]}")
    line = ", ".join(parts)
    if tail and item.get(tail):
        line += f": {item[tail]}"
    return line
