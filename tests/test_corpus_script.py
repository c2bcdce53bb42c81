"""bench/corpus.py's builders (issue 25, item 1): the server flags, the requests a chat client sends, the matrix.

No server is started here: these pin what the corpus script asks of llama-server, so a change to the matrix or the
requests is a visible test change. The corpus itself is written by ``bench/corpus.py --server-bin DIR``.
"""

from __future__ import annotations

from bench import corpus as C


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_server_args_base() -> None:
    cfg = C.Config("x", "gemma")
    args = C.server_args(cfg, "/m.gguf", 8123, "/slots")
    assert _flag(args, "-m") == "/m.gguf"
    assert _flag(args, "--port") == "8123"
    assert _flag(args, "--slot-save-path") == "/slots"
    assert _flag(args, "-fa") == "off"
    assert (_flag(args, "-ctk"), _flag(args, "-ctv")) == ("f16", "f16")
    assert _flag(args, "-np") == "1"
    assert (_flag(args, "-t"), _flag(args, "-tb")) == ("2", "2")
    # the server's own defaults are left alone unless a config sets them
    for absent in ("-b", "-ub", "--swa-full", "-kvu", "-no-kvu", "--cache-reuse"):
        assert absent not in args


def test_server_args_leave_repacking_off_on_an_amx_cpu(monkeypatch) -> None:
    """A native llama-server dies at its first prefill of Gemma 3 on a CPU with AMX unless weights are not repacked
    (slotfile/llama/cpu.py); elsewhere the server's default stays."""
    cfg = C.Config("x", "gemma")
    for amx in (True, False):
        monkeypatch.setattr(C, "has_amx", lambda amx=amx: amx)
        assert ("--no-repack" in C.server_args(cfg, "m", 1, "d")) is amx
    monkeypatch.setattr(C, "has_amx", lambda: True)
    assert C.server_args(cfg, "m", 1, "d", ["-nr"]).count("-nr") == 1
    assert "--no-repack" not in C.server_args(cfg, "m", 1, "d", ["-nr"])


def test_server_args_variants() -> None:
    cfg = C.Config(
        "x",
        "gemma",
        n_parallel=0,
        batch=256,
        ubatch=128,
        flash_attn="on",
        cache_k="q4_0",
        cache_v="q8_0",
        swa_full=True,
        kv_unified=False,
        threads=1,
        cache_reuse=64,
    )
    args = C.server_args(cfg, "m", 1, "d")
    assert "-np" not in args  # 0 = the server's auto (4 slots, unified KV)
    assert (_flag(args, "-b"), _flag(args, "-ub")) == ("256", "128")
    assert (_flag(args, "-fa"), _flag(args, "-ctk"), _flag(args, "-ctv")) == ("on", "q4_0", "q8_0")
    assert "--swa-full" in args and "-no-kvu" in args and "-kvu" not in args
    assert _flag(args, "-t") == "1" and _flag(args, "--cache-reuse") == "64"
    assert "-kvu" in C.server_args(C.Config("y", "gemma", n_parallel=4, kv_unified=True), "m", 1, "d")
    spec = C.server_args(C.Config("z", "gemma", speculative=8), "m.gguf", 1, "d")
    assert _flag(spec, "-md") == "m.gguf" and _flag(spec, "--spec-type") == "draft-simple"
    assert _flag(spec, "--spec-draft-n-max") == "8" and "-md" not in args


def test_document_is_deterministic_and_sized() -> None:
    a = C.document(7, 500)
    assert a == C.document(7, 500)
    assert a != C.document(8, 500)
    n = len(a.split())
    assert 500 <= n < 520
    assert "\n\n" in a  # paragraphs


def test_chat_requests() -> None:
    reqs = C.scenario_requests("multiturn", chat=True, n_predict=3)
    assert len(reqs) == 3
    for r in reqs:
        assert r["max_tokens"] == 3 and r["temperature"] == 0.0 and r["cache_prompt"] is True
        assert [m["role"] for m in r["messages"]] == ["user"]
    long = C.scenario_requests("long", chat=True, n_predict=4, doc_words=1800)
    first = long[0]["messages"][0]["content"]
    assert len(first.split()) > 1800  # the document, then the question
    assert first.endswith(C.SCENARIOS["long"]["turns"][0])


def test_raw_requests() -> None:
    reqs = C.scenario_requests("single", chat=False, n_predict=5)
    assert reqs == [
        {
            "temperature": 0.0,
            "seed": 42,
            "cache_prompt": True,
            "stream": False,
            "n_predict": 5,
            "prompt": C.SCENARIOS["single"]["turns"][0],
        }
    ]
    long = C.scenario_requests("long", chat=False, n_predict=4, doc_words=250)
    assert 25 <= len(long[0]["prompt"].split()) < 300


