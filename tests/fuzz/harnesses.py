"""Fuzz harnesses: functions of the fuzzer's bytes over the library's entry points.

``slot`` puts every slot-file entry point (reader, dump document, inspect renderer, repair
planners) through one input; ``appendix`` and ``gguf`` drive the SCKP/SDFT walkers and the
GGUF metadata reader.  The focused harnesses (``parse``, ``dump_json``, ``inspect``,
``repair``) take one slot-file entry point each, for working on a finding.

Every harness drives the entry point the way a user (or the CLI) would and touches every lazy
object it hands back.  The contract: no uncaught exception (a GGUF the reader cannot take is a
``ModelError`` / ``GGUFError``, every repair that cannot be done a ``Refused``; a slot file
never raises: its problems are recorded), every problem with a section and an offset inside
the file.  Time (1 s) and memory are bounded by the driver (bench/fuzz_atheris.py: libFuzzer's
``-timeout`` and ``-rss_limit_mb``) and by the smoke test (tests/test_fuzz_smoke.py:
tracemalloc).  A violation raises :class:`ContractError`.

Used by bench/fuzz_atheris.py (atheris/libFuzzer) and tests/test_fuzz_smoke.py (plain Python).
"""

from __future__ import annotations

import io
import json
import os
import re
import tempfile
import tracemalloc
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from slotfile.format import appendix as ap
from slotfile.format.records import Body, MemoryBlock, SlotFile


class ContractError(AssertionError):
    """The library broke the bad-input contract on this input."""


def traced_peak(harness: Callable[[bytes], None], data: bytes) -> int:
    """The peak Python/numpy allocation (tracemalloc) of one harness run on ``data``."""
    tracemalloc.start()
    try:
        harness(data)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _check_problems(sf: SlotFile) -> None:
    for p in sf.problems:
        if not isinstance(p.section, str) or not p.section or not isinstance(p.offset, int):
            raise ContractError(f"problem without a section and an offset: {p!r}")
        if not 0 <= p.offset <= sf.size:
            raise ContractError(f"problem offset {p.offset} outside the file (size {sf.size}): {p.line()}")
        if "\n" in p.line():
            raise ContractError(f"problem line spans lines: {p.line()!r}")


def _touch_cells(ct: Any) -> int:
    if ct is None:
        return 0
    n = int(ct.cells["pos"].sum(dtype=np.int64)) if ct.cells.size else 0
    return n + int(ct.seq_ids.size) + ct.size + len(bytes(ct.raw[:16]))


def _touch_block(blk: MemoryBlock) -> int:
    n = blk.size + blk.n_cells() + int(blk.positions().size) + len(blk.active_streams())
    for st in blk.streams:
        n += int(st.positions.size) + _touch_cells(st.cells)
    n += _touch_cells(blk.cells)
    for r in blk.runs():
        arr = r.array()
        n += arr.size + len(r.type_name) + (r.elements or 0) + r.data.length
        if arr.size:
            n += int(arr.reshape(-1)[:4].view(np.uint8).sum())  # read the first and last bytes
            n += int(arr.reshape(-1)[-1:].view(np.uint8).sum())
    return n


def _touch_body(body: Body | None) -> int:
    if body is None:
        return 0
    n = body.size + len(body.memory_class) + len(body.alternatives)
    if body.layout is not None:
        n += len(body.layout.describe())
    for blk in body.blocks:
        n += _touch_block(blk)
    return n


def walk(sf: SlotFile) -> int:
    """Touch everything a user of :class:`SlotFile` could: a number, so nothing is optimised away."""
    _check_problems(sf)
    n = len(sf.verdict) + sf.n_tokens + len(sf.errors) + len(sf.file_problems) + len(sf.model_problems)
    n += sum(len(p.line()) + len(p.to_dict()) for p in sf.problems)
    n += sum(s.offset + s.size for s in sf.sections)
    if sf.tokens is not None:
        tp = sf.tokens
        n += int(tp.tokens.sum(dtype=np.int64)) + tp.size + tp.ids_offset + len(tp.media) + tp.padding
    n += _touch_body(sf.body)
    for c in sf.checkpoints:
        n += c.n_tokens + c.pos_min + c.pos_max + c.end - c.offset
        for b in (c.tgt, c.dft, c.spec):
            n += b.data_offset + b.length + int(b.data.array().size) + (b.seq_id or 0) + _touch_body(b.body)
    for a in (sf.sckp, sf.draft):
        if a is not None:
            n += a.end - a.offset + a.version + a.count
            for b in (a.dft, a.spec):
                if b is not None:
                    n += b.length + int(b.data.array().size) + _touch_body(b.body)
    for _name, r in sf.value_runs():
        n += int(r.array().size)
    return n


