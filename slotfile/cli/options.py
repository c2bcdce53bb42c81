"""The typer options and help text several commands share, defined once."""

from __future__ import annotations

from typing import Any

import typer

# -h as well as --help, on the group and on every command
HELP = {"help_option_names": ["-h", "--help"]}


def examples(*lines: str) -> str:
    """An epilog of examples; the \\b paragraph keeps click from re-wrapping the lines."""
    return "\b\nExamples:\n" + "\n".join(f"  {line}" for line in lines)


LLAMA_LIB_HELP = (
    "A folder holding libllama.so and its libggml*.so (a llama.cpp build's bin/): the llama.cpp the "
    "workers load, e.g. one that loads the file's state version (env SLOTFILELLAMA_LIB)."
)


LLAMA_LIB = typer.Option(None, "--llama-lib", help=LLAMA_LIB_HELP)


def model_option(help: str) -> Any:
    """``--model/-m``: every command takes it; what it is used for differs."""
    return typer.Option(None, "--model", "-m", help=help)


def json_option(help: str) -> Any:
    return typer.Option(False, "--json", help=help)


LS_SERVER_ARGS = typer.Option(
    None, "--server-args", help="A restore verdict per file for this llama-server command line (structure only)."
)
SETTLE = typer.Option(5.0, "--settle", help="Seconds since the last write before a file counts as complete.")
SETTLE_WAIT = typer.Option(
    30.0,
    "--settle-wait",
    help="Seconds to wait for files still being written (inside --settle) before handling them; "
    "a file still changing then is named and the exit code is 4 (0 to 86400).",
)
