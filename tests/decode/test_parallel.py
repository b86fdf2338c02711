"""The parallel drafter (`--drafter=parallel`, PARD): a draft model with a mask-token
embedding proposes all K tokens from one forward, x_j drawn from position j's marginal
given the context.

- Theorem 1 (the enumeration and chi-square test of `theorem1`, N = 50,000 samples per
  case, one compiled program and one batch each, ALPHA = 0.001) on the one-layer tiny
  target with a noisy copy of it given a random mask embedding: temperatures 1, 0.7 and
  1.5, top-k 5 and top-p 0.8, token-wise and block verification, a ragged batch, and a
  tree of two chains (all in the slow set, with the control). Negative control, rejected with N_NEGATIVE samples: the tokens drawn
  from the masked pass's marginals, p reported as the draft's autoregressive conditional
  along the drawn chain (what a drafter that forgot its draws never saw x_<j reports).
- p is exactly the distribution x was drawn from, after loops: the warped softmax of a
  plain full forward over the row's tokens followed by masks (no cache), at every
  position, for every row of a ragged batch; the drafter's one pass scores 2K rows.
- Greedy SpS == greedy ArS token for token, on one device and eight.
- Bad input: a draft without mask tokens, a K above the draft's, a bad parallel_draft.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import model
from specjax.config import ConfigError, ModelConfig, SamplingConfig, UsageError
from specjax.decode import program, speculative
from specjax.decode.drafters import parallel
from specjax.decode.state import write_rows
from specjax.decode.warping import warp
from conftest import mesh_for
from models import RAGGED, tiny_pairs, with_masks
from theorem1 import ALPHA, N_NEGATIVE, Case, assert_case_follows_the_target, make_models, run

@pytest.fixture(scope="module")
def models(tiny):
    target, draft = make_models(tiny)
    return target, with_masks(draft)


CASES = {
    "block_ragged_K3": Case(1.0, 0, 1.0, 3, "ragged", "block", "parallel"),
    "tokenwise_temperature_0.7_top_p_0.8_K3": Case(0.7, 0, 0.8, 3, "ragged", "tokenwise", "parallel"),
    "block_temperature_0.7_top_p_0.8_K4": Case(0.7, 0, 0.8, 4, "pair", "block", "parallel"),
    "tokenwise_top_k_5_K4": Case(1.0, 5, 1.0, 4, "pair", "tokenwise", "parallel"),
    "block_temperature_1.5_K2": Case(1.5, 0, 1.0, 2, "pair", "block", "parallel"),
    "tree_two_chains_top_k_5_K3": Case(1.0, 5, 1.0, 3, "ragged", "block", "parallel", num_drafts=2),
}
DEFAULT = set()  # every case and the control run with `pytest -m slow` (the default suite's time budget)


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n in DEFAULT else [pytest.mark.slow]) for n in CASES])
def test_samples_follow_the_exact_target_distribution(models, name, patch):
    patch()
    assert_case_follows_the_target(models, CASES[name], name)


def autoregressive_p(self, state, tokens, length, key, lookahead, num_drafts, warping):
    """The negative control: x drawn right (the masked pass's marginals), p reported as the
    draft's conditional given the chain x_<j (one causal pass over the context and x)."""
    prop, new_state, bad = CORRECT(self, state, tokens, length, key, lookahead, num_drafts, warping)
    x = prop.x[:, 0]
    chain = write_rows(tokens, length, x, jnp.full(length.shape, lookahead - 1))
    logits = model.full_forward(self.lm, chain)
    at = (length - 1)[:, None] + jnp.arange(lookahead)[None, :]
    p = warp(jnp.take_along_axis(logits, at[:, :, None], axis=1), warping)[0]
    return prop._replace(p=p[:, None]), new_state, bad


CORRECT = parallel.ParallelDrafter.propose


@pytest.mark.slow
def test_negative_control_autoregressive_p_is_rejected(models, patch):
    patch([(parallel.ParallelDrafter, "propose", autoregressive_p)])
    pvalue, _ = run(models, CASES["block_ragged_K3"], N_NEGATIVE)
    print(f"parallel with the autoregressive p: p = {pvalue:.2e}")
    assert pvalue < ALPHA


# --------------------------------------------------------------------------- p, exactly


def run_loops(target, drafter, prompts, loops, K):
    """The loop state after `loops` loops of `generate`'s loop body, at temperature 1."""
    width = max(map(len, prompts))
    tokens = jnp.asarray([p + [0] * (width - len(p)) for p in prompts])
    settings = speculative.Settings(K, program.warping_of(SamplingConfig(temperature=1.0)))
    state = START(target, drafter, tokens, jnp.asarray([len(p) for p in prompts]), jax.random.key(3), settings, 64)
    for _ in range(loops):
        state = LOOP(target, drafter, state, settings, jnp.int32(40), -1)
    return state


START = jax.jit(speculative.start, static_argnames=("settings", "size"))
LOOP = jax.jit(speculative.loop, static_argnames=("settings", "eos_id"))


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_p_is_the_masked_forwards_warped_softmax_after_loops(models, temperature, top_p):
    """After 0 and 5 loops (the draft cache filled by the passes and rolled back), each row's
    p_j equals the warped softmax at position length-1+j of ONE plain causal forward (no
    cache) over the row's tokens followed by K-1 masks: the drafter's cache holds exactly
    the context, and no draw leaks into another position's distribution."""
    target, draft = models
    K = 3
    target = target.packed()
    drafter = parallel.ParallelDrafter.make(SamplingConfig(lookahead=K, drafter="parallel"), target, draft, None, None)
    assert drafter.window == K + 1
    warping = program.warping_of(SamplingConfig(temperature=temperature, top_p=top_p))
    prompts = [[5, 9, 2, 7, 1, 30], [4, 11], [8], [3, 17, 5, 3, 17, 9, 1, 22, 14]]
    for loops in (0, 5):
        state = run_loops(target, drafter, prompts, loops, K)
        prop, _, bad = jax.jit(drafter.propose, static_argnums=(4, 5, 6))(
            state.drafter_state, state.tokens, state.length, jax.random.key(9), K, 1, warping)
        assert not np.any(np.asarray(bad))
        # Every row's tokens then K-1 masks, padded on the right (the pass is causal), in one
        # full forward with no cache.
        lengths = np.asarray(state.length)
        rows = np.zeros((len(prompts), lengths.max() + K - 1), np.int32)
        for b, n in enumerate(lengths):
            rows[b, :n + K - 1] = list(np.asarray(state.tokens[b, :n])) + [model.mask_id(draft.cfg)] * (K - 1)
        logits = FULL_FORWARD(draft, jnp.asarray(rows))
        at = (lengths - 1)[:, None] + np.arange(K)[None, :]
        want = np.asarray(warp(jnp.take_along_axis(logits, jnp.asarray(at)[:, :, None], axis=1), warping)[0])
        np.testing.assert_allclose(np.asarray(prop.p[:, 0]), want, rtol=1e-4, atol=1e-6,
                                   err_msg=f"after {loops} loops")
        x = np.asarray(prop.x[:, 0])
        assert np.all(np.take_along_axis(want, x[:, :, None], axis=2) > 0), "a token drawn outside its distribution"


FULL_FORWARD = jax.jit(model.full_forward)


def test_the_proposal_is_one_pass_of_2k_rows(models):
    """The draft's cost per loop does not grow with K as K passes would: one forward of K+1
    re-fed tokens and K-1 masks (no loop over positions in the traced proposal)."""
    target, draft = models
    for K in (2, 4):
        drafter = parallel.ParallelDrafter.make(SamplingConfig(lookahead=K, drafter="parallel"), target, draft,
                                                None, None)
        cache = drafter.init_state(jnp.asarray([[1, 2, 3]]), jnp.asarray([3]), 16, 1, None)
        jaxpr = jax.make_jaxpr(lambda s: drafter.propose(s, jnp.zeros((1, 16), jnp.int32), jnp.asarray([3]),
                                                         jax.random.key(0), K, 1,
                                                         program.warping_of(SamplingConfig())))(cache)
        text = str(jaxpr)
        assert "scan" not in text and "while" not in text
        ids, positions, at = parallel.masked_pass(jnp.asarray([[1, 2, 3, 0, 0, 0, 0, 0, 0]]), jnp.asarray([3]),
                                                  K + 1, K, 99)
        assert ids.shape == (1, 2 * K)
        assert list(np.asarray(ids[0, :3])) == [1, 2, 3] and set(np.asarray(ids[0, 3:]).tolist()) == {99}
        assert list(np.asarray(at[0])) == list(range(2, 2 + K))  # the pending token, then the masks


# --------------------------------------------------------------------------- greedy, bad input


@pytest.fixture(scope="module")
def pairs(tiny):
    return {name: (target, with_masks(draft)) for name, (target, draft) in tiny_pairs(tiny).items()}


@pytest.mark.parametrize("mesh_name,num_drafts", [("1x1", 2), ("1x8", 1), pytest.param("1x1", 1, marks=pytest.mark.slow)])
def test_greedy_sps_equals_greedy_ars(pairs, mesh_name, num_drafts):
    target, draft = pairs[mesh_name]
    greedy = SamplingConfig(temperature=0, lookahead=4, max_new_tokens=48, drafter="parallel", num_drafts=num_drafts)
    ars = specjax.generate(target, None, RAGGED, dataclasses.replace(greedy, drafter="model", num_drafts=1))
    sps = specjax.generate(target, draft, RAGGED, greedy)
    assert sps.tokens == ars.tokens
    assert sps.accepted.sum() > 0 and sps.summary()["proposed_by"].keys() == {"parallel"}


def test_bad_input_names_the_problem(pairs):
    target, draft = pairs["1x1"]
    plain = model.init_lm(dataclasses.replace(draft.cfg, parallel_draft=0), mesh_for("1x1"))
    sampling = SamplingConfig(lookahead=2, max_new_tokens=4, drafter="parallel")
    with pytest.raises(UsageError, match="drafter='parallel' needs a parallel draft model .*got a draft model "
                                         "without mask tokens"):
        specjax.generate(target, plain, [[1, 2]], sampling)
    with pytest.raises(UsageError, match="lookahead=5 with drafter='parallel': the draft proposes at most 4 tokens"):
        specjax.generate(target, draft, [[1, 2]], dataclasses.replace(sampling, lookahead=5))
    with pytest.raises(ConfigError, match="parallel_draft=-1: must be an integer >= 0"):
        ModelConfig(parallel_draft=-1).validate()


def test_the_mask_switch_adds_one_embedding_row_and_changes_nothing_else(tiny):
    """parallel_draft > 0 adds `mask_embed` (made last, so the same seed gives the other
    params unchanged): a sequence without masks has the plain model's logits, and the mask
    id embeds as that row."""
    mesh = mesh_for("1x1")
    plain = model.init_lm(tiny.draft, mesh)
    masked = model.init_lm(dataclasses.replace(tiny.draft, parallel_draft=3), mesh)
    assert set(masked.params) - set(plain.params) == {"mask_embed"}
    assert masked.num_params == plain.num_params + tiny.draft.d_model == masked.cfg.num_params
    tokens = jnp.asarray([[1, 5, 9, 31, 0]])
    np.testing.assert_array_equal(np.asarray(model.full_forward(masked, tokens)),
                                  np.asarray(model.full_forward(plain, tokens)))
    row = masked.embed(jnp.asarray([[model.mask_id(masked.cfg)]]))[0, 0]
    np.testing.assert_array_equal(np.asarray(row), np.asarray(masked.params["mask_embed"].value))
