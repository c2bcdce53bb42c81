"""Write large valid slot files with slotfile's own grammars (benchmarks, scale tests).

The layout is that of a real llama-server save: GGSQ header, packed tokens, one KV block
(one stream), optional SCKP checkpoints (PARTIAL_ONLY blobs of a plain KV cache hold the whole
cache up to the checkpoint) and an optional SDFT draft state.  The data is random bytes
(finite f16/f32 or valid q8_0 blocks) shared between layers, and is streamed to disk by
construct's ``build_stream``: nothing proportional to the file is held in memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from construct import Struct

from slotfile.format import grammar as g
from slotfile.format.types import BY_NAME

# the variant synth writes: state version 3 slot files (no cell ext, no rotation words)
_V3 = g.SlotGrammar.of()


@dataclass(frozen=True)
class SynthSpec:
    n_cells: int = 4096
    n_layer: int = 32
    n_embd_k: int = 8 * 128  # n_head_kv x head_dim of a 7-8B-class model
    n_embd_v: int = 8 * 128
    type_k: str = "f16"
    type_v: str = "f16"
    v_trans: bool = False
    checkpoints: int = 0  # each at an even fraction of the cells
    draft_layers: int = 0  # a draft model's state in SDFT (0: none)
    n_vocab: int = 32000
    seed: int = 0


def _random_rows(type_name: str, n_bytes: int, rng: np.random.Generator) -> bytes:
    t = BY_NAME[type_name]
    if type_name == "f16":
        return rng.standard_normal(n_bytes // 2, dtype=np.float32).astype("<f2").tobytes()
    if type_name == "f32":
        return rng.standard_normal(n_bytes // 4, dtype=np.float32).tobytes()
    # quantized: random bytes, with each block's leading f16 scale(s) made finite
    blocks = np.frombuffer(bytearray(rng.integers(0, 256, n_bytes, dtype=np.uint8).tobytes()), np.uint8)
    blocks = blocks.reshape(-1, t.type_size)
    blocks[:, 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return blocks.tobytes()


def _cells(n: int, start: int = 0) -> g.CellTable:
    cells = np.zeros(n, g.kv_cell_dtype(0))
    cells["pos"] = np.arange(start, start + n)
    cells["n_seq_id"] = 1
    return g.CellTable(0, cells, cells["seq_id"], cells.tobytes())


def kv_block_obj(spec: SynthSpec, n_cells: int, n_layer: int, pool: dict[str, bytes]) -> dict[str, Any]:
    """The construct object of one single-stream KV block; rows are views of shared data."""
    tk, tv = BY_NAME[spec.type_k], BY_NAME[spec.type_v]
    k_row, v_row = tk.row_size(spec.n_embd_k), tv.row_size(spec.n_embd_v)

    def run(key: str, n: int) -> g.Run:
        return g.Run(0, n, memoryview(pool[key])[:n])

    k = [{"type": tk.id, "row_size": k_row, "data": run("k", n_cells * k_row)} for _ in range(n_layer)]
    if spec.v_trans:
        v = [
            {
                "type": tv.id,
                "el_size": tv.type_size,
                "n_embd": spec.n_embd_v,
                "data": run("v", n_cells * spec.n_embd_v * tv.type_size),
            }
            for _ in range(n_layer)
        ]
    else:
        v = [{"type": tv.id, "row_size": v_row, "data": run("v", n_cells * v_row)} for _ in range(n_layer)]
    data = {"meta": _cells(n_cells), "v_trans": int(spec.v_trans), "n_layer": n_layer, "k": k, "v": v}
    return {"n_stream": 1, "streams": [{"cell_count": n_cells, "data": data if n_cells else None}]}


def _pool(spec: SynthSpec, rng: np.random.Generator) -> dict[str, bytes]:
    tk, tv = BY_NAME[spec.type_k], BY_NAME[spec.type_v]
    return {
        "k": _random_rows(spec.type_k, spec.n_cells * tk.row_size(spec.n_embd_k), rng),
        "v": _random_rows(spec.type_v, spec.n_cells * tv.row_size(spec.n_embd_v), rng),
    }


class _Sink:
    """A write-only stream that only counts: the grammar itself says how long a blob is."""

    def __init__(self) -> None:
        self.n = 0

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        self.n += n
        return n

    def tell(self) -> int:
        return self.n

    def flush(self) -> None:
        pass


# the fixed fields of a checkpoint entry (n_tokens, pos_min, pos_max) and of a blob (length),
# taken from the project's own grammars so the streamed appendices cannot drift from them
_CKPT_HEAD = Struct(
    *[c for c in g.CheckpointEntry.subcons if getattr(c, "name", None) in ("n_tokens", "pos_min", "pos_max")]
)
_BLOB_LEN = next(c for c in g.Blob.subcons if getattr(c, "name", None) == "length")
_EMPTY_BLOB = {"length": 0, "data": b""}


def _write_blob(f: BinaryIO, spec: SynthSpec, n_cells: int, n_layer: int, pool: dict[str, bytes]) -> int:
    """Stream one ``u64 length`` + sequence blob (io_magic, seq_id 0, one KV block) to ``f``;
    the length is found by building the block into a counting sink first, so no blob is ever
    held in memory (a checkpoint of a plain KV cache is as large as the cache it covers)."""
    obj = kv_block_obj(spec, n_cells, n_layer, pool)
    prefix = g.SeqBlobPrefix.build({"io_magic": g.IO_MAGIC, "seq_id": 0})
    sink = _Sink()
    _V3.build_kv(obj, sink)
    length = len(prefix) + sink.n
    f.write(_BLOB_LEN.build(length))
    f.write(prefix)
    _V3.build_kv(obj, f)
    return length


def write_slot(path: str | Path, spec: SynthSpec) -> int:
    """Write the file; returns its size."""
    rng = np.random.default_rng(spec.seed)
    pool = _pool(spec, rng)
    tokens = rng.integers(0, spec.n_vocab, spec.n_cells, dtype=np.int32)
    with open(path, "wb") as f:
        _write(f, spec, pool, tokens)
        return f.tell()


def _write(f: BinaryIO, spec: SynthSpec, pool: dict[str, bytes], tokens: np.ndarray) -> None:
    n = spec.n_cells
    payload = {
        "marker": -1,
        "version": 1,
        "n_tokens": n,
        "tokens": tokens,
        "n_media": 0,
        "media_keys": np.empty(0, "<u4"),
        "media": [],
        "padding": b"",
    }
    words = (16 + 4 * n) // 4
    f.write(g.FileHeader.build({"magic": g.GGSQ_MAGIC, "version": 3, "n_token_count": words}))
    g.PackedTokens.build_stream(payload, f)
    _V3.build_kv(kv_block_obj(spec, n, spec.n_layer, pool), f)
    if spec.checkpoints:
        g.SckpHeader.build_stream({"version": 1, "count": spec.checkpoints}, f)
        for i in range(spec.checkpoints):
            c = n * (i + 1) // (spec.checkpoints + 1)
            f.write(_CKPT_HEAD.build({"n_tokens": c, "pos_min": 0, "pos_max": max(c - 1, 0)}))
            _write_blob(f, spec, c, spec.n_layer, pool)  # data_tgt
            g.Blob.build_stream(_EMPTY_BLOB, f)  # data_dft
            g.Blob.build_stream(_EMPTY_BLOB, f)  # data_spec
    if spec.draft_layers:
        g.SdftHeader.build_stream({"version": 1}, f)
        _write_blob(f, spec, n, spec.draft_layers, pool)  # data_dft
        g.Blob.build_stream(_EMPTY_BLOB, f)  # data_spec
