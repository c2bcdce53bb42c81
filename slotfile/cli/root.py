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


def structure_only() -> None:
    """Before a command that only reads structure (``ls DIR``, ``verify`` without a model)
    imports numpy: one OpenBLAS thread, unless the environment says otherwise.  OpenBLAS
    starts a thread per core at import (~0.05 s of CPU, a tenth of a small run's start); a
    structure read does no matrix work."""
    import os
    import sys

    if "numpy" not in sys.modules:
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


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
