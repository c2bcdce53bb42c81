"""``slotfile verify``: the four levels on intact fixtures and on a corpus of damaged copies,
through the real loader (no mocks), plus the CLI's outputs and exit codes."""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from typer.testing import Result

from slotfile.format.reader import open_slot_file
from slotfile.verify import LEVELS, Verifier, VerifyOptions, collect, version_message

from . import damage
from .conftest import EXTRA, FIXTURES, MANIFEST, MODELS, SLOTS, slotfile_cli


def cli(*args: object) -> Result:
    """``slotfile verify ARGS``, in-process."""
    return slotfile_cli("verify", *args)


class Verifiers:
    def __init__(self) -> None:
        self.v: dict[tuple[str, str | None], Verifier] = {}

    def get(self, model: str, draft: str | None = None) -> Verifier:
        key = (model, draft)
        if key not in self.v:
            self.v[key] = Verifier(
                VerifyOptions(
                    model=str(FIXTURES / model) if "/" in model else str(model),
                    draft_model=str(FIXTURES / draft) if draft else None,
                    deep=True,
                )
            )
        return self.v[key]

    def close(self) -> None:
        for v in self.v.values():
            v.close()


@pytest.fixture(scope="module")
def verifiers():
    v = Verifiers()
    yield v
    v.close()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("corpus")
    return {d.name: damage.build(d, tmp) for d in damage.CORPUS}


ALL = [(e["file"], e["model"], e["draft_model"], bool(e["n_tokens"])) for e in MANIFEST["slots"]] + [
    (e["file"], e["model"], None, e["kind"] == "slot" and bool(e["n_tokens"])) for e in EXTRA["files"]
]


@pytest.mark.llama
@pytest.mark.parametrize("file, model, draft, deep", ALL, ids=[a[0] for a in ALL])
def test_intact_fixtures_pass_every_level(verifiers, file, model, draft, deep):
    r = verifiers.get(model, draft).verify(FIXTURES / file)
    assert r.verdict == "pass", r.to_dict()
    assert r.level_reached == (4 if deep else 3), {k: (v.status, v.reason) for k, v in r.levels.items()}
    if deep:
        rows = r.levels["deep"].details["layers"]
        assert rows and all(row["ratio"] <= row["limit"] for row in rows)


@pytest.mark.llama
@pytest.mark.parametrize("d", damage.CORPUS, ids=lambda d: d.name)
def test_damaged_copies(verifiers, corpus, d):
    r = verifiers.get(f"models/{d.model}").verify(corpus[d.name])
    statuses = {k: v.status for k, v in r.levels.items()}
    assert r.verdict == d.verdict, statuses
    first = next((k for k in LEVELS if statuses[k] == "fail"), None)
    assert first == d.first_fail, (statuses, r.first_problem)
    assert r.level_reached == d.level_reached
    codes = {p.code for p in r.levels[first].problems} if first else set()
    assert set(d.codes) <= codes, (codes, r.first_problem)
    if d.verdict == "fail":
        assert r.first_problem and r.first_problem.startswith(f"{first}: ")
        assert r.cause is not None and r.next_step is not None


@pytest.mark.llama
def test_mla_k_only_fixture_through_the_real_loader(verifiers):
    """DeepSeek2 MLA: a K-only KV block.  It restores with flash attention off (its v_trans is 1,
    and llama.cpp checks the flag though there is no V), both checkpoints are consumed whole,
    and the deep check compares K rows only."""
    import dataclasses

    from slotfile.llama.loader import LoaderPool, settings_for

    path = SLOTS / "extra-deepseek2.slot"
    v = verifiers.get("models/extra-deepseek2.gguf")
    d = v.verify(path).to_dict()
    assert d["verdict"] == "pass" and d["level_reached"] == 4, d["first_problem"]
    assert d["levels"]["model"]["problems"] == []  # with the model there is no k-only warning
    load = d["levels"]["load"]["details"]
    assert load["body_bytes"] == 4996 and load["settings"]["flash_attn"] is False
    assert [ok for ok, _ in load["checkpoints"]] == [True, True]
    rows = d["levels"]["deep"]["details"]["layers"]
    assert [(row["part"], row["layer"]) for row in rows] == [("K", 0), ("K", 1)]
    # the flag is not decoration: with flash attention on, llama.cpp refuses the same bytes
    s = dataclasses.replace(settings_for(open_slot_file(path)), flash_attn=True)
    with LoaderPool(str(MODELS / "extra-deepseek2.gguf")) as pool:
        r = pool.load(str(path), s)
    assert not r.ok and not r.crashed and "incompatible V transposition" in r.message


