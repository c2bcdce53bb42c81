"""The typer application: one small function per command, heavy imports inside them."""

from __future__ import annotations

import functools
import inspect as _inspect
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NoReturn

import typer

from slotfile.cli.options import (
    HELP,
    LLAMA_LIB,
    SETTLE,
    SETTLE_WAIT,
    VERIFY_DEEP,
    VERIFY_DRAFT_MODEL,
    VERIFY_JOBS,
    VERIFY_JUNIT,
    VERIFY_MANIFEST,
    VERIFY_MODELS,
    VERIFY_N_BATCH,
    VERIFY_N_GPU_LAYERS,
    VERIFY_N_UBATCH,
    VERIFY_PATHS,
    VERIFY_QUIET,
    VERIFY_REQUIRE,
    VERIFY_SCAN,
    VERIFY_SETTLE,
    VERIFY_SETTLE_WAIT,
    VERIFY_TIMEOUT,
    examples,
    json_option,
    model_option,
)
from slotfile.cli.root import app, one_blas_thread


@app.command(
    context_settings=HELP,
    epilog=examples(
        "slotfile inspect slot0.bin",
        "slotfile inspect slot0.bin --model model.gguf   # with the text",
        "slotfile inspect slot0.bin --layers             # every layer",
    ),
)
def inspect(
    files: list[Path] = typer.Argument(..., help="Slot (GGSQ) or session (GGSN) files."),
    model: Path | None = model_option("GGUF model: adds a detokenised preview."),
    layers: bool = typer.Option(False, "--layers", help="List every layer's K/V/R/S entry."),
) -> None:
    """A summary of each file: format, tokens, memory layout, sections, checkpoints, verdict."""
    from slotfile.cli.inspect_cmd import InspectArgs, run_inspect

    raise typer.Exit(run_inspect(InspectArgs(tuple(files), model, layers)))


@app.command(
    context_settings=HELP,
    epilog=examples(
        "slotfile dump slot0.bin",
        "slotfile dump slot0.bin --json --tokens > slot0.json",
        "slotfile dump slot0.bin --json | jq .problems",
    ),
)
def dump(
    file: Path = typer.Argument(..., help="Slot (GGSQ) or session (GGSN) file."),
    json_out: bool = json_option("JSON on stdout (schema slotfile.dump/1, see README)."),
    tokens: bool = typer.Option(False, "--tokens", help="Include the token id arrays."),
    model: Path | None = model_option("GGUF model: adds the detokenised text."),
) -> None:
    """Every field with its byte offset, as text or JSON."""
    from slotfile.cli.dump_cmd import DumpArgs, run_dump

    raise typer.Exit(run_dump(DumpArgs(file, json_out, tokens, model)))


_SERVER_ARGS = typer.Option(
    None,
    "--server-args",
    help="A llama-server command line (quoted): say per file whether it restores under those flags "
    "(-m, -c, -np, -kvu, -fa, -ctk, -ctv, --swa-full, ...).",
)


def _verify_for_server(
    paths: list[Path],
    server_args: str,
    model: Path | None,
    json_out: bool,
    jobs: int | None,
    n_gpu_layers: int,
    timeout: float,
    quiet: bool,
    **others: object,
) -> int:
    """verify --server-args: the restore verdict per file (slotfile.restore/1)."""
    from slotfile.cli.common import fail
    from slotfile.cli.restore_cmd import RestoreCheckArgs, run_restore_check

    used = [f"--{k.replace('_', '-')}" for k, v in others.items() if v]
    if used:
        fail(f"--server-args does not combine with {', '.join(used)}", "verify")
        return 2
    return run_restore_check(
        RestoreCheckArgs(tuple(paths), server_args, model, json_out, jobs or 1, n_gpu_layers, timeout, quiet)
    )


