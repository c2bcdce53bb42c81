"""Hostile input: every mutation ends in a verdict with a located one-line reason.

The read-only paths (parse, the JSON of `dump --json`, the text of `inspect`) must never
raise, never hang (a per-input alarm), and name a section and an offset for every error.
The long campaign with memory bounds is bench/fuzz_campaign.py.
"""

from __future__ import annotations

import io
import json
import random
import signal
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console

from slotfile.format.reader import parse_buffer
from slotfile.format.records import SlotFile
from slotfile.report import to_json

from .conftest import SLOT_FILES
from .fuzzing import all_mutations, random_mutation

SMALL = [p for p in SLOT_FILES if p.stat().st_size <= 20_000]
PER_INPUT_SECONDS = 10  # a hang guard, not a speed target


@contextmanager
def time_bound(seconds: int) -> Iterator[None]:
    def boom(*_: object) -> None:
        raise TimeoutError(f"input took more than {seconds} s")

    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def check_read_only_paths(data: bytes, label: str, render: bool = True) -> SlotFile:
    from slotfile.cli import inspect_cmd

    with time_bound(PER_INPUT_SECONDS):
        sf = parse_buffer(data, label)
        assert not [p for p in sf.problems if p.code == "internal"], [p.line() for p in sf.problems]
        for p in sf.errors:
            assert p.section and 0 <= p.offset <= len(data), p.line()
            assert "\n" not in p.message and "Traceback" not in p.message
        json.dumps(to_json(sf, with_tokens=True))
        if not render:
            return sf
        inspect_cmd.render(sf, None, layers=False, console=Console(file=io.StringIO(), markup=False, highlight=False))
    return sf


@pytest.mark.parametrize("path", SMALL, ids=lambda p: p.name)
def test_every_length_field_and_section_mutation(path):
    n = 0
    for label, data in all_mutations(str(path)):
        # rendering the rich text is most of the cost: every 4th input goes through it too
        check_read_only_paths(data, f"{path.name}:{label}", render=n % 4 == 0)
        n += 1
    assert n > 20


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(idx=st.integers(0, len(SMALL) - 1), seed=st.integers(0, 2**32 - 1))
def test_random_mutations(idx, seed):
    data = SMALL[idx].read_bytes()
    label, mutated = random_mutation(data, random.Random(seed))
    check_read_only_paths(mutated, f"{SMALL[idx].name}:{label}")


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=0, max_size=512))
def test_random_bytes_behind_a_valid_header(tail):
    head = (SLOT_FILES[0].read_bytes())[:12]
    check_read_only_paths(head + tail, "random")
    check_read_only_paths(tail, "random-no-header")


# ---------------------------------------------------------------------------------------
# hostile models through the command line: one line, exit 8, at once, no big allocation
# ---------------------------------------------------------------------------------------

HOSTILE_MODELS = (
    "array claims more elements than the file holds",
    "numeric array claims more elements than the file holds",
    "string length runs past the end",
    "string length near 2**64 in a long array",
)


LAUNCH = r"""
import json, resource, subprocess, sys
r = subprocess.run(sys.argv[1:], capture_output=True, text=True, timeout=60)
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB, the largest of the command's tree
print(json.dumps([r.returncode, r.stdout, r.stderr, peak]))
"""


@pytest.mark.parametrize("command", ["verify", "inspect"])
@pytest.mark.parametrize("case", HOSTILE_MODELS)
def test_hostile_model_through_the_cli_is_one_line_exit_8(tmp_path, command, case):
    """``verify --model BAD.gguf`` (which also starts a llama.cpp worker on it) and ``inspect
    --model BAD.gguf``: the GGUF's own claim is refused with one line naming the key and its
    offset, exit 8, in seconds, no process of the command much bigger than Python itself."""
    import re
    import subprocess
    import sys

    from .conftest import ROOT
    from .test_gguf_meta import HOSTILE

    data, pattern = HOSTILE[case]
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data)
    argv = [sys.executable, "-m", "slotfile", command, str(SLOT_FILES[0]), "--model", str(bad)]
    r = subprocess.run([sys.executable, "-c", LAUNCH, *argv], cwd=ROOT, capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stderr[-2000:]  # the launcher itself (a timeout of the command lands here)
    rc, out, err, peak_kib = json.loads(r.stdout)
    lines = err.strip().splitlines()
    assert rc == 8 and len(lines) == 1 and str(bad) in lines[0], err
    assert re.search(pattern, lines[0]), lines[0]
    assert out == ""
    assert bad.read_bytes() == data  # input never modified
    assert peak_kib < 300 * 1024, f"the command peaked at {peak_kib} KiB"
