"""How fast ``slotfile ls DIR`` and ``slotfile verify DIR`` (structure only) read a large
--slot-save-path, beside the I/O baseline ``find DIR -type f | xargs cat > /dev/null`` measured
in the same run (the machine is shared: compare ratios, and read the load average printed).

The directory holds N copies (real files, not links), spread over 20 subdirectories, of
``--source fixtures``: the fixture slot files of both state versions (fixtures/slots/*.slot,
fixtures/slots/v4/*.slot: ~30 shapes, ~15 KiB each), or ``--source real``: the slot files real
llama-servers wrote (~/.cache/slotfile/corpus/{v3,v4}-native/*.bin, bench/corpus.md) under
``--max-kib`` (800: 150 files, ~115 KiB each).  ``--source real-distinct`` reads those real files
once each, no copies: every file a new shape, as in a server's directory where every prompt
has its own length (``--files`` does not apply).  Each command runs as a child process (start-up
included), ``--runs`` times; the best run is reported, with the child's peak RSS (ru_maxrss of
that child or of its largest forked worker) and the least CPU seconds (user + system, its
workers' included) of any run: on a loaded machine the files per CPU second say what idle
cores give, the wall-clock rate what this run got.

The last figures, with the before/after measured interleaved (one pass moves 20-30 % with the
load): README "Directory speed" (2026-12-04; memory: 2026-12-05).

    python bench/ls_dir.py                       # 100, 2000 and 20000 files, both sources
    python bench/ls_dir.py --files 2000 --runs 5 --source real
    python bench/ls_dir.py --files 2000 --source real --code /path/to/before --code .   # interleaved

``--realtime`` runs every command (and the ``cat``) under ``chrt -f 10`` (SCHED_FIFO, root): the
other sessions' processes on a shared machine then wait (the kernel keeps 5 % of each second
for them), and the wall clock is about what idle cores give.  Keep such runs short.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SLOTS = ROOT / "fixtures" / "slots"
CORPUS = Path(os.path.expanduser("~/.cache/slotfile/corpus"))
SOURCES = ("fixtures", "real", "real-distinct")


def sources(kind: str, max_kib: int) -> list[Path]:
    if kind == "fixtures":
        return sorted(p for d in (SLOTS, SLOTS / "v4") for p in d.iterdir() if p.suffix in (".slot", ".session"))
    found = sorted(p for d in ("v3-native", "v4-native") for p in (CORPUS / d).glob("*.bin"))
    got = [p for p in found if p.stat().st_size <= max_kib * 1024]
    if not got:
        raise SystemExit(f"no real-server slot files under {CORPUS} (bench/corpus.md says how to make them)")
    return got


def build(d: Path, n: int, srcs: list[Path]) -> int:
    """N copies, aged an hour (outside --settle); the bytes written."""
    old = time.time() - 3600
    total = 0
    for i in range(n):
        sub = d / f"d{i % 20:02d}"
        sub.mkdir(exist_ok=True)
        p = sub / f"slot{i:05d}.bin"
        shutil.copyfile(srcs[i % len(srcs)], p)
        os.utime(p, (old, old))
        total += p.stat().st_size
    return total


# Counts a child's JSON document in a process of its own: the bench process must stay small,
# for a child started from it (vfork + exec) takes its peak RSS as a floor of its own.
_COUNT = "import json,sys; d=json.load(open(sys.argv[1])); print((d.get('totals') or d['summary'])['files'])"


RT: list[str] = []  # --realtime: the prefix that runs a command under SCHED_FIFO


def child(args: list[str], out: Path, code: Path = ROOT) -> tuple[float, int, int, float]:
    """One slotfile command with --json (the slotfile package of checkout ``code``), its
    document written to ``out``: (seconds, peak RSS in KiB of that child or of its largest
    worker, the files its document counts, CPU seconds of that child and its workers: what
    idle cores would take, whatever the load)."""
    env = dict(os.environ, PYTHONPATH=str(code))
    t0 = time.perf_counter()
    with open(out, "wb") as f, tempfile.TemporaryFile() as err:
        p = subprocess.Popen([*RT, sys.executable, "-m", "slotfile", *args], stdout=f, stderr=err, env=env, cwd=code)
        _, status, ru = os.wait4(p.pid, 0)
        dt = time.perf_counter() - t0
        rc = os.waitstatus_to_exitcode(status)
        if rc not in (0, 4):
            err.seek(0)
            tail = err.read().decode(errors="replace").strip().splitlines()[-8:]
            raise SystemExit(f"slotfile {' '.join(args)} ({code}) failed ({rc}):\n" + "\n".join(tail))
    files = int(subprocess.run([sys.executable, "-c", _COUNT, str(out)], capture_output=True, check=True).stdout)
    return dt, ru.ru_maxrss, files, ru.ru_utime + ru.ru_stime


def measure(n: int, runs: int, kind: str, max_kib: int, codes: list[Path]) -> list[dict]:
    """One row per checkout in ``codes``, their runs interleaved (the load moves between runs)."""
    srcs = sources(kind, max_kib)
    n = len(srcs) if kind == "real-distinct" else n
    with tempfile.TemporaryDirectory(prefix="slotfile-ls-bench-") as tmp:
        d, doc = Path(tmp) / "dir", Path(tmp) / "doc.json"
        d.mkdir()
        size = build(d, n, srcs)
        load = os.getloadavg()
        cat: list[float] = []
        got: dict[Path, tuple[list, list]] = {c: ([], []) for c in codes}
        for _ in range(runs):
            t0 = time.perf_counter()
            subprocess.run([*RT, "sh", "-c", f"find {d} -type f | xargs cat > /dev/null"], check=True)
            cat.append(time.perf_counter() - t0)
            for c in codes:
                got[c][0].append(child(["ls", str(d), "--json", "--settle", "0", "--settle-wait", "0"], doc, c))
                got[c][1].append(child(["verify", str(d), "--json", "--settle", "0", "--settle-wait", "0"], doc, c))
        end = os.getloadavg()
        return [row(kind, n, size, load, end, min(cat), c, *got[c]) for c in codes]


def row(kind: str, n: int, size: int, load: tuple, end: tuple, cb: float, code: Path, ls: list, ver: list) -> dict:
    """The best run (least wall clock) of each command, and the least CPU of any run."""
    lsb, vb = min(ls, key=lambda r: r[0]), min(ver, key=lambda r: r[0])
    lsc, vc = min(r[3] for r in ls), min(r[3] for r in ver)
    assert lsb[2] == n and vb[2] == n
    return {
        "source": kind,
        "code": str(code),
        "files": n,
        "mib": round(size / 2**20, 1),
        "load_average_at_start": [round(x, 2) for x in load],
        "load_average_at_end": [round(x, 2) for x in end],
        "cat_seconds": round(cb, 3),
        "cat_files_per_s": round(n / cb),
        "ls_seconds": round(lsb[0], 3),
        "ls_files_per_s": round(n / lsb[0]),
        "ls_peak_rss_mib": round(lsb[1] / 1024, 1),
        "verify_seconds": round(vb[0], 3),
        "verify_files_per_s": round(n / vb[0]),
        "verify_peak_rss_mib": round(vb[1] / 1024, 1),
        "ls_cpu_seconds": round(lsc, 3),
        "ls_files_per_cpu_s": round(n / lsc),
        "verify_cpu_seconds": round(vc, 3),
        "verify_files_per_cpu_s": round(n / vc),
        "ls_time_over_cat": round(lsb[0] / cb, 1),
        "verify_time_over_cat": round(vb[0] / cb, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, action="append", help="repeatable (default 100, 2000, 20000)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--source", choices=SOURCES, action="append", help="repeatable (default fixtures, real)")
    ap.add_argument("--max-kib", type=int, default=800, help="--source real: the largest file copied")
    ap.add_argument(
        "--code",
        type=Path,
        action="append",
        help="a checkout to run (repeatable, interleaved; default: this one)",
    )
    ap.add_argument(
        "--realtime",
        action="store_true",
        help="run each command under chrt -f 10 (root): on a shared machine, the wall clock of idle cores",
    )
    a = ap.parse_args()
    RT[:] = ["chrt", "-f", "10"] if a.realtime else []
    rows = []
    for kind in a.source or ("fixtures", "real"):
        for n in (1,) if kind == "real-distinct" else a.files or (100, 2000, 20000):
            for r in measure(n, a.runs, kind, a.max_kib, [c.resolve() for c in a.code or [ROOT]]):
                rows.append(r)
                print(json.dumps(r), file=sys.stderr)  # as it goes: a 20,000-file run takes minutes
    head = {"cpus": os.cpu_count(), "python": sys.version.split()[0], "realtime": a.realtime}
    print(json.dumps({**head, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
