"""``slotfile identify``: which of the candidate models wrote a slot file.

Two stages:

1. **Metadata fit** (instant, no llama.cpp): the file read in each candidate's layout
   (:mod:`slotfile.model.expect`) and checked against it (:func:`check_against_model`): memory
   class, layers per cache, K/V row sizes from heads x head size, types, token ids below
   ``n_vocab``, positions below ``n_ctx_train``.  A candidate with an error there does not fit.
2. **Proof** (one model load per remaining candidate): the first :data:`PREFIX` stored tokens
   are prefilled in a fresh context with the file's own settings (cache types, flash attention,
   streams) through the llama.cpp worker (:class:`slotfile.llama.loader.LoaderPool`, op
   ``prefill``), and the K and V rows of the first :data:`~slotfile.seal.rows.LAYERS` layers of each KV cache are
   compared with the stored rows of the same positions.  Layer 0's K depends only on the token and its
   position, layer 1's on the tokens before it: a prefix recompute gives the same rows as the
   whole prompt did.  Bit-identical rows are ``identical``; rows whose worst head angle and norm
   ratio stay within what re-rounding into the cache type gives (:data:`NOISE`, the deep level's
   minimum floors) are ``within-noise``; anything else ``differs`` (another model of the same
   shape gives angles of tens of degrees).

A recurrent-only state (Mamba, RWKV) keeps no per-token rows: its proof recomputes every stored
token (at most :data:`MAX_RECURRENT_TOKENS`) and compares the R/S state of the first layers.

Candidates are ranked: fit, then proof (identical, within noise, not proven, differs), then the
distance (worst head angle).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from slotfile.format.records import LayerRun, ModelExpect, Severity, SlotFile, TokenForm
from slotfile.seal.rows import head_stats, kv_pairs, raw_rows, rec_pairs, rows_f64
from slotfile.verify.stats import tolerance_class

if TYPE_CHECKING:
    from slotfile.llama.loader import LoaderPool

PREFIX = 16  # stored tokens recomputed for the proof (8 or 16 cost the same within the noise: bench/seal.py)
PIPELINE = True  # start the next candidate's worker while this one proves
MAX_RECURRENT_TOKENS = 512  # a recurrent state needs every token recomputed
# worst head angle (degrees) and |ln norm ratio| that re-rounding into the cache type can give
# (the deep level's minimum noise floors, bench/deep_noise.py)
NOISE = {"float": (0.5, 0.03), "8-bit": (2.0, 0.05), "low-bit": (10.0, 0.1)}


class Fit(StrEnum):
    FITS = "fits"
    UNKNOWN = "unknown"  # the model's layout is not modelled: only the proof can tell
    NO_FIT = "no-fit"


class Proof(StrEnum):
    IDENTICAL = "identical"
    WITHIN_NOISE = "within-noise"
    NOT_PROVEN = "not-proven"
    DIFFERS = "differs"
    NOT_RUN = "not-run"


PROOF_ORDER = {Proof.IDENTICAL: 0, Proof.WITHIN_NOISE: 1, Proof.NOT_PROVEN: 2, Proof.NOT_RUN: 3, Proof.DIFFERS: 4}
FIT_ORDER = {Fit.FITS: 0, Fit.UNKNOWN: 1, Fit.NO_FIT: 2}


class IdentifyError(Exception):
    """Operational (exit 8): a candidate path that is not there, no GGUF among the candidates."""


@dataclass
class Candidate:
    path: str
    name: str | None = None
    arch: str | None = None
    fingerprint: str | None = None
    expect: ModelExpect | None = None
    note: str = ""  # why its layout is not modelled
    error: str | None = None  # unreadable GGUF

    @property
    def label(self) -> str:
        return self.name or Path(self.path).name


@dataclass
class Ranked:
    model: Candidate
    fit: Fit = Fit.FITS
    reasons: list[str] = field(default_factory=list)  # metadata misfits (or notes)
    proof: Proof = Proof.NOT_RUN
    proof_message: str = ""
    angle: float | None = None  # worst head angle over the compared rows (degrees)
    lnorm: float | None = None
    rows: int = 0  # rows compared
    layers: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    def key(self) -> tuple[int, int, float]:
        return (FIT_ORDER[self.fit], PROOF_ORDER[self.proof], self.angle if self.angle is not None else 1e9)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.path,
            "name": self.model.name,
            "arch": self.model.arch,
            "fingerprint": self.model.fingerprint,
            "fit": str(self.fit),
            "reasons": self.reasons,
            "proof": str(self.proof),
            "proof_message": self.proof_message,
            "angle": None if self.angle is None else round(self.angle, 6),
            "lnorm": None if self.lnorm is None else round(self.lnorm, 6),
            "rows": self.rows,
            "layers": self.layers,
            "seconds": round(self.seconds, 4),
        }


@dataclass
class Identification:
    path: str
    ranking: list[Ranked] = field(default_factory=list)
    error: str | None = None  # the file cannot be read

    @property
    def best(self) -> Ranked | None:
        if not self.ranking:
            return None
        top = self.ranking[0]
        return top if top.fit != Fit.NO_FIT and top.proof in (Proof.IDENTICAL, Proof.WITHIN_NOISE) else None

    @property
    def verdict(self) -> str:
        """identified (proven), likely (fits, not provable here), ambiguous (two proven),
        none (no candidate fits or all differ), error."""
        if self.error is not None:
            return "error"
        proven = [r for r in self.ranking if r.fit != Fit.NO_FIT and r.proof in (Proof.IDENTICAL, Proof.WITHIN_NOISE)]
        if len(proven) > 1 and proven[0].proof == proven[1].proof and proven[0].angle == proven[1].angle:
            return "ambiguous"
        if proven:
            return "identified"
        if any(r.fit != Fit.NO_FIT and r.proof in (Proof.NOT_PROVEN, Proof.NOT_RUN) for r in self.ranking):
            return "likely"
        return "none"

    def to_dict(self) -> dict[str, Any]:
        b = self.best
        return {
            "path": self.path,
            "verdict": self.verdict,
            "model": b.model.path if b else None,
            "proof": str(b.proof) if b else None,
            "ranking": [r.to_dict() for r in self.ranking],
            "error": self.error,
        }


# --------------------------------------------------------------------------------------- candidates


def collect_models(paths: list[Path]) -> list[str]:
    """GGUF files named or found (recursively, sorted, symlinks to files followed) in folders."""
    out: list[str] = []
    for p in paths:
        if p.is_dir():
            found = sorted(str(q) for q in p.rglob("*.gguf") if q.is_file())
            if not found:
                raise IdentifyError(f"{p}: no *.gguf model under it")
            out += found
        elif p.is_file():
            out.append(str(p))
        else:
            raise IdentifyError(f"{p}: no such file or directory")
    return list(dict.fromkeys(out))


def load_candidate(path: str) -> Candidate:
    from slotfile.model.bridge import ModelError, load_model_info
    from slotfile.model.expect import expect_from_model
    from slotfile.model.gguf import GGUFError
    from slotfile.seal.fingerprint import fingerprint

    c = Candidate(path)
    try:
        info = load_model_info(path)
        fp = fingerprint(path)
    except (ModelError, GGUFError, OSError) as e:
        c.error = str(e)
        return c
    c.name, c.arch, c.fingerprint = fp.name, info.arch, fp.value
    try:
        c.expect = expect_from_model(info)
        if not c.expect.modelled:
            c.note = "; ".join(c.expect.notes) or "layout not modelled"
            c.expect = None
    except Exception as e:  # the expectation code does not know this model
        c.note = f"no expected layout ({type(e).__name__}: {e})"
    return c


# --------------------------------------------------------------------------------------- stage 1


def metadata_fit(path: Path, cand: Candidate) -> tuple[Ranked, SlotFile | None]:
    """The file read in the candidate's layout and checked against it."""
    from slotfile.format.reader import open_slot_file

    r = Ranked(cand)
    if cand.error is not None:
        r.fit, r.reasons = Fit.NO_FIT, [f"the model cannot be read: {cand.error}"]
        return r, None
    sf = open_slot_file(path, expect=cand.expect)
    if cand.expect is None:
        r.fit, r.reasons = Fit.UNKNOWN, [cand.note]
        return r, sf
    errors = [p for p in sf.model_problems if p.severity == Severity.ERROR]
    r.reasons = [f"{p.code}: {p.line()}" for p in (errors or sf.model_problems)][:4]
    if errors:
        r.fit = Fit.NO_FIT
        return r, sf
    if sf.body is None or sf.body.layout is None:
        r.fit = Fit.NO_FIT
        r.reasons = ["the body does not parse in this model's layout"]
    return r, sf


