"""The notebook's windows into the loop: `explain_loop` shows the first SpS loop exactly as
`generate` runs it; `next_token_probs` (one full forward) agrees with the cached scoring
pass and with greedy decoding; `plan.compile_program` counts a real model's collectives."""
import dataclasses

import numpy as np
import pytest

import specjax
from specjax import model
from specjax.analysis import compile as plan
from specjax.config import HeadsConfig, SamplingConfig
from specjax.heads import init_heads
from conftest import mesh_for

PROMPT = [3, 17, 5, 9]
K = 3
SAMPLING = SamplingConfig(temperature=1.0, top_k=8, lookahead=K, max_new_tokens=8)  # one compile, shared


@pytest.fixture(scope="module")
def pair(tiny):
    mesh = mesh_for("2x4")
    return model.init_lm(tiny.target, mesh), model.init_lm(tiny.draft, mesh)


@pytest.mark.parametrize("drafter, seed", [(d, s) for d in ("model", "medusa", "eagle")
                                           for s in ((0, 1, 2, 3) if d == "model" else (0,))])
def test_explain_loop_is_the_first_loop_of_generate(pair, seed, drafter):
    target, draft = pair
    sampling = SAMPLING
    if drafter != "model":  # random heads on the target: the loop's first proposal is theirs
        draft = init_heads(HeadsConfig(kind=drafter, num_heads=K), target.cfg, mesh_for("2x4"), random=True)
        sampling = dataclasses.replace(SAMPLING, drafter=drafter)
    trace = specjax.explain_loop(target, draft, PROMPT, sampling, seed=seed)
    emitted = specjax.generate(target, draft, [PROMPT], sampling, seed=seed).tokens[0]
    assert emitted[:len(trace.tokens)] == trace.tokens
    V = target.cfg.vocab_size
    assert trace.p.shape == (K, V) and trace.q.shape == (K + 1, V)
    np.testing.assert_allclose(trace.p.sum(-1), 1, atol=1e-5)
    np.testing.assert_allclose(trace.q.sum(-1), 1, atol=1e-5)
    assert (trace.p_draft > 0).all() and ((trace.p > 0).sum(-1) <= 8).all()  # top-k applied to p too
    assert ((0 <= trace.accept_prob) & (trace.accept_prob <= 1)).all()
    n = trace.num_accepted
    assert trace.status == ["accepted"] * n + ["rejected"] * (n < K) + ["not reached"] * (K - n - 1)
    assert trace.bonus == (n == K)
    if not trace.bonus:  # the residual never proposes what the draft over-weights
        assert trace.q[n, trace.next_token] > trace.p[n, trace.next_token]


def test_explain_loop_with_draft_equal_to_target_takes_the_bonus(pair):
    target, _ = pair
    trace = specjax.explain_loop(target, target, PROMPT, SAMPLING)
    np.testing.assert_allclose(trace.accept_prob, 1.0, rtol=1e-5)
    assert trace.bonus and len(trace.tokens) == K + 1


def test_next_token_probs_match_the_cached_scoring_pass(pair):
    """q_1..q_{n+1} of the loop come from the cache after prefill; the full forward over
    prompt + accepted drafts must give the same distributions."""
    target, draft = pair
    trace = specjax.explain_loop(target, draft, PROMPT, SAMPLING, seed=4)
    n = trace.num_accepted
    probs = specjax.next_token_probs(target, [PROMPT + trace.draft_tokens[:n]], SAMPLING)
    assert probs.shape == (1, len(PROMPT) + n, target.cfg.vocab_size)
    np.testing.assert_allclose(probs[0, len(PROMPT) - 1:], trace.q[:n + 1], atol=1e-5)


def test_next_token_probs_argmax_is_greedy_decoding(pair):
    target, _ = pair
    greedy = SamplingConfig(temperature=0, max_new_tokens=12)
    tokens = specjax.generate(target, None, [PROMPT], greedy).tokens[0]
    probs = specjax.next_token_probs(target, [PROMPT + tokens[:-1]] * 2, greedy)
    np.testing.assert_array_equal(probs[:, len(PROMPT) - 1:].argmax(-1), [tokens, tokens])
    assert set(np.unique(probs)) <= {0.0, 1.0}


def test_next_token_probs_refuses_ragged_sequences(pair):
    with pytest.raises(specjax.UsageError, match="different lengths"):
        specjax.next_token_probs(pair[0], [[1, 2], [3]])


def test_compile_program_counts_megatron_all_reduces_of_a_real_model(pair):
    """The notebook's collective count: 2 per layer + 1 (vocab-parallel embedding) per
    forward; a 40-token prompt pads to 64 like `generate` does."""
    target, draft = pair
    report = plan.compile_program(target, draft, SAMPLING, batch=1, prompt_len=40,
                                  cache_len=128)
    assert report["statics"]["size"] == 128
    # The key as JSON at every depth; temperature and top-p are operands, not part of it.
    assert report["statics"]["settings"]["lookahead"] == K
    assert report["statics"]["settings"]["warping"]["temperature"] == "traced"
    messages = report["per_loop"]["all-reduce"]["messages"]
    activations = {m["shape"]: m["count"] for m in messages}
    assert {m["group"] for m in messages} == {4}  # every all-reduce spans the 'model' axis of the 2x4 mesh
    D, d = target.cfg.d_model, draft.cfg.d_model
    assert activations[f"f32[1,{K + 1},{D}]"] == 2 * target.cfg.num_layers + 1  # ONE target pass over K+1
    draft_passes = activations[f"f32[1,2,{d}]"] + activations[f"f32[1,1,{d}]"]
    assert draft_passes == K * (2 * draft.cfg.num_layers + 1)
