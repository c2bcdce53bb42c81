"""The memory-block grammars of one file variant, in one object (in the manner of pyelftools'
``elf/structs.py``, whose ``ELFStructs`` carries the file's class and endianness).

A body's blocks are read and written the same way within one file, but differently between
files: the per-cell ext size (``llama_kv_cache::has_cell_ext``), the ``seq_id = -1`` variant of
a session file (``whole``, GGSN), the KV layout without ``n_stream`` (``legacy``, before
mid-2025), the rotation words of state version 4 / session version 11 (``rot``,
``llama_kv_cache::state_write_data`` of llama.cpp 2026-10-06) and the unknown words of a
version read by trial (``extra``).  The constructs read these as construct context parameters;
:class:`SlotGrammar` holds them, so a caller names the variant once and every parse and build
it does passes the same parameters (a writer that forgot ``rot`` dropped the rotation words).

``SlotGrammar.of(...)`` returns one cached instance per variant; the struct objects behind it
are the cached ``kv_block`` / ``kv_block_legacy`` / ``rec_block`` grammars, shared by every
variant (the variant is in the parameters, not in the structs).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from construct import Struct

from slotfile.format.grammar_core import ViewStream
from slotfile.format.grammar_memory import kv_block, kv_block_legacy, rec_block


@dataclass(frozen=True, slots=True)
class SlotGrammar:
    """The KV and REC block grammars of one variant, with the parameters they read."""

    whole: bool = False  # GGSN: a cell carries any number of seq ids
    ext: int = 0  # per-cell ext bytes of KV metadata (0, 8 or 12)
    legacy: bool = False  # KV blocks without n_stream (GGSQ 2 / GGSN 9 of before mid-2025)
    rot: bool = False  # every KV stream carries n_rot_k, n_rot_v after n_layer
    extra: tuple[int, int] = (0, 0)  # trial reading: unknown u32 words before v_trans / after n_layer

    @staticmethod
    @functools.cache
    def of(
        whole: bool = False, ext: int = 0, legacy: bool = False, rot: bool = False, extra: tuple[int, int] = (0, 0)
    ) -> SlotGrammar:
        """The one instance of this variant."""
        return SlotGrammar(bool(whole), int(ext), bool(legacy), bool(rot), (int(extra[0]), int(extra[1])))

    @staticmethod
    def of_layout(layout: Any, whole: bool) -> SlotGrammar:
        """The variant a parsed body was read as (:class:`slotfile.format.layout.Layout`)."""
        return SlotGrammar.of(whole, layout.ext, layout.legacy, layout.rot, layout.extra)

    @property
    def kv_params(self) -> dict[str, Any]:
        return {
            "ext": self.ext,
            "whole": self.whole,
            "rot": self.rot,
            "trial_pre": self.extra[0],
            "trial_post": self.extra[1],
        }

    def kv(self, has_v: bool = True) -> Struct:
        """The KV block grammar (``has_v=False``: MLA and indexer caches)."""
        return kv_block_legacy(has_v) if self.legacy else kv_block(has_v)

    def rec(self, n_rec: int, has_p: bool = False) -> Struct:
        return rec_block(n_rec, has_p)

    def parse_kv(self, stream: ViewStream, has_v: bool = True) -> Any:
        return self.kv(has_v).parse_stream(stream, **self.kv_params)

    def build_kv(self, obj: Any, out: Any, has_v: bool = True) -> None:
        """Write the KV block ``obj`` to the binary stream ``out``."""
        self.kv(has_v).build_stream(obj, out, **self.kv_params)

    def parse_rec(self, stream: ViewStream, n_rec: int, has_p: bool = False) -> Any:
        return self.rec(n_rec, has_p).parse_stream(stream, whole=self.whole)

    def build_rec(self, obj: Any, out: Any, n_rec: int, has_p: bool = False) -> None:
        self.rec(n_rec, has_p).build_stream(obj, out, whole=self.whole)