# --------------------------------------------------------------------------------------- stage 2


def _head_size(cand: Candidate, role: str, part: str) -> int:
    """Elements per head of the cache's K or V rows (0: the whole row as one vector)."""
    if cand.expect is None:
        return 0
    from slotfile.format.records import CacheExpect

    for blk in cand.expect.blocks:
        if isinstance(blk, CacheExpect) and blk.role == role:
            return max(0, int(blk.head_k if part == "K" else blk.head_v))
    return 0


def judge(r: Ranked, sf: SlotFile, rec: SlotFile, n: int, cand: Candidate) -> None:
    """Compare the stored rows with the recomputed ones; sets the proof on ``r``."""
    assert sf.body is not None
    if rec.body is None or rec.body.layout is None:
        r.proof, r.proof_message = Proof.NOT_PROVEN, "the recomputed state does not parse"
        return
    worst_a = worst_l = 0.0
    identical = True
    within = True
    rows = 0
    pairs: list[tuple[str, int, LayerRun, LayerRun, np.ndarray, np.ndarray]] = kv_pairs(sf.body, rec.body, n)
    if n == sf.n_tokens:  # a recurrent state is the whole prompt's: comparable only after all of it
        one = np.zeros(1, dtype=np.int64)
        for role, rl, sr, rr in rec_pairs(sf.body, rec.body):
            pairs.append((role, rl, sr, rr, one, one))
    for role, layer, a, b, ia, ib in pairs:
        if a.type_id != b.type_id or a.row_size != b.row_size:
            r.layers.append({"role": role, "layer": layer, "part": a.part, "status": "shape"})
            identical = within = False
            worst_a = max(worst_a, 90.0)
            continue
        same = bool(np.array_equal(raw_rows(a, ia), raw_rows(b, ib)))
        x, y = rows_f64(a, ia), rows_f64(b, ib)
        ang, ln = head_stats(x, y, _head_size(cand, role, a.part) if a.part in ("K", "V") else 0)
        lim_a, lim_l = NOISE[tolerance_class(a.type_id)]
        ok = same or (ang <= lim_a and ln <= lim_l)
        r.layers.append(
            {
                "role": role,
                "layer": layer,
                "part": a.part,
                "type": a.type_name,
                "cells": len(ia),
                "identical": same,
                "angle": round(ang, 6),
                "lnorm": round(ln, 6),
                "within_noise": ok,
            }
        )
        identical &= same
        within &= ok
        worst_a, worst_l = max(worst_a, ang), max(worst_l, ln)
        rows += len(ia)
    r.angle, r.lnorm, r.rows = worst_a, worst_l, rows
    if not pairs:
        r.proof = Proof.NOT_PROVEN
        r.proof_message = "no stored rows of positions 0..n-1 to compare (context shifted, or an SWA window only)"
    elif identical:
        r.proof = Proof.IDENTICAL
        r.proof_message = f"{rows} rows of {len(pairs)} layer run(s) bit-identical to the recompute"
    elif within:
        r.proof = Proof.WITHIN_NOISE
        r.proof_message = (
            f"{rows} rows of {len(pairs)} layer run(s) within re-rounding noise (worst head {worst_a:.3g} deg, "
            f"norm {worst_l:.3g})"
        )
    else:
        r.proof = Proof.DIFFERS
        r.proof_message = f"the recomputed rows differ (worst head {worst_a:.3g} deg, norm ratio ln {worst_l:.3g})"


