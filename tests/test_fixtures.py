"""The committed fixtures are exactly what the generators write today.

Models, manifests and every structural byte of the slot files (headers, tokens, cell
metadata, type ids, row sizes, lengths, appendix framing) must be byte-identical.  The K/V/R/S
values are float results of llama.cpp's CPU kernels, whose SIMD path is fixed at compile
time: on a CPU with the same features as the one that generated the fixtures (recorded in
``fixtures/slots/generated-on.txt``) they must be byte-identical too; on another CPU they
must agree to within float rounding (the last bits of an f16), and the test says so.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

from slotfile.format.reader import open_slot_file, parse_buffer
from slotfile.verify.stats import dequant_rows

from .conftest import FIXTURES

GENERATED_ON = "slots/generated-on.txt"
# f16 carries 11 significant bits: rounding differences stay near 2^-11 of the largest value
VALUE_RTOL = 4e-3


def _value_mismatch(committed: Path, got: bytes) -> str | None:
    """None when every differing byte lies inside a value run and the values agree within
    VALUE_RTOL of the run's largest magnitude; otherwise the first disagreement."""
    want = committed.read_bytes()
    if len(got) != len(want):
        return f"size {len(got)} vs {len(want)}"
    a, b = np.frombuffer(got, np.uint8), np.frombuffer(want, np.uint8)
    diff = np.flatnonzero(a != b)
    ref = open_slot_file(committed)
    inside = np.zeros(len(b), bool)
    for _, run in ref.value_runs():
        inside[run.data.offset : run.data.offset + run.data.length] = True
    outside = diff[~inside[diff]]
    if outside.size:
        return f"structural byte differs at offset {int(outside[0])}"
    # same structure: the regenerated file has the same runs, compared as values
    for (section, y), (_, x) in zip(ref.value_runs(), parse_buffer(got).value_runs(), strict=False):
        lo, hi = y.data.offset, y.data.offset + y.data.length
        if np.array_equal(a[lo:hi], b[lo:hi]):
            continue
        xv, yv = dequant_rows(x, 0, x.n_cells), dequant_rows(y, 0, y.n_cells)
        err = float(np.abs(xv - yv).max()) / max(float(np.abs(yv).max()), 1e-30)
        if not err <= VALUE_RTOL:
            return f"{section} {y.part}[{y.index}] at offset {lo}: relative error {err:.2e}"
    return None


def _compare(out: Path, names: list[str]) -> None:
    assert names, "the generator wrote nothing"
    here = (out / GENERATED_ON).read_text() if (out / GENERATED_ON).exists() else None
    committed_on = (FIXTURES / GENERATED_ON).read_text()
    strict = here is None or here == committed_on
    loose: list[str] = []
    for rel in names:
        if rel == GENERATED_ON:
            continue
        got = (out / rel).read_bytes()
        want_path = FIXTURES / rel
        assert want_path.exists(), f"{rel} is written by the generator but not committed"
        if got == want_path.read_bytes():
            continue
        if strict or not rel.endswith((".slot", ".session")):
            pytest.fail(
                f"{rel} differs from the committed fixture ({len(got)} vs "
                f"{want_path.stat().st_size} bytes); committed and regenerated on {committed_on.strip()}"
            )
        why = _value_mismatch(want_path, got)
        assert why is None, f"{rel}: {why}"
        loose.append(rel)
    if loose:
        warnings.warn(  # noqa: B028 - the test's own frame is the right one
            f"{len(loose)} fixtures match in structure, with K/V values equal within float rounding: "
            f"they were generated on [{committed_on.strip()}], this CPU is [{(here or '').strip()}]"
        )


def _written(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())


@pytest.mark.llama
@pytest.mark.parametrize("module", ["make_fixtures", "make_extra_fixtures"])
def test_regenerated_fixtures_are_byte_identical(module, tmp_path):
    mod = __import__(f"fixtures.{module}", fromlist=["build_all"])
    mod.build_all(tmp_path)
    if module == "make_extra_fixtures":  # the CPU record is written by make_fixtures
        import fixtures.make_fixtures as base

        (tmp_path / "slots" / "generated-on.txt").write_text(base.cpu_signature() + "\n")
    _compare(tmp_path, _written(tmp_path))


def test_value_check_catches_a_changed_value(tmp_path):
    """The tolerant path is not a blanket pass: a changed K value fails it."""
    src = FIXTURES / "slots" / "llama_f16_fa.slot"
    sf = open_slot_file(src)
    run = next(r for _, r in sf.value_runs() if r.type_id == 1)
    off = run.data.offset
    del sf
    data = bytearray(src.read_bytes())
    data[off : off + 2] = np.float16(1000.0).tobytes()
    assert "relative error" in (_value_mismatch(src, bytes(data)) or "")
    data = bytearray(src.read_bytes())
    data[8] ^= 1  # the header's token word count
    assert "structural" in (_value_mismatch(src, bytes(data)) or "")


def _one_ulp_off(tmp_path: Path, cpu: str) -> Path:
    """A generator output dir holding one fixture with one K value one f16 step off."""
    rel = "slots/llama_f16_fa.slot"
    sf = open_slot_file(FIXTURES / rel)
    run = next(r for _, r in sf.value_runs() if r.type_id == 1)
    off = run.data.offset
    del sf
    data = bytearray((FIXTURES / rel).read_bytes())
    data[off : off + 2] = (np.frombuffer(bytes(data[off : off + 2]), "<u2") ^ 1).astype("<u2").tobytes()
    (tmp_path / "slots").mkdir()
    (tmp_path / rel).write_bytes(bytes(data))
    (tmp_path / GENERATED_ON).write_text(cpu)
    return tmp_path


def test_same_cpu_demands_byte_identity(tmp_path):
    out = _one_ulp_off(tmp_path, (FIXTURES / GENERATED_ON).read_text())
    with pytest.raises(pytest.fail.Exception, match="differs from the committed fixture"):
        _compare(out, [GENERATED_ON, "slots/llama_f16_fa.slot"])


def test_another_cpu_allows_float_rounding_only(tmp_path):
    out = _one_ulp_off(tmp_path, "another CPU\n")
    with pytest.warns(UserWarning, match="within float rounding"):
        _compare(out, [GENERATED_ON, "slots/llama_f16_fa.slot"])
