"""truncate-recover, strip-draft and re-save on the real fixtures.

Every output is checked byte-wise against what the manifests say it must be, re-read with
no errors, test-loaded through llama.cpp with the fixture models (the body, every checkpoint
blob, and the draft state with the draft model), and repaired again to show that a repair of
a repaired file changes nothing.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from slotfile.cli.repair_cmd import exit_code
from slotfile.format.reader import open_slot_file
from slotfile.repair import RepairOptions, run
from slotfile.safewrite import resolve_target
from slotfile.verify import Verifier, VerifyOptions

from .conftest import EXTRA, FIXTURES, MANIFEST, MODELS, SLOTS

DRAFT = MODELS / "draft.gguf"


# ------------------------------------------------------------------------------- fixtures


@dataclass(frozen=True)
class Ck:
    offset: int
    n_tokens: int
    tgt: tuple[int, int]  # (data offset, length)
    dft: tuple[int, int]
    spec: tuple[int, int]

    @property
    def end(self) -> int:
        return self.spec[0] + self.spec[1]


def _ck(offset: int, n_tokens: int, tgt_off: int, len_tgt: int, len_dft: int, len_spec: int) -> Ck:
    dft_off = tgt_off + len_tgt + 8
    spec_off = dft_off + len_dft + 8
    return Ck(offset, n_tokens, (tgt_off, len_tgt), (dft_off, len_dft), (spec_off, len_spec))


@dataclass(frozen=True)
class Fx:
    name: str
    path: Path
    model: Path
    draft: Path | None
    body_start: int
    body_end: int
    size: int
    sckp: int | None  # offset
    count: int
    ckpts: tuple[Ck, ...]
    sdft: tuple[int, int] | None  # (offset, end)
    sdft_dft: tuple[int, int] | None = None  # (data offset, length)

    @property
    def data(self) -> bytes:
        return self.path.read_bytes()


def _fixtures() -> dict[str, Fx]:
    out: dict[str, Fx] = {}
    for e in MANIFEST["slots"]:
        name = Path(e["file"]).stem
        sk = e["sckp"]
        cks = tuple(
            _ck(c["offset"], c["n_tokens"], c["tgt_offset"], c["len_tgt"], c["len_dft"], c["len_spec"])
            for c in (sk or {}).get("checkpoints", [])
        )
        sd = e["sdft"]
        out[name] = Fx(
            name,
            FIXTURES / e["file"],
            FIXTURES / e["model"],
            FIXTURES / e["draft_model"] if e["draft_model"] else None,
            e["body_start"],
            e["body_end"],
            e["file_size"],
            sk["offset"] if sk else None,
            sk["count"] if sk else 0,
            cks,
            (sd["offset"], sd["offset"] + sd["length"]) if sd else None,
            (sd["dft_offset"], sd["len_dft"]) if sd else None,
        )
    for e in EXTRA["files"]:
        if e["kind"] != "slot":
            continue
        name = Path(e["file"]).stem
        app = next((a for a in e["appendix"] if a["type"] == "SCKP"), None)
        cks = tuple(
            _ck(c["offset"], c["n_tokens"], c["tgt_offset"], c["len_tgt"], c["len_dft"], c["len_spec"])
            for c in (app or {}).get("checkpoints", [])
        )
        out[name] = Fx(
            name,
            FIXTURES / e["file"],
            FIXTURES / e["model"],
            None,
            e["body_offset"],
            e["body_end"],
            e["size"],
            app["offset"] if app else None,
            app["count"] if app else 0,
            cks,
            None,
        )
    return out


FX = _fixtures()
SWEEP = [
    "llama_f16_fa",
    "llama_q8_0_fa",
    "llama_2stream",
    "llama_draft_sdft",
    "llama_draft_sdft_only",
    "llama_sckp_empty",
    "gemma3_iswa_nofa",
    "gemma3_iswa_fa",
    "extra-mamba",
    "extra-lfm2",
    "extra-jamba",
    "extra-qwen2vl",
    "extra-deepseek2",
]


def sckp_header(count: int) -> bytes:
    return b"SCKP" + struct.pack("<II", 1, count)


@pytest.fixture(scope="module")
def pools():
    """``slotfile verify`` (its Verifier: structure, model metadata, a real test-load of the
    body, every checkpoint blob and, with the draft model, the draft state), one per model."""
    cache: dict[tuple[str, str | None], Verifier] = {}

    def get(model: Path, draft: Path | None = None) -> Verifier:
        key = (str(model), str(draft) if draft else None)
        if key not in cache:
            cache[key] = Verifier(VerifyOptions(model=key[0], draft_model=key[1]))
        return cache[key]

    yield get
    for v in cache.values():
        v.close()


def assert_loads(verifier: Verifier, path: Path, n_ckpts: int | None = None, draft: bool = False) -> None:
    rep = verifier.verify(path)
    doc = rep.to_dict()
    assert rep.verdict == "pass", json.dumps(doc, indent=1)[:3000]
    load = doc["levels"]["load"]
    assert load["status"] == "pass" and not load["problems"], load["problems"]  # no warnings either
    assert all(ok for ok, _ in load["details"]["checkpoints"])
    if n_ckpts is not None:
        assert len(load["details"]["checkpoints"]) == n_ckpts
    if draft:
        d = load["details"]["draft"]
        assert d is None or d[0], d
        assert all(ok for ok, _ in load["details"]["checkpoint_drafts"])


def repair(cmd: str, inp: Path, out: Path, **kw: Any):
    return run(cmd, str(inp), resolve_target(inp, out, force=True), RepairOptions(**kw))


def assert_idempotent(cmd: str, path: Path, tmp: Path, **kw: Any) -> None:
    again = tmp / f"again-{path.name}"
    r = repair(cmd, path, again, **kw)
    assert exit_code(r) == 0, r.reason
    assert again.read_bytes() == path.read_bytes(), f"{cmd} on its own output changed it"
    assert r.status == "nothing-to-do", r.status


def assert_clean(path: Path) -> None:
    sf = open_slot_file(path)
    assert sf.errors == [], [p.line() for p in sf.errors]


# ------------------------------------------------------------------------------- truncate-recover: appendix cuts


def cut_points(fx: Fx) -> list[int]:
    b = fx.body_end
    pts = {b, b + 1, b + 3, b + 4, b + 11}
    for c in fx.ckpts:
        pts |= {
            c.offset,
            c.offset + 3,
            c.offset + 16,
            c.tgt[0] - 4,
            c.tgt[0] + 1,
            c.tgt[0] + c.tgt[1] // 2,
            c.tgt[0] + c.tgt[1],
            c.end - 1,
        }
        if c.dft[1]:
            pts |= {c.dft[0] + 2, c.dft[0] + c.dft[1] // 2}
        if c.spec[1]:
            pts |= {c.spec[0] - 3, c.spec[0] + 7}
        pts.add(c.end)
    if fx.sdft:
        s, e = fx.sdft
        d_off, d_len = fx.sdft_dft or (s + 16, 0)
        pts |= {s, s + 2, s + 7, s + 12, d_off + 3, d_off + d_len // 2, d_off + d_len + 4, e - 1, e}
    return sorted(p for p in pts if fx.body_end <= p <= fx.size)


def expected_after_cut(fx: Fx, data: bytes, cut: int) -> bytes:
    out = data[: fx.body_end]
    done = [c for c in fx.ckpts if c.end <= cut]
    if done:
        out += sckp_header(len(done)) + data[done[0].offset : done[-1].end]
    elif fx.sckp is not None and fx.count == 0 and cut >= fx.sckp + 12:
        out += data[fx.sckp : fx.sckp + 12]
    if fx.sdft and cut >= fx.sdft[1]:
        out += data[fx.sdft[0] : fx.sdft[1]]
    return out


@pytest.mark.llama
@pytest.mark.parametrize("name", SWEEP)
def test_truncate_recover_appendix_cuts(name, tmp_path, pools):
    """Cuts inside the SCKP header, inside every checkpoint (entry header, each blob, each
    length field) and inside the SDFT: every complete checkpoint is kept verbatim, the count
    is rewritten, a complete SDFT is kept, a cut one dropped."""
    fx = FX[name]
    data = fx.data
    pool = pools(fx.model, fx.draft)
    outs = []
    for cut in cut_points(fx):
        src = tmp_path / f"cut{cut}.slot"
        src.write_bytes(data[:cut])
        out = tmp_path / f"out{cut}.slot"
        r = repair("truncate-recover", src, out)
        assert exit_code(r) == 0, (cut, r.reason)
        want = expected_after_cut(fx, data, cut)
        got = out.read_bytes()
        assert got == want, f"cut at {cut}: {len(got)} bytes, expected {len(want)}"
        assert r.output_size == len(want) and r.input_size == cut
        # the report accounts for every input byte: kept + dropped regions tile the input
        spans = sorted(
            [(k["offset"], k["bytes"]) for k in r.kept]
            + [(d["offset"], d["bytes"]) for d in r.dropped if ".data_" not in d["section"]]
        )
        pos = 0
        for off, n in spans:
            assert off == pos, (cut, spans)
            pos = off + n
        assert pos == cut, (cut, spans)
        assert (r.status == "nothing-to-do") == (want == data[:cut])
        assert_clean(out)
        outs.append(out)
    for out in outs:  # one worker per model: every output, body + checkpoints (+ draft)
        assert_loads(pool, out, draft=fx.draft is not None)
    # idempotence, on a few outputs (the sweep above already saw every shape)
    for out in outs[:: max(1, len(outs) // 4)]:
        assert_idempotent("truncate-recover", out, tmp_path)


@pytest.mark.llama
def test_truncate_recover_with_model_test_loads(tmp_path):
    fx = FX["llama_draft_sdft"]
    src = tmp_path / "cut.slot"
    src.write_bytes(fx.data[: fx.ckpts[2].dft[0] + 10])
    r = repair("truncate-recover", src, tmp_path / "o.slot", model=str(fx.model), draft_model=str(DRAFT))
    assert exit_code(r) == 0 and r.status == "repaired", r.reason
    assert r.test_load and r.test_load["ok"] and len(r.test_load["checkpoints"]) == 2
    assert [k.get("n_tokens") for k in r.kept if k["section"].startswith("sckp.checkpoint")] == [8, 20]
    assert r.changed == [{"section": "sckp", "field": "count", "from": 3, "to": 2}]


# ------------------------------------------------------------------------------- truncate-recover: damaged SCKP and SDFT


def _damage(fx: Fx, tmp: Path, edits: list[tuple[int, bytes]], extra: bytes = b"") -> Path:
    d = bytearray(fx.data)
    for off, b in edits:
        d[off : off + len(b)] = b
    p = tmp / "damaged.slot"
    p.write_bytes(bytes(d) + extra)
    return p


def _u32(v: int) -> bytes:
    return struct.pack("<I", v)


def _u64(v: int) -> bytes:
    return struct.pack("<Q", v)


D = FX["llama_draft_sdft"]
C = D.ckpts
SD = D.sdft
assert SD is not None and D.sckp is not None


DAMAGE: dict[str, tuple[list[tuple[int, bytes]], bytes, Any]] = {
    # SCKP count: the entries are walked whatever the count says; the count is rewritten
    "count-max": ([(D.sckp + 8, _u32(0xFFFFFFFF))], b"", lambda d: d),
    "count-low": ([(D.sckp + 8, _u32(1))], b"", lambda d: d),
    "count-high": ([(D.sckp + 8, _u32(7))], b"", lambda d: d),
    "count-zero": ([(D.sckp + 8, _u32(0))], b"", lambda d: d),
    "magic": ([(D.sckp, b"SCKQ")], b"", lambda d: d),
    # a length that runs past EOF: checkpoint 0 stays, the SDFT is found again by a scan
    "len-tgt-huge": (
        [(C[1].tgt[0] - 8, _u64(2**64 - 1))],
        b"",
        lambda d: d[: D.body_end] + sckp_header(1) + d[C[0].offset : C[0].end] + d[SD[0] : SD[1]],
    ),
    "len-spec-huge": (
        [(C[2].spec[0] - 8, _u64(1 << 40))],
        b"",
        lambda d: d[: D.body_end] + sckp_header(2) + d[C[0].offset : C[1].end] + d[SD[0] : SD[1]],
    ),
    # a blob that no longer parses: that checkpoint alone goes, the later ones stay
    "tgt-magic": (
        [(C[1].tgt[0], _u32(0x12345678))],
        b"",
        lambda d: d[: D.body_end] + sckp_header(2) + d[C[0].offset : C[0].end] + d[C[2].offset : SD[1]],
    ),
    "tgt-cells": (
        [(C[0].tgt[0] + 8, _u32(3))],
        b"",  # n_stream 3 in a 1-stream blob
        lambda d: d[: D.body_end] + sckp_header(2) + d[C[1].offset : SD[1]],
    ),
    "bad-positions": (
        [(C[0].offset + 8, struct.pack("<ii", 9, 2))],
        b"",
        lambda d: d[: D.body_end] + sckp_header(2) + d[C[1].offset : SD[1]],
    ),
    # a damaged data_dft: the checkpoint stays with len_dft 0
    "dft-magic": (
        [(C[1].dft[0], _u32(0))],
        b"",
        lambda d: d[: D.body_end] + d[D.sckp : C[1].dft[0] - 8] + _u64(0) + d[C[1].spec[0] - 8 : SD[1]],
    ),
    # SCKP version unknown: the appendix goes, the SDFT after it stays
    "sckp-version": ([(D.sckp + 4, _u32(9))], b"", lambda d: d[: D.body_end] + d[SD[0] : SD[1]]),
    # damaged SDFT
    "sdft-version": ([(SD[0] + 4, _u32(7))], b"", lambda d: d[: SD[0]]),
    "sdft-len-huge": ([(SD[0] + 8, _u64(1 << 50))], b"", lambda d: d[: SD[0]]),
    "sdft-dft-magic": ([(SD[0] + 16, _u32(1))], b"", lambda d: d[: SD[0]]),
    "sdft-spec-len": ([(SD[1] - 132 - 8, _u64(500))], b"", lambda d: d[: SD[0]]),
    # trailing garbage after the last section
    "trailing": ([], b"garbage after the draft appendix", lambda d: d),
    "trailing-sckp": ([], sckp_header(1), lambda d: d),  # a second SCKP header: not an appendix
}


@pytest.mark.llama
@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_truncate_recover_damaged_appendix(case, tmp_path, pools):
    edits, extra, expect = DAMAGE[case]
    src = _damage(D, tmp_path, edits, extra)
    assert open_slot_file(src).errors  # every case reads as damaged before the repair
    out = tmp_path / "out.slot"
    r = repair("truncate-recover", src, out)
    assert exit_code(r) == 0, r.reason
    want = expect(D.data)
    assert out.read_bytes() == want, f"{case}: {out.stat().st_size} bytes, expected {len(want)}; {r.dropped}"
    assert_clean(out)
    assert_loads(pools(D.model, DRAFT), out, draft=True)
    assert_idempotent("truncate-recover", out, tmp_path)
    if case.startswith("count-") and case != "count-low":
        assert {
            "section": "sckp",
            "field": "count",
            "from": struct.unpack_from("<I", src.read_bytes(), D.sckp + 8)[0],
            "to": 3,
        } in r.changed


@pytest.mark.llama
def test_trailing_garbage_after_a_bare_body(tmp_path, pools):
    fx = FX["llama_unified_2seq"]
    src = _damage(fx, tmp_path, [], b"not an appendix")
    r = repair("truncate-recover", src, tmp_path / "o.slot")
    assert exit_code(r) == 0 and (tmp_path / "o.slot").read_bytes() == fx.data
    assert r.dropped == [
        {"section": "trailing", "offset": fx.size, "bytes": 15, "reason": "bytes after the last complete section"}
    ]
    assert_loads(pools(fx.model), tmp_path / "o.slot")


@pytest.mark.llama
@pytest.mark.parametrize("name,pad", [("llama_unified_2seq", 13), ("extra-jamba", 4096)])
def test_zero_padding(name, pad, tmp_path, pools):
    """Zeros after the last section (a crash after the file was extended).  After a bare KV
    body they read like a cut KV+REC body: the reader alone cannot tell, so without the model
    the repair refuses; with it, llama.cpp's loader shows where the body ends."""
    fx = FX[name]
    src = _damage(fx, tmp_path, [], b"\0" * pad)
    out = tmp_path / "o.slot"
    r = repair("truncate-recover", src, out)
    if fx.sckp is None:
        assert exit_code(r) == 4 and not out.exists()
        r = repair("truncate-recover", src, out, model=str(fx.model))
        assert any("llama.cpp restores the body" in n for n in r.notes)
    assert exit_code(r) == 0, r.reason
    assert out.read_bytes() == fx.data
    assert r.dropped == [
        {"section": "trailing", "offset": fx.size, "bytes": pad, "reason": "bytes after the last complete section"}
    ]
    assert_loads(pools(fx.model), out)


