"""``slotfile precommit FILE...``: the pre-commit hook's entry (``.pre-commit-hooks.yaml``).

The hook matches file names (``*.slot``, ``*.bin``), and a repository's ``.bin`` files are
mostly something else: firmware, weights, test data.  This entry judges only the files that
start with a slot (GGSQ) or session (GGSN) magic and passes over the rest (with ``-v`` it
names each one and why), then runs ``slotfile verify --quiet`` on the slot files: a damaged
one fails the commit (exit 4), as does one that cannot be read (exit 8).  Symlinks are passed
over (git stores the link, not a slot file).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from slotfile.cli.common import fail
from slotfile.cli.terminal import count, escape_text
from slotfile.exitcodes import OK, OPERATIONAL
from slotfile.slotdir.walk import has_slot_magic


@dataclass(frozen=True, slots=True)
class PrecommitArgs:
    """``slotfile precommit``'s command line."""

    files: tuple[Path, ...]
    verbose: bool = False
    model: Path | None = None
    llama_lib: Path | None = None


def slot_files(args: PrecommitArgs) -> tuple[list[Path], int]:
    """(the files that carry a slot magic, how many could not be read); each file passed over
    is named on stdout with ``verbose``, each unreadable one on stderr."""
    found: list[Path] = []
    unreadable = 0
    for p in args.files:
        if p.is_symlink():
            why = "a symlink: passed over"
        elif p.is_dir():
            why = "a directory: passed over"
        else:
            magic = has_slot_magic(p)
            if magic is None:
                fail(f"{p}: cannot be read", "precommit")
                unreadable += 1
                continue
            if magic:
                found.append(p)
                continue
            why = "no slot magic (GGSQ/GGSN): not a slot file, passed over"
        if args.verbose:
            sys.stdout.write(escape_text(f"{p}: {why}") + "\n")
    return found, unreadable


def run_precommit(args: PrecommitArgs) -> int:
    found, unreadable = slot_files(args)
    if args.verbose:
        n_over = len(args.files) - len(found) - unreadable
        sys.stdout.write(f"slotfile precommit: {count(len(found), 'slot file')} to verify, {n_over} passed over\n")
    sys.stdout.flush()
    rc = OK
    if found:
        rc = _verify(found, args)
    return max(rc, OPERATIONAL if unreadable else OK)  # 0 < 2 < 4 < 8: the worst wins


def _verify(files: list[Path], args: PrecommitArgs) -> int:
    """``slotfile verify --quiet [--model M] [--llama-lib D] -- FILES`` in a child process (this
    interpreter): the verify command exactly as a user runs it, its output passed through."""
    import subprocess

    argv = [sys.executable, "-m", "slotfile", "verify", "--quiet"]
    if args.model is not None:
        argv += ["--model", str(args.model)]
    if args.llama_lib is not None:
        argv += ["--llama-lib", str(args.llama_lib)]
    argv += ["--", *(str(p) for p in files)]
    try:
        return subprocess.run(argv, check=False).returncode
    except OSError as e:
        fail(f"cannot run slotfile verify: {e.strerror or e}", "precommit")
        return OPERATIONAL
