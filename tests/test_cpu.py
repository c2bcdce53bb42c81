"""slotfile.llama.cpu: the AMX check that keeps llama.cpp's AMX kernels (which segfault on Gemma 3
270M's Q4_K weights, llama-cpp-python 0.3.36) out of slotfile's recomputes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from slotfile.llama import cpu

XEON = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f amx_bf16 avx512_fp16 amx_tile amx_int8\n"
EPYC = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512vl\n"


def test_amx_is_read_from_the_flags_line(tmp_path: Path) -> None:
    for name, text, want in (("xeon", XEON, True), ("epyc", EPYC, False), ("none", "processor\t: 0\n", False)):
        p = tmp_path / name
        p.write_text(text)
        assert cpu.has_amx(str(p)) is want, name
    assert cpu.has_amx(str(tmp_path / "missing")) is False


def test_extra_buffer_types_go_off_only_on_an_amx_cpu(monkeypatch) -> None:
    for amx in (True, False):
        monkeypatch.setattr(cpu, "has_amx", lambda amx=amx: amx)
        p = cpu.use_extra_bufts(SimpleNamespace(use_extra_bufts=True, n_gpu_layers=0))
        assert p.use_extra_bufts is (not amx) and p.n_gpu_layers == 0
    # a library whose llama_model_params has no such field (before 2025) is left as it is
    monkeypatch.setattr(cpu, "has_amx", lambda: True)
    old = cpu.use_extra_bufts(SimpleNamespace(n_gpu_layers=0))
    assert not hasattr(old, "use_extra_bufts")
