"""ggml tensor type ids and block sizes (ggml/include/ggml.h, ggml/src/ggml.c type_traits).

Only the sizes matter to slotfile: a cache row of ``ne`` elements of type ``t`` takes
``ne // blck_size * type_size`` bytes (``ggml_row_size``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GGMLType:
    id: int
    name: str
    blck_size: int
    type_size: int

    def row_elements(self, row_bytes: int) -> int | None:
        """Elements in a row of ``row_bytes`` bytes, or None when the size is not whole blocks."""
        if row_bytes % self.type_size:
            return None
        return row_bytes // self.type_size * self.blck_size

    def row_size(self, n_elements: int) -> int:
        return n_elements // self.blck_size * self.type_size


# (id, name, blck_size, type_size); removed ids 4, 5 (q4_2, q4_3) and 31-33, 36-38 are absent.
_TABLE = [
    (0, "f32", 1, 4), (1, "f16", 1, 2), (2, "q4_0", 32, 18), (3, "q4_1", 32, 20),
    (6, "q5_0", 32, 22), (7, "q5_1", 32, 24), (8, "q8_0", 32, 34), (9, "q8_1", 32, 36),
    (10, "q2_K", 256, 84), (11, "q3_K", 256, 110), (12, "q4_K", 256, 144),
    (13, "q5_K", 256, 176), (14, "q6_K", 256, 210), (15, "q8_K", 256, 292),
    (16, "iq2_xxs", 256, 66), (17, "iq2_xs", 256, 74), (18, "iq3_xxs", 256, 98),
    (19, "iq1_s", 256, 50), (20, "iq4_nl", 32, 18), (21, "iq3_s", 256, 110),
    (22, "iq2_s", 256, 82), (23, "iq4_xs", 256, 136), (24, "i8", 1, 1), (25, "i16", 1, 2),
    (26, "i32", 1, 4), (27, "i64", 1, 8), (28, "f64", 1, 8), (29, "iq1_m", 256, 56),
    (30, "bf16", 1, 2), (34, "tq1_0", 256, 54), (35, "tq2_0", 256, 66),
    (39, "mxfp4", 32, 17), (40, "nvfp4", 64, 36), (41, "q1_0", 128, 18), (42, "q2_0", 64, 18),
]

GGML_TYPE_COUNT = 43  # vendored ggml.h; ids at or above this come from newer builds or forks
TYPES: dict[int, GGMLType] = {i: GGMLType(i, n, b, s) for i, n, b, s in _TABLE}
BY_NAME: dict[str, GGMLType] = {t.name: t for t in TYPES.values()}

# The types llama.cpp accepts for --cache-type-k/v (common/arg.cpp kv_cache_types).
KV_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
# A transposed V cache is written element by element: only these types can be transposed.
TRANSPOSABLE = (0, 1, 30)


def type_name(type_id: int) -> str:
    t = TYPES.get(type_id)
    return t.name if t else f"unknown({type_id})"
