"""GGUF files of the families beside Llama (weights/arch/: `qwen2`, `qwen3`, `gemma3`)
against transformers, through committed fixtures (tests/fixtures/make_gguf_fixtures.py
--families writes them as llama.cpp's converter writes those architectures, with the gguf
package; transformers computed the logits, greedy tokens and GGUF tokenizer ids): the
config each file's metadata describes, logits on 1 device and 2x4, scanned and unrolled,
greedy tokens, the tokenizers (Qwen's byte-level BPE with the qwen2 pre-tokenizer;
Gemma's SentencePiece vocabulary with no space prefix) and their chat templates. gemma3's
norms are stored as 1 + w and read as such (norm_offset 0)."""
import dataclasses
import json
import math
import pathlib

import numpy as np
import pytest
from gguf import GGUFValueType as V

import specjax
from specjax import sharding
from specjax.config import SamplingConfig
from specjax.weights import gguf, hf
import gguf_edit
from conftest import mesh_for
from models import assert_tokenizer_cases, logits_of

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "gguf"
HF_FIXTURES = FIXTURES.parent / "hf"
FILES = ["qwen2_F32", "qwen2_Q8_0", "qwen3_F32", "qwen3_F16", "gemma3_F32", "gemma3_Q8_0"]
ATOL = {"gemma3": 6e-5}  # as test_hf.py's gemma3: |logit| to 15, six layers
CASES = ([(f, "1x1", False) for f in FILES] + [(f, "1x1", True) for f in ("qwen2_Q8_0", "qwen3_F32", "gemma3_Q8_0")]
         + [(f, "2x4", False) for f in ("qwen2_F32", "qwen3_F16", "gemma3_F32")])


def path(name):
    return FIXTURES / f"{name}.gguf"


def reference(name):
    return np.load(FIXTURES / f"{name}.npz")


@pytest.mark.parametrize("name,mesh_name,scan", CASES, ids=[f"{f}-{m}-{'scan' if s else 'unrolled'}"
                                                            for f, m, s in CASES])
def test_logits_equal_transformers(name, mesh_name, scan):
    ref = reference(name)
    mesh = mesh_for(mesh_name)
    lm, _ = gguf.load(path(name), mesh, param_dtype="float32", scan_layers=scan)
    assert sharding.shard_fraction(lm.params["embed"].value) == 1 / mesh.shape["model"]
    np.testing.assert_allclose(logits_of(lm, ref["input_ids"]), ref["logits"], rtol=0,
                               atol=ATOL.get(name.split("_")[0], 2e-5))


@pytest.mark.parametrize("name", ["qwen2_Q8_0", "qwen3_F16", "gemma3_Q8_0"])
def test_greedy_tokens_equal_transformers_generate(name):
    ref = reference(name)
    lm, _ = gguf.load(path(name), mesh_for("1x1"), param_dtype="float32")
    prompt = ref["prompt_ids"][0].tolist()
    result = specjax.generate(lm, None, [prompt], SamplingConfig(temperature=0.0, max_new_tokens=16, eos_id=-1))
    assert result.tokens[0] == ref["greedy_ids"][0, len(prompt):].tolist()


def test_config_from_each_familys_metadata():
    """What llama.cpp reads from these files: Qwen2's biases, Qwen3's q/k norms and
    head_dim 12 (attention.key_length), Gemma 3's window, its five sliding layers to one
    global (llama.cpp's default pattern), the sliding layers' base 1e4 and the global
    ones' linear scaling, head_dim**-0.5 as the query scale, sqrt(hidden) on the
    embeddings, its norms as stored (1 + w: norm_offset 0)."""
    q2 = gguf.read_config(path("qwen2_F32"))
    assert (q2.architecture, q2.family) == ("qwen2", "qwen2")
    float32_eps = lambda c: dataclasses.replace(c, norm_eps=float(np.float32(c.norm_eps)))  # noqa: E731 (stored so)
    assert q2.model == float32_eps(hf.read_config(HF_FIXTURES / "qwen2").model)
    q3 = gguf.read_config(path("qwen3_F16"))
    assert q3.model == float32_eps(hf.read_config(HF_FIXTURES / "qwen3", param_dtype="float16").model)
    g = gguf.read_config(path("gemma3_F32")).model
    assert (g.attention_pattern, g.sliding_window, g.local_rope_theta, g.rope_theta, g.rope_scaling,
            g.rope_scaling_factor) == ("LLLLLG", 4, 1e4, 1e6, "linear", 8.0)
    assert (g.ffw, g.qk_norm, g.post_norms, g.norm_offset, g.norm_weight_after_cast, g.tie_embeddings) == (
        "geglu", True, True, 0.0, False, True)
    assert g.query_scale == 8 ** -0.5 and g.input_embedding_scale == math.sqrt(32)


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "gemma3"])
def test_tokenizer_ids_decodes_and_chat_template_equal_transformers(name):
    ref = json.loads((FIXTURES / f"{name}_tokenizer.json").read_text(encoding="utf-8"))
    tok = gguf.tokenizer(path(f"{name}_F32"))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (ref["bos_token_id"], ref["eos_token_id"], ref["pad_token_id"])
    assert tok.chat_template == ref["chat_template"]
    assert_tokenizer_cases(tok, ref["cases"])
    # The file's tokenizer is its directory's: the same vocabulary, the same chats.
    hf.same_vocabulary(tok, specjax.weights.tokenizer.HFTokenizer(HF_FIXTURES / name))
    chats = json.loads((HF_FIXTURES / name / "tokenizer_reference.json").read_text(encoding="utf-8"))["chats"]
    for chat in chats:
        assert tok.render_chat(chat["messages"]) == chat["text"]
        assert tok.encode(chat["text"]) == chat["ids"]


@pytest.mark.parametrize("fields,pattern,theta", [
    ({"gemma3.attention.sliding_window_pattern": (3, V.UINT32)}, "LLG", 1e4),
    ({"gemma3.attention.sliding_window_pattern": ([True, False, True, True, False, False], V.ARRAY, V.BOOL)},
     "LGLLGG", 1e4),
    ({"gemma3.rope.freq_base_swa": (5e4, V.FLOAT32)}, "LLLLLG", 5e4),
    ({"gemma3.attention.sliding_window": gguf_edit.DROP}, "", 0.0),
])
def test_gemma_window_keys_as_llama_cpp_reads_them(tmp_path, fields, pattern, theta):
    """attention.sliding_window_pattern (an int n: layer i slides unless i % n == n - 1;
    or one bool per layer), rope.freq_base_swa; no window: every layer global."""
    edited = gguf_edit.rewrite(path("gemma3_F32"), tmp_path / "g.gguf", fields=fields)
    cfg = gguf.read_config(edited).model
    assert (cfg.attention_pattern, cfg.local_rope_theta) == (pattern, theta)
    assert cfg.sliding_window == (4 if pattern else 0)
