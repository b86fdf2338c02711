"""Self-drafts (`--self_draft=layers:N`, `specjax.self_draft`): the target's first N
layers with its embedding, final norm and unembedding, sharing the target's arrays.

- Logits: equal to an N-layer model built the ordinary way (`abstract_lm` of a config
  with num_layers=N, its params fresh device arrays holding copies of the target's
  values: layer i's for i < N, the rest as they are). That model is independent of
  `self_draft`: its own graph, its own buffers, a stack of exactly N (the scan over xs),
  so a wrong layer choice, norm or table, or a wrong index into a longer stack shows.
  `random_lm` makes every param random (norm scales too), so no mistake hides behind ones.
- Memory: every draft leaf is one of the target's buffers (plain or packed): no copy.
- Greedy SpS with the self-draft equals greedy ArS, for each verifier and a tree.
- Theorem 1 (the enumeration and chi-square test of `theorem1`, N = 50,000, ALPHA =
  0.001) with a two-layer target and its one-layer self-draft, and its negative control
  (no ratio test: keep every draft token) rejected with N_NEGATIVE samples; the same
  for a Gemma-3-shaped target (sliding window shorter than the prompts, q/k norms, four
  norms per layer, GeGLU) and its first, sliding layer (slow).
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import kernels, model, sharding
from specjax.config import SamplingConfig, UsageError
from specjax.decode import drafters, speculative, verify
from specjax.decode.warping import sample
from specjax.weights import self_draft as self_draft_lib
from conftest import mesh_for
from models import numpy_params, random_lm
from theorem1 import ALPHA, N_NEGATIVE, Case, run, sharpened

LAYERS = 3  # target layers: a draft of 1 or 2 leaves layers out on both sides of it


def reference_draft(target: model.LM, n: int) -> model.LM:
    """An n-layer model built as any model is, its params copies of the target's values."""
    cfg = dataclasses.replace(target.cfg, num_layers=n)
    values = numpy_params(target.params)
    abstract = model.abstract_lm(cfg)

    def one(path, named_sharding, variable):
        key = jax.tree_util.keystr(path).replace(".value", "")
        value = values[key]
        if cfg.scan_layers and key.startswith("['layers']"):
            value = value[:n]  # the stack's first n layers
        assert value.shape == variable.get_value().shape, key
        return variable.replace(jax.device_put(np.array(value), named_sharding))

    mesh = mesh_for("1x1")
    params = jax.tree_util.tree_map_with_path(one, sharding.param_shardings(abstract.params, mesh), abstract.params)
    return model.LM(cfg, abstract.graphdef, params)


SETTINGS = {  # (scan_layers, pos_encoding, tie_embeddings)
    "unrolled_rope": (False, "rope", False),
    "scanned_rope": (True, "rope", False),
    "scanned_relative_tied": (True, "relative", True),
    "unrolled_relative": (False, "relative", False),
}


@pytest.fixture(scope="module", params=sorted(SETTINGS))
def target(request, tiny):
    scan, pos, tied = SETTINGS[request.param]
    cfg = dataclasses.replace(tiny.target, num_layers=LAYERS, scan_layers=scan, pos_encoding=pos,
                              tie_embeddings=tied)
    return random_lm(cfg, mesh_for("1x1"), seed=3)


@pytest.mark.parametrize("n", [1, 2])
def test_self_draft_logits_equal_an_n_layer_model_with_the_targets_first_layers(target, n):
    tokens = jnp.asarray([[5, 1, 30, 7, 7, 12, 3], [2, 9, 9, 0, 31, 4, 18]])
    got = np.asarray(model.full_forward(specjax.self_draft(target, f"layers:{n}"), tokens))
    want = np.asarray(model.full_forward(reference_draft(target, n), tokens))
    full = np.asarray(model.full_forward(target, tokens))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(got - full).max() > 1e-2  # the draft really is another model than the target


def buffers(tree) -> set:
    return {x.unsafe_buffer_pointer() for x in jax.tree.leaves(tree)}


