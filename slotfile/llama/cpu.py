"""What the CPU that runs llama.cpp has, where that changes how slotfile must call llama.cpp.

**AMX.**  On a CPU with Intel AMX (Sapphire Rapids and later: ``amx_tile``/``amx_int8`` in
``/proc/cpuinfo``), a llama.cpp built with ``GGML_NATIVE=ON`` (llama-cpp-python's default
``pip install`` build, llama-server's) puts quantized weights (Q4_0, Q4_K, Q8_0, ...) into the AMX
extra buffer type, and the first prefill of Gemma 3 270M Q4_K_M segfaults in
``ggml_backend_amx_mul_mat`` (ggml-cpu/amx/mmq.cpp; llama-cpp-python 0.3.36, measured on a Xeon with
AMX, 2026-12-06).  Loading the model with ``llama_model_params.use_extra_bufts = false`` keeps the
weights in plain CPU buffers (the ggml-cpu kernels of the CPU's ISA), which is what llama-server's
``--no-repack`` does.  slotfile only recomputes a state to compare it, within its noise floors, so
it does not need the repacked kernels; it keeps them wherever the CPU has no AMX.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

__all__ = ["AMX_FLAGS", "has_amx", "use_extra_bufts"]

AMX_FLAGS = frozenset({"amx_tile", "amx_int8", "amx_bf16"})


@functools.cache
def has_amx(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether the CPU reports any AMX feature (False where ``cpuinfo`` cannot be read)."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            return not AMX_FLAGS.isdisjoint(line.partition(":")[2].split())
    return False


def use_extra_bufts(params: Any) -> Any:
    """``params`` (a ``llama_model_params``) with the extra buffer types off on an AMX CPU (see the
    module doc); unchanged elsewhere, and for a library whose struct has no such field."""
    if has_amx() and hasattr(params, "use_extra_bufts"):
        params.use_extra_bufts = False
    return params
