"""What one ``slotfile verify`` run is asked to do (the CLI builds it from the options)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from slotfile.verify.records import LEVELS

if TYPE_CHECKING:
    from slotfile.format.records import SlotFile
    from slotfile.llama.loader import LoadSettings


@dataclass
class VerifyOptions:
    """The models, the levels asked for and the resources of a run (shared by every file)."""

    model: str | None = None
    draft_model: str | None = None
    deep: bool = False
    n_gpu_layers: int = 0
    jobs: int = 1  # loader workers (--model)
    # structure only: the processes a directory's files are read with (None: 2 from 200 files,
    # or $SLOTFILE_DIR_JOBS; slotfile.slotdir.forked.dir_jobs)
    read_jobs: int | None = None
    timeout: float = 300.0
    scan: bool = False  # structure level also checks every K/V/R/S value is finite
    llama_lib: str | None = None  # a folder holding libllama.so for the workers (--llama-lib)
    n_batch: int = 0  # the deep recompute's n_batch / n_ubatch (0: llama-server's 2048 / 512)
    n_ubatch: int = 0
    # levels that must run on every file (--require): one skipped fails the file
    require: tuple[str, ...] = ()
    # change the derived load settings before each load (tests mirror a given server with it)
    settings_hook: Callable[[SlotFile, LoadSettings], LoadSettings] | None = None


def required_levels(names: tuple[str, ...]) -> tuple[str, ...]:
    """``--require`` values as levels: requiring a level requires every level below it (a load
    that was not preceded by a structure check proves nothing)."""
    top = max((LEVELS.index(n) for n in names if n in LEVELS), default=-1)
    return LEVELS[: top + 1]


def require_usage(names: tuple[str, ...], model: bool, deep: bool) -> str | None:
    """The usage error of ``--require`` values with these options: an unknown level, or a level
    that these arguments can never run on any file (exit 2, before anything is read)."""
    for n in names:
        if n not in LEVELS:
            return f"--require takes {', '.join(LEVELS)} (or a comma list of them), not {n!r}"
    need = required_levels(names)
    if "model" in need and not model:
        return f"--require {need[-1]} needs --model M.gguf: without a model no file is checked past structure"
    if "deep" in need and not deep:
        return "--require deep needs --deep: without it no file is recomputed"
    return None
