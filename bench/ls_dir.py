"""How fast ``slotfile ls DIR`` and ``slotfile verify DIR`` (structure only) read a large
--slot-save-path, beside the I/O baseline ``find DIR -type f | xargs cat > /dev/null`` measured
in the same run (the machine is shared: compare ratios, and read the load average printed).

The directory holds N copies (real files, not links) of the fixture slot files of both state
versions (fixtures/slots/*.slot, fixtures/slots/v4/*.slot: ~30 shapes), spread over 20
subdirectories.  Each command runs as a child process (start-up included), ``--runs`` times;
the best run is reported, with the child's peak RSS (ru_maxrss of that child alone) and its
CPU seconds (user + system): on a loaded machine the files per CPU second say what an idle
core gives, the wall-clock rate what this run got.

    python bench/ls_dir.py                       # 100, 2000 and 20000 files
    python bench/ls_dir.py --files 2000 --runs 5
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


def sources() -> list[Path]:
    return sorted(p for d in (SLOTS, SLOTS / "v4") for p in d.iterdir() if p.suffix in (".slot", ".session"))


def build(d: Path, n: int) -> int:
    """N copies, aged an hour (outside --settle); the bytes written."""
    srcs = sources()
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


def child(args: list[str]) -> tuple[float, int, dict, float]:
    """One slotfile command with --json: (seconds, peak RSS in KiB of that child, document,
    CPU seconds of that child: what an idle core would take, whatever the load)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    t0 = time.perf_counter()
    p = subprocess.Popen(
        [sys.executable, "-m", "slotfile", *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env
    )
    assert p.stdout is not None
    data = p.stdout.read()
    _, status, ru = os.wait4(p.pid, 0)
    dt = time.perf_counter() - t0
    rc = os.waitstatus_to_exitcode(status)
    if rc not in (0, 4):
        raise SystemExit(f"slotfile {' '.join(args)} failed ({rc})")
    return dt, ru.ru_maxrss, json.loads(data), ru.ru_utime + ru.ru_stime


def measure(n: int, runs: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="slotfile-ls-bench-") as tmp:
        d = Path(tmp)
        size = build(d, n)
        load = os.getloadavg()
        cat, ls, ver = [], [], []
        for _ in range(runs):
            t0 = time.perf_counter()
            subprocess.run(f"find {d} -type f | xargs cat > /dev/null", shell=True, check=True)
            cat.append(time.perf_counter() - t0)
            ls.append(child(["ls", str(d), "--json", "--settle", "0", "--settle-wait", "0"]))
            ver.append(child(["verify", str(d), "--json", "--settle", "0", "--settle-wait", "0"]))
        lsb, vb, cb = min(ls, key=lambda r: r[0]), min(ver, key=lambda r: r[0]), min(cat)
        assert lsb[2]["totals"]["files"] == n and vb[2]["summary"]["files"] == n
        return {
            "files": n,
            "mib": round(size / 2**20, 1),
            "load_average_at_start": [round(x, 2) for x in load],
            "cat_seconds": round(cb, 3),
            "cat_files_per_s": round(n / cb),
            "ls_seconds": round(lsb[0], 3),
            "ls_files_per_s": round(n / lsb[0]),
            "ls_peak_rss_mib": round(lsb[1] / 1024, 1),
            "verify_seconds": round(vb[0], 3),
            "verify_files_per_s": round(n / vb[0]),
            "verify_peak_rss_mib": round(vb[1] / 1024, 1),
            "ls_cpu_seconds": round(lsb[3], 3),
            "ls_files_per_cpu_s": round(n / lsb[3]),
            "verify_cpu_seconds": round(vb[3], 3),
            "verify_files_per_cpu_s": round(n / vb[3]),
            "ls_time_over_cat": round(lsb[0] / cb, 1),
            "verify_time_over_cat": round(vb[0] / cb, 1),
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, action="append", help="repeatable (default 100, 2000, 20000)")
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    rows = [measure(n, a.runs) for n in a.files or (100, 2000, 20000)]
    print(json.dumps({"cpus": os.cpu_count(), "python": sys.version.split()[0], "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
