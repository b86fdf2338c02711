"""Several drafts verified as one tree (`decode/tree.py`; `speculative.speculate` with M > 1).

1. Tree attention: the logits of every tree node equal those of a plain forward over
   that node's path (ragged rows, rotary and Transformer-XL positions, 1 device and a
   2x4 mesh), and the committed path is what the next forward attends to.
2. The multi-draft rule alone, over whole trees of M chains (as test_verify does for one
   chain): the models are tables over V = 4 tokens for every prefix, M chains of K tokens
   are drawn (i.i.d. from p; or chain 0 a point mass, as hybrid's lookup chain; or chains
   cut short by a draft-side rule; or p == q; or disjoint supports), the verifier keeps a
   path and draws one token, and the target completes the sequence to K+1 tokens. A
   lossless rule makes those K+1 tokens follow q's exact joint over all 4^(K+1)
   sequences. Chi-square at ALPHA = 0.001, N = 200,000 trees per case (cells expected
   below 5 pooled). Three negative controls, each rejected by the same test: accept a
   candidate that equals a target sample of its own (the biased multi-candidate rule),
   verify each chain on its own and keep the longest, and skip the residual update
   between candidates.
3. Greedy multi-draft SpS gives exactly greedy ArS's tokens; the tree loop is one while
   loop without host callbacks and with the chain loop's all-reduces.
The end-to-end Theorem-1 enumeration for the tree loop is in test_tree_theorem1.py.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as scipy_stats

import specjax
from specjax import kv_cache, model
from specjax.config import ConfigError, SamplingConfig
from specjax.decode import program, tree, verify
from specjax.decode.drafters import Proposal
from specjax.decode.warping import sample
from specjax.decode.state import prefill
from conftest import mesh_for
from models import RAGGED, fused_loop_collectives, tiny_pairs

ALPHA = 1e-3
N = 200_000
V = 4


# --------------------------------------------------------------------------- 1. tree attention


@pytest.mark.parametrize("pos_encoding,mesh_name", [  # relative by default (the default set's time); the rest slow
    pytest.param("rope", "1x1", marks=pytest.mark.slow), ("relative", "1x1"),
    pytest.param("rope", "2x4", marks=pytest.mark.slow),
    pytest.param("relative", "2x4", marks=pytest.mark.slow)])
def test_tree_attention_equals_a_plain_forward_over_each_path(tiny, mesh_name, pos_encoding):
    lm = model.init_lm(dataclasses.replace(tiny.target, pos_encoding=pos_encoding), mesh_for(mesh_name))
    M, K = 3, 3
    prompts = np.array([[1, 2, 3, 4, 5, 6, 0, 0], [7, 8, 9, 0, 0, 0, 0, 0]], np.int32)
    lens = np.array([6, 3], np.int32)  # ragged
    rng = np.random.default_rng(0)
    chains = rng.integers(0, tiny.target.vocab_size, (2, M, K)).astype(np.int32)
    chains[:, 1, 0] = chains[:, 0, 0]  # two branches that start alike
    pending = lens - 1
    scored = np.concatenate([prompts[np.arange(2), pending][:, None], chains.reshape(2, -1)], axis=1)
    parent, depth = tree.chain_parents(M, K)
    positions = pending[:, None] + np.concatenate([[0], depth])[None]
    winner = np.array([2, 0])
    kept = np.concatenate([np.zeros((2, 1), np.int32), 1 + winner[:, None] * K + np.arange(K)[None]], axis=1)
    with jax.set_mesh(mesh_for(mesh_name)):
        cache = jax.jit(prefill, static_argnums=3)(lm, jnp.asarray(prompts), jnp.asarray(lens), 32)

        @jax.jit
        def tree_then_next(lm, cache, scored, positions, kept, after):
            logits, fresh = lm(scored, positions, cache, tree.ancestors(parent))
            committed = kv_cache.commit(cache, fresh, positions[:, 0], kept)
            committed = committed.with_lengths(positions[:, 0] + K + 1)
            next_logits, _ = lm(after[:, None], (positions[:, 0] + K + 1)[:, None], committed)
            return logits, next_logits[:, 0]

        after = jnp.array([5, 6], jnp.int32)
        logits, next_logits = tree_then_next(lm, cache, jnp.asarray(scored), jnp.asarray(positions),
                                             jnp.asarray(kept), after)
    logits, next_logits = np.asarray(logits), np.asarray(next_logits)
    for b in range(2):
        context = prompts[b, :lens[b]].tolist()
        for t in range(1 + M * K):
            path = [] if t == 0 else chains[b, (t - 1) // K, :(t - 1) % K + 1].tolist()
            reference = model.full_forward(lm, jnp.asarray([context + path]))[0, -1]
            np.testing.assert_allclose(logits[b, t], reference, atol=2e-5, err_msg=f"row {b} node {t}")
        reference = model.full_forward(lm, jnp.asarray([context + chains[b, winner[b]].tolist() + [int(after[b])]]))
        np.testing.assert_allclose(next_logits[b], reference[0, -1], atol=2e-5, err_msg=f"row {b} after the commit")


def test_tree_layout():
    parent, depth = tree.chain_parents(2, 3)
    assert depth.tolist() == [1, 2, 3, 1, 2, 3] and parent.tolist() == [0, 1, 2, 0, 4, 5]
    a = tree.ancestors(tree.chain_parents(2, 2)[0])  # nodes: pending, chain 0 (1, 2), chain 1 (3, 4)
    assert a.astype(int).tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 1, 0],
                                      [1, 0, 0, 1, 1]]


# --------------------------------------------------------------------------- 2. the rule over tables


def node(prefix) -> int:
    """A prefix's index among all prefixes, shortest first: children of i are V*i + 1 + t."""
    i = 0
    for t in prefix:
        i = i * V + 1 + t
    return i


