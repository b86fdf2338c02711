"""Dynamic draft trees (`--draft_tree=dynamic --tree_nodes=N`): a tree of N draft nodes at
most K deep, grown where the drafter is confident, in one fixed-shape program per N.

Growth (`grow`). The drafter's first call (`Drafter.expand` on the root, node 0: the row's
pending token) gives p_0, the draft's warped distribution after the context; node 0 is
then *open*. Rounds r = 1..R (R = min(K, N)) add W_r nodes each (`round_widths`: static,
summing to N, growing with r, as later rounds have more open nodes to choose among), one
pick at a time. A pick scores the next child slot of every open node v and takes the
open node of greatest positive score (the lowest index on ties); the new child's token is
drawn from p_v without v's earlier children, renormalised, and that distribution is the
node's p, which verification reads. At temperature 0 the child is the draft's most likely
remaining token (plain softmax: the tree holds the draft's top tokens) and p is its point
mass. Where no open node has mass left (top-k or top-p supports used up) the slot stays
undrafted. After a round (but the last) one `expand` call over its W_r nodes, a draft
forward with the tree's visibility in the draft's own attention, gives their
distributions and opens them. So the draft runs R forwards of W_r rows (the root call
re-feeds its window), and every shape is fixed by N and K.

The score is the slot's expected number of accepted tokens under a model of the target
built from the draft alone: at each node the target agrees with the draft (q = p) with
probability a = AGREEMENT, or else is a point mass at a token drawn from p (temperature
0: a = 0, the target's argmax). Then a node u, the i-th child of v, is reached and
accepted with probability R(u) = R(v) (a [i = 1] + (1 - a) p_v(x_u)) (R = 1 at the root:
under q = p the first child is always accepted, under a point mass the child that is it),
and v's next slot is worth s(v) = R(v) (a [no child yet] + (1 - a) g(v)), g(v) the draft
probability the next child is expected to have: sum p^2 / sum p over v's tokens not yet
among its children (temperature 0: the next one's, the largest). So a row's tree deepens
along confident paths and widens where the draft is unsure.

Exactness at every temperature. The property that matters, (A): whether a node is created,
and as whose child, is decided before its own token is drawn, from tokens drawn before it
(R(v) reads v's path, g(v) and [no child yet] v's earlier children); the token is then
drawn from p_v without v's earlier children. So given everything drawn before it, v's
i-th child c_i is distributed as p_{v,i} = p_v with c_1..c_{i-1} removed and
renormalised: exactly the p it carries. (Later decisions may read c_i: it is an earlier
sibling or an ancestor of every node created after it, or in another branch. At
temperature 0 nothing is random and every rule is exact.)

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


# The score's a (the module docstring) at temperature > 0. On the Theorem-1 pair at
# temperature 1 and 0.6 (tokens per loop, 4,000 rows, N = 6 to 9; docs/sampling.md): 0 grew
# trees too wide (2.40 against 2.87 at N = 6, K = 3); 0.5, 0.8 and 0.95 were within 0.03.
AGREEMENT = 0.5


def round_widths(num_nodes: int, lookahead: int) -> list[int]:
    """New nodes per round: N over min(K, N) rounds in proportion to 1, 2, 3, ... (at
    least one each). The first round can only add children of the root; even widths made
    every tree that wide at the root (N = 6, K = 3: 2.67 tokens per loop at temperature 0
    and 2.84 at 1 on the Theorem-1 pair, against 2.82 and 2.86 growing)."""
    rounds = min(num_nodes, lookahead)
    share = [num_nodes * (r + 1) / (rounds * (rounds + 1) / 2) for r in range(rounds)]
    widths = [1] * rounds
    for _ in range(num_nodes - rounds):  # each further node to the round furthest below its share
        r = max(range(rounds), key=lambda r: (share[r] - widths[r], r))
        widths[r] += 1
    return widths


def ranked(logits: jax.Array, warping: Warp) -> tuple[jax.Array, jax.Array]:
    """(the distribution children are drawn from and scored by, bad): the warped one, or
    at temperature 0 the plain softmax (greedy's point mass would rank nothing)."""
    if warping.greedy:
        return warp(logits, warping._replace(temperature=1.0, top_k=0, top_p=1.0))
    return warp(logits, warping)


def tallies(left: jax.Array, greedy: bool) -> tuple[jax.Array, jax.Array]:
    """(mass, and sum p^2 or at temperature 0 the largest p) of distributions left [..., V']:
    what a slot's score reads of its node's remaining tokens, kept per node and updated
    where a row changes (a pick, a round's call) rather than over every node per pick."""
    return jnp.sum(left, axis=-1), jnp.max(left, axis=-1) if greedy else jnp.sum(left * left, axis=-1)


def slot_scores(mass: jax.Array, tally: jax.Array, reach: jax.Array, childless: jax.Array, open_: jax.Array,
                greedy: bool, agreement: float) -> jax.Array:
    """[B, N+1] s(v) of every node's next child slot (the module docstring; mass and tally
    from `tallies`), -1 where v is not open or has no mass left."""
    expected = tally if greedy else tally / jnp.where(mass > 0, mass, 1.0)
    score = reach * (agreement * childless + (1 - agreement) * expected)
    return jnp.where(open_ & (mass > 0), score, -1.0)


def next_child(key: jax.Array, left: jax.Array, reach: jax.Array, score: jax.Array, greedy: bool):
    """One pick: the node v of greatest positive score and its next child's token c, drawn
    from `left` at v (the most likely there at temperature 0) -> (v, c, ok: a slot was
    drafted, empty: c's distribution had no mass), each [B]. (`reach`, R: what a rule that
    scored by the drawn token would read; this one never does.)"""
    v = jnp.argmax(score, axis=1).astype(jnp.int32)
    row = left[jnp.arange(left.shape[0]), v]
    ok = jnp.max(score, axis=1) > 0
    if greedy:
        return v, jnp.argmax(row, axis=-1).astype(jnp.int32), ok, jnp.zeros(v.shape, bool)
    c, empty = sample(key, row)
    return v, c, ok, empty


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
    agreement = 0.0 if warping.greedy else AGREEMENT
    # Per node (0..N): what is left of its distribution for further children, R, whether it
    # is open and has no child yet, its depth and its ancestors among nodes 1..N.
    left = jnp.zeros((batch, N + 1, probs.shape[-1]), jnp.float32).at[:, 0].set(probs)
    mass, tally = (jnp.zeros((batch, N + 1), jnp.float32).at[:, 0].set(t) for t in tallies(probs, warping.greedy))
    reach = jnp.zeros((batch, N + 1), jnp.float32).at[:, 0].set(1.0)
    open_ = jnp.zeros((batch, N + 1), bool).at[:, 0].set(True)
    childless = jnp.ones((batch, N + 1), jnp.float32)
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
            score = slot_scores(mass, tally, reach, childless, open_, warping.greedy, agreement)
            v, c, ok, empty = next_child(keys[i - 1], left, reach, score, warping.greedy)
            row = left[rows, v]  # [B, V']: v's distribution without its children so far
            if warping.greedy:  # a deterministic choice: its point mass
                p_i = jax.nn.one_hot(c, row.shape[-1], dtype=jnp.float32)
            else:  # p_v without v's earlier children, renormalised (an undrafted slot's: never read)
                total = jnp.sum(row, axis=-1, keepdims=True)
                p_i = row / jnp.where(total > 0, total, 1.0)
            bad = bad | (empty & ok)
            own = jnp.take_along_axis(row, c[:, None], axis=1)[:, 0]  # p_v(c): the draft's, before any removal
            reach = reach.at[:, i].set(reach[rows, v] * (agreement * childless[rows, v] + (1 - agreement) * own))
            row = jnp.where((jnp.arange(row.shape[-1]) == c[:, None]) & ok[:, None], 0.0, row)
            left = left.at[rows, v].set(row)
            row_mass, row_tally = tallies(row, warping.greedy)
            mass, tally = mass.at[rows, v].set(row_mass), tally.at[rows, v].set(row_tally)
            childless = childless.at[rows, v].set(jnp.where(ok, 0.0, childless[rows, v]))
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
            new_mass, new_tally = tallies(probs, warping.greedy)
            mass, tally = mass.at[:, new].set(new_mass), tally.at[:, new].set(new_tally)
            open_ = open_.at[:, new].set(made)
        first += width
    source = jnp.full((batch, N), SOURCES.index(drafter.name), jnp.int32)
    nodes = tree.Tree(x, p, parent, depth[:, 1:], drafted, source, jnp.zeros((batch, N), jnp.int32), lookahead)
    return nodes, state, bad