@pytest.mark.llama
def test_damage_in_detail(verifiers, corpus):
    v = verifiers.get("models/llama.gguf")
    # the swap shows in layer 0 only, in K and in V
    deep = v.verify(corpus["kv-swapped-layer0"]).levels["deep"]
    bad = {(p.message.split(" (")[0]) for p in deep.problems if p.code == "deep-mismatch"}
    assert bad == {"K layer 0", "V layer 0"}
    # one zeroed V row: that row, 100 % off
    deep = v.verify(corpus["v-row-zeroed"]).levels["deep"]
    (p,) = [p for p in deep.problems if p.code == "deep-mismatch"]
    assert "V layer 1" in p.message and "cell 10 (position 10)" in p.message and "relative difference 100%" in p.message
    # a changed token: the KV from that position on no longer matches, and the logits differ
    deep = v.verify(corpus["token-changed"]).levels["deep"]
    assert any("cell 20 (position 20)" in p.message for p in deep.problems)
    assert any(p.code == "deep-logits" for p in deep.problems)
    # the checkpoint one byte long: the server would abort on it
    load = v.verify(corpus["checkpoint-len-plus-one"]).levels["load"]
    assert load.status == "fail" and "GGML_ABORT" in load.problems[0].message
    # the corrupt SCKP count: the body itself still restores (only the appendix is dropped)
    r = v.verify(corpus["sckp-count-corrupt"])
    assert r.levels["load"].details["body_bytes"] == 14780 and r.levels["deep"].status == "pass"


@pytest.mark.llama
def test_crash_is_contained_in_a_run(verifiers, corpus):
    v = verifiers.get("models/extra-mamba.gguf")
    reports = v.run([corpus["recurrent-two-cells"], SLOTS / "extra-mamba.slot"])
    crash, good = reports
    (p,) = [p for p in crash.levels["load"].problems if p.severity == "error"]
    assert p.code == "crashed" and "SIGABRT" in p.message and "GGML_ASSERT" in p.message
    assert crash.levels["load"].details["crashed"] is True
    assert good.verdict == "pass" and good.level_reached == 4


@pytest.mark.llama
def test_wrong_model_of_the_same_shape(tmp_path):
    other = damage.other_seed_llama(tmp_path / "other-llama.gguf")
    with Verifier(VerifyOptions(model=str(other), deep=True)) as v:
        r = v.verify(damage.BASE)
    statuses = {k: lv.status for k, lv in r.levels.items()}
    assert statuses == {"structure": "pass", "model": "pass", "load": "pass", "deep": "fail"}
    # every layer differs from position 0 on, which the shape judge reads as another build's drift
    # (a warning); what fails the file is the next-token logits, far beyond their floor, and the
    # verdict says so: decided by the logits, the message naming other weights as the likely cause
    deep = r.levels["deep"]
    (lg,) = [p for p in deep.problems if p.code == "deep-logits" and p.severity == "error"]
    assert "with the shape of drift" in lg.message and "other weights" in lg.message
    assert deep.details["decided_by"] == "logits" and deep.details["margin"] > 1000
    assert "logits differ by" in deep.details["evidence"]
    # and the drift warnings (the body's, each checkpoint's) no longer blame the server's
    # pieces, which the logits rule out
    drifts = [p for p in deep.problems if p.code == "deep-drift"]
    assert drifts[0].section == "body" and len(drifts) == 3
    for p in drifts:
        assert "shape of drift" in p.message and "not another build's arithmetic" in p.message
        assert "computed this state in pieces" not in p.message


