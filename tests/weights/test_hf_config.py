"""The JSON files of a Hugging Face directory are read with types: every key specjax
reads from config.json, generation_config.json, tokenizer_config.json and
model.safetensors.index.json, given a value of the wrong kind, is refused with one line
that names the file, the key and the value (never coerced: a string "false" is not
false, 40.9 is not 40), and so are damaged files. The table below is checked to cover
every key the reader asks for (recorded while it reads the committed fixtures, which
transformers wrote). Also: which keys each architecture reads, as transformers 5's
LlamaConfig / MistralConfig read them (Mistral's sliding window, its defaults)."""
from __future__ import annotations

import json
import pathlib
import shutil

import pytest

from specjax.config import UsageError
from specjax.weights import hf, hf_files
from clitools import python_limited
from gguf_edit import named_pipe

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "hf"
DELETE = object()  # an edit that removes the key (or, for a whole file, the file)


def edited(tmp_path, fixture: str, edits: dict) -> pathlib.Path:
    """A copy of a committed fixture with `edits`: {file: {dotted.key: value | DELETE}},
    {file: bytes} (the file's new contents) or {file: DELETE}."""
    d = tmp_path / fixture
    shutil.copytree(FIXTURES / fixture, d)
    for name, edit in edits.items():
        path = d / name
        if edit is DELETE:
            path.unlink()
        elif isinstance(edit, bytes):
            path.write_bytes(edit)
        else:
            data = json.loads(path.read_text())
            for dotted, value in edit.items():
                *outer, key = dotted.split(".")
                node = data
                for part in outer:
                    node = node[part]
                if value is DELETE:
                    node.pop(key, None)
                else:
                    node[key] = value
            path.write_text(json.dumps(data))  # NaN stays NaN: what a Python writer would leave
    return d


def read_everything(directory) -> None:
    """What `sample --hf_target=DIR` reads before any device work."""
    info = hf.read_config(directory)
    hf.tokenizer(directory)
    hf.check_weights(directory, info.model)


SP_ONLY = {"tokenizer.json": DELETE}  # llama_mha_tied read through its tokenizer.model
OTHER_LAYOUT = {"config.json": json.loads((FIXTURES / "llama3_scaled" / "config_other_layout.json").read_text())}
NAN = float("nan")

