"""Standalone fuzz campaign: every read-only command on mutated fixtures, as real processes.

    .venv/bin/python bench/fuzz_campaign.py [--inputs N] [--seed S] [--out bench/out/fuzz.json]

For each input (all length-field and section mutations of the small fixtures, then random
ones up to N) it runs `slotfile inspect`, `slotfile dump --json` and, when the command
exists, `slotfile verify` (no model), each under a time bound, and records the exit code,
the wall time and the child's peak RSS (wait4).  It fails (exit 1) when any command exits
outside the documented codes {0, 4}, prints a traceback, exceeds the time bound, or uses more
than BASE_RSS + the input's size.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.children import reap  # noqa: E402
from tests.fuzzing import all_mutations, random_mutation  # noqa: E402

SLOTS = ROOT / "fixtures" / "slots"
TIME_BOUND_S = 20.0
BASE_RSS_KIB = 150 * 1024  # the interpreter with numpy, rich, construct, gguf loaded


def run_measured(cmd: list[str], timeout: float) -> tuple[int, float, int, str]:
    """(exit code, seconds, peak RSS KiB, output tail) of one child, reaped with os.wait4 so
    the peak RSS is that child's own."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as so:
        p = subprocess.Popen(cmd, stdout=so, stderr=subprocess.STDOUT)
        status, ru, timed_out = reap(p, t0, timeout)
        if timed_out:
            return -999, time.perf_counter() - t0, 0, "timeout"
        p.returncode = os.waitstatus_to_exitcode(status)
        so.seek(0)
        text = so.read().decode(errors="replace")[-2000:]
    return p.returncode, time.perf_counter() - t0, ru.ru_maxrss, text


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--inputs", type=int, default=400, help="total inputs (systematic first, then random)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "fuzz.json")
    args = ap.parse_args()
    slotfile = [sys.executable, "-m", "slotfile"]
    has_verify = subprocess.run([*slotfile, "verify", "--help"], capture_output=True).returncode == 0
    small = sorted(p for p in SLOTS.iterdir() if p.suffix in (".slot", ".session") and p.stat().st_size <= 20_000)
    inputs: list[tuple[str, bytes]] = []
    for p in small:
        inputs += [(f"{p.name}:{label}", data) for label, data in all_mutations(str(p))]
    rng = random.Random(args.seed)
    rng.shuffle(inputs)
    inputs = inputs[: args.inputs]
    while len(inputs) < args.inputs:
        p = rng.choice(small)
        label, data = random_mutation(p.read_bytes(), rng)
        inputs.append((f"{p.name}:{label}", data))

    codes: Counter[str] = Counter()
    failures: list[dict[str, object]] = []
    peak_rss, slowest = 0, (0.0, "")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "input.slot"
        for i, (label, data) in enumerate(inputs):
            path.write_bytes(data)
            cmds = {"inspect": ["inspect", str(path)], "dump": ["dump", str(path), "--json"]}
            if has_verify:
                cmds["verify"] = ["verify", str(path)]
            for name, c in cmds.items():
                rc, secs, rss, text = run_measured(slotfile + c, TIME_BOUND_S)
                codes[f"{name}:{rc}"] += 1
                peak_rss = max(peak_rss, rss)
                if secs > slowest[0]:
                    slowest = (secs, f"{name} {label}")
                bad = rc not in (0, 4) or "Traceback" in text or rss > BASE_RSS_KIB + len(data) // 1024
                if bad:
                    failures.append({"input": label, "command": name, "rc": rc, "rss_kib": rss, "tail": text[-500:]})
            if (i + 1) % 50 == 0:
                print(f"{i + 1}/{len(inputs)} inputs, {len(failures)} failures", file=sys.stderr)
    result = {
        "inputs": len(inputs),
        "commands_run": sum(codes.values()),
        "exit_codes": dict(sorted(codes.items())),
        "peak_rss_mib": round(peak_rss / 1024, 1),
        "slowest": {"seconds": round(slowest[0], 3), "input": slowest[1]},
        "failures": failures[:50],
        "n_failures": len(failures),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "failures"}, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
