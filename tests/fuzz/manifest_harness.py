"""The fuzz harness of ``slotfile.manifest/1`` manifests (``verify --manifest``, ``seal --update``,
``prune``): any bytes read as a manifest give a :class:`~slotfile.seal.manifest.Manifest` or a
one-line :class:`~slotfile.seal.manifest.ManifestError`; a manifest that reads is written again
(``render``) and reads back the same, and a check of its (empty) directory names every entry
missing without touching anything.  Registered in tests/fuzz/harnesses.py; seeds here."""

from __future__ import annotations

import os
import tempfile

from tests.fuzz.harnesses import ContractError

_DIR: str | None = None


def _empty_dir() -> str:
    """A directory with nothing in it: where the fuzzed manifest "lives"."""
    global _DIR
    if _DIR is None:
        base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        _DIR = tempfile.mkdtemp(prefix="slotfile-fuzz-manifest-", dir=base)
    return _DIR


def manifest(data: bytes) -> None:
    from slotfile.seal.check import Status, check
    from slotfile.seal.manifest import DEFAULT_NAME, ManifestError, parse, render

    where = os.path.join(_empty_dir(), DEFAULT_NAME)
    try:
        m = parse(data, where)
    except ManifestError as e:
        if "\n" in str(e):
            raise ContractError(f"a manifest error of several lines: {e!r}") from None
        return
    again = parse(render(m), where)
    if [e.to_dict() for e in again.entries] != [e.to_dict() for e in sorted(m.entries, key=lambda e: e.path)]:
        raise ContractError("a manifest written again does not read back the same")
    res = check(m, jobs=1)
    if any(f.status not in (Status.MISSING, Status.UNREADABLE) for f in res.files):
        raise ContractError(f"an empty directory checked as {res.counts()}")
    if os.listdir(_empty_dir()):
        raise ContractError("checking a manifest wrote into its directory")


def manifest_seeds() -> dict[str, bytes]:
    """Manifests as ``seal`` writes them: empty, with entries of every kind, with models."""
    from slotfile.seal.manifest import Entry, Manifest, render

    full = [
        Entry(
            "a.slot",
            10,
            1_700_000_000_000_000_000,
            "ab" * 32,
            format="GGSQ",
            version=3,
            n_tokens=54,
            tokens_digest="00" * 16,
            memory_class="iswa",
            cache_types={"kv-base": {"k": "q8_0", "v": "q8_0"}, "kv-swa": {"k": "f16", "v": "f16"}},
            model="f" * 64,
            levels={"structure": "pass", "model": "pass", "load": "pass", "deep": "skipped"},
            passed=["structure", "model", "load"],
        ),
        Entry("sub/dir/b.bin", 0, 0, "cd" * 32, forced=True, first_problem="structure: header at offset 0: cut"),
    ]
    models = {"f" * 64: {"scheme": "slotfile.gguf-fingerprint/1", "value": "f" * 64, "name": "m", "arch": "llama"}}
    return {
        "empty": render(Manifest([], path="m.json")),
        "entries": render(Manifest(full, models, "2026-12-04T00:00:00+00:00", "slotfile 0", path="m.json")),
    }
