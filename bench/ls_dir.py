"""How fast ``slotfile ls`` reads a large --slot-save-path: N hard links of the fixture slot files
(spread over subdirectories, ages set apart), timed as a child process (min of --runs), with
the files per second of the whole command and of the in-process walk + structure read alone.

    python bench/ls_dir.py                 # 2000 files
    python bench/ls_dir.py --files 5000 --runs 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SLOTS = ROOT / "fixtures" / "slots"


def build(d: Path, n: int) -> None:
    srcs = sorted(p for p in SLOTS.iterdir() if p.suffix in (".slot", ".session"))
    now = time.time()
    for i in range(n):
        sub = d / f"d{i % 20:02d}"
        sub.mkdir(exist_ok=True)
        p = sub / f"slot{i:05d}.bin"
        os.link(srcs[i % len(srcs)], p)
    # hard links share one inode (one mtime): the ages are all the fixtures' own
    os.utime(d, (now, now))


def child(d: Path) -> tuple[float, dict]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "slotfile", "ls", str(d), "--json", "--settle", "0"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    dt = time.perf_counter() - t0
    if r.returncode not in (0, 4):
        raise SystemExit(f"ls failed ({r.returncode}): {r.stderr[-500:]}")
    return dt, json.loads(r.stdout)


def in_process(d: Path) -> float:
    sys.path.insert(0, str(ROOT))
    from slotfile.slotdir.walk import scan_dir, summarize

    t0 = time.perf_counter()
    scan = scan_dir(d, settle=0)
    for e in scan.slots:
        summarize(e)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="slotfile-ls-bench-") as tmp:
        d = Path(tmp)
        build(d, a.files)
        times = []
        doc: dict = {}
        for _ in range(a.runs):
            dt, doc = child(d)
            times.append(dt)
        walk = min(in_process(d) for _ in range(a.runs))
        n = doc["totals"]["files"]
        best = min(times)
        print(
            json.dumps(
                {
                    "files": n,
                    "bytes": doc["totals"]["bytes"],
                    "ls_seconds_min": round(best, 3),
                    "ls_files_per_s": round(n / best, 1),
                    "walk_and_read_seconds_min": round(walk, 3),
                    "walk_and_read_files_per_s": round(n / walk, 1),
                    "reported_by_ls_files_per_s": doc["files_per_second"],
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
