"""Temperature 0 without vocabulary-wide work: `verify.accept_greedy` (what the rule a
one-chain loop verifies with at temperature 0, `verify.greedy`, runs), `tree.accept_greedy`
(the tree rule's, `verify.tree_greedy`: several chains or a grown tree), `warping.first_max`
(the argmax `warp` reads greedy tokens with) and `warping.draw` (a greedy draw read off the
one-hot).

The references are the general rules themselves: at temperature 0 the target's q is
one-hot, and `verify.accept` (tokenwise) and `verify.accept_block` must then decide
exactly what `verify.accept_greedy` decides, for any draft distribution p (point masses as a
lookup's, dense ones as a draft model's at T > 0, zeros at tokens it never proposes)
and any drafted length. Both general rules draw random numbers; with a one-hot q their
outcome does not depend on them, which the test checks too (several keys). The negative
control, a rule that counts every matching draft instead of the leading run, is told
apart by the same comparison. For trees the reference is `tree.accept`, over random trees
of both layouts (per-row parents as grown trees have; M chains whose tokens repeat, so
paths are shared), and the control accepts a candidate at any depth below the kept path.
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


def random_trees(seed: int, grown: bool, count: int = 9):
    """(tree.Tree, q [B, T, V] one-hot): a grown layout (every row its own parents,
    point-mass p) or M = 3 chains of 3 (dense p, tokens often repeated across chains);
    drafts equal to the target's argmax at their parent often, so paths run deep."""
    rng = np.random.default_rng(seed)
    t = rng.integers(0, V, (B, count + 1))  # the argmax at every node
    if grown:
        parent = np.stack([rng.integers(0, i + 1, B) for i in range(count)], axis=1)  # node i+1's: below it
        depth = np.zeros((B, count + 1), np.int64)
        for i in range(count):
            depth[:, i + 1] = depth[np.arange(B), parent[:, i]] + 1
        depth, lookahead = depth[:, 1:], count
    else:
        parent, depth = tree.chain_parents(3, count // 3)
        lookahead = count // 3
    above = t[np.arange(B)[:, None], parent] if grown else t[:, parent]
    x = np.where(rng.random((B, count)) < 0.6, above, rng.integers(0, V, (B, count)))
    if not grown:  # chains that repeat each other's tokens share a path
        x[:, 3:6] = np.where(rng.random((B, 1)) < 0.5, x[:, :3], x[:, 3:6])
    if grown:
        p = np.eye(V)[x]
    else:
        p = rng.dirichlet(np.full(V, 0.5), (B, count)) + 0.05 * np.eye(V)[x]
        p /= p.sum(-1, keepdims=True)
    drafted = rng.random((B, count)) < 0.9
    as_jax = (lambda a: jnp.asarray(a, jnp.int32)) if grown else (lambda a: a)
    nodes = tree.Tree(jnp.asarray(x, jnp.int32), jnp.asarray(p, jnp.float32), as_jax(parent), as_jax(depth),
                      jnp.asarray(drafted), jnp.zeros((B, count), jnp.int32), jnp.zeros((B, count), jnp.int32),
                      lookahead, 0 if grown else 3)
    return nodes, jnp.asarray(np.eye(V)[t], jnp.float32)


def any_depth_below(key, t, q):
    """Negative control: `tree.accept_greedy` without its depth test, so a sibling of a kept
    node that comes after it, equal to the argmax below, is kept as the next depth."""
    batch, count = t.x.shape
    top = first_max(q)
    alive = jnp.zeros((batch, count + 1), bool).at[:, 0].set(True)
    kept = jnp.zeros((batch, t.lookahead + 1), jnp.int32)
    path = jnp.zeros((batch, t.lookahead + 1), jnp.int32)
    n, at = jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), jnp.int32)
    for i in range(count):
        parent, depth = tree.node_column(t.parent, i), tree.node_column(t.depth, i)
        token = t.x[:, i]
        on = t.drafted[:, i] & tree.column(alive, parent)
        continues = on & (depth <= n) & (token == tree.column(kept, depth))
        ok = on & ~continues & (token == tree.column(top, at))
        kept, path = tree.put(kept, n + 1, token, ok), tree.put(path, n + 1, jnp.full_like(token, i + 1), ok)
        n, at = n + ok.astype(jnp.int32), jnp.where(ok, i + 1, at)
        alive = alive.at[:, i + 1].set(continues | ok)
    return n, tree.below(t, path, n), tree.column(top, at), jnp.zeros((batch,), bool)


@pytest.mark.parametrize("grown", [True, False], ids=["grown_tree", "three_chains"])
def test_greedy_tree_rule_decides_what_the_tree_rule_decides_at_temperature_0(grown):
    nodes, q = random_trees(3 if grown else 4, grown)
    n, path, token, empty = jax.jit(tree.accept_greedy)(jax.random.key(0), nodes, q)
    assert not np.asarray(empty).any()
    counts = np.bincount(np.asarray(n), minlength=4)
    assert (counts[:4] > 0).all(), counts  # kept paths of every length 0..3 are exercised
    for seed in range(3):  # the general rule's draws do not matter when q is one-hot
        want = jax.jit(tree.accept)(jax.random.key(seed), nodes, q)
        for got, expected, what in zip((n, path, token), want[:3], ("n", "path", "token")):
            assert np.array_equal(got, expected), (what, seed)
        assert not np.asarray(want[3]).any()
    wrong = jax.jit(any_depth_below)(None, nodes, q)
    assert not np.array_equal(wrong[0], want[0])  # the negative control is told apart


def test_chosen_rule():
    assert verify.chosen("block", 1, False, True) == "greedy"
    assert verify.chosen("tokenwise", 1, False, True) == "greedy"
    assert verify.chosen("block", 1, False, False) == "block"
    assert verify.chosen("tokenwise", 3, False, True) == "tree_greedy"  # several chains: the tree rule
    assert verify.chosen("block", 1, True, True) == "tree_greedy"  # a grown tree
    assert verify.chosen("block", 1, True, False) == "tree"
    assert verify.chosen("tokenwise", 3, False, False) == "tree"
    assert verify.select("block", 1, False, True) is verify.greedy
    assert verify.select("block", 1, True, True) is verify.several_greedy


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
