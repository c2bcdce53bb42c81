"""Seed corpora for the fuzz harnesses, built from the fixtures at run time (nothing large is
committed): every slot/session fixture of every state version (v2 legacy without n_stream,
v3, v4 (the fixtures a real v4 libllama wrote, fixtures/slots/v4), GGSN 9 with outputs and without n_stream, GGSN 10, 11
header), with SCKP and SDFT, and GGUF metadata.

Minimised: a seed over ``MAX_LEN`` bytes is replaced by files written with
:mod:`slotfile.format.synth` of the same shape (type, V layout, checkpoints, draft state) but 2-4
cells of 2 layers of 8-32 elements, and GGUF seeds keep only their metadata (tensor count 0,
cut where the tensor infos began).
"""

from __future__ import annotations

import struct
import tempfile
from pathlib import Path

import numpy as np

from slotfile.format.reader import open_slot_file
from slotfile.format.records import SlotFile
from slotfile.format.synth import SynthSpec, write_slot
from slotfile.model import gguf as gguf_meta

ROOT = Path(__file__).resolve().parents[2]
SLOTS = ROOT / "fixtures" / "slots"
MODELS = ROOT / "fixtures" / "models"
MAX_LEN = 16384  # libFuzzer -max_len of the slot harnesses (bench/fuzz_atheris.py)
GGUF_MAX_LEN = 65536

SYNTH = {
    "synth-f16-fa": SynthSpec(n_cells=3, n_layer=2, n_embd_k=16, n_embd_v=16, n_vocab=100),
    "synth-f16-nofa": SynthSpec(n_cells=3, n_layer=2, n_embd_k=16, n_embd_v=16, v_trans=True, n_vocab=100),
    "synth-q8_0-sckp": SynthSpec(
        n_cells=4, n_layer=2, n_embd_k=32, n_embd_v=32, type_k="q8_0", type_v="q8_0", checkpoints=2, n_vocab=100
    ),
    "synth-f16-sckp-sdft": SynthSpec(
        n_cells=4, n_layer=2, n_embd_k=8, n_embd_v=8, v_trans=True, checkpoints=2, draft_layers=1, n_vocab=100
    ),
    "synth-f32-sdft": SynthSpec(
        n_cells=2, n_layer=1, n_embd_k=8, n_embd_v=8, type_k="f32", type_v="f32", draft_layers=2, n_vocab=100
    ),
}


def _with_version(data: bytes, v: int) -> bytes:
    return data[:4] + struct.pack("<I", v) + data[8:]


def _legacy_body(path: Path) -> bytes | None:
    """The file with its body as llama.cpp wrote it before mid-2025 (no n_stream word,
    single-sequence cells without seq ids), as tests/test_versions.py builds it."""
    src = open_slot_file(path)
    data = path.read_bytes()
    if src.body is None or src.errors:
        return None
    out = b""
    for blk in src.body.blocks:
        if blk.kind != "KV" or len(blk.raw.streams) != 1:
            return None
        (st,) = blk.raw.streams
        d = st.data
        if d is None or d.meta is None:
            return None
        cells = b"".join(struct.pack("<iI", int(p), 0) for p in d.meta.cells["pos"])
        if src.format == "GGSN":
            cells = bytes(d.meta.raw)
        out += struct.pack("<I", st.cell_count) + cells + data[d.v_trans_offset : blk.raw.end]
    if src.format == "GGSN":  # v9 also wrote (empty) outputs, logits and embeddings after the arch
        return _v9_outputs(src, data[: src.body.offset]) + out + data[src.body.end :]
    return data[: src.body.offset] + out + data[src.body.end :]


def _v9_outputs(src: SlotFile, head: bytes) -> bytes:
    arch = next(s for s in src.sections if s.name == "arch")
    at = arch.offset + arch.size
    return head[:at] + struct.pack("<IQQ", 0, 0, 0) + head[at:]


def _synth() -> dict[str, bytes]:
    out = {}
    with tempfile.TemporaryDirectory() as d:
        for name, spec in SYNTH.items():
            p = Path(d) / name
            write_slot(p, spec)
            out[name] = p.read_bytes()
    return out


