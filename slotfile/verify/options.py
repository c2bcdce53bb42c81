"""What one ``slotfile verify`` run is asked to do (the CLI builds it from the options)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

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
    jobs: int = 1
    timeout: float = 300.0
    scan: bool = False  # structure level also checks every K/V/R/S value is finite
    llama_lib: str | None = None  # a folder holding libllama.so for the workers (--llama-lib)
    n_batch: int = 0  # the deep recompute's n_batch / n_ubatch (0: llama-server's 2048 / 512)
    n_ubatch: int = 0
    # change the derived load settings before each load (tests mirror a given server with it)
    settings_hook: Callable[[SlotFile, LoadSettings], LoadSettings] | None = None