# (fixture, file, key as the message names it, wrong values); extra edits in EXTRA.
WRONG = [
    ("llama_gqa", "config.json", "architectures", ["LlamaForCausalLM", [5], {"a": 1}]),
    ("llama_gqa", "config.json", "model_type", [5, ["llama"]]),
    ("llama_gqa", "config.json", "vocab_size", ["64", 304.0, True, None, 304.5]),
    ("llama_gqa", "config.json", "hidden_size", [32.5, "32"]),
    ("llama_gqa", "config.json", "intermediate_size", ["48", False]),
    ("llama_gqa", "config.json", "num_hidden_layers", [True, 2.0]),
    ("llama_gqa", "config.json", "num_attention_heads", [None, [4]]),
    ("llama_gqa", "config.json", "num_key_value_heads", ["2", 2.0, False]),
    ("llama_gqa", "config.json", "head_dim", [8.0, "8", True]),
    ("llama_gqa", "config.json", "hidden_act", [None, ["silu"], 1]),
    ("llama_gqa", "config.json", "attention_bias", ["false", 0, None]),
    ("llama_gqa", "config.json", "mlp_bias", ["false", 1, None]),
    ("llama_gqa", "config.json", "max_position_embeddings", [40.9, "abc", True, None]),
    ("mistral", "config.json", "sliding_window", ["abc", 4096.5, True]),
    ("llama_gqa", "config.json", "rms_norm_eps", ["x", None, True, NAN]),
    ("llama_gqa", "config.json", "tie_word_embeddings", ["false", 0, None]),
    ("llama_gqa", "config.json", "dtype", [32, ["float32"]]),
    ("llama_gqa", "config.json", "torch_dtype", [32]),
    ("llama_gqa", "config.json", "rope_parameters", [[1e4], "default"]),
    ("llama_gqa", "config.json", "rope_scaling", ["linear", [8.0]]),
    ("llama_gqa", "config.json", "rope_theta", ["abc", None, True]),
    ("llama_gqa", "config.json", "partial_rotary_factor", ["0.5", None]),
    ("llama_gqa", "config.json", "rope_parameters.rope_type", [5, None]),
    ("llama_gqa", "config.json", "rope_parameters.type", [5, None]),
    ("llama_gqa", "config.json", "rope_parameters.rope_theta", ["abc", None]),
    ("llama_gqa", "config.json", "rope_parameters.partial_rotary_factor", ["1", None]),
    ("llama3_scaled", "config.json", "rope_parameters.factor", [None, "8"]),
    ("llama3_scaled", "config.json", "rope_parameters.low_freq_factor", [None, True]),
    ("llama3_scaled", "config.json", "rope_parameters.high_freq_factor", ["4", [4]]),
    ("llama3_scaled", "config.json", "rope_parameters.original_max_position_embeddings", [64.7, "64", None]),
    ("llama3_scaled", "config.json", "original_max_position_embeddings", [64.7, None]),
    ("llama3_scaled", "config.json", "rope_scaling.factor", [None]),  # the other layout
    ("llama_gqa", "config.json", "eos_token_id", ["a", 1.0, True, [302, None], 400]),  # without generation_config.json
    ("llama_gqa", "config.json", "bos_token_id", ["a", 1.0, True, [301]]),
    ("llama_gqa", "generation_config.json", "eos_token_id", [["a"], [1, None], 1.0, True, "2", [302, 304], -1]),
    ("llama_gqa", "generation_config.json", "bos_token_id", ["1", True, 1.0, [301]]),
    ("llama_gqa", "generation_config.json", "pad_token_id", ["0", True, 1.0, [0], -2.0]),
    ("llama_gqa", "tokenizer_config.json", "bos_token", [5, ["<s>"]]),
    ("llama_gqa", "tokenizer_config.json", "eos_token", [5, True]),
    ("llama_gqa", "tokenizer_config.json", "bos_token.content", [5, None]),
    ("llama_gqa", "tokenizer_config.json", "pad_token", [0, ["<pad>"], True]),
    ("llama_gqa", "tokenizer_config.json", "chat_template", [5, True, {"default": "x"}, ["x"]]),
    ("llama_mha_tied", "tokenizer_config.json", "add_bos_token", ["true", 1]),
    ("llama_mha_tied", "tokenizer_config.json", "add_eos_token", ["false", 0]),
    ("llama3_scaled", "model.safetensors.index.json", "weight_map", [["model-00001-of-00004.safetensors"], "x"]),
    ("llama3_scaled", "model.safetensors.index.json", "weight_map.lm_head.weight",
     [5, None, ["model-00004-of-00004.safetensors"], "../llama3_scaled/model-00004-of-00004.safetensors"]),
]
# Edits that make the key be read at all.
EXTRA = {
    "torch_dtype": {"config.json": {"dtype": DELETE}},
    "rope_scaling": {"config.json": {"rope_parameters": DELETE}},
    "rope_theta": {"config.json": {"rope_parameters": DELETE}},
    "partial_rotary_factor": {"config.json": {"rope_parameters": DELETE}},
    "rope_parameters.type": {"config.json": {"rope_parameters.rope_type": DELETE}},
    "eos_token_id@config.json": {"generation_config.json": DELETE},
    "bos_token_id@config.json": {"generation_config.json": DELETE},
    "add_bos_token": SP_ONLY,
    "add_eos_token": SP_ONLY,
    "bos_token.content": {"tokenizer_config.json": {"bos_token": {"content": "<|begin_of_text|>"}}},
    "rope_scaling.factor": OTHER_LAYOUT,
}
CASES = [(fixture, file, key, value) for fixture, file, key, values in WRONG for value in values]