def parse(data: bytes) -> None:
    """``parse_buffer`` and every lazy object it hands back."""
    from slotfile.format.reader import parse_buffer

    walk(parse_buffer(data))


def dump_json(data: bytes) -> None:
    """The ``dump --json`` document (with token ids) and the text form built from it."""
    from slotfile.format.reader import parse_buffer

    sf = parse_buffer(data)
    _check_problems(sf)
    _dump(sf)


def _dump(sf: SlotFile) -> None:
    from slotfile.cli.dump_cmd import text_lines
    from slotfile.report import to_json

    doc = to_json(sf, with_tokens=True)
    text = json.dumps(doc, ensure_ascii=True)  # no indent: the C encoder
    if json.loads(text)["verdict"] != sf.verdict:
        raise ContractError("the JSON verdict is not the file's")
    for line in text_lines(doc):
        if line.count("\n") != 1:
            raise ContractError(f"dump text line spans lines: {line!r}")


_CONSOLE: Any = None
# what escape_text (cli/terminal.py) escapes: none of it may reach a cell unescaped
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def inspect(data: bytes) -> None:
    """The ``inspect`` renderer (with --layers) into a rich Console over a StringIO."""
    from slotfile.format.reader import parse_buffer

    sf = parse_buffer(data)
    _check_problems(sf)
    for layers in (False, True):
        _render(sf, layers, full=True)


class _CellConsole:
    """Stands in for the rich Console of ``inspect``: takes what the renderer prints (tables,
    texts, strings) and checks every cell's text, without rich's layout work."""

    def print(self, *objects: Any, **_kw: Any) -> None:
        from rich.table import Table
        from rich.text import Text

        for obj in objects:
            if isinstance(obj, Table):
                texts = [obj.title] + [c for col in obj.columns for c in (col.header, *col._cells)]
            else:
                texts = [obj]
            for t in texts:
                plain = t.plain if isinstance(t, Text) else t
                if not isinstance(plain, str) and plain is not None:
                    raise ContractError(f"inspect printed a {type(plain).__name__}: {plain!r}")
                if plain and _UNSAFE.search(plain):
                    raise ContractError(f"inspect printed an unescaped control character: {plain!r}")


def _render(sf: SlotFile, layers: bool, full: bool) -> None:
    """``inspect_cmd.render``: through rich into a StringIO (``full``), or into
    :class:`_CellConsole` (every cell checked, rich's table layout skipped), passed to render."""
    global _CONSOLE
    from rich.console import Console

    from slotfile.cli import inspect_cmd

    if full and _CONSOLE is None:
        _CONSOLE = Console(file=io.StringIO(), width=120, highlight=False, markup=False, soft_wrap=False)
    console = _CONSOLE if full else _CellConsole()
    if full:
        console.file.seek(0)
        console.file.truncate()
    inspect_cmd.render(sf, None, layers, console=console)
    if full and "\x1b" in console.file.getvalue():
        raise ContractError("an escape sequence from the file reached the terminal")


_TMP: str | None = None


def _tmpdir() -> str:
    global _TMP
    if _TMP is None:
        base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        _TMP = tempfile.mkdtemp(prefix="slotfile-fuzz-", dir=base)
    return _TMP


def _write_input(data: bytes, name: str) -> str:
    path = os.path.join(_tmpdir(), name)
    with open(path, "wb") as f:
        f.write(data)
    return path


def _run_dry(command: str, path: str) -> None:
    """``repair.run`` as the CLI calls it, in dry-run mode, with no model."""
    from slotfile.repair import RepairOptions, run

    report = run(command, path, None, RepairOptions(), dry_run=True)
    json.dumps(report.to_json())
    report.lines()
    if report.outcome not in ("dry-run", "refused"):
        raise ContractError(f"{command} --dry-run: outcome {report.outcome}: {report.reason}")


