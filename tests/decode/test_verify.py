"""The verifiers alone, over whole blocks: losslessness at every one of K = 5 positions.

The Theorem-1 tests run the loop end to end but see only 3 output tokens. Here the rules
the loop selects (`verify.select`, one chain) are checked alone, and the
models are tables: a draft p and a target q over V = 4 tokens for every prefix of up to
5 tokens (random, context dependent, some draft entries exactly 0). A block of K = 5 is
proposed (sampled from p; or a point mass chosen from the prefix, as a lookup does; or
cut short after a token whose own p is below 0.35, a draft-side stopping rule like the
adaptive length's), the verifier keeps
a prefix and draws one token, and the target itself (sampled from q) completes the
sequence to K+1 tokens. A lossless verifier makes those K+1 tokens follow q's exact joint
over all 4^6 sequences. Chi-square at ALPHA = 0.001 with N = 200,000 blocks per case
(cells expected below 5 pooled); each case's negative control is rejected by the same
test.
"""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as scipy_stats

from specjax.decode import tree, verify
from specjax.decode.drafters import Proposal

ALPHA = 1e-3
N = 200_000
V, K = 4, 5


def node(prefix) -> int:
    """Index of a prefix among all prefixes, shortest first (base-V with a length offset)."""
    return sum(V ** m for m in range(len(prefix))) + sum(t * V ** i for i, t in enumerate(reversed(prefix)))


@pytest.fixture(scope="module")
def tables():
    rng = np.random.default_rng(0)
    nodes = sum(V ** m for m in range(K + 1))
    q = rng.dirichlet(np.full(V, 0.7), nodes)
    p = 0.5 * q + 0.5 * rng.dirichlet(np.full(V, 0.7), nodes)  # like q, not equal
    p[rng.random(nodes) < 0.3, 0] = 0.0  # some tokens the draft never proposes
    return p / p.sum(1, keepdims=True), q


def exact_joint(q) -> np.ndarray:
    joint = np.zeros([V] * (K + 1))
    for seq in itertools.product(range(V), repeat=K + 1):
        joint[seq] = np.prod([q[node(seq[:i]), seq[i]] for i in range(K + 1)])
    return joint


def sample_rows(rng, dist):
    """One draw per row of `dist` [N, V]."""
    return (rng.random((len(dist), 1)) > np.cumsum(dist, 1)).sum(1).clip(0, V - 1)


def run(tables, verifier, proposal: str, seed: int = 0):
    p_table, q_table = tables
    rng = np.random.default_rng(seed)
    ids = np.zeros(N, np.int64)  # the node of each row's prefix
    x = np.zeros((N, K), np.int64)
    p = np.zeros((N, K, V), np.float32)
    q = np.zeros((N, K + 1, V), np.float32)
    length = np.full(N, K)
    for j in range(K + 1):
        q[:, j] = q_table[ids]
        if j == K:
            break
        if proposal == "point":  # a deterministic choice from the prefix: a lookup's point mass
            x[:, j] = (ids * 7 + j) % V
            p[:, j] = np.eye(V)[x[:, j]]
        else:
            p[:, j] = p_table[ids]
            x[:, j] = sample_rows(rng, p_table[ids])
        if proposal == "adaptive":  # the draft stops after a token it was unsure of (its own p only)
            length = np.where((length == K) & (p[np.arange(N), j, x[:, j]] < 0.35), j + 1, length)
        ids = ids * V + 1 + x[:, j]  # node of prefix + x_j (children of node i: V*i + 1 + t)
    n, token, _ = jax.jit(verifier)(jax.random.key(seed), jnp.asarray(x, jnp.int32), jnp.asarray(p),
                                    jnp.asarray(q), jnp.asarray(length, jnp.int32))
    n, token = np.asarray(n), np.asarray(token)
    assert (n <= length).all()
    seqs = np.zeros((N, K + 1), np.int64)
    cur = np.zeros(N, np.int64)
    for i in range(K + 1):  # kept drafts, the verifier's token, then the target's own samples
        t = np.where(i < n, x[:, min(i, K - 1)], np.where(i == n, token, sample_rows(rng, q_table[cur])))
        seqs[:, i] = t
        cur = cur * V + 1 + t
    observed = np.bincount(np.ravel_multi_index(seqs.T, [V] * (K + 1)), minlength=V ** (K + 1))
    expected = exact_joint(q_table).ravel() * N
    big = expected >= 5
    o, e = np.append(observed[big], observed[~big].sum()), np.append(expected[big], expected[~big].sum())
    return float(scipy_stats.chi2.sf(np.sum((o - e) ** 2 / e), len(o) - 1)), n.mean()


def test_node_numbering_is_what_run_uses():
    assert node(()) == 0 and node((2,)) == 3 and node((1, 3)) == 1 + V + (1 * V + 3)
    for prefix in itertools.product(range(V), repeat=3):
        i = 0
        for t in prefix:
            i = i * V + 1 + t
        assert i == node(prefix)


def one_chain(rule: str):
    """The loop's rule for one chain (`verify.select`), called as a rule over x [B, K]."""
    def verifier(key, x, p, q, length):
        batch = x.shape[0]
        chains = Proposal(x[:, None], p[:, None], length[:, None], jnp.zeros((batch, 1), jnp.int32))
        n, path, token, empty = verify.select(rule, 1)(key, tree.of_chains(chains, x.shape[1]), q)
        return n, token, empty
    return verifier


@pytest.mark.parametrize("proposal", ["sampled", "point", "adaptive"])
@pytest.mark.parametrize("rule", ["tokenwise", "block"])
def test_verifier_is_lossless_over_the_whole_block(tables, rule, proposal):
    pvalue, kept = run(tables, one_chain(rule), proposal)
    print(f"{rule}, {proposal}: p = {pvalue:.4f}, mean accepted {kept:.3f}")
    assert pvalue > ALPHA


def test_block_keeps_more_than_tokenwise_in_expectation(tables):
    """Optimality, seen in the mean accepted count (same blocks: one seed for both)."""
    _, tokenwise = run(tables, verify.accept, "sampled")
    _, block = run(tables, verify.accept_block, "sampled")
    assert block > tokenwise


def block_with_tokenwise_residual(key, x, p, q, length):
    tau, _, _ = verify.accept_block(key, x, p, q, length)
    p = jnp.where(verify.drafted_mask(x, length)[..., None], p, 0.0)
    return tau, *verify.resample(jax.random.fold_in(key, 1), q, p, jnp.ones(x.shape[:1]), tau)


def tokenwise_peeking_stop(key, x, p, q, length):
    """A stopping rule that drops the first draft token the target finds unlikely."""
    q_x = jnp.take_along_axis(q[:, :K], x[..., None], axis=-1)[..., 0]
    keep = jnp.sum(jnp.cumprod(q_x >= 0.2, axis=1), axis=1).astype(jnp.int32)
    return verify.accept(key, x, p, q, jnp.minimum(length, keep))


@pytest.mark.parametrize("wrong", [block_with_tokenwise_residual, tokenwise_peeking_stop])
def test_negative_control_wrong_verifier_is_rejected(tables, wrong):
    pvalue, _ = run(tables, wrong, "sampled")
    print(f"{wrong.__name__}: p = {pvalue:.2e}")
    assert pvalue < ALPHA
