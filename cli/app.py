"""The typer application: one small function per command, heavy imports inside them."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from slotfile import __version__
from slotfile.exitcodes import OK

app = typer.Typer(
    name="slotfile",
    help="Inspect, verify and repair llama.cpp slot save files (llama-server --slot-save-path).",
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"slotfile {__version__}")
        raise typer.Exit(OK)


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """Exit codes: 0 ok, 2 usage error, 4 problems found, 8 operational error."""


@app.command()
def inspect(
    files: list[Path] = typer.Argument(..., help="Slot (GGSQ) or session (GGSN) files."),
    model: Optional[Path] = typer.Option(None, "--model", "-m", help="GGUF model: adds a detokenised preview."),
    layers: bool = typer.Option(False, "--layers", help="List every layer's K/V/R/S entry."),
) -> None:
    """A summary of each file: format, tokens, memory layout, sections, checkpoints, verdict."""
    from .inspect_cmd import run_inspect

    raise typer.Exit(run_inspect(files, model, layers))


@app.command()
def dump(
    file: Path = typer.Argument(..., help="Slot (GGSQ) or session (GGSN) file."),
    json_out: bool = typer.Option(False, "--json", help="JSON on stdout (schema slotfile.dump/1, see README)."),
    tokens: bool = typer.Option(False, "--tokens", help="Include the token id arrays."),
    model: Optional[Path] = typer.Option(None, "--model", "-m", help="GGUF model: adds the detokenised text."),
) -> None:
    """Every field with its byte offset, as text or JSON."""
    from .dump_cmd import run_dump

    raise typer.Exit(run_dump(file, json_out, tokens, model))


def main() -> None:
    app(prog_name="slotfile")


if __name__ == "__main__":
    main()
