"""A loop's draft tree: its layout (`Tree`), its visibility and its verification.

Node 0 is the row's pending token; nodes 1..N are the drafts. Each has a token, the
distribution it was drawn from, a parent (a node of lower index), a depth (its parent's
plus one: its position is the pending token's plus its depth), whether it was drafted
(undrafted nodes keep shapes static: they are scored, never accepted, nobody's parent),
the drafter that proposed it (`SOURCES`) and its branch (the chain it belongs to, for
statistics). Two proposals fill this one layout:

  M chains of K tokens (`of_chains`): chain m's depth-d token is node 1 + m*K + d - 1,
      its parent the node before it (node 0 at depth 1). Parents and depths are the same
      for every row and known when the loop is traced, so the visibility is one [T, T]
      mask; one chain (M = 1) is a tree of one, whose mask is the causal triangle.
  a grown tree (`growth.grow`, `--draft_tree=dynamic`): N nodes whose parents and depths
      differ per row: the visibility is [B, T, T].

For both, the target scores all T = 1 + N nodes in ONE pass with the ancestor mask as its
visibility (`model`'s `visible`: each node sees the cache and its own path),
`kv_cache.commit` writes the kept path's nodes (`accept`'s `path`), and `accept` verifies.

Verification (`accept`) is multi-round rejection sampling over each kept node's children
(Miao et al., "SpecInfer", arXiv 2305.09781, multi-step speculative sampling; Chen et al.,
"Sequoia", arXiv 2402.12374, for siblings drawn without replacement). With r the target's
distribution at the current kept node (the pending token's first), its drafted children
are tried in node order, each with the distribution p_i it was drawn from: candidate i is
accepted with probability min(1, r(x_i) / p_i(x_i)); on rejection r becomes
norm(max(0, r - p_i)) (r itself where that has no mass) and the next candidate is tried.
The first accepted child is the kept node at the next depth (r becomes q there); when no
candidate is accepted the next token is drawn from r (after a kept node without children:
the bonus token, q at that node). Each round is one step of the paper's modified
rejection sampling with target r, so each depth's token is distributed exactly as the
target's provided that, given everything before it, candidate i is distributed as p_i
(`growth`'s docstring proves that its construction keeps this). Both layouts do:
independent chains are draws from p at their parent (with replacement: the same token may
come twice, and a rejected token has r = 0 after it); siblings drawn without replacement
each carry p with the earlier siblings removed and renormalised. Chains that drew the
same tokens share a path: after a token is kept, every drafted node at that depth with
that token and a parent on the kept path is on it too (`alive`), and its children are
candidates at the next depth, after those of the nodes before it.

One pass over the nodes in index order is this walk: parents precede children, siblings
come in the order they were drawn, and a depth is settled by its first accepted
candidate, which precedes every other node that continues the kept path at that depth.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.decode.warping import first_max, sample


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tree:
    """The module docstring's layout for a batch of rows (nodes 1..N; node 0 is implicit)."""

    x: jax.Array  # [B, N] tokens
    p: jax.Array  # [B, N, V] the distribution each token was drawn from
    parent: Any  # [N] (every row's: static numpy for chains) or [B, N]: node index 0..N-1, below the node's own
    depth: Any  # [N] or [B, N]: 1..K
    drafted: jax.Array  # [B, N] bool
    source: jax.Array  # [B, N] drafters.SOURCES index
    branch: jax.Array  # [B, N] the chain (M chains); 0 in a grown tree
    lookahead: int = dataclasses.field(metadata=dict(static=True))  # K: the greatest depth
    num_chains: int = dataclasses.field(default=0, metadata=dict(static=True))  # M for chains, 0 for a grown tree

    @property
    def static(self) -> bool:
        """Whether parents and depths are every row's and known at trace time (chains)."""
        return isinstance(self.parent, np.ndarray)

    @property
    def single_chain(self) -> bool:
        """One chain: its nodes in order are the chain, and the kept path is a prefix of them."""
        return self.num_chains == 1


def chain_parents(num_drafts: int, lookahead: int) -> tuple[np.ndarray, np.ndarray]:
    """([N] parents, [N] depths) of M chains of K tokens, nodes 1..N = M*K."""
    j = np.arange(num_drafts * lookahead)
    depth = j % lookahead + 1
    return np.where(depth == 1, 0, j).astype(np.int32), depth.astype(np.int32)


