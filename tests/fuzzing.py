"""Mutations of valid files for the fuzz tests and the standalone campaign (bench/fuzz_campaign.py).

Every count and length field is located from a real parse, so the mutations hit the fields
that drive allocation and looping, not just random bytes.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Iterator
from dataclasses import dataclass

from slotfile.format.reader import open_slot_file
from slotfile.format.records import SlotFile


@dataclass(frozen=True)
class Field:
    offset: int
    width: int  # 4 or 8 bytes
    name: str


def length_fields(sf: SlotFile) -> list[Field]:
    """Every count / length word of a parsed file, with its offset and width."""
    out = [Field(8, 4, "header.n_token_count")]
    tp = sf.tokens
    if tp is not None and tp.form == "packed" and tp.raw is not None:
        c = tp.raw
        out += [
            Field(c.offset + 4, 4, "tokens.version"),
            Field(c.offset + 8, 4, "tokens.n_tokens"),
            Field(c.offset + 12 + 4 * int(c.n_tokens), 4, "tokens.n_media"),
        ]
    bodies = [("body", sf.body)] + [
        (f"ck{c.index}.{b.name}", b.body) for c in sf.checkpoints for b in (c.tgt, c.dft) if b.body is not None
    ]
    if sf.draft and sf.draft.dft and sf.draft.dft.body:
        bodies.append(("sdft.dft", sf.draft.dft.body))
    for name, body in bodies:
        if body is None:
            continue
        for blk in body.blocks:
            pre = f"{name}.{blk.role}"
            if blk.kind == "KV":
                out.append(Field(blk.offset, 4, f"{pre}.n_stream"))
                for st in blk.streams:
                    out.append(Field(st.offset, 4, f"{pre}.stream{st.index}.cell_count"))
                    if st.cells is not None:
                        vt = st.cells.offset + st.cells.size
                        out += [Field(vt, 4, f"{pre}.v_trans"), Field(vt + 4, 4, f"{pre}.n_layer")]
                        if st.cells.cells.size:
                            out.append(Field(st.cells.offset + 4, 4, f"{pre}.cell0.n_seq_id"))
            else:
                out.append(Field(blk.offset, 4, f"{pre}.cell_count"))
                if blk.cells is not None:
                    st = blk.cells.offset + blk.cells.size
                    out += [Field(st, 4, f"{pre}.s_trans"), Field(st + 4, 4, f"{pre}.n_layer")]
            for r in blk.runs():
                if r.transposed:
                    out += [
                        Field(r.offset + 4, 4, f"{pre}.{r.part}{r.index}.el_size"),
                        Field(r.offset + 8, 4, f"{pre}.{r.part}{r.index}.n_embd"),
                    ]
                elif r.part == "P":
                    out.append(Field(r.offset, 8, f"{pre}.P{r.index}.row_size"))
                else:
                    out += [
                        Field(r.offset, 4, f"{pre}.{r.part}{r.index}.type"),
                        Field(r.offset + 4, 8, f"{pre}.{r.part}{r.index}.row_size"),
                    ]
    if sf.sckp is not None:
        out += [Field(sf.sckp.offset + 4, 4, "sckp.version"), Field(sf.sckp.offset + 8, 4, "sckp.count")]
        for c in sf.checkpoints:
            out += [Field(c.offset, 8, f"ck{c.index}.n_tokens")]
            out += [Field(b.offset, 8, f"ck{c.index}.{b.name}.length") for b in (c.tgt, c.dft, c.spec)]
    if sf.draft is not None and sf.draft.dft is not None and sf.draft.spec is not None:
        out += [
            Field(sf.draft.offset + 4, 4, "sdft.version"),
            Field(sf.draft.dft.offset, 8, "sdft.dft.length"),
            Field(sf.draft.spec.offset, 8, "sdft.spec.length"),
        ]
    return out


def special_values(field: Field, size: int) -> list[int]:
    cap = (1 << (8 * field.width)) - 1
    vals = [0, 1, size - field.offset - field.width + 1, 2**31 - 1, 2**32 - 1, 2**64 - 1]
    return sorted({min(max(v, 0), cap) for v in vals})


def set_field(data: bytes, field: Field, value: int) -> bytes:
    fmt = "<I" if field.width == 4 else "<Q"
    return data[: field.offset] + struct.pack(fmt, value) + data[field.offset + field.width :]


def field_mutations(data: bytes, sf: SlotFile) -> Iterator[tuple[str, bytes]]:
    for f in length_fields(sf):
        if f.offset + f.width > len(data):
            continue
        for v in special_values(f, len(data)):
            yield f"{f.name}={v}", set_field(data, f, v)


def section_mutations(data: bytes, sf: SlotFile) -> Iterator[tuple[str, bytes]]:
    """Duplicated, dropped and reordered sections."""
    secs = [s for s in sf.sections if "." not in s.name and s.size]
    for s in secs:
        a, b = s.offset, s.offset + s.size
        yield f"dup:{s.name}", data[:b] + data[a:b] + data[b:]
        yield f"drop:{s.name}", data[:a] + data[b:]
    apps = [s for s in secs if s.name in ("sckp", "sdft")]
    if len(apps) == 2:
        x, y = apps
        yield (
            "swap:sckp,sdft",
            data[: x.offset] + data[y.offset : y.offset + y.size] + data[x.offset : x.offset + x.size],
        )


def random_mutation(data: bytes, rng: random.Random) -> tuple[str, bytes]:
    kind = rng.choice(("cut", "flip", "flips", "garbage", "splice"))
    n = len(data)
    if kind == "cut":
        k = rng.randrange(n + 1)
        return f"cut@{k}", data[:k]
    if kind in ("flip", "flips"):
        buf = bytearray(data)
        for _ in range(1 if kind == "flip" else rng.randint(2, 16)):
            i = rng.randrange(n)
            buf[i] ^= 1 << rng.randrange(8)
        return kind, bytes(buf)
    if kind == "garbage":
        k = rng.randrange(n + 1)
        return f"garbage@{k}", data[:k] + rng.randbytes(rng.randint(1, 256))
    i, j = sorted(rng.randrange(n + 1) for _ in range(2))
    return f"splice{i}:{j}", data[:i] + data[j:] + data[i:j]


def all_mutations(path: str) -> Iterator[tuple[str, bytes]]:
    data = open(path, "rb").read()
    sf = open_slot_file(path)
    yield from field_mutations(data, sf)
    yield from section_mutations(data, sf)