@app.command(
    context_settings=HELP,
    epilog=examples(
        "slotfile verify slots/                    # structure only",
        "slotfile verify slots/ -m model.gguf -q   # test-load too, quietly",
        "slotfile verify slot0.bin -m model.gguf --deep --junit verify.xml",
    ),
)
def verify(
    paths: list[Path] = VERIFY_PATHS,
    model: Path | None = model_option("GGUF model: metadata checks and a test-load."),
    draft_model: Path | None = VERIFY_DRAFT_MODEL,
    deep: bool = VERIFY_DEEP,
    n_gpu_layers: int = VERIFY_N_GPU_LAYERS,
    jobs: int | None = VERIFY_JOBS,
    json_out: bool = json_option("JSON on stdout (schema slotfile.verify/1, see README)."),
    junit: Path | None = VERIFY_JUNIT,
    timeout: float = VERIFY_TIMEOUT,
    scan: bool = VERIFY_SCAN,
    quiet: bool = VERIFY_QUIET,
    llama_lib: Path | None = LLAMA_LIB,
    server_args: str | None = _SERVER_ARGS,
    n_batch: int = VERIFY_N_BATCH,
    n_ubatch: int = VERIFY_N_UBATCH,
    settle: float = VERIFY_SETTLE,
    settle_wait: float = VERIFY_SETTLE_WAIT,
    require: list[str] | None = VERIFY_REQUIRE,
    manifest: Path | None = VERIFY_MANIFEST,
    models: list[Path] | None = VERIFY_MODELS,
) -> None:
    """Structure, model metadata, a real test-load and (--deep) a recompute, each reported per file."""
    one_blas_thread()
    if server_args is not None:
        # what --server-args does not combine with, in the order the error names them
        others = {"deep": deep, "junit": junit, "scan": scan, "draft_model": draft_model, "require": bool(require)}
        rc = _verify_for_server(paths, server_args, model, json_out, jobs, n_gpu_layers, timeout, quiet, **others)
        raise typer.Exit(rc)
    from slotfile.cli.verify_cmd import VerifyRequest, run_verify

    request = VerifyRequest(
        paths=tuple(paths),
        model=model,
        draft_model=draft_model,
        deep=deep,
        n_gpu_layers=n_gpu_layers,
        jobs=jobs,
        json_out=json_out,
        junit=junit,
        timeout=timeout,
        scan=scan,
        quiet=quiet,
        llama_lib=llama_lib,
        n_batch=n_batch,
        n_ubatch=n_ubatch,
        settle=settle,
        manifest=manifest,
        models=tuple(models or ()),
        settle_wait=settle_wait,
        require=tuple(v.strip().lower() for r in require or () for v in r.split(",")),
    )
    raise typer.Exit(run_verify(request))


_OUT = typer.Option(None, "--output", "-o", help="Where to write the repaired file (must not exist unless --force).")
_DRAFT = typer.Option(None, "--draft-model", help="Draft GGUF: test-load (and rebuild) the draft state too.")


@dataclass(frozen=True, slots=True)
class _Write:
    """The options every command that writes one file shares (``RepairArgs`` fields)."""

    force: bool
    in_place: bool
    backup: Path | None
    dry_run: bool
    json_out: bool
    timeout: float
    llama_lib: Path | None


# _Write's fields as typer parameters, in the order --help lists them
_WRITE_PARAMS = [
    _inspect.Parameter(name, _inspect.Parameter.POSITIONAL_OR_KEYWORD, default=option, annotation=kind)
    for name, kind, option in (
        ("force", bool, typer.Option(False, "--force", help="Replace an existing OUT (or backup).")),
        (
            "in_place",
            bool,
            typer.Option(
                False, "--in-place", help="Replace IN itself, keeping IN.bak (or --backup); never through a symlink."
            ),
        ),
        ("backup", Path | None, typer.Option(None, "--backup", help="Backup path for --in-place (default IN.bak).")),
        ("dry_run", bool, typer.Option(False, "--dry-run", help="Print the plan; write nothing.")),
        (
            "json_out",
            bool,
            json_option("The report as JSON on stdout (schema slotfile.repair/1)."),
        ),
        ("timeout", float, typer.Option(600.0, "--timeout", help="Seconds allowed for each llama.cpp worker.")),
        ("llama_lib", Path | None, LLAMA_LIB),
    )
]


def _writes_one_file(command: Callable[..., None]) -> Callable[..., None]:
    """Give ``command``'s ``write: _Write`` parameter to typer as the seven shared options
    (in its place in the signature) and hand them back to ``command`` as one ``_Write``."""
    sig = _inspect.signature(command, eval_str=True)
    params = list(sig.parameters.values())
    at = [p.name for p in params].index("write")
    params[at : at + 1] = _WRITE_PARAMS
    names = [p.name for p in _WRITE_PARAMS]

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> None:
        write = _Write(**{n: kwargs.pop(n) for n in names})
        command(write=write, **kwargs)

    wrapper.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in params} | {"return": None}
    return wrapper


# the placeholder default of the ``write`` parameter :func:`_writes_one_file` replaces
_WRITE: Any = None