def _plan(op_name: str, sf: SlotFile, workdir: str, with_model: bool) -> None:
    """One planner called directly on an open file, in dry-run mode.  ``with_model``: a model
    is named (never loaded in a dry run), so the planning goes past the "needs --model"
    refusals."""
    from slotfile.repair import Refused, RepairOptions
    from slotfile.repair.resave import resave
    from slotfile.repair.strip_draft import strip_draft
    from slotfile.repair.truncate import truncate_recover

    model = os.path.join(workdir, "model.gguf")
    op = {"truncate-recover": truncate_recover, "strip-draft": strip_draft, "re-save": resave}[op_name]
    if not with_model:
        opts = RepairOptions()
    elif op_name == "re-save":
        opts = RepairOptions(model=model, flash_attn=False, tokens="plain")
    else:
        opts = RepairOptions(model=model, flash_attn=True, type_k="q8_0", checkpoint_at=[1, 2])
    try:
        planned = op(sf, opts, workdir, dry_run=True)
        json.dumps(planned.report.to_json())
        planned.report.lines()
    except Refused as e:
        if "\n" in str(e):
            raise ContractError(f"a refusal spans lines: {e}") from None


# the dry-run plans of the repair harness: (sf, path of sf, scratch directory) -> None; the
# first two through repair.run (the CLI's way in: it opens the file itself)
REPAIR_PLANS: tuple[Callable[[SlotFile, str, str], None], ...] = (
    lambda sf, path, wd: _run_dry("truncate-recover", path),
    lambda sf, path, wd: _run_dry("strip-draft", path),
    lambda sf, path, wd: _plan("truncate-recover", sf, wd, with_model=True),
    lambda sf, path, wd: _plan("re-save", sf, wd, with_model=True),
    lambda sf, path, wd: _plan("truncate-recover", sf, wd, with_model=False),
    lambda sf, path, wd: _plan("strip-draft", sf, wd, with_model=False),
)
# the slot harness: the plans on its open file, and 1 input in 8 also through repair.run
SLOT_PLANS, SLOT_RUN_EVERY = REPAIR_PLANS[2:], 8


def _repair_input(data: bytes) -> tuple[str, str]:
    """The input as ``input.slot`` in an empty scratch directory: (path, directory)."""
    workdir = os.path.join(_tmpdir(), "repair")
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "input.slot")
    with open(path, "wb") as f:
        f.write(data)
    return path, workdir


def _nothing_written(workdir: str) -> None:
    left = sorted(os.listdir(workdir))
    if left != ["input.slot"]:
        raise ContractError(f"a dry run wrote into its directory: {left}")


def repair(data: bytes) -> None:
    """The repair planners in dry-run mode on a file in a scratch directory: nothing may be
    written there (or anywhere) but the input itself."""
    from slotfile.format.reader import open_slot_file

    path, workdir = _repair_input(data)
    sf = open_slot_file(path)
    try:
        for plan in REPAIR_PLANS[:4]:  # the direct no-model plans are what run() does
            plan(sf, path, workdir)
    finally:
        sf.close()
    _nothing_written(workdir)


def slot(data: bytes) -> None:
    """Every slot-file entry point on one input: the ``parse`` walk, the ``dump_json``
    document, the ``inspect`` renderer and one of the repair plans, all on one parse.

    This is the harness the million-execution campaign runs (2 cores cannot give each entry
    point its own million).  A CRC of the input picks, reproducibly, what varies: the repair
    plan (1 in 4 each, and 1 input in 8 also through ``repair.run``, which parses again),
    ``--layers`` (1 in 2) and whether rich lays the tables out (1 in 16; otherwise every
    cell's text is checked by :class:`_CellConsole`, skipping rich's layout work)."""
    from slotfile.format.reader import open_slot_file

    pick = zlib.crc32(data)
    path, workdir = _repair_input(data)
    sf = open_slot_file(path)
    try:
        walk(sf)
        _dump(sf)
        _render(sf, layers=bool(pick & 1), full=(pick >> 1) % 16 == 0)
        SLOT_PLANS[(pick >> 5) % len(SLOT_PLANS)](sf, path, workdir)
        if (pick >> 7) % SLOT_RUN_EVERY == 0:
            REPAIR_PLANS[(pick >> 10) % 2](sf, path, workdir)
    finally:
        sf.close()
    _nothing_written(workdir)


