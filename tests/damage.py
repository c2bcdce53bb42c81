"""Damaged copies of real fixture slot files, built byte by byte for the loader and verify tests.

Every builder takes the bytes of a fixture and returns new bytes; offsets come from the
reader's parse of the intact file (so the damage lands exactly where it is meant to).  Each
entry of :data:`CORPUS` says what ``slotfile verify --model --deep`` must conclude: the verdict,
the level that fails first and ``level_reached``.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from slotfile.format.reader import parse_buffer

from .conftest import MODELS, SLOTS

BASE = SLOTS / "llama_f16_fa.slot"  # f16 K/V, flash attention on (v_trans 0), 2 checkpoints, no draft


def _sf(data: bytes, tmp: Path):
    """The reader's view of ``data`` (``tmp`` is unused: the bytes are parsed in memory)."""
    return parse_buffer(data)


def _kv_stream(sf):
    blk = sf.body.blocks[0]
    return blk.active_streams()[0]


def swap_kv_layer0(data: bytes, tmp: Path) -> bytes:
    """Exchange the K and V rows of layer 0 (same type and row size: the headers still match)."""
    st = _kv_stream(_sf(data, tmp))
    k, v = st.k[0].data, st.v[0].data
    assert k.length == v.length
    b = bytearray(data)
    kb, vb = bytes(b[k.offset : k.offset + k.length]), bytes(b[v.offset : v.offset + v.length])
    b[k.offset : k.offset + k.length] = vb
    b[v.offset : v.offset + v.length] = kb
    return bytes(b)


def zero_v_row(data: bytes, tmp: Path, layer: int = 1, cell: int = 10) -> bytes:
    """One cell's V row of one layer set to zero bytes."""
    st = _kv_stream(_sf(data, tmp))
    v = st.v[layer]
    off = v.data.offset + cell * v.row_size
    b = bytearray(data)
    b[off : off + v.row_size] = bytes(v.row_size)
    return bytes(b)