# ------------------------------------------------------------------------------- truncate-recover: rebuilding a body


def assert_close_state(got: Path, ref: Path) -> None:
    """Same layout, sizes, positions, and K/V/R/S values equal within f16 rounding."""
    a, b = open_slot_file(got), open_slot_file(ref)
    assert a.errors == []
    assert a.body.layout == b.body.layout and a.body.size == b.body.size
    for x, y in zip(a.body.blocks, b.body.blocks, strict=False):
        assert (x.kind, x.n_stream, x.size, x.n_cells()) == (y.kind, y.n_stream, y.size, y.n_cells())
        assert np.array_equal(x.positions(), y.positions())
        for rx, ry in zip(x.runs(), y.runs(), strict=False):
            assert (rx.part, rx.index, rx.type_id, rx.row_size, rx.n_cells) == (
                ry.part,
                ry.index,
                ry.type_id,
                ry.row_size,
                ry.n_cells,
            )
            if rx.type_id in (0, 1):
                u, v = rx.array().astype(np.float32), ry.array().astype(np.float32)
                assert np.allclose(u, v, rtol=2e-2, atol=2e-2), (rx.part, rx.index, float(np.abs(u - v).max()))


SETTINGS = {"flash_attn": True, "type_k": "f16", "type_v": "f16"}
REBUILD = [
    # (fixture, cut (None: corrupt in place instead), edits, expected checkpoint n_tokens, options)
    ("llama_f16_fa", 244 + 100, [], [], SETTINGS),  # inside the cell table: the settings must be given
    ("llama_f16_fa", 5000, [], [], {}),  # inside K: V type assumed = K type (noted)
    ("llama_f16_fa", 9000, [], [], {}),  # inside V: every setting still shows
    ("llama_f16_fa", 14779, [], [], {}),  # the last byte of the body
    ("llama_q8_0_fa", 6000, [], [], {}),
    ("llama_2stream", 10000, [], [], {}),  # slot 1 of a 2-stream cache
    ("llama_unified_2seq", 7000, [], [], {}),  # slot 1 of a unified cache
    ("llama_plain_tokens", 3000, [], [], {}),  # the old plain token payload
    ("gemma3_iswa_nofa", 5000, [], [41], {}),  # iSWA: one checkpoint near the end (none known)
    ("gemma3_iswa_fa", None, [(300, _u32(0xFFFFFFFF))], [5, 21], {}),  # damaged cell: checkpoints at 5, 21
    ("extra-mamba", 3000, [], [21], {}),  # recurrent
    ("extra-jamba", 4000, [], [21], {}),  # hybrid, cut inside the REC block
    ("extra-lfm2", 1000, [], [21], {}),
    ("extra-qwen2vl", 2000, [], [], {}),  # M-RoPE cells with a 12-byte ext
]


