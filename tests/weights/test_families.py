"""The model families of weights/arch/ beside Llama (Qwen2, Qwen3, Gemma 3) against
transformers itself, through committed fixtures (tests/fixtures/make_hf_fixtures.py:
tiny random models that transformers 5.24 saved, with the logits, greedy tokens,
tokenizer ids and chat renderings it computed). Their logits on 1 device and 2x4, scanned
and unrolled, their greedy tokens and import -> export -> import are in test_hf.py's
parametrisations; here: what each family's config.json means, the rotary tables, the
tokenizers and chat templates, and what is refused.

gemma3 is six layers, five sliding (window 4) then one global, over 12-token inputs, so
the window and each kind's own rotary base decide its logits (the negative control
drops the window and misses them)."""
import dataclasses
import json
import math
import pathlib
import shutil

import numpy as np
import pytest

from specjax import model
from specjax.config import UsageError
from specjax.weights import hf
from specjax.weights.tokenizer import HFTokenizer
from conftest import mesh_for
from models import assert_tokenizer_cases, logits_of

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "hf"
ATOL = 2e-5  # as test_hf.py
# Gemma's logits reach 15.5 (its embedding scale): float32 rounding of a different sum
# order is 2e-5 through XLA's dots and 3e-5 through the CPU attention kernel (which serves
# a 12-token prompt since it takes 16 query rows): 2e-6 of the largest logit.
GEMMA_ATOL = 4e-5


def reference(name):
    return np.load(FIXTURES / name / "reference.npz")


def test_each_family_reads_its_switches_from_config_json():
    q2, q3, g = (hf.read_config(FIXTURES / n) for n in ("qwen2", "qwen3", "gemma3"))
    assert (q2.family, q2.architecture, q3.family, g.family) == ("qwen2", "Qwen2ForCausalLM", "qwen3", "gemma3")
    c = q2.model
    assert (c.qkv_bias, c.qk_norm, c.post_norms, c.tie_embeddings, c.rope_theta, c.ffw) == (True, False, False, True,
                                                                                          1e6, "swiglu")
    c = q3.model
    assert (c.qkv_bias, c.qk_norm, c.head_dim, c.tie_embeddings, c.norm_weight_after_cast) == (False, True, 12, False,
                                                                                              True)
    c = g.model
    assert (c.attention_pattern, c.sliding_window, c.rope_theta, c.local_rope_theta, c.rope_scaling,
            c.rope_scaling_factor) == ("LLLLLG", 4, 1e6, 1e4, "linear", 8.0)
    assert (c.ffw, c.qk_norm, c.post_norms, c.norm_offset, c.norm_weight_after_cast, c.tie_embeddings) == (
        "geglu", True, True, 1.0, False, True)
    assert c.query_scale == 24 ** -0.5 and c.input_embedding_scale == math.sqrt(32)
    assert [c.sliding(i) for i in range(6)] == [True] * 5 + [False]
    assert (g.bos_id, g.eos_ids) == (2, (1, 6))  # generation_config.json: <eos>, <end_of_turn>


def test_gemma_rotary_tables_equal_transformers_per_layer_kind():
    cfg = hf.read_config(FIXTURES / "gemma3").model
    ref = reference("gemma3")
    np.testing.assert_allclose(model.rope_frequencies(cfg), ref["rope_inv_freq"], rtol=1e-6, atol=0)
    np.testing.assert_allclose(model.rope_frequencies(cfg, local=True), ref["rope_local_inv_freq"], rtol=1e-6, atol=0)


def test_the_sliding_window_decides_gemmas_logits():
    """Negative control of the window: the same weights attending to every earlier key
    (no sliding layer) miss transformers' logits by far more than GEMMA_ATOL."""
    ref = reference("gemma3")
    lm, _ = hf.load(FIXTURES / "gemma3", mesh_for("1x1"))
    np.testing.assert_allclose(logits_of(lm, ref["input_ids"]), ref["logits"], rtol=0, atol=GEMMA_ATOL)
    cfg = dataclasses.replace(lm.cfg, attention_pattern="", sliding_window=0)
    wide = model.LM(cfg, model.abstract_lm(cfg).graphdef, lm.params)
    assert np.abs(logits_of(wide, ref["input_ids"]) - ref["logits"]).max() > 100 * GEMMA_ATOL


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "gemma3"])
def test_tokenizer_ids_decodes_and_chat_template_equal_transformers(name):
    ref = json.loads((FIXTURES / name / "tokenizer_reference.json").read_text(encoding="utf-8"))
    tok = HFTokenizer(FIXTURES / name)
    generation = json.loads((FIXTURES / name / "generation_config.json").read_text())
    # No BOS token in Qwen's tokenizer: the id generation_config.json names, as for every directory.
    bos = ref["bos_token_id"] if ref["bos_token_id"] is not None else generation["bos_token_id"]
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (bos, ref["eos_token_id"], ref["len_tokenizer"])
    assert_tokenizer_cases(tok, ref["cases"])
    assert tok.chat_template == ref["chat_template"] and len(ref["chats"]) == 3
    for chat in ref["chats"]:
        text = tok.render_chat(chat["messages"])
        assert text == chat["text"]
        assert tok.encode(text) == chat["ids"]