def test_self_draft_shares_the_targets_buffers(target):
    draft = specjax.self_draft(target, "layers:2")
    held = buffers(target.params) | buffers(target.packed().params)
    assert buffers(draft.params) <= held  # no new array: every leaf is one of the target's
    assert buffers(draft.packed().params) <= held  # nor when decoding packs it
    if target.cfg.scan_layers:  # the stacked arrays themselves, all LAYERS of them
        leaf = jax.tree.leaves(draft.params["layers"])[0]
        assert leaf.shape[0] == LAYERS
        assert any(leaf is x for x in jax.tree.leaves(target.packed().params["layers"]))
    else:
        assert sorted(draft.params["layers"].keys()) == [0, 1]


@pytest.mark.parametrize("name,overrides", [("tokenwise", dict(verify="tokenwise")), ("block", dict(verify="block")),
                                            ("tree", dict(num_drafts=2)), ("hybrid", dict(drafter="hybrid"))])
def test_greedy_sps_with_a_self_draft_equals_greedy_ars(target, name, overrides):
    # Every verifier on one setting, tokenwise on a stacked one (each case compiles a loop).
    if not (target.cfg.pos_encoding == "rope" and (not target.cfg.scan_layers or name == "tokenwise")):
        pytest.skip("the logits test covers this setting; one loop per verifier is enough")
    prompts = [[5, 1, 30], [2, 9, 9, 0, 31, 4, 18, 7]]
    base = SamplingConfig(temperature=0.0, max_new_tokens=12, lookahead=3)
    ars = specjax.generate(target, None, prompts, base)
    sps = specjax.generate(target, specjax.self_draft(target, "layers:1"), prompts,
                           dataclasses.replace(base, **overrides).validate())
    assert sps.tokens == ars.tokens
    assert sps.acceptance_rate > 0  # the draft proposed and was heard


@pytest.mark.parametrize("text,needle", [
    ("layers:0", "N in 1..2"), ("layers:3", "N in 1..2"), ("layers", "unknown form 'layers'"),
    ("int8+int4", "a quantized form given twice"), ("int8+int8", "given twice"),
    ("int4+layers:3", "N in 1..2"), ("layers:1+layers:2", "layers given twice"),
    ("int8+layers:3", "N in 1..2"),
    ("layers:1,layers:2", "one self-draft here"), ("first:2", "unknown form"),
    ("layers:\u0661", "unknown form"), ("layers:\uff11", "unknown form"),  # an Arabic-Indic, a full-width 1
])
def test_bad_self_drafts_are_refused_in_one_line(tiny, text, needle):
    with pytest.raises(UsageError, match=needle) as e:  # `specjax.self_draft` checks the same way first
        self_draft_lib.draft_config(dataclasses.replace(tiny.target, num_layers=LAYERS), text)
    assert "\n" not in str(e.value) and repr(text) in str(e.value)


@pytest.mark.parametrize("kind", ["int8", "int4", "w4a8"])
def test_quantized_self_draft_is_the_targets_quantized_copy(target, kind):
    """`int8` / `int4`: the logits of the target quantized on its own (`LM.quantized`,
    which test_quantized checks against a float64 reference), through the self-draft's own
    graph; `KIND+layers:1` runs the first layer of that copy: close to the float layers:1
    draft (rounding only), far from the whole target. int4 on one setting: the self-draft
    code is the same for both kinds (test_quantized covers int4 in every layout)."""
    if kind != "int8" and not (target.cfg.pos_encoding == "rope" and not target.cfg.scan_layers):
        pytest.skip(f"{kind}: one setting is enough")
    tokens = jnp.asarray([[5, 1, 30, 7, 7, 12, 3], [2, 9, 9, 0, 31, 4, 18]])
    got = np.asarray(model.full_forward(specjax.self_draft(target, kind), tokens))
    want = np.asarray(model.full_forward(target.quantized(kind), tokens))
    np.testing.assert_array_equal(got, want)
    one = np.asarray(model.full_forward(specjax.self_draft(target, f"{kind}+layers:1"), tokens))
    float_one = np.asarray(model.full_forward(reference_draft(target, 1), tokens))
    full = np.asarray(model.full_forward(target, tokens))
    assert np.abs(one - float_one).max() < (0.05 if kind == "int8" else 0.3) * np.abs(float_one).max()
    assert np.abs(one - full).max() > 1e-2
    with pytest.raises(UsageError, match=f"is {kind} already"):
        specjax.self_draft(target.quantized(kind), kind)