@pytest.mark.llama
@pytest.mark.parametrize("name,cut,edits,n_ck,opts", REBUILD, ids=[f"{r[0]}@{r[1]}" for r in REBUILD])
def test_truncate_recover_rebuilds_a_cut_body(name, cut, edits, n_ck, opts, tmp_path, pools):
    fx = FX[name]
    data = fx.data
    src = tmp_path / "in.slot"
    if cut is None:
        src = _damage(fx, tmp_path, edits)
    else:
        src.write_bytes(data[:cut])
    out = tmp_path / "out.slot"
    # without the model: refused, with a one-line reason, nothing written
    r = repair("truncate-recover", src, out)
    assert exit_code(r) == 4 and r.status == "refused" and "--model" in r.reason and "\n" not in r.reason
    assert not out.exists()
    if opts:  # the damaged file no longer shows its settings: refused until they are given
        r = repair("truncate-recover", src, out, model=str(fx.model))
        assert exit_code(r) == 4 and "--flash-attn" in r.reason and not out.exists()
    r = repair("truncate-recover", src, out, model=str(fx.model), **opts)
    assert exit_code(r) == 0, r.reason
    assert r.test_load and r.test_load["ok"]
    got = out.read_bytes()
    assert got[: fx.body_start] == data[: fx.body_start]  # header and tokens verbatim
    body = next(x for x in r.rebuilt if x["section"] == "body")
    assert body["bytes"] == fx.body_end - fx.body_start and body["tokens"] == open_slot_file(fx.path).n_tokens
    cks = open_slot_file(out).checkpoints
    assert [c.n_tokens for c in cks] == n_ck
    # rebuilt checkpoints at the file's own n_tokens are the same shape as the originals
    orig = {c.n_tokens: c for c in fx.ckpts}
    for c in cks:
        if c.n_tokens in orig:
            assert c.tgt.length == orig[c.n_tokens].tgt[1]
    ref = tmp_path / "ref.slot"
    ref.write_bytes(data[: fx.body_end])
    assert_close_state(out, ref)
    assert_loads(pools(fx.model), out, n_ckpts=len(n_ck))
    assert_idempotent("truncate-recover", out, tmp_path)


