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
