"""The loss over the tokens a batch marks as counted (`train.self_distill_replies`: the
teacher's own tokens, not its prompts): every loss the trainer runs (a model's, with and
without distillation, a parallel draft's, and draft heads': Medusa, EAGLE, EAGLE-3 with
its training-time test) averages over the positions whose target token is counted, so a
target token that is not counted moves nothing, and one that is moves the loss (the
control: the same change with every token counted). The value itself is checked against
a log-softmax written out in numpy over the counted positions alone."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import model
from specjax.config import HeadsConfig, TrainConfig
from specjax.heads import heads_loss, init_heads
from specjax.training import losses
from conftest import mesh_for

B, T = 2, 12


@pytest.fixture(scope="module")
def models(tiny):
    mesh = mesh_for("1x1")
    return model.init_lm(tiny.target, mesh, seed=1), model.init_lm(tiny.draft, mesh, seed=2)


def batches(vocab):
    """(batch, the same batch with its last token changed, counted with the last token not
    counted): the last token is only ever a target, never an input."""
    batch = jax.random.randint(jax.random.key(0), (B, T + 1), 0, vocab)
    changed = batch.at[:, -1].set((batch[:, -1] + 1) % vocab)
    counted = jnp.ones((B, T + 1), jnp.int32).at[:, -1].set(0).at[0, 3].set(0)
    return batch, changed, counted


def the_loss(fn, *args, counted=None):
    return float(jax.jit(fn)(*args, counted)[0])


def check(fn, lead, vocab):
    batch, changed, counted = batches(vocab)
    ones = jnp.ones_like(counted)
    assert the_loss(fn, *lead, batch, 0.7, counted=counted) == the_loss(fn, *lead, changed, 0.7, counted=counted)
    assert the_loss(fn, *lead, batch, 0.7, counted=ones) != the_loss(fn, *lead, changed, 0.7, counted=ones)
    # None counts every token, as all-ones does.
    np.testing.assert_allclose(the_loss(fn, *lead, batch, 0.7), the_loss(fn, *lead, batch, 0.7, counted=ones),
                               rtol=1e-6)


@pytest.mark.parametrize("distill", [False, True], ids=["plain", "distilled"])
def test_model_loss_counts_only_the_counted_targets(models, distill):
    target, draft = models
    fn = losses.make_loss(TrainConfig(), distill)
    check(fn, (draft, target if distill else None), draft.cfg.vocab_size)


def test_model_loss_value_is_the_mean_over_the_counted_positions(models):
    _, draft = models
    batch, _, counted = batches(draft.cfg.vocab_size)
    ce = float(jax.jit(losses.make_loss(TrainConfig(), False))(draft, None, batch, 0.0, counted)[1]["ce"])
    logits = np.asarray(model.full_forward(draft, batch[:, :-1]), np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, np.asarray(batch[:, 1:])[..., None], -1)[..., 0]
    keep = np.asarray(counted[:, 1:], bool)
    np.testing.assert_allclose(ce, nll[keep].mean(), rtol=1e-5)
    assert not np.isclose(ce, nll.mean(), rtol=1e-5)  # the control: the mean over every position differs


def test_parallel_draft_loss_counts_only_the_counted_targets(tiny):
    draft = model.init_lm(dataclasses.replace(tiny.draft, parallel_draft=4), mesh_for("1x1"), seed=3)
    check(losses.make_loss(TrainConfig(), False), (draft, None), draft.cfg.vocab_size)


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3"])
def test_heads_loss_counts_only_the_counted_targets(models, kind):
    target, _ = models
    extra = {"medusa": dict(num_heads=3), "eagle": {}, "eagle3": dict(feature_layers=(1, 2), ttt_steps=3)}[kind]
    heads = init_heads(HeadsConfig(kind=kind, **extra), target.cfg, mesh_for("1x1"), random=True)
    check(heads_loss(TrainConfig()), (heads, target), target.cfg.vocab_size)


# A draft vocabulary: the layer is trained on what it drafts from, the target conditioned
# on those tokens (the same optimum as the whole vocabulary's KL, at N/V of its
# unembedding per training-time-test step).
VOCAB = np.arange(0, 32, 2, dtype=np.int32)[::-1]  # 16 of the 32 ids, not in id order


def layer_with_a_draft_vocabulary(target, kind):
    extra = {"eagle": {}, "eagle3": dict(feature_layers=(1, 2), ttt_steps=3)}[kind]
    return init_heads(HeadsConfig(kind=kind, draft_vocab=len(VOCAB), **extra), target.cfg, mesh_for("1x1"),
                      random=True, vocab=VOCAB)


def with_unembedding_columns(target, ids, scale):
    params = jax.tree.map(lambda x: x, target.params)
    params["unembed"].value = params["unembed"].value.at[:, ids].multiply(scale)
    return dataclasses.replace(target, params=params)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_draft_vocabulary_layer_is_scored_on_its_own_tokens(models, kind):
    """Columns of the target's unembedding outside the draft vocabulary do not move the
    loss (a batch of draft-vocabulary tokens only, so they reach no input); a column
    inside it does (the control)."""
    target, _ = models
    heads = layer_with_a_draft_vocabulary(target, kind)
    batch = jnp.asarray(VOCAB)[jax.random.randint(jax.random.key(1), (B, T + 1), 0, len(VOCAB))]
    fn = heads_loss(TrainConfig(distill_weight=0.5))
    outside = np.setdiff1d(np.arange(32), VOCAB)
    base = the_loss(fn, heads, target, batch, 0.5)
    np.testing.assert_allclose(the_loss(fn, heads, with_unembedding_columns(target, outside, 3.0), batch, 0.5), base,
                               rtol=1e-6)
    assert not np.isclose(the_loss(fn, heads, with_unembedding_columns(target, VOCAB[:3], 3.0), batch, 0.5), base,
                          rtol=1e-4)


def test_a_token_outside_the_draft_vocabulary_is_no_target(models):
    """A row whose next token the layer cannot draft counts in no cross-entropy: the same
    batch with that row's token swapped for another outside token has the same 'ce', and
    the one with it uncounted too; swapped for a draft-vocabulary token it moves (the control)."""
    target, _ = models
    heads = layer_with_a_draft_vocabulary(target, "eagle3")
    batch = jnp.asarray(VOCAB)[jax.random.randint(jax.random.key(2), (B, T + 1), 0, len(VOCAB))]
    fn = jax.jit(heads_loss(TrainConfig(distill_weight=0.0)))
    ce = lambda b, counted=None: float(fn(heads, target, b, 0.0, counted)[1]["ce"])  # noqa: E731
    odd = batch.at[0, -1].set(1)
    assert np.isfinite(ce(odd))
    np.testing.assert_allclose(ce(odd), ce(batch.at[0, -1].set(31)), rtol=1e-6)
    np.testing.assert_allclose(ce(odd), ce(batch, jnp.ones_like(batch).at[0, -1].set(0)), rtol=1e-6)
    assert not np.isclose(ce(odd), ce(batch.at[0, -1].set(int(VOCAB[5]))), rtol=1e-4)
