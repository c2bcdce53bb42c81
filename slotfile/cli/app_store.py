"""The typer commands over a whole slot store and between files: ls, prune, precommit,
completion, diff, seal and identify (registered on :data:`slotfile.cli.app.app`)."""

from __future__ import annotations

from pathlib import Path

import typer

from slotfile.cli.options import (
    HELP,
    LLAMA_LIB,
    LS_SERVER_ARGS,
    SETTLE,
    SETTLE_WAIT,
    examples,
    json_option,
    model_option,
)
from slotfile.cli.root import app, one_blas_thread


@app.command(
    "ls",
    context_settings=HELP,
    epilog=examples(
        "slotfile ls /var/lib/llama/slots --sort size",
        "slotfile ls slots/ --server-args 'llama-server -m m.gguf -np 4 -fa on'",
        "slotfile ls slots/ --json | jq .totals",
    ),
)
def ls(
    directory: Path = typer.Argument(..., help="A --slot-save-path directory (searched recursively)."),
    json_out: bool = json_option("JSON on stdout (schema slotfile.ls/1)."),
    sort: str = typer.Option("path", "--sort", help="path|size|age|tokens (largest / oldest first)."),
    server_args: str | None = LS_SERVER_ARGS,
    model: Path | None = model_option("GGUF model (default: the server's -m)."),
    settle: float = SETTLE,
    settle_wait: float = SETTLE_WAIT,
    models: list[Path] | None = typer.Option(
        None, "--models", help="Candidate GGUFs or folders: a model column (slotfile identify)."
    ),
    llama_lib: Path | None = typer.Option(
        None,
        "--llama-lib",
        help="A llama.cpp build (folder of libllama.so): per file, does it load as is, after migrate, or not at all "
        "(needs --model or --server-args with -m).",
    ),
) -> None:
    """One row per slot file (size, tokens, version, memory, streams, K/V types, flash attention, checkpoints,
    draft, age) and totals.  With --llama-lib: per file, whether that llama.cpp loads it as is, after
    migrate, or not at all."""
    one_blas_thread()
    if llama_lib is not None:
        from slotfile.cli.migrate_cmd import LsLibraryArgs, run_ls_library

        raise typer.Exit(run_ls_library(LsLibraryArgs(directory, llama_lib, model, json_out, settle, server_args)))
    from slotfile.cli.ls_cmd import LsArgs, run_ls

    raise typer.Exit(
        run_ls(LsArgs(directory, json_out, sort, server_args, model, settle, settle_wait, tuple(models or ())))
    )


