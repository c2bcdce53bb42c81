"""Reading a llama-server command line: spellings, defaults and the arithmetic of the slot
context, as common/arg.cpp, tools/server/server.cpp and llama_context define them."""

from __future__ import annotations

import pytest

from slotfile.format.types import BY_NAME
from slotfile.slotdir.serverargs import NO_VALUE, ONE_VALUE, ServerArgsError, parse_server_args


def test_defaults_are_the_servers():
    s = parse_server_args("llama-server -m m.gguf")
    # -np auto: 4 slots with a unified cache (server.cpp); -fa auto; f16 caches; -c 0
    assert (s.n_parallel, s.parallel_auto, s.kv_unified, s.n_stream) == (4, True, True, 1)
    assert (s.flash_attn, s.fa_on, s.type_k, s.type_v, s.n_ctx, s.n_ubatch) == ("auto", True, "f16", "f16", 0, 512)
    assert s.model == "m.gguf"


def test_explicit_parallel_is_not_unified_unless_asked():
    s = parse_server_args("/opt/llama/bin/llama-server -m m.gguf -np 2")
    assert (s.n_parallel, s.kv_unified, s.n_stream) == (2, False, 2)
    assert parse_server_args("llama-server -np 2 -kvu").n_stream == 1
    assert parse_server_args("llama-server --parallel 3 --kv-unified").kv_unified
    # -np -1 is auto, and auto turns the unified cache on whatever -no-kvu says
    s = parse_server_args("llama-server -np -1 --no-kv-unified")
    assert (s.n_parallel, s.kv_unified) == (4, True) and s.notes


@pytest.mark.parametrize(
    ("word", "want"),
    [
        ("on", "on"),
        ("enabled", "on"),
        ("true", "on"),
        ("1", "on"),
        ("off", "off"),
        ("disabled", "off"),
        ("false", "off"),
        ("0", "off"),
        ("auto", "auto"),
        ("-1", "auto"),
    ],
)
def test_flash_attn_words(word, want):
    assert parse_server_args(f"llama-server -fa {word}").flash_attn == want
    assert parse_server_args(f"llama-server --flash-attn {word}").flash_attn == want


def test_cache_types_and_long_spellings():
    s = parse_server_args("llama-server --cache-type-k q8_0 -ctv q4_0 -fa on --ctx_size 8192 --ubatch-size 256")
    assert (s.type_k, s.type_v, s.n_ctx, s.n_ubatch) == ("q8_0", "q4_0", 8192, 256)
    assert s.load_settings(4096, 10).type_k == BY_NAME["q8_0"].id


def test_other_server_flags_are_ignored_with_their_values():
    s = parse_server_args(
        "llama-server --host 0.0.0.0 --port 8080 --jinja -t 8 -m m.gguf --metrics "
        "--control-vector-layer-range 1 5 --slot-save-path /var/slots -ngl 99"
    )
    assert s.model == "m.gguf" and s.slot_save_path == "/var/slots" and s.n_gpu_layers == 99
    assert "--port 8080" in s.ignored and "--control-vector-layer-range 1 5" in s.ignored and "--jinja" in s.ignored


def test_flag_table_came_from_arg_cpp():
    for flag in ("--host", "--port", "-t", "--mmproj", "-ot", "--spec-type", "--fit"):
        assert flag in ONE_VALUE
    for flag in ("--jinja", "--metrics", "-cb", "--no-webui", "--swa-full", "-kvu"):
        assert flag in NO_VALUE


@pytest.mark.parametrize(
    ("line", "names"),
    [
        ("llama-server --bogus 1", "'--bogus' is not a llama-server flag"),
        ("llama-server -m m.gguf stray", "'stray' is a stray value"),
        ("llama-server -c lots", "-c takes a whole number"),
        ("llama-server -fa maybe", "-fa takes on, off or auto"),
        ("llama-server -ctk q9_9", "-ctk 'q9_9' is not a KV cache type"),
        ("llama-server -ctk Q8_0", "not a KV cache type"),  # kv_cache_type_from_str compares exactly
        ("llama-server -np", "-np needs a value"),
        ("llama-server -np 0", "-np 0 is refused"),
        ("llama-server -np 300", "LLAMA_MAX_SEQ"),
        ('llama-server -m "unterminated', "cannot be split"),
    ],
)
def test_bad_lines_name_the_flag(line, names):
    with pytest.raises(ServerArgsError) as e:
        parse_server_args(line)
    msg = str(e.value)
    assert names in msg and "\n" not in msg


def test_unknown_flag_lists_what_is_understood():
    with pytest.raises(ServerArgsError, match=r"understood: -m, -c, -np, -kvu/-no-kvu.*-fa, -ctk, -ctv, --swa-full"):
        parse_server_args("llama-server --no-such-flag")


def test_slot_context_arithmetic():
    # non-unified: n_ctx padded to 256, split per slot and padded again (llama_context)
    s = parse_server_args("llama-server -c 1000 -np 3")
    assert s.pool_ctx(4096) == 1024 and s.n_ctx_seq(4096) == 512 and s.slot_ctx(4096) == 512
    # unified: every slot sees the whole pool; the slot context is capped by n_ctx_train
    s = parse_server_args("llama-server -c 8192 -np 4 -kvu")
    assert s.n_ctx_seq(4096) == 8192 and s.slot_ctx(4096) == 4096
    # -c 0: n_ctx_train; --kv-unified-per-slot without -c sizes the pool n_parallel * N and caps a slot
    s = parse_server_args("llama-server -np 2 -kvu --kv-unified-per-slot 300")
    assert s.pool_ctx(4096) == 768 and s.slot_ctx(4096) == 300


def test_load_settings_mirror_the_server():
    s = parse_server_args("llama-server -c 4096 -np 2 -fa off -ctk f32 -ctv f32")
    ls = s.load_settings(4096, 54)
    assert (ls.n_seq_max, ls.kv_unified, ls.flash_attn) == (2, False, False)
    assert ls.type_k == BY_NAME["f32"].id and ls.n_ctx == 2 * 256  # capped at what the file needs, per stream
    assert parse_server_args("llama-server -np 4 -kvu").load_settings(4096, 54).n_ctx == 256


def test_a_server_that_cannot_start_is_named():
    assert parse_server_args("llama-server -fa off -ctv q8_0").problems()
    assert not parse_server_args("llama-server -fa on -ctv q8_0").problems()
