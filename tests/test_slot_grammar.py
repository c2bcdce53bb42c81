"""SlotGrammar: one object per file variant carries the parameters every memory-block parse
and build needs, so the reader and the writer cannot disagree on them."""

from __future__ import annotations

from pathlib import Path

import pytest

from slotfile.format import grammar as g
from slotfile.format.grammar_variant import SlotGrammar
from slotfile.format.reader import open_slot_file
from slotfile.format.writer import to_bytes

V4_SLOTS = Path(__file__).resolve().parent.parent / "fixtures" / "slots" / "v4"
V4_FILES = sorted(p for p in V4_SLOTS.iterdir() if p.suffix in (".slot", ".session"))


def test_one_instance_per_variant():
    assert SlotGrammar.of(False, 12, False, True) is SlotGrammar.of(False, 12, False, True)
    assert SlotGrammar.of(rot=True) is not SlotGrammar.of(rot=False)
    assert g.SlotGrammar is SlotGrammar


def test_the_params_follow_the_variant():
    sg = SlotGrammar.of(whole=True, ext=8, rot=True, extra=(1, 2))
    assert sg.kv_params == {"ext": 8, "whole": True, "rot": True, "trial_pre": 1, "trial_post": 2}
    assert sg.kv(True) is g.kv_block(True)
    assert SlotGrammar.of(legacy=True).kv(False) is g.kv_block_legacy(False)


@pytest.mark.parametrize("path", V4_FILES, ids=lambda p: p.name)
def test_v4_round_trip_keeps_the_rotation_words(path: Path):
    """The writer builds a version-4 body with its rotation words (before SlotGrammar it built
    them without ``rot`` and dropped 8 bytes per KV stream)."""
    sf = open_slot_file(path)
    try:
        assert sf.errors == [], [p.line() for p in sf.errors]
        assert sf.body is not None and sf.body.layout is not None and sf.body.layout.rot
        assert to_bytes(sf) == path.read_bytes()
    finally:
        sf.close()