def make_tables(K: int, kind: str):
    rng = np.random.default_rng(K)
    nodes = sum(V ** m for m in range(K + 2))
    q = rng.dirichlet(np.full(V, 0.7), nodes)
    if kind == "same":
        return q, q
    if kind == "disjoint":
        q[:, 1::2] = 0.0
        p = rng.dirichlet(np.full(V, 0.7), nodes)
        p[:, 0::2] = 0.0
        return p / p.sum(1, keepdims=True), q / q.sum(1, keepdims=True)
    p = 0.5 * q + 0.5 * rng.dirichlet(np.full(V, 0.7), nodes)  # like q, not equal
    p[rng.random(nodes) < 0.3, 0] = 0.0  # some tokens the draft never proposes
    return p / p.sum(1, keepdims=True), q


def sample_rows(rng, dist):
    return (rng.random((len(dist), 1)) > np.cumsum(dist, 1)).sum(1).clip(0, V - 1)


def exact_joint(q, K) -> np.ndarray:
    joint = np.ones([V] * (K + 1))
    for i in range(K + 1):
        for prefix in np.ndindex(*([V] * i)):
            joint[prefix] *= q[node(prefix)][(slice(None),) + (None,) * (K - i)] if i < K else q[node(prefix)]
    return joint


def run_tables(verifier, M: int, K: int, proposal: str, kind: str = "pair", seed: int = 0):
    p_table, q_table = make_tables(K, kind)
    rng = np.random.default_rng(seed)
    x = np.zeros((N, M, K), np.int64)
    p = np.zeros((N, M, K, V), np.float32)
    q = np.zeros((N, 1 + M * K, V), np.float32)
    length = np.full((N, M), K)
    q[:, 0] = q_table[0]
    for m in range(M):
        ids = np.zeros(N, np.int64)
        for j in range(K):
            if proposal == "point" and m == 0:  # a lookup's deterministic chain next to sampled ones
                x[:, m, j] = (ids * 7 + j) % V
                p[:, m, j] = np.eye(V)[x[:, m, j]]
            else:
                p[:, m, j] = p_table[ids]
                x[:, m, j] = sample_rows(rng, p_table[ids])
            if proposal == "adaptive":  # a chain stops after a token its own p was unsure of
                length[:, m] = np.where((length[:, m] == K) & (p[np.arange(N), m, j, x[:, m, j]] < 0.35), j + 1,
                                        length[:, m])
            ids = ids * V + 1 + x[:, m, j]
            q[:, 1 + m * K + j] = q_table[ids]
    chains = Proposal(jnp.asarray(x, jnp.int32), jnp.asarray(p), jnp.asarray(length, jnp.int32),
                      jnp.zeros((N, M), jnp.int32))
    n, path, token, _ = jax.jit(lambda key, c, q: verifier(key, tree.of_chains(c, K), q))(
        jax.random.key(seed), chains, jnp.asarray(q))
    n, path, token = np.asarray(n), np.asarray(path), np.asarray(token)
    win = (np.maximum(path[np.arange(N), np.maximum(n, 1)], 1) - 1) // K  # the chain of the last kept node
    assert (n <= length[np.arange(N), win]).all()
    return completed_pvalue(rng, q_table, K, x.reshape(N, M * K), n, path, token), n.mean()


