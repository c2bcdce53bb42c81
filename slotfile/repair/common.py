"""What every repair shares: its options, the retry state the runner hands it, its result,
its two failures, and the input as the repairs see it."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from slotfile.format.layout import PARTIAL_OF
from slotfile.format.reader import SlotFile
from slotfile.format.records import FileFormat, TokenForm
from slotfile.repair.report import Report
from slotfile.safewrite import Plan


class Refused(Exception):
    """The repair cannot be done, with a one-line reason."""


class Operational(Exception):
    """The job could not be done for an outside reason: worker, model, I/O."""


@dataclass(slots=True)
class RepairOptions:
    model: str | None = None
    draft_model: str | None = None
    flash_attn: bool | None = None  # truncate-recover: fills an unknown setting; re-save: the new one
    type_k: str | None = None
    type_v: str | None = None
    checkpoint_at: list[int] | None = None
    tokens: str | None = None  # re-save: "packed" or "plain"
    recompute: bool = False  # re-save: prefill instead of transposing V
    timeout: float = 600.0
    n_gpu_layers: int = 0
    llama_lib: str | None = None  # a folder holding libllama.so for every worker (--llama-lib)
    to_version: int | None = None  # migrate: the target state version


@dataclass(slots=True)
class Retry:
    """What earlier attempts learned (the runner sets it after a failed test-load)."""

    force_rebuild: str | None = None  # why the kept body is rebuilt anyway
    exclude_ckpt: dict[int, str] = field(default_factory=dict)  # input checkpoint index -> why
    exclude_dft: dict[int, str] = field(default_factory=dict)
    exclude_sdft: str | None = None


@dataclass(slots=True)
class Planned:
    """What an operation decided: the report so far and the plan to write (None in a dry run
    of a rebuild)."""

    report: Report
    plan: Plan | None = None
    identity: bool = False  # the plan reproduces the input byte for byte
    temps: list[str] = field(default_factory=list)
    test_draft: bool = False
    ckpt_map: list[int] | None = None  # input checkpoint index of each output checkpoint
    rebuilt_body: bool = False
    model_check: bool = False  # the output is also read against --model / --draft-model before it lands


def start(command: str, sf: SlotFile, dry_run: bool, temps: list[str] | None, sink: list[Report] | None) -> Planned:
    """A fresh report for ``sf``, handed to ``sink`` at once so a refusal still shows what
    was found before it."""
    report = Report(command, sf.path, input_size=sf.size, dry_run=dry_run)
    if sink is not None:
        sink.append(report)
    return Planned(report, temps=temps if temps is not None else [])


Planner = Callable[[SlotFile, RepairOptions, str, Planned, Retry], Planned]


# what the runner calls: (sf, opts, workdir, *, dry_run, temps, sink, retry) -> Planned
Operation = Callable[..., Planned]


def operation(command: str) -> Callable[[Planner], Operation]:
    """Give a planner ``(sf, opts, workdir, out, retry)`` the runner's operation signature
    ``(sf, opts, workdir, *, dry_run, temps, sink, retry)``: ``out`` is :func:`start`'s
    fresh result (``out.report.dry_run`` says whether this is a dry run) and ``retry`` is
    never None."""

    def wrap(planner: Planner) -> Operation:
        @functools.wraps(planner)
        def op(
            sf: SlotFile,
            opts: RepairOptions,
            workdir: str,
            *,
            dry_run: bool = False,
            temps: list[str] | None = None,
            sink: list[Report] | None = None,
            retry: Retry | None = None,
        ) -> Planned:
            return planner(sf, opts, workdir, start(command, sf, dry_run, temps, sink), retry or Retry())

        return op

    return wrap


def header_tokens_ok(sf: SlotFile) -> None:
    """Refuse files whose header or token payload is not readable (nothing can be saved)."""
    if sf.format == FileFormat.GGSN:
        raise Refused("a whole-context session file (GGSN): the repair commands handle slot files (GGSQ)")
    if sf.format != FileFormat.GGSQ:
        raise Refused("not a slot file (no GGSQ magic)")
    bad = [p for p in sf.errors if p.section in ("header", "tokens") or p.section.startswith("tokens")]
    if bad or sf.tokens is None or (sf.tokens.form == TokenForm.PACKED and sf.tokens.raw is None):
        why = bad[0].line() if bad else "the token payload cannot be read"
        raise Refused(f"{why}: without the tokens nothing that would load can be saved")


def body_ok(sf: SlotFile) -> bool:
    return (
        sf.body is not None
        and sf.body.layout is not None
        and not any(p.section == "body" or p.section.startswith("body.") for p in sf.errors)
    )


def tgt_partial(sf: SlotFile) -> tuple[str, ...] | None:
    return PARTIAL_OF.get(sf.body.memory_class) if sf.body is not None and sf.body.layout is not None else None


def view_of(sf: SlotFile) -> memoryview:
    buf = sf.buffer
    return buf if isinstance(buf, memoryview) else memoryview(buf).cast("B") if len(buf) else memoryview(b"")


def words_of(sf: SlotFile) -> list[int]:
    n = sf.n_token_count or 0
    return [int(x) for x in np.frombuffer(view_of(sf), dtype="<i4", count=n, offset=12)]


def tokens_of(sf: SlotFile) -> list[int]:
    assert sf.tokens is not None
    return [int(x) for x in sf.tokens.tokens]


def prefill_request(
    sf: SlotFile,
    opts: RepairOptions,
    settings: dict[str, Any],
    words: list[int],
    at: list[int] | None,
    base: str,
    blobs: str,
) -> dict[str, Any]:
    """The worker's ``prefill`` request (llama/worker/program.py): prefill ``sf``'s tokens
    under ``settings``, take checkpoints at the n_tokens ``at``, save the state to ``base``
    with ``words`` as its token payload and the checkpoint / draft blobs to ``blobs``."""
    return {
        "op": "prefill",
        "model": opts.model,
        "draft_model": opts.draft_model,
        "settings": settings,
        "tokens": tokens_of(sf),
        "words": words,
        "checkpoints_at": at,
        "out": base,
        "blobs": blobs,
        "llama_lib": opts.llama_lib,
        "state_version": sf.version,
    }


def worker_ok(res: Any, what: str) -> None:
    """A llama.cpp worker result: a crash is operational, a refusal refuses the repair."""
    if res.ok:
        return
    if res.crashed:
        raise Operational(f"{what} failed: {res.message}")
    raise Refused(f"{what} failed: {res.message}")