def slot_seeds() -> dict[str, bytes]:
    """name -> bytes: every fixture of at most MAX_LEN bytes, their legacy (v2 / GGSN 9) and
    other-version variants, and the synth seeds standing in for the bigger ones."""
    out = _synth()
    paths = sorted(p for p in SLOTS.rglob("*") if p.suffix in (".slot", ".session", ".bin") and p.is_file())
    for p in paths:
        name = str(p.relative_to(SLOTS)).replace("/", "_")
        data = p.read_bytes()
        if len(data) <= MAX_LEN:
            out[name] = data
        fmt = {b"qsgg": "GGSQ", b"nsgg": "GGSN"}.get(data[:4])
        current = data[4:8] in (struct.pack("<I", 3), struct.pack("<I", 10))  # the legacy rewrite reads v3 bodies
        legacy = _legacy_body(p) if len(data) <= MAX_LEN and current else None
        if legacy is not None:
            out[f"{name}.legacy-v{2 if fmt == 'GGSQ' else 9}"] = _with_version(legacy, 2 if fmt == "GGSQ" else 9)
    return out


def _gguf_metadata_only(path: Path) -> bytes | None:
    data = bytearray(path.read_bytes())
    data[8:16] = struct.pack("<Q", 0)  # no tensors: only the key/value pairs are kept
    with tempfile.NamedTemporaryFile(suffix=".gguf") as f:
        f.write(data)
        f.flush()
        try:
            end = gguf_meta.scan(f.name).data_offset
        except gguf_meta.GGUFError:
            return None
    cut = bytes(data[:end])
    return cut if len(cut) <= GGUF_MAX_LEN else None


def _gguf_written() -> dict[str, bytes]:
    """Small GGUFs written with gguf.GGUFWriter: a llama-like one with a vocabulary and one
    tensor, a recurrent one with per-layer arrays."""
    import gguf

    out = {}
    with tempfile.TemporaryDirectory() as d:
        for name, arch in (("written-llama", "llama"), ("written-jamba", "jamba")):
            p = Path(d) / f"{name}.gguf"
            w = gguf.GGUFWriter(str(p), arch)
            w.add_block_count(2)
            w.add_context_length(64)
            w.add_embedding_length(16)
            w.add_head_count(2)
            w.add_head_count_kv([1, 2] if arch == "jamba" else 1)
            w.add_tokenizer_model("gpt2")
            w.add_token_list(["<s>", "a", "Ġb", "Ċ", "\u00e9"])
            w.add_token_types([3, 1, 1, 1, 1])
            w.add_add_bos_token(True)
            w.add_tensor("token_embd.weight", np.zeros((5, 16), np.float32))
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
            w.close()
            out[name] = p.read_bytes()
    return out


def gguf_seeds() -> dict[str, bytes]:
    out = _gguf_written()
    for p in sorted(MODELS.glob("*.gguf")):
        cut = _gguf_metadata_only(p)
        if cut is not None:
            out[p.name] = cut
    return out


def appendix_seeds(slots: dict[str, bytes]) -> dict[str, bytes]:
    """For the appendix walkers: a 2-byte start offset, then the bytes from the end of the
    body on (SCKP and SDFT appendices), cut to MAX_LEN."""
    from slotfile.format.reader import parse_buffer

    out = {}
    for name, data in slots.items():
        sf = parse_buffer(data)
        if sf.body is None or (sf.sckp is None and sf.draft is None):
            continue
        tail = data[sf.body.end :][: MAX_LEN - 2]
        out[name] = b"\0\0" + tail
    return out


def corpora() -> dict[str, dict[str, bytes]]:
    """harness name -> seed name -> bytes."""
    slots = slot_seeds()
    return {
        "parse": slots,
        "dump_json": slots,
        "inspect": slots,
        "repair": slots,
        "slot": slots,
        "gguf": gguf_seeds(),
        "appendix": appendix_seeds(slots),
        "manifest": _manifest_seeds(),
    }


def _manifest_seeds() -> dict[str, bytes]:
    from tests.fuzz.manifest_harness import manifest_seeds

    return manifest_seeds()
