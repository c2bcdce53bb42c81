"""The version registry (slotfile/format/versions.py): its facts, and that the reader, the grammar,
layout detection and migrate read them from it (migrate.PAIRS is held equal to it)."""

from __future__ import annotations

import struct

import pytest

from slotfile.format import grammar as g
from slotfile.format import layout, read_version, reader
from slotfile.format import versions as V
from slotfile.format.reader import open_slot_file, parse_buffer
from slotfile.format.records import FileFormat, SlotFile

from .conftest import SLOTS


def test_supported_versions():
    assert V.READER_SUPPORTED_VERSIONS == {"GGSQ": (2, 3, 4), "GGSN": (9, 10, 11)}
    assert V.known(FileFormat.GGSQ) == (2, 3, 4) and V.known("unknown") == ()
    assert (V.newest("GGSQ"), V.newest(FileFormat.GGSN)) == (4, 11)
    assert V.version_info("GGSQ", 5) is None and V.version_info("GGSQ", None) is None
    assert V.version_info(FileFormat.GGSN, 11) is V.VERSIONS[("GGSN", 11)]


def test_one_llama_cpp_line_writes_each_state_and_session_pair():
    for v in V.VERSIONS.values():
        own = v.state_version if v.format == "GGSQ" else v.session_version
        assert own == v.version, v
        if v.format == "GGSQ":
            other = V.version_info("GGSN", v.session_version)
        else:
            other = V.version_info("GGSQ", v.state_version)
        assert other is not None
        assert (other.state_version, other.session_version) == (v.state_version, v.session_version)
        # the line's layout features are the same in both formats
        assert (other.n_stream, other.cell_ext, other.io_magic_prefix, other.rotation_words, other.loaders) == (
            v.n_stream,
            v.cell_ext,
            v.io_magic_prefix,
            v.rotation_words,
            v.loaders,
        )
    assert [V.session_of(s) for s in (2, 3, 4, 5)] == [9, 10, 11, None]
    assert [V.state_of(s) for s in (9, 10, 11, 12)] == [2, 3, 4, None]


def test_layout_features_by_version():
    rot = {k: v.rotation_words for k, v in V.VERSIONS.items()}
    assert rot == {
        ("GGSQ", 2): False,
        ("GGSQ", 3): False,
        ("GGSQ", 4): True,
        ("GGSN", 9): False,
        ("GGSN", 10): False,
        ("GGSN", 11): True,
    }
    assert [k for k, v in V.VERSIONS.items() if v.n_stream == V.NStream.SOMETIMES] == [("GGSQ", 2), ("GGSN", 9)]
    assert [k for k, v in V.VERSIONS.items() if v.io_magic_prefix != V.Presence.ALWAYS] == [("GGSQ", 2), ("GGSN", 9)]
    assert [k for k, v in V.VERSIONS.items() if v.session_outputs] == [("GGSN", 9)]
    assert all(12 in v.cell_ext for v in V.VERSIONS.values() if v.state_version >= 3)
    assert (V.first_with_rotation("GGSQ"), V.first_with_rotation("GGSN")) == (4, 11)
    assert (V.migrate_pair("GGSQ"), V.migrate_pair("GGSN")) == ((3, 4), (10, 11))


# ---------------------------------------------------------------------------------------
# the readers of the registry (the older tables are gone)
# ---------------------------------------------------------------------------------------


def test_the_older_tables_are_gone():
    """The reader's GGSQ_VERSIONS / GGSN_VERSIONS / TRIAL_AHEAD and the grammar's ROT_*_VERSION
    were second copies of the registry's facts; everything reads slotfile.format.versions now."""
    for mod, names in (
        (reader, ("GGSQ_VERSIONS", "GGSN_VERSIONS", "TRIAL_AHEAD")),
        (read_version, ("GGSQ_VERSIONS", "GGSN_VERSIONS", "TRIAL_AHEAD")),
        (g, ("ROT_STATE_VERSION", "ROT_SESSION_VERSION")),
    ):
        assert not [n for n in names if hasattr(mod, n)], mod.__name__


def test_migrate_versions_agree():
    """migrate converts between every state version the registry knows (issue 23: 2, 3 and 4)."""
    from slotfile.repair import migrate, migrate_versions

    assert V.known("GGSQ") == migrate_versions.STATES
    for fmt in (FileFormat.GGSQ, FileFormat.GGSN):
        assert tuple(migrate_versions.file_version(fmt, s) for s in migrate_versions.STATES) == V.known(fmt)
    assert V.first_with_rotation("GGSQ") == migrate.ROT_STATE


def test_layout_ext_sizes_are_the_registry_s():
    assert set(V.CELL_EXT_SIZES) == {e for v in V.VERSIONS.values() for e in v.cell_ext}
    assert layout.EXT_SIZES == V.CELL_EXT_SIZES == (0, 12, 8)  # the newest line's sizes tried first


def test_versions_in_messages_come_from_the_registry():
    unknown = parse_buffer(_with_version((SLOTS / "gemma3_iswa_fa.slot").read_bytes(), 2 + V.newest("GGSQ") + 1))
    (p,) = [p for p in unknown.errors if p.code == "bad-version"]
    assert p.message.endswith(f"(known: {', '.join(map(str, V.known('GGSQ')))})")
    assert read_version.rot_matters(SlotFile("x", 0, FileFormat.GGSQ, version=V.first_with_rotation("GGSQ") - 1))
    assert not read_version.rot_matters(SlotFile("x", 0, FileFormat.GGSQ, version=V.first_with_rotation("GGSQ") - 2))


@pytest.mark.parametrize("key", list(V.VERSIONS))
def test_reader_version_rules_agree(key: tuple[str, int]):
    fmt, version = key
    v = V.VERSIONS[key]
    sf = SlotFile("x", 0, FileFormat(fmt), version=version)
    assert read_version.has_rot(sf) == v.rotation_words
    assert read_version.may_be_legacy(sf) == (v.n_stream == V.NStream.SOMETIMES)
    assert read_version._newest(sf) == V.newest(fmt)


def _with_version(data: bytes, v: int) -> bytes:
    return data[:4] + struct.pack("<I", v) + data[8:]


def test_real_files_have_the_features_their_version_says():
    v3 = open_slot_file(SLOTS / "gemma3_iswa_fa.slot")
    v4 = open_slot_file(SLOTS / "v4" / "gemma3_iswa_fa.slot")
    for sf in (v3, v4):
        info = V.version_info(sf.format, sf.version)
        assert info is not None and not sf.problems
        assert sf.body is not None and sf.body.layout is not None
        assert sf.body.layout.rot == info.rotation_words
        assert not sf.body.layout.legacy and info.n_stream == V.NStream.ALWAYS
    # the same v3 body under a version word that says rotation words: refused, not misread
    bad = parse_buffer(_with_version((SLOTS / "gemma3_iswa_fa.slot").read_bytes(), 4))
    assert "version-layout" in [p.code for p in bad.errors]
