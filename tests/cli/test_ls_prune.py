"""ls, prune, verify --server-args and re-save DIR as a user runs them: output, exit codes,
and that every conversion's output restores under the new server's settings."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from ..conftest import MODELS, SLOTS
from ..conftest import slotfile_cli as run

LLAMA = MODELS / "llama.gguf"
DAY = 86400.0


def _saves(tmp_path: Path, names: tuple[str, ...], age: float = DAY) -> Path:
    d = tmp_path / "slots"
    (d / "old").mkdir(parents=True)
    now = time.time()
    for i, n in enumerate(names):
        p = d / ("old" if i % 2 else "") / f"{n}.slot"
        shutil.copyfile(SLOTS / f"{n}.slot", p)
        os.utime(p, (now - age - i, now - age - i))
    return d


def _digests(d: Path) -> dict[str, str]:
    return {
        p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in d.rglob("*") if p.is_file()
    }


SAVES = ("llama_f16_fa", "llama_f16_nofa", "llama_2stream", "llama_unified_2seq", "llama_q8_0_fa", "llama_draft_sdft")


def test_ls_lists_and_totals(tmp_path):
    d = _saves(tmp_path, ("llama_f16_fa", "llama_2stream", "gemma3_iswa_nofa"))
    (d / ".x.slot.slotfile-7-0123456789ab.tmp").write_bytes(b"qsgg")
    shutil.copyfile(SLOTS / "llama_q8_0_fa.slot", d / "fresh.slot")  # just written, and not waited for
    r = run("ls", d, "--json", "--sort", "size", "--settle-wait", "0")
    assert r.exit_code == 4, r.stderr  # a file left out is never a success
    assert f"{d / 'fresh.slot'}: still being written" in r.stderr
    doc = json.loads(r.stdout)
    assert doc["schema"] == "slotfile.ls/1"
    assert [f["rel"] for f in doc["files"]] == ["llama_f16_fa.slot", "old/llama_2stream.slot", "gemma3_iswa_nofa.slot"]
    two = doc["files"][1]
    assert (two["n_stream"], two["active_streams"], two["flash_attn"], two["type_k"]) == (2, 1, True, "f16")
    assert doc["files"][2]["flash_attn"] is False and doc["files"][2]["memory_class"] == "iswa"
    assert doc["totals"]["files"] == 3 and doc["totals"]["tokens"] == 162
    assert doc["temp"] == {"files": 1, "bytes": 4} and doc["busy"]["files"] == 1
    assert doc["still_being_written"] == [str(d / "fresh.slot")]
    assert doc["tally"] == {"handled": 3, "skipped": 1, "failed": 1}
    text = run("ls", d, "--sort", "age", "--settle-wait", "0")
    assert text.exit_code == 4 and "3 slot files," in text.stdout and "1 still being written" in text.stdout
    assert "3 handled, 1 skipped, 1 failed" in text.stdout


def test_ls_waits_for_a_file_being_written_then_lists_it(tmp_path):
    d = _saves(tmp_path, ("llama_f16_fa",))
    shutil.copyfile(SLOTS / "llama_q8_0_fa.slot", d / "fresh.slot")  # copied a moment ago
    t = time.monotonic()
    r = run("ls", d, "--json", "--settle", "1", "--settle-wait", "20")
    assert r.exit_code == 0, r.stderr
    assert time.monotonic() - t < 10 and "waiting up to 20 s for fresh.slot: still being written" in r.stderr
    doc = json.loads(r.stdout)
    assert [f["rel"] for f in doc["files"]] == ["fresh.slot", "llama_f16_fa.slot"]
    assert doc["busy"]["files"] == 0 and doc["tally"] == {"handled": 2, "skipped": 0, "failed": 0}


def test_a_file_still_changing_after_the_wait_is_named_and_exits_4(tmp_path):
    d = _saves(tmp_path, ("llama_f16_fa",))
    live = d / "live.slot"
    live.write_bytes(b"qsgg")
    stop = threading.Event()

    def writer() -> None:  # a server writing a large state in pieces
        with open(live, "ab") as f:
            while not stop.wait(0.1):
                f.write(b"\0" * 4096)
                f.flush()

    th = threading.Thread(target=writer)
    th.start()
    try:
        r = run("ls", d, "--settle", "1", "--settle-wait", "1.5")
        p = run("prune", d, "--older-than", "1d", "--settle", "1", "--settle-wait", "0.5", "--json")
    finally:
        stop.set()
        th.join()
    assert r.exit_code == 4 and f"{live}: still being written" in r.stderr and "--settle-wait 1.5" in r.stderr
    assert "1 handled, 0 skipped, 1 failed" in r.stdout
    assert p.exit_code == 4 and f"{live}: still being written" in p.stderr
    doc = json.loads(p.stdout)
    assert doc["still_being_written"] == [str(live)] and doc["tally"] == {"handled": 1, "skipped": 0, "failed": 1}
    assert [x["rel"] for x in doc["remove"]] == ["llama_f16_fa.slot"]  # the plan goes on for the files it could judge


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "100000", "soon"])
def test_settle_wait_out_of_range_is_a_usage_error(tmp_path, value):
    d = _saves(tmp_path, ("llama_f16_fa",))
    for cmd in (
        ("ls", d),
        ("prune", d, "--keep", "1"),
        ("re-save", d, "-o", tmp_path / "o", "--server-args", f"llama-server -m {LLAMA}"),
    ):
        r = run(*cmd, "--settle-wait", value)
        assert r.exit_code == 2 and "--settle-wait" in r.stderr, (cmd, r.stdout, r.stderr)
        if value != "soon":  # not a number: typer's own usage message; out of range: slotfile's one line
            assert r.stderr.count("\n") == 1, r.stderr


def test_ls_exit_codes(tmp_path):
    d = _saves(tmp_path, ("llama_f16_fa",))
    cut = d / "cut.slot"
    cut.write_bytes((SLOTS / "llama_f16_fa.slot").read_bytes()[:3000])
    os.utime(cut, (time.time() - 60, time.time() - 60))
    assert run("ls", d).exit_code == 4  # a damaged file
    assert run("ls", tmp_path / "nope").exit_code == 8
    assert run("ls", d, "--sort", "colour").exit_code == 2


def test_ls_with_server_args_predicts_without_loading(tmp_path):
    d = _saves(tmp_path, ("llama_f16_fa", "llama_2stream"))
    r = run("ls", d, "--json", "--server-args", f"llama-server -m {LLAMA} -np 2 -c 512")
    doc = json.loads(r.stdout)
    fates = {f["rel"]: f["restore"]["fate"] for f in doc["files"]}
    assert fates == {"llama_f16_fa.slot": "needs re-save, exact", "old/llama_2stream.slot": "restores as is"}
    assert not any(f["restore"]["proven"] for f in doc["files"])


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ("llama-server -m M --frobnicate", "'--frobnicate' is not a llama-server flag"),
        ("llama-server -m M -fa sometimes", "-fa takes on, off or auto"),
        ("llama-server -np 2", "no -m MODEL"),
        ("llama-server -m M -fa off -ctv q8_0", "quantized V cache"),
    ],
)
def test_server_args_usage_errors(tmp_path, args, says):
    d = _saves(tmp_path, ("llama_f16_fa",))
    r = run("verify", d, "--server-args", args.replace("M", str(LLAMA)))
    assert r.exit_code == 2 and says in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert run("verify", d, "--server-args", f"llama-server -m {LLAMA}", "--deep").exit_code == 2


@pytest.mark.llama
def test_verify_server_args_exit_codes_and_json(tmp_path):
    d = _saves(tmp_path, ("llama_f16_fa", "llama_unified_2seq"))
    same = f"llama-server -m {LLAMA} -c 256 -np 1 -fa on"
    r = run("verify", d, "--server-args", same, "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert doc["schema"] == "slotfile.restore/1" and doc["summary"]["as_is"] == 2
    assert all(f["proven"] and f["load"]["ok"] for f in doc["files"])
    other = f"/usr/local/bin/llama-server --host 0.0.0.0 -m {LLAMA} -c 1024 -np 2 -fa off"
    r = run("verify", d, "--server-args", other)
    assert r.exit_code == 4 and "needs re-save, exact" in r.stdout and "n_stream mismatch" in r.stdout
    r = run("verify", d, tmp_path / "missing.slot", "--server-args", same)
    assert r.exit_code == 8 and "missing.slot" in r.stderr


@pytest.mark.llama
@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        f"llama-server -m {LLAMA} -c 1024 -np 4 -fa off",  # streams and V layout change
        f"llama-server -m {LLAMA} -c 512 -np 2 -fa on -ctk q8_0 -ctv q8_0",  # lossy: other cache types
        f"llama-server -m {LLAMA} -c 1024",  # -np auto: unified, fa auto (rows)
    ],
)
def test_resave_dir_converts_for_the_new_server(tmp_path, args):
    d = _saves(tmp_path, (*SAVES, "gemma3_iswa_fa"))
    before = _digests(d)
    out = tmp_path / "converted"
    dry = run("re-save", d, "-o", out, "--server-args", args, "--dry-run", "--json")
    assert dry.exit_code == 4, dry.stderr  # the gemma3 save cannot restore into a llama server
    assert not out.exists() or not any(out.rglob("*.slot"))
    r = run("re-save", d, "-o", out, "--server-args", args, "--json")
    doc = json.loads(r.stdout)
    acts = {f["file"]: f["action"] for f in doc["files"]}
    assert acts.pop("gemma3_iswa_fa.slot") == "skipped"
    assert set(acts.values()) <= {"converted", "copied"} and len(acts) == len(SAVES), doc
    assert _digests(d) == before  # inputs untouched
    # the outputs mirror the tree, keep their ages, leave no temp behind, and restore as is (a real load each)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == sorted(acts)
    assert abs(os.stat(out / "llama_f16_fa.slot").st_mtime - os.stat(d / "llama_f16_fa.slot").st_mtime) < 1e-3
    v = run("verify", out, "--server-args", args, "--json")
    vdoc = json.loads(v.stdout)
    assert v.exit_code == 0 and vdoc["summary"]["as_is"] == len(SAVES), v.stdout
    # a second run finds every output in the way
    again = run("re-save", d, "-o", out, "--server-args", args)
    assert again.exit_code == 2 and "exists" in again.stderr


def test_resave_dir_usage(tmp_path):
    d = _saves(tmp_path, ("llama_f16_fa",))
    args = f"llama-server -m {LLAMA} -np 2"
    assert run("re-save", d, "-o", d / "inside", "--server-args", args).exit_code == 2
    assert run("re-save", d, "-o", tmp_path / "o").exit_code == 2  # no --server-args
    assert run("re-save", d, "--server-args", args).exit_code == 2  # no -o
    assert run("re-save", d, "--in-place", "--server-args", args).exit_code == 2


def test_prune_plans_then_deletes_exactly_the_plan(tmp_path):
    d = tmp_path / "slots"
    d.mkdir()
    now = time.time()
    size = (SLOTS / "llama_f16_fa.slot").stat().st_size
    for i in range(1, 7):
        p = d / f"s{i}.slot"
        shutil.copyfile(SLOTS / "llama_f16_fa.slot", p)
        os.utime(p, (now - i * DAY, now - i * DAY))
    (d / "live.slot").write_bytes(b"qsgg")  # being written right now (and not waited for)
    plan = run("prune", d, "--older-than", "3.5d", "--max-total", str(3 * size), "--json", "--settle-wait", "0")
    assert plan.exit_code == 4 and "live.slot: still being written" in plan.stderr, plan.stderr
    doc = json.loads(plan.stdout)
    planned = [r["rel"] for r in doc["remove"]]
    assert planned == ["s6.slot", "s5.slot", "s4.slot", "s3.slot"]  # age first, then the quota (live.slot counts)
    assert all(not r["removed"] for r in doc["remove"]) and len(list(d.iterdir())) == 7
    done = run("prune", d, "--older-than", "3.5d", "--max-total", str(3 * size), "--delete", "--settle-wait", "0")
    assert done.exit_code == 4 and "removed 4 files" in done.stdout and "6 handled, 0 skipped, 1 failed" in done.stdout
    assert sorted(p.name for p in d.iterdir()) == ["live.slot", "s1.slot", "s2.slot"]


def test_prune_usage_and_quota_errors(tmp_path):
    d = _saves(tmp_path, ("llama_f16_fa",))
    assert run("prune", d).exit_code == 2  # no rule
    assert run("prune", d, "--max-total", "lots").exit_code == 2
    assert run("prune", d, "--older-than", "7 days").exit_code == 2
    (d / "busy.slot").write_bytes(b"x" * 100)  # fresh: counts, never removed
    r = run("prune", d, "--max-total", "50", "--settle-wait", "0")
    assert r.exit_code == 4 and "do not free enough" in r.stdout


def test_ls_lists_by_path_in_verifys_order(tmp_path: Path):
    """``ls`` sorted by path lists part by part, as ``verify DIR`` and pathlib do (``d/x``
    before ``d-2/x`` and ``d.slot``): streamed in the walk's order, and with ``--sort path``
    where the rows are kept (a manifest beside the files)."""
    from pathlib import PurePosixPath

    d = tmp_path / "slots"
    names = ["d/x.slot", "d-2/x.slot", "d.slot", "d/a b.slot", "c/d/e.slot", "c.slot"]
    for n in names:
        (d / n).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(SLOTS / "llama_f16_fa.slot", d / n)
        os.utime(d / n, (1, 1))
    want = [str(p) for p in sorted(map(PurePosixPath, names))]
    assert want[:3] == ["c/d/e.slot", "c.slot", "d/a b.slot"]
    r = run("ls", d, "--json", "--settle", "0")
    assert r.exit_code == 0, r.stderr
    assert [f["rel"] for f in json.loads(r.stdout)["files"]] == want
    v = run("verify", d, "--json", "--settle", "0")
    assert [str(PurePosixPath(f["path"]).relative_to(d.as_posix())) for f in json.loads(v.stdout)["files"]] == want
    assert run("seal", d).exit_code == 0  # a manifest: ls keeps every row, sorted by --sort path
    r = run("ls", d, "--json", "--settle", "0", "--sort", "path")
    assert [f["rel"] for f in json.loads(r.stdout)["files"]] == want
