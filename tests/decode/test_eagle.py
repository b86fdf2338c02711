"""The EAGLE drafter (`--drafter=eagle`, `specjax.heads.EagleHead`): one decoder layer
drafting in the target's feature space. The checks of the drafting machinery that EAGLE-3
shares (`--drafter=eagle3`: the same drafter over a fusion of the target's layers) run
for both kinds here; EAGLE-3's own (Theorem 1, the training-time test) are in
test_eagle3.py.

- Theorem 1 (the enumeration and chi-square test of `theorem1`, N = 50,000 samples per
  case, one compiled program and one batch each, ALPHA = 0.001) with a random EAGLE layer
  on the one-layer tiny target: K = 1 and 3, temperature 1 and 0.7 with top-p, a ragged
  batch (all in the slow set, with the control); the negative control (p taken before
  warping) is rejected with N_NEGATIVE samples.
- Greedy SpS == greedy ArS token for token, on one device and eight (both kinds).
- The fused loop: one while loop, no host round trip, no cache copied (the target's or
  the layer's own), and the layer's K passes add their own collectives only.
- The state after the prompts and after four loops: the window holds the TARGET's features (a full forward
  of the row's tokens) from `start`, start + count is the pending token's position, and
  the layer's cache before `start` equals a teacher-forced pass of the layer over the
  target's true features (EAGLE-3: its layers' residual streams, fused). The same check
  rejects a wrong variant whose next loop starts from the layer's own predicted features
  (a quality bug, not an exactness one: Theorem 1 cannot see it, this test does). The same
  holds for the layer behind hybrid_eagle3's lookup, after loops the lookup proposed.
- Bad input: Medusa heads for the EAGLE drafter and the reverse, several chains.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import heads as heads_lib, kernels, model
from specjax.config import ConfigError, HeadsConfig, SamplingConfig, UsageError
from specjax.decode import drafters, program, speculative
from specjax.decode.drafters import eagle
from specjax.decode.warping import warp
from specjax.heads import init_heads
from conftest import mesh_for
from models import RAGGED, cache_copies, fused_loop_collectives, tiny_pairs
from theorem1 import ALPHA, N, N_NEGATIVE, Case, assert_case_follows_the_target, make_models, run

EAGLE = HeadsConfig(kind="eagle", init_seed=2)
EAGLE3 = HeadsConfig(kind="eagle3", init_seed=2)  # on tiny's 2 layers: it fuses both (the kind's default)


@pytest.fixture(scope="module")
def models(tiny):
    target, _ = make_models(tiny)
    return target, init_heads(EAGLE, target.cfg, mesh_for("1x1"))


CASES = {
    "ragged_temperature_0.7_top_p_0.8_K3": Case(0.7, 0, 0.8, 3, "ragged", "block", "eagle"),
    "tokenwise_K1": Case(1.0, 0, 1.0, 1, "pair", "tokenwise", "eagle"),
    "ragged_K3": Case(1.0, 0, 1.0, 3, "ragged", "tokenwise", "eagle"),
    # (temperature 0.7 with top-p at K=1 on one prompt: this random layer never proposes
    # a token in q's small support there, so the case would test nothing; K=3 above does.)
    "ragged_top_p_0.9_K1": Case(1.0, 0, 0.9, 1, "ragged", "block", "eagle"),
}
DEFAULT = set()  # every case and the control run with `pytest -m slow` (the default suite's time budget)


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n in DEFAULT else [pytest.mark.slow]) for n in CASES])
def test_samples_follow_the_exact_target_distribution(models, name, patch):
    patch()
    assert_case_follows_the_target(models, CASES[name], name)


# A layer narrower than the target (width 16 of 32) with a draft vocabulary of 20 of the
# 32 tokens, in a scrambled order (an index used as a token id would show), decoding in int8.
NARROW = HeadsConfig(kind="eagle", init_seed=2, width=16, draft_vocab=20, quantize="int8")
NARROW_VOCAB = np.random.default_rng(7).permutation(32)[:20]
NARROW_CASE = Case(0.7, 0, 0.9, 3, "ragged", "tokenwise", "eagle")


@pytest.fixture(scope="module")
def narrow_models(models):
    target, _ = models
    return target, init_heads(NARROW, target.cfg, mesh_for("1x1"), vocab=NARROW_VOCAB)


@pytest.mark.slow
def test_draft_vocabulary_samples_follow_the_exact_target_distribution(narrow_models, patch):
    """p is the warped softmax over the 20 tokens, zero on the other 12: tokens outside
    the draft vocabulary come only from the residual."""
    patch()
    pvalue, result = run(narrow_models, NARROW_CASE, N)
    print(f"eagle draft vocabulary: p = {pvalue:.4f}, acceptance rate {result.acceptance_rate:.3f}")
    assert pvalue > ALPHA
    assert 0 < result.accepted.sum() < result.proposed
    drafted = np.asarray(result.tokens)[:, :1]  # the first token: drafted, or the residual's where rejected
    assert set(np.unique(drafted)) - set(NARROW_VOCAB.tolist()), "no token outside the draft vocabulary came back"


@pytest.mark.slow
def test_negative_control_draft_vocabulary_spread_onto_the_wrong_ids(narrow_models, patch):
    """x drawn right, p spread onto the first N ids instead of the draft vocabulary's."""
    patch([(heads_lib.Unembedding, "spread", lambda self, probs: jnp.zeros(
        probs.shape[:-1] + (self.target.cfg.vocab_size,), probs.dtype).at[..., :probs.shape[-1]].set(probs))])
    pvalue, _ = run(narrow_models, NARROW_CASE, N_NEGATIVE)
    assert pvalue < ALPHA