@pytest.mark.llama
def test_rebuild_keeps_draft_state_found_after_a_damaged_body(tmp_path, pools):
    """The body is damaged in place; the SCKP and SDFT behind it are found by a scan: the
    checkpoints are rebuilt at their n_tokens with their data_dft/data_spec carried over,
    and the SDFT is kept verbatim."""
    fx = D
    src = _damage(fx, tmp_path, [(fx.body_start + 8 + 4, _u32(7))])  # cell 0: n_seq_id 7
    out = tmp_path / "out.slot"
    r = repair("truncate-recover", src, out, model=str(fx.model), draft_model=str(DRAFT))
    assert exit_code(r) == 0, r.reason
    sf = open_slot_file(out)
    assert [c.n_tokens for c in sf.checkpoints] == [8, 20, 32]
    data = fx.data
    for c, o in zip(sf.checkpoints, fx.ckpts, strict=False):
        assert bytes(c.dft.data.view) == data[o.dft[0] : o.dft[0] + o.dft[1]]
        assert bytes(c.spec.data.view) == data[o.spec[0] : o.spec[0] + o.spec[1]]
        assert c.tgt.length == o.tgt[1]
    assert out.read_bytes()[sf.draft.offset :] == data[SD[0] : SD[1]]
    assert r.test_load["draft"][0] and all(ok for ok, _ in r.test_load["checkpoint_drafts"])
    assert any("carried over" in x["how"] for x in r.rebuilt)
    assert_loads(pools(fx.model, DRAFT), out, n_ckpts=3, draft=True)


