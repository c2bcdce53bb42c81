"""Coverage-guided fuzz campaign with atheris (libFuzzer) over the harnesses of tests/fuzz.

    .venv/bin/python bench/fuzz_atheris.py [HARNESS ...] [--runs N] [--max-time S] [--jobs K]
                                           [--parallel P] [--out bench/out/fuzz] [--summary F.json]

For each harness (default: the campaign's, tests.fuzz.harnesses.CAMPAIGN: slot, appendix,
gguf; the focused ones, parse, dump_json, inspect, repair, by name) it writes the seed corpus
(tests/fuzz/seeds.py) and runs ``--jobs`` libFuzzer processes on that corpus (each its own
``-seed`` and ``--runs / jobs`` executions, reloading what the others find), under
``nice -n 10``, until the runs or ``--max-time`` seconds, whichever comes first.  Every
slotfile module is instrumented (imported inside ``atheris.instrument_imports``).

* ``-timeout=TIMEOUT_S``: the hang bound of the instrumented run; every input slower than
  ``CONTRACT_S`` there is kept as ``slow-*`` and replayed uninstrumented with the whole final
  corpus, where each must finish within ``CONTRACT_S`` (1 s);
* ``-rss_limit_mb=RSS_LIMIT_MB``: peak RSS of each process bounded;
* every ``ALLOC_EVERY``-th input runs under tracemalloc: its peak Python/numpy allocation must
  stay under ``ALLOC_BASE + ALLOC_PER_BYTE * len(input)`` (no allocation sized by a length
  field); the replay measures every corpus input so;
* any exception out of a harness (ContractError included) is a finding: libFuzzer writes the
  input as ``crash-*`` into the harness's ``artifacts`` folder.

The summary (executions, seconds, exec/s, ``cov:`` / ``ft:`` of libFuzzer's last status line,
corpus size, peak RSS, findings, replay) goes to ``--summary`` (JSON) and is printed as a
markdown table.  ``--worker HARNESS`` is one libFuzzer process (the parent starts them).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Per process, and so a backstop: the RSS of a long run grows (the MEM lines of each log tell
# whether Python's live blocks grow with it); what bounds the library's memory per input is the
# allocation check below and the replay.
RSS_LIMIT_MB = 4096
MEM_EVERY = 20000
# Coverage instrumentation slows the library ~10x: libFuzzer's -timeout is the hang bound of the
# instrumented run; every input slower than CONTRACT_S there is kept as slow-* and, with the
# whole final corpus, replayed uninstrumented, where each must finish within CONTRACT_S.
TIMEOUT_S = 10
CONTRACT_S = 1.0
ALLOC_EVERY = 64
ALLOC_BASE = 4 << 20  # 4 MiB: rich tables, JSON text, construct containers of small inputs
ALLOC_PER_BYTE = 16  # the parsed structures and rendered text of an input of N bytes
HARNESS_NAMES = ("slot", "appendix", "gguf", "manifest")  # the campaign (tests.fuzz.harnesses.CAMPAIGN)
MAX_LEN = {"gguf": 65536}  # the others: tests/fuzz/seeds.MAX_LEN


def _worker(name: str, corpus: Path, artifacts: Path, libfuzzer_args: list[str]) -> None:
    import atheris

    with atheris.instrument_imports(include=["slotfile"]):
        # every module of the package, so that lazily imported ones are instrumented too
        import importlib
        import pkgutil

        import slotfile

        for mod in pkgutil.walk_packages(slotfile.__path__, "slotfile."):
            if not mod.name.startswith("slotfile.llama.worker") and not mod.name.endswith(".__main__"):
                importlib.import_module(mod.name)
    from tests.fuzz.harnesses import HARNESSES, ContractError, traced_peak

    harness = HARNESSES[name]
    count = [0]

    def one_input(data: bytes) -> None:
        count[0] += 1
        if count[0] % MEM_EVERY == 0:
            # Python's live blocks against the process RSS: a leak in the harnessed code grows
            # the first, libFuzzer's own bookkeeping (corpus, features, tables) only the second
            rss_kib = int(open("/proc/self/statm").read().split()[1]) * 4
            print(f"MEM #{count[0]} python_blocks={sys.getallocatedblocks()} rss_mib={rss_kib >> 10}", file=sys.stderr)
        if count[0] % ALLOC_EVERY:
            t0 = time.perf_counter()
            harness(data)
            if time.perf_counter() - t0 > CONTRACT_S:
                (artifacts / f"slow-{hashlib.sha1(data).hexdigest()}").write_bytes(data)
            return
        peak = traced_peak(harness, data)
        bound = ALLOC_BASE + ALLOC_PER_BYTE * len(data)
        if peak > bound:
            raise ContractError(f"{name}: peak allocation {peak} bytes for a {len(data)}-byte input (bound {bound})")

    argv = [sys.argv[0], *libfuzzer_args, f"-artifact_prefix={artifacts}/", str(corpus)]
    atheris.Setup(argv, one_input)
    atheris.Fuzz()


def _write_seeds(name: str, corpus: Path) -> int:
    from tests.fuzz.seeds import corpora

    corpus.mkdir(parents=True, exist_ok=True)
    seeds = corpora()[name]
    for seed, data in seeds.items():
        (corpus / f"seed-{seed}").write_bytes(data)
    return len(seeds)


_STATUS = re.compile(
    r"^#(\d+)\s+(\w+)\s+cov: (\d+) ft: (\d+) corp: (\d+)/(\S+)(?: lim: (\d+))? exec/s: (\d+) rss: (\d+)Mb", re.M
)


def campaign(name: str, runs: int, max_time: int, out: Path, jobs: int = 1) -> dict[str, Any]:
    """One harness: ``jobs`` libFuzzer processes on one corpus (each ``runs / jobs`` executions,
    its own ``-seed``, reloading what the others add), then the replay of the corpus."""
    from tests.fuzz.seeds import MAX_LEN as SLOT_MAX_LEN

    hdir = out / name
    corpus, artifacts = hdir / "corpus", hdir / "artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    n_seeds = _write_seeds(name, corpus)
    args = [
        f"-runs={-(-runs // jobs)}",
        f"-max_total_time={max_time}",
        f"-timeout={TIMEOUT_S}",
        f"-rss_limit_mb={RSS_LIMIT_MB}",
        f"-max_len={MAX_LEN.get(name, SLOT_MAX_LEN)}",
        "-print_final_stats=1",
        f"-reload={1 if jobs > 1 else 0}",
    ]
    t0 = time.monotonic()
    procs = []
    for j in range(jobs):
        cmd = ["nice", "-n", "10", sys.executable, __file__, "--worker", name, "--corpus", str(corpus)]
        cmd += ["--artifacts", str(artifacts), "--", *args, f"-seed={j + 1}"]
        log = open(hdir / (f"log-{j}.txt" if jobs > 1 else "log.txt"), "w")
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT), log))
    rcs = []
    for proc, log in procs:
        rcs.append(proc.wait())
        log.close()
    wall = time.monotonic() - t0
    texts = [p.read_text(errors="replace") for p in sorted(hdir.glob("log*.txt"))]
    execs = [_executions(t) for t in texts]
    last = max((s[-1] for t in texts if (s := _STATUS.findall(t))), key=lambda s: int(s[2]), default=None)
    peaks = [int(m.group(1)) for t in texts if (m := re.search(r"stat::peak_rss_mb:\s+(\d+)", t))]
    findings = sorted(p.name for p in artifacts.iterdir() if not p.name.startswith("slow-"))
    res = subprocess.run(
        [sys.executable, __file__, "--replay", name, "--corpus", str(corpus), "--artifacts", str(artifacts)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    try:
        rep = json.loads(res.stdout)
    except ValueError:
        rep = {"errors": [res.stderr[-2000:]]}
    text = "\n".join(texts)
    return {
        "harness": name,
        "jobs": jobs,
        "exit_code": max(rcs),
        "seeds": n_seeds,
        "executions": sum(execs),
        "executions_per_job": execs,
        "seconds": round(wall, 1),
        "exec_per_s": round(sum(execs) / wall, 1) if wall else None,
        "cov": int(last[2]) if last else None,
        "ft": int(last[3]) if last else None,
        "corpus": len(list(corpus.iterdir())),
        "peak_rss_mb": max(peaks, default=None),
        "findings": findings,
        "slow_instrumented": sorted(p.name for p in artifacts.iterdir() if p.name.startswith("slow-")),
        "replay": rep,
        "uncaught": "Uncaught Python exception" in text,
        "timeouts": "ALARM: working on the last Unit for" in text,
        "rss_exceeded": "out-of-memory (used:" in text,
    }


def _executions(text: str) -> int:
    """Executions of one libFuzzer log: its final stats, or its last status line."""
    if m := re.search(r"stat::number_of_executed_units:\s+(\d+)", text):
        return int(m.group(1))
    status = _STATUS.findall(text)
    return int(status[-1][0]) if status else 0


def replay(name: str, folders: list[Path]) -> dict[str, Any]:
    """Every input of ``folders`` through the harness without instrumentation: the slowest
    time (the contract: CONTRACT_S) and the largest peak allocation over its input size."""
    from tests.fuzz.harnesses import HARNESSES, traced_peak

    harness = HARNESSES[name]
    files = sorted(p for d in folders if d.is_dir() for p in d.iterdir() if not p.name.startswith("crash-"))
    slowest, slowest_file, alloc_excess, errors = 0.0, "", 0, []
    for p in files:
        data = p.read_bytes()
        try:
            harness(data)  # warm: first-use imports and caches are not the input's
            t0 = time.perf_counter()
            harness(data)
            dt = time.perf_counter() - t0
            peak = traced_peak(harness, data)
        except Exception as e:
            errors.append(f"{p.name}: {type(e).__name__}: {e}")
            continue
        if dt > slowest:
            slowest, slowest_file = dt, p.name
        alloc_excess = max(alloc_excess, peak - ALLOC_PER_BYTE * len(data))
    return {
        "inputs": len(files),
        "slowest_s": round(slowest, 3),
        "slowest_input": slowest_file,
        "max_alloc_over_16x_input": alloc_excess,
        "errors": errors,
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = "| harness | executions | seconds | exec/s | cov | ft | corpus | peak RSS MiB | slowest (replay) s "
    head += "| findings |\n"
    head += "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n"
    return head + "".join(
        f"| {r['harness']} | {r['executions']:,} | {r['seconds']:,} | {r['exec_per_s']} | {r['cov']} | {r['ft']} "
        f"| {r['corpus']} | {r['peak_rss_mb']} | {r['replay'].get('slowest_s')} "
        f"| {', '.join(r['findings']) or 'none'} |\n"
        for r in rows
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("harnesses", nargs="*", default=list(HARNESS_NAMES))
    ap.add_argument("--runs", type=int, default=1_000_000)
    ap.add_argument("--max-time", type=int, default=3600, help="seconds per harness")
    ap.add_argument("--time", action="append", default=[], help="HARNESS=SECONDS: another limit for one harness")
    ap.add_argument("--parallel", type=int, default=1, help="harnesses run at once")
    ap.add_argument("--jobs", type=int, default=1, help="libFuzzer processes per harness, sharing its corpus")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "fuzz")
    ap.add_argument("--summary", type=Path, default=None)
    ap.add_argument("--worker", default=None)
    ap.add_argument("--replay", default=None)
    ap.add_argument("--corpus", type=Path)
    ap.add_argument("--artifacts", type=Path)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:cut])  # libFuzzer's own flags follow "--" (worker only)
    if a.replay:
        print(json.dumps(replay(a.replay, [a.corpus, a.artifacts])))
        return 0
    if a.worker:
        _worker(a.worker, a.corpus, a.artifacts, argv[cut + 1 :])
        return 0
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(a.parallel) as pool:
        limits = {k: int(v) for k, v in (x.split("=") for x in a.time)}
        rows = list(pool.map(lambda h: campaign(h, a.runs, limits.get(h, a.max_time), a.out, a.jobs), a.harnesses))
    doc = {
        "rss_limit_mb": RSS_LIMIT_MB,
        "timeout_s": TIMEOUT_S,
        "alloc_bound": f"{ALLOC_BASE} + {ALLOC_PER_BYTE} * len(input), every {ALLOC_EVERY}th input",
        "runs_asked": a.runs,
        "jobs": a.jobs,
        "max_time_s": {h: limits.get(h, a.max_time) for h in a.harnesses},
        "python": sys.version.split()[0],
        "results": rows,
    }
    if a.summary:
        a.summary.write_text(json.dumps(doc, indent=1) + "\n")
    print(table(rows))
    bad = [r for r in rows if r["findings"] or r["exit_code"] != 0 or r["replay"].get("errors")]
    bad += [r for r in rows if (r["replay"].get("slowest_s") or 0) > CONTRACT_S]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