def completed_pvalue(rng, q_table, K, x, n, path, token) -> float:
    """The chi-square p-value of the K+1 tokens: the kept path's (x [N, nodes] at `path`),
    the verifier's token, then the target's own samples, against q's exact joint."""
    seqs = np.zeros((N, K + 1), np.int64)
    cur = np.zeros(N, np.int64)
    for i in range(K + 1):
        kept = x[np.arange(N), np.maximum(path[:, min(i + 1, K)] - 1, 0)]
        t = np.where(i < n, kept, np.where(i == n, token, sample_rows(rng, q_table[cur])))
        seqs[:, i] = t
        cur = cur * V + 1 + t
    observed = np.bincount(np.ravel_multi_index(seqs.T, [V] * (K + 1)), minlength=V ** (K + 1))
    expected = exact_joint(q_table, K).ravel() * N
    if observed[expected == 0].sum():
        return 0.0
    big = expected >= 5
    o, e = np.append(observed[big], observed[~big].sum()), np.append(expected[big], expected[~big].sum())
    keep = e > 0
    return float(scipy_stats.chi2.sf(np.sum((o[keep] - e[keep]) ** 2 / e[keep]), keep.sum() - 1))


TABLE_CASES = [(2, 1, "sampled", "pair"), (3, 1, "sampled", "pair"), (2, 3, "sampled", "pair"),
               (3, 3, "sampled", "pair"), (2, 3, "point", "pair"), (3, 3, "adaptive", "pair"),
               (3, 1, "point", "pair"), (2, 3, "sampled", "same"), (3, 3, "sampled", "disjoint")]


@pytest.mark.parametrize("M,K,proposal,kind", TABLE_CASES)
def test_multi_draft_rule_is_lossless_over_whole_trees(M, K, proposal, kind):
    pvalue, kept = run_tables(tree.accept, M, K, proposal, kind)
    print(f"M={M} K={K} {proposal} {kind}: p = {pvalue:.4f}, mean kept {kept:.3f}")
    assert pvalue > ALPHA
    if kind == "same":
        assert kept == K  # p == q: every first candidate is kept
    if kind == "disjoint":
        assert kept == 0


def test_more_drafts_keep_more():
    """The point of several drafts: more kept tokens per loop (same tables and seed)."""
    one = run_tables(tree.accept, 1, 3, "sampled")[1]
    three = run_tables(tree.accept, 3, 3, "sampled")[1]
    assert three > one + 0.2


# A tree's siblings drawn WITHOUT replacement (a grown tree's, `decode/growth.py`), of a
# fixed shape: node i's parent. The root has three children, its first child two, and
# each of those one; each node's children are drawn in order from p at the node without
# the earlier ones. V = 4 and p has zeros, so a node's support is sometimes used up: the
# slot is then not drafted.
SHAPE = np.array([0, 0, 0, 1, 1, 4, 5], np.int32)


