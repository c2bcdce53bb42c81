#!/usr/bin/env python3
"""``slotfile diff`` against ``cmp`` on two ~1 GiB slot files, measured in the same run.

    .venv/bin/python bench/diff.py [--gib 1.0] [--repeat 3] [--work DIR] [--out bench/out/diff.json] [--keep]

Builds one file with ``slotfile.format.synth`` (a real llama-server layout: GGSQ 3, packed
tokens, one KV block of 32 layers, 8 KV heads x 128, f16, 8,192 cells at the default size), copies
it byte for byte (B), and makes a third copy with one byte flipped in the last cell of the last V
layer (C, so that ``cmp`` too reads nearly all of it), and a pair an eighth the size (the peak RSS of
``diff`` must not follow the file size).  The page cache is warmed with one ``cmp``
of each pair; then, interleaved and rotating the order, ``cmp A B`` / ``slotfile diff A B`` and
``cmp A C`` / ``slotfile diff A C`` run as child processes.  Wall time: min over ``--repeat``
runs; peak RSS: the child's ``ru_maxrss`` through GNU time when installed (``os.wait4`` of a child
forked from this small process otherwise).  Prints one JSON object (and writes it to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIME = shutil.which("time") or ("/usr/bin/time" if Path("/usr/bin/time").exists() else None)

BUILD = """
import sys
from slotfile.format.synth import SynthSpec, write_slot
n = int(sys.argv[2])
print(write_slot(sys.argv[1], SynthSpec(n_cells=n, n_layer=32, n_embd_k=1024, n_embd_v=1024, seed=1)))
"""

LAST_V = """
import sys
from slotfile import open_slot_file
sf = open_slot_file(sys.argv[1])
st = sf.body.blocks[0].active_streams()[0]
v = st.v[-1]
print(v.data.offset + (v.n_cells - 1) * v.row_size + 3)
"""


def run(argv: list[str]) -> tuple[float, int, int]:
    """(wall seconds, peak RSS KiB, exit code) of argv as a child, stdout discarded."""
    rss_file = tempfile.NamedTemporaryFile(prefix="rss", delete=False)
    rss_file.close()
    full = ([TIME, "-f", "%M %x", "-o", rss_file.name] if TIME else []) + argv
    t0 = time.perf_counter()
    p = subprocess.Popen(full, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    rc = os.waitstatus_to_exitcode(status)
    rss = int(ru.ru_maxrss)
    if TIME:
        fields = Path(rss_file.name).read_text().split()
        try:
            rss, rc = int(fields[-2]), int(fields[-1])
        except (IndexError, ValueError):
            pass
    os.unlink(rss_file.name)
    if p.stderr is not None:
        p.stderr.close()
    return wall, rss, rc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="file size in GiB (default 1)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--work", type=Path, default=None, help="folder for the files (default a temporary one)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()

    work = args.work or Path(tempfile.mkdtemp(prefix="slotfile-bench-diff."))
    work.mkdir(parents=True, exist_ok=True)
    a, b, c = work / "a.slot", work / "b.slot", work / "c.slot"
    # bytes per cell: 32 layers x (K + V) x 1024 f16 = 128 KiB
    n_cells = max(16, int(args.gib * (1 << 30) / (32 * 2 * 1024 * 2)))
    py = sys.executable
    size = int(subprocess.check_output([py, "-c", BUILD, str(a), str(n_cells)], cwd=ROOT).decode())
    shutil.copyfile(a, b)
    shutil.copyfile(a, c)
    flip = int(subprocess.check_output([py, "-c", LAST_V, str(c)], cwd=ROOT).decode())
    with open(c, "r+b") as f:
        f.seek(flip)
        byte = f.read(1)
        f.seek(flip)
        f.write(bytes([byte[0] ^ 0x40]))

    # the resident set must not follow the file: the same diff on a file an eighth the size
    small, small_b = work / "small.slot", work / "small_b.slot"
    subprocess.check_output([py, "-c", BUILD, str(small), str(max(16, n_cells // 8))], cwd=ROOT)
    shutil.copyfile(small, small_b)
    run(["cmp", str(small), str(small_b)])
    small_rss = max(run([py, "-m", "slotfile", "diff", str(small), str(small_b)])[1] for _ in range(2))

    cases = {
        "identical": (["cmp", str(a), str(b)], [py, "-m", "slotfile", "diff", str(a), str(b)]),
        "one byte flipped near the end": (["cmp", str(a), str(c)], [py, "-m", "slotfile", "diff", str(a), str(c)]),
    }
    for cmp_argv, _ in cases.values():  # warm the page cache
        run(cmp_argv)
    start = run([py, "-c", "import slotfile.cli.app"])  # interpreter start-up and imports
    results: dict[str, dict[str, list[float] | list[int] | int]] = {
        k: {"cmp_s": [], "diff_s": [], "diff_rss_kib": [], "cmp_rss_kib": [], "rc": []} for k in cases
    }
    for i in range(args.repeat):
        for name, (cmp_argv, diff_argv) in cases.items():
            order = [("cmp", cmp_argv), ("diff", diff_argv)]
            if i % 2:
                order.reverse()
            for what, argv in order:
                wall, rss, rc = run(argv)
                r = results[name]
                r[f"{what}_s"].append(wall)  # type: ignore[union-attr]
                r[f"{what}_rss_kib"].append(rss)  # type: ignore[union-attr]
                if what == "diff":
                    r["rc"].append(rc)  # type: ignore[union-attr]
    summary = {
        "schema": "slotfile.bench-diff/1",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load": os.getloadavg()},
        "file_bytes": size,
        "n_cells": n_cells,
        "layout": "GGSQ 3, packed tokens, 1 KV block, 32 layers, K and V f16 1024 wide, no appendix",
        "repeat": args.repeat,
        "startup_s": round(start[0], 3),
        "startup_rss_mib": round(start[1] / 1024, 1),
        "small_file_bytes": small.stat().st_size,
        "small_file_diff_peak_rss_mib": round(small_rss / 1024, 1),
        "rss_via": "GNU time" if TIME else "os.wait4",
        "cases": {},
    }
    for name, r in results.items():
        cmp_s, diff_s = min(r["cmp_s"]), min(r["diff_s"])  # type: ignore[type-var]
        summary["cases"][name] = {  # type: ignore[index]
            "cmp_s": round(cmp_s, 3),
            "diff_s": round(diff_s, 3),
            "ratio": round(diff_s / cmp_s, 3),
            "diff_peak_rss_mib": round(max(r["diff_rss_kib"]) / 1024, 1),  # type: ignore[type-var]
            "cmp_peak_rss_mib": round(max(r["cmp_rss_kib"]) / 1024, 1),  # type: ignore[type-var]
            "diff_exit_codes": sorted(set(r["rc"])),  # type: ignore[arg-type]
            "all_cmp_s": [round(x, 3) for x in r["cmp_s"]],  # type: ignore[union-attr]
            "all_diff_s": [round(x, 3) for x in r["diff_s"]],  # type: ignore[union-attr]
        }
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    if not args.keep:
        for p in (a, b, c, small, small_b):
            p.unlink(missing_ok=True)
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
