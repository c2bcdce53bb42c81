"""What ``slotfile verify`` adds with a manifest (``--manifest M``, or the default one of the
directory given) and with ``--models``: kept here so that the verify command only calls in.

With a manifest, every file is checked against it (:func:`slotfile.seal.check.check`) next to
the levels: the JSON gains a top-level ``"manifest"`` object (``path``, ``counts``, ``files``:
every file with its status, missing ones included) and a ``"manifest"`` member in each file's
entry; the listing gains one line per file that is not as sealed and a summary line; a file
that is missing, extra, changed or sealed with another model makes the exit code 4.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from slotfile.problems import ProblemCode
from slotfile.seal.check import CheckResult, FileCheck, check, discover
from slotfile.seal.manifest import Manifest, ManifestError, load


def manifest_for(paths: list[Path], explicit: Path | None) -> Path | None:
    """The manifest to check against: ``--manifest``, else the default one of the one directory given."""
    return explicit if explicit is not None else discover(paths)


def run_check(
    manifest: Path, paths: list[Path], model: str | None = None, draft_model: str | None = None
) -> CheckResult:
    """Check ``paths`` against ``manifest``; raises ManifestError (one line) for a manifest or
    model that cannot be used.  The manifest's own directory given as the one path: the whole
    store (missing and extra files); otherwise only what the paths cover."""
    from slotfile.model.gguf import GGUFError
    from slotfile.seal.fingerprint import fingerprint

    m: Manifest = load(manifest)
    scope: list[Path] | None = list(paths)
    if len(paths) == 1 and paths[0].is_dir() and Path(os.path.abspath(paths[0])) == m.directory:
        scope = None
    fps = []
    for p in (model, draft_model):
        try:
            fps.append(fingerprint(p) if p else None)
        except (OSError, GGUFError) as e:
            raise ManifestError(f"{p}: {getattr(e, 'strerror', None) or e}") from None
    return check(m, scope, fps[0], fps[1])


def _rel(res: CheckResult, path: str) -> str:
    d = Path(res.manifest).resolve().parent
    try:
        return Path(os.path.abspath(path)).relative_to(d).as_posix()
    except ValueError:
        return os.path.abspath(path)


def annotate(doc: dict[str, Any], res: CheckResult) -> None:
    """Add the manifest's findings to verify's JSON document (keys only added)."""
    by = {f.path: f for f in res.files}
    for f in doc.get("files", []):
        fc = by.get(_rel(res, str(f.get("path"))))
        f["manifest"] = fc.to_dict() if fc is not None else None
    doc["manifest"] = res.to_dict()


def failed(res: CheckResult) -> list[FileCheck]:
    return res.failed


def lines(res: CheckResult, quiet: bool = False) -> list[str]:
    """The listing's lines: one per file not as sealed, then the summary."""
    out = [f"manifest: {fc.status}: {fc.path}: {'; '.join(fc.messages)}" for fc in res.failed]
    c = res.counts()
    parts = [f"{c[k]} {k}" for k in ("ok", "changed", "missing", "extra", "model-mismatch", "unreadable") if c[k]]
    out.append(f"manifest {res.manifest}: " + (", ".join(parts) or "no files"))
    return out


def exit_code(rc: int, res: CheckResult) -> int:
    """verify's exit code with the manifest's findings: 4 for a file not as sealed (8 stays 8)."""
    from slotfile.exitcodes import OK, PROBLEMS

    return PROBLEMS if rc == OK and res.failed else rc


def verify_with_models(
    files: Sequence[Path], models: list[Path], opts: Any, on_done: Any = None
) -> tuple[list[Any], dict[str, dict[str, Any]]]:
    """``verify DIR --models PATH...``: each file's model picked by identify (metadata fit, then
    the prefix proof), every file verified with its model, one Verifier per model; a file that
    no candidate fits fails its model level (``model-mismatch``, naming the best candidate's
    misfit).  Returns the reports in the order of ``files`` and each file's identification
    (``identify --json``'s form) by path.  Raises IdentifyError (a candidate path that is not
    there) and VerifyError (a model that does not load)."""
    import dataclasses

    from slotfile.seal.identify import IdentifyOptions, collect_models, pick_models
    from slotfile.verify import Verifier

    cands = collect_models(models)
    groups, idents = pick_models(
        list(files),
        cands,
        IdentifyOptions(timeout=opts.timeout, llama_lib=opts.llama_lib, n_gpu_layers=opts.n_gpu_layers),
    )
    by_path: dict[str, Any] = {}
    for model, fs in groups.items():
        with Verifier(dataclasses.replace(opts, model=model)) as v:
            for r in v.run(fs, on_done):
                by_path[r.path] = r
    out = []
    for f, ident in zip(files, idents, strict=True):
        found = by_path.get(str(f))
        if found is None:
            found = _unfit(f, ident, len(cands))
            if on_done is not None:
                on_done(found)
        out.append(found)
    return out, {i.path: i.to_dict() for i in idents}


