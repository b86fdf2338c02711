"""Medusa heads as a drafter (`--drafter=medusa`, `specjax.heads`).

- Theorem 1 (the enumeration and chi-square test of `theorem1`, N = 50,000 samples per
  case, one compiled program and one batch each, ALPHA = 0.001) with random heads on the
  one-layer tiny target: K = 1 and 3, temperature 1 and 0.7 with top-p, a ragged batch,
  and two chains verified as a tree (all in the slow set, with the control); the negative
  control (the heads' p taken before
  warping while the tokens are drawn after it: a proposal's p that is not the
  distribution it was drawn from) is rejected with N_NEGATIVE samples.
- Greedy SpS == greedy ArS token for token (one chain and a tree, one device and eight).
- The fused loop: one while loop, no host round trip, no cache copied, and the heads add
  one all-reduce to the target's one pass per loop (on a 1x8 mesh).
- The state: after the prompts, the target's hidden state at the second-to-last prompt
  token (from the prefill, against a full forward of the prompt); after a loop, the
  kept path's last node (the one whose q gave the new pending token).
- Bad input: more lookahead than heads, heads for another width, heads given where a
  draft model is wanted and the reverse.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import model
from specjax.config import HeadsConfig, SamplingConfig, UsageError
from specjax.decode import program, speculative
from specjax.decode.drafters import Verdict, medusa
from specjax.heads import init_heads
from conftest import mesh_for
from models import RAGGED, cache_copies, fused_loop_collectives, tiny_pairs
from theorem1 import ALPHA, N, N_NEGATIVE, Case, make_models, run

HEADS = HeadsConfig(num_heads=3, init_seed=4)


@pytest.fixture(scope="module")
def models(tiny):
    target, _ = make_models(tiny)
    return target, init_heads(HEADS, target.cfg, mesh_for("1x1"), random=True)


CASES = {
    "ragged_temperature_0.7_top_p_0.8_K3": Case(0.7, 0, 0.8, 3, "ragged", "block", "medusa"),
    "tree_M2_K3": Case(1.0, 0, 1.0, 3, "ragged", "block", "medusa", num_drafts=2),
    "tokenwise_K1": Case(1.0, 0, 1.0, 1, "pair", "tokenwise", "medusa"),
    "tree_M2_temperature_0.7_top_p_0.8_K1": Case(0.7, 0, 0.8, 1, "pair", "block", "medusa", num_drafts=2),
}
DEFAULT = set()  # every case and the control run with `pytest -m slow` (the default suite's time budget)


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n in DEFAULT else [pytest.mark.slow]) for n in CASES])
def test_samples_follow_the_exact_target_distribution(models, name, patch):
    patch()
    case = CASES[name]
    pvalue, result = run(models, case, N)
    summary = result.summary()
    print(f"medusa {name}: p = {pvalue:.4f}, acceptance rate {result.acceptance_rate:.3f}, "
          f"proposed by {summary['proposed_by']}")
    assert pvalue > ALPHA
    assert set(summary["proposed_by"]) == {"medusa"}
    assert 0 < result.accepted.sum() < result.proposed  # acceptances and rejections both happened


@pytest.mark.slow
def test_negative_control_p_before_warping_is_rejected(models, patch):
    """Tokens drawn from the warped heads, but p reported as their plain softmax."""
    correct = medusa.MedusaDrafter.propose

    def unwarped_p(self, state, tokens, length, key, lookahead, num_drafts, warping):
        prop, state, bad = correct(self, state, tokens, length, key, lookahead, num_drafts, warping)
        plain = jax.nn.softmax(self.heads.logits(self.target, state, lookahead), axis=-1)
        return prop._replace(p=jnp.broadcast_to(plain[:, None], prop.p.shape)), state, bad

    patch([(medusa.MedusaDrafter, "propose", unwarped_p)])
    pvalue, _ = run(models, CASES["ragged_temperature_0.7_top_p_0.8_K3"], N_NEGATIVE)
    assert pvalue < ALPHA


@pytest.fixture(scope="module")
def pairs(tiny):
    out = {}
    for name, (target, _) in tiny_pairs(tiny).items():
        out[name] = target, init_heads(HeadsConfig(num_heads=4), target.cfg, mesh_for(name), random=True)
    return out


@pytest.mark.parametrize("mesh_name, num_drafts", [("1x1", 2), ("1x8", 1), pytest.param("1x1", 1, marks=pytest.mark.slow),
                                                   pytest.param("1x8", 2, marks=pytest.mark.slow)])
def test_greedy_sps_equals_greedy_ars(pairs, mesh_name, num_drafts):
    target, heads = pairs[mesh_name]
    greedy = SamplingConfig(temperature=0, lookahead=4, max_new_tokens=64, drafter="medusa", num_drafts=num_drafts)
    ars = specjax.generate(target, None, RAGGED, dataclasses.replace(greedy, drafter="model", num_drafts=1))
    sps = specjax.generate(target, heads, RAGGED, greedy)
    assert sps.tokens == ars.tokens
    assert sps.accepted.sum() > 0 and sps.summary()["proposed_by"].keys() == {"medusa"}


def test_one_fused_loop_no_cache_copy_and_only_the_targets_all_reduces(pairs):
    target, heads = pairs["1x8"]
    sampling = SamplingConfig(temperature=0.8, top_p=0.9, lookahead=4, max_new_tokens=32, drafter="medusa")
    built = program.build(target, heads, RAGGED, sampling, seed=0)
    per_loop = fused_loop_collectives(built)
    assert not cache_copies(built)
    # One target pass (Megatron: 2 per layer + the vocab-parallel embedding), and ONE for
    # all the heads (their blocks split over 'model' on the input axis); the hidden state
    # they read stays whole rows (split on d_model, the target's own pass would gather).
    assert sum(n for c, n in per_loop.items() if c.kind == "all-reduce") == 2 * target.cfg.num_layers + 1 + 1


def test_state_after_the_prompts_and_after_a_loop(pairs):
    target, heads = pairs["1x1"]
    drafter = medusa.MedusaDrafter(heads, target)
    prompts = [[5, 9, 2, 7, 1, 30], [4, 11, 0, 0, 0, 0], [8, 0, 0, 0, 0, 0]]
    lens = jnp.asarray([6, 2, 1])
    state = speculative.start(target, drafter, jnp.asarray(prompts), lens, jax.random.key(0),
                              speculative.Settings(3, program.warping_of(SamplingConfig())), 16)
    for row, (prompt, n) in enumerate(zip(prompts, [6, 2, 1])):
        _, hidden = model.full_forward(target, jnp.asarray([prompt[:n]]), features=True)
        np.testing.assert_allclose(state.drafter_state[row], hidden[0, max(n - 2, 0)], rtol=1e-5, atol=1e-5)
    # After a loop: the hidden state at the kept path's node num_accepted (node 0 the old pending token).
    features = jnp.arange(3 * 4 * 2, dtype=jnp.float32).reshape(3, 4, 2)
    verdict = Verdict(jnp.zeros(3, jnp.int32), jnp.asarray([0, 3, 1]), jnp.zeros(3, jnp.int32),
                      jnp.zeros(3, jnp.int32), features)
    np.testing.assert_array_equal(drafter.update(None, verdict), features[jnp.arange(3), jnp.asarray([0, 3, 1])])


def test_bad_input_names_the_problem(pairs):
    target, heads = pairs["1x1"]
    medusa_k = lambda k: SamplingConfig(lookahead=k, max_new_tokens=4, drafter="medusa")  # noqa: E731
    with pytest.raises(UsageError, match=r"lookahead=5 .*at most 4 tokens a loop \(num_heads=4\)"):
        specjax.generate(target, heads, [[1, 2]], medusa_k(5))
    wide = init_heads(HeadsConfig(num_heads=4), dataclasses.replace(target.cfg, d_model=64), mesh_for("1x1"))
    with pytest.raises(UsageError, match="d_model=64, the target has d_model=32"):
        specjax.generate(target, wide, [[1, 2]], medusa_k(2))
    with pytest.raises(UsageError, match="draws from draft heads, and the draft given is a model"):
        specjax.generate(target, target, [[1, 2]], medusa_k(2))
    with pytest.raises(UsageError, match="draws from a draft model, and the draft given is draft heads"):
        specjax.generate(target, heads, [[1, 2]], SamplingConfig(lookahead=2, max_new_tokens=4))
