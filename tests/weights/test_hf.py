"""Hugging Face import and export against transformers itself, through the committed
fixtures in tests/fixtures/hf (tiny random models that transformers 5.24 saved, with the
logits, greedy tokens and tokenizer ids it computed; tests/fixtures/make_hf_fixtures.py
made them). Nothing here needs torch or transformers, except the slow export ->
transformers check, which runs another Python ($SPECJAX_TORCH_PYTHON).

- logits equal transformers' within ATOL for GQA/MHA/MQA, tied/untied, llama3 rope,
  Mistral, on 1 device and sharded over 2x4 and 1x8, unrolled and scanned layers;
- greedy decoding gives transformers' `generate(do_sample=False)` tokens;
- tokenizers give transformers' ids and decodes for 31 strings;
- import -> export -> import gives identical params, and the exported safetensors hold
  exactly the tensors transformers wrote (read back with the reference safetensors
  library, not our reader);
- SpS on an imported pair: greedy equals ArS, and Theorem 1 holds (chi-square against
  the enumerated target distribution, with a negative control);
- distilling a draft from an imported target, then exporting it.
"""
import dataclasses
import json
import os
import pathlib
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import specjax
from specjax import model, sharding
from specjax.config import SamplingConfig, UsageError, load_config
from specjax.decode.warping import Warp
from specjax.weights import checkpoint, hf
from specjax.weights.tokenizer import HFTokenizer
from conftest import mesh_for
from models import assert_tokenizer_cases, logits_of
from test_speculative import use_accept  # noqa: F401 (a fixture)
from theorem1 import ALPHA, N, N_NEGATIVE, chi_square_pvalue, exact_joint, optimised

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "hf"
ROOT = FIXTURES.parent.parent.parent
MODELS = ["llama_gqa", "llama_mha_tied", "llama3_scaled", "mistral", "pair_target", "pair_draft", "llama_tp",
          "qwen2", "qwen3", "gemma3"]  # the last three: weights/arch's other families (test_families.py)
# transformers' float32 logits reach |10|; specjax sums in another order (measured max
# |difference| 9.6e-6 over every case below).
ATOL = 2e-5
# gemma3 runs six layers with its logits scaled up by the sqrt(32) embedding scale (|logit| to 15.5): scanned and
# on 2x4 it measured 2.5e-5 from transformers, 1.7e-6 of the largest logit.
TOLERANCE = {"gemma3": 5e-5}
SPLITS_4 = [m for m in MODELS if m != "pair_draft"]  # 2 heads: no 4-way split
CASES = ([(m, "1x1", scan) for m in MODELS for scan in (False, True)]
         + [(m, "2x4", False) for m in SPLITS_4] + [("llama_mha_tied", "2x4", True), ("llama_tp", "2x4", True)]
         + [("llama_tp", "1x8", False), ("llama_tp", "1x8", True)])


def reference(name):
    return np.load(FIXTURES / name / "reference.npz")


@pytest.mark.parametrize("name,mesh_name,scan", CASES, ids=[f"{m}-{n}-{'scan' if s else 'unrolled'}"
                                                            for m, n, s in CASES])
def test_logits_equal_transformers(name, mesh_name, scan):
    ref = reference(name)
    mesh = mesh_for(mesh_name)
    lm, _ = hf.load(FIXTURES / name, mesh, scan_layers=scan)
    assert lm.cfg.scan_layers == scan and lm.cfg.param_dtype == "float32"
    split = mesh.shape["model"]
    assert sharding.shard_fraction(lm.params["embed"].value) == 1 / split  # vocab-parallel, really sharded
    np.testing.assert_allclose(logits_of(lm, ref["input_ids"]), ref["logits"], rtol=0, atol=TOLERANCE.get(name, ATOL))


@pytest.mark.parametrize("layout,shape,spec", [
    ("heads_out", (8, 32, 4), ("model", None, None)), ("heads_in", (8, 4, 32), ("model", None, None)),
    ("transpose", (32, 64), (None, "model")), ("transpose", (64, 32), ("model", None)),
    ("heads_out", (3, 8, 32, 4), (None, "model", None, None))])
