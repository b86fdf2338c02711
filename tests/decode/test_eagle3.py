"""The EAGLE-3 drafter (`--drafter=eagle3`; Li et al. 2025, arXiv 2503.01840): the EAGLE
layer over a fusion of several target layers' residual streams, trained by the
training-time test. What it shares with `eagle` (greedy SpS == ArS on one device and
eight, the state after each loop, the folded narrow layer) is tested for both kinds in
test_eagle.py.

- Theorem 1 (`theorem1`: N = 50,000 samples per case, chi-square at ALPHA = 0.001) on the
  one-layer target with a layer that drafts about as it samples (`mimicking`, through the
  fusion projection; acceptance ~0.4), all in the slow set (as EAGLE's):
  temperature 0.7 with top-k and top-p at K = 3 (block verification, a ragged batch),
  temperature 1 token-wise at K = 2, temperature 1.3 with top-p, and the layer in int8
  with a draft vocabulary. The negative control (the token drawn from sqrt(p),
  renormalised, p reported as drawn from p) is rejected by the same test with N_NEGATIVE.
  The same for hybrid_eagle3 (the prompt lookup's chain where a row's 3-token suffix
  recurs, else the layer's) at temperature 1 (block) and 0.7 with top-k (token-wise, a
  batch of rows that match and rows that do not); its control verifies the lookup's rows
  with the layer's p.
- The forward's layer features: the residual stream after n layers, through the final
  norm, is the final hidden state of the target cut to its first n layers (a self-draft
  `layers:n`, another path through the model).
- The training-time test (`heads.training_time_test`) computes what drafting computes: at
  every step j and row t, the feature the layer predicts after a window pass over the
  true pairs up to t and j steps on its own features, run with its KV cache as the
  drafter runs it. Wrong visibilities (a step's rows seeing the earlier steps' rows at
  other positions, or everything) fail.
- Bad input: layers beyond the target's depth, heads of the other EAGLE kind, config checks.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from specjax import heads as heads_lib, model
from specjax.config import ConfigError, HeadsConfig, SamplingConfig, UsageError, load_config
from specjax.decode import verify
from specjax.decode.drafters import base, eagle
from specjax.heads import init_heads
from specjax.weights.self_draft import self_draft
from conftest import mesh_for
from theorem1 import ALPHA, N, N_NEGATIVE, Case, assert_case_follows_the_target, make_models, peeks_at_target, run

EAGLE3 = HeadsConfig(kind="eagle3", init_seed=3)


def mimicking(heads, target, feature_noise: float = 0.3):
    """`heads` (full width, on a one-layer target) made to draft about as the target
    samples, so that acceptances and rejections are both frequent (a random layer's p
    hardly overlaps the sharpened q: acceptance ~2%, and a control would test nothing):
    the layer's block is a copy of the target's one layer and reads the embedding of the
    token as it is (w_token = I; pair j sits at position j, the target's token j+1 at j+1:
    rotary scores depend on differences only), plus the fused target feature through a
    random w_feature scaled by `feature_noise` (so p depends on the fusion: with 0.3 the
    acceptance is ~0.44, with 0 ~0.58). It differs from q by the window's missing first
    token, the final norm and that noise."""
    params = jax.tree.map(lambda x: x, heads.params)
    params["block"] = jax.tree.map(lambda x: x, target.params["layers"][0])
    params["w_token"].set_value(jnp.eye(target.cfg.d_model, dtype=params["w_token"][...].dtype))
    params["w_feature"].set_value(params["w_feature"][...] * feature_noise)
    return dataclasses.replace(heads, params=params)


@pytest.fixture(scope="module")
def models(tiny):
    target, _ = make_models(tiny)
    heads = init_heads(EAGLE3, target.cfg, mesh_for("1x1"), random=True)
    assert heads.features == (1,) and "w_fuse" in heads.params  # the fused path, on the one layer there is
    return target, mimicking(heads, target)


CASES = {
    "ragged_temperature_0.7_top_k_12_top_p_0.9_K3": Case(0.7, 12, 0.9, 3, "ragged", "block", "eagle3"),
    "tokenwise_K2": Case(1.0, 0, 1.0, 2, "pair", "tokenwise", "eagle3"),
    "ragged_temperature_1.3_top_p_0.95_K3": Case(1.3, 0, 0.95, 3, "ragged", "tokenwise", "eagle3"),
}
DEFAULT = set()  # every case and the control run with `pytest -m slow` (the default suite's time budget)


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n in DEFAULT else [pytest.mark.slow]) for n in CASES])
def test_samples_follow_the_exact_target_distribution(models, name, patch):
    patch()
    assert_case_follows_the_target(models, CASES[name], name)


# hybrid_eagle3: a full 3-token suffix match proposes the prompt lookup's chain (a point
# mass), else the layer its own (prompts whose suffixes recur, and one beside them that
# does not). The control verifies the lookup's rows with the layer's p instead. The
# adaptive case scores each pass as wide as the longest row's proposal; in a batch of
# 50,000 rows some row nearly always drafts all K, so it checks the full-width pass too.
HYBRID = {
    "hybrid_repeats_K3": Case(1.0, 0, 1.0, 3, "repeats", "block", "hybrid_eagle3"),
    "hybrid_mixed_temperature_0.7_top_k_12_K2": Case(0.7, 12, 1.0, 2, "mixed", "tokenwise", "hybrid_eagle3"),
    "hybrid_mixed_adaptive_0.5_K3_pass_as_proposed": Case(1.0, 0, 1.0, 3, "mixed", "block", "hybrid_eagle3",
                                                          draft_confidence=0.5, pass_width="proposed"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(HYBRID))
def test_hybrid_samples_follow_the_exact_target_distribution(models, name, patch):
    patch()
    pvalue, result = run(models, HYBRID[name], N)
    proposed = result.summary()["proposed_by"]
    print(f"{name}: p = {pvalue:.4f}, acceptance rate {result.acceptance_rate:.3f}, proposed by {proposed}")
    assert pvalue > ALPHA
    assert proposed.get("ngram", 0) > 0 and proposed.get("eagle3", 0) > 0 and set(proposed) == {"ngram", "eagle3"}
    assert 0 < result.accepted.sum() < result.proposed
    if HYBRID[name].draft_confidence:  # the layer's rows stopped early, some drafted all K
        assert_lengths_vary(result, HYBRID[name].K)


# The adaptive draft length (draft_confidence, EAGLE-2's): a row stops after a draw whose
# top probability is below 0.5 (0.3 at temperature 0.7, whose warped draws are sharper),
# on the layer's side only. Its control cuts the draft where the target would reject.
ADAPTIVE = {
    "adaptive_0.5_ragged_K3": Case(1.0, 0, 1.0, 3, "ragged", "block", "eagle3", draft_confidence=0.5),
    "adaptive_0.6_temperature_0.7_top_p_0.9_K4": Case(0.7, 0, 0.9, 4, "pair", "tokenwise", "eagle3",
                                                      draft_confidence=0.6),
}


def assert_lengths_vary(result, K):
    lengths = np.flatnonzero(result.drafted.sum(0))
    assert len(lengths) > 1 and lengths.max() == K, lengths


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ADAPTIVE))
def test_adaptive_samples_follow_the_exact_target_distribution(models, name, patch):
    patch()
    pvalue, result = run(models, ADAPTIVE[name], N)
    print(f"{name}: p = {pvalue:.4f}, acceptance rate {result.acceptance_rate:.3f}, lengths "
          f"{result.summary()['drafted_histogram']}")
    assert pvalue > ALPHA
    assert 0 < result.accepted.sum() < result.proposed
    assert_lengths_vary(result, ADAPTIVE[name].K)


@pytest.mark.slow
def test_negative_control_adaptive_length_that_peeks_at_the_target_is_rejected(models, patch):
    patch([(verify, "accept_block", peeks_at_target)])
    pvalue, _ = run(models, ADAPTIVE["adaptive_0.5_ragged_K3"], N_NEGATIVE)
    assert pvalue < ALPHA


@pytest.mark.parametrize("drafter", ["eagle3", "hybrid_eagle3"])
def test_greedy_with_an_adaptive_length_equals_greedy_ars(models, drafter):
    """draft_confidence at temperature 0 reads the layer's plain softmax (the warped one is
    a point mass): rows stop at different lengths, and the tokens are greedy ArS's."""
    target, heads = models
    prompts = [[5, 9, 2, 7, 1, 30], [4, 11], [3, 8, 3, 8, 3, 8]]
    greedy = SamplingConfig(temperature=0, lookahead=4, max_new_tokens=24, drafter=drafter, draft_confidence=0.5)
    ars = specjax.generate(target, None, prompts, dataclasses.replace(greedy, drafter="model", draft_confidence=0))
    sps = specjax.generate(target, heads, prompts, greedy)
    assert sps.tokens == ars.tokens
    assert sps.accepted.sum() > 0 and sps.summary()["proposed_by"].get("eagle3", 0) > 0
    assert len(np.flatnonzero(sps.drafted.sum(0)[1:])) > 1  # more than one length of the layer's chains


