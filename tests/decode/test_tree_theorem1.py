"""Theorem 1 for several drafts verified as a tree: the fused tree loop samples the
target's exact distribution (enumeration and chi-square test of `theorem1`: N = 50,000
samples per case, one compiled program and one batch each, ALPHA = 0.001), for M in
{2, 3} chains and K in {1, 3}: temperature 1 and 0.7, top-k, top-p, ragged rows, the
target as its own draft (p == q), a draft with disjoint support, and hybrid (the n-gram
proposal as chain 0 next to the draft model's chains).

Negative controls, each REJECTED by the same test with N_NEGATIVE samples: the three
wrong multi-draft rules of test_tree.py swapped in for `tree.accept` inside the loop.
"""
import pytest

from specjax.decode import tree
from test_tree import WRONG_RULES
from theorem1 import ALPHA, N_NEGATIVE, Case, make_models, run


@pytest.fixture(scope="module")
def models(tiny):
    return make_models(tiny)


@pytest.fixture
def use_rule(patch):
    return lambda name: patch([] if name is None else [(tree, "accept", WRONG_RULES[name])])


def tree_case(temperature, top_k, top_p, K, kind, M, drafter="model", prompts=""):
    return Case(temperature, top_k, top_p, K, kind, "block", drafter, prompts=prompts, num_drafts=M)


CASES = {
    "M2_ragged_K3": tree_case(1.0, 0, 1.0, 3, "ragged", 2),
    "M3_temperature_0.7_K1": tree_case(0.7, 0, 1.0, 1, "pair", 3),
    "M3_draft_is_target_K1": tree_case(1.0, 0, 1.0, 1, "same", 3),
    "M2_hybrid_repeats_K3": tree_case(1.0, 0, 1.0, 3, "repeats", 2, "hybrid"),
    "M2_top_k_5_K1": tree_case(1.0, 5, 1.0, 1, "pair", 2),
    "M3_top_p_0.8_K3": tree_case(1.0, 0, 0.8, 3, "ragged", 3),
    "M2_disjoint_support_K3": tree_case(1.0, 0, 1.0, 3, "disjoint", 2),
    "M3_hybrid_draft_is_target_K3": tree_case(1.0, 0, 1.0, 3, "same", 3, "hybrid", prompts="repeats"),
}
NEGATIVE = [("M3_temperature_0.7_K1", "match_own_target_sample"), ("M2_ragged_K3", "longest_of_independent_chains"),
            ("M3_temperature_0.7_K1", "no_residual_update")]
# The default suite runs ragged chains (the tree's own rule, every row length) and the
# biased rule's control; the rest (temperature, p == q, hybrid, ...) with `pytest -m slow`.
DEFAULT = {"M2_ragged_K3", "M3_temperature_0.7_K1-match_own_target_sample"}


def maybe_slow(name, *rest):
    key = "-".join((name,) + rest)
    return pytest.param(name, *rest, marks=[] if key in DEFAULT else [pytest.mark.slow], id=key)


@pytest.mark.parametrize("name", [maybe_slow(n) for n in CASES])
def test_tree_samples_follow_the_exact_target_distribution(models, name, use_rule):
    use_rule(None)
    pvalue, result = run(models, CASES[name])
    print(f"{name}: p = {pvalue:.4f}, tokens/loop {result.tokens_per_loop:.3f}, won by chain "
          f"{result.chain_won.sum(0).tolist()}")
    assert pvalue > ALPHA
    case = CASES[name]
    if case.kind == "same" and case.drafter == "model":
        assert result.histogram[:, :case.K].sum() == 0  # p == q: every loop keeps all K
        assert result.chain_won[:, 1:].sum() == 0  # ... from the first chain
    elif case.kind == "disjoint":
        assert result.accepted.sum() == 0
    else:
        assert result.chain_won[:, 1:].sum() > 0  # later chains really won loops
    if case.drafter == "hybrid":
        assert result.by_drafter(result.accepted_by.sum(0)).get("ngram", 0) > 0


@pytest.mark.parametrize("name,wrong", [maybe_slow(a, b) for a, b in NEGATIVE])
def test_negative_control_wrong_multi_draft_rule_is_rejected(models, name, wrong, use_rule):
    use_rule(wrong)
    pvalue, _ = run(models, CASES[name], n=N_NEGATIVE)
    print(f"{name} with {wrong}: p = {pvalue:.2e}")
    assert pvalue < ALPHA