@pytest.mark.llama
def test_rebuild_checkpoint_positions_and_model_mismatch(tmp_path):
    fx = FX["extra-mamba"]
    src = tmp_path / "in.slot"
    src.write_bytes(fx.data[:2000])
    out = tmp_path / "out.slot"
    r = repair("truncate-recover", src, out, model=str(fx.model), checkpoint_at=[10, 19])
    assert exit_code(r) == 0, r.reason
    sf = open_slot_file(out)
    assert [c.n_tokens for c in sf.checkpoints] == [10, 19]
    assert [c.tgt.length for c in sf.checkpoints] == [c.tgt[1] for c in fx.ckpts]
    for c, o in zip(sf.checkpoints, fx.ckpts, strict=False):  # the same recurrent state as the server's checkpoints
        x = c.tgt.body.blocks[0]
        y = open_slot_file(fx.path).checkpoints[fx.ckpts.index(o)].tgt.body.blocks[0]
        for rx, ry in zip(x.runs(), y.runs(), strict=False):
            assert np.allclose(rx.array(), ry.array(), rtol=2e-2, atol=2e-2)
    # the wrong model: the rebuilt state would not have the file's shape; refused, nothing written
    cut = tmp_path / "llama.slot"
    cut.write_bytes(FX["llama_f16_fa"].data[:9000])
    r = repair("truncate-recover", cut, tmp_path / "x.slot", model=str(MODELS / "gemma3.gguf"))
    assert exit_code(r) == 4 and "does not match" in r.reason and not (tmp_path / "x.slot").exists()