@pytest.mark.slow
def test_negative_control_p_before_warping_is_rejected(models, patch):
    """Tokens drawn from the warped softmax, p reported as the plain one."""
    correct = eagle.EagleDrafter.propose

    def unwarped_p(self, state, tokens, length, key, lookahead, num_drafts, warping):
        prop, new_state, bad = correct(self, state, tokens, length, key, lookahead, num_drafts, warping)
        return prop._replace(p=unwarped_distributions(self, state, prop.x[:, 0], tokens, lookahead)), new_state, bad

    patch([(eagle.EagleDrafter, "propose", unwarped_p)])
    pvalue, _ = run(models, CASES["ragged_temperature_0.7_top_p_0.8_K3"], N_NEGATIVE)
    assert pvalue < ALPHA


def unwarped_distributions(drafter, state, x, tokens, K):
    """softmax of the layer's logits along the chain x (teacher-forced on x itself)."""
    return teacher_forced(drafter, state, x, tokens, K)[:, None]


@pytest.mark.parametrize("kind,temperature,top_p", [("eagle", 1.0, 1.0), ("eagle", 0.7, 0.8), ("eagle3", 0.7, 0.8)])
def test_a_narrow_layer_folds_w_up_into_its_steps(narrow_models, kind, temperature, top_p):
    """A narrow layer with a draft vocabulary (float here) drafts with w_up folded into the
    columns and the next step's w_feature (`heads.Folded`; EAGLE-3's window pass also
    w_fuse into w_feature): its p along the chain it drew equals the unfolded layer's
    teacher-forced on that chain (D-wide features, w_up, then the draft vocabulary's
    columns and the same warping) to float rounding; the drafter holds the folded [W, W]
    weight (and EAGLE-3's [2 * D, W])."""
    target, heads = narrow_models
    if kind == "eagle3":  # the two-layer tiny target, both layers fused
        target = model.init_lm(dataclasses.replace(target.cfg, num_layers=2), mesh_for("1x1"))
        heads = init_heads(dataclasses.replace(NARROW, kind=kind), target.cfg, mesh_for("1x1"), vocab=NARROW_VOCAB)
        assert heads.features == (1, 2)
    heads = dataclasses.replace(heads, cfg=dataclasses.replace(heads.cfg, quantize=""))
    target = target.packed()
    cls = drafters.kind(kind)
    drafter = cls.make(SamplingConfig(lookahead=3, drafter=kind), target, heads, None, None)
    W = NARROW.width
    assert drafter.feature_weight is not None and kernels.stored(drafter.feature_weight).shape == (W, W)
    if kind == "eagle3":  # its window pass reads the two layers through w_fuse w_feature folded
        assert kernels.stored(drafter.window_weight).shape == (2 * target.cfg.d_model, W)
    else:
        assert drafter.window_weight is None
    assert kernels.stored(drafter.unembed.columns).shape == (W, NARROW.draft_vocab)
    prompts = jnp.asarray([[5, 9, 2, 7, 1, 30], [4, 11, 8, 0, 0, 0]])
    lens = jnp.asarray([6, 3])
    warping = program.warping_of(SamplingConfig(temperature=temperature, top_p=top_p))
    settings = speculative.Settings(3, warping)
    state = speculative.start(target, drafter, prompts, lens, jax.random.key(0), settings, 32)
    tokens = jnp.concatenate([prompts, jnp.zeros((2, 26), jnp.int32)], axis=1)
    prop, _, bad = drafter.propose(state.drafter_state, tokens, lens, jax.random.key(1), 3, 1, warping)
    assert not np.any(np.asarray(bad))
    plain = cls(heads.packed(target), target, 3, None, heads_lib.unembedding(heads, target))
    want = teacher_forced(plain, state.drafter_state, prop.x[:, 0], tokens, 3, warping)
    np.testing.assert_allclose(np.asarray(prop.p[:, 0]), np.asarray(want), rtol=1e-4, atol=1e-5)


