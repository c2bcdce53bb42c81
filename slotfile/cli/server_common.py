"""What the commands that take ``--server-args`` share: reading the flags and the model, and
the server as JSON.  (Their listings: :mod:`slotfile.cli.listing`.)"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from slotfile.cli.common import fail
from slotfile.exitcodes import OPERATIONAL, USAGE
from slotfile.slotdir.serverargs import ServerArgsError, ServerSettings, parse_server_args


def server_and_model(
    server_args: str, model: Path | None, command: str, need_model: bool = True
) -> tuple[ServerSettings, str | None] | int:
    """The parsed flags and the model to use (``--model`` over the server's ``-m``), or an exit code."""
    try:
        server = parse_server_args(server_args)
    except ServerArgsError as e:
        fail(f"--server-args: {e}", command)
        return USAGE
    for p in server.problems():
        fail(f"--server-args: {p}", command)
        return USAGE
    path = str(model) if model is not None else server.model
    if path is None and need_model:
        fail("--server-args has no -m MODEL and no --model was given: a test-load needs the model", command)
        return USAGE
    if path is not None and not os.path.isfile(path) and (need_model or model is not None):
        fail(f"model not found: {path}", command)
        return OPERATIONAL
    return server, path if path is not None and os.path.isfile(path) else None


def server_dict(server: Any) -> dict[str, Any]:
    from dataclasses import asdict

    d = asdict(server)
    d["n_stream"] = server.n_stream
    d["describe"] = server.describe()
    return d