def edits_for(fixture, file, key, value) -> dict:
    extra = EXTRA.get(f"{key}@{file}", EXTRA.get(key, {}))
    edits = {f: dict(e) if isinstance(e, dict) else e for f, e in extra.items()}
    if key == "weight_map.lm_head.weight":  # the tensor name holds dots
        data = json.loads((FIXTURES / fixture / file).read_text())
        data["weight_map"]["lm_head.weight"] = value
        return {**edits, file: json.dumps(data).encode()}
    if key == "rope_scaling.factor":
        config = dict(edits.pop("config.json"))
        config["rope_scaling"] = {**config["rope_scaling"], "factor": value}
        return {**edits, "config.json": json.dumps(config).encode()}
    if isinstance(edits.get(file), dict):
        edits[file] = {**edits[file], key: value}
    else:
        edits[file] = {key: value}
    return edits


@pytest.mark.parametrize("fixture,file,key,value", CASES,
                         ids=[f"{file}:{key}={hf_files.show(v)}" for _, file, key, v in CASES])
def test_a_wrong_kind_of_value_is_refused_naming_file_key_and_value(tmp_path, fixture, file, key, value):
    d = edited(tmp_path, fixture, edits_for(fixture, file, key, value))
    with pytest.raises(UsageError) as err:
        read_everything(d)
    message = str(err.value)
    assert "\n" not in message
    assert f"{d / file}: {key}={hf_files.show(value)}: " in message, message


def test_the_table_covers_every_key_the_reader_reads(tmp_path, monkeypatch):
    """Every (file, key) that `Fields.get` is asked for while the fixtures (and the edits
    that reach the other branches) are read has a row in WRONG."""
    asked = set()
    real_get = hf_files.Fields.get

    def recording_get(self, key, kind, *default):
        asked.add((pathlib.Path(self.where).name, self.prefix + key))
        return real_get(self, key, kind, *default)

    monkeypatch.setattr(hf_files.Fields, "get", recording_get)
    sources = [(name, {}) for name in ("llama_gqa", "llama_mha_tied", "llama3_scaled", "mistral", "llama_tp")]
    sources += [("llama_mha_tied", SP_ONLY), ("llama3_scaled", OTHER_LAYOUT),
                ("llama_gqa", {"generation_config.json": DELETE, "config.json": {"rope_parameters": DELETE,
                                                                                  "dtype": DELETE}}),
                ("llama_gqa", {"config.json": {"rope_parameters.rope_type": DELETE}}),
                ("llama_gqa", {"tokenizer_config.json": {"bos_token": {"content": "<|begin_of_text|>"}}})]
    for i, (fixture, edits) in enumerate(sources):
        read_everything(edited(tmp_path / str(i), fixture, edits))
    # One reader serves both rope layouts, and each tensor of the index: one row each.
    asked = {(f, "weight_map.lm_head.weight" if k.startswith("weight_map.") else
              k.replace("rope_scaling.", "rope_parameters.")) for f, k in asked}
    covered = {(file, key) for _, file, key, _ in WRONG}
    assert asked - covered == set()
    assert len(asked) >= 40


def test_a_pad_token_id_of_minus_1_means_no_pad_token(tmp_path):
    """Llama-1-era conversions write `pad_token_id: -1` (transformers loads them): read as
    no pad id in generation_config.json (as if the key were absent), not refused."""
    minus_one = edited(tmp_path / "a", "llama_gqa", {"generation_config.json": {"pad_token_id": -1}})
    absent = edited(tmp_path / "b", "llama_gqa", {"generation_config.json": {"pad_token_id": DELETE}})
    read_everything(minus_one)
    assert hf.tokenizer(minus_one).pad_id == hf.tokenizer(absent).pad_id


