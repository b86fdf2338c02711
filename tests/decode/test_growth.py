"""Dynamic draft trees (`decode/growth.py`, `--draft_tree=dynamic`).

1. What a grown tree holds, node by node: its p is the draft's warped distribution after
   its parent's path, with the parent's earlier children removed and renormalised (the
   reference: a full forward of the draft model over context + path, or the EAGLE layer
   teacher-forced on the path, `test_eagle.teacher_forced`), so the draft's rounds attend
   to the right ancestors through `kv_cache.Prior`; its token has p > 0, siblings are
   distinct, parents precede children, depths are the parent's + 1 and at most K, and at
   temperature 0 a node's children are the draft's most likely tokens in order, as point
   masses. Rotary and Transformer-XL positions; the model drafter, a narrow EAGLE (and
   EAGLE-3) layer with a draft vocabulary (folded), and the parallel drafter (whose
   reference is the draft's full forward over the context and d mask tokens); ragged rows.
2. Greedy SpS with a grown tree gives greedy ArS's tokens (model: a random draft; with -m
   slow the target drafting for itself, which keeps deep paths, eagle, eagle3, and 8 devices), in
   one fused loop with no host round trip and no copy of either cache; `explain_loop`
   shows the first loop (slow).
Theorem 1 for grown trees: test_growth_theorem1.py; the verification of siblings drawn
without replacement over whole tables: test_tree.py.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import model
from specjax.config import HeadsConfig, SamplingConfig
from specjax.decode import drafters, growth, program, speculative
from specjax.decode.warping import Warp, warp
from specjax.heads import init_heads
from conftest import mesh_for
from models import RAGGED, cache_copies, fused_loop_collectives, random_lm, tiny_pairs, with_masks
from test_eagle import NARROW, NARROW_VOCAB, teacher_forced
from theorem1 import make_models, sharpened

K, NODES = 3, 7
PROMPTS = np.array([[5, 9, 2, 7, 1, 30, 4, 8], [4, 11, 8, 0, 0, 0, 0, 0], [17, 0, 0, 0, 0, 0, 0, 0]], np.int32)
LENS = np.array([8, 3, 1], np.int32)  # ragged, one row of a single token


def grown(target, draft, sampling, seed=0):
    """(the drafter, its state after the prompts, the tree `growth.grow` makes, the token buffer)."""
    mesh = program.mesh_of(target)
    target = target.packed()
    drafter = drafters.make(sampling, target, draft, None, mesh)
    warping = program.warping_of(sampling)
    settings = speculative.Settings(K, warping, "block", 1, NODES)
    size = 32
    tokens = jnp.asarray(np.pad(PROMPTS, ((0, 0), (0, size - PROMPTS.shape[1]))))
    with jax.set_mesh(mesh):
        state = speculative.start(target, drafter, jnp.asarray(PROMPTS), jnp.asarray(LENS), jax.random.key(0),
                                  settings, size)
        nodes, _, bad = jax.jit(lambda d, s, t, n, key: growth.grow(d, s, t, n, key, K, NODES, warping,
                                                                    target.cfg.vocab_size))(
            drafter, state.drafter_state, tokens, jnp.asarray(LENS), jax.random.key(seed))
    assert not np.any(np.asarray(bad))
    return drafter, state.drafter_state, jax.tree.map(np.asarray, nodes), tokens


def paths(nodes, b):
    """Row b's path (tokens from depth 1) of every node 0..N."""
    out = [[]]
    for i in range(NODES):
        out.append(out[int(nodes.parent[b, i])] + [int(nodes.x[b, i])])
    return out


def check_tree(nodes, reference, warping: Warp):
    """The module docstring's part 1 for every row and node: reference(b, path) is the
    draft's (unwarped) logits after that row's context and path."""
    greedy = warping.greedy
    plain = warping._replace(temperature=1.0, top_k=0, top_p=1.0)
    for b in range(len(LENS)):
        path = paths(nodes, b)
        depth = [0] + nodes.depth[b].tolist()
        children = {}
        for i in range(NODES):
            v = int(nodes.parent[b, i])
            assert 0 <= v <= i and depth[i + 1] == depth[v] + 1 <= K, (b, i)
            if not nodes.drafted[b, i]:
                continue
            dist = np.asarray(warp(jnp.asarray(reference(b, path[v])), plain if greedy else warping)[0], np.float64)
            earlier = children.setdefault(v, [])
            assert int(nodes.x[b, i]) not in earlier, (b, i)
            dist[earlier] = 0.0
            if greedy:
                assert int(nodes.x[b, i]) == int(np.argmax(dist)), (b, i)  # the most likely remaining token
                np.testing.assert_array_equal(nodes.p[b, i], np.eye(len(dist))[int(nodes.x[b, i])])
            else:
                np.testing.assert_allclose(nodes.p[b, i], dist / dist.sum(), rtol=1e-4, atol=2e-6,
                                           err_msg=f"row {b} node {i + 1}")
                assert nodes.p[b, i, int(nodes.x[b, i])] > 0
            earlier.append(int(nodes.x[b, i]))
    assert max(np.max(nodes.depth[b][nodes.drafted[b]]) for b in range(len(LENS))) > 1  # the trees have depth