def test_version_message_is_plain():
    sf = open_slot_file(damage.BASE)
    assert version_message(sf, 3, "x") is None
    sf.version = 4
    msg = version_message(sf, 3, "llama-cpp-python 0.3.36")
    assert "state version 4" in msg and "only loads version 3" in msg and "2026-10-05" in msg
    sf.version = 2
    assert "2025" in version_message(sf, 3, "llama-cpp-python 0.3.36")


def test_structure_only_without_a_model(corpus):
    with Verifier(VerifyOptions()) as v:
        ok = v.verify(damage.BASE)
        cut = v.verify(corpus["body-truncated"])
    assert ok.verdict == "pass" and ok.level_reached == 1
    assert {k: lv.status for k, lv in ok.levels.items()} == {
        "structure": "pass",
        "model": "skipped",
        "load": "skipped",
        "deep": "skipped",
    }
    assert cut.verdict == "fail" and cut.level_reached == 0


def test_directory_collection(tmp_path):
    (tmp_path / "sub").mkdir()
    shutil.copy(damage.BASE, tmp_path / "a.slot")
    shutil.copy(damage.BASE, tmp_path / "b.bin")
    shutil.copy(damage.BASE, tmp_path / "slot0")  # no suffix, but a GGSQ magic
    shutil.copy(damage.BASE, tmp_path / "sub" / "d.slot")
    (tmp_path / "notes.txt").write_text("not a slot")
    (tmp_path / "manifest.json").write_text("{}")
    os.symlink(tmp_path / "a.slot", tmp_path / "link.slot")
    col = collect([tmp_path, tmp_path / "missing.slot"], settle=0)
    files, errors, notes = col.files, col.errors, col.notes
    assert [p.relative_to(tmp_path).as_posix() for p in files] == ["a.slot", "b.bin", "slot0", "sub/d.slot"]
    assert errors == [f"{tmp_path / 'missing.slot'}: no such file or directory"]
    assert notes == [f"{tmp_path}: skipped: 1 symlink(s) not followed (not verified)"]  # counted, as ls does


def test_directory_walk_sets_temp_and_busy_files_aside(tmp_path):
    """``verify DIR`` walks as ``ls`` and ``prune`` do (slotfile.slotdir.walk): slotfile's own
    temp files and partial downloads are skipped; a file still being written is waited for (up
    to --settle-wait) and verified once settled, or named, and the run fails (exit 4)."""
    shutil.copy(damage.BASE, tmp_path / "old.slot")
    shutil.copy(damage.BASE, tmp_path / ".old.slot.slotfile-123-0123456789ab.tmp")
    shutil.copy(damage.BASE, tmp_path / "down.slot.part")
    shutil.copy(damage.BASE, tmp_path / "new.slot")
    now = os.stat(tmp_path / "new.slot").st_mtime
    for name in ("old.slot", ".old.slot.slotfile-123-0123456789ab.tmp", "down.slot.part"):
        os.utime(tmp_path / name, (now - 3600, now - 3600))
    col = collect([tmp_path], settle=60, settle_wait=0)
    files, errors, notes = col.files, col.errors, col.notes
    assert [p.name for p in files] == ["old.slot"] and errors == []
    assert notes == [f"{tmp_path}: skipped: 2 temp files (not verified)"] and col.skipped == 2
    assert col.busy_paths == [str(tmp_path / "new.slot")] and "still being written" in col.busy[0]
    # a file that stops changing is verified once it has settled: the walk waits for it
    os.utime(tmp_path / "new.slot")  # written just now
    t0 = time.monotonic()
    col = collect([tmp_path], settle=2, settle_wait=30)
    files, errors, notes = col.files, col.errors, col.notes
    assert [p.name for p in files] == ["new.slot", "old.slot"] and 1.5 < time.monotonic() - t0 < 30
    assert notes == [f"{tmp_path}: skipped: 2 temp files (not verified)"]
    # still being written after the bound: named, exit 4, the tally counts it failed
    os.utime(tmp_path / "new.slot")
    r = cli(tmp_path, "--settle", "60", "--settle-wait", "0.2", "--json")
    assert r.exit_code == 4, r.output
    doc = json.loads(r.stdout)
    assert doc["still_being_written"] == [str(tmp_path / "new.slot")] and doc["exit_code"] == 4
    assert doc["tally"] == {"handled": 1, "skipped": 2, "failed": 1}
    assert "new.slot: still being written" in r.stderr and "waiting up to 0.2 s" in r.stderr
    r = cli(tmp_path, "--settle", "0")
    assert r.exit_code == 0 and "2 files: 2 pass" in r.stdout  # the temp files stay aside
    assert "2 handled, 2 skipped, 0 failed" in r.stdout
    for bad in (["--settle-wait", "-1"], ["--settle-wait", "1e9"], ["--settle", "nan"]):
        assert cli(tmp_path, *bad).exit_code == 2