def proof_plan(sf: SlotFile) -> tuple[list[int], str | None]:
    """The tokens to recompute, or why the file cannot be proven."""
    if sf.tokens is None or sf.body is None or sf.body.layout is None:
        return [], "the file has no readable tokens or body"
    if sf.tokens.form == TokenForm.PACKED and sf.tokens.media:
        return [], "the prompt holds media (positions are not token indices)"
    tokens = [int(t) for t in sf.tokens.tokens]
    if not tokens:
        return [], "no stored tokens"
    kinds = {b.kind for b in sf.body.blocks}
    if "KV" in kinds:
        return tokens[: min(PREFIX, len(tokens))], None
    if len(tokens) > MAX_RECURRENT_TOKENS:
        return [], f"a recurrent state of {len(tokens)} tokens (recomputing it all is over {MAX_RECURRENT_TOKENS})"
    return tokens, None


def _prefill(pool: Any, tokens: list[int], settings: Any, timeout: float) -> tuple[str | None, str]:
    """Prefill ``tokens`` in a fresh context of the worker; (file holding that state, message)."""
    d = settings.to_dict()
    d["n_ctx"] = 0  # the worker sizes it for the tokens
    fd, out = tempfile.mkstemp(prefix="slotfile-identify-", suffix=".slot")
    os.close(fd)
    fd, blobs = tempfile.mkstemp(prefix="slotfile-identify-", suffix=".blobs")
    os.close(fd)
    req = {
        "op": "prefill",
        "tokens": tokens,
        "words": tokens,
        "settings": d,
        "checkpoints_at": [],
        "blobs": blobs,
        "out": out,
        "n_batch": 0,
    }
    try:
        resp, died, _log = pool._call(req, timeout)  # the worker's own prefill (slotfile/llama/worker/program.py)
    finally:
        os.unlink(blobs)
    if resp is None or not resp.get("ok"):
        os.unlink(out)
        return None, died if resp is None else str(resp.get("message", "failed"))
    return out, ""


