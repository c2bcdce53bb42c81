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

from slotfile.reader import parse_buffer
from slotfile.records import SlotFile
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
        inspect_cmd.out = Console(file=io.StringIO(), markup=False, highlight=False)
        inspect_cmd.render(sf, None, layers=False)
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
