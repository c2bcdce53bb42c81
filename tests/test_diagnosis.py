"""The cause of a failure and the next step, from the problems' classes and sections."""

from __future__ import annotations

import pytest

from slotfile.diagnosis import Cause, Facts, file_cause, next_step
from slotfile.format.reader import parse_buffer, recognise_foreign
from slotfile.problems import CheckLevel, Problem, ProblemClass, ProblemCode, Severity, cause_of, codes

from .conftest import SLOTS

F = Facts("slots/cut.slot", "GGSQ", "m.gguf")


def e(level: str, code: str, section: str) -> Problem:
    return Problem(Severity.ERROR, ProblemCode(code), section, None, "", CheckLevel(level))


def test_classes_by_code_never_by_message():
    model_mismatch = set(codes(level=CheckLevel.MODEL, cls=ProblemClass.MISMATCH))
    assert model_mismatch == {"wrong-arch", "model-mismatch", "token-out-of-vocab", "position-beyond-context"}
    assert {cause_of(c, "error") for c in model_mismatch} == {Cause.MISMATCH}
    assert cause_of("version-mismatch", "error") == Cause.MISMATCH
    assert cause_of("not-slot-file", "error") == Cause.NOT_SLOT_FILE
    assert cause_of("truncated", "error") == Cause.DAMAGED
    assert cause_of("draft-not-checked", "warning") == Cause.CANNOT_CHECK
    assert cause_of("k-only", "warning") == Cause.NOTICE
    assert cause_of("unsupported-layout", "error") == Cause.UNSUPPORTED
    # a damaged code raised as a warning is a notice (invalid: cells of several seq ids)
    assert cause_of("invalid", "warning") == Cause.NOTICE
    assert cause_of(ProblemCode.INVALID, "error") == Cause.DAMAGED


def test_an_unregistered_code_is_refused_not_classed_damaged():
    with pytest.raises(ValueError):
        cause_of("no-such-code", "error")
    with pytest.raises(ValueError):
        e("load", "load-faild", "body")


def test_a_model_level_problem():
    p = e("model", "model-mismatch", "body")
    assert p.level == CheckLevel.MODEL and p.from_model and p.offset is None
    assert p.code is ProblemCode.MODEL_MISMATCH and p.cls == Cause.MISMATCH


def test_cause_order():
    assert file_cause([]) is None
    assert file_cause([Problem(Severity.WARNING, ProblemCode.K_ONLY, "body", None, "")]) is None
    # a model mismatch makes the test-load fail too: that is the mismatch, not damage
    assert file_cause([e("model", "model-mismatch", "body"), e("load", "load-failed", "body")]) == Cause.MISMATCH
    # damaged bytes win over a mismatch the damage may cause
    assert file_cause([e("structure", "truncated", "body"), e("model", "model-mismatch", "body")]) == Cause.DAMAGED
    assert file_cause([e("load", "load-failed", "body")]) == Cause.DAMAGED
    assert file_cause([e("structure", "not-slot-file", "header")]) == Cause.NOT_SLOT_FILE


@pytest.mark.parametrize(
    "problems, command",
    [
        (
            [e("structure", "truncated", "body")],
            "slotfile truncate-recover slots/cut.slot -o slots/cut.fixed.slot --model m.gguf",
        ),
        (
            [e("structure", "truncated", "sckp.checkpoint[1].data_tgt")],
            "slotfile truncate-recover slots/cut.slot -o slots/cut.fixed.slot --model m.gguf",
        ),
        (
            [e("structure", "trailing-bytes", "trailing")],
            "slotfile truncate-recover slots/cut.slot -o slots/cut.fixed.slot --model m.gguf",
        ),
        (
            [e("structure", "truncated", "sdft.data_dft")],
            "slotfile truncate-recover slots/cut.slot -o slots/cut.fixed.slot --model m.gguf",
        ),
        ([e("load", "draft-rejected", "sdft.data_dft")], "slotfile strip-draft slots/cut.slot -o slots/cut.fixed.slot"),
        (
            [e("load", "checkpoint-draft-rejected", "sckp.checkpoint[0].data_dft")],
            "slotfile strip-draft slots/cut.slot -o slots/cut.fixed.slot",
        ),
        (
            [e("load", "checkpoint-rejected", "sckp.checkpoint[0].data_tgt")],
            "slotfile truncate-recover slots/cut.slot -o slots/cut.fixed.slot --model m.gguf",
        ),
        ([e("structure", "bad-magic", "header")], None),
        ([e("structure", "truncated", "tokens")], None),
        ([e("deep", "deep-mismatch", "body.kv.stream[0]")], None),
    ],
)
def test_next_step_follows_the_section(problems, command):
    step = next_step(file_cause(problems), problems, F)
    assert step is not None and step.command == command, step
    if command is None:
        assert step.text.startswith("nothing")