def test_params_are_rearranged_on_the_devices_without_collectives(layout, shape, spec):
    """Each device's slice of the HF tensor (partitioned by `hf_spec`) holds exactly its
    own shard of the specjax param: the on-device transpose moves nothing between devices."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = mesh_for("2x4")
    stacked = len(shape) == 4
    inner = shape[1:] if stacked else shape
    hf_shape = {"heads_out": lambda: (inner[0] * inner[2], inner[1]), "transpose": lambda: inner[::-1],
                "heads_in": lambda: (inner[2], inner[0] * inner[1])}[layout]()
    spec_hf = ((None,) + hf.hf_spec(layout, spec[1:])) if stacked else hf.hf_spec(layout, spec)
    x = jax.ShapeDtypeStruct(((3,) if stacked else ()) + hf_shape, jnp.float32,
                             sharding=NamedSharding(mesh, P(*spec_hf)))
    text = hf._on_device(layout, shape, jnp.float32, NamedSharding(mesh, P(*spec))).lower(x).compile().as_text()
    assert not [op for op in ("all-reduce", "all-gather", "all-to-all", "collective-permute") if op in text]


@pytest.mark.parametrize("name", ["llama3_scaled", "llama_tp", "mistral", "llama_gqa"])
def test_rope_frequencies_equal_transformers_inv_freq(name):
    """llama3 scaling: llama3_scaled's frequencies fall in all three bands (kept,
    smoothed, divided by the factor), transformers' scaled inv_freq recorded."""
    cfg = hf.read_config(FIXTURES / name).model
    assert (cfg.rope_scaling == "llama3") == (name in ("llama3_scaled", "llama_tp"))
    assert float(reference(name)["rope_attention_scaling"]) == 1.0  # llama3 leaves the attention scale alone
    np.testing.assert_allclose(model.rope_frequencies(cfg), reference(name)["rope_inv_freq"], rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", MODELS)
def test_old_and_new_config_layouts_give_the_same_model(name, tmp_path):
    shutil.copy(FIXTURES / name / "config_other_layout.json", tmp_path / "config.json")
    new = json.loads((FIXTURES / name / "config.json").read_text())
    old = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in new and "rope_parameters" not in old and "rope_theta" in old
    assert hf.read_config(tmp_path).model == hf.read_config(FIXTURES / name).model


def test_config_mapping():
    """The fields transformers' config names, against the fixture's config.json values."""
    cfg = hf.read_config(FIXTURES / "llama3_scaled").model
    assert (cfg.vocab_size, cfg.d_model, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.d_ff, cfg.max_seq_len, cfg.norm_eps, cfg.rope_theta) == (64, 32, 1, 4, 2, 12, 48, 512, 1e-5, 1e4)
    assert (cfg.rope_scaling, cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
            cfg.rope_original_max_len) == ("llama3", 8.0, 1.0, 4.0, 64)
    assert (cfg.ffw, cfg.pos_encoding, cfg.embed_scale, cfg.tie_embeddings) == ("swiglu", "rope", 1.0, False)
    tied = hf.read_config(FIXTURES / "llama_mha_tied")
    assert tied.model.tie_embeddings and tied.model.input_embedding_scale == 1.0  # no sqrt(d) for Llama
    assert hf.read_config(FIXTURES / "mistral").model.rope_theta == 1e6
    gqa = hf.read_config(FIXTURES / "llama_gqa")
    assert (gqa.bos_id, gqa.eos_ids) == (301, (302, 303))  # generation_config.json's list
    assert hf.read_config(FIXTURES / "pair_draft").eos_ids == (1,)


@pytest.mark.parametrize("name", ["llama_gqa", "llama_mha_tied", "llama3_scaled", "mistral", "pair_draft", "qwen2",
                                  "qwen3", "gemma3"])
def test_greedy_tokens_equal_transformers_generate(name):
    """pair_draft's greedy path ends at its EOS: the row stops there, as transformers' does."""
    ref = reference(name)
    lm, _ = hf.load(FIXTURES / name, mesh_for("1x1"))
    eos = hf.read_config(FIXTURES / name).eos_ids
    prompt = ref["prompt_ids"][0].tolist()
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=16, eos_id=eos[0] if len(eos) == 1 else eos)
    result = specjax.generate(lm, None, [prompt], sampling)
    assert result.tokens[0] == ref["greedy_ids"][0, len(prompt):].tolist()
    assert bool(ref["greedy_hit_eos"]) == (name == "pair_draft") == (len(result.tokens[0]) < 16)


