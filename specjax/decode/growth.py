"""Dynamic draft trees (`--draft_tree=dynamic --tree_nodes=N`): a tree of N draft nodes at
most K deep, grown where the drafter is confident, in one fixed-shape program per N.

Growth (`grow`). The drafter's first call (`Drafter.expand` on the root, node 0: the row's
pending token) gives p_0, the draft's warped distribution after the context; node 0 is
then *open*. Rounds r = 1..R (R = min(K, N)) add W_r nodes each (`round_widths`, static;
they sum to N), one pick at a time. A pick scores the next child slot of every open node
v by s(v) = P(v) * m(v): P(v) is the product of the draft probabilities along v's path (1
at the root), m(v) the draft mass of the tokens not yet among v's children. It takes the
open node of greatest positive score (the lowest index on ties) and draws the new child's
token from p_v without v's earlier children, renormalised; that distribution is the node's
p, which verification reads. At temperature 0 the child is the draft's most likely
remaining token (plain softmax: the tree holds the draft's top tokens) and p is its point
mass. Where no open node has positive score (top-k or top-p supports used up) the slot
stays undrafted. After a round (but the last) one `expand` call over its W_r nodes, a draft
forward with the tree's visibility in the draft's own attention, gives their distributions
and opens them. So a row's tree deepens along confident paths and widens where the draft
is unsure, the draft runs R forwards of W_r rows (the root call re-feeds its window), and
every shape is fixed by N and K.

Exactness at every temperature. The property that matters, (A): whether a node is created,
and as whose child, is decided before its own token is drawn, from tokens drawn before it
(P(v) reads v's path, m(v) v's earlier children); the token is then drawn from p_v without
v's earlier children. So given everything drawn before it, v's i-th child c_i is
distributed as p_{v,i} = p_v with c_1..c_{i-1} removed and renormalised: exactly the p it
carries. (Later decisions may read c_i: it is an earlier sibling or an ancestor of every
node created after it, or in another branch.)

Theorem. With (A), `tree.accept` (multi-round rejection sampling over siblings drawn
without replacement: SpecInfer, Miao et al. arXiv 2305.09781; Sequoia, Chen et al. arXiv
2402.12374) emits tokens distributed exactly as the target's.
Proof. Let the walk stand at a kept node v, having read H (tokens, which nodes exist,
uniforms), with r_1 = q_v. Claim, by backward induction on i: given H and the rejections
of c_1..c_{i-1}, the token emitted after v is distributed as r_i, where r_{i+1} =
norm(max(0, r_i - p_{v,i})). Without an i-th child it is a draw from r_i. Otherwise, by
(A), c_i given H, c_{<i} and the decision to create it is p_{v,i}-distributed: that
decision read only earlier draws and draws in other branches, which given v's path are
independent of c_i, as are the verifier's uniforms. So step i is the paper's modified
rejection sampling with proposal p_{v,i} and target r_i: it emits x with probability
min(p_{v,i}(x), r_i(x)) and rejects with probability sum_x max(0, r_i(x) - p_{v,i}(x)),
after which the emitted token is (induction) r_{i+1}-distributed whatever c_i was, as
r_{i+1} does not depend on it: min(p_{v,i}, r_i) + max(0, r_i - p_{v,i}) = r_i (Theorem 1).
At i = 1 the token after v is q_v-distributed. If it is an accepted child x, the walk
goes on at x with q_x: the walk has read nothing in x's subtree, whose nodes were each
created under (A) again, so the same argument holds there; after a kept node without
children the bonus token is a draw from q at it. By induction over depth every emitted
token has the target's conditional distribution. QED.

What (A) forbids is a decision that reads a node's own token: EAGLE-2's reranking ("draw
children, keep those whose path probability, their own token's included, ranks in the top
N") keeps a child more often when its token is likely, so given that it exists it is not
p-distributed. With r = p = uniform{a, b} and a child kept only if it is a, P(a) = 1/2 +
1/2 * 1/2 = 3/4. The Theorem-1 test rejects that construction (tests/decode/
test_growth_theorem1.py). Invariant 9 holds: growth reads only the draft's side. At
temperature 0 a child is accepted iff it is the target's argmax: the kept path is the
longest path of target argmaxes in the tree, and the output is greedy ArS's token for token.

The drafter's part is one method, `Drafter.expand` (drafters/base.py): the next-token
logits after each node of a round, given its path.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.decode import tree
from specjax.decode.drafters.base import SOURCES, Drafter, Expansion
from specjax.decode.state import gather_rows
from specjax.decode.warping import Warp, sample, warp


def round_widths(num_nodes: int, lookahead: int) -> list[int]:
    """New nodes per round: N over min(K, N) rounds as evenly as possible, wider first."""
    rounds = min(num_nodes, lookahead)
    base, extra = divmod(num_nodes, rounds)
    return [base + (r < extra) for r in range(rounds)]


def ranked(logits: jax.Array, warping: Warp) -> tuple[jax.Array, jax.Array]:
    """(the distribution children are drawn from and scored by, bad): the warped one, or
    at temperature 0 the plain softmax (greedy's point mass would rank nothing)."""
    if warping.greedy:
        return warp(logits, warping._replace(temperature=1.0, top_k=0, top_p=1.0))
    return warp(logits, warping)


def next_child(key: jax.Array, left: jax.Array, mass: jax.Array, weight: jax.Array, open_: jax.Array,
               greedy: bool):
    """One pick (the module docstring): the open node v of greatest s(v) = P(v) m(v), and its
    next child's token c, drawn from `left` at v (v's distribution without its children so
    far; the most likely there at temperature 0). left [B, N+1, V'], mass, weight, open_
    [B, N+1] -> (v, c, ok: a slot was drafted, empty: c's distribution had no mass), [B]."""
    score = jnp.where(open_ & (mass > 0), weight * mass, -1.0)
    v = jnp.argmax(score, axis=1).astype(jnp.int32)
    row = left[jnp.arange(left.shape[0]), v]
    if greedy:
        return v, jnp.argmax(row, axis=-1).astype(jnp.int32), jnp.max(score, axis=1) > 0, jnp.zeros(v.shape, bool)
    c, empty = sample(key, row)
    return v, c, jnp.max(score, axis=1) > 0, empty


def grow(drafter: Drafter, state, tokens: jax.Array, length: jax.Array, key: jax.Array, lookahead: int,
         num_nodes: int, warping: Warp, vocab_size: int):
    """The module docstring's tree after each row's context tokens[b, :length[b]] ->
    (tree.Tree of N nodes, the drafter's state, nonfinite [B]: a draft distribution was
    not one)."""
    batch, N = tokens.shape[0], num_nodes
    ids = drafter.draft_vocab
    spread = (lambda a: a) if ids is None else (
        lambda a: jnp.zeros(a.shape[:-1] + (vocab_size,), a.dtype).at[..., ids].set(a))
    token_of = (lambda i: i) if ids is None else (lambda i: jnp.take(ids, i))
    root = Expansion(0, gather_rows(tokens, length - 1)[:, None], jnp.zeros((batch, 1), jnp.int32),
                     jnp.zeros((batch, 1), jnp.int32), jnp.zeros((batch, 1, N), bool), N)
    logits, state, carry = drafter.expand(state, None, tokens, length, root)
    probs, bad = ranked(logits[:, 0], warping)
    rows = jnp.arange(batch)
    # Per node (0..N): what is left of its distribution for further children, that mass, its
    # path probability P, whether it is open, its depth and its ancestors among nodes 1..N.
    left = jnp.zeros((batch, N + 1, probs.shape[-1]), jnp.float32).at[:, 0].set(probs)
    mass = jnp.zeros((batch, N + 1), jnp.float32).at[:, 0].set(jnp.sum(probs, axis=-1))
    weight = jnp.zeros((batch, N + 1), jnp.float32).at[:, 0].set(1.0)
    open_ = jnp.zeros((batch, N + 1), bool).at[:, 0].set(True)
    depth = jnp.zeros((batch, N + 1), jnp.int32)
    above = jnp.zeros((batch, N + 1, N), bool)
    x = jnp.zeros((batch, N), jnp.int32)
    p = jnp.zeros((batch, N, vocab_size), jnp.float32)
    parent = jnp.zeros((batch, N), jnp.int32)
    drafted = jnp.zeros((batch, N), bool)
    keys = jax.random.split(key, N)
    first = 0
    widths = round_widths(N, lookahead)
    for r, width in enumerate(widths):
        for i in range(first + 1, first + width + 1):  # node i
            v, c, ok, empty = next_child(keys[i - 1], left, mass, weight, open_, warping.greedy)
            row = left[rows, v]  # [B, V']: v's distribution without its children so far
            if warping.greedy:  # a deterministic choice: its point mass
                p_i = jax.nn.one_hot(c, row.shape[-1], dtype=jnp.float32)
            else:  # p_v without v's earlier children, renormalised (an undrafted slot's: never read)
                total = jnp.sum(row, axis=-1, keepdims=True)
                p_i = row / jnp.where(total > 0, total, 1.0)
            bad = bad | (empty & ok)
            weight = weight.at[:, i].set(weight[rows, v] * jnp.take_along_axis(row, c[:, None], axis=1)[:, 0])
            row = jnp.where((jnp.arange(row.shape[-1])[None, :] == c[:, None]) & ok[:, None], 0.0, row)
            left = left.at[rows, v].set(row)
            mass = mass.at[rows, v].set(jnp.where(ok, jnp.sum(row, axis=-1), mass[rows, v]))
            x = x.at[:, i - 1].set(token_of(c))
            p = p.at[:, i - 1].set(spread(p_i))
            parent = parent.at[:, i - 1].set(v)
            drafted = drafted.at[:, i - 1].set(ok)
            depth = depth.at[:, i].set(depth[rows, v] + 1)
            above = above.at[:, i].set(above[rows, v] | (jnp.arange(1, N + 1)[None, :] == v[:, None]))
        if r + 1 < len(widths):  # the last round's nodes get no children: no forward for them
            new = slice(first + 1, first + width + 1)
            nodes = Expansion(first + 1, x[:, first:first + width], parent[:, first:first + width], depth[:, new],
                              above[:, new], N)
            logits, state, carry = drafter.expand(state, carry, tokens, length, nodes)
            probs, bad_new = ranked(logits, warping)
            made = drafted[:, first:first + width]
            bad = bad | jnp.any(bad_new & made, axis=1)
            left = left.at[:, new].set(probs)
            mass = mass.at[:, new].set(jnp.sum(probs, axis=-1))
            open_ = open_.at[:, new].set(made)
        first += width
    source = jnp.full((batch, N), SOURCES.index(drafter.name), jnp.int32)
    nodes = tree.Tree(x, p, parent, depth[:, 1:], drafted, source, jnp.zeros((batch, N), jnp.int32), lookahead)
    return nodes, state, bad
