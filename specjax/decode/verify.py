"""Verification: which path of the proposal the target keeps, and the next token.

Every rule has one signature, `rule(key, nodes, q) -> (num_accepted [B], path [B, K+1],
next_token [B], empty [B])`: `nodes` is the loop's proposal as a `tree.Tree` (M chains or
a grown tree), q [B, T, V] the target's warped distributions at its T = 1 + N scored
nodes (for one chain: the pending token then x_1..x_K), path the kept path's nodes (node
0, the kept node at each depth, then the rest of the kept chain: `tree.accept`), empty a
row whose distribution for next_token had no mass (only when p or q was not one). Each
keeps the output distributed exactly as q (Theorem 1; invariant 10: several candidates
only by a published lossless rule):

  tokenwise  the paper's modified rejection sampling (Algorithm 2), token by token;
  block      block verification (Sun et al. 2025): the same outputs decided jointly,
             never fewer accepted tokens in expectation (one chain);
  greedy     what both chain rules do at temperature 0, from the target's argmaxes
             (`accept_greedy`);
  tree       SpecInfer's multi-round rule over a tree: M chains or a grown tree whose
             siblings are drawn without replacement (`tree.accept`).
  tree_greedy what `tree` does at temperature 0, from the target's argmaxes
             (`tree.accept_greedy`).

`select(name, num_drafts, grown, greedy)` is the one place a rule is chosen:
SamplingConfig.verify for one chain (greedy at temperature 0), the tree rule for several
or for a grown tree (tree_greedy at temperature 0).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.decode import tree
from specjax.decode.warping import first_max, sample


def acceptance_draws(key: jax.Array, shape) -> jax.Array:
    """The U[0, 1) draws that decide acceptance (Algorithm 2's r; block verification's eta)."""
    return jax.random.uniform(key, shape)


def drafted_mask(x: jax.Array, length: jax.Array | None) -> jax.Array:
    """[B, K] True at the proposed positions j < length (all K when length is None)."""
    if length is None:
        return jnp.ones(x.shape, bool)
    return jnp.arange(x.shape[1])[None, :] < length[:, None]


def resample(key: jax.Array, q: jax.Array, p: jax.Array, weight: jax.Array, n: jax.Array):
    """The token after n accepted drafts: a sample from norm(max(0, weight * q_{n+1} - p_{n+1})),
    with p = 0 past the proposed positions (so after a full accept it is the bonus q_{n+1}),
    and q_{n+1} itself when that has no mass. q [B, K+1, V], p [B, K, V] (masked), n [B].
    Returns (token [B], empty [B]: the distribution had no mass, only when q was not one)."""
    p_ext = jnp.concatenate([p, jnp.zeros_like(p[:, :1])], axis=1)
    q_n = jnp.take_along_axis(q, n[:, None, None], axis=1)[:, 0]
    p_n = jnp.take_along_axis(p_ext, n[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(weight[:, None] * q_n - p_n, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), q_n)  # q - p <= 0 everywhere: use q
    return sample(key, residual)


def accept(key: jax.Array, x: jax.Array, p: jax.Array, q: jax.Array, length: jax.Array | None = None):
    """Modified rejection sampling (Algorithm 2), token by token, vectorised over rows.

    x [B,K] proposed tokens, p [B,K,V] their distributions, q [B,K+1,V] target probs,
    length [B] proposed tokens per row (None: all K). Returns (num_accepted [B] in
    0..length, next_token [B], empty [B]): the residual sample at the first rejection, or
    the bonus sample from q_{length+1} when every proposed token was accepted; empty marks
    a row whose distribution for it had no mass (only when p or q was not one)."""
    batch, lookahead = x.shape
    drafted = drafted_mask(x, length)
    accept_key, resample_key = jax.random.split(key)
    p_x = jnp.take_along_axis(p, x[..., None], axis=-1)[..., 0]
    q_x = jnp.take_along_axis(q[:, :lookahead], x[..., None], axis=-1)[..., 0]
    u = acceptance_draws(accept_key, (batch, lookahead))
    accepted = (u * p_x < q_x) & drafted  # u < q/p without dividing; p_x > 0 as x was drawn from p
    num_accepted = jnp.sum(jnp.cumprod(accepted, axis=1), axis=1).astype(jnp.int32)
    p = jnp.where(drafted[..., None], p, 0.0)
    return (num_accepted, *resample(resample_key, q, p, jnp.ones((batch,), q.dtype), num_accepted))


def accept_block(key: jax.Array, x: jax.Array, p: jax.Array, q: jax.Array, length: jax.Array | None = None):
    """Block verification (Sun et al., "Block Verification Accelerates Speculative
    Decoding", ICLR 2025, arXiv 2403.10444, Algorithm 2): the proposed block is verified
    jointly. Same signature and meaning as `accept`; exact like it, and never fewer
    accepted tokens in expectation (optimal among verifiers that see only the block).

    With weights w_0 = 1, w_i = min(1, w_{i-1} q_i(x_i) / p_i(x_i)) and, for i < L,
    h_i = S_i / (S_i + 1 - w_i) where S_i = sum_x max(0, w_i q_{i+1}(x) - p_{i+1}(x)),
    and h_L = w_L (L = the row's length): draw eta_i ~ U(0, 1) and keep x_1..x_tau for
    the largest tau with eta_tau < h_tau (0 if none); the next token comes from
    norm(max(0, w_tau q_{tau+1} - p_{tau+1})), the bonus q_{L+1} when tau = L.
    (S_i = 0 gives h_i = 0: no residual mass there, so the block never stops there.)"""
    batch, lookahead = x.shape
    drafted = drafted_mask(x, length)
    size = jnp.full((batch,), lookahead, jnp.int32) if length is None else length
    accept_key, resample_key = jax.random.split(key)
    p = jnp.where(drafted[..., None], p, 0.0)
    p_x = jnp.take_along_axis(p, x[..., None], axis=-1)[..., 0]
    q_x = jnp.take_along_axis(q[:, :lookahead], x[..., None], axis=-1)[..., 0]
    ratio = jnp.where(drafted, q_x / jnp.where(drafted, p_x, 1.0), 0.0)  # p_x > 0: x was drawn from p
    weights = [jnp.ones((batch,), q.dtype)]
    for j in range(lookahead):
        weights.append(jnp.minimum(1.0, weights[-1] * ratio[:, j]))
    w = jnp.stack(weights, axis=1)  # [B, K+1]: w_0..w_K
    mass = jnp.sum(jnp.maximum(w[:, :lookahead, None] * q[:, :lookahead] - p, 0.0), axis=-1)  # S_0..S_{K-1}
    s_i, w_i = mass[:, 1:], w[:, 1:lookahead]  # i = 1..K-1
    h = jnp.where(s_i > 0, s_i / jnp.where(s_i > 0, s_i + 1.0 - w_i, 1.0), 0.0)
    i = jnp.arange(1, lookahead + 1)[None, :]
    h = jnp.concatenate([h, jnp.zeros((batch, 1), h.dtype)], axis=1)  # [B, K]: h_1..h_K
    h = jnp.where(i < size[:, None], h, jnp.where(i == size[:, None], w[:, 1:], 0.0))
    eta = acceptance_draws(accept_key, (batch, lookahead))
    tau = jnp.max(jnp.where(eta < h, i, 0), axis=1).astype(jnp.int32)
    weight = jnp.take_along_axis(w, tau[:, None], axis=1)[:, 0]
    return (tau, *resample(resample_key, q, p, weight, tau))


def accept_greedy(key: jax.Array, x: jax.Array, p: jax.Array, q: jax.Array, length: jax.Array | None = None):
    """Temperature 0, where each q_j is one-hot at the target's argmax t_j: what `accept`
    and `accept_block` decide there, for any p, read from the argmaxes alone (no
    vocabulary-wide residuals, cumulative sums or draws). Same signature and meaning.

    Tokenwise accepts x_j iff u p_j(x_j) < q_j(x_j), i.e. iff x_j = t_j, and its residual
    max(0, q_j - p_j) has all its mass, 1 - p_j(t_j) > 0, at t_j. Block: w_i stays 1 along
    the matches and is 0 from the first other draft m on, so h_{m-1} = 1 (S_{m-1} = 1 -
    p_m(t_m) > 0) and h_i = 0 for i >= m (S_i = 0), and tau = m - 1 (L, where h_L = w_L = 1,
    when all L match); the residual at tau is one-hot at t again. So both keep the leading
    drafts equal to t and emit t after them (the bonus t_{L+1} after all L)."""
    del key, p
    t = first_max(q)  # [B, K+1]: the one-hot rows' tokens
    match = (x == t[:, :x.shape[1]]) & drafted_mask(x, length)
    n = jnp.sum(jnp.cumprod(match, axis=1), axis=1).astype(jnp.int32)
    return n, jnp.take_along_axis(t, n[:, None], axis=1)[:, 0], jnp.zeros(n.shape, bool)


# --------------------------------------------------------------------------- the rules


def on_chain_zero(rule, key, nodes, q):
    """A rule over one chain x [B, K] (`accept`, `accept_block`) applied to a tree of one
    chain (M = 1), whose nodes in order are the chain: the kept path is its first n tokens."""
    length = jnp.sum(nodes.drafted, axis=1).astype(jnp.int32)
    n, token, empty = rule(key, nodes.x, nodes.p, q, length)
    return n, tree.single_chain_path(n, nodes.lookahead), token, empty


# `accept`, `accept_block`, `accept_greedy` and `tree.accept` are looked up when a loop is
# traced, so a test can swap a deliberately wrong rule in (the negative controls).
def tokenwise(key, nodes, q):
    return on_chain_zero(accept, key, nodes, q)


def block(key, nodes, q):
    return on_chain_zero(accept_block, key, nodes, q)


def greedy(key, nodes, q):
    return on_chain_zero(accept_greedy, key, nodes, q)


def several(key, nodes, q):
    """SpecInfer's multi-round rule over the tree (M chains, or a grown tree)."""
    return tree.accept(key, nodes, q)


def several_greedy(key, nodes, q):
    """The tree rule at temperature 0, read from the argmaxes (`tree.accept_greedy`)."""
    return tree.accept_greedy(key, nodes, q)


RULES = {"tokenwise": tokenwise, "block": block, "greedy": greedy, "tree": several, "tree_greedy": several_greedy}


def chosen(name: str, num_drafts: int, grown: bool = False, greedy: bool = False) -> str:
    """The rule a loop verifies with: for several chains or a grown tree 'tree', or
    'tree_greedy' at temperature 0 (what 'tree' does there); for one chain 'greedy' at
    temperature 0 (what both chain rules do there), else `name` (SamplingConfig.verify:
    'tokenwise' or 'block')."""
    if num_drafts > 1 or grown:
        return "tree_greedy" if greedy else "tree"
    return "greedy" if greedy else name


def select(name: str, num_drafts: int, grown: bool = False, greedy: bool = False):
    return RULES[chosen(name, num_drafts, grown, greedy)]
