"""Shared pieces of the commands: opening files, loading the model, consoles, error lines."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slotfile.cli.terminal import escape_text
from slotfile.exitcodes import OK, OPERATIONAL, PROBLEMS

if TYPE_CHECKING:
    from rich.console import Console

    from slotfile.format.records import SlotFile
    from slotfile.model.bridge import ModelInfo

# The reader (numpy, the construct grammar: ~0.2 s) is imported where a file is opened, not
# here: a directory run on forked processes imports it in each worker, in parallel, while
# this process only walks the directory and writes the rows (slotfile.slotdir.forked).


def out_console() -> Console:
    """A rich console on stdout (results), made for one invocation; rich is imported only
    here, so that commands printing plain text or JSON (dump, --json) never import it.  It
    writes to whatever ``sys.stdout`` is when it prints (a test runner's capture included)."""
    from rich.console import Console

    return Console(highlight=False, markup=False, soft_wrap=False)


def err_console() -> Console:
    """A rich console on stderr (progress, logs), made for one invocation."""
    from rich.console import Console

    return Console(stderr=True, highlight=False, markup=False)


def progress_bar(disable: bool = False, console: Console | None = None) -> Any:
    """The progress bar of the commands that walk many files: on stderr (``console``, or a
    fresh one), gone when done, off when stderr is not a terminal; rich.progress is imported
    only here."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    err = console if console is not None else err_console()
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


def say_waiting(command: str) -> Callable[[list[Any], float], None]:
    """A directory walker's ``on_wait`` (slotdir.walk.scan_dir): one line on stderr before it
    waits for files being written, so that a wait is never silent."""

    def say(files: list[Any], bound: float) -> None:
        more = f" and {len(files) - 1} more" if len(files) > 1 else ""
        first = escape_text(files[0].rel, 60) if files else "files"
        sys.stderr.write(f"slotfile {command}: waiting up to {bound:g} s for {first}{more}: still being written\n")
        sys.stderr.flush()

    return say


def open_or_report(path: Path, model: ModelInfo | None = None, draft_model: ModelInfo | None = None) -> SlotFile | None:
    """Open a file (with the model's layout when given); an unreadable path is reported on
    stderr and gives None."""
    from slotfile.format.reader import open_slot_file

    try:
        if path.is_dir():
            fail(f"{path}: is a directory")
            return None
        return open_slot_file(path, model=model, draft_model=draft_model)
    except OSError as e:
        fail(f"{path}: {e.strerror or e}")
        return None


def load_model_or_report(path: Path | None, command: str | None = None) -> tuple[ModelInfo | None, bool]:
    """(model, ok): ok is False when a model was asked for and could not be read (said on
    stderr, as ``command``'s error)."""
    from slotfile.model.bridge import ModelError, load_model_info

    if path is None:
        return None, True
    try:
        return load_model_info(path), True
    except ModelError as e:
        fail(str(e), command)
        return None, False


def exit_code(files: list[SlotFile | None]) -> int:
    if any(f is None for f in files):
        return OPERATIONAL
    if any(f.errors for f in files if f is not None):
        return PROBLEMS
    return OK


def write_json(doc: Any) -> None:
    """``doc`` on stdout exactly as ``json.dumps(doc, indent=2)`` and a newline, written in
    pieces as it is encoded, at a fraction of json's cost with an indent (:mod:`slotfile.cli.jsonout`)."""
    from slotfile.cli.jsonout import write

    write(doc, sys.stdout)
