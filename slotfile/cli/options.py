"""The typer options and help text several commands share, defined once."""

from __future__ import annotations

from typing import Any

import typer

# -h as well as --help, on the group and on every command
HELP = {"help_option_names": ["-h", "--help"]}


def examples(*lines: str) -> str:
    """An epilog of examples; the \\b paragraph keeps click from re-wrapping the lines."""
    return "\b\nExamples:\n" + "\n".join(f"  {line}" for line in lines)


LLAMA_LIB_HELP = (
    "A folder holding libllama.so and its libggml*.so (a llama.cpp build's bin/): the llama.cpp the "
    "workers load, e.g. one that loads the file's state version (env SLOTFILELLAMA_LIB)."
)


LLAMA_LIB = typer.Option(None, "--llama-lib", help=LLAMA_LIB_HELP)


def model_option(help: str) -> Any:
    """``--model/-m``: every command takes it; what it is used for differs."""
    return typer.Option(None, "--model", "-m", help=help)


def json_option(help: str) -> Any:
    return typer.Option(False, "--json", help=help)


LS_SERVER_ARGS = typer.Option(
    None, "--server-args", help="A restore verdict per file for this llama-server command line (structure only)."
)
SETTLE = typer.Option(5.0, "--settle", help="Seconds since the last write before a file counts as complete.")
SETTLE_WAIT = typer.Option(
    30.0,
    "--settle-wait",
    help="Seconds to wait for files still being written (inside --settle) before handling them; "
    "a file still changing then is named and the exit code is 4 (0 to 86400).",
)

# slotfile verify: its options, declared here so that verify() holds only its steps
VERIFY_PATHS = typer.Argument(
    ..., help="Slot files, or directories (every *.slot / *.bin / slot-magic file under them)."
)
VERIFY_DRAFT_MODEL = typer.Option(None, "--draft-model", help="Draft GGUF: check and test-load the draft state.")
VERIFY_DEEP = typer.Option(False, "--deep", help="Recompute the state from the tokens and compare K/V and logits.")
VERIFY_N_GPU_LAYERS = typer.Option(0, "--n-gpu-layers", help="Layers to offload in the loader (default 0: CPU).")
VERIFY_JOBS = typer.Option(
    None,
    "--jobs",
    "-j",
    help="Files verified in parallel: loader worker processes with --model (default 1); structure only, "
    "processes reading a directory of 200+ files (default 2, or $SLOTFILE_DIR_JOBS).",
)
VERIFY_JUNIT = typer.Option(None, "--junit", help="Also write JUnit XML here (one testcase per file).")
VERIFY_TIMEOUT = typer.Option(300.0, "--timeout", help="Seconds allowed for each llama.cpp load.")
VERIFY_SCAN = typer.Option(
    False, "--scan", help="Structure level: check every K/V/R/S value is finite (reads all data)."
)
VERIFY_QUIET = typer.Option(False, "--quiet", "-q", help="No table: the failing files and the summary line only.")
VERIFY_N_BATCH = typer.Option(
    2048, "--n-batch", min=1, help="--deep: the recompute's n_batch (match the server's -b; default 2048)."
)
VERIFY_N_UBATCH = typer.Option(
    512, "--n-ubatch", min=1, help="--deep: the recompute's n_ubatch (match the server's -ub; default 512)."
)
VERIFY_SETTLE = typer.Option(
    5.0,
    "--settle",
    help="DIR: seconds since the last write before a file counts as complete (newer ones are waited for).",
)
VERIFY_SETTLE_WAIT = typer.Option(
    30.0,
    "--settle-wait",
    help="DIR: seconds to wait for files still being written; one still changing then is named "
    "and the exit code is 4 (0 to 86400).",
)
VERIFY_REQUIRE = typer.Option(
    None,
    "--require",
    help="Levels that must run on every file (structure|model|load|deep; repeat or comma list): "
    "a file where one was skipped fails, naming the option that would check it.",
)
VERIFY_MANIFEST = typer.Option(
    None, "--manifest", help="Check against this manifest (slotfile seal); default: DIR/slotfile-manifest.json."
)
VERIFY_MODELS = typer.Option(
    None, "--models", help="Candidate GGUFs or folders: each file verified with the model identify picks."
)
