"""Where a chat's replies lie in a slot file's tokens, read from the chat template's text.

llama-server decodes a reply one token per ``llama_decode`` call (``update_slots``, the
generation phase), and the next turn reuses those cells as its prompt's prefix
(``get_common_prefix``).  A prefill of the same tokens computes them otherwise, and the difference
is not always small: in a 713-token three-turn Gemma 3 270M chat (chatml fallback template, both
pinned trees) a prefill puts one cell of the last reply 45 degrees from the server's, which a
one-per-call replay of that reply reproduces bit for bit in the early layers
(:func:`slotfile.verify.shape.reply_schedules`).  The file does not record where replies are,
but the tokens do: a reply begins after the template's assistant opener and ends where the turn's
closer begins (the closer is the stop token or text the next prompt appends, prefilled).

The markers are the assistant openers and turn closers of the templates llama.cpp ships
(``src/llama-chat.cpp``, ``llm_chat_apply_template``), matched in the detokenized text, so a
template written out as plain text (chatml on a vocabulary without ``<|im_start|>``) is found too.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence

# per template family (llm_chat_apply_template): the text that opens a user turn, the text after
# which the model's reply starts, and the texts that close a turn (the stop token the reply
# sampled, or what the next prompt appends after it)
TEMPLATES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    # chatml (also llama-server's fallback for a GGUF without a template), qwen
    ("<|im_start|>user\n", "<|im_start|>assistant\n", ("<|im_end|>", "<|endoftext|>")),
    ("<start_of_turn>user\n", "<start_of_turn>model\n", ("<end_of_turn>",)),  # gemma
    (  # llama 3
        "<|start_header_id|>user<|end_header_id|>\n\n",
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        ("<|eot_id|>",),
    ),
    ("<|user|>\n", "<|assistant|>\n", ("<|end|>", "<|endoftext|>")),  # phi 3, zephyr
    ("<|start_of_role|>user<|end_of_role|>", "<|start_of_role|>assistant<|end_of_role|>", ("<|end_of_text|>",)),
    ("<｜User｜>", "<｜Assistant｜>", ("<｜end▁of▁sentence｜>",)),  # deepseek 2/3
    ("[INST]", "[/INST]", ("</s>",)),  # llama 2, mistral
    (  # command-r
        "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>",
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
        ("<|END_OF_TURN_TOKEN|>",),
    ),
)


def reply_spans(pieces: Sequence[str]) -> list[tuple[int, int]]:
    """Token ranges ``[a, b)`` of the replies in a token sequence given as its text pieces, by
    the turns of the first template family whose assistant opener the text holds.  A turn runs
    from one user opener to the next; its reply from the first assistant opener in it to the
    last turn closer before the next user opener (the closer the template appends); the last
    turn's reply runs to the end of the tokens (the server saves the slot after generating it).
    Markers inside a reply (a small model repeating the template's text) are text the next
    turn's split may misplace; the schedules built from these spans are candidates the
    recompute confirms or rejects, never facts."""
    starts: list[int] = []  # character offset where each token's text starts
    at = 0
    for p in pieces:
        starts.append(at)
        at += len(p)
    text = "".join(pieces)
    for user, assistant, closers in TEMPLATES:
        opens = _occurrences(text, assistant)
        if not opens:
            continue
        users = _occurrences(text, user)
        return _spans(text, starts, users, [o + len(assistant) for o in opens], closers)
    return []


def _spans(
    text: str, starts: list[int], users: list[int], replies: list[int], closers: tuple[str, ...]
) -> list[tuple[int, int]]:
    n = len(starts)

    def token_at(ch: int) -> int:
        return bisect.bisect_right(starts, ch) - 1

    turns = [*users, len(text)] if users and users[0] < replies[0] else [0, *users, len(text)]
    out: list[tuple[int, int]] = []
    for t0, t1 in itertools.pairwise(turns):
        k = bisect.bisect_left(replies, t0)
        if k == len(replies) or replies[k] >= t1:
            continue  # a turn without a reply
        ch = replies[k]
        a = token_at(ch) if ch < len(text) else n
        if a < n and starts[a] < ch:  # the opener's last character shares a token with the reply
            a += 1
        if t1 == len(text):  # the last turn: the file ends inside its reply (a closer in it is generated text)
            b = n
        else:
            b = token_at(max((i for c in closers for i in _occurrences(text, c, ch, t1)), default=t1))
        if a < b:
            out.append((a, b))
    return out


def _occurrences(text: str, marker: str, lo: int = 0, hi: int | None = None) -> list[int]:
    out, i = [], text.find(marker, lo, hi)
    while i >= 0:
        out.append(i)
        i = text.find(marker, i + 1, hi)
    return out


def model_reply_spans(model_path: str, tokens: Sequence[int]) -> list[tuple[int, int]]:
    """:func:`reply_spans` of ``tokens`` read with the GGUF's vocabulary (token by token, as
    llama.cpp renders them); none when the model's vocabulary cannot be read (the schedules
    that need them are then not tried)."""
    from slotfile.model.bridge import ModelError, load_model_info

    try:
        info = load_model_info(model_path)
    except ModelError:
        return []
    if not info.n_vocab:
        return []
    return reply_spans([info.detokenize([t]) for t in tokens])
