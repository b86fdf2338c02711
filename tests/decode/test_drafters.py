"""Theorem 1 for the modes beyond the paper: block verification, the adaptive draft
length, and the n-gram, datastore and hybrid drafters all sample the target's exact
distribution (the enumeration and chi-square test of `theorem1`: N = 50,000 samples
per case, one compiled program and one batch each, ALPHA = 0.001).

Each mode has negative controls next to its cases: the same test on a deliberately
wrong variant, each of them a bug peers have shipped or could easily ship, which must
be REJECTED at ALPHA with N_NEGATIVE = 20,000 samples. Lookup cases use contexts whose
n-grams recur (`theorem1.REPEATS`) or a datastore built from target samples, and assert
that proposals really happened.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.config import SamplingConfig
from specjax.decode import speculative, verify
from specjax.decode.drafters import base, draft_model
from specjax.decode.retrieval_index import Datastore
from specjax.decode.warping import Warp, sample, warp
from theorem1 import ALPHA, N, N_NEGATIVE, PROMPT, PROMPT_LONG, Case, make_models, peeks_at_target, run


@pytest.fixture(scope="module")
def models(tiny):
    return make_models(tiny)


@pytest.fixture(scope="module")
def datastores(models):
    """'samples': target samples after the test prompts (like a corpus the target was
    trained on), so its continuations are often, not always, what the target wants."""
    target, _ = models
    prompts = [PROMPT, PROMPT_LONG] * 256
    samples = specjax.generate(target, None, prompts, SamplingConfig(temperature=1.0, max_new_tokens=8), seed=99)
    stream = np.concatenate([np.array(p + t) for p, t in zip(prompts, samples.tokens)])
    return {"samples": Datastore.build(stream, vocab_size=target.cfg.vocab_size, ngram=3, continuation=8,
                                       min_count=1)}


CASES = {
    # Block verification (Sun et al. 2025) with the draft model.
    "block_ragged_K3": Case(1.0, 0, 1.0, 3, "ragged", "block"),
    "block_top_k_5_K3": Case(1.0, 5, 1.0, 3, "pair", "block"),
    "block_draft_is_target_K3": Case(1.0, 0, 1.0, 3, "same", "block"),
    "block_temperature_0.7_K5": Case(0.7, 0, 1.0, 5, "pair", "block"),
    "block_top_p_0.8_K5": Case(1.0, 0, 0.8, 5, "ragged", "block"),
    "block_disjoint_support_K3": Case(1.0, 0, 1.0, 3, "disjoint", "block"),
    "block_K1": Case(1.0, 0, 1.0, 1, "pair", "block"),
    # Adaptive draft length: rows stop after a draft distribution with top probability < 0.5.
    "adaptive_ragged_K5": Case(1.0, 0, 1.0, 5, "ragged", "block", draft_confidence=0.5),
    "adaptive_tokenwise_top_p_0.8_K3": Case(1.0, 0, 0.8, 3, "pair", "tokenwise", draft_confidence=0.5),
    # Prompt lookup (no draft model).
    "ngram_repeats_K3": Case(1.0, 0, 1.0, 3, "repeats", "block", "ngram"),
    "ngram_tokenwise_temperature_0.7_K1": Case(0.7, 0, 1.0, 1, "repeats", "tokenwise", "ngram"),
    "ngram_top_k_5_K5": Case(1.0, 5, 1.0, 5, "repeats", "block", "ngram"),
    "ngram_top_p_0.8_K3": Case(1.0, 0, 0.8, 3, "repeats", "tokenwise", "ngram"),
    # Datastore lookup (no draft model).
    "retrieval_ragged_K3": Case(1.0, 0, 1.0, 3, "ragged", "block", "retrieval"),
    "retrieval_tokenwise_top_p_0.8_K5": Case(1.0, 0, 0.8, 5, "ragged", "tokenwise", "retrieval"),
    # Hybrid: a full-length n-gram match, else the datastore's (where given), else the draft model.
    "hybrid_repeats_K3": Case(1.0, 0, 1.0, 3, "repeats", "block", "hybrid"),
    "hybrid_datastore_adaptive_top_k_5_K5": Case(1.0, 5, 1.0, 5, "mixed", "block", "hybrid", 0.3, "samples"),
    "hybrid_draft_is_target_K3": Case(1.0, 0, 1.0, 3, "same", "tokenwise", "hybrid", prompts="repeats"),
    # The scoring pass as wide as the longest row's proposal (pass_width='proposed'): the
    # lookup finds nothing in either ragged prompt, so every row's first pass scores the
    # pending token alone, and later ones vary; with draft == target every draft is kept,
    # so the third token of a row that drafted K = 2 is the bonus, from the pass's last
    # position (at K = 3 a whole chain's bonus is past the 3 tokens the test reads); the
    # two prompts stop at different lengths.
    "ngram_ragged_temperature_0.7_K3_pass_as_proposed": Case(0.7, 0, 1.0, 3, "ragged", "tokenwise", "ngram",
                                                             pass_width="proposed"),
    "adaptive_draft_is_target_K2_pass_as_proposed": Case(1.0, 0, 1.0, 2, "same", "block", draft_confidence=0.5,
                                                         prompts="ragged", pass_width="proposed"),
}
# The default suite runs one case per mode plus the edge cases of the new verifier (p == q
# gives S_i = 0 everywhere); the rest (~2 minutes) runs with `pytest -m slow`.
DEFAULT = {"block_ragged_K3", "adaptive_ragged_K5",
           "ngram_repeats_K3", "retrieval_ragged_K3", "hybrid_repeats_K3"}


def maybe_slow(name, *rest):
    return pytest.param(name, *rest, marks=[] if name in DEFAULT else [pytest.mark.slow])


@pytest.mark.parametrize("name", [maybe_slow(n) for n in CASES])
def test_samples_follow_the_exact_target_distribution(models, datastores, name, patch):
    patch()
    case = CASES[name]
    pvalue, result = run(models, case, N, datastores=datastores)
    summary = result.summary()
    print(f"{name}: p = {pvalue:.4f}, acceptance rate {result.acceptance_rate:.3f}, proposed by "
          f"{summary['proposed_by']}, accepted by {summary['accepted_by']}, lengths {summary['drafted_histogram']}")
    assert pvalue > ALPHA
    proposed, accepted = summary["proposed_by"], summary["accepted_by"]
    if case.kind == "same":
        # p == q up to rounding: the draft's 1-token pass and the target's (K+1)-token scoring
        # pass sum in different orders (the few-row kernel, per ISA), so q/p is 1 within float
        # error and a handful of 300k tokens may be rejected (CI saw 2 on another host). A rule
        # that rejected for any other reason would reject far more than 1 in 10^4.
        assert proposed["model"] > 0 and proposed["model"] - accepted["model"] <= 1e-4 * proposed["model"]
    elif case.kind == "disjoint":
        assert result.acceptance_rate == 0.0  # q(x) = 0 for every drafted x
    else:
        assert 0 < result.accepted.sum() < result.proposed  # acceptances and rejections both happened
    if case.drafter in ("ngram", "retrieval"):
        assert accepted[case.drafter] > 0 and set(proposed) == {case.drafter}
    if case.drafter == "hybrid":  # the draft model and each lookup really proposed
        lookups = ["ngram"] + (["retrieval"] if case.datastore else [])
        assert proposed["model"] > 0 and all(proposed.get(name, 0) > 0 for name in lookups)
    if case.draft_confidence:
        lengths = np.flatnonzero(result.drafted.sum(0))
        assert len(lengths) > 1 and lengths.max() == case.K  # some rows stopped early, some drafted all K


# --------------------------------------------------------------------------- negative controls

correct_block = verify.accept_block
correct_select = base.select
correct_width = speculative.scored_width


def block_with_tokenwise_residual(key, x, p, q, length=None):
    """Block verification's tau, but the token-wise residual norm(max(0, q - p)) instead of
    norm(max(0, w_tau q - p))."""
    tau, _, _ = correct_block(key, x, p, q, length)
    p = jnp.where(verify.drafted_mask(x, length)[..., None], p, 0.0)
    return tau, *verify.resample(jax.random.fold_in(key, 1), q, p, jnp.ones(x.shape[:1]), tau)


def select_with_model_p(use, first, second):
    """Hybrid rows that use the n-gram proposal, verified with the draft model's soft
    probabilities instead of the proposal's point mass."""
    return correct_select(use, first, second)._replace(p=second.p)


