"""`python -m specjax.sample --hf_target=DIR [--hf_draft=DIR]` run as a user runs it, on
the committed Hugging Face fixtures (tests/fixtures/hf): the tokens transformers'
greedy `generate` gave, from ArS and SpS alike, with text prompts through the model's
own tokenizer and on a 1x8 mesh; and every bad directory or flag combination is one
line on stderr with exit code 2, before anything is compiled."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from clitools import assert_one_line, cli_env, run_many, xla_flags
from gguf_edit import named_pipe

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "hf"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return cli_env(tmp_path_factory.mktemp("hf_cli"))


def sample(env, *args, timeout=900, **extra):
    return subprocess.run([sys.executable, "-m", "specjax.sample", *args], cwd=ROOT, env={**env, **extra},
                          capture_output=True, text=True, timeout=timeout)


def records(path):
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]


def greedy_reference(name):
    ref = np.load(FIXTURES / name / "reference.npz")
    prompt = ref["prompt_ids"][0].tolist()
    return prompt, ref["greedy_ids"][0, len(prompt):].tolist()


def test_pair_from_hf_directories_gives_transformers_greedy_tokens_in_both_modes(env, tmp_path):
    prompt, expected = greedy_reference("pair_target")
    proc = sample(env, f"--hf_target={FIXTURES / 'pair_target'}", f"--hf_draft={FIXTURES / 'pair_draft'}",
                  "--mode=both", "--temperature=0", "--max_new_tokens=16", "--noprint_samples",
                  f"--prompt_tokens={','.join(map(str, prompt))}", f"--output={tmp_path / 'out.jsonl'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = {r["mode"]: r for r in records(tmp_path / "out.jsonl")}
    assert out["ars"]["tokens"] == out["sps"]["tokens"] == expected
    assert "SpS speedup over ArS" in proc.stdout


def test_text_prompt_goes_through_the_directory_tokenizer(env, tmp_path):
    """llama_gqa's tokenizer.json adds its BOS as transformers does; the generated text is
    decoded by the same tokenizer."""
    prompt, expected = greedy_reference("llama_gqa")
    proc = sample(env, f"--hf_target={FIXTURES / 'llama_gqa'}", "--mode=ars", "--temperature=0",
                  "--max_new_tokens=16", "--prompt=def f(x):", f"--output={tmp_path / 'out.jsonl'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (record,) = records(tmp_path / "out.jsonl")
    assert record["prompt_tokens"] == prompt and record["prompt_tokens"][0] == 301  # <|begin_of_text|>
    assert record["tokens"] == expected
    assert isinstance(record["text"], str) and record["text"] in proc.stdout


def test_sharded_over_a_1x8_mesh(env, tmp_path):
    prompt, expected = greedy_reference("llama_tp")
    proc = sample(env, f"--hf_target={FIXTURES / 'llama_tp'}", "--mode=ars", "--temperature=0", "--mesh=1x8",
                  "--max_new_tokens=16", f"--prompt_tokens={','.join(map(str, prompt))}", "--noprint_samples",
                  f"--output={tmp_path / 'out.jsonl'}", XLA_FLAGS=xla_flags(8))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert records(tmp_path / "out.jsonl")[0]["tokens"] == expected


def test_bench_measures_an_imported_pair(env, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "specjax.bench", f"--hf_target={FIXTURES / 'pair_target'}",
                           f"--hf_draft={FIXTURES / 'pair_draft'}", "--lookahead=2", "--num_prompts=2",
                           "--prompt_len=4", "--max_new_tokens=8", "--repeats=2", f"--json={tmp_path / 'b.json'}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["hf_target"].endswith("pair_target") and report["ars"]["ms_per_token"] > 0
    assert [r["lookahead"] for r in report["sps"]] == [2] and 0 <= report["sps"][0]["acceptance_rate"] <= 1


def test_ngram_drafting_needs_no_draft_directory(env, tmp_path):
    """Prompt lookup drafts from the row's own context: `sample --drafter=ngram` runs SpS
    on a target directory alone, and greedy SpS gives greedy ArS's tokens, which are
    transformers' own greedy tokens (bench: the test below)."""
    prompt, expected = greedy_reference("pair_target")
    proc = sample(env, f"--hf_target={FIXTURES / 'pair_target'}", "--mode=both", "--drafter=ngram", "--ngram=2",
                  "--temperature=0", "--max_new_tokens=16", "--noprint_samples",
                  f"--prompt_tokens={','.join(map(str, prompt))}", f"--output={tmp_path / 'out.jsonl'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = {r["mode"]: r for r in records(tmp_path / "out.jsonl")}
    assert out["sps"]["tokens"] == out["ars"]["tokens"] == expected
    assert out["sps"]["stats"]["proposed"] > 0  # the lookup did propose


@pytest.mark.parametrize("kind", [pytest.param("medusa", marks=pytest.mark.slow), "eagle"])
def test_draft_heads_on_an_imported_target(env, tmp_path, kind):
    """Heads saved for the directory's model shape load by --draft_checkpoint next to
    --hf_target (its draft is the heads, not another directory), and greedy SpS gives
    transformers' greedy tokens; heads made for another width are refused in one line."""
    import jax
    from specjax import sharding
    from specjax.config import HeadsConfig
    from specjax.heads import init_heads
    from specjax.weights import checkpoint, hf
    cfg = hf.read_config(FIXTURES / "pair_target").model
    mesh = sharding.make_mesh(devices=jax.devices()[:1])
    checkpoint.save_heads(init_heads(HeadsConfig(kind=kind, num_heads=3), cfg, mesh, random=True), tmp_path / "heads")
    prompt, expected = greedy_reference("pair_target")
    proc = sample(env, f"--hf_target={FIXTURES / 'pair_target'}", "--mode=both", f"--drafter={kind}",
                  f"--draft_checkpoint={tmp_path / 'heads'}", "--lookahead=3", "--temperature=0",
                  "--max_new_tokens=16", "--noprint_samples", f"--prompt_tokens={','.join(map(str, prompt))}",
                  f"--output={tmp_path / 'out.jsonl'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = {r["mode"]: r for r in records(tmp_path / "out.jsonl")}
    assert out["sps"]["tokens"] == out["ars"]["tokens"] == expected
    wide = dataclasses.replace(cfg, d_model=2 * cfg.d_model)
    checkpoint.save_heads(init_heads(HeadsConfig(kind=kind), wide, mesh, random=True), tmp_path / "wide")
    proc = sample(env, f"--hf_target={FIXTURES / 'pair_target'}", f"--drafter={kind}", "--lookahead=3",
                  "--max_new_tokens=8", f"--draft_checkpoint={tmp_path / 'wide'}",
                  f"--prompt_tokens={','.join(map(str, prompt))}")
    assert_one_line(proc, 2, ["d_model=", "(checkpoint) vs"], program="sample")


def test_eos_id_minus_1_never_stops_where_the_directory_has_an_eos(env, tmp_path):
    """pair_draft's greedy path reaches its EOS (generation_config.json: 1) after 14
    tokens, where transformers stops too; --config.sampling.eos_id=-1 ("never stop")
    runs the whole budget through it."""
    prompt, expected = greedy_reference("pair_draft")
    common = [f"--hf_target={FIXTURES / 'pair_draft'}", "--mode=ars", "--temperature=0", "--max_new_tokens=24",
              "--noprint_samples", f"--prompt_tokens={','.join(map(str, prompt))}"]
    stops = sample(env, *common, f"--output={tmp_path / 'stop.jsonl'}")
    never = sample(env, *common, "--config.sampling.eos_id=-1", f"--output={tmp_path / 'never.jsonl'}")
    assert stops.returncode == 0 and never.returncode == 0, (stops.stderr[-2000:], never.stderr[-2000:])
    (stopped,), (full,) = records(tmp_path / "stop.jsonl"), records(tmp_path / "never.jsonl")
    assert stopped["tokens"] == expected and expected[-1] == 1
    assert len(full["tokens"]) == 24 and full["tokens"][:len(expected)] == expected


def test_bench_of_a_lookup_drafter_needs_no_draft_and_takes_a_prompts_file(env, tmp_path):
    """A real model's n-gram SpS against its ArS: no --hf_draft, the prompts from a file
    through the directory's tokenizer (as `sample --prompts_file` reads them)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def f(x):"}\n{"prompt": "def f(x):\\n    return x"}\n')
    proc = subprocess.run([sys.executable, "-m", "specjax.bench", f"--hf_target={FIXTURES / 'llama_gqa'}",
                           "--drafter=ngram", "--lookahead=2", f"--prompts_file={prompts}", "--max_new_tokens=8",
                           "--repeats=2", f"--json={tmp_path / 'b.json'}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["prompts"] == str(prompts) and report["num_prompts"] == 2
    assert [(r["lookahead"], r["drafter"]) for r in report["sps"]] == [(2, "ngram")]
    proc = subprocess.run([sys.executable, "-m", "specjax.bench", f"--hf_target={FIXTURES / 'llama_gqa'}",
                           "--drafter=model"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "needs a draft: pass --hf_draft=DIR" in proc.stderr, proc.stderr


# ------------------------------------------------------------------ bad input


@pytest.mark.skipif(importlib.util.find_spec("gcsfs") is not None, reason="gcsfs is installed here")
def test_a_gs_checkpoint_without_the_gcs_package_says_which_to_install(env):
    """(--hf_target=gs://... is in the table below.)"""
    proc = sample(env, "--mode=ars", "--prompt_tokens=1,2", "--checkpoint=gs://specjax-no-such-bucket/model",
                  "--config=tiny", timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "gs://specjax-no-such-bucket/model" in lines[0] and "pip install 'specjax[gcs]'" in lines[0], lines[0]


def copy_model(src, dst, **config_changes):
    shutil.copytree(FIXTURES / src, dst)
    if config_changes:
        path = dst / "config.json"
        config = json.loads(path.read_text())
        for key, value in config_changes.items():
            config[key] = value
        path.write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    base = tmp_path_factory.mktemp("bad_hf")
    (base / "empty").mkdir()
    (base / "config_only").mkdir()
    shutil.copy(FIXTURES / "pair_target" / "config.json", base / "config_only")
    copy_model("pair_target", base / "gpt2", architectures=["GPT2LMHeadModel"], model_type="gpt2")
    copy_model("pair_target", base / "yarn", rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    # Weight files rewritten with the reference safetensors library: one tensor dropped, one transposed.
    tensors = load_file(str(FIXTURES / "pair_target" / "model.safetensors"))
    for name, change in (("missing", lambda t: t.pop("model.layers.1.mlp.down_proj.weight")),
                         ("misshapen", lambda t: t.update({"model.layers.0.self_attn.q_proj.weight":
                                                           t["model.layers.0.self_attn.q_proj.weight"][:, :16]}))):
        d = copy_model("pair_target", base / name)
        changed = dict(tensors)
        change(changed)
        save_file(changed, str(d / "model.safetensors"), metadata={"format": "pt"})
    d = copy_model("pair_target", base / "truncated")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:-100])
    # Same vocabulary size as llama_gqa, two tokens swapped: the tokenizers differ, not the sizes.
    d = copy_model("llama_gqa", base / "other_tokens")
    tok = json.loads((d / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab)[100], sorted(vocab)[101]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (d / "tokenizer.json").write_text(json.dumps(tok))
    # One wrong-typed or misplaced thing each (tests/weights/test_hf_config.py has every key).
    copy_model("pair_target", base / "tie_string", tie_word_embeddings="false")
    copy_model("pair_target", base / "max_len_float", max_position_embeddings=40.9)
    copy_model("pair_target", base / "theta_text", rope_parameters={"rope_type": "default", "rope_theta": "abc"})
    copy_model("pair_target", base / "scaling_string", rope_parameters=None, rope_scaling="linear")
    copy_model("pair_target", base / "arch_string", architectures="LlamaForCausalLM")
    copy_model("pair_target", base / "theta_null", rope_parameters={"rope_type": "default", "rope_theta": None})
    copy_model("pair_target", base / "max_len_text", max_position_embeddings="abc")
    copy_model("pair_target", base / "eps_text", rms_norm_eps="x")
    copy_model("mistral", base / "window_text", sliding_window="abc")
    rope = json.loads((FIXTURES / "llama3_scaled" / "config.json").read_text())["rope_parameters"]
    copy_model("llama3_scaled", base / "factor_null", rope_parameters={**rope, "factor": None})
    d = copy_model("pair_target", base / "eos_null")
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [1, None]}))
    d = copy_model("llama_gqa", base / "tokenizer_config_broken")
    (d / "tokenizer_config.json").write_text('{"bos_token": ')
    copy_model("gemma3", base / "gemma_vision", architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3")
    copy_model("pair_target", base / "short_context", max_position_embeddings=8)
    d = copy_model("pair_target", base / "eos_text")
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": ["a"]}))
    d = copy_model("llama3_scaled", base / "index_number")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = 5
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    d = copy_model("llama_gqa", base / "tokenizer_config_list")
    (d / "tokenizer_config.json").write_text("[]")
    d = copy_model("llama_mha_tied", base / "garbage_sentencepiece")
    (d / "tokenizer.json").unlink()
    (d / "tokenizer.model").write_bytes(b"not a sentencepiece model")
    for name, inner in (("config_dir", "config.json"), ("weights_dir", "model.safetensors")):
        d = copy_model("pair_target", base / name)
        (d / inner).unlink()
        (d / inner).mkdir()
    for name, inner in (("config_pipe", "config.json"), ("weights_pipe", "model.safetensors")):
        d = copy_model("pair_target", base / name)
        (d / inner).unlink()
        named_pipe(d / inner)
    copy_model("pair_target", base / "layers_huge", num_hidden_layers=10**9)
    return base


PAIR = f"--hf_target={FIXTURES / 'pair_target'}"
BAD_INPUTS = [  # (name, args, fragments of the one error line)
    ("no config.json", ["--hf_target={bad}/empty", "--mode=ars"], ["empty: no config.json", "Hugging Face model"]),
    ("no weights", ["--hf_target={bad}/config_only", "--mode=ars"],
     ["config_only: no weights", "model.safetensors"]),
    ("unsupported architecture", ["--hf_target={bad}/gpt2", "--mode=ars"],
     ["'GPT2LMHeadModel' is not supported", "LlamaForCausalLM, MistralForCausalLM"]),
    ("unknown rope scaling", ["--hf_target={bad}/yarn", "--mode=ars"],
     ["rope scaling type 'yarn' is not supported", "default, llama3"]),
    ("tensor missing", ["--hf_target={bad}/missing", "--mode=ars"],
     ["model.layers.1.mlp.down_proj.weight is missing"]),
    ("tensor of the wrong shape", ["--hf_target={bad}/misshapen", "--mode=ars"],
     ["model.layers.0.self_attn.q_proj.weight has shape [32, 16]", "needs [32, 32]"]),
    ("truncated safetensors", ["--hf_target={bad}/truncated", "--mode=ars"], ["model.safetensors: truncated"]),
    ("vocabulary sizes differ", [f"--hf_target={FIXTURES / 'llama_gqa'}", f"--hf_draft={FIXTURES / 'llama_mha_tied'}"],
     ["draft.vocab_size=384 differs from target.vocab_size=304", "share a tokenizer"]),
    ("tokenizers differ", [f"--hf_target={FIXTURES / 'llama_gqa'}", "--hf_draft={bad}/other_tokens"],
     ["tokenizer", "differ on 2 tokens", "the target's vocabulary"]),
    ("hf_target with checkpoint", [PAIR, "--checkpoint=/tmp/x", "--mode=ars"],
     ["--hf_target and --checkpoint both name weights"]),
    ("hf_draft without hf_target", [f"--hf_draft={FIXTURES / 'pair_draft'}"], ["--hf_draft needs --hf_target"]),
    ("sps without hf_draft", [PAIR, "--mode=sps"], ["--mode=sps with --drafter=model needs a draft", "--hf_draft=DIR",
                                                    "--drafter=ngram", "--mode=ars"]),
    ("hybrid without hf_draft", [PAIR, "--mode=sps", "--drafter=hybrid"], ["--drafter=hybrid needs a draft"]),
    ("hf_target is a file", [f"--hf_target={FIXTURES / 'pair_target' / 'config.json'}", "--mode=ars"],
     ["config.json: is a file, not a Hugging Face model directory"]),
    ("hf_draft is a file", [PAIR, f"--hf_draft={FIXTURES / 'pair_draft' / 'model.safetensors'}"],
     ["model.safetensors: is a file, not a Hugging Face model directory"]),
    ("config.json is a directory", ["--hf_target={bad}/config_dir", "--mode=ars"],
     ["config_dir/config.json: is a directory, not a JSON file"]),
    ("model.safetensors is a directory", ["--hf_target={bad}/weights_dir", "--mode=ars"],
     ["weights_dir/model.safetensors: is a directory, not a safetensors file"]),
    ("tie_word_embeddings a string", ["--hf_target={bad}/tie_string", "--mode=ars"],
     ["tie_string/config.json: tie_word_embeddings=\"false\": must be true or false"]),
    ("max_position_embeddings a fraction", ["--hf_target={bad}/max_len_float", "--mode=ars"],
     ["config.json: max_position_embeddings=40.9: must be an integer"]),
    ("rope_theta text", ["--hf_target={bad}/theta_text", "--mode=ars"],
     ["config.json: rope_parameters.rope_theta=\"abc\": must be a finite number"]),
    ("rope_scaling a string", ["--hf_target={bad}/scaling_string", "--mode=ars"],
     ["config.json: rope_scaling=\"linear\": must be a JSON object or null"]),
    ("rope_theta null", ["--hf_target={bad}/theta_null", "--mode=ars"],
     ["theta_null/config.json: rope_parameters.rope_theta=null: must be a finite number"]),
    ("llama3 factor null", ["--hf_target={bad}/factor_null", "--mode=ars"],
     ["factor_null/config.json: rope_parameters.factor=null: must be"]),
    ("max_position_embeddings text", ["--hf_target={bad}/max_len_text", "--mode=ars"],
     ["max_len_text/config.json: max_position_embeddings=\"abc\": must be an integer"]),
    ("rms_norm_eps text", ["--hf_target={bad}/eps_text", "--mode=ars"],
     ["eps_text/config.json: rms_norm_eps=\"x\": must be"]),
    ("sliding_window text", ["--hf_target={bad}/window_text", "--mode=ars"],
     ["window_text/config.json: sliding_window=\"abc\": must be"]),
    ("generation eos holds null", ["--hf_target={bad}/eos_null", "--mode=ars"],
     ["eos_null/generation_config.json: eos_token_id=[1, null]: must be"]),
    ("tokenizer_config not JSON", ["--hf_target={bad}/tokenizer_config_broken", "--mode=ars"],
     ["tokenizer_config_broken/tokenizer_config.json: not valid JSON"]),
    ("architectures a string", ["--hf_target={bad}/arch_string", "--mode=ars"],
     ["config.json: architectures=\"LlamaForCausalLM\": must be a list of strings or null"]),
    ("a vision tower", ["--hf_target={bad}/gemma_vision", "--mode=ars"],
     ["architecture 'Gemma3ForConditionalGeneration' is not supported: it has a vision tower"]),
    ("generation eos not ids", ["--hf_target={bad}/eos_text", "--mode=ars"],
     ["generation_config.json: eos_token_id=[\"a\"]: must be an integer or a list of integers or null"]),
    ("index entry not a file name", ["--hf_target={bad}/index_number", "--mode=ars"],
     ["model.safetensors.index.json: weight_map.lm_head.weight=5: must be a string"]),
    ("tokenizer_config a list", ["--hf_target={bad}/tokenizer_config_list", "--mode=ars"],
     ["tokenizer_config.json: expected a JSON object, found list"]),
    ("garbage tokenizer.model", ["--hf_target={bad}/garbage_sentencepiece", "--mode=ars"],
     ["tokenizer.model: not a SentencePiece model"]),
    ("ngram beyond the bound", [PAIR, "--mode=sps", "--drafter=ngram", "--ngram=1000"],
     ["ngram=1000", "[1, 16]"]),
    ("ngram beyond the context", ["--hf_target={bad}/short_context", "--mode=sps", "--drafter=ngram", "--ngram=12",
                                  "--lookahead=2"], ["ngram=12", "context of 8 tokens"]),
    ("mesh does not divide", [PAIR, "--mode=ars", "--mesh=1x8"],
     ["num_heads=4 is not divisible by the 'model' mesh axis of size 8"]),
    ("config.json a named pipe", ["--hf_target={bad}/config_pipe", "--mode=ars"],
     ["config_pipe/config.json: is a named pipe, not a file"]),
    ("model.safetensors a named pipe", ["--hf_target={bad}/weights_pipe", "--mode=ars"],
     ["weights_pipe/model.safetensors: is a named pipe, not a file"]),
    ("num_hidden_layers 1e9", ["--hf_target={bad}/layers_huge", "--mode=ars"],
     ["layers_huge/config.json: num_hidden_layers=1000000000: the safetensors files hold 2 layers"]),
    ("empty hf_target", ["--hf_target=", "--mode=ars"], ["'': an empty path, not a Hugging Face model directory"]),
    # etils reads gs:// through fsspec, which raises ImportError from deep inside without gcsfs.
    ("gs:// without gcsfs", ["--hf_target=gs://bkt/Llama-3.1-70B", "--mode=ars"],
     ["gs://bkt/Llama-3.1-70B", "needs the gcsfs package", "pip install 'specjax[gcs]'"]),
]


@pytest.fixture(scope="module")
def bad_runs(env, bad):
    limited = {"num_hidden_layers 1e9": {"CLITOOLS_RLIMIT_AS": str(6 << 30)}}  # a regression: MemoryError, not OOM
    cases = [(["--prompt_tokens=0,5,6", "--max_new_tokens=16", *[a.format(bad=bad) for a in args]],
              limited.get(name, {})) for name, args, _ in BAD_INPUTS]
    return dict(zip((c[0] for c in BAD_INPUTS), run_many(
        "specjax.sample", cases, env={**env, "XLA_FLAGS": xla_flags(8)}, cwd=ROOT)))


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_one_line_and_exit_2(bad_runs, case):
    name, _, fragments = case
    if name == "gs:// without gcsfs" and importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed here")
    proc = bad_runs[name]
    assert_one_line(proc, 2, fragments)
    assert proc.stdout.strip() == ""  # nothing ran