@pytest.mark.llama
def test_parseable_body_that_does_not_load_is_rebuilt(tmp_path):
    """A K type id no llama.cpp accepts parses (an unknown type is only a warning), but the
    test-load refuses it: the second attempt rebuilds the body from the tokens."""
    fx = FX["llama_f16_fa"]
    src = _damage(fx, tmp_path, [(fx.body_start + 8 + 54 * 12 + 8, _u32(77))])
    r = repair("truncate-recover", src, tmp_path / "o.slot", model=str(fx.model))
    assert exit_code(r) == 0, r.reason
    assert any(n.startswith("first attempt") for n in r.notes)
    assert [c.n_tokens for c in open_slot_file(tmp_path / "o.slot").checkpoints] == [16, 32]
    assert_close_state(tmp_path / "o.slot", fx.path)


# ------------------------------------------------------------------------------- strip-draft


@pytest.mark.llama
@pytest.mark.parametrize("name", ["llama_draft_sdft", "llama_draft_sdft_only"])
def test_strip_draft(name, tmp_path, pools):
    fx = FX[name]
    data = fx.data
    out = tmp_path / "out.slot"
    r = repair("strip-draft", fx.path, out)
    assert exit_code(r) == 0 and r.status == "repaired", r.reason
    want = data[: fx.body_end]
    if fx.sckp is not None:
        want += data[fx.sckp : fx.sckp + 12]
        for c in fx.ckpts:
            want += data[c.offset : c.tgt[0] + c.tgt[1]] + _u64(0) + _u64(0)
    got = out.read_bytes()
    assert got == want
    assert got[: fx.body_end] == data[: fx.body_end]  # the target state, byte-identical
    saved = sum(c.dft[1] + c.spec[1] for c in fx.ckpts) + (fx.sdft[1] - fx.sdft[0] if fx.sdft else 0)
    assert r.bytes_saved == saved == len(data) - len(got)
    sf = open_slot_file(out)
    assert sf.errors == [] and sf.draft is None and all(c.dft.length == c.spec.length == 0 for c in sf.checkpoints)
    assert_loads(pools(fx.model), out, n_ckpts=len(fx.ckpts))
    assert_idempotent("strip-draft", out, tmp_path)


def test_strip_draft_nothing_to_do_and_damaged(tmp_path):
    fx = FX["llama_f16_fa"]
    r = repair("strip-draft", fx.path, tmp_path / "o.slot")
    assert r.status == "nothing-to-do" and (tmp_path / "o.slot").read_bytes() == fx.data
    cut = tmp_path / "cut.slot"
    cut.write_bytes(fx.data[:20000])
    r = repair("strip-draft", cut, tmp_path / "p.slot")
    assert exit_code(r) == 4 and "truncate-recover" in r.reason and not (tmp_path / "p.slot").exists()
    for cmd in ("truncate-recover", "strip-draft"):  # session files are not slot files
        r = repair(cmd, SLOTS / "extra-llama.session", tmp_path / "s.slot")
        assert exit_code(r) == 4 and "GGSN" in r.reason and not (tmp_path / "s.slot").exists()