def gguf(data: bytes) -> None:
    """The GGUF metadata reader (``gguf_meta.scan``) and ``load_model_info`` with its vocabulary."""
    from slotfile.model import gguf as gguf_meta
    from slotfile.model.bridge import ModelError, load_model_info

    path = _write_input(data, "model.gguf")
    try:
        meta = gguf_meta.scan(path)
    except gguf_meta.GGUFError as e:
        if "\n" in str(e):
            raise ContractError(f"a GGUF error spans lines: {e}") from None
    else:
        for key in list(meta.fields):
            v = meta.get(key)
            arr = meta.array(key)
            if arr is not None:
                len(arr)
                if arr.item_type == gguf_meta.STRING:
                    s = arr.strings(errors="replace")
                    s[: min(len(s), 8)]
                elif arr.item_type != gguf_meta.ARRAY:
                    arr.view()[:8].tolist()
            repr(v)
    try:
        info = load_model_info(path)
    except ModelError:
        return
    len(info.tokens)
    info.n_vocab  # noqa: B018
    info.detokenize(np.arange(min(info.n_vocab, 64), dtype=np.int32))
    info.detokenize([0, 1, -1, 2**31 - 1, info.n_vocab])


def appendix(data: bytes) -> None:
    """The SCKP/SDFT walkers of :mod:`slotfile.format.appendix`: the first two bytes pick the offset
    the walk starts at (inside the rest), the rest is the file."""
    if len(data) < 2:
        return
    off = int.from_bytes(data[:2], "little")
    view = memoryview(data[2:])
    end = len(view)
    off = off % (end + 1)
    ap.magic_at(view, off, end)
    ap.cut_magics(view, off, end)
    ap.starts_with(view, off, b"SCKP", end)
    sr = ap.server_read(view, off)
    sr.astuple()
    h = ap.sckp_head(view, off, end, any_magic=True)
    if isinstance(h, ap.SckpHead):
        for item in ap.entries(view, h.end, end, count=min(h.count, 64)):
            _touch_frame(view, item, end)
        for item in ap.entries(view, h.end, end, stop_at_sdft=True):
            _touch_frame(view, item, end)
    d = ap.sdft_head(view, off, end)
    if isinstance(d, ap.SdftHead):
        body = ap.sdft_body(view, d, end)
        if isinstance(body, ap.SdftFrame):
            ap.blob_seq_id(view, body.dft.data_offset, body.dft.end)
    fb = ap.first_blob(view, off, end)
    if isinstance(fb, ap.BlobFrame):
        ap.blob_seq_id(view, fb.data_offset, fb.end)
    ap.blob_seq_id(view, off, end)


def _touch_frame(view: memoryview, item: Any, end: int) -> None:
    if isinstance(item, ap.EntryFrame):
        for b in (item.tgt, item.dft, item.spec):
            if b.end > end or b.data_offset > b.end:
                raise ContractError(f"entry {item.index}: blob {b} runs past the end ({end})")
            ap.blob_seq_id(view, b.data_offset, b.end)


# The campaign's harnesses: together they reach every entry point (bench/fuzz_atheris.py runs
# these by default).
def manifest(data: bytes) -> None:
    """A slotfile.manifest/1 manifest (slotfile seal): tests/fuzz/manifest_harness.py."""
    from tests.fuzz.manifest_harness import manifest as run

    run(data)


CAMPAIGN: dict[str, Callable[[bytes], None]] = {"slot": slot, "appendix": appendix, "gguf": gguf, "manifest": manifest}
# One slot-file entry point each, and all of it per input (both inspect forms through rich,
# every repair plan): to reproduce, minimise or dig into a finding of ``slot``.
FOCUSED: dict[str, Callable[[bytes], None]] = {
    "parse": parse,
    "dump_json": dump_json,
    "inspect": inspect,
    "repair": repair,
}
HARNESSES: dict[str, Callable[[bytes], None]] = {**CAMPAIGN, **FOCUSED}