def full_forward_reference(draft):
    fn = jax.jit(lambda lm, t: model.full_forward(lm, t))
    cache = {}

    def reference(b, path):
        key = (b, tuple(path))
        if key not in cache:
            seq = PROMPTS[b, :LENS[b]].tolist() + path
            cache[key] = np.asarray(fn(draft, jnp.asarray([seq + [0] * (12 - len(seq))])))[0, len(seq) - 1]
        return cache[key]
    return reference


@pytest.mark.parametrize("pos_encoding,temperature,top_k", [
    ("rope", 0.9, 0), ("relative", 0.0, 0),
    pytest.param("relative", 0.9, 0, marks=pytest.mark.slow), pytest.param("rope", 0.0, 0, marks=pytest.mark.slow),
    pytest.param("rope", 1.0, 3, marks=pytest.mark.slow)])  # top-k 3: some nodes' support is used up
def test_model_drafter_nodes_carry_the_drafts_distribution_along_their_paths(tiny, pos_encoding, temperature, top_k):
    mesh = mesh_for("1x1")
    cfg = lambda c: dataclasses.replace(c, pos_encoding=pos_encoding)  # noqa: E731
    target = random_lm(cfg(tiny.target), mesh)
    draft = sharpened(random_lm(cfg(tiny.draft), mesh, seed=3), 4.0)  # sure enough to grow deep somewhere
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, lookahead=K, draft_tree="dynamic",
                              tree_nodes=NODES)
    _, _, nodes, _ = grown(target, draft, sampling)
    check_tree(nodes, full_forward_reference(draft), program.warping_of(sampling))


# eagle's two in the slow set (the default set's time budget): eagle3's layer is the same
# EagleDrafter with a fused input.
@pytest.mark.parametrize("kind,temperature", [pytest.param("eagle", 0.9, marks=pytest.mark.slow),
                                              pytest.param("eagle", 0.0, marks=pytest.mark.slow), ("eagle3", 0.9)])
def test_eagle_drafter_nodes_carry_the_layers_distribution_along_their_paths(tiny, kind, temperature):
    """A narrow layer with a draft vocabulary of 20 tokens, folded for drafting (float):
    each node's p is the unfolded layer's teacher-forced on its path, spread onto the
    draft vocabulary's ids. EAGLE-3 (the one-layer target's layer, fused through w_fuse):
    the root call's window pass reads the fused layers through w_fuse w_feature folded,
    the rounds the layer's own features, as its chain does."""
    target, _ = make_models(tiny)
    hcfg = dataclasses.replace(NARROW, quantize="", kind=kind)
    heads = init_heads(hcfg, target.cfg, mesh_for("1x1"), vocab=NARROW_VOCAB)
    sampling = SamplingConfig(temperature=temperature, lookahead=K, drafter=kind, draft_tree="dynamic",
                              tree_nodes=NODES)
    drafter, state, nodes, tokens = grown(target, heads, sampling)
    assert drafter.feature_weight is not None  # the folded layer drafts
    assert (drafter.window_weight is not None) == (kind == "eagle3")
    plain = drafters.kind(kind)(drafter.heads, drafter.target, K, None,
                                specjax.heads.unembedding(heads, drafter.target))
    rows = {}

    def reference(b, path):  # the layer's plain softmax after the path, as logits
        if b not in rows:
            rows[b] = {}
        if tuple(path) not in rows[b]:
            row = lambda a: a[b:b + 1]  # noqa: E731
            cache = dataclasses.replace(state.cache, k=state.cache.k[:, b:b + 1], v=state.cache.v[:, b:b + 1],
                                        lengths=row(state.cache.lengths))
            one = state._replace(cache=cache, window=row(state.window), count=row(state.count), start=row(state.start))
            x = jnp.asarray([path + [0] * (K - len(path))], jnp.int32)
            p = teacher_forced(plain, one, x, tokens[b:b + 1], K)[0, len(path)]
            rows[b][tuple(path)] = np.log(np.maximum(np.asarray(p), 1e-38))
        return rows[b][tuple(path)]

    check_tree(nodes, reference, program.warping_of(sampling))
    assert set(np.unique(nodes.x[nodes.drafted])) <= set(NARROW_VOCAB.tolist())