@app.command(
    "prune",
    context_settings=HELP,
    epilog=examples(
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
    json_out: bool = json_option("JSON on stdout (schema slotfile.prune/1)."),
    settle: float = SETTLE,
    settle_wait: float = SETTLE_WAIT,
) -> None:
    """Plan which slot files to remove to meet a quota (oldest first); remove them only with --delete."""
    from slotfile.cli.prune_cmd import PruneArgs, run_prune

    args = PruneArgs(directory, max_total, older_than, keep, damaged, delete, json_out, settle, settle_wait)
    raise typer.Exit(run_prune(args))


@app.command(
    "precommit",
    context_settings=HELP,
    epilog=examples(
        "slotfile precommit sessions/a.slot firmware.bin   # firmware.bin: passed over",
        "slotfile precommit -v $(git diff --cached --name-only)",
    ),
)
def precommit(
    files: list[Path] = typer.Argument(..., help="Files a commit adds or changes (as pre-commit passes them)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Name every file passed over, and why."),
    model: Path | None = model_option("GGUF model: metadata checks and a test-load."),
    llama_lib: Path | None = LLAMA_LIB,
) -> None:
    """The pre-commit hook: verify the files that carry a slot magic (GGSQ/GGSN), pass over the rest."""
    from slotfile.cli.precommit_cmd import PrecommitArgs, run_precommit

    raise typer.Exit(run_precommit(PrecommitArgs(tuple(files), verbose, model, llama_lib)))


@app.command(
    context_settings=HELP,
    epilog=examples(
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
    "diff",
    context_settings=HELP,
    epilog=examples(
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
    model: Path | None = model_option(
        "GGUF model: text around a token difference, head sizes for the angles, model layer numbers."
    ),
    json_out: bool = json_option("JSON on stdout (schema slotfile.diff/1)."),
) -> None:
    """Where two files differ, in file order: headers and settings, tokens, every layer over the
    cells both hold (head angle, relative difference, worst cell), checkpoints, draft state.
    Exit 0 identical (or identical but for the rotation words), 1 different, 8 cannot read."""
    from slotfile.cli.diff_cmd import DiffArgs, run_diff

    raise typer.Exit(run_diff(DiffArgs(file_a, file_b, model, json_out)))


@app.command(
    "seal",
    context_settings=HELP,
    epilog=examples(
        "slotfile seal slots/                                  # writes slots/slotfile-manifest.json",
        "slotfile seal slots/ -m model.gguf                    # verified, with the model's fingerprint",
        "slotfile seal slots/ --update                         # re-seal new and changed files",
        "slotfile verify slots/                                # checks every file against the manifest",
    ),
)
def seal_command(
    paths: list[Path] = typer.Argument(..., help="Slot files and directories (searched recursively) to seal."),
    output: Path | None = typer.Option(
        None, "--output", "-o", help="The manifest (default: slotfile-manifest.json in the directory given)."
    ),
    model: Path | None = model_option("GGUF model: verify (model check, test-load) and record its fingerprint."),
    draft_model: Path | None = typer.Option(None, "--draft-model", help="Draft GGUF (with --model)."),
    deep: bool = typer.Option(False, "--deep", help="Also recompute each file before sealing it (with --model)."),
    force: bool = typer.Option(
        False, "--force", help="Seal files that fail too (their verdict is recorded); replace a manifest."
    ),
    update: bool = typer.Option(False, "--update", help="Re-seal new and changed files into the existing manifest."),
    jobs: int = typer.Option(
        1, "--jobs", "-j", help="Files verified at once with --model (loader workers); hashing uses up to 4 threads."
    ),
    timeout: float = typer.Option(300.0, "--timeout", help="Seconds for each llama.cpp load."),
    llama_lib: Path | None = LLAMA_LIB,
    json_out: bool = json_option("JSON on stdout (schema slotfile.seal/1)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only refusals and the summary line."),
) -> None:
    """Write a checksum manifest (schema slotfile.manifest/1) of a slot store: per file its size,
    mtime, checksum, format, tokens digest, memory class and cache types; with --model the model's
    fingerprint and the verify levels that passed.  `verify DIR` then checks it."""
    from slotfile.cli.seal_cmd import SealArgs, run_seal

    args = SealArgs(
        tuple(paths),
        output=output,
        model=model,
        draft_model=draft_model,
        deep=deep,
        force=force,
        update=update,
        jobs=jobs,
        timeout=timeout,
        llama_lib=llama_lib,
        json_out=json_out,
        quiet=quiet,
    )
    raise typer.Exit(run_seal(args))


@app.command(
    "identify",
    context_settings=HELP,
    epilog=examples(
        "slotfile identify slot0.bin --models /models/",
        "slotfile identify slots/ --models a.gguf b.gguf --json",
        "slotfile identify slot0.bin --models /models/ --no-proof   # metadata fit only",
    ),
)
def identify_command(
    files: list[Path] = typer.Argument(..., help="Slot files and directories."),
    models: list[Path] = typer.Option(..., "--models", help="Candidate GGUF files or folders of them (repeatable)."),
    proof: bool = typer.Option(
        True, "--proof/--no-proof", help="Recompute the first K/V rows under each fitting model."
    ),
    timeout: float = typer.Option(300.0, "--timeout", help="Seconds for each llama.cpp load or recompute."),
    llama_lib: Path | None = LLAMA_LIB,
    json_out: bool = json_option("JSON on stdout (schema slotfile.identify/1)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only each file's answer, no ranking."),
) -> None:
    """Which model wrote each slot file: candidates ranked by metadata fit (memory class, layers,
    heads, row sizes, types, token ids, positions), then proven by recomputing the first layers'
    K and V rows of the first stored tokens (bit-identical, or within the cache type's noise)."""
    from slotfile.cli.identify_cmd import IdentifyArgs, run_identify

    args = IdentifyArgs(tuple(files), tuple(models), proof, timeout, llama_lib, json_out, quiet)
    raise typer.Exit(run_identify(args))