@dataclass
class IdentifyOptions:
    timeout: float = 300.0
    llama_lib: str | None = None
    n_gpu_layers: int = 0
    prove: bool = True


def identify(
    files: list[Path],
    models: list[str],
    opts: IdentifyOptions | None = None,
    on_progress: Callable[[str], None] | None = None,
) -> list[Identification]:
    """Rank ``models`` for every file.  Each candidate that fits some file is loaded once."""
    opts = opts or IdentifyOptions()
    cands = [load_candidate(m) for m in models]
    results, opened = _fit_all(files, cands)
    todo = {ci: [(fi, sf) for (fi, cj), sf in opened.items() if cj == ci] for ci in range(len(cands))}
    order = [ci for ci in range(len(cands)) if todo[ci]] if opts.prove else []
    try:
        _prove_all(order, todo, cands, results, opts, on_progress)
    finally:
        for sf in opened.values():
            sf.close()
    for ident in results:
        ident.ranking.sort(key=Ranked.key)
    return results


def _fit_all(files: list[Path], cands: list[Candidate]) -> tuple[list[Identification], dict[tuple[int, int], SlotFile]]:
    """Stage 1 for every file and candidate: the rankings, and the files left open (by file and
    candidate index) where the candidate fits, for the proof."""
    from slotfile.format.reader import open_slot_file

    results: list[Identification] = []
    opened: dict[tuple[int, int], SlotFile] = {}
    for fi, f in enumerate(files):
        ident = Identification(str(f))
        results.append(ident)
        try:
            if f.is_dir():
                raise IsADirectoryError(21, "is a directory")
            open_slot_file(f).close()
        except OSError as e:
            ident.error = f"{f}: {e.strerror or e}"
            continue
        for ci, c in enumerate(cands):
            r, sf = metadata_fit(f, c)
            ident.ranking.append(r)
            if sf is not None and r.fit != Fit.NO_FIT:
                opened[(fi, ci)] = sf
            elif sf is not None:
                sf.close()
    return results, opened