@pytest.mark.slow
def test_negative_control_lookup_rows_verified_with_the_layers_p(models, patch):
    real = base.select
    patch([(base, "select", lambda use, first, second: real(use, first, second)._replace(p=second.p))])
    pvalue, _ = run(models, HYBRID["hybrid_repeats_K3"], N_NEGATIVE)
    assert pvalue < ALPHA


@pytest.mark.slow
def test_int8_layer_with_a_draft_vocabulary_follows_the_target(models, patch):
    """The layer decoding from an int8 copy of itself, scoring 20 of the 32 tokens (in a
    scrambled order; the fold of a narrow layer is checked in test_eagle.py)."""
    target, heads = models
    cfg = dataclasses.replace(heads.cfg, draft_vocab=20, quantize="int8")
    vocab = jnp.asarray(np.random.default_rng(7).permutation(32)[:20], jnp.int32)
    heads = dataclasses.replace(heads, cfg=cfg, vocab=vocab)
    patch()
    pvalue, result = run((target, heads), Case(0.7, 0, 0.9, 3, "ragged", "tokenwise", "eagle3"), N)
    print(f"eagle3 int8, draft vocabulary: p = {pvalue:.4f}, acceptance rate {result.acceptance_rate:.3f}")
    assert pvalue > ALPHA
    assert 0 < result.accepted.sum() < result.proposed