@pytest.mark.parametrize("file,contents,fragment", [
    ("config.json", b"[1, 2]", "expected a JSON object, found list"),
    ("config.json", b"{", "not valid JSON"),
    ("config.json", b"\xff\xfe", "not valid JSON"),
    ("generation_config.json", b"[302]", "expected a JSON object, found list"),
    ("generation_config.json", b"{'eos': 1}", "not valid JSON"),
    ("tokenizer_config.json", b"[]", "expected a JSON object, found list"),
    ("tokenizer_config.json", b"{\"bos_token\": ", "not valid JSON"),
    ("tokenizer.json", b"{\"model\": 5}", "not a tokenizers file"),
])
def test_damaged_json_files_are_one_line(tmp_path, file, contents, fragment):
    d = edited(tmp_path, "llama_gqa", {file: contents})
    with pytest.raises(UsageError, match=fragment) as err:
        read_everything(d)
    assert str(d / file) in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("contents", [b"", b"\x00" * 64, b"not a sentencepiece model at all", bytes(range(256))])
def test_a_garbage_tokenizer_model_is_one_line(tmp_path, contents):
    d = edited(tmp_path, "llama_mha_tied", {**SP_ONLY, "tokenizer.model": contents})
    with pytest.raises(UsageError, match="not a SentencePiece model") as err:
        read_everything(d)
    assert str(d / "tokenizer.model") in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("what", ["directory is a file", "config.json is a directory",
                                  "model.safetensors is a directory", "a shard is a directory",
                                  "index is a directory"])
def test_files_and_directories_in_the_wrong_place_are_one_line(tmp_path, what):
    if what == "directory is a file":
        target, fragment = FIXTURES / "pair_target" / "config.json", "is a file, not a Hugging Face model directory"
    else:
        fixture = "llama3_scaled" if what in ("a shard is a directory", "index is a directory") else "pair_target"
        target = edited(tmp_path, fixture, {})
        name = {"config.json is a directory": "config.json", "model.safetensors is a directory": "model.safetensors",
                "a shard is a directory": "model-00002-of-00004.safetensors",
                "index is a directory": "model.safetensors.index.json"}[what]
        (target / name).unlink()
        (target / name).mkdir()
        fragment = f"{target / name}: is a directory"
    with pytest.raises(UsageError) as err:
        read_everything(target)
    assert fragment in str(err.value), str(err.value)


# ------------------------------------------------------------------ which keys each architecture reads


def test_mistral_applies_its_sliding_window_whatever_use_sliding_window_says(tmp_path):
    """transformers' Mistral masks with `sliding_window` whenever it is not null (it has
    no use_sliding_window key: that is Qwen2's): every layer slides."""
    d = edited(tmp_path, "mistral", {"config.json": {"sliding_window": 64, "use_sliding_window": False}})
    cfg = hf.read_config(d).model
    assert (cfg.attention_pattern, cfg.sliding_window) == ("L", 64)


def test_mistral_without_a_sliding_window_key_has_transformers_default_window(tmp_path):
    """MistralConfig defaults sliding_window to 4096 and max_position_embeddings to
    131072: a config.json with neither key describes a windowed model; with a context
    within the window it is the plain model."""
    d = edited(tmp_path, "mistral", {"config.json": {"sliding_window": DELETE, "max_position_embeddings": DELETE}})
    cfg = hf.read_config(d).model
    assert (cfg.attention_pattern, cfg.sliding_window, cfg.max_seq_len) == ("L", 4096, 131072)
    d = edited(tmp_path / "b", "mistral", {"config.json": {"sliding_window": DELETE}})
    assert hf.read_config(d).model == hf.read_config(FIXTURES / "mistral").model


def test_mistral_without_num_key_value_heads_has_eight(tmp_path):
    """MistralConfig's default is 8 kv heads, LlamaConfig's the number of query heads."""
    d = edited(tmp_path, "mistral", {"config.json": {"num_key_value_heads": DELETE, "num_attention_heads": 16}})
    assert hf.read_config(d).model.num_kv_heads == 8
    d = edited(tmp_path / "b", "llama_gqa", {"config.json": {"num_key_value_heads": DELETE}})
    assert hf.read_config(d).model.num_kv_heads == 4


