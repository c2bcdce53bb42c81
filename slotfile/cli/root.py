"""The typer application object and its root options (``--version``); the command modules
(:mod:`slotfile.cli.app`, :mod:`slotfile.cli.app_store`) register their commands on it."""

from __future__ import annotations

import typer

from slotfile import __version__
from slotfile.cli.options import HELP
from slotfile.exitcodes import OK

app = typer.Typer(
    name="slotfile",
    context_settings=HELP,
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
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Exit codes: 0 ok, 2 usage error, 4 problems found, 8 operational error."""