def test_an_a8_self_draft_of_an_int4_target_multiplies_its_own_codes(target):
    """`w4a8` of a target quantized to int4 already (as `--quantize=int4` or a GGUF file's
    Q4 tensors load it): the same code arrays (not copies) multiplying int8 activations, so
    its logits are those of `target.quantized('w4a8')` (the int4 codes of the float target,
    the same quantization) and not the int4 target's own; `int4` of it is still refused."""
    if not (target.cfg.pos_encoding == "rope" and not target.cfg.scan_layers):
        pytest.skip("one setting is enough")
    int4 = target.quantized("int4")
    draft = specjax.self_draft(int4, "w4a8")
    is_g = lambda x: isinstance(x, kernels.Grouped)  # noqa: E731
    mine = [w for w in jax.tree.leaves(draft.params, is_leaf=is_g) if is_g(w)]
    theirs = [w for w in jax.tree.leaves(int4.params, is_leaf=is_g) if is_g(w)]
    assert len(mine) == len(theirs) > 0 and all(a.code is b.code for a, b in zip(mine, theirs))
    assert {w.activations for w in mine} == {"int8"} and {w.activations for w in theirs} == {"float32"}
    tokens = jnp.asarray([[5, 1, 30, 7, 7, 12, 3], [2, 9, 9, 0, 31, 4, 18]])
    got = np.asarray(model.full_forward(draft, tokens))
    np.testing.assert_array_equal(got, np.asarray(model.full_forward(target.quantized("w4a8"), tokens)))
    assert np.abs(got - np.asarray(model.full_forward(int4, tokens))).max() > 1e-4 * np.abs(got).max()
    with pytest.raises(UsageError, match="is int4 already"):
        specjax.self_draft(int4, "int4")
    self_draft_lib.check_quantize(self_draft_lib.parse("w4a8"), "int4")  # the command lines allow it
    with pytest.raises(UsageError, match="is int8 already"):
        self_draft_lib.check_quantize(self_draft_lib.parse("w4a8"), "int8")


@pytest.mark.parametrize("kind", ["int8", "int4", "w4a8"])
def test_greedy_sps_with_a_quantized_self_draft_equals_greedy_ars(target, kind):
    if not (target.cfg.pos_encoding == "rope" and not target.cfg.scan_layers):
        pytest.skip("one loop is enough: the logits test covers every setting")
    prompts = [[5, 1, 30], [2, 9, 9, 0, 31, 4, 18, 7]]
    base = SamplingConfig(temperature=0.0, max_new_tokens=12, lookahead=3)
    sps = specjax.generate(target, specjax.self_draft(target, kind), prompts, base)
    assert sps.tokens == specjax.generate(target, None, prompts, base).tokens
    assert sps.acceptance_rate > 0.5  # the quantized copy mostly agrees


def as_plain(draft: model.LM) -> model.LM:
    """The same draft as an ordinary LM (not a `model.SelfDraft`): a loop prefills it."""
    return model.LM(draft.cfg, draft.graphdef, draft.params, draft.kernels)


@pytest.mark.parametrize("spec,num_drafts", [("layers:1", 1), ("int8", 1), ("int8+layers:2", 2)])
def test_a_self_draft_starts_from_the_targets_prefilled_cache(target, spec, num_drafts):
    """`speculative.start`: a self-draft's cache is the target's first N layers as the
    target's prefill left them (bitwise: no prefill of its own; each row repeated for the
    M chains), where the same weights as an ordinary LM prefill themselves (for an int8
    copy, other numbers). Ragged rows: the lengths are each row's own."""
    if target.cfg.scan_layers and spec != "layers:1":
        pytest.skip("one stacked case is enough")
    draft = specjax.self_draft(target, spec)
    prompts = jnp.asarray([[5, 1, 30, 7, 7, 12, 3, 0], [2, 9, 9, 0, 31, 4, 18, 7]])
    lens = jnp.asarray([5, 8])
    settings = speculative.Settings(3, None, "block", num_drafts)
    sampling = SamplingConfig(lookahead=3, num_drafts=num_drafts)

    def started(d):
        drafter = drafters.make(sampling, target.packed(), d, None, mesh_for("1x1"))
        return speculative.start(target.packed(), drafter, prompts, lens, jax.random.key(0), settings, 64)

    state = started(draft)
    n = draft.cfg.num_layers
    rows = lambda a: np.repeat(np.asarray(a), num_drafts, axis=1)  # noqa: E731
    np.testing.assert_array_equal(np.asarray(state.drafter_state.k), rows(state.target_cache.k[:n]))
    np.testing.assert_array_equal(np.asarray(state.drafter_state.v), rows(state.target_cache.v[:n]))
    np.testing.assert_array_equal(np.asarray(state.drafter_state.lengths), np.repeat([4, 7], num_drafts))
    if target.cfg.pos_encoding == "relative":
        np.testing.assert_array_equal(np.asarray(state.drafter_state.position_table),
                                      np.asarray(state.target_cache.position_table[:n]))
    own = started(as_plain(draft)).drafter_state  # the same weights, prefilling themselves
    assert own.k.shape == state.drafter_state.k.shape
    if spec.startswith("int8"):
        assert not np.array_equal(np.asarray(own.k), np.asarray(state.drafter_state.k))
    else:  # layers:N: the target's first layers compute the same keys and values
        np.testing.assert_allclose(np.asarray(own.k), np.asarray(state.drafter_state.k), rtol=1e-5, atol=1e-5)