def _repair(command: str, file: Path, output: Path | None, write: _Write, **specific: Any) -> NoReturn:
    """Run one file-writing command through :func:`slotfile.cli.repair_cmd.run_repair`."""
    from slotfile.cli.repair_cmd import RepairArgs, run_repair

    raise typer.Exit(run_repair(RepairArgs(command, file, output, **asdict(write), **specific)))


@app.command(
    "truncate-recover",
    context_settings=HELP,
    epilog=examples(
        "slotfile truncate-recover slot0.bin --dry-run      # print the plan",
        "slotfile truncate-recover slot0.bin -o fixed.bin",
        "slotfile truncate-recover slot0.bin -o fixed.bin -m model.gguf",
    ),
)
@_writes_one_file
def truncate_recover(
    file: Path = typer.Argument(..., help="Damaged slot file (opened read-only)."),
    output: Path | None = _OUT,
    model: Path | None = model_option("GGUF model: test-load the result; rebuild a damaged body from the tokens."),
    draft_model: Path | None = _DRAFT,
    flash_attn: str | None = typer.Option(
        None, "--flash-attn", help="on|off: for a rebuild when the damaged file no longer shows it."
    ),
    cache_type_k: str | None = typer.Option(
        None, "--cache-type-k", help="K cache type for a rebuild when the file no longer shows it."
    ),
    cache_type_v: str | None = typer.Option(
        None, "--cache-type-v", help="V cache type for a rebuild when the file no longer shows it."
    ),
    checkpoint_at: list[int] | None = typer.Option(
        None, "--checkpoint-at", help="Rebuild checkpoints at these n_tokens (repeatable)."
    ),
    write: _Write = _WRITE,
) -> None:
    """Keep every intact section; drop damaged checkpoints, a damaged SDFT and trailing bytes;
    with --model rebuild a cut body."""
    _repair(
        "truncate-recover",
        file,
        output,
        write,
        model=model,
        draft_model=draft_model,
        flash_attn=flash_attn,
        cache_type_k=cache_type_k,
        cache_type_v=cache_type_v,
        checkpoint_at=tuple(checkpoint_at or ()),
    )


@app.command(
    "strip-draft",
    context_settings=HELP,
    epilog=examples(
        "slotfile strip-draft slot0.bin -o nodraft.bin",
        "slotfile strip-draft slot0.bin --in-place     # keeps slot0.bin.bak",
    ),
)
@_writes_one_file
def strip_draft(
    file: Path = typer.Argument(..., help="Slot file (opened read-only)."),
    output: Path | None = _OUT,
    model: Path | None = model_option("GGUF model: test-load the result."),
    write: _Write = _WRITE,
) -> None:
    """Remove the SDFT appendix and every checkpoint's draft and speculative blobs; the target
    state stays byte-identical."""
    _repair("strip-draft", file, output, write, model=model)


_RESAVE_CTK = typer.Option(None, "--cache-type-k", help="Recompute the state with this K cache type (lossy).")
_RESAVE_CTV = typer.Option(None, "--cache-type-v", help="Recompute the state with this V cache type (lossy).")
_RESAVE_SERVER_ARGS = typer.Option(
    None, "--server-args", help="With a directory: the llama-server command line to convert every file for."
)


@app.command(
    "re-save",
    context_settings=HELP,
    epilog=examples(
        "slotfile re-save slot0.bin -m model.gguf --flash-attn on -o fa.bin",
        "slotfile re-save slot0.bin -m model.gguf --tokens plain -o plain.bin",
        "slotfile re-save slots/ -o new/ --server-args 'llama-server -m m.gguf -np 4'",
    ),
)
@_writes_one_file
def re_save(
    file: Path = typer.Argument(..., help="Slot file (opened read-only), or a directory (with --server-args)."),
    output: Path | None = _OUT,
    model: Path | None = model_option("GGUF model (required)."),
    draft_model: Path | None = _DRAFT,
    flash_attn: str | None = typer.Option(None, "--flash-attn", help="on|off: write the V layout for this setting."),
    tokens: str | None = typer.Option(None, "--tokens", help="packed|plain: convert the token payload."),
    recompute: bool = typer.Option(
        False, "--recompute", help="With --flash-attn: prefill the tokens again instead of rewriting V."
    ),
    cache_type_k: str | None = _RESAVE_CTK,
    cache_type_v: str | None = _RESAVE_CTV,
    server_args: str | None = _RESAVE_SERVER_ARGS,
    write: _Write = _WRITE,
    settle: float = SETTLE,
    settle_wait: float = SETTLE_WAIT,
) -> None:
    """Load the body through llama.cpp and write it again, keeping the checkpoints and draft state."""
    if file.is_dir() or server_args is not None:
        from slotfile.cli.restore_cmd import ResaveDirArgs, run_resave_dir

        raise typer.Exit(
            run_resave_dir(
                ResaveDirArgs(
                    file,
                    output,
                    server_args,
                    model,
                    dry_run=write.dry_run,
                    force=write.force,
                    json_out=write.json_out,
                    in_place=write.in_place,
                    timeout=write.timeout,
                    settle=settle,
                    settle_wait=settle_wait,
                )
            )
        )
    _repair(
        "re-save",
        file,
        output,
        write,
        model=model,
        draft_model=draft_model,
        flash_attn=flash_attn,
        tokens=tokens,
        recompute=recompute,
        cache_type_k=cache_type_k,
        cache_type_v=cache_type_v,
    )


