"""``slotfile completion SHELL``: the shell completion script, printed.

typer's own ``--install-completion`` / ``--show-completion`` stay off (``add_completion=False``):
with them typer builds extra parameters and detects the shell on every start-up.  The script
printed here calls ``slotfile`` with ``_SLOTFILE_COMPLETE`` set; :func:`enable_if_completing`
registers typer's completion classes only then, so a normal run pays nothing for it."""

from __future__ import annotations

import os
import sys

from slotfile.exitcodes import OK, USAGE

SHELLS = ("bash", "zsh", "fish")
PROG = "slotfile"
COMPLETE_VAR = "_SLOTFILE_COMPLETE"


def enable_if_completing() -> None:
    """Before the app runs: a completion request (the env var the script sets) needs typer's
    bash/zsh/fish classes registered, which add_completion=False leaves out."""
    if os.environ.get(COMPLETE_VAR):
        from typer.completion import completion_init

        completion_init()


def run_completion(shell: str) -> int:
    if shell not in SHELLS:
        from slotfile.cli.common import fail  # not at import: main() imports this module on every start

        fail(f"unknown shell {shell!r}: give one of {', '.join(SHELLS)}", "completion")
        return USAGE
    from typer.completion import get_completion_script

    sys.stdout.write(get_completion_script(prog_name=PROG, complete_var=COMPLETE_VAR, shell=shell).rstrip("\n") + "\n")
    return OK