@pytest.mark.parametrize("temperature", [0.9, pytest.param(0.0, marks=pytest.mark.slow)])
def test_parallel_drafter_nodes_carry_the_masked_pass_distribution_at_their_depth(tiny, temperature):
    """A node at depth d draws its children from the one masked pass's (d+1)-th
    distribution, whatever its path: the reference is a full forward of the draft over the
    context followed by d mask tokens (no cache), at its last position."""
    mesh = mesh_for("1x1")
    target = random_lm(tiny.target, mesh)
    draft = with_masks(sharpened(random_lm(tiny.draft, mesh, seed=3), 4.0), k=K)  # sure enough to grow deep
    sampling = SamplingConfig(temperature=temperature, lookahead=K, drafter="parallel", draft_tree="dynamic",
                              tree_nodes=NODES)
    _, _, nodes, _ = grown(target, draft, sampling)
    fn = jax.jit(lambda lm, t: model.full_forward(lm, t))

    def reference(b, path):
        seq = PROMPTS[b, :LENS[b]].tolist() + [model.mask_id(draft.cfg)] * len(path)
        return np.asarray(fn(draft, jnp.asarray([seq + [0] * (12 - len(seq))])))[0, len(seq) - 1]

    check_tree(nodes, reference, program.warping_of(sampling))


# --------------------------------------------------------------------------- 2. the loop


@pytest.fixture(scope="module")
def pairs(tiny):
    return tiny_pairs(tiny)


GREEDY = SamplingConfig(temperature=0, lookahead=K, max_new_tokens=32)
DYNAMIC = dataclasses.replace(GREEDY, draft_tree="dynamic", tree_nodes=8)


@pytest.mark.parametrize("mesh_name", ["1x1", pytest.param("1x8", marks=pytest.mark.slow)])
def test_greedy_grown_tree_equals_greedy_ars_in_one_fused_loop(pairs, mesh_name):
    target, draft = pairs[mesh_name]  # a random draft: mostly rejected
    ars = specjax.generate(target, None, RAGGED, GREEDY)
    sps = specjax.generate(target, draft, RAGGED, DYNAMIC)
    assert sps.tokens == ars.tokens
    assert sps.accepted.sum() > 0
    built = program.build(target, draft, RAGGED, DYNAMIC)
    assert not cache_copies(built)
    fused_loop_collectives(built)


@pytest.mark.slow
def test_greedy_grown_tree_of_a_sure_draft_keeps_deep_paths(pairs):
    """The (sharpened) target drafting for itself: the tree grows down its argmax path."""
    sharp = sharpened(pairs["1x1"][0], 4.0)
    sps = specjax.generate(sharp, sharp, RAGGED, DYNAMIC)
    assert sps.tokens == specjax.generate(sharp, None, RAGGED, GREEDY).tokens
    assert sps.tokens_per_loop > 2.5


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_greedy_grown_tree_with_eagle_equals_greedy_ars(pairs, kind):
    target, _ = pairs["1x1"]
    heads = init_heads(HeadsConfig(kind=kind, init_seed=2), target.cfg, mesh_for("1x1"))
    greedy = SamplingConfig(temperature=0, lookahead=4, max_new_tokens=48)
    ars = specjax.generate(target, None, RAGGED, greedy)
    sps = specjax.generate(target, heads, RAGGED, dataclasses.replace(greedy, drafter=kind, draft_tree="dynamic",
                                                                      tree_nodes=8))
    assert sps.tokens == ars.tokens
    assert sps.accepted.sum() > 0 and sps.summary()["proposed_by"].keys() == {kind}


@pytest.mark.slow
def test_explain_loop_shows_the_first_grown_trees_kept_path(pairs):
    """explain_loop's first loop is generate's: its kept path, then the first child of each
    node below it, with the residual or bonus token after the kept ones."""
    target, draft = pairs["1x1"]
    sampling = SamplingConfig(temperature=1.0, lookahead=K, max_new_tokens=8, draft_tree="dynamic", tree_nodes=6)
    for seed in range(3):
        trace = specjax.explain_loop(target, draft, RAGGED[1], sampling, seed=seed)
        assert trace.verify == "tree" and trace.num_accepted <= trace.lookahead <= K
        tokens = specjax.generate(target, draft, [RAGGED[1]], sampling, seed=seed).tokens[0]
        assert tokens[:len(trace.tokens)] == trace.tokens