def run_grown(shape, kind: str = "pair", seed: int = 0, keep_if_likely: float = 0.0):
    """(p-value, mean kept) of `tree.accept` over N trees of `shape` drawn without
    replacement from the tables. `keep_if_likely` > 0: the negative control, a drawn
    child kept only if its own p is at least that (its slot decided by its own token)."""
    depth = np.zeros(len(shape) + 1, np.int32)
    for i, parent in enumerate(shape):
        depth[i + 1] = depth[parent] + 1
    K = int(depth.max())
    p_table, q_table = make_tables(K, kind)
    rng = np.random.default_rng(seed)
    rows, count = np.arange(N), len(shape)
    x = np.zeros((N, count), np.int64)
    p = np.zeros((N, count, V), np.float32)
    q = np.zeros((N, count + 1, V), np.float32)
    drafted = np.zeros((N, count), bool)
    prefix = np.zeros((N, count + 1), np.int64)  # each node's path as an index into the tables
    left = {}
    q[:, 0] = q_table[0]
    for i, parent in enumerate(shape):
        rest = left.get(parent, p_table[prefix[:, parent]].copy())
        total = rest.sum(1, keepdims=True)
        dist = rest / np.maximum(total, 1e-30)
        token = sample_rows(rng, dist)
        made = (total[:, 0] > 0) & (drafted[:, parent - 1] if parent > 0 else True)
        if keep_if_likely:
            made &= p_table[prefix[:, parent]][rows, token] >= keep_if_likely
        x[:, i], p[:, i], drafted[:, i] = token, dist, made
        rest[rows, token] = np.where(made, 0.0, rest[rows, token])
        left[parent] = rest
        prefix[:, i + 1] = prefix[:, parent] * V + 1 + token
        q[:, i + 1] = q_table[prefix[:, i + 1]]
    nodes = tree.Tree(jnp.asarray(x, jnp.int32), jnp.asarray(p), shape, depth[1:], jnp.asarray(drafted),
                      jnp.zeros((N, count), jnp.int32), jnp.zeros((N, count), jnp.int32), K)
    n, path, token, _ = jax.jit(tree.accept)(jax.random.key(seed), nodes, jnp.asarray(q))
    n, path, token = np.asarray(n), np.asarray(path), np.asarray(token)
    return completed_pvalue(rng, q_table, K, x, n, path, token), n.mean()


@pytest.mark.parametrize("kind", ["pair", "same", "disjoint"])
def test_siblings_drawn_without_replacement_are_verified_losslessly(kind):
    pvalue, kept = run_grown(SHAPE, kind)
    print(f"grown {kind}: p = {pvalue:.4f}, mean kept {kept:.3f}")
    assert pvalue > ALPHA
    if kind == "same":
        assert kept == 3  # p == q: every first child is kept, down to depth 3
    if kind == "disjoint":
        assert kept == 0


def test_negative_control_a_child_that_exists_because_of_its_own_token_is_rejected():
    """The pitfall of growing by a node's own probability (EAGLE-2's reranking), at its
    plainest: a drawn child is kept only if its own draft probability is high."""
    pvalue, _ = run_grown(SHAPE, keep_if_likely=0.3)
    print(f"grown, children kept by their own p: p = {pvalue:.2e}")
    assert pvalue < ALPHA


# Deliberately wrong multi-draft rules (negative controls), same signature as tree.accept.
def walk(key, t, q, test):
    """tree.accept's walk over the nodes (`tree.walk`) with the candidate test replaced by
    `test(key_i, r, r_level, token, p_i, u_i) -> (ok [B], r after a rejection)`: r is the
    current residual, r_level the target's q at the kept node."""
    batch, count = t.x.shape
    keys = jax.random.split(key, count + 2)
    u = jax.random.uniform(keys[-2], (batch, count))

    def decide(i, candidate, token, carry):
        r, level = carry
        ok, rejected = test(keys[i], r, level, token, t.p[:, i], u[:, i])
        ok = candidate & ok
        r = jnp.where(ok[:, None], q[:, i + 1], jnp.where((candidate & ~ok)[:, None], rejected, r))
        return ok, (r, jnp.where(ok[:, None], q[:, i + 1], level))

    n, path, (r, _) = tree.walk(t, decide, (q[:, 0], q[:, 0]))
    token, empty = sample(keys[-1], r)
    return n, path, token, empty


def at(a, token):
    return jnp.take_along_axis(a, token[:, None], axis=1)[:, 0]


def residual(r, p):
    res = jnp.maximum(r - p, 0.0)
    return res / jnp.maximum(res.sum(-1, keepdims=True), 1e-30)


def match_own_target_sample(key, t, q):
    """Each candidate is checked against a target sample of its own: kept if equal."""
    return walk(key, t, q, lambda k, r, level, token, p, u: (sample(k, r)[0] == token, r))


