"""Will a slot file restore into a llama-server started with given flags?  Per file, one of

* **restores as is**: proven by a real ``llama_state_seq_load_file`` in a context built from
  the server's flags (streams, unified cache, flash attention, cache types), in a worker;
* **needs re-save, exact**: only the stream layout (``-np`` / ``-kvu``: the n_stream word and
  the empty streams' cell counts) or the flash-attention V layout (V rows vs V transposed)
  differ; ``slotfile re-save DIR --server-args`` rewrites them without changing a value;
* **needs re-save, lossy**: the cache types differ (``-ctk`` / ``-ctv``); the state can only be
  recomputed from the tokens with the new types (values differ by the quantization);
* **cannot**: another model, more tokens than the slot context, a damaged file, another state
  version, a session file, cells in several streams.

Each with one line saying why; for the re-save verdicts, llama.cpp's own refusal under the
server's settings (the error the server would log) when a model is at hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from slotfile.format.records import FileFormat, MemoryKind
from slotfile.format.types import BY_NAME, TRANSPOSABLE
from slotfile.problems import Severity
from slotfile.slotdir.serverargs import ServerSettings
from slotfile.slotdir.walk import FileSummary, fill_summary

if TYPE_CHECKING:
    from slotfile.format.records import ModelExpect, SlotFile
    from slotfile.llama.loader import LoaderPool
    from slotfile.model.bridge import ModelInfo

SCHEMA = "slotfile.restore/1"


class Fate(StrEnum):
    AS_IS = "restores as is"
    EXACT = "needs re-save, exact"
    LOSSY = "needs re-save, lossy"
    CANNOT = "cannot"


@dataclass(slots=True)
class Restore:
    fate: Fate
    reason: str
    changes: list[str] = field(default_factory=list)  # what a re-save changes
    n_stream_to: int | None = None  # the stream count a re-save writes (None: unchanged)
    fa_to: bool | None = None  # flash attention a re-save writes for (None: unchanged)
    types_to: tuple[str, str] | None = None  # K, V types a re-save writes (None: unchanged)
    proven: bool = False  # a real load under the server's settings agreed
    load: dict[str, Any] | None = None  # that load: ok, message, settings

    def to_dict(self) -> dict[str, Any]:
        return {
            "fate": str(self.fate),
            "reason": self.reason,
            "changes": self.changes,
            "proven": self.proven,
            "load": self.load,
        }


@dataclass
class ModelSide:
    info: ModelInfo
    expect: ModelExpect | None
    n_ctx_train: int


def model_side(path: str) -> ModelSide:
    """Raises slotfile.model.bridge.ModelError when the GGUF cannot be read."""
    from slotfile.model.bridge import load_model_info
    from slotfile.model.expect import expect_from_model

    info = load_model_info(path)
    try:
        exp: ModelExpect | None = expect_from_model(info)
    except Exception:  # a model the expectation code cannot read: no layout check
        exp = None
    n_ctx_train = (exp.n_ctx_train if exp is not None else 0) or int(info.get("context_length", 0) or 0)
    return ModelSide(info, exp, n_ctx_train)


def predict(
    s: FileSummary, sf: SlotFile | None, server: ServerSettings, side: ModelSide | None, loader_version: int | None
) -> Restore:
    """The verdict from the structure (and the model's metadata), before any load."""
    if s.format == FileFormat.GGSN:
        return Restore(Fate.CANNOT, "a whole-context session file (GGSN): the server restores slot files only")
    if s.damaged:
        return Restore(Fate.CANNOT, f"damaged: {s.first_problem} (truncate-recover keeps what is intact)")
    if loader_version is not None and s.version is not None and s.version != loader_version:
        return Restore(
            Fate.CANNOT,
            f"state version {s.version}; the installed llama.cpp loads version "
            f"{loader_version} only (llama_state_seq_load_file demands an exact match)",
        )
    if side is not None and sf is not None:
        bad = _model_problem(sf, side)
        if bad:
            return Restore(Fate.CANNOT, f"another model than -m {side.info.path}: {bad}")
    n_train = side.n_ctx_train if side is not None else 0
    if side is not None or server.n_ctx:
        slot = server.slot_ctx(n_train)
        if (s.n_tokens or 0) > slot:
            return Restore(
                Fate.CANNOT,
                f"{s.n_tokens} tokens, the slot context holds {slot} "
                f'({_ctx_why(server, n_train)}): "Restored prompt does not fit in the slot context"',
            )
        per = server.n_ctx_seq(n_train)
        if (s.kv_cells or 0) > per:
            return Restore(Fate.CANNOT, f"{s.kv_cells} KV cells, a stream of this server holds {per}")
    return _differences(s, server)


def _ctx_why(server: ServerSettings, n_train: int) -> str:
    parts = [f"-c {server.n_ctx}" if server.n_ctx else f"-c 0 = n_ctx_train {n_train}"]
    if not server.kv_unified and server.n_parallel > 1:
        parts.append(f"/ -np {server.n_parallel}")
    if server.kv_unified_per_slot:
        parts.append(f"capped by --kv-unified-per-slot {server.kv_unified_per_slot}")
    return " ".join(parts)


def _model_problem(sf: SlotFile, side: ModelSide) -> str | None:
    for p in sf.model_problems:  # open_slot_file(expect=...) ran slotfile.model.check
        if p.severity == Severity.ERROR:
            return p.line()
    return None


def _differences(s: FileSummary, server: ServerSettings) -> Restore:
    r = Restore(Fate.AS_IS, "the file matches the server's streams, V layout and cache types")
    if s.n_stream is None:  # no KV cache (recurrent, empty): nothing of these flags reaches the state
        r.reason = "no KV cache in the state: streams, flash attention and cache types do not apply"
        return r
    if s.n_stream != server.n_stream:
        if (s.active_streams or 0) > 1:
            return Restore(
                Fate.CANNOT,
                f"{s.active_streams} streams hold cells (several slots in one file); the server has {server.n_stream}",
            )
        r.changes.append(f"streams {s.n_stream} -> {server.n_stream}")
        r.n_stream_to = server.n_stream
    if s.v_trans is not None and (s.v_trans == 0) != server.fa_on:
        r.changes.append(f"flash attention {'on' if s.v_trans == 0 else 'off'} -> {'on' if server.fa_on else 'off'}")
        r.fa_to = server.fa_on
    types = []
    if s.type_k is not None and s.type_k != server.type_k:
        types.append(f"K {s.type_k} -> {server.type_k}")
    if s.type_v is not None and s.type_v != server.type_v:
        types.append(f"V {s.type_v} -> {server.type_v}")
    if types:
        r.changes += types
        r.types_to = (server.type_k, server.type_v)
        r.fate = Fate.LOSSY
        r.reason = ", ".join(types) + ": the state must be recomputed from the tokens with the new cache types"
    elif r.fa_to is False and s.type_v is not None and BY_NAME[s.type_v].id not in TRANSPOSABLE:
        return Restore(Fate.CANNOT, f"a {s.type_v} V cache needs flash attention; the server runs without it")
    elif r.changes:
        r.fate = Fate.EXACT
        r.reason = ", ".join(r.changes) + ": rewritten byte for byte (no value changes)"
    return r


def need_cells(sf: SlotFile) -> int:
    """The most cells any KV stream of the body or a checkpoint blob holds."""
    n = 0
    bodies = [sf.body] + [ck.tgt.body for ck in sf.checkpoints]
    for body in bodies:
        if body is None or body.layout is None:
            continue
        for blk in body.blocks:
            if blk.kind == MemoryKind.KV:
                for st in blk.active_streams():
                    n = max(n, st.cell_count)
    return max(n, sf.n_tokens or 0)


def prove(
    r: Restore,
    sf: SlotFile,
    path: str,
    server: ServerSettings,
    side: ModelSide,
    pool: LoaderPool,
    n_gpu_layers: int = 0,
    timeout: float = 300.0,
) -> Restore:
    """Load the file under the server's settings; a predicted "as is" holds only if it loads,
    a predicted re-save gets llama.cpp's refusal as its expected error."""
    if r.fate == Fate.CANNOT:
        return r
    settings = server.load_settings(side.n_ctx_train, need_cells(sf), n_gpu_layers)
    res = pool.load(path, settings, timeout=timeout, sf=sf)
    bad = [f"checkpoint {i}: {m}" for i, (ok, m) in enumerate(res.checkpoints) if not ok]
    if res.draft is not None and not res.draft[0]:
        bad.append(f"draft state: {res.draft[1]}")
    r.load = {
        "ok": res.ok,
        "message": res.message,
        "crashed": res.crashed,
        "settings": settings.to_dict(),
        "checkpoints_rejected": bad,
    }
    if r.fate == Fate.AS_IS:
        if res.ok:
            r.proven = True
            if bad:
                r.reason += f"; the body restores, but {'; '.join(bad)}"
        else:
            r.fate = Fate.CANNOT
            r.reason = f"llama.cpp refuses it under these settings: {res.message}"
        return r
    if res.ok:  # llama.cpp takes it although the layout differs: trust the loader
        r.fate, r.proven = Fate.AS_IS, True
        r.reason = f"restores as is (llama.cpp loads it despite {', '.join(r.changes)})"
        r.changes, r.n_stream_to, r.fa_to, r.types_to = [], None, None, None
    else:
        r.proven = True
        r.reason += f"; as is, llama.cpp says: {res.message}"
    return r


class Checker:
    """The server's settings, its model and loader workers, shared by every file of a run."""

    def __init__(
        self,
        server: ServerSettings,
        model: str | None,
        *,
        load: bool = True,
        jobs: int = 1,
        n_gpu_layers: int = 0,
        timeout: float = 300.0,
        pool: LoaderPool | None = None,
    ) -> None:
        """Raises slotfile.model.bridge.ModelError or slotfile.llama.loader.LoaderError (operational)."""
        self.server, self.model = server, model
        self.side = model_side(model) if model else None
        self.pool = pool
        self.n_gpu_layers, self.timeout = n_gpu_layers, timeout
        if load and model and self.pool is None:
            from slotfile.llama.loader import LoaderPool

            self.pool = LoaderPool(model, server.draft_model, n_gpu_layers, jobs)

    @property
    def loader_version(self) -> int | None:
        return self.pool.state_seq_version if self.pool is not None else None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def check(self, path: str, rel: str, size: int, mtime: float) -> tuple[FileSummary, Restore | None]:
        """(summary, verdict); the verdict is None for a file that cannot be read (``summary.error``)."""
        from slotfile.format.reader import open_slot_file

        s = FileSummary(path, rel, size, mtime)
        try:
            sf = open_slot_file(path, expect=self.side.expect if self.side is not None else None)
        except OSError as e:
            s.error = f"{path}: {e.strerror or e}"
            return s, None
        try:
            fill_summary(s, sf)
            # the model's own check reports disagreements with -m as problems of the file
            r = predict(s, sf, self.server, self.side, self.loader_version)
            if self.pool is not None and self.side is not None:
                r = prove(r, sf, path, self.server, self.side, self.pool, self.n_gpu_layers, self.timeout)
            return s, r
        finally:
            sf.close()
