"""A version-2 (legacy) body reads the same whatever was read before it.

A version-2 KV block may or may not carry ``n_stream`` (grammar.kv_block_legacy), and for some
bodies both readings fit: only the full layout search, which ranks both, tells them apart.
The per-size layout cache may therefore not hand a version-2 body a layout cached for a body
of another size (layout._other_size): in the full suite a cached version-2 layout once made a
copy of a version-3 file whose version word alone was set to 2 read differently from a cold
parse, and ``diff`` call the two files different (ffa872f).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest

from slotfile.format import layout, layout_cache

from .conftest import SLOTS
from .test_scale import _verdict

V2 = sorted((SLOTS / "v2").glob("*.slot"))
V3 = sorted(SLOTS.glob("*.slot"))


def _as_version_2(path: Path) -> bytes:
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, 4, 2)  # the state version word after the GGSQ magic
    return bytes(data)


def _cold(data: bytes) -> tuple[object, ...]:
    layout_cache.SHAPES.clear()
    return _verdict(data)


@pytest.mark.parametrize("path", V3, ids=lambda p: p.name)
def test_a_version_word_copy_reads_as_cold_after_every_v2_file(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A version-3 file rewritten to say version 2, read after each real version-2 fixture
    (each caching its own layout and size): the verdict of an empty cache, and the other-size
    path is never asked for a legacy body
    (checkpoint blobs, which never lacked ``n_stream``, may take it)."""
    data = _as_version_2(path)
    want = _cold(data)
    asked: list[Any] = []
    real = layout._other_size

    def spy(*a: Any, **k: Any) -> Any:
        if a[6][6]:  # the cache key's legacy flag: a body that may lack n_stream (blobs never do)
            asked.append(a[1:3])
        return real(*a, **k)

    monkeypatch.setattr(layout, "_other_size", spy)
    for prime in V2:
        layout_cache.SHAPES.clear()
        _verdict(prime.read_bytes())
        asked.clear()
        assert _verdict(data) == want, f"{path.name} as version 2, read after v2/{prime.name}"
        assert not asked, f"{path.name} as version 2 took the other-size path after v2/{prime.name}"


def test_every_v2_fixture_reads_as_cold_after_all_the_others() -> None:
    """The version-2 fixtures read in a row (each size new, the cache warm with the others)."""
    cold = {p: _cold(p.read_bytes()) for p in V2}
    layout_cache.SHAPES.clear()
    for p in [*V2, *reversed(V2)]:
        assert _verdict(p.read_bytes()) == cold[p], f"v2/{p.name} read after other v2 files"