def scale_k_layer(data: bytes, tmp: Path, layer: int = 1, factor: float = 1.5) -> bytes:
    """Every K value of one layer multiplied by ``factor`` (f16): plausible-looking, wrong."""
    st = _kv_stream(_sf(data, tmp))
    k = st.k[layer]
    vals = np.frombuffer(data, dtype="<f2", count=k.data.length // 2, offset=k.data.offset).astype(np.float32)
    b = bytearray(data)
    b[k.data.offset : k.data.offset + k.data.length] = (vals * factor).astype("<f2").tobytes()
    return bytes(b)


def change_token(data: bytes, tmp: Path, index: int = 20, new: int = 101) -> bytes:
    """One token id of the packed payload replaced; the KV is untouched."""
    sf = _sf(data, tmp)
    assert sf.tokens.form == "packed" and int(sf.tokens.tokens[index]) != new
    off = sf.tokens.offset + 12 + 4 * index
    b = bytearray(data)
    b[off : off + 4] = struct.pack("<i", new)
    return bytes(b)


def corrupt_sckp_count(data: bytes, tmp: Path) -> bytes:
    sf = _sf(data, tmp)
    off = sf.sckp.offset + 8
    b = bytearray(data)
    b[off : off + 4] = struct.pack("<I", 0xFFFFFFFF)
    return bytes(b)


def ckpt_blob_plus_one(data: bytes, tmp: Path, index: int = 0) -> bytes:
    """Checkpoint ``index``'s len_tgt one larger, with one byte inserted at the blob's end, so
    that the SCKP walk stays consistent: the server would accept the appendix and then abort in
    common_prompt_checkpoint::load_tgt (consumed size != blob size)."""
    sf = _sf(data, tmp)
    tgt = sf.checkpoints[index].tgt
    b = bytearray(data)
    b[tgt.offset : tgt.offset + 8] = struct.pack("<Q", tgt.length + 1)
    end = tgt.data_offset + tgt.length
    return bytes(b[:end]) + b"\0" + bytes(b[end:])


def truncate_body(data: bytes, tmp: Path) -> bytes:
    sf = _sf(data, tmp)
    return data[: (sf.body.offset + sf.body.end) // 2]


def version_4(data: bytes, tmp: Path) -> bytes:
    """The same state as version 4 (the rotation words inserted by slotfile migrate)."""
    from slotfile.repair import RepairOptions, run
    from slotfile.safewrite import resolve_target

    src, out = tmp / "v3-in.slot", tmp / "v4-out.slot"
    src.write_bytes(data)
    out.unlink(missing_ok=True)
    run("migrate", str(src), resolve_target(src, out), RepairOptions(to_version=4))
    return out.read_bytes()


def recurrent_two_cells(data: bytes, tmp: Path) -> bytes:
    """For extra-mamba.slot: the REC block claims two cells (pos - 1 and pos), rows doubled.

    llama.cpp's single-sequence recurrent restore puts one sequence in one cell, then asserts
    that the last restored cell holds the last position:
    ``GGML_ASSERT(cells[head].pos == ubatch.pos[0])`` in llama-memory-recurrent.cpp fails and
    the process aborts (SIGABRT) whenever the context has room for 2 cells (n_seq_max >= 2,
    llama-server's default is 4)."""
    sf = _sf(data, tmp)
    blk = sf.body.blocks[0]
    assert blk.kind == "REC" and blk.cell_count == 1
    pos = int(blk.cells.cells["pos"][0])
    out = bytearray(data[: sf.body.offset])
    out += struct.pack("<I", 2) + struct.pack("<iI", pos - 1, 0) + struct.pack("<iI", pos, 0)
    out += struct.pack("<II", 0, blk.n_layer)
    for run in blk.r + blk.s:
        rows = bytes(run.data.array(np.uint8))
        out += struct.pack("<iQ", run.type_id, run.row_size) + rows * 2
    return bytes(out) + data[sf.body.end :]


@dataclass(frozen=True)
class Damage:
    name: str
    build: Callable[[bytes, Path], bytes]
    verdict: str
    first_fail: str | None  # the first level that fails
    level_reached: int
    base: Path = BASE
    model: str = "llama.gguf"
    codes: tuple[str, ...] = ()  # problem codes that must appear (in first_fail's level)


CORPUS: tuple[Damage, ...] = (
    Damage("kv-swapped-layer0", swap_kv_layer0, "fail", "deep", 3, codes=("deep-mismatch",)),
    Damage("v-row-zeroed", zero_v_row, "fail", "deep", 3, codes=("deep-mismatch",)),
    Damage("k-layer1-scaled", scale_k_layer, "fail", "deep", 3, codes=("deep-mismatch",)),
    Damage("token-changed", change_token, "fail", "deep", 3, codes=("deep-mismatch",)),
    Damage("sckp-count-corrupt", corrupt_sckp_count, "fail", "structure", 0, codes=("over-cap",)),
    Damage("checkpoint-len-plus-one", ckpt_blob_plus_one, "fail", "structure", 0),
    Damage("body-truncated", truncate_body, "fail", "structure", 0, codes=("truncated",)),
    # another state version than the installed loader's: the load cannot be checked here (skipped, not failed)
    Damage("version-4", version_4, "pass", None, 2),
    Damage(
        "recurrent-two-cells",
        recurrent_two_cells,
        "fail",
        "structure",
        0,
        base=SLOTS / "extra-mamba.slot",
        model="extra-mamba.gguf",
    ),
)


def build(d: Damage, tmp: Path) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    out = tmp / f"{d.name}.slot"
    out.write_bytes(d.build(d.base.read_bytes(), tmp))
    return out


def other_seed_llama(path: Path) -> Path:
    """A second llama-shaped GGUF, same geometry and vocabulary, different weights."""
    from fixtures import models

    models._write(path, replace(models.LLAMA, seed=1234), "slotfile-tiny-llama-other")
    return path


__all__ = ["BASE", "CORPUS", "MODELS", "Damage", "build", "other_seed_llama"]