def test_next_request_carries_the_conversation() -> None:
    t1, t2, t3 = C.scenario_requests("multiturn", chat=True, n_predict=4)
    body = C.next_request(t3, [(t1, "reply one"), (t2, "reply two")])
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user", "assistant", "user"]
    assert body["messages"][1]["content"] == "reply one"
    assert body["messages"][3]["content"] == "reply two"
    assert body["messages"][-1] == t3["messages"][0]
    assert t3["messages"] == [t3["messages"][0]]  # the template is not modified
    # raw prompts: every later prompt starts with the earlier text, so the server can reuse its cached prefix
    r1, r2, _ = C.scenario_requests("multiturn", chat=False, n_predict=4)
    raw = C.next_request(r2, [(r1, " xyz")])
    assert raw["prompt"] == r1["prompt"] + " xyz\n" + r2["prompt"]
    assert C.next_request(r1, [])["prompt"] == r1["prompt"]


def test_matrix_covers_the_issue() -> None:
    cs = C.configs(4)
    names = [c.name for c in cs]
    assert len(names) == len(set(names))
    g = [c for c in cs if c.model == "gemma"]
    assert {c.flash_attn for c in g} == {"on", "off", "auto"}
    assert {c.cache_k for c in g} >= {"f16", "q8_0", "q4_0"} and {c.cache_v for c in g} >= {"f16", "q8_0", "q4_0"}
    assert {c.n_parallel for c in g} >= {1, 4, 0}
    assert {c.swa_full for c in g} == {True, False}
    assert len({(c.batch, c.ubatch) for c in g}) >= 3
    assert {s for c in g for s in c.scenarios} == set(C.SCENARIOS)
    # states the stored tokens cannot give: a reply past -c with --context-shift, a reused chunk shifted into place
    shift = [c for c in cs if c.context_shift]
    assert shift and all(
        {"overflow", "overflow-keep"} & set(c.scenarios) and (c.n_predict or 0) > c.ctx // max(1, c.n_parallel)
        for c in shift
    )
    assert any("overflow-keep" in c.scenarios for c in shift) and C.SCENARIOS["overflow-keep"]["request"]["n_keep"] > 0
    assert any(c.swa_full for c in shift if c.model == "gemma") and {c.model for c in shift} > {"gemma", "llama"}
    assert all(c.cache_reuse for c in cs if "trimmed" in c.scenarios)
    assert C.SCENARIOS["trimmed"]["drop_from_last"] == 0 and C.SCENARIOS["switch"]["conversation"] == [0, 1, 0]
    # a chat UI's regenerate and edit: on Gemma with replies longer than the 512-cell window (the server must go
    # back through a checkpoint), and on every fixture memory kind
    for sc in ("regenerate", "edit"):
        assert any(sc in c.scenarios and (c.n_predict or 0) > 512 for c in g)
        assert {c.model for c in cs if sc in c.scenarios} >= set(C.FIXTURES) | {"gemma"}

    # speculative decoding (replies decoded in drafted batches), one slot and several, separate and unified caches
    spec = [c for c in g if c.speculative]
    assert spec and {c.n_parallel for c in spec} >= {1, 4} and {bool(c.kv_unified) for c in spec} == {True, False}
    assert all((c.n_predict or 0) > c.speculative for c in spec)
    # long prompts under a small ubatch, with flash attention on and off (the split changes the stored values)
    assert {c.flash_attn for c in g if "long" in c.scenarios and c.ubatch is not None and c.ubatch < 512} == {
        "on",
        "off",
    }
    # every fixture model (every memory kind) is in the matrix, with long prompts and with several slots
    f = [c for c in cs if c.model != "gemma"]
    assert {c.model for c in f} == set(C.FIXTURES)
    for key in C.FIXTURES:
        mine = [c for c in f if c.model == key]
        assert any("long" in c.scenarios for c in mine)
        assert any(c.n_parallel == 4 for c in mine)
    # quantized V needs flash attention in llama.cpp (llama_init_from_model refuses it otherwise)
    assert all(c.flash_attn != "off" for c in cs if c.cache_v not in ("f16", "f32", "bf16"))
    # every slot must fit its share of the context (a non-unified cache splits -c between -np slots)
    for c in cs:
        if c.model == "gemma" and "long" in c.scenarios:
            assert c.ctx // max(c.n_parallel, 1) >= 1.5 * c.doc_words * 1.4


def test_slots_for() -> None:
    assert C.slots_for(C.Config("a", "gemma")) == [0]
    assert C.slots_for(C.Config("a", "gemma", n_parallel=4)) == [0, 1, 2, 3]
    assert C.slots_for(C.Config("a", "gemma", n_parallel=0)) == [0, 1, 2, 3]  # auto = 4 slots


def test_list_runs_without_a_server(capsys: object) -> None:
    assert C.main(["--list", "--only", "g-base"]) == 0


