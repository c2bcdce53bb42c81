"""Shared pieces of the commands: opening files, loading the model, consoles, error lines."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from slotfile.cli.terminal import escape_text
from slotfile.exitcodes import OK, OPERATIONAL, PROBLEMS
from slotfile.format.reader import open_slot_file
from slotfile.format.records import SlotFile
from slotfile.model.bridge import ModelError, ModelInfo, load_model_info


def __getattr__(name: str) -> Any:
    """``out`` / ``err``: rich consoles, built on first use, so that commands printing plain
    text or JSON (dump, --json) never import rich.  stdout carries results; everything else
    (logs, operational errors) goes to stderr."""
    if name not in ("out", "err"):
        raise AttributeError(name)
    from rich.console import Console

    console = (
        Console(highlight=False, markup=False, soft_wrap=False)
        if name == "out"
        else Console(stderr=True, highlight=False, markup=False)
    )
    globals()[name] = console
    return console


def progress_bar(disable: bool = False) -> Any:
    """The progress bar of the commands that walk many files: on stderr, gone when done, off
    when stderr is not a terminal; rich.progress is imported only here."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    err = __getattr__("err")
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=disable or not err.is_terminal,
    )


def fail(message: str, command: str | None = None) -> None:
    """The one way a command reports an error: one line on stderr, ``slotfile: MESSAGE`` (or
    ``slotfile COMMAND: MESSAGE``), escaped and never wrapped (people grep for these)."""
    prefix = f"slotfile {command}" if command else "slotfile"
    sys.stderr.write(f"{prefix}: {escape_text(message)}\n")
    sys.stderr.flush()


def open_or_report(path: Path, model: ModelInfo | None = None, draft_model: ModelInfo | None = None) -> SlotFile | None:
    """Open a file (with the model's layout when given); an unreadable path is reported on
    stderr and gives None."""
    try:
        if path.is_dir():
            fail(f"{path}: is a directory")
            return None
        return open_slot_file(path, model=model, draft_model=draft_model)
    except OSError as e:
        fail(f"{path}: {e.strerror or e}")
        return None


def load_model_or_report(path: Path | None) -> tuple[ModelInfo | None, bool]:
    """(model, ok): ok is False when a model was asked for and could not be read."""
    if path is None:
        return None, True
    try:
        return load_model_info(path), True
    except ModelError as e:
        fail(str(e))
        return None, False


def exit_code(files: list[SlotFile | None]) -> int:
    if any(f is None for f in files):
        return OPERATIONAL
    if any(f.errors for f in files if f is not None):
        return PROBLEMS
    return OK


def stdout_is_tty() -> bool:
    return sys.stdout.isatty()
