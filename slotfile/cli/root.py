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


def one_blas_thread() -> None:
    """Before ``ls``/``verify`` imports numpy: one OpenBLAS thread, unless the environment says
    otherwise.  OpenBLAS starts a thread per core at import (~0.05 s of CPU, a tenth of a small
    run's start) and a structure read does no matrix work.  A deep check's matrix work in this
    process is small (a layer's worst cells against its recomputed rows: 64 x a few hundred x
    256) and runs beside the loader's threads: on 2 cores a second BLAS thread waits on them, and
    the judgment after the loader's reply took 84-90 ms with one thread against 131-193 ms with
    two (a GPU-written 125-token Gemma file, 2026-12-05).  The loader (a child process) inherits
    it; a llama.cpp built with its BLAS backend sets the count itself before each product
    (``ggml_backend_blas_mul_mat``, ggml-blas.cpp)."""
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