def zero_draws(key, shape):
    """The uniform draw hard-coded to 0: every proposed token the target allows is accepted."""
    return jnp.zeros(shape)


def unwarped_draft_p(case):
    """transformers #47932: draft tokens sampled from the warped distribution, but p taken
    from the draft's unwarped softmax (the warped one is rebuilt from it for sampling)."""
    w = Warp(case.temperature, case.top_k, case.top_p)
    unwarped = lambda logits, _: (jax.nn.softmax(logits.astype(jnp.float32), axis=-1),  # noqa: E731
                                  jnp.zeros(logits.shape[:-1], bool))
    return [(draft_model, "warp", unwarped),
            (draft_model, "draw", lambda key, probs, _: sample(key, warp(jnp.log(probs), w)[0]))]


def greedy_draft_soft_p(case):
    """transformers #32867: a greedy draft (argmax tokens) whose soft probabilities are
    used as p, where p must be the point mass it really was."""
    return [(draft_model, "draw", lambda key, probs, _: (jnp.argmax(probs, axis=-1).astype(jnp.int32),
                                                      jnp.zeros(probs.shape[:-1], bool)))]


def one_short(nodes):
    """A pass as proposed that leaves out the longest row's last position: its last q
    (the bonus after a chain kept whole) is never computed."""
    return jnp.maximum(correct_width(nodes) - 1, 1)


