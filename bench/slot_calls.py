"""Replay a corpus configuration's recorded requests and read each slot's prompt calls from the server's log.

    .venv/bin/python bench/slot_calls.py SIDECAR.json [SIDECAR.json ...] --out DIR [--alone] [-- EXTRA SERVER ARGS]

Each ``SIDECAR.json`` is a corpus file's sidecar (bench/corpus.py): the server's argv and every request body
the slot got. The script starts that server again (its own binary and flags, another port, ``--slot-save-path
DIR``, ``-lv 4``), sends each slot's requests as the corpus did (all slots at once, one client thread a
slot; ``--alone``: one slot after another), saves every slot as ``DIR/sN.bin`` and prints, per slot, the
positions where the server started a new ``llama_decode`` call for its prompt: the ``cached n_tokens = X``
lines ``server_context_impl::update_slots`` logs each time it fills a batch.

Used for the sixteenth session's finding (bench/detect-skipped-retries.md): a 4-slot server's slot computed
with the other slots' prompts in its batches parts from every recompute at position 513, and the same
requests sent alone give a file that passes on statistics. ``llama_batch_allocr::split_equal`` cuts a batch
shared by k slots into n_ubatch / k tokens per slot, so the slot's pieces depend on the other slots'
prompts and on when they arrived, which the file does not keep.

Exit 1 (with a ``FAILED`` line on stderr each) when a request or a save got another answer than 200.

Stdlib only, like bench/corpus.py, whose server helpers it uses.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent.parent) not in sys.path:  # run as a script: bench/ is a namespace package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.corpus import _free_port, _http, running_server

CALL = re.compile(r"slot\s+\S+: id\s+(\d+) \| task \d+ \| cached n_tokens = (\d+), memory_seq_rm")


def server_argv(sidecar: dict[str, Any], out: Path, port: int, extra: Sequence[str]) -> tuple[Path, list[str]]:
    """The sidecar's llama-server and its arguments with another port and slot-save path, and ``-lv 4``."""
    argv = list(sidecar["server_argv"])
    for flag, value in (("--port", str(port)), ("--slot-save-path", str(out))):
        argv[argv.index(flag) + 1] = value
    return Path(argv[0]), [*argv[1:], "-lv", "4", *extra]


def send(base: str, sidecar: dict[str, Any], results: dict[int, list[Any]]) -> None:
    """One slot's recorded requests, in order, into ``results[slot]`` (their ``timings``)."""
    slot = int(sidecar["slot"])
    for rq in sidecar["requests"]:
        status, resp = _http("POST", base + rq["endpoint"], rq["body"])
        results.setdefault(slot, []).append(resp.get("timings") if status == 200 and isinstance(resp, dict) else status)


def calls_per_slot(log: str) -> dict[int, list[int]]:
    """Per slot, the positions its prompt calls started at, in the order the server logged them."""
    out: dict[int, list[int]] = {}
    for m in CALL.finditer(log):
        out.setdefault(int(m.group(1)), []).append(int(m.group(2)))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sidecars", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True, help="slot-save path and the server's log")
    ap.add_argument("--alone", action="store_true", help="one slot after another instead of all at once")
    args_in = list(sys.argv[1:] if argv is None else argv)
    cut = args_in.index("--") if "--" in args_in else len(args_in)  # after --: more llama-server arguments
    a = ap.parse_args(args_in[:cut])
    extra = args_in[cut + 1 :]
    sides = [json.loads(p.read_text()) for p in a.sidecars]
    a.out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    binary, args = server_argv(sides[0], a.out.resolve(), port, extra)
    log_path = a.out / "server.log"
    results: dict[int, list[Any]] = {}
    with running_server(binary, args, log_path, port) as base:
        if a.alone:
            for sd in sides:
                send(base, sd, results)
        else:
            threads = [threading.Thread(target=send, args=(base, sd, results)) for sd in sides]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        failed = [
            f"slot {slot}: request {i} answered {r}"
            for slot, rs in results.items()
            for i, r in enumerate(rs)
            if isinstance(r, int)
        ]
        for sd in sides:
            slot = int(sd["slot"])
            status, resp = _http("POST", f"{base}/slots/{slot}?action=save", {"filename": f"s{slot}.bin"})
            print(f"slot {slot}: saved {status} {resp}")
            if status != 200:
                failed.append(f"slot {slot}: save answered {status}")
    calls = calls_per_slot(log_path.read_text(errors="replace"))
    for slot in sorted(results):
        print(f"slot {slot}: timings {results[slot]}")
        print(f"slot {slot}: prompt calls start at {calls.get(slot, [])}")
    for line in failed:  # a run that did not replay every request or save every slot says so, and exits 1
        print(f"FAILED {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