def test_directory_without_slot_files_is_an_error(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("not a slot")
    col = collect([tmp_path / "empty", tmp_path / "other"])
    files, errors = col.files, col.errors
    assert files == []
    assert errors == [f"no slot files found under {tmp_path / d}" for d in ("empty", "other")]


# ----------------------------------------------------------------------------- CLI


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, corpus) -> Path:
    """Intact llama files and the llama damaged copies in one directory."""
    d = tmp_path_factory.mktemp("llama-dir")
    for e in MANIFEST["slots"]:
        if e["model"] == "models/llama.gguf" and not e["draft_model"]:
            shutil.copy(FIXTURES / e["file"], d)
    for dm in damage.CORPUS:
        if dm.model == "llama.gguf":
            shutil.copy(corpus[dm.name], d)
    settled(d)
    return d


def settled(d: Path) -> None:
    """Every file under ``d`` last written an hour ago (the walker sets newer ones aside)."""
    for p in d.rglob("*"):
        t = p.stat().st_mtime - 3600
        os.utime(p, (t, t))


def _check_schema(doc: dict) -> None:
    assert doc["schema"] == "slotfile.verify/1"
    assert set(doc) >= {
        "loader",
        "model",
        "draft_model",
        "deep",
        "tolerances",
        "files",
        "errors",
        "summary",
        "exit_code",
    }
    for f in doc["files"]:
        assert set(f) >= {"path", "size", "n_tokens", "levels", "verdict", "first_problem", "level_reached"}
        assert list(f["levels"]) == list(LEVELS)
        for lv in f["levels"].values():
            assert lv["status"] in ("pass", "fail", "skipped")
            for p in lv["problems"]:
                assert set(p) == {"severity", "code", "section", "offset", "message", "class"}
                assert p["class"] in ("damaged", "mismatch", "not-a-slot-file", "unsupported", "cannot-check", "notice")
        assert f["verdict"] in ("pass", "fail", "error")
        assert (f["cause"] is None) == (f["verdict"] != "fail") and (f["next_step"] is None) == (f["cause"] is None)
        assert (f["first_problem"] is None) == (f["verdict"] == "pass")


