"""A GGUF file's metadata is read with types: every key specjax reads, stored with a GGUF
type the key does not take, is refused with one line naming the file, the key, the value
and its stored type (never coerced: the string "false" is not false, a float32 300.7 is
not token 300), as llama.cpp's loader refuses a key of the wrong type. The table below is
checked to cover every key the reader asks for (recorded while it reads the committed
fixtures). Also the values of the right type that the model or tokenizer cannot use
(token ids outside the vocabulary, arrays of another length than the vocabulary, merges
of tokens the vocabulary lacks, head counts that do not divide the width, a layer count
the tensor table does not hold).

The edited files are the committed fixtures written again by the gguf package's writer
with one key replaced (tests/helpers/gguf_edit.py)."""
from __future__ import annotations

import math

import pytest

from specjax.config import UsageError
from specjax.weights import gguf, gguf_meta
from clitools import python_limited
from gguf_edit import V, fixture, rewrite

NAN, INF = math.nan, math.inf
A = V.ARRAY


def read_everything(path) -> None:
    """What `sample --gguf_target=FILE` reads before any device work."""
    info = gguf.read_config(path)
    gguf.tokenizer(path)
    gguf.check_weights(path, info.model)


# (fixture, key as the reader names it, [(wrong value, GGUF type[, item type])]).
WRONG = [
    ("bpe_F32", "general.architecture", [(5, V.UINT32), (["llama"], A, V.STRING)]),
    ("bpe_F32", "{arch}.block_count", [(2.0, V.FLOAT32), ("2", V.STRING), (True, V.BOOL), ([2, 2], A, V.UINT32)]),
    ("bpe_F32", "{arch}.embedding_length", [(32.0, V.FLOAT32), ("32", V.STRING)]),
    ("bpe_F32", "{arch}.feed_forward_length", [(64.5, V.FLOAT32), ([64, 32], A, V.UINT32),
                                               ([64.0, 64.0], A, V.FLOAT32)]),
    ("bpe_F32", "{arch}.attention.head_count", [(4.0, V.FLOAT32), (True, V.BOOL), ([4, 2], A, V.UINT32)]),
    ("bpe_F32", "{arch}.attention.head_count_kv", [("2", V.STRING), (2.0, V.FLOAT64)]),
    ("llama_tp_F32", "{arch}.attention.key_length", [(8.0, V.FLOAT32), ("8", V.STRING)]),
    ("llama_tp_F32", "{arch}.attention.value_length", [(8.0, V.FLOAT32), (False, V.BOOL)]),
    ("bpe_F32", "{arch}.rope.dimension_count", [(8.0, V.FLOAT32), ("8", V.STRING)]),
    ("bpe_F32", "{arch}.vocab_size", [(304.0, V.FLOAT32), ("304", V.STRING)]),
    ("bpe_F32", "{arch}.expert_count", [(2.0, V.FLOAT32), ("2", V.STRING)]),
    ("bpe_F32", "{arch}.context_length", [(128.5, V.FLOAT32), ("128", V.STRING)]),
    ("bpe_F32", "{arch}.rope.freq_base", [("10000", V.STRING), (True, V.BOOL), (INF, V.FLOAT32), (NAN, V.FLOAT32)]),
    ("bpe_F32", "{arch}.attention.layer_norm_rms_epsilon", [("1e-5", V.STRING), (NAN, V.FLOAT32)]),
    ("bpe_F32", "{arch}.rope.scaling.type", [(0, V.UINT32), (["linear"], A, V.STRING)]),
    ("bpe_F32", "{arch}.rope.scaling.factor", [("1", V.STRING), (True, V.BOOL)]),
    ("bpe_F32", "{arch}.attention.sliding_window", [(8.0, V.FLOAT32), ("8", V.STRING), (True, V.BOOL)]),
    ("llama_tp_F32", "{arch}.rope.scaling.original_context_length", [(64.5, V.FLOAT32), ("64", V.STRING)]),
    ("bpe_F32", "tokenizer.ggml.model", [(2, V.UINT32), (["gpt2"], A, V.STRING)]),
    ("bpe_F32", "tokenizer.ggml.tokens", [("abc", V.STRING), (list(range(304)), A, V.UINT32)]),
    ("bpe_F32", "tokenizer.ggml.token_type", [(["1"] * 304, A, V.STRING), (1, V.INT32), ([1.0] * 304, A, V.FLOAT32)]),
    ("bpe_F32", "tokenizer.ggml.merges", [(list(range(45)), A, V.UINT32), ("\u0120 t", V.STRING)]),
    ("bpe_F32", "tokenizer.ggml.pre", [(5, V.UINT32), (["llama-bpe"], A, V.STRING)]),
    ("bpe_F32", "tokenizer.ggml.add_bos_token", [("false", V.STRING), (0, V.UINT8), (1, V.INT32)]),
    ("spm_F32", "tokenizer.ggml.add_eos_token", [("true", V.STRING), (1, V.UINT32)]),
    ("spm_F32", "tokenizer.ggml.scores", [(["0.0"] * 384, A, V.STRING), (0.5, V.FLOAT32), ([NAN] * 384, A, V.FLOAT32)]),
    ("bpe_F32", "tokenizer.ggml.bos_token_id", [(300.7, V.FLOAT32), ("301", V.STRING), ([301], A, V.UINT32),
                                                (True, V.BOOL)]),
    ("bpe_F32", "tokenizer.ggml.eos_token_id", [(302.9, V.FLOAT32), ([302], A, V.UINT32), ("302", V.STRING)]),
    ("bpe_F32", "tokenizer.ggml.padding_token_id", [(302.0, V.FLOAT64), ("302", V.STRING)]),
    ("spm_F32", "tokenizer.ggml.unknown_token_id", [(0.0, V.FLOAT32), ("0", V.STRING)]),
    ("bpe_F32", "tokenizer.ggml.eot_token_id", [(302.0, V.FLOAT32), ([302], A, V.UINT32)]),
    ("bpe_F32", "tokenizer.chat_template", [(5, V.UINT32), (["x"], A, V.STRING)]),
]
# Edits that make a key be read at all.
EXTRA = {"{arch}.rope.scaling.factor": {"llama.rope.scaling.type": ("linear", V.STRING)}}
CASES = [(name, key, wrong) for name, key, values in WRONG for wrong in values]