@pytest.mark.slow
def test_negative_control_token_not_drawn_from_p_is_rejected(models, patch):
    """Each draft token drawn from sqrt(p) (renormalised: flatter), while p is what
    verification reads."""
    real = eagle.draw

    def flattened(key, probs, warping):
        root = jnp.sqrt(probs)
        return real(key, root / jnp.sum(root, axis=-1, keepdims=True), warping)

    patch([(eagle, "draw", flattened)])
    pvalue, _ = run(models, CASES["ragged_temperature_0.7_top_k_12_top_p_0.9_K3"], N_NEGATIVE)
    assert pvalue < ALPHA


def test_layer_features_are_the_residual_stream_after_n_layers(tiny):
    """features=(n, ...) gives [B, T, len * D]; through the final norm, slice n is the final
    hidden state of the target's first n layers (`self_draft` layers:n), and n = L the
    full forward's; features=False and True are unchanged."""
    cfg = dataclasses.replace(tiny.target, num_layers=3)
    target = model.init_lm(cfg, mesh_for("1x1"))
    tokens = jnp.asarray([[5, 9, 2, 7, 1, 30, 4], [4, 11, 8, 0, 3, 3, 1]])
    logits, hidden = model.full_forward(target, tokens, features=True)
    got_logits, layers = model.full_forward(target, tokens, features=(1, 2, 3))
    D = cfg.d_model
    assert layers.shape == (2, 7, 3 * D)
    np.testing.assert_array_equal(np.asarray(got_logits), np.asarray(logits))
    norm = nnx.merge(target.graphdef, target.params).final_norm
    for i, n in enumerate((1, 2, 3)):
        cut = self_draft(target, f"layers:{n}") if n < 3 else target
        _, want = model.full_forward(cut, tokens, features=True)
        np.testing.assert_allclose(np.asarray(norm(layers[..., i * D:(i + 1) * D])), np.asarray(want), atol=1e-5)
    assert model.full_forward(target, tokens).shape == logits.shape
    one = model.full_forward(target, tokens, features=(2,))[1]
    np.testing.assert_array_equal(np.asarray(one), np.asarray(layers[..., D:2 * D]))


@jax.jit
def drafting_recurrence(heads, target, inputs, hidden):
    """[B, T-1, steps, D]: row t, step j, the feature the drafter's own path predicts: a
    window pass (into the layer's cache) over the fused true pairs, the cache rolled back
    to the pairs 0..t (what `EagleDrafter.update` does), then j steps on its own output.
    One row per (sequence, t); entries past the sequence's end are left over."""
    B, T = inputs.shape
    steps = STEPS
    positions = jnp.broadcast_to(jnp.arange(T - 1), (B, T - 1))
    predicted, cache = heads.eagle_step(target, heads.fused(hidden[:, :-1]), inputs[:, 1:], positions,
                                        heads.empty_cache(B, T + steps))
    rows = lambda a: jnp.repeat(a, T - 1, axis=0)  # noqa: E731  (sequence b, t) -> row b * (T-1) + t
    t = jnp.tile(jnp.arange(T - 1), B)
    cache = dataclasses.replace(cache, k=jnp.repeat(cache.k, T - 1, axis=1), v=jnp.repeat(cache.v, T - 1, axis=1),
                                lengths=t + 1)
    feature = predicted.reshape(B * (T - 1), 1, -1)
    tokens = rows(inputs)
    out = [feature[:, 0]]
    for j in range(1, steps):
        token = jnp.take_along_axis(tokens, jnp.minimum(t + 1 + j, T - 1)[:, None], axis=1)
        feature, cache = heads.eagle_step(target, feature, token, (t + j)[:, None], cache)
        out.append(feature[:, 0])
    return jnp.stack(out, axis=1).reshape(B, T - 1, steps, -1)