def of_chains(chains, lookahead: int) -> Tree:
    """A drafter's M chains (`drafters.Proposal`, fields [B, M, ...]) as the tree layout."""
    batch, drafts = chains.x.shape[:2]
    parent, depth = chain_parents(drafts, lookahead)
    flat = lambda a: a.reshape((batch, drafts * lookahead) + a.shape[3:])  # noqa: E731
    per_node = lambda a: jnp.repeat(a, lookahead, axis=1)  # noqa: E731  [B, M] -> [B, M*K]
    drafted = (depth[None, :] <= per_node(chains.length)).astype(bool)
    branch = jnp.broadcast_to(jnp.repeat(jnp.arange(drafts, dtype=jnp.int32), lookahead), (batch, drafts * lookahead))
    return Tree(flat(chains.x), flat(chains.p), parent, depth, drafted, per_node(chains.source), branch, lookahead,
                drafts)


def depths(t: Tree):
    """[T] (static) or [B, T]: every node's depth, 0 for the pending token."""
    if t.static:
        return np.concatenate([[0], t.depth]).astype(np.int32)
    return jnp.concatenate([jnp.zeros_like(t.depth[:, :1]), t.depth], axis=1)


def ancestors(parent) -> np.ndarray | jax.Array:
    """[T, T] from parents [N] (numpy), or [B, T, T] from [B, N]: True where node u is node
    t or one of its ancestors (node 0 is everyone's)."""
    if isinstance(parent, np.ndarray) and parent.ndim == 1:
        a = np.eye(len(parent) + 1, dtype=bool)
        for i, par in enumerate(parent):
            a[i + 1] |= a[par]
        return a
    batch, count = parent.shape  # (a traced [N], as in a jitted test, is broadcast by `visibility`)
    a = jnp.broadcast_to(jnp.eye(count + 1, dtype=bool), (batch, count + 1, count + 1))
    for i in range(count):
        a = a.at[:, i + 1].set(a[:, i + 1] | column(a, parent[:, i]))
    return a


def visibility(t: Tree):
    """The target pass's `visible`: the ancestor mask over all T nodes."""
    return ancestors(t.parent if t.static or t.parent.ndim == 2 else jnp.broadcast_to(t.parent, t.x.shape))


def column(a: jax.Array, index) -> jax.Array:
    """a[b, index[b]] for every row (index a Python/numpy int: the same column for all)."""
    if isinstance(index, (int, np.integer)):
        return a[:, int(index)]
    index = jnp.broadcast_to(index, a.shape[:1])
    return jnp.take_along_axis(a, index.reshape(index.shape + (1,) * (a.ndim - 1)), axis=1)[:, 0]


def put(a: jax.Array, index, value: jax.Array, where: jax.Array) -> jax.Array:
    """a[b, index[b]] = value[b] where where[b] (a [B, C] array; index as in `column`)."""
    if isinstance(index, (int, np.integer)):
        return a.at[:, int(index)].set(jnp.where(where, value, a[:, int(index)]))
    index = jnp.broadcast_to(index, a.shape[:1])
    hit = where[:, None] & (jnp.arange(a.shape[1])[None, :] == index[:, None])
    return jnp.where(hit, value[:, None], a)


def node_column(a, i: int):
    """Node i+1's entry of a per-node field ([N] shared or [B, N] per row)."""
    return a[i] if a.ndim == 1 else a[:, i]


def take_node(q: jax.Array, index: jax.Array) -> jax.Array:
    """q [B, T, V] at one node per row -> [B, V]."""
    return jnp.take_along_axis(q, index[:, None, None], axis=1)[:, 0]


def walk(t: Tree, decide, carry):
    """The walk over the nodes in index order that both rules share: which drafted nodes are
    candidates (children of the kept path's last node, at the next depth) or copies of a
    kept node (`alive`), and the kept path. `decide(i, candidate [B], token [B], carry) ->
    (ok [B], carry)` accepts or rejects node i+1 where it is a candidate. Returns (n [B],
    path [B, K+1] as `accept`'s, carry)."""
    batch, count = t.x.shape
    K = t.lookahead
    alive = jnp.zeros((batch, count + 1), bool).at[:, 0].set(True)  # nodes on the kept path
    kept = jnp.zeros((batch, K + 1), jnp.int32)  # the kept token at each depth
    path = jnp.zeros((batch, K + 1), jnp.int32)
    n = jnp.zeros((batch,), jnp.int32)
    for i in range(count):
        parent, depth = node_column(t.parent, i), node_column(t.depth, i)
        token = t.x[:, i]
        on = t.drafted[:, i] & column(alive, parent)
        continues = on & (depth <= n) & (token == column(kept, depth))  # a copy of the kept path's node there
        ok, carry = decide(i, on & (depth == n + 1), token, carry)
        kept, path = put(kept, depth, token, ok), put(path, depth, jnp.full_like(token, i + 1), ok)
        n = n + ok.astype(jnp.int32)
        alive = alive.at[:, i + 1].set(continues | ok)
    return n, below(t, path, n), carry