# ------------------------------------------------------------------------------- re-save


def _v_runs(path: Path) -> list[Any]:
    sf = open_slot_file(path)
    return [r for b in sf.body.blocks for s in b.active_streams() for r in s.v]


@pytest.mark.llama
def test_resave_unchanged_is_byte_identical(tmp_path):
    fx = FX["llama_draft_sdft"]
    r = repair("re-save", fx.path, tmp_path / "o.slot", model=str(fx.model), draft_model=str(DRAFT))
    assert exit_code(r) == 0, r.reason
    assert (tmp_path / "o.slot").read_bytes() == fx.data and r.status == "nothing-to-do"


@pytest.mark.llama
def test_resave_flash_attn_flip(tmp_path, pools):
    """FA on -> off rewrites V transposed (the same values), in the body and in every
    checkpoint blob; the result loads with flash attention off and flips back to the
    original byte for byte."""
    fx, ref = FX["llama_f16_fa"], FX["llama_f16_nofa"]
    off = tmp_path / "off.slot"
    r = repair("re-save", fx.path, off, model=str(fx.model), flash_attn=False)
    assert exit_code(r) == 0, r.reason
    assert r.test_load["ok"] and any("byte for byte" in n for n in r.notes)
    sf = open_slot_file(off)
    assert sf.errors == [] and all(s.v_trans == 1 for b in sf.body.blocks for s in b.active_streams())
    for a, b in zip(_v_runs(off), _v_runs(fx.path), strict=False):
        assert np.array_equal(a.array(), b.array().T)
    # layer 0 does not depend on the attention kernel: equal to the fixture saved with FA off
    ra, rb = open_slot_file(off), open_slot_file(ref.path)
    sa, sb = ra.body.blocks[0].streams[0], rb.body.blocks[0].streams[0]
    assert bytes(sa.k[0].data.view) == bytes(sb.k[0].data.view)
    assert bytes(sa.v[0].data.view) == bytes(sb.v[0].data.view)
    assert off.stat().st_size == ref.size
    for c in ra.checkpoints:
        assert all(s.v_trans == 1 for b in c.tgt.body.blocks for s in b.active_streams())
    assert_loads(pools(fx.model), off, n_ckpts=2)
    back = tmp_path / "back.slot"
    r = repair("re-save", off, back, model=str(fx.model), flash_attn=True)
    assert exit_code(r) == 0 and back.read_bytes() == fx.data
    # re-save with the setting the file already has: nothing changes
    assert_idempotent("re-save", off, tmp_path, model=str(fx.model), flash_attn=False)


@pytest.mark.llama
@pytest.mark.parametrize(
    "name,model_fa", [("gemma3_iswa_nofa", True), ("llama_draft_sdft", False), ("extra-jamba", True)]
)
def test_resave_flip_round_trip_with_checkpoints_and_draft(name, model_fa, tmp_path, pools):
    fx = FX[name]
    kw: dict[str, Any] = {"model": str(fx.model)}
    if fx.draft:
        kw["draft_model"] = str(DRAFT)
    mid, back = tmp_path / "mid.slot", tmp_path / "back.slot"
    r = repair("re-save", fx.path, mid, flash_attn=model_fa, tokens="plain", **kw)
    assert exit_code(r) == 0, r.reason
    sf = open_slot_file(mid)
    assert sf.tokens.form == "plain" and sf.errors == []
    if fx.draft:
        assert r.test_load["draft"][0] and all(ok for ok, _ in r.test_load["checkpoint_drafts"])
        assert all(s.v_trans == (0 if model_fa else 1) for b in sf.draft.dft.body.blocks for s in b.active_streams())
    assert_loads(pools(fx.model, fx.draft), mid, n_ckpts=len(fx.ckpts), draft=fx.draft is not None)
    r = repair("re-save", mid, back, flash_attn=not model_fa, tokens="packed", **kw)
    assert exit_code(r) == 0, r.reason
    assert back.read_bytes() == fx.data


@pytest.mark.llama
def test_resave_recompute(tmp_path, pools):
    fx, ref = FX["llama_f16_fa"], FX["llama_f16_nofa"]
    out = tmp_path / "o.slot"
    r = repair("re-save", fx.path, out, model=str(fx.model), flash_attn=False, recompute=True)
    assert exit_code(r) == 0, r.reason
    assert any("recomputed" in x["how"] for x in r.rebuilt) and r.test_load["ok"]
    assert [c.n_tokens for c in open_slot_file(out).checkpoints] == [16, 32]
    assert_close_state(out, ref.path)  # what a server with flash attention off computes
    assert_loads(pools(fx.model), out, n_ckpts=2)