WRONG = {
    "block_with_tokenwise_residual": lambda case: [(verify, "accept_block", block_with_tokenwise_residual)],
    "peeks_at_target": lambda case: [(verify, "accept_block", peeks_at_target)],
    "ngram_with_model_p": lambda case: [(base, "select", select_with_model_p)],
    "zero_uniform": lambda case: [(verify, "acceptance_draws", zero_draws)],
    "unwarped_draft_p": unwarped_draft_p,
    "greedy_draft_soft_p": greedy_draft_soft_p,
    "pass_one_short": lambda case: [(speculative, "scored_width", one_short)],
}
# The token-wise residual is wrong only where w_tau < 1: with top-k the draft's and the
# target's supports differ and the weights drop far below 1 (at temperature 1 without
# top-k the bias is too small to detect at K = 3 even with N samples).
NEGATIVE = [("block_top_k_5_K3", "block_with_tokenwise_residual"), ("block_ragged_K3", "zero_uniform"),
            ("block_ragged_K3", "greedy_draft_soft_p"), ("block_top_k_5_K3", "unwarped_draft_p"),
            ("adaptive_ragged_K5", "peeks_at_target"), ("ngram_repeats_K3", "zero_uniform"),
            ("hybrid_repeats_K3", "ngram_with_model_p"), ("retrieval_ragged_K3", "zero_uniform"),
            ("adaptive_draft_is_target_K2_pass_as_proposed", "pass_one_short")]


@pytest.mark.parametrize("name,wrong", NEGATIVE, ids=[f"{a}-{b}" for a, b in NEGATIVE])
def test_negative_control_wrong_variant_is_rejected(models, datastores, name, wrong, patch):
    patch(WRONG[wrong](CASES[name]))
    pvalue, _ = run(models, CASES[name], N_NEGATIVE, datastores=datastores)
    print(f"{name} with {wrong}: p = {pvalue:.2e}")
    assert pvalue < ALPHA