def accept(key: jax.Array, t: Tree, q: jax.Array):
    """Multi-round rejection sampling over the tree (the module docstring), vectorised over
    rows. q [B, T, V]: the target's distribution at every node. Returns (n [B] kept
    tokens, path [B, K+1]: the kept path's nodes (node 0, then the kept node at each depth
    1..n, then below the last kept node its first drafted child at each further depth, 0
    where there is none), next_token [B], empty [B]: its distribution had no mass)."""
    accept_key, sample_key = jax.random.split(key)
    u = jax.random.uniform(accept_key, t.x.shape)

    def decide(i, candidate, token, r):  # r: the current residual
        p_i = t.p[:, i]
        p_t = jnp.take_along_axis(p_i, token[:, None], axis=1)[:, 0]
        r_t = jnp.take_along_axis(r, token[:, None], axis=1)[:, 0]
        ok = candidate & (u[:, i] * p_t < r_t)  # u < r/p without dividing; p_t > 0 as the token was drawn from p_i
        residual = jnp.maximum(r - p_i, 0.0)
        mass = jnp.sum(residual, axis=-1, keepdims=True)
        residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), r)  # r <= p everywhere: keep r
        return ok, jnp.where(ok[:, None], q[:, i + 1], jnp.where((candidate & ~ok)[:, None], residual, r))

    n, path, r = walk(t, decide, q[:, 0])
    next_token, empty = sample(sample_key, r)
    return n, path, next_token, empty


def accept_greedy(key: jax.Array, t: Tree, q: jax.Array):
    """Temperature 0, where each q row is one-hot at the target's argmax: what `accept`
    decides there, for any p, read from the argmaxes alone (no vocabulary-wide residuals
    or draws). Same signature and meaning.

    With r one-hot at the kept node's argmax a, a candidate is accepted iff u p_i(x_i) <
    r(x_i), i.e. iff x_i = a (p_i(x_i) > 0 and u < 1); a rejected one leaves r one-hot at
    a (max(0, r - p_i) has mass 1 - p_i(a) > 0 there only: p_i(a) = 1 would have drawn
    x_i = a). So the walk keeps, depth by depth, the first candidate equal to the argmax at
    the node before it, and emits that node's argmax after the last kept one."""
    del key
    top = first_max(q)  # [B, T]: the argmax at every node

    def decide(i, candidate, token, at):  # at: the last kept node
        ok = candidate & (token == column(top, at))
        return ok, jnp.where(ok, i + 1, at)

    n, path, at = walk(t, decide, jnp.zeros(t.x.shape[:1], jnp.int32))
    return n, path, column(top, at), jnp.zeros(t.x.shape[:1], bool)


def first_children(t: Tree) -> jax.Array:
    """[B, N+1]: each node's first drafted child (0: none)."""
    batch, count = t.x.shape
    first = jnp.zeros((batch, count + 1), jnp.int32)
    for i in reversed(range(count)):  # the lowest index wins
        first = put(first, node_column(t.parent, i), jnp.full((batch,), i + 1, jnp.int32), t.drafted[:, i])
    return first


def below(t: Tree, path: jax.Array, n: jax.Array) -> jax.Array:
    """`path` past depth n continued by first drafted children (the rest of the kept
    chain, for chains): what the loop reports as the proposal along the kept path."""
    first = first_children(t)
    for d in range(1, t.lookahead + 1):
        path = path.at[:, d].set(jnp.where(d > n, column(first, path[:, d - 1]), path[:, d]))
    return path


def along(t: Tree, path: jax.Array, a: jax.Array) -> jax.Array:
    """A per-node field a [B, N, ...] at the path's nodes 1..K -> [B, K, ...] (node 0's
    entries, where the path ends early, read node 1's)."""
    index = jnp.maximum(path[:, 1:] - 1, 0)
    return jnp.take_along_axis(a, index.reshape(index.shape + (1,) * (a.ndim - 2)), axis=1)


def reach(t: Tree, path: jax.Array) -> jax.Array:
    """[B] how many nodes the path holds below node 0 (drafted, from depth 1 on)."""
    on = (path[:, 1:] > 0) & along(t, path, t.drafted)
    return jnp.sum(jnp.cumprod(on, axis=1), axis=1).astype(jnp.int32)


def single_chain_path(n: jax.Array, lookahead: int) -> jax.Array:
    """One chain's path: its nodes in order, whatever was kept."""
    return jnp.broadcast_to(jnp.arange(lookahead + 1, dtype=jnp.int32), (n.shape[0], lookahead + 1))