def test_verify_groups_and_row(tmp_path: object) -> None:
    import json
    from pathlib import Path

    d = Path(str(tmp_path))
    cfg = C.Config("g-ub128-b256-fa-on", "gemma", batch=256, ubatch=128, flash_attn="on")
    for name, model, version in (("a.bin", "/m/g.gguf", 4), ("b.bin", "/m/g.gguf", 4), ("c.bin", "/m/t.gguf", 3)):
        (d / name).write_bytes(b"x")
        meta = {
            "model_path": model,
            "state_version": version,
            "isa": "native",
            "model": "gemma",
            "config": C.dataclasses.asdict(cfg),
            "scenario": "long",
            "slot": 0,
            "requests": [{"timings": {"cache_n": 0}}, {"timings": {"cache_n": 2400}}],
        }
        (d / (name + ".json")).write_text(json.dumps(meta))
    groups = C.verify_groups(d)
    assert groups == {("/m/g.gguf", 4): [d / "a.bin", d / "b.bin"], ("/m/t.gguf", 3): [d / "c.bin"]}
    entry = {
        "path": str(d / "a.bin"),
        "n_tokens": 2500,
        "verdict": "fail",
        "first_problem": "deep: body at offset 9: layer 3 V",
        "seconds": 3.5,
        "levels": {
            "deep": {
                "status": "fail",
                "details": {
                    "margin": 51.6,
                    "worst": {"section": "body.kv-base", "part": "V", "layer": 5, "ratio": 51.6, "by": "lnorm"},
                    "logits": {"ratio": 0.3},
                },
            }
        },
    }
    row = C.verify_row(entry, json.loads((d / "a.bin.json").read_text()))
    assert row["file"] == "a.bin" and row["config"] == "g-ub128-b256-fa-on" and row["version"] == 4
    assert row["cache_n"] == [0, 2400]
    assert (row["verdict"], row["deep"], row["margin"], row["logits_ratio"]) == ("fail", "fail", 51.6, 0.3)
    assert row["worst"]["layer"] == 5 and row["worst"]["worst_pos"] is None
    # a file deep skipped (no details) still makes a row
    bare = C.verify_row(
        {"path": "/x/c.bin", "verdict": "pass", "levels": {}}, json.loads((d / "c.bin.json").read_text())
    )
    assert bare["margin"] is None and bare["worst"] is None


def test_regenerate_and_edit_send_what_a_chat_ui_sends() -> None:
    regen = C.scenario_requests("regenerate", True, 600)
    assert regen[0]["messages"] == regen[1]["messages"] and regen[1]["temperature"] == 1.0
    assert regen[0]["temperature"] == 0.0
    edit = C.scenario_requests("edit", True, 600, doc_words=50)
    assert all(r["ignore_eos"] for r in edit)
    # the last turn's history keeps the first exchange and drops the second: the edited message takes its place
    past = [(edit[0], "R0"), (edit[1], "R1")]
    drop = C.SCENARIOS["edit"]["drop_from_last"]
    body = C.next_request(edit[2], [h for j, h in enumerate(past) if j != drop])
    assert [m["content"] for m in body["messages"]][1:] == ["R0", "Which section mentions a bridge?"]
    keep = C.scenario_requests("overflow-keep", False, 700)
    assert keep[0]["n_keep"] == 40 and keep[0]["ignore_eos"]


def test_slot_calls_reads_each_slots_prompt_calls_from_the_log() -> None:
    """bench/slot_calls.py: the positions each slot's prompt calls start at, from the lines a v3 server logs at
    ``-lv 4`` (``update_slots``), and the sidecar's server flags with another port and slot-save path."""
    from pathlib import Path

    from bench import slot_calls as S

    log = (
        "0.01.535.659 I slot   operator(): id  1 | task 1 | cached n_tokens = 0, memory_seq_rm [0, end)\n"
        "0.01.569.060 I slot   operator(): id  0 | task 3 | cached n_tokens = 0, memory_seq_rm [0, end)\n"
        "0.01.569.112 I slot   operator(): id  1 | task 1 | cached n_tokens = 1, memory_seq_rm [1, end)\n"
        "0.05.816.542 I slot create_check: id  0 | task 3 | created context checkpoint 2 of 32 (n_tokens = 1498)\n"
        "0.05.816.585 I slot   operator(): id  1 | task 1 | cached n_tokens = 552, memory_seq_rm [552, end)\n"
    )
    assert S.calls_per_slot(log) == {1: [0, 1, 552], 0: [0]}
    side = {"server_argv": ["/bin/llama-server", "-m", "m.gguf", "--port", "1", "--slot-save-path", "/a", "-np", "4"]}
    binary, args = S.server_argv(side, Path("/out"), 8124, ["-t", "1"])
    assert binary == Path("/bin/llama-server")
    assert args == ["-m", "m.gguf", "--port", "8124", "--slot-save-path", "/out", "-np", "4", "-lv", "4", "-t", "1"]
