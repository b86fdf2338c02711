"""The draft chains of a loop as one tree: its layout and the multi-draft rule.

A loop's tree has T = 1 + M*K nodes: node 0 is the row's pending token, and chain m's
depth-d token (d = 1..K) is node 1 + m*K + d - 1. Every chain hangs off node 0 on its own
branch; a node's position is the pending token's plus its depth, so nodes of different
chains share positions, and the target scores them all in ONE pass with the ancestor
mask as its visibility (`model`'s `visible`), each node seeing the cache and its own
path. One chain (M = 1) is a tree of one: its ancestor mask is the causal triangle.

Verification (`accept`) walks the tree level by level with multi-round rejection
sampling over the candidates at each level (Miao et al., "SpecInfer", arXiv 2305.09781,
multi-step speculative sampling; for candidates from different proposals, e.g. a lookup's
point mass next to the draft model's chains, the same rule with each candidate's own
proposal p_j): with r the target's distribution
at the current node, candidate j is accepted with probability min(1, r(x_j) / p_j(x_j));
on rejection r becomes norm(max(0, r - p_j)) and the next candidate is tried; if every
candidate is rejected the token comes from the last r. Each round is one step of the
paper's modified rejection sampling with target r, so the level's token is distributed
exactly as the target's when the candidates are independent given the path (the chains
are drawn independently; a lookup is a function of the context). After a token is kept,
the candidates of the next level are the next tokens of every chain whose path so far
is the kept path (chains that drew the same tokens share it), each still a fresh,
independent draw given that path; with one such chain left it is the paper's rule.
"""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp

from specjax.decode.warping import sample


def depths(num_drafts: int, lookahead: int) -> np.ndarray:
    """[T] each node's depth: 0 for the pending token, then 1..K for every chain."""
    return np.concatenate([[0], np.tile(np.arange(1, lookahead + 1), num_drafts)]).astype(np.int32)


def ancestors(num_drafts: int, lookahead: int) -> np.ndarray:
    """[T, T] True where node u is node t or one of its ancestors."""
    chain = np.concatenate([[-1], np.repeat(np.arange(num_drafts), lookahead)])
    depth = depths(num_drafts, lookahead)
    same_branch = (chain[:, None] == chain[None, :]) | (chain[None, :] == -1)
    return same_branch & (depth[None, :] <= depth[:, None])


def node(chain: jax.Array, depth: int, lookahead: int) -> jax.Array:
    """The tree index of `chain`'s node at `depth` (0: the pending token)."""
    return jnp.where(depth == 0, 0, 1 + chain * lookahead + depth - 1)


def path_nodes(chain: jax.Array, lookahead: int) -> jax.Array:
    """[B, K+1]: the pending token's node, then `chain`'s K nodes."""
    return jnp.concatenate([jnp.zeros_like(chain)[:, None],
                            1 + chain[:, None] * lookahead + jnp.arange(lookahead)[None, :]], axis=1)


def take_node(q: jax.Array, index: jax.Array) -> jax.Array:
    """q [B, T, V] at one node per row -> [B, V]."""
    return jnp.take_along_axis(q, index[:, None, None], axis=1)[:, 0]


def accept(key: jax.Array, x: jax.Array, p: jax.Array, q: jax.Array, length: jax.Array):
    """Multi-draft verification, vectorised over rows (see the module docstring).

    x [B, M, K] the chains' tokens, p [B, M, K, V] the distributions they were drawn from,
    q [B, T, V] the target's distribution at every tree node, length [B, M] tokens per
    chain. Returns (n [B] kept tokens, picks [B, K]: the chain whose token was kept at
    each depth, -1 past n; next_token [B]; empty [B]: its distribution had no mass).
    The kept path is chain picks[n-1]'s first n tokens (equal to every chain picked)."""
    batch, drafts, lookahead = x.shape
    accept_key, sample_key = jax.random.split(key)
    u = jax.random.uniform(accept_key, (batch, lookahead, drafts))
    alive = length > 0  # [B, M]: chains whose path so far is the kept path
    chain = jnp.zeros((batch,), jnp.int32)
    stopped = jnp.zeros((batch,), bool)
    final = q[:, 0]
    n = jnp.zeros((batch,), jnp.int32)
    picks = []
    for d in range(lookahead):
        r = take_node(q, node(chain, d, lookahead))
        found = jnp.zeros((batch,), bool)
        token = jnp.zeros((batch,), jnp.int32)
        pick = jnp.full((batch,), -1, jnp.int32)
        for m in range(drafts):
            candidate = alive[:, m] & (length[:, m] > d) & ~found & ~stopped
            t, p_m = x[:, m, d], p[:, m, d]
            p_t = jnp.take_along_axis(p_m, t[:, None], axis=1)[:, 0]
            r_t = jnp.take_along_axis(r, t[:, None], axis=1)[:, 0]
            ok = candidate & (u[:, d, m] * p_t < r_t)  # u < r/p without dividing; p_t > 0 as t was drawn from p
            token, pick, found = jnp.where(ok, t, token), jnp.where(ok, m, pick), found | ok
            residual = jnp.maximum(r - p_m, 0.0)
            mass = jnp.sum(residual, axis=-1, keepdims=True)
            residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), r)  # r <= p everywhere: keep r
            r = jnp.where((candidate & ~ok)[:, None], residual, r)
        stop = ~stopped & ~found  # no candidate kept here (or none left): the token comes from r
        final = jnp.where(stop[:, None], r, final)
        stopped = stopped | stop
        n = n + found.astype(jnp.int32)
        chain = jnp.where(found, pick, chain)
        alive = alive & found[:, None] & (length > d) & (x[:, :, d] == token[:, None])
        picks.append(pick)
    bonus = take_node(q, node(chain, lookahead, lookahead))  # every depth kept: q at the last node
    final = jnp.where(stopped[:, None], final, bonus)
    next_token, empty = sample(sample_key, final)
    return n, jnp.stack(picks, axis=1), next_token, empty


def winner(picks: jax.Array, n: jax.Array) -> jax.Array:
    """[B] the chain that holds the kept path: picks at depth n (0 when nothing was kept)."""
    last = jnp.take_along_axis(picks, jnp.maximum(n - 1, 0)[:, None], axis=1)[:, 0]
    return jnp.where(n > 0, last, 0)


def kept(picks: jax.Array, n: jax.Array, num_drafts: int, lookahead: int) -> tuple[jax.Array, jax.Array | None]:
    """(the kept chain [B], its path's nodes [B, K+1]: the pending token, then the chain's
    K nodes). A tree of one chain keeps chain 0, whose nodes are all of them in order
    (None: nothing to gather)."""
    if num_drafts == 1:
        return jnp.zeros_like(n), None
    chain = winner(picks, n)
    return chain, path_nodes(chain, lookahead)
