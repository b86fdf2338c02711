"""`warp` against a plain-numpy reference, and the accept/residual rule on hand-made p, q."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.sampling import Warp, warp
from specjax.speculative import accept


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
    got = np.asarray(warp(logits, Warp(temperature, top_k, top_p)))
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, reference_warp(logits, temperature, top_k, top_p), atol=1e-6)


def test_warp_is_float32_for_bfloat16_logits():
    logits = jax.random.normal(jax.random.key(1), (4, 32)).astype(jnp.bfloat16)
    probs = warp(logits, Warp(0.8, 0, 0.9))
    assert probs.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(probs.sum(-1)), 1.0, atol=1e-6)


def test_accept_rule_on_hand_made_distributions():
    """p, q chosen so every branch is known: x1 has q >= p (always kept), x2 has q = 0
    (always rejected), so n = 1 and the token comes from norm(max(0, q2 - p2))."""
    p = jnp.array([[[0.5, 0.5, 0.0], [0.2, 0.8, 0.0]]])
    q = jnp.array([[[0.1, 0.9, 0.0], [0.6, 0.0, 0.4], [1.0, 0.0, 0.0]]])
    x = jnp.array([[1, 1]])
    draws = [accept(k, x, p, q) for k in jax.random.split(jax.random.key(2), 400)]
    assert {int(n[0]) for n, _ in draws} == {1}
    tokens = np.array([int(t[0]) for _, t in draws])
    # residual = max(0, [0.6, 0, 0.4] - [0.2, 0.8, 0]) = [0.4, 0, 0.4] -> tokens 0 and 2, 50/50
    assert set(tokens) == {0, 2}
    assert abs((tokens == 0).mean() - 0.5) < 0.1  # 400 draws: sd 0.025, so 4 sd


def test_accept_all_gives_bonus_from_last_target_distribution():
    p = jnp.array([[[0.5, 0.5, 0.0]]])
    q = jnp.array([[[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]])  # q == p at the draft: always accepted
    n, token = accept(jax.random.key(3), jnp.array([[0]]), p, q)
    assert int(n[0]) == 1 and int(token[0]) == 2


def test_zero_residual_falls_back_to_q():
    """If max(0, q - p) sums to 0 at the rejected position, the token comes from q there."""
    p = jnp.array([[[0.0, 1.0, 0.0]]])
    q = jnp.array([[[0.0, 1.0, 0.0], [0.3, 0.3, 0.4]]])
    # x = 0 with q(x) = 0 is always rejected, and q == p there, so the residual is all
    # zeros: the fallback must draw from q_1 = one-hot(1), never from the all-zero vector.
    n, token = accept(jax.random.key(4), jnp.array([[0]]), p, q)
    assert int(n[0]) == 0 and int(token[0]) == 1
