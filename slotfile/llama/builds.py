"""The llama.cpp libraries slotfile's build scripts leave in the cache: one per state version.

``scripts/build-llama-v2.sh`` and ``scripts/build-llama-v4.sh`` build the ``llama`` library of a
pinned llama.cpp into ``${SLOTFILE_CACHE_DIR:-${XDG_CACHE_HOME:-~/.cache}/slotfile}/llama-vN/<sha256>/bin``
and mark a finished build with ``.complete`` beside ``bin``.  A command that must test-load a
file of a version its own llama.cpp does not load (``migrate --to 2``, ``ls --llama-lib``) looks
there when no ``--llama-lib`` was given: that is the "found" library of the reports.
``$SLOTFILE_LLAMA_V2`` / ``$SLOTFILE_LLAMA_V4`` (a folder holding libllama.so) take precedence.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_root", "cached_library"]


def cache_root() -> Path:
    env = os.environ.get("SLOTFILE_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "slotfile"


def cached_library(state_version: int) -> Path | None:
    """A finished build of the llama.cpp that writes ``state_version`` (its ``bin`` folder), or None."""
    env = os.environ.get(f"SLOTFILE_LLAMA_V{state_version}")
    if env and (Path(env) / "libllama.so").is_file():
        return Path(env)
    root = cache_root() / f"llama-v{state_version}"
    try:
        found = sorted(root.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:
        return None
    for d in found:
        if (d / ".complete").is_file() and (d / "bin" / "libllama.so").is_file():
            return d / "bin"
    return None