# ------------------------------------------------------------------ tokenizers


def sentencepiece_only(tmp_path):
    """llama_mha_tied's tokenizer.model with its tokenizer_config.json, no tokenizer.json."""
    for f in ("tokenizer.model", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(FIXTURES / "llama_mha_tied" / f, tmp_path / f)
    return tmp_path


@pytest.mark.parametrize("source", ["llama_gqa", "llama_mha_tied", "sentencepiece_only"])
def test_tokenizer_ids_and_decodes_equal_transformers(source, tmp_path):
    name = "llama_mha_tied" if source == "sentencepiece_only" else source
    directory = sentencepiece_only(tmp_path) if source == "sentencepiece_only" else FIXTURES / name
    ref = json.loads((FIXTURES / name / "tokenizer_reference.json").read_text(encoding="utf-8"))
    tok = HFTokenizer(directory)
    assert tok.path.name == ("tokenizer.model" if source == "sentencepiece_only" else "tokenizer.json")
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (ref["bos_token_id"], ref["eos_token_id"], ref["len_tokenizer"])
    gen_eos = ref["generation_config_eos_token_id"]
    assert tok.stop_ids == tuple(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    assert_tokenizer_cases(tok, ref["cases"])


# ------------------------------------------------------------------ export


def read_tensors(directory) -> dict:
    """Every tensor of a directory's safetensors files, with the reference library."""
    out = {}
    for f in sorted(pathlib.Path(directory).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def equal_params(a, b) -> bool:
    la, lb = jax.tree.leaves(a.params), jax.tree.leaves(b.params)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


@pytest.mark.parametrize("name,scan,shard_bytes", [("llama_gqa", False, None), ("llama_mha_tied", True, None),
                                                   ("llama3_scaled", False, 20_000), ("llama_tp", True, 30_000),
                                                   ("qwen2", False, None), ("qwen3", True, None),
                                                   ("gemma3", True, 100_000)])
def test_import_export_import_gives_identical_params(name, scan, shard_bytes, tmp_path):
    src, out = FIXTURES / name, tmp_path / "export"
    mesh = mesh_for("2x4" if name == "llama_tp" else "1x1")
    lm, _ = hf.load(src, mesh, scan_layers=scan)
    info = hf.read_config(src)
    hf.export(lm, out, tokenizer_dir=src, bos_id=info.bos_id, eos_ids=info.eos_ids,
              **({"max_shard_bytes": shard_bytes} if shard_bytes else {}))
    again, tok = hf.load(out, mesh, scan_layers=scan)
    assert again.cfg == lm.cfg
    assert equal_params(again, lm)
    # The files hold exactly what transformers' save_pretrained wrote (names, shapes, values).
    written, original = read_tensors(out), read_tensors(src)
    assert sorted(written) == sorted(original)
    for k in original:
        assert written[k].dtype == original[k].dtype and np.array_equal(written[k], original[k]), k
    files = sorted(p.name for p in out.glob("*.safetensors"))
    if shard_bytes:
        assert len(files) > 1
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert sorted(index["weight_map"]) == sorted(original) and set(index["weight_map"].values()) == set(files)
    else:
        assert files == ["model.safetensors"]
    assert hf.read_config(out).eos_ids == info.eos_ids
    if (src / "tokenizer.json").exists():
        assert tok.vocabulary() == HFTokenizer(src).vocabulary()


def test_bf16_stays_bf16(tiny, tmp_path):
    cfg = dataclasses.replace(tiny.target, ffw="swiglu", param_dtype="bfloat16", compute_dtype="bfloat16")
    lm = model.init_lm(cfg, mesh_for("1x1"))
    hf.export(lm, tmp_path)
    assert {str(t.dtype) for t in read_tensors(tmp_path).values()} == {"bfloat16"}
    again, _ = hf.load(tmp_path, mesh_for("2x4"))  # the stored dtype, unless asked otherwise
    assert again.cfg.param_dtype == "bfloat16" and equal_params(again, lm)
    assert {str(x.dtype) for x in jax.tree.leaves(again.params)} == {"bfloat16"}


def test_ranged_reads_give_what_the_memory_map_gives(monkeypatch):
    """The reader for non-local paths (gs://), run on the local fixture with a chunk of a
    few rows: the same params, sharded on 2x4."""
    from specjax.weights import safetensors_io
    monkeypatch.setattr(safetensors_io, "REMOTE_CHUNK_BYTES", 300)
    mapped, _ = hf.load(FIXTURES / "llama_tp", mesh_for("2x4"))
    ranged, _ = hf.load(FIXTURES / "llama_tp", mesh_for("2x4"), local=False)
    assert equal_params(mapped, ranged)


def test_export_folds_an_untied_embedding_scale_into_the_table(tiny, tmp_path):
    cfg = dataclasses.replace(tiny.target, ffw="swiglu", embed_scale=2.5)
    lm = model.init_lm(cfg, mesh_for("1x1"))
    hf.export(lm, tmp_path)
    again, tok = hf.load(tmp_path, mesh_for("1x1"))
    assert tok is None and again.cfg.embed_scale == 1.0
    ids = np.array([[3, 17, 5, 9, 30, 2]])
    np.testing.assert_allclose(logits_of(again, ids), logits_of(lm, ids), rtol=0, atol=1e-5)


@pytest.mark.parametrize("change,needle", [
    (dict(ffw="gelu"), "LlamaForCausalLM: ffw='gelu'"),
    (dict(ffw="swiglu", pos_encoding="relative"), "no Transformer-XL relative position terms"),
    (dict(ffw="swiglu", tie_embeddings=True), "scaled by 5.65685"),  # sqrt(32): the tied default
    (dict(ffw="swiglu", qkv_bias=True, qk_norm=True), "Qwen3ForCausalLM: qkv_bias=True"),
])
def test_export_refuses_what_no_family_can_express(tiny, change, needle, tmp_path):
    with pytest.raises(UsageError, match="cannot export") as err:
        hf.export(model.abstract_lm(dataclasses.replace(tiny.target, **change)), tmp_path)
    assert needle in str(err.value)
    assert not any(tmp_path.iterdir())


def test_checkpoints_without_the_new_model_fields_keep_their_meaning(tiny):
    """A checkpoint written before rope_scaling / embed_scale / norm_weight_after_cast
    existed has no such keys in its saved ModelConfig: they count as their defaults."""
    saved = dataclasses.asdict(tiny.target)
    for field in ("rope_scaling", "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                  "rope_original_max_len", "embed_scale", "norm_weight_after_cast"):
        del saved[field]
    assert checkpoint.config_differences(saved, tiny.target) == []
    assert checkpoint.config_differences(saved, dataclasses.replace(tiny.target, rope_scaling="llama3")) == [
        "rope_scaling='none' (checkpoint) vs 'llama3' (config)"]
    assert checkpoint.config_differences(saved, dataclasses.replace(tiny.target, embed_scale=1.0)) == [
        "embed_scale=None (checkpoint) vs 1.0 (config)"]


# ------------------------------------------------------------------ speculative sampling with imported weights


@pytest.fixture(scope="module")
def pair():
    mesh = mesh_for("1x1")
    return hf.load(FIXTURES / "pair_target", mesh)[0], hf.load(FIXTURES / "pair_draft", mesh)[0]


def noisy(lm, scale):
    """`lm` with noise on its output layer: a draft whose argmax agrees with lm's only sometimes."""
    params = jax.tree.map(lambda x: x, lm.params)
    u = params["unembed"].value
    params["unembed"].value = u + scale * u.std() * jax.random.normal(jax.random.key(7), u.shape)
    return dataclasses.replace(lm, params=params)


def test_greedy_sps_equals_greedy_ars_and_transformers_on_an_imported_pair(pair):
    """With pair_draft (unrelated random weights: its argmax rarely matches) and with the
    imported target plus output noise (matches often), greedy SpS is greedy ArS."""
    target, draft = pair
    ref = reference("pair_target")
    prompts = [ref["prompt_ids"][0].tolist(), [0, 9, 1, 22], [0, 3, 17, 5, 30, 2, 7, 11]]  # ragged rows
    sampling = SamplingConfig(temperature=0.0, lookahead=3, max_new_tokens=16)
    ars = specjax.generate(target, None, prompts, sampling)
    assert ars.tokens[0] == ref["greedy_ids"][0, len(prompts[0]):].tolist()
    rates = []
    for d in (draft, noisy(target, 0.3)):
        sps = specjax.generate(target, d, prompts, sampling)
        assert sps.tokens == ars.tokens
        rates.append(sps.acceptance_rate)
    print(f"acceptance rates: pair_draft {rates[0]:.2f}, noisy target {rates[1]:.2f}")
    assert 0.2 < rates[1] < 0.9  # both accepted and rejected drafts occur


def test_any_of_several_eos_ids_ends_a_row(pair):
    """Llama 3's generation_config lists several EOS ids; the row stops at the first one
    it emits. pair_target's greedy path is 26 17 5 22 ..."""
    target, _ = pair
    prompt = reference("pair_target")["prompt_ids"][0].tolist()
    for eos, expected in (((22, 5), [26, 17, 5]), ((22, 30), [26, 17, 5, 22])):
        result = specjax.generate(target, None, [prompt], SamplingConfig(temperature=0.0, max_new_tokens=8,
                                                                         eos_id=eos))
        assert result.tokens[0] == expected, eos


PROMPT = [0, 17, 5]


def theorem_1(pair, n):
    target, draft = pair
    # The paper's token-wise rule: the rule the control swaps out (block verification,
    # the default, has its own tests in test_drafters.py).
    sampling = SamplingConfig(temperature=1.0, lookahead=3, max_new_tokens=3, verify="tokenwise")
    with optimised():
        result = specjax.generate(target, draft, [PROMPT] * n, sampling, seed=0, pad_to=8)
    return chi_square_pvalue(np.array(result.tokens), exact_joint(target, PROMPT, Warp(1.0, 0, 1.0))), result


@pytest.mark.slow  # with its control ~2 minutes; Theorem 1 itself is the default suite's (test_speculative)
def test_sps_with_an_imported_pair_follows_the_exact_target_distribution(pair, use_accept):  # noqa: F811
    """Theorem 1 on pair_target/pair_draft (vocabulary 32): N=50,000 three-token samples
    against the exact joint from the target's full forward, chi-square at ALPHA=0.001."""
    use_accept(None)
    pvalue, result = theorem_1(pair, N)
    print(f"imported pair: p = {pvalue:.4f}, acceptance rate {result.acceptance_rate:.3f}")
    assert pvalue > ALPHA
    assert 0.05 < result.acceptance_rate < 0.95


@pytest.mark.slow
def test_negative_control_imported_pair_without_the_ratio_test_is_rejected(pair, use_accept):  # noqa: F811
    use_accept("no_ratio_test")
    pvalue, _ = theorem_1(pair, N_NEGATIVE)
    print(f"imported pair, no ratio test: p = {pvalue:.2e}")
    assert pvalue < ALPHA


# ------------------------------------------------------------------ distillation from an imported teacher


def test_draft_distilled_from_an_imported_target_exports_and_imports(tmp_path):
    from specjax.training import trainer
    from specjax.training.export import export_hf
    from specjax.training.workdir import read_metrics
    config = load_config("tiny", ["target.ffw=swiglu", f"train.teacher_hf={FIXTURES / 'pair_target'}",
                                  "train.steps=6", "train.seq_len=32", "train.batch_size=8", "train.warmup_steps=1",
                                  "train.eval_every=6", "train.eval_batches=1", "train.save_every=6",
                                  "train.log_every=1", "mesh.model=1"])
    result = trainer.train(config, tmp_path / "work", progress=False, devices=jax.devices()[:1])
    metrics = read_metrics(tmp_path / "work")
    assert result.step == 6 and all("kl" in m for m in metrics.values())  # the teacher's KL is in the loss
    export_hf(config, tmp_path / "work", tmp_path / "hf", devices=jax.devices()[:1])
    draft, _ = hf.load(tmp_path / "hf", mesh_for("1x1"))
    trained = checkpoint.load_lm(config.target, mesh_for("1x1"), tmp_path / "work")
    ids = np.array([[0, 3, 17, 5, 9]])
    np.testing.assert_allclose(logits_of(draft, ids), logits_of(trained, ids), rtol=0, atol=1e-5)
    assert hf.read_config(tmp_path / "hf").eos_ids == (1,)  # the teacher's generation ids


def test_text_corpus_is_tokenised_by_the_imported_teachers_tokenizer(tmp_path, monkeypatch):
    """train.teacher_hf with a text corpus: the token stream is the teacher tokenizer's
    (document text, then its EOS), and the student trains on it."""
    from specjax.training import trainer
    from specjax.training.corpus import load_corpus
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus.py"
    corpus.write_text((pathlib.Path(os.__file__).parent / "textwrap.py").read_text())
    config = load_config("tiny", ["target.ffw=swiglu", "target.vocab_size=304", "draft=none", "tokenizer_vocab=304",
                                  f"train.teacher_hf={FIXTURES / 'llama_gqa'}", f"train.corpus={corpus}",
                                  "train.steps=2", "train.seq_len=32", "train.batch_size=8", "train.warmup_steps=1",
                                  "train.eval_every=2", "train.eval_batches=1", "mesh.model=1"])
    data = load_corpus(config, HFTokenizer(FIXTURES / "llama_gqa"))
    tok = HFTokenizer(FIXTURES / "llama_gqa")
    expected = tok.encode(corpus.read_text()) + [tok.eos_id]
    assert np.concatenate([data.train, data.val]).tolist() == expected
    result = trainer.train(config, tmp_path / "work", progress=False, devices=jax.devices()[:1])
    assert result.step == 2 and not (tmp_path / "work" / "tokenizer.model").exists()


# ------------------------------------------------------------------ transformers loads an export (slow)


@pytest.mark.slow
def test_transformers_loads_an_export_to_the_same_logits(tiny, tmp_path):
    """A specjax-made Llama (random init: GQA, llama3 rope, explicit head_dim) exported,
    then loaded by transformers in a Python that has torch: the same logits."""
    import importlib.util
    import sys
    here = all(importlib.util.find_spec(m) for m in ("torch", "transformers"))
    python = os.environ.get("SPECJAX_TORCH_PYTHON") or (sys.executable if here else None)
    if not python:
        pytest.skip("no torch and transformers in this Python: set SPECJAX_TORCH_PYTHON to a Python that has "
                    "them to run this check")
    cfg = dataclasses.replace(tiny.target, ffw="swiglu", rope_scaling="llama3", rope_original_max_len=16,
                              rope_theta=500000.0, head_dim=12, norm_eps=1e-5)
    for tied in (False, True):
        c = dataclasses.replace(cfg, tie_embeddings=tied, embed_scale=1.0)
        lm = model.init_lm(c, mesh_for("1x1"), seed=3)
        out = tmp_path / f"tied_{tied}"
        hf.export(lm, out, tokenizer_dir=FIXTURES / "pair_target", bos_id=0, eos_ids=(1,))
        ids = np.array([[0, 3, 17, 5, 9, 30, 2, 11, 4, 27, 6, 12, 19, 25, 8, 31, 22, 14, 1, 7]])  # past 16 positions
        code = ("import json, sys, numpy as np, torch, transformers\n"
                "m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()\n"
                "assert type(m).__name__ == 'LlamaForCausalLM', type(m)\n"
                "with torch.no_grad():\n"
                "    print(json.dumps(m(torch.tensor(json.loads(sys.argv[2]))).logits.numpy().tolist()))\n")
        proc = subprocess.run([python, "-c", code, str(out), json.dumps(ids.tolist())], capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        theirs = np.array(json.loads(proc.stdout.strip().splitlines()[-1]), np.float32)
        np.testing.assert_allclose(logits_of(lm, ids), theirs, rtol=0, atol=ATOL)
        print(f"tied={tied}: max |specjax - transformers| = {np.abs(logits_of(lm, ids) - theirs).max():.2e}")
