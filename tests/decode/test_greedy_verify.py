"""Temperature 0 without vocabulary-wide work: `verify.accept_greedy` (what the rule a
one-chain loop verifies with at temperature 0, `verify.greedy`, runs), `warping.first_max`
(the argmax `warp` reads greedy tokens with) and `warping.draw` (a greedy draw read off the
one-hot).

The references are the general rules themselves: at temperature 0 the target's q is
one-hot, and `verify.accept` (tokenwise) and `verify.accept_block` must then decide
exactly what `verify.accept_greedy` decides, for any draft distribution p (point masses as a
lookup's, dense ones as a draft model's at T > 0, zeros at tokens it never proposes)
and any drafted length. Both general rules draw random numbers; with a one-hot q their
outcome does not depend on them, which the test checks too (several keys). The negative
control, a rule that counts every matching draft instead of the leading run, is told
apart by the same comparison.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decode import tree, verify
from specjax.decode.drafters import Proposal
from specjax.decode.warping import Warp, draw, first_max, sample, warp

B, K, V = 4000, 5, 7


def cases(seed: int, dense: bool):
    """(x [B, K], p [B, K, V], q [B, K+1, V] one-hot, length [B]): drafts that match the
    target's argmax often, so every accepted count 0..K occurs."""
    rng = np.random.default_rng(seed)
    t = rng.integers(0, V, (B, K + 1))
    x = np.where(rng.random((B, K)) < 0.7, t[:, :K], rng.integers(0, V, (B, K)))
    if dense:
        p = rng.dirichlet(np.full(V, 0.5), (B, K))
        p[rng.random((B, K, V)) < 0.2] = 0.0
        p[np.arange(B)[:, None], np.arange(K)[None], x] += 0.05  # x was drawn from p: p(x) > 0
        p /= p.sum(-1, keepdims=True)
    else:
        p = np.eye(V)[x]
    q = np.eye(V)[t]
    length = rng.integers(0, K + 1, B)
    return (jnp.asarray(x, jnp.int32), jnp.asarray(p, jnp.float32), jnp.asarray(q, jnp.float32),
            jnp.asarray(length, jnp.int32))


def every_matching_draft(key, x, p, q, length=None):
    """Negative control: counts every draft equal to the target's argmax, not the leading run."""
    t = first_max(q)
    n = jnp.sum((x == t[:, :x.shape[1]]) & verify.drafted_mask(x, length), axis=1).astype(jnp.int32)
    return n, jnp.take_along_axis(t, n[:, None], axis=1)[:, 0], jnp.zeros(n.shape, bool)


@pytest.mark.parametrize("dense", [False, True], ids=["point_mass_p", "dense_p"])
@pytest.mark.parametrize("general", ["tokenwise", "block"])
def test_greedy_rule_decides_what_the_general_rules_decide_at_temperature_0(dense, general):
    x, p, q, length = cases(1 if dense else 0, dense)
    rule = {"tokenwise": verify.accept, "block": verify.accept_block}[general]
    n, token, empty = jax.jit(verify.accept_greedy)(jax.random.key(0), x, p, q, length)
    assert not np.asarray(empty).any()
    counts = np.bincount(np.asarray(n), minlength=K + 1)
    assert (counts > 0).all(), counts  # every outcome 0..K is exercised
    for seed in range(3):  # the general rules' draws do not matter when q is one-hot
        want_n, want_token, want_empty = jax.jit(rule)(jax.random.key(seed), x, p, q, length)
        assert np.array_equal(n, want_n), (general, seed)
        assert np.array_equal(token, want_token), (general, seed)
        assert not np.asarray(want_empty).any()
    wrong_n, _, _ = every_matching_draft(None, x, p, q, length)
    assert not np.array_equal(wrong_n, want_n)  # the negative control is told apart


def test_greedy_rule_over_one_chain_keeps_its_leading_path():
    """`verify.greedy`, as `speculate` calls it: the chain's kept path is its first n nodes."""
    x, p, q, length = cases(2, False)
    prop = Proposal(x[:, None], p[:, None], length[:, None], jnp.zeros((x.shape[0], 1), jnp.int32))
    n, path, token, empty = jax.jit(verify.greedy)(jax.random.key(0), tree.of_chains(prop, K), q)
    want_n, want_token, _ = verify.accept_greedy(None, x, p, q, length)
    assert np.array_equal(n, want_n) and np.array_equal(token, want_token) and not np.asarray(empty).any()
    assert np.array_equal(path, tree.single_chain_path(want_n, K))


def test_chosen_rule():
    assert verify.chosen("block", 1, False, True) == "greedy"
    assert verify.chosen("tokenwise", 1, False, True) == "greedy"
    assert verify.chosen("block", 1, False, False) == "block"
    assert verify.chosen("tokenwise", 3, False, True) == "tree"  # several chains: the tree rule
    assert verify.chosen("block", 1, True, True) == "tree"  # a grown tree
    assert verify.select("block", 1, False, True) is verify.greedy


def test_first_max_is_argmax():
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(64, 1000)).astype(np.float32)
    rows[1, [3, 700]] = 50.0  # a tie: the first
    rows[2] = -np.inf  # all -inf: index 0
    rows[3, [10, 20]] = np.inf  # the first +inf
    rows[4] = 0.0
    rows[5, :] = rows[5, 999] = 7.0  # every entry tied
    got = np.asarray(jax.jit(first_max)(jnp.asarray(rows)))
    assert np.array_equal(got, np.argmax(rows, axis=-1))
    assert got.dtype == np.int32
    nan = rows[6].copy()
    nan[5] = np.nan
    assert int(first_max(jnp.asarray(nan))) == 999  # a NaN row (warp marks it bad): the last index


def test_greedy_draw_is_the_one_hot_token():
    logits = jax.random.normal(jax.random.key(1), (3, 5, 300))
    greedy = Warp(temperature=0.0)
    probs, bad = warp(logits, greedy)
    token, empty = draw(jax.random.key(2), probs, greedy)
    want, want_empty = sample(jax.random.key(2), probs)
    assert np.array_equal(token, want) and np.array_equal(token, np.argmax(np.asarray(logits), axis=-1))
    assert not np.asarray(empty).any() and not np.asarray(want_empty).any() and not np.asarray(bad).any()
    sampled = Warp(temperature=1.0)
    probs, _ = warp(logits, sampled)
    assert np.array_equal(draw(jax.random.key(2), probs, sampled)[0], sample(jax.random.key(2), probs)[0])


def test_sample_of_no_mass_stays_empty():
    probs = jnp.zeros((2, 9)).at[1, 4].set(1.0)
    token, empty = sample(jax.random.key(0), probs)
    assert np.asarray(empty).tolist() == [True, False] and int(token[1]) == 4 and 0 <= int(token[0]) < 9