def teacher_forced(drafter, state, x, tokens, K, warping=None):
    """The layer's p along the chain x, teacher-forced on x itself, unfolded: its window
    pass, then its d_model-wide feature scored by its unembedding (the draft vocabulary's
    columns where it has one) and fed back through w_feature; warped by `warping`, or the
    plain softmax where None. (EAGLE-3: the window's layer features fused first.)"""
    positions = state.start[:, None] + jnp.arange(K + 1)[None, :]
    after = jnp.take_along_axis(tokens, jnp.clip(positions + 1, 0, tokens.shape[1] - 1), axis=1)
    predicted, cache = drafter.heads.eagle_step(drafter.target, drafter.heads.fused(state.window), after, positions,
                                                state.cache)
    pending = state.start + state.count
    cache = cache.with_lengths(pending)
    feature = jnp.take_along_axis(predicted, (state.count - 1)[:, None, None], axis=1)
    unembed = drafter.unembed if drafter.unembed is not None else heads_lib.Unembedding(drafter.target)
    out = []
    for j in range(K):
        logits = unembed.logits(feature)[:, 0]
        out.append(unembed.spread(jax.nn.softmax(logits, axis=-1) if warping is None else warp(logits, warping)[0]))
        if j < K - 1:
            feature, cache = drafter.heads.eagle_step(drafter.target, feature, x[:, j:j + 1], (pending + j)[:, None],
                                                      cache)
    return jnp.stack(out, axis=1)


@pytest.fixture(scope="module")
def pairs(tiny):
    return {name: (target, init_heads(EAGLE, target.cfg, mesh_for(name)))
            for name, (target, _) in tiny_pairs(tiny).items()}


@pytest.fixture(scope="module")
def pairs3(pairs):
    """EAGLE-3 layers on the same targets (tiny's two layers, fused)."""
    return {name: (target, init_heads(EAGLE3, target.cfg, mesh_for(name))) for name, (target, _) in pairs.items()}


@pytest.mark.parametrize("kind,mesh_name,narrow", [
    ("eagle", "1x1", False), ("eagle", "1x1", True), pytest.param("eagle", "1x8", False, marks=pytest.mark.slow),
    ("eagle", "1x8", True), ("eagle3", "1x1", False), ("eagle3", "1x1", True),
    pytest.param("eagle3", "1x8", False, marks=pytest.mark.slow), ("eagle3", "1x8", True)])