@pytest.mark.llama
def test_cli_json_and_jobs_over_a_directory(llama_dir, tmp_path):
    r1 = cli(llama_dir, "--model", MODELS / "llama.gguf", "--deep", "--json")
    r2 = cli(
        llama_dir,
        "--model",
        MODELS / "llama.gguf",
        "--deep",
        "--json",
        "--jobs",
        "2",
        "--junit",
        tmp_path / "junit.xml",
    )
    assert r1.exit_code == r2.exit_code == 4, r1.stderr + r2.stderr
    d1, d2 = json.loads(r1.stdout), json.loads(r2.stdout)
    _check_schema(d1)
    _check_schema(d2)
    loader = d1["loader"]
    assert {k: loader[k] for k in ("llama_cpp_python", "state_seq_version", "session_version")} == {
        "llama_cpp_python": "0.3.36",
        "state_seq_version": 3,
        "session_version": 10,
    }
    assert loader["library"].endswith("/libllama.so") and loader["library_source"] == "installed"
    assert d1["loaders"] == [loader] and loader["files"] == len(d1["files"])
    paths = [f["path"] for f in d1["files"]]
    assert paths == sorted(paths) and len(paths) == len(list(llama_dir.iterdir()))

    def summary(d):
        return [
            (Path(f["path"]).name, f["verdict"], f["level_reached"], tuple(lv["status"] for lv in f["levels"].values()))
            for f in d["files"]
        ]

    assert summary(d1) == summary(d2)
    by_name = {Path(f["path"]).name: f for f in d1["files"]}
    for dm in damage.CORPUS:
        if dm.model == "llama.gguf":
            f = by_name[f"{dm.name}.slot"]
            assert (f["verdict"], f["level_reached"]) == (dm.verdict, dm.level_reached), f["first_problem"]
    assert by_name["llama_f16_fa.slot"]["verdict"] == "pass"
    assert d1["summary"]["fail"] == sum(1 for dm in damage.CORPUS if dm.model == "llama.gguf" and dm.verdict == "fail")

    # JUnit: well-formed, one testcase per file, failures where the JSON says fail
    root = ET.parse(tmp_path / "junit.xml").getroot()
    cases = root.findall("./testsuite/testcase")
    assert len(cases) == len(d2["files"]) and int(root.get("tests")) == len(cases)
    failed = {c.get("name") for c in cases if c.find("failure") is not None}
    assert failed == {f["path"] for f in d2["files"] if f["verdict"] == "fail"}
    assert int(root.get("failures")) == len(failed) and root.get("errors") == "0"
    for c in cases:
        fl = c.find("failure")
        if fl is not None:
            assert fl.get("type") in LEVELS and fl.get("message")


@pytest.mark.llama
def test_cli_table_with_a_model():
    ok = cli(SLOTS / "llama_f16_fa.slot", SLOTS / "llama_q8_0_fa.slot", "--model", MODELS / "llama.gguf")
    assert ok.exit_code == 0, ok.stdout + ok.stderr
    assert "llama_f16_fa.slot: pass [S:ok M:ok L:ok D:-]\n" in ok.stdout and "2 files: 2 pass, 0 fail" in ok.stdout
    assert "llama-cpp-python 0.3.36" in ok.stdout
    assert "structure only" not in ok.stdout


def test_cli_table_and_exit_codes(tmp_path):
    structure = cli(SLOTS)  # no model: structure only, every fixture reads cleanly
    assert structure.exit_code == 0, structure.stdout
    n = len(collect([SLOTS], settle=0).files)
    assert f"{n} files: {n} pass, 0 fail (structure only; add --model to test-load) in " in structure.stdout

    missing_model = cli(SLOTS / "llama_f16_fa.slot", "--model", tmp_path / "nope.gguf")
    assert missing_model.exit_code == 8 and "model not found" in missing_model.stderr

    missing_path = cli(SLOTS / "llama_f16_fa.slot", tmp_path / "nope.slot", "--json")
    assert missing_path.exit_code == 8 and "no such file" in missing_path.stderr
    assert json.loads(missing_path.stdout)["errors"]
    only_missing = cli(tmp_path / "nope.slot")  # nothing to verify: no empty table before the error
    assert only_missing.exit_code == 8 and only_missing.stdout == ""
    assert only_missing.stderr == f"slotfile: {tmp_path / 'nope.slot'}: no such file or directory\n"

    assert cli(SLOTS / "llama_f16_fa.slot", "--deep").exit_code == 2  # --deep needs --model
    assert cli().exit_code == 2
    assert cli(SLOTS / "llama_f16_fa.slot", "--jobs", "0").exit_code == 2

    bad = tmp_path / "bad.slot"
    bad.write_bytes(damage.truncate_body(damage.BASE.read_bytes(), tmp_path))
    r = cli(bad)
    assert r.exit_code == 4 and "fail" in r.stdout and "truncated" in r.stdout


