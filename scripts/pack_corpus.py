"""Pack a corpus folder into at most 8 tar bundles of at most 15.5 MiB each and 62 MiB in all (what a lent GPU
machine may send back, scripts/device-gpu-corpus.sh), each member lzma-compressed: sidecars, logs and the extra
files first, then the slot files from the smallest, so that every configuration's short files come back before
the long ones; what does not fit is listed in the first bundle's ``index.txt``.

    python3 scripts/pack_corpus.py CORPUS_DIR OUT_DIR [EXTRA_FILE ...]

Unpack with ``tar xf bundle-*.tar`` and ``unxz *.xz``. Stdlib only.
"""

from __future__ import annotations

import io
import lzma
import sys
import tarfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

LIMIT = int(15.5 * 2**20)
BUNDLES = 8
TOTAL = 62 * 2**20


def _xz(path: Path) -> tuple[str, bytes]:
    return path.name + ".xz", lzma.compress(path.read_bytes(), preset=6)


def main(argv: list[str]) -> int:
    corpus, out = Path(argv[0]), Path(argv[1])
    extra = [Path(a) for a in argv[2:]]
    bins = sorted(corpus.glob("*.bin"), key=lambda p: p.stat().st_size)
    small = sorted(corpus.glob("*.json")) + sorted(corpus.glob("*.log")) + [e for e in extra if e.exists()]
    with ProcessPoolExecutor() as pool:
        packed_small = list(pool.map(_xz, small))
        packed_bins = list(pool.map(_xz, bins))
    bundles: list[list[tuple[str, bytes]]] = [[] for _ in range(BUNDLES)]
    sizes = [0] * BUNDLES
    left: list[str] = []
    for name, data in packed_small + packed_bins:
        cost = len(data) + 1024
        k = next((i for i in range(BUNDLES) if sizes[i] + cost <= LIMIT - 64 * 1024), None)
        if k is None or sum(sizes) + cost > TOTAL:
            left.append(name)
            continue
        bundles[k].append((name, data))
        sizes[k] += cost
    index = "packed:\n" + "".join(f"  {n} {len(d)}\n" for b in bundles for n, d in b)
    index += "left out (no room):\n" + "".join(f"  {n}\n" for n in left)
    bundles[0].append(("index.txt", index.encode()))
    for i, members in enumerate(bundles):
        if not members:
            continue
        with tarfile.open(out / f"bundle-{i}.tar", "w") as tar:
            for name, data in members:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    print(f"{sum(len(b) for b in bundles)} members in bundles, {len(left)} left out: {' '.join(left)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