def test_greedy_sps_equals_greedy_ars(pairs, pairs3, kind, mesh_name, narrow):
    target, heads = (pairs if kind == "eagle" else pairs3)[mesh_name]
    greedy = SamplingConfig(temperature=0, lookahead=4, max_new_tokens=64, drafter=kind)
    if narrow:  # a narrower quantized layer and a draft vocabulary (on a mesh: its columns whole on every device)
        quantize = "w4a8" if mesh_name == "1x1" else "int8"  # int4 codes times int8 activations on one device
        cfg = dataclasses.replace(NARROW, quantize=quantize, kind=kind)
        heads = init_heads(cfg, target.cfg, mesh_for(mesh_name), vocab=NARROW_VOCAB)
        drafter = drafters.kind(kind).make(greedy, target, heads, None, None)
        is_q = lambda x: isinstance(x, kernels.QUANTIZED)  # noqa: E731
        weights = [w for w in jax.tree.leaves((drafter.heads.params, drafter.unembed.columns), is_leaf=is_q)
                   if is_q(w) or isinstance(w, kernels.Packed)]
        want = kernels.Int8 if quantize == "int8" else kernels.Grouped
        assert weights and all(isinstance(w, want) for w in weights), {type(w).__name__ for w in weights}
        if quantize == "w4a8":
            assert {w.activations for w in weights} == {"int8"}
    ars = specjax.generate(target, None, RAGGED, dataclasses.replace(greedy, drafter="model"))
    sps = specjax.generate(target, heads, RAGGED, greedy)
    assert sps.tokens == ars.tokens
    assert sps.accepted.sum() > 0 and sps.summary()["proposed_by"].keys() == {kind}


def test_one_fused_loop_and_no_cache_copy(pairs):
    target, heads = pairs["1x8"]
    K = 4
    sampling = SamplingConfig(temperature=0.8, top_p=0.9, lookahead=K, max_new_tokens=32, drafter="eagle")
    built = program.build(target, heads, RAGGED, sampling, seed=0)
    per_loop = fused_loop_collectives(built)
    assert not cache_copies(built)
    # The target's one pass (2 per layer + the embedding), and the layer's K passes (the
    # window, then K-1 steps), each its block's 2: the tokens it reads are embedded from the
    # drafter's whole copy of the table, with no collective.
    total = sum(n for c, n in per_loop.items() if c.kind == "all-reduce")
    assert total == 2 * target.cfg.num_layers + 1 + K * 2, per_loop


def test_draft_vocabulary_logits_need_no_collective(pairs):
    """With a draft vocabulary the layer's feature is scored against a copy of those
    columns whole on every device: the K draws' logits are not all-gathered (the target's
    scoring pass's one all-gather stays), and the all-reduces are the same."""
    target, heads = pairs["1x8"]
    K = 4
    sampling = SamplingConfig(temperature=0.8, top_p=0.9, lookahead=K, max_new_tokens=32, drafter="eagle")
    narrow = init_heads(dataclasses.replace(NARROW, width=0), target.cfg, mesh_for("1x8"), vocab=NARROW_VOCAB)
    count = {}
    for name, h in (("whole", heads), ("draft vocabulary", narrow)):
        per_loop = fused_loop_collectives(program.build(target, h, RAGGED, sampling, seed=0))
        count[name] = {kind: sum(n for c, n in per_loop.items() if c.kind == kind) for kind in ("all-reduce", "all-gather")}
    assert count["whole"]["all-gather"] == K + 1 and count["draft vocabulary"]["all-gather"] == 1, count
    assert count["whole"]["all-reduce"] == count["draft vocabulary"]["all-reduce"], count


def test_whole_table_embeds_as_the_vocab_parallel_lookup(pairs):
    """The drafter's copy of the table (1x8: whole on every device, made once per LM; one
    device: none) gives the embeddings the vocab-parallel lookup gives."""
    target = pairs["1x8"][0]
    table = model.whole_table(target)
    assert table.sharding.is_fully_replicated and model.whole_table(target) is table
    assert model.whole_table(pairs["1x1"][0]) is None
    tokens = (jnp.arange(24, dtype=jnp.int32).reshape(2, 12) * 37) % target.cfg.vocab_size
    with jax.set_mesh(target.params["embed"].value.sharding.mesh):
        lookup = jax.jit(target.embed)(tokens)
        gathered = jax.jit(lambda t: target.embed(t, table))(tokens)
    np.testing.assert_array_equal(np.asarray(gathered), np.asarray(lookup))