def test_a_self_draft_of_another_layout_prefills_itself(target):
    """A SelfDraft whose cache is not a prefix of this target's (another target's, here one
    with another head_dim) is not handed this target's cache: it prefills its own."""
    other_cfg = dataclasses.replace(target.cfg, head_dim=target.cfg.head_dim // 2)
    if target.cfg.scan_layers or target.cfg.pos_encoding != "rope":
        pytest.skip("one setting is enough")
    other = specjax.self_draft(random_lm(other_cfg, mesh_for("1x1"), seed=4), "layers:1")
    drafter = drafters.make(SamplingConfig(lookahead=3), target.packed(), other, None, mesh_for("1x1"))
    assert not drafter.from_target
    assert drafters.make(SamplingConfig(lookahead=3), target.packed(), specjax.self_draft(target, "layers:1"),
                         None, mesh_for("1x1")).from_target
    state = speculative.start(target.packed(), drafter, jnp.asarray([[5, 1, 30, 7]]), jnp.asarray([4]),
                              jax.random.key(0), speculative.Settings(3, None), 32)
    assert state.drafter_state.k.shape[-1] == other_cfg.head_dim


def test_greedy_sps_from_the_targets_cache_keeps_what_a_prefilled_draft_keeps(target):
    """layers:N's cache from the target is what its own prefill computes, so a greedy run
    keeps the same drafts at every loop as the same draft prefilling itself (a wrong slice
    of the target's layers, or rows of the wrong prompt, would change what is kept)."""
    if target.cfg.scan_layers == (target.cfg.pos_encoding == "rope"):
        pytest.skip("an unrolled RoPE and a stacked relative setting")
    prompts = [[5, 1, 30], [2, 9, 9, 0, 31, 4, 18, 7]]
    base = SamplingConfig(temperature=0.0, max_new_tokens=16, lookahead=3)
    draft = specjax.self_draft(target, "layers:2")
    mine, theirs = (specjax.generate(target, d, prompts, base) for d in (draft, as_plain(draft)))
    assert mine.tokens == theirs.tokens
    np.testing.assert_array_equal(mine.histogram, theirs.histogram)
    assert mine.acceptance_rate > 0


# ----------------------------------------------------------------------------- Theorem 1

@pytest.fixture(scope="module")
def theorem1_models(tiny):
    """A two-layer target (one kv head, logits sharpened x3, as theorem1.make_models) and
    its first layer as the draft."""
    two = dataclasses.replace(tiny.target, num_layers=2, num_kv_heads=1)
    target = sharpened(model.init_lm(two, mesh_for("1x1")), 3.0)
    return target, specjax.self_draft(target, "layers:1")


def no_ratio_test(key, x, p, q, length=None):
    """Wrong: keeps every draft token (samples follow the self-draft, not the target)."""
    return jnp.full((x.shape[0],), x.shape[1], jnp.int32), *sample(key, q[:, -1])


@pytest.fixture
def use_accept(patch):
    return lambda accept: patch([] if accept is None else [(verify, "accept", accept)])


CASE = Case(1.0, 0, 1.0, 3, "ragged")


def test_self_draft_samples_follow_the_exact_target_distribution(theorem1_models, use_accept):
    use_accept(None)
    pvalue, result = run(theorem1_models, CASE)
    print(f"self-draft layers:1: p = {pvalue:.4f}, acceptance rate {result.acceptance_rate:.3f}")
    assert pvalue > ALPHA
    assert 0.05 < result.acceptance_rate < 0.95  # the draft is not the target


def test_self_draft_negative_control_is_rejected(theorem1_models, use_accept):
    use_accept(no_ratio_test)
    pvalue, _ = run(theorem1_models, CASE, N_NEGATIVE)
    print(f"self-draft layers:1 with no ratio test: p = {pvalue:.2e}")
    assert pvalue < ALPHA


# K = 1: the bonus token is inside the 3-token window whenever the draft is kept, which
# for a quantized copy is nearly always (at K = 3 the window holds only drafts).
QUANTIZED_CASE = Case(1.0, 0, 1.0, 1, "ragged")


@pytest.fixture(scope="module", params=["int8", "int4", "w4a8"])
def quantized_models(theorem1_models, request):
    target, _ = theorem1_models
    return request.param, target, specjax.self_draft(target, request.param)


correct_accept = verify.accept  # the real rule, kept before any swap


def bonus_off_by_one(key, x, p, q, length=None):
    """Wrong: the bonus token after K kept drafts comes from q at the first position.
    Rejected even where p is nearly q (a quantized draft keeps almost every token)."""
    n, token, empty = correct_accept(key, x, p, q, length)
    return n, jnp.where(n == x.shape[1], sample(jax.random.fold_in(key, 1), q[:, 0])[0], token), empty


@pytest.mark.slow  # with its control ~1.5 minutes per kind; the layers:N case runs by default
def test_quantized_self_draft_samples_follow_the_exact_target_distribution(quantized_models, use_accept):
    kind, *models = quantized_models
    use_accept(None)
    pvalue, result = run(tuple(models), QUANTIZED_CASE)
    print(f"self-draft {kind}: p = {pvalue:.4f}, acceptance rate {result.acceptance_rate:.3f}")
    assert pvalue > ALPHA
    assert result.acceptance_rate > (0.9 if kind == "int8" else 0.6)  # the copy nearly is the target


@pytest.mark.slow
def test_quantized_self_draft_negative_control_is_rejected(quantized_models, use_accept):
    kind, *models = quantized_models
    use_accept(bonus_off_by_one)
    pvalue, _ = run(tuple(models), QUANTIZED_CASE, N_NEGATIVE)
    print(f"self-draft {kind} with the bonus token off by one: p = {pvalue:.2e}")
    assert pvalue < ALPHA


# A Gemma-3-shaped target (weights/arch/gemma3's switches; untied, so `sharpened` can
# scale its unembedding): a sliding layer with a window of 2, shorter than every prompt,
# then a global one with its own rotary base; its first (sliding) layer drafts.
GEMMA_SHAPED = dict(num_layers=2, num_kv_heads=1, ffw="geglu", qk_norm=True, post_norms=True, norm_offset=1.0,
                    attention_pattern="LG", sliding_window=2, local_rope_theta=100.0, rope_theta=1e6,
                    query_scale=0.3, embed_scale=2.0, tie_embeddings=False)


@pytest.fixture(scope="module")
def gemma_shaped_models(tiny):
    cfg = dataclasses.replace(tiny.target, **GEMMA_SHAPED).validate()
    target = sharpened(random_lm(cfg, mesh_for("1x1"), seed=5), 3.0)
    return target, specjax.self_draft(target, "layers:1")


@pytest.mark.slow  # with its control ~1 minute; the plain layers:N case above runs by default
def test_gemma_shaped_self_draft_samples_follow_the_exact_target_distribution(gemma_shaped_models, use_accept):
    use_accept(None)
    pvalue, result = run(gemma_shaped_models, CASE)
    print(f"Gemma-shaped self-draft layers:1: p = {pvalue:.4f}, acceptance rate {result.acceptance_rate:.3f}")
    assert pvalue > ALPHA
    assert 0.05 < result.acceptance_rate < 0.95


@pytest.mark.slow
def test_gemma_shaped_self_draft_negative_control_is_rejected(gemma_shaped_models, use_accept):
    use_accept(no_ratio_test)
    pvalue, _ = run(gemma_shaped_models, CASE, N_NEGATIVE)
    print(f"Gemma-shaped self-draft layers:1 with no ratio test: p = {pvalue:.2e}")
    assert pvalue < ALPHA