def test_next_step_placeholders_and_v_layout():
    body = [e("structure", "truncated", "body.kv")]
    assert next_step(Cause.DAMAGED, body, Facts("a b.slot")).command == (
        "slotfile truncate-recover 'a b.slot' -o 'a b.fixed.slot' --model MODEL.gguf"
    )
    # without a model, a damaged appendix is dropped without a test-load
    assert next_step(Cause.DAMAGED, [e("structure", "truncated", "sckp")], Facts("x.slot")).command == (
        "slotfile truncate-recover x.slot -o x.fixed.slot"
    )
    assert next_step(Cause.DAMAGED, body, Facts("x.slot", media=True)).command is None
    assert next_step(Cause.DAMAGED, body, Facts("x.session", "GGSN")).command is None
    rejected = [e("load", "checkpoint-rejected", "sckp.checkpoint[0].data_tgt")]
    step = next_step(Cause.DAMAGED, rejected, Facts("x.slot", "GGSQ", "m.gguf", body_v_trans=0, v_trans_differs=True))
    assert step.command == "slotfile re-save x.slot -o x.fixed.slot --model m.gguf --flash-attn on"
    assert next_step(Cause.MISMATCH, [e("model", "model-mismatch", "body")], F).command is None
    assert next_step(None, [], F) is None


@pytest.mark.parametrize(
    "data, says",
    [
        (b"GGUF\x03\x00\x00\x00" + bytes(64), "this is a GGUF model, not a slot file: pass it with --model"),
        (
            b"\x1f\x8b\x08\x00" + bytes(64),
            "gzip-compressed file, not a slot file: decompress it first (gunzip -k x.slot)",
        ),
        (
            b"\x28\xb5\x2f\xfd" + bytes(64),
            "zstd-compressed file, not a slot file: decompress it first (zstd -d x.slot)",
        ),
        (b'{"id_slot": 0, "n_saved": 12}\n', 'this is a text file (it starts \'{"id_slot"'),
        (b"GGUF", "this is a GGUF model"),  # shorter than a header: still named
    ],
)
def test_wrong_inputs_are_named(data: bytes, says: str):
    sf = parse_buffer(data, "x.slot")
    (p,) = sf.problems
    assert (p.code, p.section, p.offset) == ("not-slot-file", "header", 0) and says in p.message, p.message
    assert file_cause(sf.problems) == Cause.NOT_SLOT_FILE


def test_an_empty_file_is_a_cut_slot_file():
    """A save that failed before writing: truncated at 0, nothing to recover (a wrong input it is not)."""
    sf = parse_buffer(b"", "e.slot")
    (p,) = sf.problems
    assert (p.code, p.offset) == ("truncated", 0) and p.message.startswith("empty file (0 bytes)")
    assert file_cause(sf.problems) == Cause.DAMAGED
    step = next_step(Cause.DAMAGED, sf.problems, Facts("e.slot", "unknown"))
    assert step is not None and step.command is None and step.text.startswith("nothing can be repaired")


def test_damage_is_not_mistaken_for_a_wrong_input():
    data = (SLOTS / "llama_f16_fa.slot").read_bytes()
    assert recognise_foreign(data[:4096], len(data)) is None
    garbage = bytes(range(256)) * 4  # binary, unknown magic: damage, not a wrong input
    (p,) = parse_buffer(garbage, "g.slot").problems
    assert p.code == "bad-magic"
    (p,) = parse_buffer(bytes(64), "z.slot").problems
    assert p.code == "bad-magic" and "all its first bytes are zero" in p.message
    assert not parse_buffer(data, "ok.slot").problems  # a slot file (with text in its tokens) stays one