def run_loops(target, heads, prompts, loops, hybrid=False):
    """The loop state after `loops` loops (the loop body `generate` runs), at temperature 1;
    `hybrid`: the layer as hybrid_eagle3's fallback, behind a 3-token prompt lookup."""
    drafter = drafters.kind(heads.cfg.kind)(heads, target.packed(), 3)
    if hybrid:
        drafter = drafters.HybridEagle3Drafter(drafter, (drafters.NgramDrafter(3, target.cfg.vocab_size),))
    width = max(map(len, prompts))
    tokens = jnp.asarray([p + [0] * (width - len(p)) for p in prompts])
    settings = speculative.Settings(3, program.warping_of(SamplingConfig(temperature=1.0)))
    state = START(target.packed(), drafter, tokens, jnp.asarray([len(p) for p in prompts]), jax.random.key(3),
                  settings, 64)
    for _ in range(loops):
        state = LOOP(target.packed(), drafter, state, settings, jnp.int32(40), -1)
    return state


# Compiled once for every call of run_loops (the models are arguments, the settings static).
START = jax.jit(speculative.start, static_argnames=("settings", "size"))
LOOP = jax.jit(speculative.loop, static_argnames=("settings", "eos_id"))


def state_errors(target, heads, state) -> list[str]:
    """Where the EAGLE state differs from the target's true features / a teacher-forced pass."""
    st = state.drafter_state
    out = []
    # Both references over every row at full width, one compiled pass each: the target and
    # the layer are causal, so a row's positions before its length see only its own tokens.
    tokens = state.tokens
    _, hidden_all = jax.jit(lambda lm, t: model.full_forward(lm, t, features=heads.features))(target, tokens)
    B, W = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(W - 1), (B, W - 1))
    _, fresh_all = jax.jit(lambda h, lm, t: h(h.fused(hidden_all[:, :-1]), lm.embed(t[:, 1:]), positions,
                                              h.empty_cache(B, 0)))(heads, target, tokens)
    for b in range(B):
        n = int(state.length[b])
        hidden = hidden_all[b:b + 1, :n]
        start, count = int(st.start[b]), int(st.count[b])
        if start + count != n - 1 and n > 1:  # a one-token prompt's own feature stands in before it
            out.append(f"row {b}: start {start} + count {count} != pending {n - 1}")
        if not np.allclose(st.window[b, :count], hidden[0, start:start + count], atol=1e-4):
            out.append(f"row {b}: the window is not the target's features")
        if start == 0:
            continue  # nothing cached before the window
        cached = st.cache.k[0, b, :, :start]  # [G, start, H]
        want = jnp.swapaxes(fresh_all.k[0, b, :start], 0, 1)
        if not np.allclose(cached, want, atol=1e-4):
            out.append(f"row {b}: the layer's cache before {start} is not its pass over the true features")
    return out


@pytest.mark.parametrize("kind", [pytest.param("eagle", marks=pytest.mark.slow),  # the default set's time budget
                                  "eagle3", pytest.param("hybrid_eagle3", marks=pytest.mark.slow)])
def test_each_loop_starts_from_the_targets_features(pairs, pairs3, patch, kind):
    """hybrid_eagle3: loops whose tokens the n-gram lookup proposed (the first loop's for
    every row, where the layer's draft steps are skipped) leave the layer's state as its
    own loops do."""
    target, heads = (pairs if kind == "eagle" else pairs3)["1x1"]
    hybrid = kind == "hybrid_eagle3"
    prompts = [[5, 9, 2, 7, 1, 30], [4, 11], [8]] if not hybrid else [[5, 9, 2, 7, 5, 9, 2], [4, 11, 3, 4, 11, 3, 4, 11]]
    for loops in (0, 1, 4) if hybrid else (0, 4):
        state = run_loops(target, heads, prompts, loops, hybrid)
        assert not state_errors(target, heads, state), (loops, state_errors(target, heads, state))
        if hybrid and loops:  # the lookup proposed every row's first chain; the layer later ones
            proposed = np.asarray(state.stats.proposed_by)
            assert proposed[:, drafters.SOURCES.index("ngram")].min() > 0, proposed
            assert loops == 1 or proposed[:, drafters.SOURCES.index("eagle3")].sum() > 0, proposed
    # The wrong variant: the window keeps the layer's own predictions (its cache is not
    # rolled back over them either), only the bookkeeping moves on.
    stale = lambda self, state, verdict: state._replace(  # noqa: E731
        start=jnp.maximum(verdict.length - 2 - verdict.num_accepted, 0), count=verdict.num_accepted + 1)
    patch([(eagle.EagleDrafter, "update", stale)])  # drops the compiled loop: the swap is traced in
    assert state_errors(target, heads, run_loops(target, heads, prompts, 4, hybrid))


