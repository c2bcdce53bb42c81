"""ggml tensor type ids and block sizes (ggml/include/ggml.h, ggml/src/ggml.c type_traits).

Only the sizes matter to slotfile: a cache row of ``ne`` elements of type ``t`` takes
``ne // blck_size * type_size`` bytes (``ggml_row_size``).

:class:`TypeId` spells the ids with the member names of ``gguf.GGMLQuantizationType``
(tests/test_grammar.py checks that they agree).  It is not that enum itself: importing
``gguf`` costs about 50 ms at start-up that ``dump`` and ``inspect`` without a model never pay,
the vendored ggml has an id gguf does not know yet (42, q2_0), and gguf sizes q8_1 with f32
scales (40 bytes) where ggml's ``block_q8_1`` has two f16 (36 bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class TypeId(IntEnum):
    """``enum ggml_type`` (the ids that are written into state files)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41
    Q2_0 = 42


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


# (id, ggml type_name, blck_size, type_size); removed ids 4, 5 (q4_2, q4_3) and 31-33, 36-38 are absent.
_TABLE: list[tuple[TypeId, str, int, int]] = [
    (TypeId.F32, "f32", 1, 4),
    (TypeId.F16, "f16", 1, 2),
    (TypeId.Q4_0, "q4_0", 32, 18),
    (TypeId.Q4_1, "q4_1", 32, 20),
    (TypeId.Q5_0, "q5_0", 32, 22),
    (TypeId.Q5_1, "q5_1", 32, 24),
    (TypeId.Q8_0, "q8_0", 32, 34),
    (TypeId.Q8_1, "q8_1", 32, 36),
    (TypeId.Q2_K, "q2_K", 256, 84),
    (TypeId.Q3_K, "q3_K", 256, 110),
    (TypeId.Q4_K, "q4_K", 256, 144),
    (TypeId.Q5_K, "q5_K", 256, 176),
    (TypeId.Q6_K, "q6_K", 256, 210),
    (TypeId.Q8_K, "q8_K", 256, 292),
    (TypeId.IQ2_XXS, "iq2_xxs", 256, 66),
    (TypeId.IQ2_XS, "iq2_xs", 256, 74),
    (TypeId.IQ3_XXS, "iq3_xxs", 256, 98),
    (TypeId.IQ1_S, "iq1_s", 256, 50),
    (TypeId.IQ4_NL, "iq4_nl", 32, 18),
    (TypeId.IQ3_S, "iq3_s", 256, 110),
    (TypeId.IQ2_S, "iq2_s", 256, 82),
    (TypeId.IQ4_XS, "iq4_xs", 256, 136),
    (TypeId.I8, "i8", 1, 1),
    (TypeId.I16, "i16", 1, 2),
    (TypeId.I32, "i32", 1, 4),
    (TypeId.I64, "i64", 1, 8),
    (TypeId.F64, "f64", 1, 8),
    (TypeId.IQ1_M, "iq1_m", 256, 56),
    (TypeId.BF16, "bf16", 1, 2),
    (TypeId.TQ1_0, "tq1_0", 256, 54),
    (TypeId.TQ2_0, "tq2_0", 256, 66),
    (TypeId.MXFP4, "mxfp4", 32, 17),
    (TypeId.NVFP4, "nvfp4", 64, 36),
    (TypeId.Q1_0, "q1_0", 128, 18),
    (TypeId.Q2_0, "q2_0", 64, 18),
]

TYPES: dict[int, GGMLType] = {int(i): GGMLType(int(i), n, b, s) for i, n, b, s in _TABLE}
BY_NAME: dict[str, GGMLType] = {t.name: t for t in TYPES.values()}

# The types llama.cpp accepts for --cache-type-k/v (common/arg.cpp kv_cache_types).
KV_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
# A transposed V cache is written element by element: only these types can be transposed.
TRANSPOSABLE = (TypeId.F32, TypeId.F16, TypeId.BF16)
# The numpy dtype of one element of the unquantized types (bf16 as its raw 16 bits).
ELEMENT_DTYPE: dict[int, str] = {TypeId.F32: "<f4", TypeId.F16: "<f2", TypeId.BF16: "<u2"}


def type_name(type_id: int) -> str:
    t = TYPES.get(type_id)
    return t.name if t else f"unknown({type_id})"
