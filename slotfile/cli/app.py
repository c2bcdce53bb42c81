"""The typer application: one small function per command, heavy imports inside them."""

from __future__ import annotations

from pathlib import Path

import typer

from slotfile import __version__
from slotfile.exitcodes import OK

# -h as well as --help, on the group and on every command
HELP = {"help_option_names": ["-h", "--help"]}


def _examples(*lines: str) -> str:
    """An epilog of examples; the \\b paragraph keeps click from re-wrapping the lines."""
    return "\b\nExamples:\n" + "\n".join(f"  {line}" for line in lines)


app = typer.Typer(
    name="slotfile",
    context_settings=HELP,
    help="Inspect, verify and repair llama.cpp slot save files (llama-server --slot-save-path).",
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)


_LLAMA_LIB_HELP = (
    "A folder holding libllama.so and its libggml*.so (a llama.cpp build's bin/): the llama.cpp the "
    "workers load, e.g. one that loads the file's state version (env SLOTFILE_LLAMA_LIB)."
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"slotfile {__version__}")
        raise typer.Exit(OK)


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Exit codes: 0 ok, 2 usage error, 4 problems found, 8 operational error."""


@app.command(
    context_settings=HELP,
    epilog=_examples(
        "slotfile inspect slot0.bin",
        "slotfile inspect slot0.bin --model model.gguf   # with the text",
        "slotfile inspect slot0.bin --layers             # every layer",
    ),
)
def inspect(
    files: list[Path] = typer.Argument(..., help="Slot (GGSQ) or session (GGSN) files."),
    model: Path | None = typer.Option(None, "--model", "-m", help="GGUF model: adds a detokenised preview."),
    layers: bool = typer.Option(False, "--layers", help="List every layer's K/V/R/S entry."),
) -> None:
    """A summary of each file: format, tokens, memory layout, sections, checkpoints, verdict."""
    from slotfile.cli.inspect_cmd import run_inspect

    raise typer.Exit(run_inspect(files, model, layers))


@app.command(
    context_settings=HELP,
    epilog=_examples(
        "slotfile dump slot0.bin",
        "slotfile dump slot0.bin --json --tokens > slot0.json",
        "slotfile dump slot0.bin --json | jq .problems",
    ),
)
def dump(
    file: Path = typer.Argument(..., help="Slot (GGSQ) or session (GGSN) file."),
    json_out: bool = typer.Option(False, "--json", help="JSON on stdout (schema slotfile.dump/1, see README)."),
    tokens: bool = typer.Option(False, "--tokens", help="Include the token id arrays."),
    model: Path | None = typer.Option(None, "--model", "-m", help="GGUF model: adds the detokenised text."),
) -> None:
    """Every field with its byte offset, as text or JSON."""
    from slotfile.cli.dump_cmd import run_dump

    raise typer.Exit(run_dump(file, json_out, tokens, model))


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
    jobs: int,
    n_gpu_layers: int,
    timeout: float,
    quiet: bool,
    **others: object,
) -> int:
    """verify --server-args: the restore verdict per file (slotfile.restore/1)."""
    from slotfile.cli.common import fail
    from slotfile.cli.restore_cmd import run_restore_check

    used = [f"--{k.replace('_', '-')}" for k, v in others.items() if v]
    if used:
        fail(f"--server-args does not combine with {', '.join(used)}", "verify")
        return 2
    return run_restore_check(paths, server_args, model, json_out, jobs, n_gpu_layers, timeout, quiet)


@app.command(
    context_settings=HELP,
    epilog=_examples(
        "slotfile verify slots/                    # structure only",
        "slotfile verify slots/ -m model.gguf -q   # test-load too, quietly",
        "slotfile verify slot0.bin -m model.gguf --deep --junit verify.xml",
    ),
)
def verify(
    paths: list[Path] = typer.Argument(
        ..., help="Slot files, or directories (every *.slot / *.bin / slot-magic file under them)."
    ),
    model: Path | None = typer.Option(None, "--model", "-m", help="GGUF model: metadata checks and a test-load."),
    draft_model: Path | None = typer.Option(
        None, "--draft-model", help="Draft GGUF: check and test-load the draft state."
    ),
    deep: bool = typer.Option(False, "--deep", help="Recompute the state from the tokens and compare K/V and logits."),
    n_gpu_layers: int = typer.Option(0, "--n-gpu-layers", help="Layers to offload in the loader (default 0: CPU)."),
    jobs: int = typer.Option(1, "--jobs", "-j", help="Loader worker processes (files verified in parallel)."),
    json_out: bool = typer.Option(False, "--json", help="JSON on stdout (schema slotfile.verify/1, see README)."),
    junit: Path | None = typer.Option(None, "--junit", help="Also write JUnit XML here (one testcase per file)."),
    timeout: float = typer.Option(300.0, "--timeout", help="Seconds allowed for each llama.cpp load."),
    scan: bool = typer.Option(
        False, "--scan", help="Structure level: check every K/V/R/S value is finite (reads all data)."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No table: the failing files and the summary line only."),
    llama_lib: Path | None = typer.Option(None, "--llama-lib", help=_LLAMA_LIB_HELP),
    server_args: str | None = _SERVER_ARGS,
    n_batch: int = typer.Option(
        2048, "--n-batch", min=1, help="--deep: the recompute's n_batch (match the server's -b; default 2048)."
    ),
    n_ubatch: int = typer.Option(
        512, "--n-ubatch", min=1, help="--deep: the recompute's n_ubatch (match the server's -ub; default 512)."
    ),
) -> None:
    """Structure, model metadata, a real test-load and (--deep) a recompute, each reported per file."""
    if server_args is not None:
        raise typer.Exit(
            _verify_for_server(
                paths,
                server_args,
                model,
                json_out,
                jobs,
                n_gpu_layers,
                timeout,
                quiet,
                deep=deep,
                junit=junit,
                scan=scan,
                draft_model=draft_model,
            )
        )
    pool = None
    if model is not None and jobs >= 1 and model.is_file() and (draft_model is None or draft_model.is_file()):
        # the llama.cpp workers load the model while this process imports and parses
        from slotfile.llama.loader import LoaderError, LoaderPool

        try:
            pool = LoaderPool.start(
                str(model), str(draft_model) if draft_model else None, n_gpu_layers, jobs, llama_lib=llama_lib
            )
        except LoaderError:  # an unusable --llama-lib: reported by run_verify, with its exit code
            pool = None
    from slotfile.cli.verify_cmd import run_verify

    raise typer.Exit(
        run_verify(
            paths,
            model,
            draft_model,
            deep,
            n_gpu_layers,
            jobs,
            json_out,
            junit,
            timeout,
            scan,
            pool=pool,
            quiet=quiet,
            llama_lib=llama_lib,
            n_batch=n_batch,
            n_ubatch=n_ubatch,
        )
    )


_OUT = typer.Option(None, "--output", "-o", help="Where to write the repaired file (must not exist unless --force).")
_FORCE = typer.Option(False, "--force", help="Replace an existing OUT (or backup).")
_IN_PLACE = typer.Option(
    False, "--in-place", help="Replace IN itself, keeping IN.bak (or --backup); never through a symlink."
)
_BACKUP = typer.Option(None, "--backup", help="Backup path for --in-place (default IN.bak).")
_DRY = typer.Option(False, "--dry-run", help="Print the plan; write nothing.")
_JSON = typer.Option(False, "--json", help="The report as JSON on stdout (schema slotfile.repair/1).")
_DRAFT = typer.Option(None, "--draft-model", help="Draft GGUF: test-load (and rebuild) the draft state too.")
_TIMEOUT = typer.Option(600.0, "--timeout", help="Seconds allowed for each llama.cpp worker.")
_LLAMA_LIB = typer.Option(None, "--llama-lib", help=_LLAMA_LIB_HELP)


@app.command(
    "truncate-recover",
    context_settings=HELP,
    epilog=_examples(
        "slotfile truncate-recover slot0.bin --dry-run      # print the plan",
        "slotfile truncate-recover slot0.bin -o fixed.bin",
        "slotfile truncate-recover slot0.bin -o fixed.bin -m model.gguf",
    ),
)
def truncate_recover(
    file: Path = typer.Argument(..., help="Damaged slot file (opened read-only)."),
    output: Path | None = _OUT,
    model: Path | None = typer.Option(
        None, "--model", "-m", help="GGUF model: test-load the result; rebuild a damaged body from the tokens."
    ),
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
    force: bool = _FORCE,
    in_place: bool = _IN_PLACE,
    backup: Path | None = _BACKUP,
    dry_run: bool = _DRY,
    json_out: bool = _JSON,
    timeout: float = _TIMEOUT,
    llama_lib: Path | None = _LLAMA_LIB,
) -> None:
    """Keep every intact section; drop damaged checkpoints, a damaged SDFT and trailing bytes;
    with --model rebuild a cut body."""
    from slotfile.cli.repair_cmd import run_repair

    raise typer.Exit(
        run_repair(
            "truncate-recover",
            file,
            output,
            force=force,
            in_place=in_place,
            backup=backup,
            dry_run=dry_run,
            json_out=json_out,
            model=model,
            draft_model=draft_model,
            flash_attn=flash_attn,
            cache_type_k=cache_type_k,
            cache_type_v=cache_type_v,
            checkpoint_at=checkpoint_at,
            timeout=timeout,
            llama_lib=llama_lib,
        )
    )


@app.command(
    "strip-draft",
    context_settings=HELP,
    epilog=_examples(
        "slotfile strip-draft slot0.bin -o nodraft.bin",
        "slotfile strip-draft slot0.bin --in-place     # keeps slot0.bin.bak",
    ),
)
def strip_draft(
    file: Path = typer.Argument(..., help="Slot file (opened read-only)."),
    output: Path | None = _OUT,
    model: Path | None = typer.Option(None, "--model", "-m", help="GGUF model: test-load the result."),
    force: bool = _FORCE,
    in_place: bool = _IN_PLACE,
    backup: Path | None = _BACKUP,
    dry_run: bool = _DRY,
    json_out: bool = _JSON,
    timeout: float = _TIMEOUT,
    llama_lib: Path | None = _LLAMA_LIB,
) -> None:
    """Remove the SDFT appendix and every checkpoint's draft and speculative blobs; the target
    state stays byte-identical."""
    from slotfile.cli.repair_cmd import run_repair

    raise typer.Exit(
        run_repair(
            "strip-draft",
            file,
            output,
            force=force,
            in_place=in_place,
            backup=backup,
            dry_run=dry_run,
            json_out=json_out,
            model=model,
            timeout=timeout,
            llama_lib=llama_lib,
        )
    )


_RESAVE_CTK = typer.Option(None, "--cache-type-k", help="Recompute the state with this K cache type (lossy).")
_RESAVE_CTV = typer.Option(None, "--cache-type-v", help="Recompute the state with this V cache type (lossy).")
_RESAVE_SERVER_ARGS = typer.Option(
    None, "--server-args", help="With a directory: the llama-server command line to convert every file for."
)
_LS_SERVER_ARGS = typer.Option(
    None, "--server-args", help="A restore verdict per file for this llama-server command line (structure only)."
)
_SETTLE = typer.Option(5.0, "--settle", help="Seconds since the last write before a file counts as complete.")


@app.command(
    "re-save",
    context_settings=HELP,
    epilog=_examples(
        "slotfile re-save slot0.bin -m model.gguf --flash-attn on -o fa.bin",
        "slotfile re-save slot0.bin -m model.gguf --tokens plain -o plain.bin",
        "slotfile re-save slots/ -o new/ --server-args 'llama-server -m m.gguf -np 4'",
    ),
)
def re_save(
    file: Path = typer.Argument(..., help="Slot file (opened read-only), or a directory (with --server-args)."),
    output: Path | None = _OUT,
    model: Path | None = typer.Option(None, "--model", "-m", help="GGUF model (required)."),
    draft_model: Path | None = _DRAFT,
    flash_attn: str | None = typer.Option(None, "--flash-attn", help="on|off: write the V layout for this setting."),
    tokens: str | None = typer.Option(None, "--tokens", help="packed|plain: convert the token payload."),
    recompute: bool = typer.Option(
        False, "--recompute", help="With --flash-attn: prefill the tokens again instead of rewriting V."
    ),
    cache_type_k: str | None = _RESAVE_CTK,
    cache_type_v: str | None = _RESAVE_CTV,
    server_args: str | None = _RESAVE_SERVER_ARGS,
    force: bool = _FORCE,
    in_place: bool = _IN_PLACE,
    backup: Path | None = _BACKUP,
    dry_run: bool = _DRY,
    json_out: bool = _JSON,
    timeout: float = _TIMEOUT,
    llama_lib: Path | None = _LLAMA_LIB,
) -> None:
    """Load the body through llama.cpp and write it again, keeping the checkpoints and draft state."""
    if file.is_dir() or server_args is not None:
        raise typer.Exit(
            _resave_dir(
                file,
                output,
                server_args,
                model,
                dry_run=dry_run,
                force=force,
                json_out=json_out,
                timeout=timeout,
                in_place=in_place,
            )
        )
    from slotfile.cli.repair_cmd import run_repair

    raise typer.Exit(
        run_repair(
            "re-save",
            file,
            output,
            force=force,
            in_place=in_place,
            backup=backup,
            dry_run=dry_run,
            json_out=json_out,
            model=model,
            draft_model=draft_model,
            flash_attn=flash_attn,
            tokens=tokens,
            recompute=recompute,
            timeout=timeout,
            cache_type_k=cache_type_k,
            cache_type_v=cache_type_v,
            llama_lib=llama_lib,
        )
    )


def _resave_dir(
    root: Path,
    output: Path | None,
    server_args: str | None,
    model: Path | None,
    *,
    dry_run: bool,
    force: bool,
    json_out: bool,
    timeout: float,
    in_place: bool,
) -> int:
    """re-save DIR -o OUTDIR --server-args ARGS."""
    from slotfile.cli.common import fail
    from slotfile.cli.restore_cmd import run_resave_dir

    if not root.is_dir():
        fail("--server-args goes with a directory: re-save DIR -o OUTDIR --server-args ARGS", "re-save")
        return 2
    if in_place:
        fail("a directory is never converted in place: give -o OUTDIR", "re-save")
        return 2
    return run_resave_dir(
        root, output, server_args, model, dry_run=dry_run, force=force, json_out=json_out, timeout=timeout
    )


@app.command(
    "ls",
    context_settings=HELP,
    epilog=_examples(
        "slotfile ls /var/lib/llama/slots --sort size",
        "slotfile ls slots/ --server-args 'llama-server -m m.gguf -np 4 -fa on'",
        "slotfile ls slots/ --json | jq .totals",
    ),
)
def ls(
    directory: Path = typer.Argument(..., help="A --slot-save-path directory (searched recursively)."),
    json_out: bool = typer.Option(False, "--json", help="JSON on stdout (schema slotfile.ls/1)."),
    sort: str = typer.Option("path", "--sort", help="path|size|age|tokens (largest / oldest first)."),
    server_args: str | None = _LS_SERVER_ARGS,
    model: Path | None = typer.Option(None, "--model", "-m", help="GGUF model (default: the server's -m)."),
    settle: float = _SETTLE,
    llama_lib: Path | None = typer.Option(
        None,
        "--llama-lib",
        help="A llama.cpp build (folder of libllama.so): per file, does it load as is, after migrate, or not at all "
        "(needs --model).",
    ),
) -> None:
    """One row per slot file (size, tokens, version, memory, streams, K/V types, flash attention, checkpoints,
    draft, age) and totals."""
    if llama_lib is not None:
        from slotfile.cli.migrate_cmd import run_ls_library

        raise typer.Exit(run_ls_library(directory, llama_lib, model, json_out, settle, server_args))
    from slotfile.cli.ls_cmd import run_ls

    raise typer.Exit(run_ls(directory, json_out, sort, server_args, model, settle))


@app.command(
    "prune",
    context_settings=HELP,
    epilog=_examples(
        "slotfile prune slots/ --max-total 10G                 # print the plan",
        "slotfile prune slots/ --older-than 7d --damaged --delete",
        "slotfile prune slots/ --keep 100 --max-total 500M --delete",
    ),
)
def prune(
    directory: Path = typer.Argument(..., help="A --slot-save-path directory (recursive; symlinks not followed)."),
    max_total: str | None = typer.Option(None, "--max-total", help="Oldest first until the rest fits (10G, 500M)."),
    older_than: str | None = typer.Option(None, "--older-than", help="Files last modified longer ago (7d, 12h)."),
    keep: int | None = typer.Option(None, "--keep", help="Keep at most this many files (the newest)."),
    damaged: bool = typer.Option(False, "--damaged", help="Remove damaged files (first)."),
    delete: bool = typer.Option(False, "--delete", help="Remove the planned files (without it: print the plan only)."),
    json_out: bool = typer.Option(False, "--json", help="JSON on stdout (schema slotfile.prune/1)."),
    settle: float = _SETTLE,
) -> None:
    """Plan which slot files to remove to meet a quota (oldest first); remove them only with --delete."""
    from slotfile.cli.prune_cmd import run_prune

    raise typer.Exit(run_prune(directory, max_total, older_than, keep, damaged, delete, json_out, settle))


@app.command(
    context_settings=HELP,
    epilog=_examples(
        "slotfile completion bash > ~/.local/share/bash-completion/completions/slotfile",
        "echo 'source <(slotfile completion zsh)' >> ~/.zshrc",
        "slotfile completion fish > ~/.config/fish/completions/slotfile.fish",
    ),
)
def completion(shell: str = typer.Argument(..., help="bash, zsh or fish.")) -> None:
    """Print the shell completion script (commands, options, file names); nothing is installed."""
    from slotfile.cli.completion_cmd import run_completion

    raise typer.Exit(run_completion(shell))


@app.command(
    "migrate",
    context_settings=HELP,
    epilog=_examples(
        "slotfile migrate slot0.bin -o slot0.v4.bin --to 4             # float caches: no model needed",
        "slotfile migrate slot0.bin -o slot0.v4.bin --to 4 -m model.gguf",
        "slotfile migrate slot0.v4.bin -o slot0.bin --to 3 -m model.gguf",
        "slotfile migrate slots/ -o slots.v4/ --to 4 -m model.gguf --llama-lib /opt/llama.cpp/build/bin",
    ),
)
def migrate(
    file: Path = typer.Argument(
        ..., help="Slot (GGSQ 2/3/4) or session (GGSN 9/10/11) file, or a directory of them (read-only)."
    ),
    output: Path | None = _OUT,
    to: int = typer.Option(
        ..., "--to", help="Target state version: 2, 3 or 4 (a session file: 9, 10 or 11, or 2/3/4)."
    ),
    model: Path | None = typer.Option(
        None,
        "--model",
        "-m",
        help="GGUF model: the rotation widths of a quantized cache; checks and test-loads the result.",
    ),
    draft_model: Path | None = typer.Option(
        None, "--draft-model", help="Draft GGUF: the widths of a quantized draft cache."
    ),
    force: bool = _FORCE,
    in_place: bool = _IN_PLACE,
    backup: Path | None = _BACKUP,
    dry_run: bool = _DRY,
    json_out: bool = _JSON,
    timeout: float = _TIMEOUT,
    llama_lib: Path | None = _LLAMA_LIB,
    only_changed: bool = typer.Option(
        False, "--only-changed", help="DIR: leave out files already at the target version (default: copy them)."
    ),
) -> None:
    """Convert between state versions 2, 3 and 4 (llama.cpp to 2026-08 / to 2026-10-05 / from then),
    both ways, wherever lossless.  With --llama-lib DIR (a build of the target version) the output is
    test-loaded through it before it lands.  A directory is migrated into -o OUTDIR (same tree)."""
    if file.is_dir():
        from slotfile.cli.migrate_cmd import run_migrate_dir

        raise typer.Exit(
            run_migrate_dir(
                file,
                output,
                to,
                model,
                draft_model,
                llama_lib,
                dry_run=dry_run,
                force=force,
                only_changed=only_changed,
                json_out=json_out,
                timeout=timeout,
            )
        )
    from slotfile.cli.repair_cmd import run_repair

    raise typer.Exit(
        run_repair(
            "migrate",
            file,
            output,
            force=force,
            in_place=in_place,
            backup=backup,
            dry_run=dry_run,
            json_out=json_out,
            model=model,
            draft_model=draft_model,
            to_version=to,
            timeout=timeout,
            llama_lib=llama_lib,
        )
    )


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