def _id(key, wrong):
    shown = wrong[0] if not isinstance(wrong[0], list) else f"[{len(wrong[0])} items]"
    return f"{key}={shown}:{gguf_meta.type_words([int(t) for t in wrong[1:]])}"


@pytest.mark.parametrize("name,key,wrong", CASES, ids=[_id(k, w) for _, k, w in CASES])
def test_a_wrong_type_of_value_is_refused_naming_file_key_value_and_type(tmp_path, name, key, wrong):
    resolved = key.replace("{arch}", "llama")
    path = rewrite(fixture(name), tmp_path / "edited.gguf", fields={**EXTRA.get(key, {}), resolved: wrong})
    with pytest.raises(UsageError) as err:
        read_everything(path)
    message = str(err.value)
    assert "\n" not in message
    stored = gguf_meta.type_words([int(t) for t in wrong[1:]])
    assert message.startswith(f"{path}: metadata {resolved}=") and f" ({stored}): must be " in message, message


def test_the_table_covers_every_key_the_reader_reads(tmp_path, monkeypatch):
    """Every key `Metadata.get` is asked for while the fixtures (and the edits that reach
    the other branches) are read has a row in WRONG."""
    asked = set()
    real_get = gguf_meta.Metadata.get

    def recording_get(self, key, kind, *default):
        asked.add(key)
        return real_get(self, key, kind, *default)

    monkeypatch.setattr(gguf_meta.Metadata, "get", recording_get)
    for name in ("bpe_F32", "bpe_Q4_1", "spm_F32", "llama_tp_Q8_0", "kquant"):
        read_everything(fixture(name))
    read_everything(rewrite(fixture("bpe_F32"), tmp_path / "linear.gguf",
                            fields={**EXTRA["{arch}.rope.scaling.factor"]}))
    covered = {key for _, key, _ in WRONG}
    assert asked - covered == set()
    assert len(asked) >= 30


