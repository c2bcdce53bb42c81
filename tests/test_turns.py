"""Where a chat's replies lie in a slot file's tokens (slotfile.verify.turns) and the schedules
that replay them (slotfile.verify.shape.turn_schedules)."""

from __future__ import annotations

from slotfile.llama.worker.pieces import stepwise_ranges
from slotfile.verify.shape import (
    MAX_STEPWISE,
    Schedule,
    candidate_schedules,
    reply_schedules,
    starts_in_a_reply,
    turn_schedules,
)
from slotfile.verify.turns import reply_spans


def _pieces(*parts: str) -> list[str]:
    """Text as one piece per word (and per marker character run), like a tokenizer's pieces."""
    out: list[str] = []
    for p in parts:
        out.extend(x for x in p.replace("\n", " \n ").split(" ") if x)
    return out


def test_chatml_turns_give_each_reply_and_the_last_runs_to_the_end():
    t = ["<bos>", "<|im_start|>user\n", "Hi", "<|im_end|>\n", "<|im_start|>assistant\n"]
    r1 = ["Hello", "there", "."]
    t2 = ["<|im_end|>\n", "<|im_start|>user\n", "More", "<|im_end|>\n", "<|im_start|>assistant\n"]
    r2 = ["Sure", "thing"]
    pieces = t + r1 + t2 + r2
    a1 = len(t)
    a2 = a1 + len(r1) + len(t2)
    assert reply_spans(pieces) == [(a1, a1 + len(r1)), (a2, len(pieces))]


def test_template_text_split_over_many_tokens_and_markers_inside_the_last_reply():
    # chatml on a vocabulary without <|im_start|> (Gemma 3 with llama-server's fallback): the
    # markers are text split over several tokens; a small model repeats them in its reply
    head = ["<bos>", "<", "|", "im", "_", "start", "|>", "user", "\n", "Q", "?", "<", "|", "im", "_", "end", "|>", "\n"]
    opener = ["<", "|", "im", "_", "start", "|>", "assistant", "\n"]
    reply = ["I", " am", "<", "|", "im", "_", "end", "|>", "\n", "<", "|", "im", "_", "start", "|>", "user", "\n", "x"]
    pieces = head + opener + reply
    spans = reply_spans(pieces)
    assert spans[0][0] == len(head) + len(opener)
    # the repeated user opener splits the reply as text; the schedules still run the last reply
    # (here the one before the repeated opener) to the end of the file
    (s,) = [x for x in turn_schedules(Schedule(2048, 512), len(pieces), spans, False) if len(x.stepwise) == 1]
    assert s.stepwise == ((len(head) + len(opener), len(pieces)),)


def test_other_template_families():
    gemma = ["<bos>", "<start_of_turn>", "user\n", "Hi", "<end_of_turn>\n", "<start_of_turn>", "model\n", "Yo", "!"]
    assert reply_spans(gemma) == [(7, 9)]
    llama3 = ["<|start_header_id|>", "user", "<|end_header_id|>", "\n\n", "Hi", "<|eot_id|>"]
    llama3 += ["<|start_header_id|>", "assistant", "<|end_header_id|>", "\n\n", "Hey"]
    assert reply_spans(llama3) == [(10, 11)]
    # a prompt without any template (a raw completion): no replies to replay
    assert reply_spans(["Once", " upon", " a", " time"]) == []
    assert reply_spans([]) == []


def test_turn_schedules_break_each_prompt_where_the_server_took_checkpoints():
    first = Schedule(2048, 512)
    # two replies of a 2,440-token file (the server's prompts: 2,007 and 2,241 tokens, the
    # second reusing the first reply): breaks n_prompt - 4 - 512 and n_prompt - 4 of each prompt,
    # the second prompt's first break before the first reply's end left out
    c = turn_schedules(first, 2440, [(2007, 2206), (2241, 2430)], True)
    assert c == [
        Schedule(2048, 512, (2237,), ((2241, 2440),)),
        Schedule(2048, 512, (1491, 2003, 2237), ((2007, 2206), (2241, 2440))),
    ]
    assert "one token per call at positions 2007-2205, 2241-2439" in c[1].label()
    # no checkpoints: no breaks; one reply: one schedule
    assert turn_schedules(first, 713, [(514, 679)], False) == [Schedule(2048, 512, (), ((514, 713),))]
    assert turn_schedules(first, 713, [], True) == []
    # at most MAX_STEPWISE tokens one per call
    assert turn_schedules(first, MAX_STEPWISE + 600, [(500, 510)], False) == []
    # the text's replies are tried first, before the replays found from the first difference
    spans = [(2007, 2206), (2241, 2430)]
    c = candidate_schedules(first, 2440, 2300, True, 1491, spans)
    assert c[:2] == turn_schedules(first, 2440, spans, True)
    # whatever the onset: a difference before the replies may have another cause (a --swa-full
    # server's long document: exact up to 1,027, its replies from 2,007 on)
    assert candidate_schedules(first, 2440, 1078, True, 1027, spans)[:2] == turn_schedules(first, 2440, spans, True)
    # another build's drift from the first tokens: every replay stays a candidate
    assert candidate_schedules(first, 2440, 3, True, 3, spans)[:2] == turn_schedules(first, 2440, spans, True)


def test_no_reply_is_replayed_from_inside_a_users_turn():
    """A 4-slot server's 2,092-token slot (a document, a question, two 3-4 token replies) parts from the
    first recompute at 513, where Gemma 3's window of 512 first leaves a cell out: the replays found from there
    (:func:`reply_schedules`: 1,063 and 1,579 tokens one per call, most of deep's 57 seconds) start
    inside the document, which the server prefilled; the text's replies stay."""
    first = Schedule(2048, 512)
    spans = [(2050, 2054), (2089, 2092)]
    found = reply_schedules(first, 2092, 575, True, 513)
    assert [s.stepwise[0][0] for s in found] == [1029, 513]
    c = candidate_schedules(first, 2092, 575, True, 513, spans)
    assert c[:2] == turn_schedules(first, 2092, spans, True)
    assert all(s not in c for s in found) and not any(starts_in_a_reply(s, 2092, spans) for s in found)
    # the text shows no replies (a raw /completion prompt): the found replays stay
    assert all(s in candidate_schedules(first, 2092, 575, True, 513) for s in found)
    # a difference a few tokens before a reply the text shows, or inside the last one (which runs to the
    # end of the file), may be that reply's
    assert starts_in_a_reply(Schedule(2048, 512, (), ((2045, 2092),)), 2092, spans)
    assert starts_in_a_reply(Schedule(2048, 512, (), ((2091, 2092),)), 2092, [(2050, 2054), (2089, 2090)])
    assert not starts_in_a_reply(Schedule(2048, 512, (), ((2060, 2092),)), 2092, spans)


def test_worker_stepwise_ranges_are_clipped_merged_and_ordered():
    assert stepwise_ranges([[50, 60], [10, 20], [15, 30], [90, 200], [5, 5], [-3, 2]], 100) == [
        (0, 2),
        (10, 30),
        (50, 60),
        (90, 100),
    ]
    assert stepwise_ranges(None, 10) == [] and stepwise_ranges([[20, 30]], 10) == []