def no_residual_update(key, t, q):
    """Every candidate is tested against the target's q itself, never the residual."""
    return walk(key, t, q, lambda k, r, level, token, p, u: (u * at(p, token) < at(level, token), residual(level, p)))


def longest_of_independent_chains(key, t, q):
    """Each chain verified on its own by the paper's rule; the longest kept prefix wins."""
    batch, lookahead, drafts = t.x.shape[0], t.lookahead, t.num_chains
    chain_nodes = np.concatenate([np.zeros((drafts, 1), np.int32), 1 + np.arange(drafts * lookahead).reshape(
        drafts, lookahead)], axis=1)  # [M, K+1]
    q_chain = q[:, chain_nodes]  # [B, M, K+1, V]
    length = jnp.sum(t.drafted.reshape(batch, drafts, lookahead), axis=2)
    flat = lambda a: a.reshape((batch * drafts,) + a.shape[2:])
    n, token, empty = verify.accept(key, flat(t.x.reshape(batch, drafts, lookahead)),
                                    flat(t.p.reshape((batch, drafts, lookahead) + t.p.shape[2:])), flat(q_chain),
                                    flat(length))
    n, token, empty = n.reshape(batch, drafts), token.reshape(batch, drafts), empty.reshape(batch, drafts)
    best = jnp.argmax(n, axis=1)
    pick = lambda a: jnp.take_along_axis(a, best[:, None], axis=1)[:, 0]
    return pick(n), jnp.asarray(chain_nodes)[best], pick(token), pick(empty)


WRONG_RULES = {"match_own_target_sample": match_own_target_sample,
               "longest_of_independent_chains": longest_of_independent_chains,
               "no_residual_update": no_residual_update}


@pytest.mark.parametrize("wrong", sorted(WRONG_RULES))
@pytest.mark.parametrize("M,K", [(2, 3), (3, 1)])
def test_negative_control_wrong_multi_draft_rule_is_rejected(wrong, M, K):
    pvalue, _ = run_tables(WRONG_RULES[wrong], M, K, "sampled")
    print(f"{wrong} M={M} K={K}: p = {pvalue:.2e}")
    assert pvalue < ALPHA


# --------------------------------------------------------------------------- 3. the loop

@pytest.fixture(scope="module")
def pairs(tiny):
    return tiny_pairs(tiny)


@pytest.mark.parametrize("mesh_name", ["1x1", pytest.param("1x8", marks=pytest.mark.slow)])
def test_greedy_multi_draft_equals_greedy_ars(pairs, mesh_name):
    """With the random draft (mostly rejected) and with the target as its own draft (all
    kept), for the model drafter and hybrid (whose chain 0 is the n-gram proposal)."""
    target, draft = pairs[mesh_name]
    greedy = SamplingConfig(temperature=0, lookahead=3, max_new_tokens=48)
    ars = specjax.generate(target, None, RAGGED, greedy)
    chain = specjax.generate(target, draft, RAGGED, greedy)
    for d, drafter, M in ((draft, "model", 2), (target, "model", 3), (draft, "hybrid", 3)):
        sps = specjax.generate(target, d, RAGGED, dataclasses.replace(greedy, drafter=drafter, num_drafts=M))
        assert sps.tokens == ars.tokens, (drafter, M)
        assert sps.accepted.sum() > 0
        if d is draft and drafter == "model":
            # Greedy chains start with the draft's M most likely tokens, not M copies of one.
            assert sps.accepted.sum() > chain.accepted.sum()
            assert sps.chain_won[:, 1:].sum() > 0
        if d is target:
            assert sps.tokens_per_loop > 3.5  # every draft kept: K+1 per loop but at the budget's end
            assert sps.chain_won[:, 0].sum() == sps.chain_won.sum()  # the first chain wins every tie


