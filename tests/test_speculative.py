"""Theorem 1, statistically: SpS samples follow the target's exact distribution.

Setting: a `tiny` target (vocabulary 32) with sharpened logits and a draft that differs
from it (see `models`), so acceptances and rejections are both frequent.
The exact joint distribution of the next 3 tokens is enumerated (32^3 cells) from full
forward passes of the target, with the same warping. SpS draws N = 100,000 samples as one
batch. Test: chi-square goodness of fit, cells with expected count < 5 pooled into one
bin, significance level ALPHA = 0.001; any sample in a zero-probability cell fails too.

Power: each check has a negative control next to it, the same test on a deliberately
wrong sampler (no ratio test = keep every draft token; resample from q instead of the
residual; bonus token drawn from the wrong position). Each must be REJECTED at ALPHA
with only N_NEGATIVE samples, so the test demonstrably detects the kind of bug it is
there for with a wide margin of power at N.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as scipy_stats

import specjax
from specjax import kv_cache, model
from specjax.decode import program, speculative
from specjax.config import SamplingConfig
from specjax.decode.sampling import Warp, sample, warp
from specjax.decode.speculative import accept as correct_accept
from conftest import mesh_for

ALPHA = 1e-3
N = 100_000
N_NEGATIVE = 20_000  # controls use 5x fewer samples: rejecting even then shows ample power
V = 32
PROMPT = [3, 17, 5]
PROMPT_LONG = [9, 1, 22, 14, 7, 30, 2]


def sharpened(lm: model.LM, factor: float) -> model.LM:
    params = jax.tree.map(lambda x: x, lm.params)
    params["unembed"].value = params["unembed"].value * factor
    return dataclasses.replace(lm, params=params)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class ParityLM(model.LM):
    """A model that can only emit tokens of one parity (logit -1e9 elsewhere: probability
    exactly 0 in float32). Two of them with different parities have disjoint supports."""

    parity: int = 0

    def __call__(self, tokens, positions, cache):
        logits, cache = super().__call__(tokens, positions, cache)
        return jnp.where(jnp.arange(V) % 2 == self.parity, logits, -1e9), cache

    def tree_flatten(self):
        return (self.params,), (self.cfg, self.graphdef, self.parity)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(aux[0], aux[1], children[0], aux[2])


@pytest.fixture(scope="module")
def models(tiny):
    """Target: tiny with logits sharpened x3. Draft: the target with noise on its output
    layer, so p resembles q (acceptance ~0.5, like a trained draft) but is not equal."""
    # One layer and one kv head (MQA): XLA:CPU runs attention at batch 100k as one tiny
    # GEMM per (row, kv head), so this halves the cost of the 100k-row batches. Theorem 1
    # does not depend on the architecture.
    one_layer = dataclasses.replace(tiny.target, num_layers=1, num_kv_heads=1)
    target = sharpened(model.init_lm(one_layer, mesh_for("1x1")), 3.0)
    params = jax.tree.map(lambda x: x, target.params)
    u = params["unembed"].value
    params["unembed"].value = u + 0.3 * u.std() * jax.random.normal(jax.random.key(7), u.shape)
    return target, dataclasses.replace(target, params=params)


def exact_joint(lm, prompt, w: Warp) -> np.ndarray:
    """P(x1, x2, x3 | prompt) by enumeration: one full forward over all 32^2 continuations."""
    pairs = np.stack(np.meshgrid(np.arange(V), np.arange(V), indexing="ij"), -1).reshape(-1, 2)
    seqs = np.concatenate([np.tile(prompt, (len(pairs), 1)), pairs], axis=1)
    B, T = seqs.shape
    logits, _ = jax.jit(lambda lm, t, p, c: lm(t, p, c))(
        lm, jnp.asarray(seqs), jnp.broadcast_to(jnp.arange(T), (B, T)), kv_cache.init_cache(lm.cfg, B, T))
    probs, bad = warp(logits[:, -3:], w)
    assert not bad.any()
    probs = np.asarray(probs, np.float64)  # [V*V, 3, V]
    q1 = probs[0, 0]
    q2 = probs[::V, 1]  # rows with x2 = 0: the distribution of x2 given x1
    q3 = probs[:, 2].reshape(V, V, V)
    return q1[:, None, None] * q2[:, :, None] * q3


def chi_square_pvalue(samples: np.ndarray, joint: np.ndarray) -> float:
    n = len(samples)
    observed = np.bincount(samples[:, 0] * V * V + samples[:, 1] * V + samples[:, 2], minlength=V ** 3)
    expected = joint.ravel() * n
    if observed[expected == 0].sum() > 0:
        return 0.0  # a token of probability zero was emitted
    big = expected >= 5
    o = np.append(observed[big], observed[~big].sum())
    e = np.append(expected[big], expected[~big].sum())
    keep = e > 0
    statistic = np.sum((o[keep] - e[keep]) ** 2 / e[keep])
    return float(scipy_stats.chi2.sf(statistic, keep.sum() - 1))


# Deliberately wrong acceptance rules (negative controls), same signature as `accept`.
def no_ratio_test(key, x, p, q):
    return jnp.full((x.shape[0],), x.shape[1], jnp.int32), *sample(key, q[:, -1])


def resample_from_q(key, x, p, q):
    n, _, _ = correct_accept(key, x, p, q)
    q_n = jnp.take_along_axis(q, n[:, None, None], axis=1)[:, 0]
    return n, *sample(jax.random.fold_in(key, 1), q_n)


def bonus_off_by_one(key, x, p, q):
    n, token, empty = correct_accept(key, x, p, q)
    return n, jnp.where(n == x.shape[1], sample(jax.random.fold_in(key, 1), q[:, 0])[0], token), empty


WRONG = {"no_ratio_test": no_ratio_test, "resample_from_q": resample_from_q, "bonus_off_by_one": bonus_off_by_one}


@pytest.fixture
def use_accept(monkeypatch):
    """Swap the acceptance rule; compiled programs are dropped before and after so the
    swap is traced in and never leaks into another test."""
    def swap(name):
        if name is not None:
            monkeypatch.setattr(speculative, "accept", WRONG[name])
        program._COMPILED.clear()
        jax.clear_caches()
    yield swap
    monkeypatch.undo()
    program._COMPILED.clear()
    jax.clear_caches()


CASES = {  # name -> (temperature, top_k, top_p, K, kind)
    "temperature_1_K3": (1.0, 0, 1.0, 3, "pair"),
    "temperature_0.7_K1": (0.7, 0, 1.0, 1, "pair"),
    "top_k_5_K5": (1.0, 5, 1.0, 5, "pair"),
    "top_p_0.8_K3": (1.0, 0, 0.8, 3, "pair"),
    "ragged_rows_K3": (1.0, 0, 1.0, 3, "ragged"),
    "draft_is_target_K1": (1.0, 0, 1.0, 1, "same"),
    "disjoint_support_K3": (1.0, 0, 1.0, 3, "disjoint"),
}
NEGATIVE = [("temperature_1_K3", "no_ratio_test"), ("temperature_1_K3", "resample_from_q"),
            ("temperature_0.7_K1", "no_ratio_test"), ("top_k_5_K5", "no_ratio_test"),
            ("top_p_0.8_K3", "resample_from_q"), ("ragged_rows_K3", "no_ratio_test"),
            ("draft_is_target_K1", "bonus_off_by_one"), ("disjoint_support_K3", "no_ratio_test")]


def run_case(models, name, n=N, seed=0):
    temperature, top_k, top_p, K, kind = CASES[name]
    target, draft = models
    if kind == "same":
        draft = target
    if kind == "disjoint":
        target = ParityLM(target.cfg, target.graphdef, target.params, parity=0)
        draft = ParityLM(draft.cfg, draft.graphdef, draft.params, parity=1)
    groups = [PROMPT, PROMPT_LONG] if kind == "ragged" else [PROMPT]
    prompts = [groups[i % len(groups)] for i in range(n)]  # interleaved: ragged rows in one batch
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, lookahead=K, max_new_tokens=3)
    result = specjax.generate(target, draft, prompts, sampling, seed=seed, pad_to=8)  # short cache: cheaper
    samples = np.array(result.tokens)
    w = Warp(temperature, top_k, top_p)
    pvalues = [chi_square_pvalue(samples[g::len(groups)], exact_joint(target, prompt, w))
               for g, prompt in enumerate(groups)]
    return min(pvalues) * len(groups), result  # Bonferroni over prompt groups


# Run with `pytest -m slow` (keeps the default suite under 15 minutes on 2 cores): top-k at
# K=5 (40 s), and plain temperature 1 at K=3 with its two controls (~70 s), whose ground
# stays covered by default: K=3 at temperature 1 with ragged rows, and both wrong rules
# on top_p_0.8_K3 / ragged_rows_K3.
SLOW = {"top_k_5_K5", "temperature_1_K3"}


def maybe_slow(name, *rest):
    return pytest.param(name, *rest, marks=[pytest.mark.slow] if name in SLOW else [])


@pytest.mark.parametrize("name", [maybe_slow(n) for n in sorted(CASES)])
def test_sps_samples_follow_the_exact_target_distribution(models, name, use_accept):
    use_accept(None)
    pvalue, result = run_case(models, name)
    print(f"{name}: p = {pvalue:.4f}, acceptance rate {result.acceptance_rate:.3f}")
    assert pvalue > ALPHA
    kind = CASES[name][-1]
    if kind == "same":
        assert result.acceptance_rate == 1.0  # p == q: every draft token is accepted
    elif kind == "disjoint":
        assert result.acceptance_rate == 0.0  # q(x) = 0 for every drafted x
    else:
        assert 0.05 < result.acceptance_rate < 0.95  # p and q really differ


@pytest.mark.parametrize("name,wrong", [maybe_slow(a, b) for a, b in NEGATIVE],
                         ids=[f"{a}-{b}" for a, b in NEGATIVE])
def test_negative_control_wrong_sampler_is_rejected(models, name, wrong, use_accept):
    use_accept(wrong)
    pvalue, _ = run_case(models, name, n=N_NEGATIVE)
    print(f"{name} with {wrong}: p = {pvalue:.2e}")
    assert pvalue < ALPHA