def test_cli_directory_with_no_slot_files_fails(tmp_path):
    """A CI job pointed at the wrong directory must not go green."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "notes.txt").write_text("not a slot")
    for d in (tmp_path / "empty", tmp_path / "txt"):
        r = cli(d)
        assert r.exit_code == 8 and r.stdout == ""
        assert r.stderr == f"slotfile: no slot files found under {d}\n"
        doc = json.loads(cli(d, "--json").stdout)
        assert doc["exit_code"] == 8 and doc["files"] == [] and doc["errors"] == [f"no slot files found under {d}"]
    # one empty directory among good files still fails the run
    r = cli(SLOTS / "llama_f16_fa.slot", tmp_path / "empty")
    assert r.exit_code == 8 and "1 file: 1 pass" in r.stdout


def test_cli_shows_warnings_in_the_table(tmp_path):
    """A version-5 file with a version-3 body reads by trial: a structure warning, shown in the
    table (verdict and first-problem column), not only by inspect."""
    data = (SLOTS / "gemma3_iswa_fa.slot").read_bytes()
    p = tmp_path / "v5.slot"
    p.write_bytes(data[:4] + struct.pack("<I", 5) + data[8:])
    r = cli(p)
    assert r.exit_code == 0, r.stdout + r.stderr
    assert "pass, 1 warning" in r.stdout and "warning: structure: body at offset 244: GGSQ version 5" in r.stdout
    assert "exactly like version 3" in r.stdout  # the row may fold: the message goes on
    plain = cli(SLOTS / "gemma3_iswa_fa.slot").stdout
    assert "warning" not in plain


def test_cli_quiet(tmp_path):
    bad = tmp_path / "bad.slot"
    bad.write_bytes(damage.truncate_body(damage.BASE.read_bytes(), tmp_path))
    r = cli(SLOTS / "llama_f16_fa.slot", bad, "-q")
    assert r.exit_code == 4
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and "slotfile verify" not in r.stdout  # no table
    assert lines[0].startswith(f"{bad}: fail: structure: ") and "truncated" in lines[0]
    assert lines[1].startswith("2 files: 1 pass, 1 fail")
    ok = cli(SLOTS / "llama_f16_fa.slot", "--quiet")
    assert ok.exit_code == 0 and ok.stdout.startswith("1 file: 1 pass, 0 fail") and len(ok.stdout.splitlines()) == 1
    assert json.loads(cli(bad, "-q", "--json").stdout)["summary"]["fail"] == 1  # JSON is unchanged by -q


@pytest.mark.llama
def test_cli_version_mismatch_is_cannot_check_not_a_failure(corpus):
    """A file of another state version than the installed loader's: the load level is skipped
    with the reason (cannot be checked here), the file passes what could be checked, exit 0,
    and the summary says that not everything could be checked."""
    r = cli(corpus["version-4"], "--model", MODELS / "llama.gguf", "--json")
    assert r.exit_code == 0, r.stdout
    f = json.loads(r.stdout)["files"][0]
    load = f["levels"]["load"]
    assert (load["status"], load["skip_kind"]) == ("skipped", "cannot-check")
    assert "state version 4" in load["reason"] and "llama-cpp-python" in load["reason"]
    assert f["levels"]["deep"]["status"] == "skipped" and f["verdict"] == "pass" and f["cause"] is None
    assert f["unchecked"] and f["unchecked"][0].startswith("load: this file has state version 4")
    table = cli(corpus["version-4"], "--model", MODELS / "llama.gguf")
    assert table.exit_code == 0 and "1 not fully checkable here" in table.stdout
    # the table says it in two lines at 80 columns, without the loader's path: why, and what to pass
    assert "not checked here: load: needs another llama.cpp; pass --llama-lib DIR" in table.stdout


def test_model_level_token_and_position_checks():
    from slotfile.format.reader import parse_buffer
    from slotfile.verify.model import level_model, model_side

    side = model_side(str(MODELS / "llama.gguf"))
    data = damage.BASE.read_bytes()
    assert level_model(parse_buffer(data), side, None).status == "pass"
    # a token id beyond the 320-token vocabulary: the server's validate() rejects it
    bad_tok = damage.change_token(data, Path("."), index=7, new=999)
    lv = level_model(parse_buffer(bad_tok), side, None)
    (p,) = [p for p in lv.problems if p.code == "token-out-of-vocab"]
    assert (
        lv.status == "fail" and "token 7 is id 999" in p.message and p.offset == 12 + 12 + 4 * 7
    )  # header, packed prefix, 7 tokens
    # the last cell at position 300, beyond the model's 256-token training context
    sf = parse_buffer(data)
    cells = sf.body.blocks[0].active_streams()[0].cells
    off = cells.offset + (cells.cells.size - 1) * 12
    moved = data[:off] + (300).to_bytes(4, "little", signed=True) + data[off + 4 :]
    lv = level_model(parse_buffer(moved), side, None)
    assert any(p.code == "position-beyond-context" and "256" in p.message for p in lv.problems)
    # without a draft model, draft blobs are reported as not checked (a warning)
    lv = level_model(open_slot_file(SLOTS / "llama_draft_sdft.slot"), side, None)
    assert lv.status == "pass" and any(p.code == "draft-not-checked" for p in lv.problems)
    dside = model_side(str(MODELS / "draft.gguf"))
    assert not level_model(open_slot_file(SLOTS / "llama_draft_sdft.slot"), side, dside).problems
    # the draft model used as the target: every layer's row size is wrong
    lv = level_model(parse_buffer(data), dside, None)
    assert lv.status == "fail" and any(p.code == "model-mismatch" for p in lv.problems)


def test_collected_paths_sort_as_paths_do(tmp_path):
    """A directory's files are held as strings (slotfile.verify.collect.PathList) in the walk's
    order, which is pathlib's, part by part (``d/x`` before ``d-2/x`` and ``d.x``, a folder's
    files among its subfolders by name), as when each was a Path and sorted; path_order is
    the one-string key of that order."""
    from pathlib import Path, PurePosixPath

    from slotfile.slotdir.walk import path_order
    from slotfile.verify.collect import PathList

    names = ["d/x", "d-2/x", "d.x", "d/sub/y", "d/a", "a b/c", "d/sub-1/z", "D/x", "d/\u00e9", "d/z"]
    assert sorted(names, key=path_order) == [str(p) for p in sorted(map(PurePosixPath, names))]
    for n in names:
        (tmp_path / n).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(damage.BASE, tmp_path / n)
        os.utime(tmp_path / n, (1, 1))
    col = collect([tmp_path], settle=0)
    assert isinstance(col.files, PathList)
    assert list(col.files) == sorted(tmp_path / n for n in names)
    assert col.files == sorted(tmp_path / n for n in names) and col.files[1:3] == list(col.files)[1:3]
    assert list(col.sizes) == [(tmp_path / n).stat().st_size for n in sorted(names, key=lambda n: PurePosixPath(n))]
    assert all(type(p) is type(Path()) for p in col.files)