@app.command(
    "migrate",
    context_settings=HELP,
    epilog=examples(
        "slotfile migrate slot0.bin -o slot0.v4.bin --to 4             # float caches: no model needed",
        "slotfile migrate slot0.bin -o slot0.v4.bin --to 4 -m model.gguf",
        "slotfile migrate slot0.v4.bin -o slot0.bin --to 3 -m model.gguf",
        "slotfile migrate slots/ -o slots.v4/ --to 4 -m model.gguf --llama-lib /opt/llama.cpp/build/bin",
    ),
)
@_writes_one_file
def migrate(
    file: Path = typer.Argument(
        ..., help="Slot (GGSQ 2/3/4) or session (GGSN 9/10/11) file, or a directory of them (read-only)."
    ),
    output: Path | None = _OUT,
    to: int = typer.Option(
        ..., "--to", help="Target state version: 2, 3 or 4 (a session file: 9, 10 or 11, or 2/3/4)."
    ),
    model: Path | None = model_option(
        "GGUF model: the rotation widths of a quantized cache; checks and test-loads the result."
    ),
    draft_model: Path | None = typer.Option(
        None, "--draft-model", help="Draft GGUF: the widths of a quantized draft cache."
    ),
    write: _Write = _WRITE,
    only_changed: bool = typer.Option(
        False, "--only-changed", help="DIR: leave out files already at the target version (default: copy them)."
    ),
) -> None:
    """Convert between state versions 2, 3 and 4 (llama.cpp to 2026-08 / to 2026-10-05 / from then),
    both ways, wherever lossless.  With --llama-lib DIR (a build of the target version) the output is
    test-loaded through it before it lands.  A directory is migrated into -o OUTDIR (same tree)."""
    if file.is_dir():
        from slotfile.cli.migrate_cmd import MigrateDirArgs, run_migrate_dir

        dir_args = MigrateDirArgs(
            file,
            output,
            to,
            model=model,
            draft_model=draft_model,
            llama_lib=write.llama_lib,
            dry_run=write.dry_run,
            force=write.force,
            only_changed=only_changed,
            json_out=write.json_out,
            timeout=write.timeout,
        )
        raise typer.Exit(run_migrate_dir(dir_args))
    _repair("migrate", file, output, write, model=model, draft_model=draft_model, to_version=to)


# the commands over a slot store and between files register on ``app`` when their module is imported
from slotfile.cli import app_store  # noqa: E402, F401


def main() -> None:
    """The console script.  It ends with os._exit once the output is flushed and the atexit
    handlers have run: the interpreter's teardown of numpy, rich and typer costs ~0.15 s of
    every run and has nothing left to do (every file a command writes is closed by then)."""
    import atexit
    import os
    import sys

    from slotfile.cli.completion_cmd import enable_if_completing

    enable_if_completing()
    try:
        app(prog_name="slotfile")
        code: object = 0
    except SystemExit as e:
        code = e.code
    except Exception as e:
        from slotfile.exitcodes import OPERATIONAL
        from slotfile.slotdir.forked import WorkerLost

        if not isinstance(e, WorkerLost):
            raise
        print(f"slotfile: {e}; the listing above is incomplete", file=sys.stderr)
        code = OPERATIONAL
    if not isinstance(code, int):  # sys.exit("message") / sys.exit(None)
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    atexit._run_exitfuncs()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said
            code = code or 1
    os._exit(code)


if __name__ == "__main__":
    main()
