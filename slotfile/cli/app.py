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
    from slotfile.cli.inspect_cmd import InspectArgs, run_inspect

    raise typer.Exit(run_inspect(InspectArgs(tuple(files), model, layers)))


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
    jobs: int,
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
        RestoreCheckArgs(tuple(paths), server_args, model, json_out, jobs, n_gpu_layers, timeout, quiet)
    )


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
    settle: float = typer.Option(
        5.0,
        "--settle",
        help="DIR: seconds since the last write before a file counts as complete (newer ones are waited for).",
    ),
    settle_wait: float = typer.Option(
        30.0,
        "--settle-wait",
        help="DIR: seconds to wait for files still being written; one still changing then is named "
        "and the exit code is 4 (0 to 86400).",
    ),
    require: list[str] | None = typer.Option(
        None,
        "--require",
        help="Levels that must run on every file (structure|model|load|deep; repeat or comma list): "
        "a file where one was skipped fails, naming the option that would check it.",
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
                require=bool(require),
            )
        )
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
        settle_wait=settle_wait,
        require=tuple(v.strip().lower() for r in require or () for v in r.split(",")),
    )
    raise typer.Exit(run_verify(request))


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
    from slotfile.cli.repair_cmd import RepairArgs, run_repair

    args = RepairArgs(
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
        checkpoint_at=tuple(checkpoint_at or ()),
        timeout=timeout,
        llama_lib=llama_lib,
    )
    raise typer.Exit(run_repair(args))


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
    from slotfile.cli.repair_cmd import RepairArgs, run_repair

    args = RepairArgs(
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
    raise typer.Exit(run_repair(args))


_RESAVE_CTK = typer.Option(None, "--cache-type-k", help="Recompute the state with this K cache type (lossy).")
_RESAVE_CTV = typer.Option(None, "--cache-type-v", help="Recompute the state with this V cache type (lossy).")
_RESAVE_SERVER_ARGS = typer.Option(
    None, "--server-args", help="With a directory: the llama-server command line to convert every file for."
)
_LS_SERVER_ARGS = typer.Option(
    None, "--server-args", help="A restore verdict per file for this llama-server command line (structure only)."
)
_SETTLE = typer.Option(5.0, "--settle", help="Seconds since the last write before a file counts as complete.")
_SETTLE_WAIT = typer.Option(
    30.0,
    "--settle-wait",
    help="Seconds to wait for files still being written (inside --settle) before handling them; "
    "a file still changing then is named and the exit code is 4 (0 to 86400).",
)


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
    settle: float = _SETTLE,
    settle_wait: float = _SETTLE_WAIT,
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
                    dry_run=dry_run,
                    force=force,
                    json_out=json_out,
                    in_place=in_place,
                    timeout=timeout,
                    settle=settle,
                    settle_wait=settle_wait,
                )
            )
        )
    from slotfile.cli.repair_cmd import RepairArgs, run_repair

    args = RepairArgs(
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
    raise typer.Exit(run_repair(args))


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
    settle_wait: float = _SETTLE_WAIT,
) -> None:
    """One row per slot file (size, tokens, version, memory, streams, K/V types, flash attention, checkpoints,
    draft, age) and totals."""
    from slotfile.cli.ls_cmd import LsArgs, run_ls

    raise typer.Exit(run_ls(LsArgs(directory, json_out, sort, server_args, model, settle, settle_wait)))


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
    settle_wait: float = _SETTLE_WAIT,
) -> None:
    """Plan which slot files to remove to meet a quota (oldest first); remove them only with --delete."""
    from slotfile.cli.prune_cmd import PruneArgs, run_prune

    args = PruneArgs(directory, max_total, older_than, keep, damaged, delete, json_out, settle, settle_wait)
    raise typer.Exit(run_prune(args))


@app.command(
    "precommit",
    context_settings=HELP,
    epilog=_examples(
        "slotfile precommit sessions/a.slot firmware.bin   # firmware.bin: passed over",
        "slotfile precommit -v $(git diff --cached --name-only)",
    ),
)
def precommit(
    files: list[Path] = typer.Argument(..., help="Files a commit adds or changes (as pre-commit passes them)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Name every file passed over, and why."),
    model: Path | None = typer.Option(None, "--model", "-m", help="GGUF model: metadata checks and a test-load."),
    llama_lib: Path | None = typer.Option(None, "--llama-lib", help=_LLAMA_LIB_HELP),
) -> None:
    """The pre-commit hook: verify the files that carry a slot magic (GGSQ/GGSN), pass over the rest."""
    from slotfile.cli.precommit_cmd import PrecommitArgs, run_precommit

    raise typer.Exit(run_precommit(PrecommitArgs(tuple(files), verbose, model, llama_lib)))


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
    ),
)
def migrate(
    file: Path = typer.Argument(..., help="Slot (GGSQ 3/4) or session (GGSN 10/11) file (opened read-only)."),
    output: Path | None = _OUT,
    to: int = typer.Option(..., "--to", help="Target state version: 3 or 4 (a session file: 10 or 11, or 3/4)."),
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
) -> None:
    """Convert between state versions 3 and 4 (llama.cpp before / from 2026-10-05): add or
    remove the K/V rotation words.  With --llama-lib DIR (a build of the target version) the
    output is test-loaded through it before it lands."""
    from slotfile.cli.repair_cmd import RepairArgs, run_repair

    args = RepairArgs(
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
    raise typer.Exit(run_repair(args))


@app.command(
    "diff",
    context_settings=HELP,
    epilog=_examples(
        "slotfile diff slot0.bin slot0.repaired.bin",
        "slotfile diff slot0.bin slot0.v4.bin     # after migrate --to 4: exit 0",
        "slotfile diff a.bin b.bin --model model.gguf --json",
    ),
)
def diff(
    file_a: Path = typer.Argument(
        ..., metavar="A", help="First slot (GGSQ) or session (GGSN) file (opened read-only)."
    ),
    file_b: Path = typer.Argument(..., metavar="B", help="Second file."),
    model: Path | None = typer.Option(
        None,
        "--model",
        "-m",
        help="GGUF model: text around a token difference, head sizes for the angles, model layer numbers.",
    ),
    json_out: bool = typer.Option(False, "--json", help="JSON on stdout (schema slotfile.diff/1)."),
) -> None:
    """Where two files differ, in file order: headers and settings, tokens, every layer over the
    cells both hold (head angle, relative difference, worst cell), checkpoints, draft state.
    Exit 0 identical (or identical but for the rotation words), 1 different, 8 cannot read."""
    from slotfile.cli.diff_cmd import DiffArgs, run_diff

    raise typer.Exit(run_diff(DiffArgs(file_a, file_b, model, json_out)))


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
