"""The committed fixtures are exactly what the generators write today."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import FIXTURES


def _compare(out: Path, names: list[str]) -> None:
    assert names, "the generator wrote nothing"
    for rel in names:
        got = (out / rel).read_bytes()
        want = (FIXTURES / rel).read_bytes()
        assert got == want, f"{rel} differs from the committed fixture ({len(got)} vs {len(want)} bytes)"


def _written(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())


@pytest.mark.parametrize("module", ["make_fixtures", "make_extra_fixtures"])
def test_regenerated_fixtures_are_byte_identical(module, tmp_path):
    mod = __import__(f"fixtures.{module}", fromlist=["build_all"])
    mod.build_all(tmp_path)
    _compare(tmp_path, _written(tmp_path))
