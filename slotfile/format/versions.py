"""Every state version slotfile reads, in one table (in the manner of gguf-py's
``READER_SUPPORTED_VERSIONS``): for each format and version, the llama.cpp line that writes it,
the layout features its bodies have, and the libraries that load it.

Two formats carry a version word at offset 4 of the header:

* ``GGSQ``, a slot file (``llama_state_seq_save_file``): the version is ``LLAMA_STATE_SEQ_VERSION``;
* ``GGSN``, a session file (``llama_state_save_file``): the version is ``LLAMA_SESSION_VERSION``.

One llama.cpp line bumps both together (2/9, 3/10, 4/11), and ``llama_state_*_load_file``
accepts only its own version exactly (``llama_context::state_seq_load_file`` /
``state_load_file``, src/llama-context.cpp), so a file loads only into a library of its line.

Adding version N: add one :class:`Version` per format to :data:`VERSIONS` (and the grammar
change for its new fields, slotfile.format.grammar); the reader, the loader messages and migrate
read the rest from here.  Sources: slot-format.md §3.1, §5, §7, §12 and §12.1; facts.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Literal

__all__ = [
    "CELL_EXT_SIZES",
    "READER_SUPPORTED_VERSIONS",
    "TRIAL_AHEAD",
    "VERSIONS",
    "Format",
    "NStream",
    "Version",
    "first_with_rotation",
    "known",
    "migrate_pair",
    "newest",
    "session_of",
    "state_of",
    "version_info",
]

Format = Literal["GGSQ", "GGSN"]  # FileFormat.GGSQ / .GGSN compare and hash equal to these


class Presence(StrEnum):
    """Whether the files of a version carry a field: the llama.cpp lines that write one version
    number did not all write the same bytes."""

    ALWAYS = "always"
    # added within the version's lifetime without a version bump: its files come both ways, and
    # the reader tries both layouts
    SOMETIMES = "sometimes"
    NEVER = "never"


# Whether a KV block starts with the ``n_stream`` word (``llama_kv_cache::state_write``): llama.cpp
# added it (unified-KV support) in mid-2025 without a version bump, so version-2 files come both
# ways and the reader also tries the layout without it ("legacy")
NStream = Presence


@dataclass(frozen=True, slots=True)
class Version:
    format: Format
    version: int  # the header's version word
    state_version: int  # LLAMA_STATE_SEQ_VERSION of the llama.cpp line that writes it
    session_version: int  # LLAMA_SESSION_VERSION of that line
    writer: str  # the llama.cpp line that writes it (inspect's version line, verify's messages)
    loaders: str  # the libraries that load it (llama.cpp loads only its own version)
    n_stream: NStream
    # the per-cell ext sizes (llama_kv_cell_ext) a KV block's cells may carry: 12 (x, y, tok) when
    # the model uses M-RoPE/IMROPE or PLE (llama_kv_cache::has_cell_ext, from 2026); 8 (x, y) from
    # some 2026 trees, mostly forks, that say version 2 or 3 (unverified which, slot-format.md §12).
    # The reader tries every size for every version (CELL_EXT_SIZES).
    cell_ext: tuple[int, ...]
    # checkpoint and draft blobs (llama_state_seq_get_data_ext) open with u32 io_magic 0xaf143cd8 and
    # i32 seq_id (llama_context::state_seq_get_data); older builds wrote the bare body (§5): the
    # 2026 builds that still say version 2 write it, earlier ones do not (the reader takes both)
    io_magic_prefix: Presence
    # every KV stream's data section holds u32 n_rot_k, n_rot_v after n_layer
    # (llama_kv_cache::state_write_data of llama.cpp 2026-10-06, §12.1)
    rotation_words: bool
    # GGSN only: output ids, logits and embeddings between the arch name and the memory (§7); the
    # version-9 llama.cpp of 2026-08 no longer writes them (read_body tries both)
    session_outputs: bool = False

    @property
    def key(self) -> tuple[str, int]:
        return (self.format, self.version)


_V2 = (
    "llama.cpp builds of mid-2024 to 2026-08 (KV blocks without n_stream until mid-2025; the 2026 builds "
    "write an 8-byte M-RoPE cell ext (x, y) and the io_magic blob prefix)"
)
_V3 = "llama.cpp of 2026 up to about October (llama-cpp-python 0.3.36 vendors this)"
_V4 = "llama.cpp from 2026-10-05 on (every KV stream records its K/V rotation widths n_rot_k, n_rot_v)"
_L2 = "llama-cpp-python releases up to 0.3.35 (llama.cpp 4df29be4f of 2026-08-16; scripts/build-llama-v2.sh)"
_L3 = "llama-cpp-python 0.3.36 (vendors llama.cpp of 2026-10-01)"
_L4 = "llama-cpp-python releases after 0.3.36 that vendor llama.cpp from October 2026 on"

_ALL: tuple[Version, ...] = (
    Version("GGSQ", 2, 2, 9, _V2, _L2, NStream.SOMETIMES, (0, 8), Presence.SOMETIMES, rotation_words=False),
    Version("GGSQ", 3, 3, 10, _V3, _L3, NStream.ALWAYS, (0, 8, 12), Presence.ALWAYS, rotation_words=False),
    Version("GGSQ", 4, 4, 11, _V4, _L4, NStream.ALWAYS, (0, 12), Presence.ALWAYS, rotation_words=True),
    Version(
        "GGSN",
        9,
        2,
        9,
        "llama.cpp builds of 2025 to 2026-08 (the older ones put output ids, logits, embeddings before the memory; "
        "KV blocks without n_stream until mid-2025)",
        _L2,
        NStream.SOMETIMES,
        (0, 8),
        io_magic_prefix=Presence.SOMETIMES,
        rotation_words=False,
        session_outputs=True,
    ),
    Version(
        "GGSN",
        10,
        3,
        10,
        "llama.cpp of 2026 up to about October (llama-cpp-python 0.3.36)",
        _L3,
        NStream.ALWAYS,
        (0, 8, 12),
        io_magic_prefix=Presence.ALWAYS,
        rotation_words=False,
    ),
    Version(
        "GGSN",
        11,
        4,
        11,
        "llama.cpp from 2026-10-05 on (as state version 4: every KV stream records n_rot_k, n_rot_v)",
        _L4,
        NStream.ALWAYS,
        (0, 12),
        io_magic_prefix=Presence.ALWAYS,
        rotation_words=True,
    ),
)

VERSIONS: Mapping[tuple[str, int], Version] = MappingProxyType({v.key: v for v in _ALL})
if len(VERSIONS) != len(_ALL):  # pragma: no cover - import-time guard
    raise RuntimeError("slotfile.format.versions: a (format, version) is listed twice")

READER_SUPPORTED_VERSIONS: Mapping[str, tuple[int, ...]] = MappingProxyType(
    {fmt: tuple(sorted(v.version for v in _ALL if v.format == fmt)) for fmt in ("GGSQ", "GGSN")}
)

# Every per-cell ext size any version's KV cells may carry, the newest line's first: the reader
# tries them all for every version (slotfile.format.layout.detect), in this order.
CELL_EXT_SIZES: tuple[int, ...] = tuple(
    dict.fromkeys(e for v in sorted(_ALL, key=lambda v: -v.state_version) for e in v.cell_ext)
)

# How far past the newest known version a file is still read by trial (as the newest layout
# with a few unknown words per KV stream, with a warning); anything further is refused.
TRIAL_AHEAD = 2


def version_info(fmt: str, version: int | None) -> Version | None:
    """The entry of ``fmt`` version ``version``; None for a version slotfile does not know."""
    return VERSIONS.get((str(fmt), version)) if version is not None else None


def known(fmt: str) -> tuple[int, ...]:
    """The versions of ``fmt`` slotfile reads exactly, ascending (() for another format)."""
    return READER_SUPPORTED_VERSIONS.get(str(fmt), ())


def newest(fmt: str) -> int:
    return max(READER_SUPPORTED_VERSIONS[str(fmt)])


def first_with_rotation(fmt: str) -> int:
    """The first version of ``fmt`` whose KV streams carry the rotation words (4 / 11)."""
    return min(v.version for v in _ALL if v.format == str(fmt) and v.rotation_words)


def migrate_pair(fmt: str) -> tuple[int, int]:
    """The versions migrate converts between: (the last without rotation words, the first with them)."""
    first = first_with_rotation(fmt)
    return (first - 1, first)


def session_of(state_version: int) -> int | None:
    """The session version of the llama.cpp line that writes ``state_version`` (3 -> 10)."""
    v = version_info("GGSQ", state_version)
    return v.session_version if v else None


def state_of(session_version: int) -> int | None:
    """The state version of the llama.cpp line that writes ``session_version`` (10 -> 3)."""
    v = version_info("GGSN", session_version)
    return v.state_version if v else None
