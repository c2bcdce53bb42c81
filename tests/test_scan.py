"""The full data scan finds every kind of non-finite value at its exact offset."""

from __future__ import annotations

import struct

import pytest

from slotfile.format.reader import open_slot_file, parse_buffer
from slotfile.format.scan import scan

from .conftest import SLOT_FILES, SLOTS, slotfile_cli


@pytest.mark.parametrize("path", SLOT_FILES, ids=lambda p: p.name)
def test_fixtures_are_finite(path):
    sf = open_slot_file(path)
    found, scanned, unchecked = scan(sf)
    assert found == [] and unchecked == []
    # every value run was covered, and a file with tokens has values: an empty scan cannot pass
    assert scanned == sum(r.data.length for _, r in sf.value_runs())
    assert (scanned > 0) == (sf.n_tokens > 0), (scanned, sf.n_tokens)


def _poke(path, pick, value: bytes):
    sf = open_slot_file(path)
    run = pick(sf)
    el = len(value)  # an element's size: keep the poke on an element boundary
    off = run.data.offset + (run.data.length * 2 // 3) // el * el
    data = bytearray(path.read_bytes())
    data[off : off + len(value)] = value
    return parse_buffer(bytes(data)), off


@pytest.mark.parametrize(
    "name,pick,value",
    [
        ("llama_f16_fa.slot", lambda sf: sf.body.blocks[0].streams[0].v[1], struct.pack("<H", 0x7E00)),  # f16 NaN
        (
            "llama_f16_nofa.slot",
            lambda sf: sf.body.blocks[0].streams[0].v[0],
            struct.pack("<H", 0xFC00),
        ),  # -inf, transposed V
        ("extra-mamba.slot", lambda sf: sf.body.blocks[0].s[1], struct.pack("<f", float("nan"))),  # f32 state
        (
            "gemma3_iswa_fa.slot",
            lambda sf: sf.checkpoints[1].tgt.body.blocks[0].streams[0].k[0],
            struct.pack("<H", 0x7C00),
        ),
    ],
)
def test_non_finite_values_are_found(name, pick, value):
    sf, off = _poke(SLOTS / name, pick, value)
    found, _, _ = scan(sf)
    assert [f.offset for f in found] == [off]


def test_quantized_block_scale():
    path = SLOTS / "llama_q8_0_fa.slot"
    sf = open_slot_file(path)
    run = sf.body.blocks[0].streams[0].k[1]
    off = run.data.offset + 34 * 5  # the d of the sixth block
    data = bytearray(path.read_bytes())
    data[off : off + 2] = struct.pack("<H", 0x7C00)
    found, _, unchecked = scan(parse_buffer(bytes(data)))
    assert [f.offset for f in found] == [off] and unchecked == []


def test_verify_scan_fails_a_nan(tmp_path):
    import json

    sf, off = _poke(
        SLOTS / "llama_f16_fa.slot", lambda sf: sf.body.blocks[0].streams[0].k[0], struct.pack("<H", 0x7E00)
    )
    bad = tmp_path / "nan.slot"
    bad.write_bytes(bytes(sf.buffer))
    r = slotfile_cli("verify", bad, "--scan", "--json")
    assert r.exit_code == 4
    (f,) = json.loads(r.stdout)["files"]
    (p,) = f["levels"]["structure"]["problems"]
    assert p["code"] == "non-finite" and p["offset"] == off