def _unfit(f: Path, ident: Any, n: int) -> Any:
    """The report of a file that no candidate fits (or that identify could not read)."""
    from slotfile.verify import FileReport

    r = FileReport(str(f))
    if ident.error is not None:
        r.error = ident.error
        return r
    why = ""
    if ident.ranking:
        top = ident.ranking[0]
        if str(top.fit) != "no-fit":  # it fits the metadata, its recompute differs
            why = f"{top.model.label}: {top.proof_message}"
        elif top.reasons:
            why = f"{top.model.label}: {top.reasons[0]}"
    msg = f"no candidate model fits ({n} tried)" + (f"; the closest, {why}" if why else "")
    r.levels["model"].error(ProblemCode.MODEL_MISMATCH, "body", None, msg)
    r.levels["model"].finish()
    return r


# --------------------------------------------------------------------------------------- ls and prune


def ls_states(root: Path, paths: list[str]) -> tuple[dict[str, str] | None, list[str], str | None]:
    """For ``ls DIR``: each file's sealed state (``sealed``, ``changed``: size or mtime differ
    from the manifest, ``unsealed``) when DIR holds a manifest (None when it holds none), the
    sealed files that are gone, and the error line of a manifest that cannot be read.  Nothing
    is hashed: ``verify DIR`` says whether a changed file's bytes did change."""
    from slotfile.seal.check import sealed_state
    from slotfile.seal.manifest import find_manifest

    mp = find_manifest(root)
    if mp is None:
        return None, [], None
    try:
        m = load(mp)
    except ManifestError as e:
        return None, [], str(e)
    entries = m.by_path()
    states: dict[str, str] = {}
    seen = set()
    for p in paths:
        try:
            rel = Path(os.path.abspath(p)).relative_to(m.directory).as_posix()
            st = os.stat(p, follow_symlinks=False)
        except (ValueError, OSError):
            continue
        seen.add(rel)
        states[p] = sealed_state(entries.get(rel), st.st_size, st.st_mtime_ns)
    gone = sorted(set(entries) - seen)
    return states, [g for g in gone if not os.path.lexists(m.directory / g)], None


def prune_manifest(root: Path, removed: list[str]) -> tuple[str | None, list[str], str | None]:
    """For ``prune --delete``: drop the entries of the removed files from DIR's manifest;
    (manifest path or None, entries dropped, error line)."""
    from slotfile.safewrite import CheckFailed, WriteRefused
    from slotfile.seal.build import drop_entries
    from slotfile.seal.manifest import find_manifest

    mp = find_manifest(root)
    if mp is None:
        return None, [], None
    try:
        return str(mp), drop_entries(mp, removed), None
    except (ManifestError, OSError, WriteRefused, CheckFailed) as e:
        return str(mp), [], f"{mp}: not updated: {e}"


def ls_models(paths: list[str], models: list[Path]) -> dict[str, dict[str, Any]]:
    """For ``ls DIR --models PATH...``: each file's model by identify (metadata fit, then the
    prefix proof; each fitting candidate loaded once): ``{"model", "name", "verdict", "proof"}``
    per path.  Raises IdentifyError for a candidate path that is not there."""
    from slotfile.seal.identify import collect_models, identify

    out: dict[str, dict[str, Any]] = {}
    for ident in identify([Path(p) for p in paths], collect_models(models)):
        top = ident.ranking[0] if ident.ranking else None
        fits = top is not None and str(top.fit) != "no-fit" and ident.verdict != "none"
        out[ident.path] = {
            "model": top.model.path if fits and top is not None else None,
            "name": top.model.label if fits and top is not None else None,
            "verdict": ident.verdict,
            "proof": str(top.proof) if fits and top is not None else None,
        }
    return out


def model_cell(d: dict[str, Any] | None) -> str:
    """The ``model`` column of ``ls --models``."""
    if d is None:
        return "-"
    if d["verdict"] == "identified":
        return f"{d['name']} ({d['proof']})"
    if d["verdict"] in ("likely", "ambiguous"):
        return f"{d['verdict']}: {d['name']}"
    return "none fits" if d["verdict"] == "none" else "-"


def junit_add(path: Path, res: CheckResult) -> None:
    """Append a ``slotfile.manifest`` testsuite to verify's JUnit file: one testcase per file
    of the manifest check, a ``<failure type="manifest-...">`` for each that is not as sealed."""
    import xml.etree.ElementTree as ET  # only for --junit

    tree = ET.parse(path)
    root = tree.getroot()
    bad = res.failed
    suite = ET.SubElement(
        root,
        "testsuite",
        name="slotfile.manifest",
        tests=str(len(res.files)),
        failures=str(len(bad)),
        errors="0",
        skipped="0",
        time=f"{res.seconds:.3f}",
    )
    for fc in res.files:
        tc = ET.SubElement(suite, "testcase", classname="slotfile.manifest", name=fc.path, time="0")
        if not fc.ok:
            msg = f"{fc.status}: {'; '.join(fc.messages)}"
            ET.SubElement(tc, "failure", message=msg, type=str(fc.to_dict()["code"])).text = msg
    for attr in ("tests", "failures"):
        root.set(attr, str(int(root.get(attr, "0")) + int(suite.get(attr, "0"))))
    ET.indent(root)
    data = ET.tostring(root, encoding="unicode", xml_declaration=False)
    path.write_text('<?xml version="1.0" encoding="UTF-8"?>\n' + data + "\n", encoding="utf-8")
