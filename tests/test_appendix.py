"""The appendix walker (slotfile/format/appendix.py): the framing of SCKP and SDFT, where a walk
stops and why, and the server's reading the llama.cpp worker needs."""

from __future__ import annotations

import struct
import subprocess
import sys

import pytest

from slotfile.format import appendix as ap
from slotfile.format import grammar as g
from slotfile.format.layout import Failure
from slotfile.format.reader import open_slot_file

from .conftest import MANIFEST, SLOTS

WITH_APPENDIX = [e for e in MANIFEST["slots"] if e["sckp"] or e["sdft"]]


def _variants(e: dict) -> list[tuple[str, bytes]]:
    """The tail after the body: intact, cut at many points, and with fields set to hostile values."""
    data = (SLOTS.parent / e["file"]).read_bytes()[e["body_end"] :]
    out = [("intact", data)]
    out += [
        (f"cut{n}", data[:n])
        for n in sorted({0, 1, 3, 4, 7, 8, 11, 12, 13, 20, 27, 28, 40, 100, 4000, len(data) // 2, len(data) - 1})
    ]
    for off in range(4, min(len(data), 64), 4):
        for v in (0, 1, 0xFFFFFFFF):
            d = bytearray(data)
            d[off : off + 4] = struct.pack("<I", v)
            out.append((f"u32@{off}={v}", bytes(d)))
    for c in (e["sckp"] or {}).get("checkpoints", []):
        for name in ("tgt", "dft", "spec"):
            at = c[f"{name}_offset"] - 8 - e["body_end"]
            for v in (0, 1 << 40):
                d = bytearray(data)
                d[at : at + 8] = struct.pack("<Q", v)
                out.append((f"ck{c['n_tokens']}.{name}={v}", bytes(d)))
    return out


def _reference_walk(data: bytes, off: int) -> tuple[list[tuple[bytes, bytes]] | None, str, bytes | None, str]:
    """An independent oracle: the worker's own struct-based reading of the appendices, as it
    was before the walker replaced it (the server's load_slot_checkpoints, byte by byte).

        Returns (checkpoints as (data_tgt, data_dft) or None, SCKP note, SDFT data_dft or None,
        SDFT note).  Any SCKP damage drops the whole appendix, as load_slot_checkpoints does.
    """
    end = len(data)
    ckpts: list[tuple[bytes, bytes]] | None = None
    sckp_note = ""
    if off + 4 <= end and struct.unpack_from("<I", data, off)[0] == 0x504B4353:
        p = off + 4
        if p + 8 > end:
            sckp_note = "SCKP header truncated: the server ignores the appendix"
            return [], sckp_note, None, ""
        version, count = struct.unpack_from("<II", data, p)
        p += 8
        if version != 1:
            return [], f"SCKP version {version}: the server ignores the appendix", None, ""
        if count > g.MAX_CHECKPOINTS:
            return [], f"SCKP count {count} over {g.MAX_CHECKPOINTS}: the server drops the appendix", None, ""
        items: list[tuple[bytes, bytes]] = []
        for i in range(count):
            if p + 16 > end:
                return [], f"checkpoint {i} of {count} truncated: the server drops the whole appendix", None, ""
            p += 16  # n_tokens, pos_min, pos_max
            blobs = []
            for _name in ("data_tgt", "data_dft", "data_spec"):
                if p + 8 > end:
                    return [], f"checkpoint {i} of {count} truncated: the server drops the whole appendix", None, ""
                n = struct.unpack_from("<Q", data, p)[0]
                p += 8
                if n > end - p:
                    return (
                        [],
                        (
                            f"checkpoint {i} of {count}: {_name} length {n} exceeds the {end - p} bytes left: "
                            "the server drops the whole appendix"
                        ),
                        None,
                        "",
                    )
                blobs.append(data[p : p + n])
                p += n
            if not blobs[0]:
                return [], f"checkpoint {i} has an empty data_tgt: the server drops the whole appendix", None, ""
            items.append((blobs[0], blobs[1]))
        ckpts = items
        off = p
    dft: bytes | None = None
    sdft_note = ""
    if off + 4 <= end and struct.unpack_from("<I", data, off)[0] == 0x54464453:
        p = off + 4
        try:
            version = struct.unpack_from("<I", data, p)[0]
            p += 4
            if version != 1:
                sdft_note = f"SDFT version {version}: the draft state is dropped"
            else:
                n = struct.unpack_from("<Q", data, p)[0]
                p += 8
                if n > end - p:
                    sdft_note = f"SDFT data_dft length {n} exceeds the {end - p} bytes left: the draft state is dropped"
                else:
                    dft = data[p : p + n]
        except struct.error:
            sdft_note = "SDFT header truncated: the draft state is dropped"
    return ckpts, sckp_note, dft, sdft_note


def _bytes(x):
    return None if x is None else bytes(x)


@pytest.mark.parametrize("e", WITH_APPENDIX, ids=lambda e: e["file"].split("/")[-1])
def test_server_read_is_the_workers_reading(e):
    """server_read (what the worker calls) gives exactly what the independent oracle gives."""
    for label, data in _variants(e):
        want = _reference_walk(memoryview(data), 0)
        got = ap.server_read(memoryview(data), 0).astuple()
        w_ck = None if want[0] is None else [(bytes(t), bytes(d)) for t, d in want[0]]
        g_ck = None if got[0] is None else [(bytes(t), bytes(d)) for t, d in got[0]]
        assert (g_ck, got[1], _bytes(got[2]), got[3]) == (w_ck, want[1], _bytes(want[2]), want[3]), label


@pytest.mark.parametrize("e", WITH_APPENDIX, ids=lambda e: e["file"].split("/")[-1])
def test_frames_are_the_readers(e):
    path = SLOTS.parent / e["file"]
    sf = open_slot_file(path)
    view = memoryview(path.read_bytes())
    off = e["body_end"]
    if e["sckp"]:
        h = ap.sckp_head(view, off)
        assert isinstance(h, ap.SckpHead) and h.magic_ok and (h.version, h.count) == (1, e["sckp"]["count"])
        items = list(ap.entries(view, h.end, count=h.count))
        stop = items.pop()
        assert isinstance(stop, ap.Stop) and stop.why == "count" and stop.failure is None
        assert [
            (i.offset, i.end, i.n_tokens, i.tgt.offset, i.tgt.length, i.dft.length, i.spec.length) for i in items
        ] == [
            (c.offset, c.end, c.n_tokens, c.tgt.offset, c.tgt.length, c.dft.length, c.spec.length)
            for c in sf.checkpoints
        ]
        for i in items:
            assert ap.blob_seq_id(view, i.tgt.data_offset, i.tgt.end) == sf.checkpoints[i.index].tgt.seq_id
        off = stop.offset
    if e["sdft"]:
        assert ap.magic_at(view, off) == g.SDFT_MAGIC
        h = ap.sdft_head(view, off)
        b = ap.sdft_body(view, h)
        assert isinstance(b, ap.SdftFrame) and (b.offset, b.end) == (sf.draft.offset, sf.draft.end)


def test_entry_walk_stops_and_why():
    e = next(x for x in MANIFEST["slots"] if x["file"].endswith("llama_draft_sdft.slot"))
    data = (SLOTS.parent / e["file"]).read_bytes()
    start = e["sckp"]["offset"] + 12
    ck = e["sckp"]["checkpoints"]
    # without a count: every entry, then the SDFT magic
    items = list(ap.entries(memoryview(data), start, stop_at_sdft=True))
    assert len(items) == len(ck) + 1 and items[-1].why == "sdft" and items[-1].offset == e["sdft"]["offset"]
    # the same bytes cut inside checkpoint 1's data_tgt: a declared length past the end
    cut = ck[1]["tgt_offset"] + 10
    stop = list(ap.entries(memoryview(data[:cut]), start))[-1]
    assert stop.why == "damaged" and stop.index == 1 and stop.blob == "data_tgt"
    assert stop.declared == ck[1]["len_tgt"] and stop.left == 10 and stop.cut_n_tokens == ck[1]["n_tokens"]
    assert stop.failure.code == "truncated" and stop.failure.loc == "checkpoint[1].data_tgt"
    # cut inside a length field: no declared length
    stop = list(ap.entries(memoryview(data[: ck[1]["tgt_offset"] - 3]), start))[-1]
    assert stop.why == "damaged" and stop.blob == "data_tgt" and stop.declared is None
    # cut inside the entry head
    stop = list(ap.entries(memoryview(data[: ck[1]["offset"] + 5]), start))[-1]
    assert stop.why == "damaged" and stop.blob == "" and stop.cut_n_tokens is None
    # a magic cut short
    assert ap.cut_magics(b"SD", 0) == (g.SDFT_MAGIC,) and ap.cut_magics(b"S", 0) == (g.SCKP_MAGIC, g.SDFT_MAGIC)
    assert ap.starts_with(b"SCK", 0, g.SCKP_MAGIC) and not ap.starts_with(b"", 0, g.SCKP_MAGIC)


def test_a_huge_count_or_length_allocates_nothing():
    head = g.sckp_header(0xFFFFFFFF)
    entry = g.checkpoint_head(5, 0, 4) + g.blob_length(2**64 - 1)
    items = list(ap.entries(memoryview(head + entry), 12, count=0xFFFFFFFF))
    assert len(items) == 1 and items[0].why == "damaged" and items[0].declared == 2**64 - 1
    assert isinstance(ap.blob_seq_id(b"\0" * 8, 0, 8), Failure)
    assert ap.blob_seq_id(struct.pack("<Ii", g.IO_MAGIC, 3), 0, 8) == 3


def test_build_side_matches_the_layout():
    """The framing pieces a repair writes, against the byte layout (slot-format.md §3, §4, §8, §9)."""
    assert g.sckp_header(3) == b"SCKP" + struct.pack("<II", 1, 3)
    assert g.checkpoint_head(-2, 7, 9) == struct.pack("<qii", -2, 7, 9)
    assert g.blob_length(2**40) == struct.pack("<Q", 2**40)
    assert g.sdft_header() == b"SDFT" + struct.pack("<I", 1)
    assert g.file_header(g.GGSQ_MAGIC, 3, 7) == struct.pack("<III", g.GGSQ_MAGIC, 3, 7)
    assert g.plain_tokens([-1, 1, 5]) == struct.pack("<iii", -1, 1, 5) and g.plain_tokens([]) == b""
    assert g.v_trans_word(1) == struct.pack("<I", 1)
    assert g.kv_layer_head(1, 256) == struct.pack("<iQ", 1, 256)
    assert g.kv_layer_t_head(1, 2, 128) == struct.pack("<iII", 1, 2, 128)


def test_walker_imports_cheaply():
    code = (
        "import sys, slotfile.format.appendix; "
        "bad = [m for m in ('slotfile.format.reader', 'slotfile.model.expect', 'slotfile.model.bridge', 'slotfile.repair', 'gguf', "
        "'rich', 'typer') if m in sys.modules]; assert not bad, bad"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
