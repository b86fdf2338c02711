"""`warp` against a plain-numpy reference, `sample` against its distribution, and the
accept/residual rule on hand-made p, q."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from specjax.decode.warping import Warp, cumulative, sample, warp
from specjax.decode.verify import accept


def reference_warp(logits, temperature, top_k, top_p):
    """Straightforward numpy, one row at a time: the definition, not the vectorised code."""
    out = []
    for row in np.asarray(logits, np.float64):
        if temperature == 0:
            p = np.zeros_like(row)
            p[np.argmax(row)] = 1
            out.append(p)
            continue
        z = row / temperature
        if 0 < top_k < len(z):
            kth = np.sort(z)[::-1][top_k - 1]
            z = np.where(z >= kth, z, -np.inf)
        p = np.exp(z - z.max())
        p /= p.sum()
        if top_p < 1:
            order = np.argsort(-p, kind="stable")
            kept, mass = [], 0.0
            for i in order:
                kept.append(i)
                mass += p[i]
                if mass >= top_p:
                    break
            mask = np.zeros_like(p, bool)
            mask[kept] = True
            p = np.where(mask, p, 0)
            p /= p.sum()
        out.append(p)
    return np.stack(out)


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8), (0.8, 0, 0.95), (0.9, 7, 0.6), (0.0, 0, 1.0)])
def test_warp_matches_reference(temperature, top_k, top_p):
    logits = 2.0 * jax.random.normal(jax.random.key(0), (64, 50))
    got, bad = warp(logits, Warp(temperature, top_k, top_p))
    assert not bad.any()
    got = np.asarray(got)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, reference_warp(logits, temperature, top_k, top_p), atol=1e-6)


def test_warp_is_float32_for_bfloat16_logits():
    logits = jax.random.normal(jax.random.key(1), (4, 32)).astype(jnp.bfloat16)
    probs, _ = warp(logits, Warp(0.8, 0, 0.9))
    assert probs.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(probs.sum(-1)), 1.0, atol=1e-6)


def test_accept_rule_on_hand_made_distributions():
    """p, q chosen so every branch is known: x1 has q >= p (always kept), x2 has q = 0
    (always rejected), so n = 1 and the token comes from norm(max(0, q2 - p2))."""
    p = jnp.array([[[0.5, 0.5, 0.0], [0.2, 0.8, 0.0]]])
    q = jnp.array([[[0.1, 0.9, 0.0], [0.6, 0.0, 0.4], [1.0, 0.0, 0.0]]])
    x = jnp.array([[1, 1]])
    draws = [accept(k, x, p, q) for k in jax.random.split(jax.random.key(2), 400)]
    assert {int(n[0]) for n, _, _ in draws} == {1}
    assert not any(bool(e[0]) for _, _, e in draws)
    tokens = np.array([int(t[0]) for _, t, _ in draws])
    # residual = max(0, [0.6, 0, 0.4] - [0.2, 0.8, 0]) = [0.4, 0, 0.4] -> tokens 0 and 2, 50/50
    assert set(tokens) == {0, 2}
    assert abs((tokens == 0).mean() - 0.5) < 0.1  # 400 draws: sd 0.025, so 4 sd


def test_accept_all_gives_bonus_from_last_target_distribution():
    p = jnp.array([[[0.5, 0.5, 0.0]]])
    q = jnp.array([[[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]])  # q == p at the draft: always accepted
    n, token, _ = accept(jax.random.key(3), jnp.array([[0]]), p, q)
    assert int(n[0]) == 1 and int(token[0]) == 2


def test_zero_residual_falls_back_to_q():
    """If max(0, q - p) sums to 0 at the rejected position, the token comes from q there."""
    p = jnp.array([[[0.0, 1.0, 0.0]]])
    q = jnp.array([[[0.0, 1.0, 0.0], [0.3, 0.3, 0.4]]])
    # x = 0 with q(x) = 0 is always rejected, and q == p there, so the residual is all
    # zeros: the fallback must draw from q_1 = one-hot(1), never from the all-zero vector.
    n, token, empty = accept(jax.random.key(4), jnp.array([[0]]), p, q)
    assert int(n[0]) == 0 and int(token[0]) == 1 and not bool(empty[0])


# `sample` draws from probs exactly: a chi-square goodness-of-fit test at alpha = 0.001
# on N = 40000 fixed-seed draws from a 40-token distribution with zero-probability
# entries (first, inner and last positions). Power: the negative control below feeds the
# same test draws from a distribution 10% sharper (probs ** 1.1, renormalised, a bias
# smaller than any temperature slip); it must be rejected, so the test can fail.
SAMPLE_ALPHA, SAMPLE_N = 1e-3, 40_000


def _sample_probs():
    p = np.asarray(jax.random.uniform(jax.random.key(7), (40,)), np.float64) ** 2
    p[[0, 17, 18, 39]] = 0.0
    return p / p.sum()


def _gof_pvalue(draws, probs):
    counts = np.bincount(draws, minlength=probs.size)
    support = probs > 0
    assert counts[~support].sum() == 0, f"zero-probability tokens drawn: {np.flatnonzero(counts * ~support)}"
    return stats.chisquare(counts[support], SAMPLE_N * probs[support]).pvalue


def _draws(probs):
    keys = jax.random.split(jax.random.key(11), SAMPLE_N)
    rows = jnp.broadcast_to(jnp.asarray(probs, jnp.float32), (SAMPLE_N, probs.size))
    # one key per row, as the loops use it (a [B, V] batch shares one key there)
    tokens, empty = jax.jit(jax.vmap(sample))(keys, rows)
    assert not np.asarray(empty).any()
    return np.asarray(tokens)


def test_sample_matches_its_distribution():
    probs = _sample_probs()
    assert _gof_pvalue(_draws(probs), probs) > SAMPLE_ALPHA


def test_sample_test_rejects_a_slightly_sharper_sampler():
    probs = _sample_probs()
    sharper = probs ** 1.1 / np.sum(probs ** 1.1)
    assert _gof_pvalue(_draws(sharper), probs) < SAMPLE_ALPHA


def test_sample_one_hot_and_last_token():
    """A one-hot (greedy) row always gives its token, including the last vocabulary entry
    (where u * total rounding up to the total must not step past the end)."""
    for hot in (0, 5, 49):
        probs = jax.nn.one_hot(jnp.full((64,), hot), 50)
        draws, _ = jax.vmap(sample)(jax.random.split(jax.random.key(hot), 64), probs)
        assert set(np.asarray(draws).tolist()) == {hot}


@pytest.mark.parametrize("vocab", [1, 7, 64, 65, 4096, 32000])
def test_cumulative_matches_float64_cumsum(vocab):
    """The blocked-matmul cumsum, for sizes below, at and across the 64-entry blocks."""
    probs = jax.random.uniform(jax.random.key(vocab), (2, 3, vocab))
    expected = np.cumsum(np.asarray(probs, np.float64), axis=-1)
    np.testing.assert_allclose(np.asarray(cumulative(probs)), expected, rtol=1e-5, atol=1e-5)
