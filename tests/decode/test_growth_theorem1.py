"""Theorem 1 for dynamic draft trees (`--draft_tree=dynamic`, `decode/growth.py`): the
fused loop with a grown tree samples the target's exact distribution (enumeration and
chi-square test of `theorem1`: N = 50,000 samples per case, one compiled program and one
batch each, ALPHA = 0.001): the model drafter at temperature 1 with ragged rows, 0.7 with
top-p 0.8, top-k 5, trees of 4 to 8 nodes and depth 2 to 4, the target as its own draft
(p == q), a draft with disjoint support, the EAGLE and EAGLE-3 drafters (random layers),
and the parallel drafter (the draft with a random mask embedding; temperature 0.9, and 1
with top-k 5).

Negative control, REJECTED by the same test with N_NEGATIVE samples: growth by a node's
own probability (EAGLE-2's reranking: a child drawn for every open node, the one whose
path probability with its own token is highest kept), swapped in for `growth.next_child`
(with the model drafter, and with the parallel drafter). It reads each child's own token
to decide whether the child exists, which biases the output at any temperature > 0
(growth.py's docstring).
"""
import jax.numpy as jnp
import pytest

from specjax.config import HeadsConfig
from specjax.decode import growth
from specjax.decode.warping import sample
from specjax.heads import init_heads
from conftest import mesh_for
from models import with_masks
from theorem1 import ALPHA, N_NEGATIVE, Case, make_models, run


@pytest.fixture(scope="module")
def models(tiny):
    return make_models(tiny)


def grown_case(temperature, top_k, top_p, K, kind, nodes, drafter="model"):
    return Case(temperature, top_k, top_p, K, kind, "block", drafter, tree_nodes=nodes)


CASES = {
    "ragged_N4_K3": grown_case(1.0, 0, 1.0, 3, "ragged", 4),
    "temperature_0.7_top_p_0.8_N6_K3": grown_case(0.7, 0, 0.8, 3, "ragged", 6),
    "top_k_5_N5_K2": grown_case(1.0, 5, 1.0, 2, "pair", 5),
    "N8_K4": grown_case(1.0, 0, 1.0, 4, "pair", 8),
    "draft_is_target_N4_K3": grown_case(1.0, 0, 1.0, 3, "same", 4),
    "disjoint_support_N4_K2": grown_case(1.0, 0, 1.0, 2, "disjoint", 4),
    "eagle_ragged_N4_K3": grown_case(0.9, 0, 1.0, 3, "ragged", 4, "eagle"),
    "eagle3_ragged_N4_K3": grown_case(0.9, 0, 1.0, 3, "ragged", 4, "eagle3"),
    "parallel_ragged_N5_K3": grown_case(0.9, 0, 1.0, 3, "ragged", 5, "parallel"),
    "parallel_top_k_5_N6_K3": grown_case(1.0, 5, 1.0, 3, "ragged", 6, "parallel"),
}
DEFAULT = {"ragged_N4_K3", "ragged_N4_K3-keep_by_own_probability"}


def maybe_slow(name, *rest):
    key = "-".join((name,) + rest)
    return pytest.param(name, *rest, marks=[] if key in DEFAULT else [pytest.mark.slow], id=key)


def models_for(models, case):
    if case.drafter in ("eagle", "eagle3"):
        target, _ = models
        return target, init_heads(HeadsConfig(kind=case.drafter, init_seed=2), target.cfg, mesh_for("1x1"))
    if case.drafter == "parallel":
        target, draft = models
        return target, with_masks(draft)
    return models


@pytest.mark.parametrize("name", [maybe_slow(n) for n in CASES])
def test_grown_tree_samples_follow_the_exact_target_distribution(models, name, patch):
    patch()
    case = CASES[name]
    pvalue, result = run(models_for(models, case), case)
    summary = result.summary()
    print(f"{name}: p = {pvalue:.4f}, tokens/loop {result.tokens_per_loop:.3f}, drafted depths "
          f"{summary['drafted_histogram']}")
    assert pvalue > ALPHA
    # Every slot drafted (V = 32), unless top-k or top-p leave a node fewer children to draw.
    assert result.proposed == case.tree_nodes * result.loops.sum() or case.top_k or case.top_p < 1
    if case.kind == "disjoint":
        assert result.accepted.sum() == 0
    else:
        assert result.histogram[:, 2:].sum() > 0  # kept paths below depth 1: the trees grew down, not only wide


def keep_by_own_probability(key, left, reach, score, greedy):
    """EAGLE-2's reranking as one pick: a child drawn for every open node, the one kept
    whose own path probability R(v) p_v(c) is highest."""
    c, empty = sample(key, left)  # [B, N+1]: a candidate child per node
    own = jnp.take_along_axis(left, c[..., None], axis=-1)[..., 0]
    score = jnp.where(score > 0, reach * own, -1.0)
    v = jnp.argmax(score, axis=1)
    pick = lambda a: jnp.take_along_axis(a, v[:, None], axis=1)[:, 0]  # noqa: E731
    return v.astype(jnp.int32), pick(c), jnp.max(score, axis=1) > 0, pick(empty)


@pytest.mark.parametrize("name,wrong", [maybe_slow("ragged_N4_K3", "keep_by_own_probability"),
                                        maybe_slow("temperature_0.7_top_p_0.8_N6_K3", "keep_by_own_probability"),
                                        maybe_slow("parallel_ragged_N5_K3", "keep_by_own_probability")])
def test_negative_control_growth_by_a_nodes_own_probability_is_rejected(models, name, wrong, patch):
    patch([(growth, "next_child", keep_by_own_probability)])
    pvalue, _ = run(models_for(models, CASES[name]), CASES[name], n=N_NEGATIVE)
    print(f"{name} with {wrong}: p = {pvalue:.2e}")
    assert pvalue < ALPHA