STEPS = 4


def test_training_time_test_computes_what_drafting_computes(tiny, patch):
    target = model.init_lm(tiny.target, mesh_for("1x1"))
    heads = init_heads(dataclasses.replace(EAGLE3, width=16), target.cfg, mesh_for("1x1"), random=True)
    inputs = jax.random.randint(jax.random.key(0), (2, 9), 0, 32)
    _, hidden = model.full_forward(target, inputs, features=heads.features)
    want = np.asarray(drafting_recurrence(heads, target, inputs, hidden))

    def errors():
        got = jax.jit(heads_lib.training_time_test, static_argnums=4)(heads, target, inputs, hidden, STEPS)
        assert [g.shape for g in got] == [(2, 8 - j, 32) for j in range(STEPS)]
        return [j for j in range(STEPS) if not np.allclose(np.asarray(got[j]), want[:, :8 - j, j], atol=2e-5)]

    assert errors() == []
    # Wrong: a step's rows see every earlier step's rows up to their own (the earlier steps'
    # predictions at other positions leak in).
    real = heads_lib.test_visibility
    patch([(heads_lib, "test_visibility", lambda T, j: np.concatenate(
        [np.arange(T - 1 - i)[None, :] <= np.arange(T - 1 - j)[:, None] for i in range(j)], axis=1))])
    assert errors() == [2, 3]
    patch([(heads_lib, "test_visibility", lambda T, j: np.ones_like(real(T, j)))])  # the future too
    assert errors() == [1, 2, 3]


def test_bad_input_names_the_problem(models):
    target, heads = models
    mesh = mesh_for("1x1")
    with pytest.raises(UsageError, match=r"heads.feature_layers=\(1, 2\): the target has 1 layer \(each must be"):
        init_heads(dataclasses.replace(EAGLE3, feature_layers=(1, 2)), target.cfg, mesh)
    plain = init_heads(HeadsConfig(kind="eagle"), target.cfg, mesh)
    with pytest.raises(UsageError, match="drafter='eagle3' needs an EAGLE-3 layer .*got eagle heads"):
        specjax.generate(target, plain, [[1, 2]], SamplingConfig(lookahead=2, max_new_tokens=4, drafter="eagle3"))
    with pytest.raises(UsageError, match="drafter='eagle' needs an EAGLE layer .*got eagle3 heads"):
        specjax.generate(target, heads, [[1, 2]], SamplingConfig(lookahead=2, max_new_tokens=4, drafter="eagle"))
    for layers in ((0, 1), (2, 1), (1, 1)):
        with pytest.raises(ConfigError, match=r"heads.feature_layers=.*must be increasing layer counts >= 1"):
            dataclasses.replace(EAGLE3, feature_layers=layers).validate()
    with pytest.raises(ConfigError, match=r"heads.ttt_steps=17: must be an integer in \[0, 16\]"):
        dataclasses.replace(EAGLE3, ttt_steps=17).validate()
    with pytest.raises(ConfigError, match="heads.ttt_steps=2: only EAGLE heads"):
        HeadsConfig(kind="medusa", ttt_steps=2).validate()
    with pytest.raises(ConfigError, match="num_drafts=2 with drafter='eagle3'"):
        SamplingConfig(num_drafts=2, drafter="eagle3").validate()
    assert load_config("tiny", ["heads.kind=eagle3", "heads.feature_layers=1,2"]).heads.feature_layers == (1, 2)
    with pytest.raises(ConfigError, match="--config.heads.feature_layers='1,x': not a valid tuple"):
        load_config("tiny", ["heads.kind=eagle3", "heads.feature_layers=1,x"])


@pytest.mark.parametrize("num_layers,want", [(1, (1,)), (2, (1, 2)), (6, (2, 3)), (32, (2, 16, 29))])
def test_default_layers_are_eagle3s(num_layers, want):
    """EAGLE-3's code hooks the residual stream entering 0-based layers 2, L // 2 and L - 3:
    after that many layers; clipped to 1..L, repeats dropped. 'eagle' reads the final state."""
    assert HeadsConfig(kind="eagle3").layers_for(num_layers) == want
    assert HeadsConfig(kind="eagle").layers_for(num_layers) == ()
    assert (HeadsConfig(kind="eagle3").test_steps, HeadsConfig(kind="eagle").test_steps) == (7, 1)
