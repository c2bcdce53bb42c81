"""One row per file, as ``verify``, ``ls`` and ``prune`` print a directory: on a terminal
(or with ``$COLUMNS`` set) fixed columns sized to their contents, the file name last and never
folded (on its own line under the row when the row would reach the edge), and under a row the
lines it has to say, wrapped at word boundaries; on a pipe or a file, one plain line per file
(grep, awk) and nothing wrapped.  Every name is escaped (:func:`escape_text`)."""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from slotfile.cli.terminal import escape_text

if TYPE_CHECKING:
    from rich.console import Console

DETAIL_INDENT = "    "
GAP = "  "


@dataclass(frozen=True, slots=True)
class Row:
    """A file's row: its cells (the file name last, as it is: printing escapes it), the style
    of the first cell, and the lines under it as (style, text); style ``command`` is a command
    line, printed whole to copy and paste."""

    cells: tuple[str, ...]
    style: str = ""
    details: tuple[tuple[str, str], ...] = ()


def screen_width(out: Console) -> int | None:
    """The width to lay a listing out for: ``$COLUMNS``, else the terminal's; None on a pipe
    or a file (one plain line per file)."""
    cols = os.environ.get("COLUMNS", "")
    if out.is_terminal or cols:
        return int(cols) if cols.isdigit() else out.width
    return None


def plain_pipe(stream: TextIO | None = None) -> bool:
    """``stream`` (stdout) is a pipe or a file, certainly, without asking rich: no ``$COLUMNS``,
    nor the ``$TTY_COMPATIBLE`` / ``$FORCE_COLOR`` rich would heed, and not a tty.  Then the
    listing is the plain lines, and rich is never imported (about 50 ms of a run's start)."""
    if any(k in os.environ for k in ("COLUMNS", "TTY_COMPATIBLE", "FORCE_COLOR")):
        return False
    try:
        return not (stream or sys.stdout).isatty()
    except ValueError:  # closed
        return False


def print_rows(out: Console, heads: Sequence[str], rows: Sequence[Row], width: int, right: Iterable[str] = ()) -> None:
    """The header and one row per file (see the module), then each row's lines."""
    from rich.text import Text

    aligned = set(right)
    n = len(heads) - 1
    widths = [max([len(heads[i]), *(len(r.cells[i]) for r in rows)]) for i in range(n)]

    def facts(cells: Sequence[str]) -> str:
        return GAP.join(
            c.rjust(w) if h in aligned else c.ljust(w) for c, w, h in zip(cells, widths, heads, strict=False)
        )

    def line(cells: Sequence[str], name: str) -> Text:
        text = facts(cells) + GAP + name
        if len(text) >= width:  # the name would wrap mid-word at the edge: it goes on its own line
            text = facts(cells).rstrip() + "\n" + DETAIL_INDENT + name
        return Text(text)

    out.print(Text(str(line(heads[:n], heads[n])), style="bold"), soft_wrap=True)
    for r in rows:
        row = line(r.cells[:n], escape_text(r.cells[n]))
        if r.style:
            row.stylize(r.style, 0, len(r.cells[0]))
        out.print(row, soft_wrap=True)
        for style, text in r.details:
            if style == "command":  # whole, to copy and paste
                out.print(Text(DETAIL_INDENT + "  " + escape_text(text), style="bold"), soft_wrap=True)
            else:
                print_wrapped(out, text, width, style, DETAIL_INDENT, DETAIL_INDENT + "  ")


def print_wrapped(out: Console, text: str, width: int, style: str = "", indent: str = "", then: str = "  ") -> None:
    """``text`` (escaped) wrapped to ``width`` at word boundaries; a word longer than a line
    (a path) is never split."""
    from rich.text import Text

    for piece in textwrap.wrap(
        escape_text(text),
        width=max(40, width - 1),
        initial_indent=indent,
        subsequent_indent=then,
        break_long_words=False,
        break_on_hyphens=False,
    ):
        out.print(Text(piece, style=style), soft_wrap=True)


def pipe_line(name: str, facts: str, details: Iterable[str] = ()) -> None:
    """``NAME: FACTS; DETAIL; DETAIL`` on one line of stdout, escaped."""
    sys.stdout.write(pipe_text(name, facts, details) + "\n")


def pipe_text(name: str, facts: str, details: Iterable[str] = ()) -> str:
    """:func:`pipe_line`'s line, without the newline."""
    more = "; ".join(details)
    return escape_text(f"{name}: {facts}" + (f"; {more}" if more else ""))


def summary(out: Console, text: str, width: int | None) -> None:
    """The line under a listing: wrapped to the terminal at word boundaries, whole on a pipe."""
    if width is None:
        out.print(escape_text(text), soft_wrap=True)
    else:
        print_wrapped(out, text, width)