def test_llama_reads_no_sliding_window_and_mistral_no_bias_flags(tmp_path):
    """LlamaConfig has no sliding_window (transformers' Llama never windows), and
    Mistral's projections have no bias whatever attention_bias says."""
    d = edited(tmp_path, "llama_gqa", {"config.json": {"sliding_window": 8, "use_sliding_window": True}})
    assert hf.read_config(d).model == hf.read_config(FIXTURES / "llama_gqa").model
    d = edited(tmp_path / "b", "mistral", {"config.json": {"attention_bias": True, "mlp_bias": True}})
    assert hf.read_config(d).model == hf.read_config(FIXTURES / "mistral").model


def test_rope_keys_are_merged_as_transformers_merges_them(tmp_path):
    """A legacy rope_scaling object wins over rope_parameters, and its rope_theta over
    the top-level one (transformers 5's convert_rope_params_to_dict)."""
    base = hf.read_config(FIXTURES / "llama3_scaled").model
    d = edited(tmp_path, "llama3_scaled", {"config.json": {
        "rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 32, "rope_theta": 5e5},
        "rope_theta": 123.0}})
    cfg = hf.read_config(d).model
    assert (cfg.rope_scaling_factor, cfg.rope_original_max_len, cfg.rope_theta) == (4.0, 32, 5e5)
    assert base.rope_scaling_factor == 8.0
    d = edited(tmp_path / "b", "llama3_scaled", {"config.json": {"original_max_position_embeddings": 128}})
    assert hf.read_config(d).model.rope_original_max_len == 128  # the top-level key wins for llama3


def test_model_type_and_architectures_must_agree(tmp_path):
    d = edited(tmp_path, "llama_gqa", {"config.json": {"model_type": "mistral"}})
    with pytest.raises(UsageError, match="model_type='mistral'"):
        hf.read_config(d)


# ------------------------------------------------------------------ sizes and file kinds


def test_a_huge_layer_count_is_refused_before_anything_counts_layers(tmp_path):
    """num_hidden_layers=1e9 once made 9e9 tensor names (a MemoryError, or the OOM
    killer) before comparing them with the files: read in a child capped at 4 GiB."""
    d = edited(tmp_path, "llama_gqa", {"config.json": {"num_hidden_layers": 10**9}})
    proc = python_limited("from specjax.config import UsageError\n"
                          "from specjax.weights import hf\n"
                          "try:\n"
                          f"    hf.check_weights({str(d)!r}, hf.read_config({str(d)!r}).model)\n"
                          "except UsageError as e:\n"
                          "    print(e)\n")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"{d / 'config.json'}: num_hidden_layers=1000000000: the safetensors files hold 2 layers" in proc.stdout


def test_a_layer_count_the_files_do_not_hold_is_named(tmp_path):
    d = edited(tmp_path, "llama_gqa", {"config.json": {"num_hidden_layers": 3}})
    with pytest.raises(UsageError, match="num_hidden_layers=3: the safetensors files hold 2 layers"):
        read_everything(d)


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json",
                                  "model.safetensors"])
def test_a_named_pipe_in_the_directory_is_refused_without_waiting(tmp_path, name):
    d = edited(tmp_path, "llama_gqa", {name: DELETE})
    named_pipe(d / name)
    with pytest.raises(UsageError) as err:
        read_everything(d)
    assert str(err.value) == f"{d / name}: is a named pipe, not a file"


def test_a_named_pipe_as_tokenizer_model_is_refused(tmp_path):
    d = edited(tmp_path, "llama_mha_tied", {**SP_ONLY, "tokenizer.model": DELETE})
    named_pipe(d / "tokenizer.model")
    with pytest.raises(UsageError, match="tokenizer.model: is a named pipe, not a file"):
        read_everything(d)
