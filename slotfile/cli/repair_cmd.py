"""``slotfile truncate-recover``, ``strip-draft``, ``re-save`` and ``migrate``: the commands that write."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slotfile.cli.common import fail, out_console
from slotfile.cli.terminal import escape_text
from slotfile.exitcodes import OK, OPERATIONAL, PROBLEMS, USAGE
from slotfile.format.types import KV_CACHE_TYPES
from slotfile.repair import Outcome, RepairOptions, Report, run
from slotfile.safewrite import WriteRefused, resolve_target

EXIT_CODES = {
    Outcome.REPAIRED: OK,
    Outcome.NOTHING_TO_DO: OK,
    Outcome.DRY_RUN: OK,
    Outcome.REFUSED: PROBLEMS,  # cannot be repaired
    Outcome.CHECK_FAILED: PROBLEMS,  # the result failed its check; nothing written
    Outcome.UNUSABLE_OUTPUT: USAGE,  # OUT exists, a symlink, a read-only directory
    Outcome.OPERATIONAL: OPERATIONAL,  # input or model missing, worker crash, I/O error
}


def exit_code(report: Report) -> int:
    """The exit code of a repair's outcome (README, "Exit codes")."""
    return EXIT_CODES[report.outcome]


def report_json(report: Report) -> dict[str, Any]:
    """The report as JSON (schema slotfile.repair/1), with its exit code after the status."""
    out: dict[str, Any] = {}
    for k, v in report.to_json().items():
        out[k] = v
        if k == "status":
            out["exit_code"] = exit_code(report)
    return out


def _on_off(value: str | None, option: str) -> bool | None:
    if value is None:
        return None
    v = value.strip().lower()
    if v in ("on", "1", "true", "yes", "enabled"):
        return True
    if v in ("off", "0", "false", "no", "disabled"):
        return False
    raise ValueError(f"{option} takes on or off, not {value!r}")


def _cache_type(value: str | None, option: str) -> str | None:
    if value is None:
        return None
    if value.lower() not in KV_CACHE_TYPES:
        raise ValueError(f"{option} {value!r} is not a KV cache type ({', '.join(KV_CACHE_TYPES)})")
    return value.lower()


@dataclass(frozen=True, slots=True)
class RepairArgs:
    """The command line of a command that writes one file (``truncate-recover``,
    ``strip-draft``, ``re-save FILE``, ``migrate``); an option a command lacks keeps its default."""

    command: str
    input: Path
    output: Path | None = None
    force: bool = False
    in_place: bool = False
    backup: Path | None = None
    dry_run: bool = False
    json_out: bool = False
    model: Path | None = None
    draft_model: Path | None = None
    flash_attn: str | None = None
    cache_type_k: str | None = None
    cache_type_v: str | None = None
    checkpoint_at: tuple[int, ...] = ()
    tokens: str | None = None
    recompute: bool = False
    timeout: float = 600.0
    llama_lib: Path | None = None
    to_version: int | None = None

    def options(self) -> RepairOptions:
        """The repair library's options; raises ValueError with the option's name for a bad value."""
        opts = RepairOptions(
            model=str(self.model) if self.model else None,
            draft_model=str(self.draft_model) if self.draft_model else None,
            flash_attn=_on_off(self.flash_attn, "--flash-attn"),
            type_k=_cache_type(self.cache_type_k, "--cache-type-k"),
            type_v=_cache_type(self.cache_type_v, "--cache-type-v"),
            checkpoint_at=list(self.checkpoint_at) if self.checkpoint_at else None,
            tokens=self.tokens.lower() if self.tokens else None,
            recompute=self.recompute,
            timeout=self.timeout,
            llama_lib=str(self.llama_lib) if self.llama_lib is not None else None,
            to_version=self.to_version,
        )
        if opts.tokens not in (None, "packed", "plain"):
            raise ValueError(f"--tokens takes packed or plain, not {self.tokens!r}")
        if self.command == "re-save" and self.model is None:
            raise ValueError("re-save needs --model")
        return opts


def run_repair(args: RepairArgs) -> int:
    command, input_path, json_out = args.command, args.input, args.json_out
    try:
        opts = args.options()
        target = None
        if not args.dry_run or args.output is not None or args.in_place:
            if not input_path.exists() and not input_path.is_symlink():
                target = None  # reported by run() as an unreadable input
            else:
                target = resolve_target(
                    input_path, args.output, in_place=args.in_place, backup=args.backup, force=args.force
                )
    except (ValueError, WriteRefused) as e:
        return _usage(command, input_path, str(e), json_out)
    if target is None and not args.dry_run:
        report = Report(command, str(input_path)).fail(Outcome.OPERATIONAL, f"{input_path}: no such file")
        _emit(report, json_out)
        return exit_code(report)
    report = run(command, str(input_path), target, opts, dry_run=args.dry_run)
    _emit(report, json_out)
    return exit_code(report)


def _usage(command: str, input_path: Path, message: str, json_out: bool) -> int:
    """A usage error (bad option, unusable OUT): one line on stderr, nothing planned."""
    report = Report(command, str(input_path), input_size=_size(input_path)).fail(Outcome.UNUSABLE_OUTPUT, message)
    if json_out:
        _print_json(report)
    fail(message, command)
    return USAGE


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _print_json(report: Report) -> None:
    sys.stdout.write(json.dumps(report_json(report), indent=2) + "\n")
    sys.stdout.flush()


def _emit(report: Report, json_out: bool) -> None:
    code = exit_code(report)
    if json_out:
        _print_json(report)
        if code and report.reason:
            fail(report.reason, report.command)
        return
    out = out_console()
    if code:
        # one line with the reason on stderr; what a refused or failed repair found on stdout
        # (a repair that could not start or write has nothing to show there)
        fail(report.reason or report.status, report.command)
        if report.outcome in (Outcome.REFUSED, Outcome.CHECK_FAILED):
            lines = report.lines()
            for line in lines[2:] if report.reason else lines[1:]:
                out.print(escape_text(line), soft_wrap=True)
        return
    for line in report.lines():
        out.print(escape_text(line), soft_wrap=True)