def test_rows_the_lookup_proposes_skip_only_the_layers_draft_steps(pairs3):
    """hybrid_eagle3 asks the layer for no row (`active` all False) where the lookup matched
    every row: the layer's draft steps are skipped, and its cache still holds the window
    pass over the true features up to the pending token (the rollback in `update` keeps
    those: they were the draft steps' own predictions before). Rows not asked for report no
    nonfinite draft."""
    target, heads = pairs3["1x1"]
    state = run_loops(target, heads, [[5, 9, 2, 7, 1, 30], [4, 11]], 4)  # the draft steps wrote past pending
    drafter = drafters.kind("eagle3")(heads, target.packed(), 3)
    warping = program.warping_of(SamplingConfig(temperature=1.0))
    args = (state.drafter_state, state.tokens, state.length, jax.random.key(5), 3, 1, warping)
    _, drawn, _ = drafter.propose(*args)
    _, skipped, bad = drafter.propose(*args, active=jnp.zeros((2, 1), bool))
    pending = np.asarray(state.length) - 1
    for b in range(2):
        np.testing.assert_allclose(skipped.cache.k[:, b, :, :pending[b]], drawn.cache.k[:, b, :, :pending[b]], atol=1e-6)
        np.testing.assert_allclose(skipped.cache.v[:, b, :, :pending[b]], drawn.cache.v[:, b, :, :pending[b]], atol=1e-6)
    assert not np.asarray(bad).any()


def test_bad_input_names_the_problem(pairs):
    target, heads = pairs["1x1"]
    medusa = init_heads(HeadsConfig(num_heads=4), target.cfg, mesh_for("1x1"))
    with pytest.raises(UsageError, match="drafter='eagle' needs an EAGLE layer .*got medusa heads"):
        specjax.generate(target, medusa, [[1, 2]], SamplingConfig(lookahead=2, max_new_tokens=4, drafter="eagle"))
    with pytest.raises(UsageError, match="drafter='medusa' needs Medusa heads .*got eagle heads"):
        specjax.generate(target, heads, [[1, 2]], SamplingConfig(lookahead=2, max_new_tokens=4, drafter="medusa"))
    with pytest.raises(ConfigError, match="num_drafts=2 with drafter='eagle'"):
        SamplingConfig(num_drafts=2, drafter="eagle").validate()
    with pytest.raises(UsageError, match="heads.width=12: must be a multiple of the target's head_dim=8"):
        init_heads(HeadsConfig(kind="eagle", width=12), target.cfg, mesh_for("1x1"))
    with pytest.raises(UsageError, match="heads.draft_vocab=40: the target has only 32 tokens"):
        init_heads(HeadsConfig(kind="eagle", draft_vocab=40), target.cfg, mesh_for("1x1"))
    with pytest.raises(UsageError, match="draft vocabulary of heads.draft_vocab=4 distinct token ids below 32"):
        init_heads(HeadsConfig(kind="eagle", draft_vocab=4), target.cfg, mesh_for("1x1"), vocab=[1, 2, 2, 3])
    # Only the options given are named (not the defaults beside them), with what fixes it.
    with pytest.raises(ConfigError, match=r"^heads.draft_vocab=8: only EAGLE heads have it, these are 'medusa'; "
                                          r"set heads.kind='eagle' or 'eagle3' with it, or leave it unset$"):
        HeadsConfig(kind="medusa", draft_vocab=8).validate()
    with pytest.raises(ConfigError, match=r"^heads.width=64, heads.ttt_steps=2: only EAGLE heads have them"):
        HeadsConfig(kind="medusa", width=64, ttt_steps=2).validate()