@pytest.mark.llama
def test_resave_tokens_and_limits(tmp_path, pools):
    fx = FX["llama_f16_fa"]
    out = tmp_path / "plain.slot"
    r = repair("re-save", fx.path, out, model=str(fx.model), tokens="plain")
    assert exit_code(r) == 0, r.reason
    got, data = out.read_bytes(), fx.data
    sf = open_slot_file(out)
    assert sf.tokens.form == "plain" and sf.n_token_count == 54
    assert got[sf.body.offset : sf.body.end] == data[fx.body_start : fx.body_end]  # the state itself unchanged
    assert got[sf.body.end :] == data[fx.body_end :]
    assert_loads(pools(fx.model), out, n_ckpts=2)
    # quantized V cannot be stored transposed: refused
    q = FX["llama_q8_0_fa"]
    r = repair("re-save", q.path, tmp_path / "q.slot", model=str(q.model), flash_attn=False)
    assert exit_code(r) == 4 and "q8_0" in r.reason and not (tmp_path / "q.slot").exists()
    # no V cache at all: flash attention does not reach the state
    m = FX["extra-mamba"]
    r = repair("re-save", m.path, tmp_path / "m.slot", model=str(m.model), flash_attn=True)
    assert exit_code(r) == 0 and (tmp_path / "m.slot").read_bytes() == m.data
    assert any("no V cache" in n for n in r.notes)


# ------------------------------------------------------------------------------- the JSON report


def test_json_report_shape(tmp_path):
    src = tmp_path / "cut.slot"
    src.write_bytes(D.data[: C[1].tgt[0] + 100])
    r = subprocess.run(
        [sys.executable, "-m", "slotfile", "truncate-recover", str(src), "-o", str(tmp_path / "o.slot"), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["schema"] == "slotfile.repair/1" and doc["command"] == "truncate-recover"
    assert set(doc) >= {
        "input",
        "output",
        "status",
        "exit_code",
        "reason",
        "input_size",
        "output_size",
        "bytes_saved",
        "kept",
        "dropped",
        "changed",
        "rebuilt",
        "notes",
        "test_load",
        "timings",
    }
    assert doc["status"] == "repaired" and doc["exit_code"] == 0
    assert [k["section"] for k in doc["kept"]] == ["header+tokens", "body", "sckp.header", "sckp.checkpoint[0]"]
    assert doc["kept"][0]["tokens"] == 54 and doc["kept"][3]["n_tokens"] == 8
    assert (
        doc["dropped"][0]["section"] == "sckp.checkpoint[1]"
        and doc["dropped"][0]["bytes"] == C[1].tgt[0] + 100 - C[1].offset
    )
    assert doc["changed"] == [{"section": "sckp", "field": "count", "from": 3, "to": 1}]


@pytest.mark.llama
def test_slotfile_verify_passes_on_repaired_outputs(tmp_path):
    """The command itself, once over a folder of outputs of every kind of repair above."""
    outs = tmp_path / "repaired"
    outs.mkdir()
    cases = [D.data[: C[1].tgt[0] + 5], D.data[: SD[0] + 30], D.data + b"junk"]
    for i, blob in enumerate(cases):
        src = tmp_path / f"in{i}.slot"
        src.write_bytes(blob)
        assert exit_code(repair("truncate-recover", src, outs / f"tr{i}.slot")) == 0
    for case in ("count-max", "tgt-magic", "dft-magic", "sdft-version"):
        edits, extra, _ = DAMAGE[case]
        src = _damage(D, tmp_path, edits, extra)
        assert exit_code(repair("truncate-recover", src, outs / f"{case}.slot")) == 0
    body_cut = tmp_path / "body.slot"
    body_cut.write_bytes(D.data[:9000])
    assert exit_code(repair("truncate-recover", body_cut, outs / "rebuilt.slot", model=str(D.model))) == 0
    assert exit_code(repair("strip-draft", D.path, outs / "stripped.slot")) == 0
    assert (
        exit_code(repair("re-save", D.path, outs / "fa-off.slot", model=str(D.model), flash_attn=False, tokens="plain"))
        == 0
    )
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "slotfile",
            "verify",
            str(outs),
            "--model",
            str(D.model),
            "--draft-model",
            str(DRAFT),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    doc = json.loads(r.stdout)
    assert r.returncode == 0, [f["first_problem"] for f in doc["files"]]
    assert doc["summary"]["files"] == 10 and doc["summary"]["pass"] == 10