def _prove_all(
    order: list[int],
    todo: dict[int, list[tuple[int, SlotFile]]],
    cands: list[Candidate],
    results: list[Identification],
    opts: IdentifyOptions,
    on_progress: Callable[[str], None] | None,
) -> None:
    """Stage 2: load each candidate in ``order`` once and prove the files it fits; with
    :data:`PIPELINE` the next candidate's worker starts while this one proves."""
    from slotfile.llama.loader import LoaderError, LoaderPool

    def start(ci: int) -> LoaderPool | str:
        try:  # spawned only: the worker loads the model while the previous candidate proves
            return LoaderPool.start(cands[ci].path, None, opts.n_gpu_layers, 1, llama_lib=opts.llama_lib)
        except LoaderError as e:
            return str(e)

    started: dict[int, tuple[LoaderPool | str, float]] = {}
    try:
        for k, ci in enumerate(order):
            if on_progress is not None:
                on_progress(f"loading {cands[ci].label}")
            if ci not in started:
                started[ci] = (start(ci), time.monotonic())
            pool, t0 = started.pop(ci)
            if PIPELINE and k + 1 < len(order):  # at most two models in memory: this one and the next
                started[order[k + 1]] = (start(order[k + 1]), time.monotonic())
            _prove_candidate(pool, t0, [(results[fi].ranking[ci], sf) for fi, sf in todo[ci]], cands[ci], opts)
    finally:
        for pending, _ in started.values():  # a candidate started but not reached
            if not isinstance(pending, str):
                pending.close()


def _prove_candidate(
    pool: LoaderPool | str, t0: float, work: list[tuple[Ranked, SlotFile]], c: Candidate, opts: IdentifyOptions
) -> None:
    """Prove every (ranking, file) of one candidate with its started worker (or the reason it
    could not start), then close the worker; each ranking's seconds include the model's load."""
    from slotfile.llama.loader import LoaderError

    try:
        if isinstance(pool, str):
            raise LoaderError(pool)
        pool.ready()
    except LoaderError as e:
        for r, _ in work:
            r.proof, r.proof_message = Proof.NOT_PROVEN, f"the model does not load: {e}"
        return
    try:
        load_s = time.monotonic() - t0
        for r, sf in work:
            t1 = time.monotonic()
            _prove(r, sf, c, pool, opts)
            r.seconds = time.monotonic() - t1 + load_s
    finally:
        pool.close()


def _prove(r: Ranked, sf: SlotFile, c: Candidate, pool: Any, opts: IdentifyOptions) -> None:
    from slotfile.format.reader import open_slot_file
    from slotfile.llama.loader import settings_for

    tokens, why = proof_plan(sf)
    if why is not None:
        r.proof, r.proof_message = Proof.NOT_PROVEN, why
        return
    n_vocab = int(pool.info.get("n_vocab") or 0)
    if n_vocab and any(not 0 <= t < n_vocab for t in tokens):
        r.proof, r.proof_message = Proof.DIFFERS, f"token ids outside the model's vocabulary of {n_vocab}"
        return
    settings = settings_for(sf, opts.n_gpu_layers)
    out, msg = _prefill(pool, tokens, settings, opts.timeout)
    if out is None:
        r.proof, r.proof_message = Proof.NOT_PROVEN, f"the recompute failed: {msg}"
        return
    try:
        rec = open_slot_file(out, expect=c.expect)
        try:
            judge(r, sf, rec, len(tokens), c)
        finally:
            rec.close()
    finally:
        os.unlink(out)


def pick_models(
    files: list[Path], models: list[str], opts: IdentifyOptions | None = None
) -> tuple[dict[str, list[Path]], list[Identification]]:
    """For ``verify DIR --models``: the files grouped by the model identified (or, where no
    proof is possible here, the one that fits first); files no candidate fits are left out
    (their Identification says why)."""
    results = identify(files, models, opts)
    groups: dict[str, list[Path]] = {}
    for f, ident in zip(files, results, strict=True):
        if ident.error is not None or not ident.ranking:
            continue
        top = ident.ranking[0]
        if ident.verdict in ("identified", "likely", "ambiguous") and top.fit != Fit.NO_FIT:
            groups.setdefault(top.model.path, []).append(f)
    return groups, results
