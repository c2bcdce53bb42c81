"""Detection power of ``slotfile verify --deep`` (issue 25 item 4): seeded damage of every kind
(bench/damage.py) in clean files written by real llama-servers, each damaged copy judged by the
real verify engine (:class:`slotfile.verify.Verifier`, the levels ``slotfile verify --deep``
runs, with the model and llama library each file needs).

    .venv/bin/python bench/detect.py                 # 30 corpus files + 6 committed fixtures
    .venv/bin/python bench/detect.py --quick         # a smoke run: 3 files
    .venv/bin/python bench/detect.py --files 60 --cases-per-kind 3 --seed 7 --out /tmp/d.json --md /tmp/d.md

Inputs: the real-server corpus (``~/.cache/slotfile/corpus/v<N>-<isa>``: v3-native, v4-native, v4-cuda; bench/corpus.md;
model from each ``.bin.json`` sidecar) picked across strata (state version, model, cache types,
V layout) smallest first, and committed fixtures that hold SCKP checkpoints (the servers wrote
none) for the ``ckpt-span`` kind.  v4 files are loaded with the v4 library
(``--llama-lib-v4``, default the one ``scripts/build-llama-v4.sh`` cached); v3 files with the
installed llama-cpp-python.

Per file: the clean file is verified first (a false alarm if it fails; its layers' largest
stored-vs-recomputed difference ``max_abs`` is the noise a bit flip is compared with), then
every case: the damaged copy is written to a scratch folder, verified and deleted.  Output:
a JSON file of every case (``~/.cache/slotfile/detect/seed-N.json``: half a megabyte, not
committed) and the markdown tables of bench/detect_report.py (``bench/detect.md``, committed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent.parent) not in sys.path:  # run as a script: bench/ is a namespace package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import corpus, damage, detect_report
from slotfile.format.reader import open_slot_file
from slotfile.verify import FileReport, Verifier, VerifyOptions

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("SLOTFILE_CACHE_DIR", Path.home() / ".cache" / "slotfile"))
CORPUS = CACHE / "corpus"
FIXTURE_MANIFESTS = ("manifest.json", "extra-manifest.json", "v4/manifest.json", "v4/extra-manifest.json")


@dataclass(frozen=True)
class Source:
    """One clean file and what verifying it needs."""

    path: Path
    model: str
    version: int
    origin: str  # "corpus" or "fixture"
    n_tokens: int
    stratum: tuple[str, ...]  # (version, model, cache types, V layout)

    @property
    def family(self) -> str:
        return self.stratum[1]


def _stratum(path: Path, version: int, model: str, isa: str = "") -> tuple[tuple[str, ...], int]:
    """(the file's stratum, its token count) from its parsed body; ``isa``: the build that wrote
    it (``native``, ``cuda``...; a GPU server's files drift otherwise, so they form their own strata)."""
    sf = open_slot_file(path)
    try:
        types: set[str] = set()
        layout = set()
        for t in damage.body_targets(sf):
            types.add(t.type_name)
            if t.part == "V":
                layout.add("V transposed" if t.transposed else "V rows")
        n = int(sf.tokens.tokens.size) if sf.tokens is not None else 0
        roles = ",".join(sorted({t.block for t in damage.body_targets(sf)}))
        where = f"v{version}" + (f"-{isa}" if isa else "")
        return (where, Path(model).stem, "+".join(sorted(types)), "+".join(sorted(layout)), roles), n
    finally:
        sf.close()


def corpus_sources(root: Path) -> list[Source]:
    """Every file of the real-server corpus, with its model and state version from the sidecar (a
    fixture model that is no longer where the corpus run found it: this checkout's copy)."""
    out = []
    for side in sorted(root.glob("v*-*/*.bin.json")):
        meta = json.loads(side.read_text())
        path, model, version = side.with_suffix(""), meta["model_path"], int(meta["state_version"])
        if not Path(model).exists() and meta.get("model") in corpus.FIXTURES:
            model = str(corpus.model_path(meta["model"], sys.executable))
        if not path.exists() or not Path(model).exists():
            continue
        st, n = _stratum(path, version, model, str(meta.get("isa") or "native"))
        out.append(Source(path, model, version, "corpus", n, st))
    return out


def fixture_sources() -> list[Source]:
    """The committed fixtures (v3 and v4) that hold checkpoint rows, with their models (no draft models)."""
    out = []
    for name in FIXTURE_MANIFESTS:
        man = ROOT / "fixtures" / "slots" / name
        if not man.exists():
            continue
        doc = json.loads(man.read_text())
        for e in doc.get("slots") or doc.get("files") or []:
            path, model = ROOT / "fixtures" / e["file"], ROOT / "fixtures" / e["model"]
            if e.get("draft_model") or e.get("kind", "slot") != "slot" or not path.exists():
                continue
            sf = open_slot_file(path)
            version, ck = sf.version or 0, bool(damage.checkpoint_targets(sf))
            sf.close()
            if ck and version in (3, 4):
                st, n = _stratum(path, version, str(model))
                out.append(Source(path, str(model), version, "fixture", n, st))
    return out


def select(sources: list[Source], n: int, max_tokens: int) -> list[Source]:
    """``n`` files spread over the strata: Gemma and fixture-model strata alternate, each stratum
    giving its smallest file not yet taken, round after round.  A file with no tokens (a slot the
    server cleared before saving it) holds nothing to damage and is left out."""
    strata: dict[tuple[str, ...], list[Source]] = {}
    for s in sorted(sources, key=lambda s: (s.n_tokens, s.path.name)):
        if 0 < s.n_tokens <= max_tokens:
            strata.setdefault(s.stratum, []).append(s)
    gemma = [k for k in sorted(strata) if k[1].startswith("gemma-3")]
    other = _interleave_models([k for k in sorted(strata) if not k[1].startswith("gemma-3")])
    order = [k for pair in zip(gemma, other, strict=False) for k in pair]
    order += gemma[len(other) :] + other[len(gemma) :]
    picked: list[Source] = []
    while len(picked) < n and any(strata[k] for k in order):
        for k in order:
            if strata[k] and len(picked) < n:
                picked.append(strata[k].pop(0))
    return picked


def _interleave_models(keys: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """Strata reordered so that consecutive ones belong to different models where possible."""
    by_model: dict[str, list[tuple[str, ...]]] = {}
    for k in keys:
        by_model.setdefault(k[1], []).append(k)
    for i, m in enumerate(sorted(by_model)):  # every other model starts with its last stratum (v4 before v3)
        if i % 2:
            by_model[m].reverse()
    out: list[tuple[str, ...]] = []
    while any(by_model.values()):
        for m in sorted(by_model):
            if by_model[m]:
                out.append(by_model[m].pop(0))
    return out


def outcome(rep: FileReport) -> dict[str, Any]:
    """What the verify engine said of one file: verdict, the failing levels, the deep margin and logits."""
    deep = rep.levels["deep"]
    det = deep.details or {}
    lg = det.get("logits") or {}
    top_r, top_c = lg.get("top5_restored") or [None], lg.get("top5_recomputed") or [None]
    return {
        "verdict": str(rep.verdict),
        "failed_levels": [name for name, lv in rep.levels.items() if str(lv.status) == "fail"],
        "first_problem": rep.first_problem,
        "deep": str(deep.status),
        "deep_reason": deep.reason or None,
        "margin": det.get("margin"),
        "worst": det.get("worst"),
        "logits_rel": lg.get("rel"),
        "logits_ratio": lg.get("ratio"),
        "top1_changed": (top_r[0] != top_c[0]) if lg else None,
        "seconds": round(rep.seconds, 2),
    }


def layer_noise(rep: FileReport) -> dict[str, float]:
    """The clean file's largest stored-vs-recomputed difference per layer ("block/part/layer")."""
    noise: dict[str, float] = {}
    for row in (rep.levels["deep"].details or {}).get("layers", []):
        if "max_abs" in row:
            key = f"{row.get('block')}/{row.get('part')}/{row.get('layer')}"
            noise[key] = max(noise.get(key, 0.0), float(row["max_abs"]))
    return noise


def _groups(sources: list[Source], lib_v4: str | None) -> Iterator[tuple[tuple[str, str | None], list[Source]]]:
    """The files by (model, llama library): one Verifier (one model load) per group."""
    groups: dict[tuple[str, str | None], list[Source]] = {}
    for s in sources:
        groups.setdefault((s.model, lib_v4 if s.version == 4 else None), []).append(s)
    yield from groups.items()


def run_file(
    v: Verifier, src: Source, seed: int, per_kind: int, scratch: Path, kinds: list[str] | None
) -> dict[str, Any]:
    """The clean file, then every case of it: the file's record with its cases' outcomes."""
    clean_rep = v.verify(src.path)
    clean = outcome(clean_rep)
    noise = layer_noise(clean_rep)
    cases, na = damage.generate(src.path, seed, per_kind, kinds)
    rec: dict[str, Any] = {
        "file": str(src.path),
        "origin": src.origin,
        "model": Path(src.model).name,
        "version": src.version,
        "n_tokens": src.n_tokens,
        "stratum": list(src.stratum),
        "clean": clean,
        "layer_noise": noise,
        "not_applicable": na,
        "cases": [],
    }
    eta = clean["seconds"] * len(cases)
    print(
        f"  {src.path.name}: clean {clean['verdict']} margin {clean['margin']}; {len(cases)} cases, ~{eta:.0f} s",
        flush=True,
    )
    for case in cases:
        out = damage.write_damaged(case, scratch)
        try:
            got = outcome(v.verify(out))
        finally:
            out.unlink()
        row = {**case.to_dict(), **got}
        key = f"{case.where.get('block')}/{case.where.get('part')}/{case.where.get('layer')}"
        if case.kind.startswith("flip") and case.where.get("region") == "body" and key in noise:
            row["noise"] = noise[key]
        rec["cases"].append(row)
    return rec


def run(
    sources: list[Source], seed: int, per_kind: int, lib_v4: str | None, kinds: list[str] | None
) -> list[dict[str, Any]]:
    """Every file, grouped by model and library."""
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="slotfile-detect-") as tmp:
        for (model, lib), files in _groups(sources, lib_v4):
            print(
                f"{Path(model).name} ({'v4 library' if lib else 'installed llama-cpp-python'}): {len(files)} files",
                flush=True,
            )
            with Verifier(VerifyOptions(model=model, deep=True, llama_lib=lib)) as v:
                for src in files:
                    records.append(run_file(v, src, seed, per_kind, Path(tmp), kinds))
    return records


def estimate(sources: list[Source], per_kind: int, kinds: list[str] | None = None) -> float:
    """A rough run time in seconds (measured on this loaded 2-core machine: a median 3.9 s per deep verify
    of a 38-token Gemma 3 270M file, 0.2 s for a fixture model, a few seconds per model load)."""
    per_file = 1 + per_kind * sum(len(damage.KINDS[k]) for k in kinds or damage.KINDS)
    gemma = sum(per_file * (3.0 + 0.025 * s.n_tokens) for s in sources if s.family.startswith("gemma-3"))
    return gemma + sum(3.0 + 0.3 * per_file for s in sources if not s.family.startswith("gemma-3"))


def default_v4_lib() -> str | None:
    """The v4 library scripts/build-llama-v4.sh cached (the only one, or the newest)."""
    found = sorted((CACHE / "llama-v4").glob("*/bin"), key=lambda p: p.stat().st_mtime)
    return str(found[-1]) if found else None


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=30, help="corpus files (spread over the strata)")
    ap.add_argument("--fixtures", type=int, default=6, help="committed fixtures with checkpoints")
    ap.add_argument("--cases-per-kind", type=int, default=1)
    ap.add_argument("--seed", type=int, default=25)
    ap.add_argument("--max-tokens", type=int, default=200, help="skip corpus files with more stored tokens")
    ap.add_argument("--kinds", help="comma list of kinds (default all: " + ",".join(damage.KINDS) + ")")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 2 corpus files and 1 fixture")
    ap.add_argument("--corpus", type=Path, default=CORPUS)
    ap.add_argument("--llama-lib-v4", default=default_v4_lib(), help="folder of the v4 libllama.so")
    ap.add_argument("--out", type=Path, help="the JSON of every case (default ~/.cache/slotfile/detect/seed-N.json)")
    ap.add_argument("--md", type=Path, help="the tables (default bench/detect.md, committed; --quick: none)")
    ns = ap.parse_args(argv)
    if ns.quick:
        ns.files, ns.fixtures = 2, 1
    kinds = ns.kinds.split(",") if ns.kinds else None
    for k in kinds or []:
        if k not in damage.KINDS:
            ap.error(f"unknown kind {k!r}")
    sources = select(corpus_sources(ns.corpus), ns.files, ns.max_tokens)
    sources += select(fixture_sources(), ns.fixtures, ns.max_tokens)
    if not ns.llama_lib_v4:
        sources = [s for s in sources if s.version != 4]
        print("no v4 library (scripts/build-llama-v4.sh): v4 files left out", flush=True)
    print(
        f"{len(sources)} files, seed {ns.seed}: about {estimate(sources, ns.cases_per_kind, kinds) / 60:.0f} min",
        flush=True,
    )
    # random bytes make NaN/inf values and block scales: the judge's numpy (dequantization, f16 to f64) warns
    # about them once per case; the verdict is what counts here
    warnings.filterwarnings("ignore", category=RuntimeWarning)
    t0, commit = time.monotonic(), _commit()  # the code that judged, not what HEAD is once the run ends
    records = run(sources, ns.seed, ns.cases_per_kind, ns.llama_lib_v4, kinds)
    meta = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "seed": ns.seed,
        "cases_per_kind": ns.cases_per_kind,
        "commit": commit,
        "argv": sys.argv[1:] if argv is None else list(argv),
        "seconds": round(time.monotonic() - t0, 1),
    }
    out = ns.out or CACHE / "detect" / f"seed-{ns.seed}{'-quick' if ns.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "files": records}, indent=1, default=str) + "\n")
    print(f"every case: {out}", flush=True)
    md = detect_report.markdown(meta, records)
    print(md)
    md_path = ns.md or (None if ns.quick else ROOT / "bench" / "detect.md")
    if md_path is not None:
        md_path.write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
