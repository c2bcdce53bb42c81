"""Files people pass by mistake (a GGUF model, a compressed file, text), recognised by their
first bytes, so that the reader says what was passed and what to pass instead rather than
calling a model a damaged slot file."""

from __future__ import annotations

import shlex

# Files people pass by mistake, recognised by their first bytes: (magic, what it is, what to do).
FOREIGN_MAGICS: tuple[tuple[bytes, str, str], ...] = (
    (b"GGUF", "a GGUF model", "pass it with --model, and the slot file as the argument"),
    (b"\x1f\x8b", "a gzip-compressed file", "decompress it first (gunzip -k {file}) and pass the result"),
    (b"\x28\xb5\x2f\xfd", "a zstd-compressed file", "decompress it first (zstd -d {file}) and pass the result"),
    (b"\xfd7zXZ\x00", "an xz-compressed file", "decompress it first (xz -dk {file}) and pass the result"),
    (b"BZh", "a bzip2-compressed file", "decompress it first (bunzip2 -k {file}) and pass the result"),
    (b"PK\x03\x04", "a zip archive", "extract the slot file from it first (unzip {file})"),
    (b"\x7fELF", "an executable (ELF)", "pass the file llama-server wrote under --slot-save-path"),
)
TEXT_SAMPLE = 4096  # bytes looked at to call a file text


def recognise_foreign(head: bytes, size: int, path: str = "FILE") -> str | None:
    """A one-line description of a file that is clearly not a slot or session file (a GGUF
    model, a compressed file, text), with what to pass instead; None when it is not one of
    these (then a wrong magic means damage).  An empty file is not one of them: it is a slot
    file cut at 0 (a save that failed before writing), reported as truncated."""
    for magic, what, todo in FOREIGN_MAGICS:
        if head.startswith(magic):
            return f"this is {what}, not a slot file: {todo.format(file=shlex.quote(path))}"
    if _is_text(head):
        start = head[:40].decode("utf-8", "replace").split("\n")[0]
        return (
            f"this is a text file (it starts {start!r}), not a slot file: slot files are binary, "
            "written by llama-server's POST /slots/{id}?action=save"
        )
    return None


def _is_text(head: bytes) -> bool:
    """Mostly printable: no NUL, and at least 95 % printable ASCII, whitespace or UTF-8 text
    (a slot file starts with a binary magic and little-endian integers full of zero bytes)."""
    sample = head[:TEXT_SAMPLE]
    if not sample or b"\x00" in sample:
        return False
    text = sample.decode("utf-8", "replace")
    printable = sum(1 for ch in text if ch.isprintable() or ch in "\n\r\t")
    return printable >= 0.95 * len(text)