def test_tree_loop_is_one_fused_loop_with_the_chain_loops_all_reduces(pairs):
    """The wider pass adds bytes, not collectives: the same all-reduces (and all-gathers) per
    loop as the chain loop (Megatron's 2 per layer + 1 for the embedding per forward: the draft's K
    steps over M rows each, the target's one tree pass), plus 0."""
    target, draft = pairs["1x8"]
    K = 3
    counts, gathers = {}, {}
    for M in (1, 3):
        sampling = SamplingConfig(temperature=0.8, top_p=0.9, lookahead=K, max_new_tokens=32, num_drafts=M,
                                  verify="tokenwise")
        per_loop = fused_loop_collectives(program.build(target, draft, RAGGED, sampling, seed=0))
        counts[M] = sum(n for c, n in per_loop.items() if c.kind == "all-reduce")
        gathers[M] = {c.shape: n for c, n in per_loop.items() if c.kind == "all-gather"}
    assert counts[1] == 2 * (target.cfg.num_layers + K * draft.cfg.num_layers) + K + 1
    assert counts[3] == counts[1] + 0
    # All-gathers: the vocab-parallel logits only, as many as the chain loop's (never a cache:
    # tiny's 4 kv heads on 8 devices once made XLA reshard the target's cache and gather it
    # back whole in the commit).
    # A row of logits is gathered as its 8 shards, each padded to whole 128-lane tiles
    # (`sharding.gather_rows`): [..., 8, 128] for tiny's 32 tokens.
    shards = 8
    width = -(-target.cfg.vocab_size // shards // 128) * 128
    assert sum(gathers[3].values()) == sum(gathers[1].values())
    assert all(shape.endswith(f",{shards},{width}]") for shape in gathers[3]), gathers[3]


def test_statistics_of_a_tree_run(pairs):
    target, draft = pairs["1x1"]
    sampling = SamplingConfig(temperature=1.0, lookahead=3, max_new_tokens=24, num_drafts=3)
    result = specjax.generate(target, draft, RAGGED, sampling, seed=1)
    assert result.chain_won.shape == result.chain_accepted.shape == (len(RAGGED), 3)
    assert (result.chain_accepted.sum(1) == result.accepted).all()
    assert (result.chain_proposed.sum(1) == result.proposed_rows).all()
    assert (result.chain_won.sum(1) == result.histogram[:, 1:].sum(1)).all()  # loops that kept a token
    summary = result.summary()
    assert summary["num_drafts"] == 3 and len(summary["won_by_chain"]) == 3
    # Kept drafts per loop: tokens per loop less the one sampled token, except where the
    # budget cut a last loop short.
    assert result.tokens_per_loop - 1 <= summary["accepted_path"] < result.tokens_per_loop
    assert set(result.row_stats(0)) >= {"won_by_chain", "acceptance_by_chain"}


def test_explain_loop_shows_the_winning_chain_of_the_first_tree_loop(pairs):
    target, draft = pairs["1x1"]
    sampling = SamplingConfig(temperature=1.0, lookahead=3, max_new_tokens=8, num_drafts=3)
    for seed in range(4):
        trace = specjax.explain_loop(target, draft, RAGGED[1], sampling, seed=seed)
        assert trace.verify == "tree"
        tokens = specjax.generate(target, draft, [RAGGED[1]], sampling, seed=seed).tokens[0]
        assert tokens[:len(trace.tokens)] == trace.tokens


def test_config_and_registry_agree_on_drafters_and_chains():
    """SamplingConfig (which cannot import the decode layer) names the drafters, which
    draw several chains, which honour draft_confidence and which grow dynamic trees as the
    registry's classes declare."""
    from specjax.config import DRAFTERS
    from specjax.decode import drafters
    assert set(DRAFTERS) == set(drafters.REGISTRY)
    for name, kind in drafters.REGISTRY.items():
        for declared, setting, message in ((kind.several_chains, dict(num_drafts=2), "num_drafts=2"),
                                           (kind.adaptive, dict(draft_confidence=0.5), "draft_confidence=0.5"),
                                           (kind.grows_trees, dict(draft_tree="dynamic"), "draft_tree='dynamic'")):
            sampling = SamplingConfig(drafter=name, **setting)
            if declared:
                sampling.validate()
            else:
                with pytest.raises(ConfigError, match=message):
                    sampling.validate()


@pytest.mark.parametrize("bad,message", [(dict(num_drafts=0), "num_drafts=0"),
                                         (dict(num_drafts=2, drafter="ngram"), "num_drafts=2 with drafter='ngram'")])
def test_bad_num_drafts_is_refused(bad, message):
    with pytest.raises(ConfigError, match=message):
        SamplingConfig(**bad).validate()
