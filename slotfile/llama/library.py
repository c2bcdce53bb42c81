"""Which llama.cpp library the loader workers load: ``--llama-lib``, ``$SLOTFILE_LLAMA_LIB``,
llama-cpp-python's own, or the library beside the ``llama-server`` on PATH.  Nothing here loads
a library: the chosen folder is handed to the worker process in its environment."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class LoaderError(Exception):
    """The loader could not start (model missing or unloadable, a library folder that does not
    exist, holds no libllama or does not load): an operational error, one line."""


LIB_ENV = "SLOTFILE_LLAMA_LIB"  # the folder --llama-lib names, for every command
LIB_NAME = "libllama.so"


@dataclass(frozen=True)
class Library:
    """The llama.cpp library a worker loads: ``path`` a folder holding libllama.so (handed to
    llama-cpp-python as LLAMA_CPP_LIB_PATH in the worker's environment, never in this
    process), or None for llama-cpp-python's own; ``source`` says who chose it."""

    path: str | None
    source: str  # "--llama-lib", "SLOTFILE_LLAMA_LIB", "llama-server on PATH", "LLAMA_CPP_LIB_PATH", "installed"


def library_dir(path: str | os.PathLike[str], what: str = "--llama-lib") -> str:
    """``path`` checked as a llama.cpp library folder (or libllama.so itself): the absolute
    folder.  Raises LoaderError with a one-line reason."""
    p = Path(path).expanduser()
    if p.is_file() and p.name.startswith(LIB_NAME):
        p = p.parent
    if not p.exists():
        raise LoaderError(f"{what} {path}: no such folder")
    if not p.is_dir():
        raise LoaderError(f"{what} {path}: not a folder (give the folder that holds {LIB_NAME})")
    if not (p / LIB_NAME).is_file():
        raise LoaderError(
            f"{what} {path}: the folder holds no {LIB_NAME} (a llama.cpp build puts it and its "
            "libggml*.so in BUILD/bin)"
        )
    return str(p.resolve())


def resolve_library(llama_lib: str | os.PathLike[str] | None = None) -> Library:
    """``llama_lib`` (the --llama-lib option), else $SLOTFILE_LLAMA_LIB, else the library
    llama-cpp-python finds itself (its own, or $LLAMA_CPP_LIB_PATH).  Raises LoaderError."""
    if llama_lib is not None and str(llama_lib) != "":
        return Library(library_dir(llama_lib), "--llama-lib")
    env = os.environ.get(LIB_ENV)
    if env:
        return Library(library_dir(env, LIB_ENV), LIB_ENV)
    if os.environ.get("LLAMA_CPP_LIB_PATH"):
        return Library(None, "LLAMA_CPP_LIB_PATH")
    return Library(None, "installed")


def server_library() -> tuple[str | None, str]:
    """The llama.cpp library of the ``llama-server`` on PATH (the llama.cpp the user runs):
    ``libllama.so`` in its folder or in ``../lib``, also behind a symlinked llama-server.
    Returns (folder or None, what was looked at, for messages)."""
    exe = shutil.which("llama-server")
    if exe is None:
        return None, "no llama-server on PATH"
    dirs: list[Path] = []
    for e in (Path(exe), Path(os.path.realpath(exe))):
        for d in (e.parent, e.parent.parent / "lib"):
            if d not in dirs:
                dirs.append(d)
    for d in dirs:
        if (d / LIB_NAME).is_file():
            return str(d.resolve()), f"the library beside {exe} ({d.resolve()})"
    return None, f"no {LIB_NAME} beside {exe} (looked in {', '.join(str(d) for d in dirs)})"


def library_label(info: dict[str, Any]) -> str:
    """How messages name a loader: ``llama-cpp-python 0.3.36 with /x/libllama.so``."""
    return f"llama-cpp-python {info.get('llama_cpp_python')} with {info.get('library') or '?'}"