def test_a_chat_template_error_is_one_line():
    tok = HFTokenizer(FIXTURES / "gemma3")
    with pytest.raises(UsageError, match="roles must alternate"):
        tok.render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def edited(tmp_path, name, changes):
    """A copy of fixture `name` with config.json's keys changed (None deletes one)."""
    shutil.copytree(FIXTURES / name, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    for k, v in changes.items():
        config.pop(k) if v is None else config.__setitem__(k, v)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("name,changes,needle", [
    ("gemma3", {"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0: a final logit softcap"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, "an attention logit softcap"),
    ("gemma3", {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"}, "a vision tower"),
    ("qwen3", {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}, "it has MoE layers"),
    ("qwen3", {"attention_bias": True}, "attention_bias=true: a bias on the output projection"),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention=true"),
    ("gemma3", {"hidden_activation": "gelu"}, "hidden_activation='gelu': only 'gelu_pytorch_tanh'"),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0},
                                    "sliding_attention": {"rope_type": "default"}}}, "'yarn' is not supported"),
    ("qwen2", {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3"}, "Qwen3ForCausalLM, Gemma3ForCausalLM"),
])
def test_what_the_model_lacks_is_refused_naming_it(tmp_path, name, changes, needle):
    with pytest.raises(UsageError, match="^.*$") as err:
        hf.read_config(edited(tmp_path, name, changes))
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_old_config_layout_of_gemma_reads_the_same_model(tmp_path):
    """Gemma 3's releases on the Hub say rope_theta, rope_local_base_freq and rope_scaling
    (transformers 4.x); transformers 5 writes rope_parameters per layer type."""
    shutil.copy(FIXTURES / "gemma3" / "config_other_layout.json", tmp_path / "config.json")
    old = json.loads((tmp_path / "config.json").read_text())
    assert "rope_local_base_freq" in old and "rope_parameters" not in old
    assert hf.read_config(tmp_path).model == hf.read_config(FIXTURES / "gemma3").model
    layers = edited(tmp_path / "b", "gemma3", {"layer_types": None, "sliding_window_pattern": 3})
    assert hf.read_config(layers).model.attention_pattern == "LLG"


# ------------------------------------------------------------------ transformers loads an export (slow)

TINY = dict(vocab_size=64, d_model=32, num_layers=6, num_heads=4, num_kv_heads=2, head_dim=8, d_ff=48,
            max_seq_len=64, pos_encoding="rope", norm_eps=1e-6)
GEMMA = dict(ffw="geglu", qk_norm=True, post_norms=True, norm_offset=1.0, norm_weight_after_cast=False,
             attention_pattern="LLLLLG", sliding_window=5, local_rope_theta=10000.0, rope_theta=1e6,
             rope_scaling="linear", rope_scaling_factor=4.0, query_scale=24 ** -0.5, tie_embeddings=True,
             embed_scale=math.sqrt(32))
EXPORTS = {
    "Qwen2ForCausalLM": dict(ffw="swiglu", qkv_bias=True, tie_embeddings=True, embed_scale=1.0,
                             norm_weight_after_cast=True, rope_theta=1e6),
    "Qwen3ForCausalLM": dict(ffw="swiglu", qk_norm=True, embed_scale=1.0, norm_weight_after_cast=True),
    "Gemma3ForCausalLM": GEMMA,
    # a Gemma read from GGUF: its norms hold 1 + w (norm_offset 0); the export writes w
    "Gemma3ForCausalLM-offset0": dict(GEMMA, norm_offset=0.0),
    "MistralForCausalLM": dict(ffw="swiglu", attention_pattern="L", sliding_window=5, embed_scale=1.0,
                               norm_weight_after_cast=True),
}


@pytest.mark.slow
@pytest.mark.parametrize("architecture", list(EXPORTS))
def test_transformers_loads_each_familys_export_to_the_same_logits(architecture, tmp_path):
    """A random model with a family's switches (every param random, norms included)
    exported, then loaded by transformers in a Python that has torch: the class its
    config.json names, the same logits over 20 tokens (past every window)."""
    import importlib.util
    import os
    import subprocess
    import sys
    from specjax.config import ModelConfig
    from models import random_lm
    here = all(importlib.util.find_spec(m) for m in ("torch", "transformers"))
    python = os.environ.get("SPECJAX_TORCH_PYTHON") or (sys.executable if here else None)
    if not python:
        pytest.skip("no torch and transformers in this Python: set SPECJAX_TORCH_PYTHON to a Python that has "
                    "them to run this check")
    cfg = ModelConfig(**TINY, **EXPORTS[architecture]).validate()
    lm = random_lm(cfg, mesh_for("1x1"), seed=4)
    hf.export(lm, tmp_path / "out", bos_id=0, eos_ids=(1,))
    ids = np.array([[0, 3, 17, 5, 9, 30, 2, 11, 4, 27, 6, 12, 19, 25, 8, 31, 22, 14, 1, 7]])
    code = ("import json, sys, numpy as np, torch, transformers\n"
            "m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()\n"
            "print(type(m).__name__)\n"
            "with torch.no_grad():\n"
            "    print(json.dumps(m(torch.tensor(json.loads(sys.argv[2]))).logits.numpy().tolist()))\n")
    proc = subprocess.run([python, "-c", code, str(tmp_path / "out"), json.dumps(ids.tolist())], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    name, logits = proc.stdout.strip().splitlines()[-2:]
    assert name == architecture.split("-")[0]
    theirs = np.array(json.loads(logits), np.float32)
    np.testing.assert_allclose(logits_of(lm, ids), theirs, rtol=0, atol=1e-4)
    again, _ = hf.load(tmp_path / "out", mesh_for("1x1"))  # and specjax reads it back to the same model
    np.testing.assert_allclose(logits_of(again, ids), logits_of(lm, ids), rtol=0, atol=1e-5)