# (fixture, key, value of the right type, a fragment of the one line)
UNUSABLE = [
    ("bpe_F32", "tokenizer.ggml.bos_token_id", (304, V.UINT32), "must be a token id in 0..303"),
    ("bpe_F32", "tokenizer.ggml.eos_token_id", (100000, V.UINT32), "must be a token id in 0..303"),
    ("bpe_F32", "tokenizer.ggml.padding_token_id", (-1, V.INT32), "must be a token id in 0..303"),
    ("bpe_F32", "tokenizer.ggml.token_type", ([1] * 10, A, V.INT32), "must hold one value per token (304), not 10"),
    ("spm_F32", "tokenizer.ggml.scores", ([0.0] * 5, A, V.FLOAT32), "must hold one value per token (384), not 5"),
    ("bpe_F32", "tokenizer.ggml.merges", (["zzzq qqqz"], A, V.STRING),
     "tokenizer.ggml.merges[0]='zzzq qqqz': names 'zzzq', which tokenizer.ggml.tokens does not hold"),
    ("bpe_F32", "tokenizer.ggml.merges", (["\u0120t"], A, V.STRING), "must be two tokens joined by one space"),
    ("spm_F32", "tokenizer.ggml.merges", (["\u2581 zzzq"], A, V.STRING), "names 'zzzq'"),
    ("bpe_F32", "llama.attention.head_count", (0, V.UINT32),
     "llama.attention.head_count=0 (uint32): must be at least 1"),
    ("bpe_F32", "llama.attention.head_count", (3, V.UINT32),
     "llama.attention.head_count=3 (uint32): must divide embedding_length=32"),
    ("bpe_F32", "llama.attention.head_count_kv", (0, V.UINT32), "head_count_kv=0 (uint32): must be at least 1"),
    ("bpe_F32", "llama.block_count", (1, V.UINT32), "llama.block_count=1 (uint32): the tensor table holds 2 blocks"),
    ("bpe_F32", "llama.block_count", (-1, V.INT32), "llama.block_count=-1 (int32): the tensor table holds 2 blocks"),
]


@pytest.mark.parametrize("name,key,value,fragment", UNUSABLE,
                         ids=[f"{k}={v[0] if not isinstance(v[0], list) else '[..]'}" for _, k, v, _ in UNUSABLE])
def test_a_value_the_model_cannot_use_is_one_line(tmp_path, name, key, value, fragment):
    path = rewrite(fixture(name), tmp_path / "edited.gguf", fields={key: value})
    with pytest.raises(UsageError) as err:
        read_everything(path)
    assert fragment in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert str(err.value).startswith(f"{path}: ")


def test_a_per_layer_array_with_one_value_is_that_value(tmp_path):
    """llama.cpp reads head counts and the feed-forward width as one value or one per
    layer; an array whose values agree is the same model."""
    per_layer = {f"llama.{k}": ([v, v], A, V.UINT32) for k, v in
                 (("attention.head_count", 4), ("attention.head_count_kv", 2), ("feed_forward_length", 64))}
    path = rewrite(fixture("bpe_F32"), tmp_path / "per_layer.gguf", fields=per_layer)
    assert gguf.read_config(path).model == gguf.read_config(fixture("bpe_F32")).model


def test_integers_of_any_width_and_integer_numbers_are_read(tmp_path):
    """Writers differ in integer widths (uint32, int32, uint64); a float key stored as an
    integer is that number."""
    widths = {"llama.block_count": (2, V.UINT64), "llama.embedding_length": (32, V.INT32),
              "tokenizer.ggml.bos_token_id": (301, V.INT64), "llama.rope.freq_base": (10000, V.UINT32)}
    path = rewrite(fixture("bpe_F32"), tmp_path / "widths.gguf", fields=widths)
    a, b = gguf.read_config(path), gguf.read_config(fixture("bpe_F32"))
    assert (a.model, a.bos_id, a.eos_ids) == (b.model, b.bos_id, b.eos_ids)


def test_a_huge_block_count_is_refused_before_anything_counts_layers(tmp_path):
    """llama.block_count=1e9 once made 9e9 tensor names (a MemoryError after 26 s, or the
    OOM killer): read in a child whose address space is capped at 4 GiB."""
    path = rewrite(fixture("bpe_F32"), tmp_path / "huge.gguf", fields={"llama.block_count": (10**9, V.UINT32)})
    proc = python_limited("from specjax.config import UsageError\n"
                          "from specjax.weights import gguf\n"
                          "try:\n"
                          f"    gguf.check_weights({str(path)!r}, gguf.read_config({str(path)!r}).model)\n"
                          "except UsageError as e:\n"
                          "    print(e)\n")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "llama.block_count=1000000000 (uint32): the tensor table holds 2 blocks (blk.0 .. blk.1)" in proc.stdout
