"""Every byte a repair writes, pinned without llama.cpp.

The llama.cpp worker (``slotfile.llama.requests.run_worker``) and the loader are replaced by fakes
that write deterministic files, so the framing a repair writes around what llama.cpp made
(SCKP and checkpoint headers, blob lengths, the SDFT header, a flipped V layout, the token
payload) is compared byte for byte with what the code wrote before it was restructured: the
sha256 of every output and of every report (paths and timings left out) are recorded below.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from slotfile.format.reader import open_slot_file
from slotfile.repair import RepairOptions, run
from slotfile.safewrite import resolve_target

from .conftest import MANIFEST, MODELS, SLOTS

LLAMA = MODELS / "llama.gguf"


def _fake_worker(ref: Path, draft_blobs: bool) -> Any:
    """A stand-in for ``run_worker``: the 'rebuilt' body is the body of ``ref`` (an intact
    file with the same model), the 'rebuilt' checkpoint blobs are its checkpoints' data_tgt
    (and data_dft), in turn."""
    sf = open_slot_file(ref)
    body = ref.read_bytes()[sf.body.offset : sf.body.end]
    head = ref.read_bytes()[:8]
    tgts = [bytes(c.tgt.data.view) for c in sf.checkpoints]
    dfts = [bytes(c.dft.data.view) for c in sf.checkpoints if c.dft.length]
    sdft = bytes(sf.draft.dft.data.view) if sf.draft is not None and sf.draft.dft is not None else b""

    def run_worker(req: dict[str, Any], timeout: float = 600.0) -> Any:
        words = req["words"]
        src_body = body
        if req["op"] == "resave":
            src = open_slot_file(req["in"])
            src_body = Path(req["in"]).read_bytes()[src.body.offset : src.body.end]
        data = (
            head
            + len(words).to_bytes(4, "little")
            + b"".join((w & 0xFFFFFFFF).to_bytes(4, "little") for w in words)
            + src_body
        )
        Path(req["out"]).write_bytes(data)
        out: dict[str, Any] = {
            "settings": req["settings"],
            "file_size": len(data),
            "model": {"needs_checkpoints": True},
            "checkpoints": [],
            "draft": None,
        }
        if req["op"] == "prefill":
            at = req.get("checkpoints_at") or [max(1, len(req["tokens"]) - 1)]
            blob = b""
            for i, n in enumerate(at if tgts else []):
                t = tgts[i % len(tgts)]
                c: dict[str, Any] = {"n_tokens": n, "pos_min": 0, "pos_max": n - 1, "tgt": [len(blob), len(t)]}
                blob += t
                if draft_blobs and dfts:
                    d = dfts[i % len(dfts)]
                    c["dft"] = [len(blob), len(d)]
                    blob += d
                out["checkpoints"].append(c)
            if draft_blobs and sdft:
                out["draft"] = [len(blob), len(sdft)]
                blob += sdft
            Path(req["blobs"]).write_bytes(blob)
        return SimpleNamespace(ok=True, message="", data=out, crashed=False, log="", seconds=0.0)

    return run_worker


class _FakePool:
    state_seq_version = None

    def __init__(self, *a: Any, **k: Any) -> None:
        pass

    def __enter__(self) -> _FakePool:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def load(self, path: str, settings: Any, timeout: float = 0, sf: Any = None) -> Any:
        sf = sf or open_slot_file(path)
        return SimpleNamespace(
            ok=True,
            message="fake",
            body_bytes=sf.body.end if sf.body else 0,
            checkpoints=[(True, "fake")] * len(sf.checkpoints),
            checkpoint_drafts=[],
            draft=None,
            crashed=False,
        )


@pytest.fixture
def fakes(monkeypatch):
    import slotfile.llama.loader
    import slotfile.llama.requests

    monkeypatch.setattr(slotfile.llama.loader, "LoaderPool", _FakePool)
    monkeypatch.setattr(
        slotfile.llama.loader, "test_load", lambda *a, **k: SimpleNamespace(ok=False, body_bytes=0, message="fake")
    )

    def use(ref: Path, draft: bool = False) -> None:
        monkeypatch.setattr(slotfile.llama.requests, "run_worker", _fake_worker(ref, draft))

    return use


def _digest(report: Any, out: Path, tmp: Path) -> str:
    doc = report.to_json()
    doc.pop("timings", None)
    doc.pop("exit_code", None)
    text = json.dumps(doc, sort_keys=True).replace(str(tmp), "TMP")
    h = hashlib.sha256(text.encode())
    h.update(out.read_bytes() if out.exists() else b"<absent>")
    return f"{report.status}:{h.hexdigest()[:16]}"


def _cases() -> dict[str, tuple[str, str, Any, dict[str, Any]]]:
    """name -> (command, fixture, how to damage its bytes, options)."""
    d = {e["file"].split("/")[-1][:-5]: e for e in MANIFEST["slots"]}
    dr = d["llama_draft_sdft"]
    ck = dr["sckp"]["checkpoints"]
    cases: dict[str, tuple[str, str, Any, dict[str, Any]]] = {}
    for name in ("llama_f16_fa", "llama_draft_sdft", "llama_draft_sdft_only", "llama_sckp_empty", "gemma3_iswa_nofa"):
        e = d[name]
        for k, cut in enumerate((e["body_end"] + 7, e["file_size"] - 5, (e["body_end"] + e["file_size"]) // 2)):
            cases[f"tr-{name}-cut{k}"] = ("truncate-recover", name, lambda b, c=cut: b[:c], {})
        cases[f"strip-{name}"] = ("strip-draft", name, lambda b: b, {})
        cases[f"dry-{name}"] = ("truncate-recover", name, lambda b: b[:-3], {"dry_run": True})
    cases["tr-count"] = (
        "truncate-recover",
        "llama_draft_sdft",
        lambda b: b[: dr["sckp"]["offset"] + 8] + b"\x09\0\0\0" + b[dr["sckp"]["offset"] + 12 :],
        {},
    )
    cases["tr-dft-magic"] = (
        "truncate-recover",
        "llama_draft_sdft",
        lambda b: b[: ck[1]["dft_offset"]] + b"\0\0\0\0" + b[ck[1]["dft_offset"] + 4 :],
        {},
    )
    cases["tr-magic"] = (
        "truncate-recover",
        "llama_draft_sdft",
        lambda b: b[: dr["sckp"]["offset"]] + b"SCKQ" + b[dr["sckp"]["offset"] + 4 :],
        {},
    )
    # rebuilds of a cut or damaged body (fake worker)
    for name, cut in (("llama_f16_fa", 9000), ("llama_draft_sdft", 9000), ("gemma3_iswa_nofa", 9000)):
        cases[f"rebuild-{name}"] = ("truncate-recover", name, lambda b, c=cut: b[:c], {"model": True})
        cases[f"rebuild-dry-{name}"] = (
            "truncate-recover",
            name,
            lambda b, c=cut: b[:c],
            {"model": True, "dry_run": True},
        )
    cases["rebuild-scan-draft"] = (
        "truncate-recover",
        "llama_draft_sdft",
        lambda b: b[: dr["body_start"] + 12] + b"\x07\0\0\0" + b[dr["body_start"] + 16 :],
        {"model": True, "draft": True},
    )
    cases["rebuild-at"] = (
        "truncate-recover",
        "llama_draft_sdft",
        lambda b: b[:9000],
        {"model": True, "draft": True, "checkpoint_at": [5, 30]},
    )
    # re-save (fake worker)
    for name in ("llama_f16_fa", "llama_f16_nofa", "llama_draft_sdft", "gemma3_iswa_nofa", "llama_plain_tokens"):
        fa = d[name]["flash_attn"]
        cases[f"resave-{name}"] = ("re-save", name, lambda b: b, {"model": True})
        cases[f"resave-flip-{name}"] = ("re-save", name, lambda b: b, {"model": True, "flash_attn": not fa})
        cases[f"resave-plain-{name}"] = ("re-save", name, lambda b: b, {"model": True, "tokens": "plain"})
        cases[f"resave-packed-{name}"] = ("re-save", name, lambda b: b, {"model": True, "tokens": "packed"})
        cases[f"resave-recompute-{name}"] = (
            "re-save",
            name,
            lambda b: b,
            {"model": True, "flash_attn": not fa, "recompute": True, "draft": True},
        )
        cases[f"resave-dry-{name}"] = (
            "re-save",
            name,
            lambda b: b,
            {"model": True, "flash_attn": not fa, "dry_run": True},
        )
    return cases


CASES = _cases()

EXPECTED = {  # recorded on the code before the repair package and the appendix walker
    "dry-gemma3_iswa_nofa": "dry-run:7ce4fb4eab3c6380",
    "dry-llama_draft_sdft": "dry-run:ed58d59dc9903297",
    "dry-llama_draft_sdft_only": "dry-run:1575b2b15760edb9",
    "dry-llama_f16_fa": "dry-run:92d6fc6cf69fa026",
    "dry-llama_sckp_empty": "dry-run:39a9a109176540d9",
    "rebuild-at": "repaired:fc7abd8c1523512e",
    "rebuild-dry-gemma3_iswa_nofa": "dry-run:611fc8b85761d265",
    "rebuild-dry-llama_draft_sdft": "dry-run:ba20853f48073712",
    "rebuild-dry-llama_f16_fa": "dry-run:ba20853f48073712",
    "rebuild-gemma3_iswa_nofa": "repaired:004e0fd8d79041c4",
    "rebuild-llama_draft_sdft": "repaired:09e2ef0da47f78de",
    "rebuild-llama_f16_fa": "repaired:9347c982f2bc1532",
    "rebuild-scan-draft": "repaired:13e49144cadc1c5e",
    "resave-dry-gemma3_iswa_nofa": "dry-run:0ca7b6ae4ef47b3e",
    "resave-dry-llama_draft_sdft": "dry-run:e966df846c05a1e6",
    "resave-dry-llama_f16_fa": "dry-run:a63707ccd3de9aa6",
    "resave-dry-llama_f16_nofa": "dry-run:48daaa71e5a0f7a5",
    "resave-dry-llama_plain_tokens": "dry-run:6c516da060e3b721",
    "resave-flip-gemma3_iswa_nofa": "repaired:ed1db5b518d3222a",
    "resave-flip-llama_draft_sdft": "repaired:f8b398a47bdaf67e",
    "resave-flip-llama_f16_fa": "repaired:5e6520262b45aa7c",
    "resave-flip-llama_f16_nofa": "repaired:55fc2a445c5cb57d",
    "resave-flip-llama_plain_tokens": "repaired:3a7a257021ea0702",
    "resave-gemma3_iswa_nofa": "nothing-to-do:38f1e64b03020713",
    "resave-llama_draft_sdft": "nothing-to-do:9e279516b7ebc8f6",
    "resave-llama_f16_fa": "nothing-to-do:7accd806ffe60da4",
    "resave-llama_f16_nofa": "nothing-to-do:701d0b376df2293d",
    "resave-llama_plain_tokens": "nothing-to-do:76c89ef797713cc5",
    "resave-packed-gemma3_iswa_nofa": "nothing-to-do:38f1e64b03020713",
    "resave-packed-llama_draft_sdft": "nothing-to-do:9e279516b7ebc8f6",
    "resave-packed-llama_f16_fa": "nothing-to-do:7accd806ffe60da4",
    "resave-packed-llama_f16_nofa": "nothing-to-do:701d0b376df2293d",
    "resave-packed-llama_plain_tokens": "repaired:203115a00a5bb0bf",
    "resave-plain-gemma3_iswa_nofa": "repaired:f02088f86ab937d7",
    "resave-plain-llama_draft_sdft": "repaired:8feda75bc1f29c6c",
    "resave-plain-llama_f16_fa": "repaired:50c21fa3a5b9e08c",
    "resave-plain-llama_f16_nofa": "repaired:90c96d099b25102d",
    "resave-plain-llama_plain_tokens": "nothing-to-do:76c89ef797713cc5",
    "resave-recompute-gemma3_iswa_nofa": "nothing-to-do:8250b0620ffaf848",
    "resave-recompute-llama_draft_sdft": "nothing-to-do:a94dbab1c926e044",
    "resave-recompute-llama_f16_fa": "nothing-to-do:71ebc8a69c1ca938",
    "resave-recompute-llama_f16_nofa": "nothing-to-do:16db38a331f01b9a",
    "resave-recompute-llama_plain_tokens": "nothing-to-do:35402ced05aa1b45",
    "strip-gemma3_iswa_nofa": "nothing-to-do:366a3e7568b52fd3",
    "strip-llama_draft_sdft": "repaired:c9d0a1396093d628",
    "strip-llama_draft_sdft_only": "repaired:be2d6ee0d3745d51",
    "strip-llama_f16_fa": "nothing-to-do:b8ed4dab9a1845e2",
    "strip-llama_sckp_empty": "nothing-to-do:36d56658cc9a0a86",
    "tr-count": "repaired:2e98c25a9cca3de6",
    "tr-dft-magic": "repaired:57cf4302a69a7b5a",
    "tr-gemma3_iswa_nofa-cut0": "repaired:2a10670750550bd5",
    "tr-gemma3_iswa_nofa-cut1": "repaired:19b21a2f2eca7469",
    "tr-gemma3_iswa_nofa-cut2": "repaired:56a8a9376dea0531",
    "tr-llama_draft_sdft-cut0": "repaired:7d01cec9f58ac730",
    "tr-llama_draft_sdft-cut1": "repaired:f9b2ee4797722da9",
    "tr-llama_draft_sdft-cut2": "repaired:7b1200b8b6d7a742",
    "tr-llama_draft_sdft_only-cut0": "repaired:70510dc68cc5eaee",
    "tr-llama_draft_sdft_only-cut1": "repaired:0cf14e269c660fa0",
    "tr-llama_draft_sdft_only-cut2": "repaired:cbf3b9e1fc177b76",
    "tr-llama_f16_fa-cut0": "repaired:7d01cec9f58ac730",
    "tr-llama_f16_fa-cut1": "repaired:23b8c9fa5811751d",
    "tr-llama_f16_fa-cut2": "repaired:ad3f270f68065f0b",
    "tr-llama_sckp_empty-cut0": "repaired:7d01cec9f58ac730",
    "tr-llama_sckp_empty-cut1": "repaired:7d01cec9f58ac730",
    "tr-llama_sckp_empty-cut2": "repaired:c729a19247f00fc8",
    "tr-magic": "repaired:3c2443fece821210",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_repair_output_bytes(case, tmp_path, fakes):
    cmd, name, damage, kw = CASES[case]
    kw = dict(kw)
    e = next(x for x in MANIFEST["slots"] if x["file"].endswith(f"/{name}.slot"))
    ref = SLOTS / f"{name}.slot"
    src = tmp_path / "in.slot"
    src.write_bytes(damage(ref.read_bytes()))
    dry = kw.pop("dry_run", False)
    draft = kw.pop("draft", False)
    if kw.pop("model", False):
        kw["model"] = str(SLOTS.parent / e["model"])
        if draft and e["draft_model"]:
            kw["draft_model"] = str(SLOTS.parent / e["draft_model"])
    fakes(ref, draft=draft and bool(e["draft_model"]))
    out = tmp_path / "out.slot"
    target = None if dry else resolve_target(src, out)
    r = run(cmd, str(src), target, RepairOptions(**kw), dry_run=dry)
    got = _digest(r, out, tmp_path)
    if not EXPECTED:
        print(f"    {case!r}: {got!r},")
        return
    assert got == EXPECTED[case], (case, r.to_json())
