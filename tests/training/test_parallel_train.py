"""Training a parallel draft model (`ModelConfig.parallel_draft`, PARD): the one training
pass with masks after anchors gives, at every row, the logits of a separate plain causal
forward over what that row sees (the tokens up to its anchor, then its masks: the pass the
drafter runs), and its loss is the mean cross-entropy against the token after each row's
position; distilled from a teacher, a run stopped after a checkpoint and run again with
the same config resumes exactly (in process, on `tiny`'s synthetic data)."""
import dataclasses
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import model
from specjax.config import TrainConfig, UsageError
from specjax.training import losses, trainer
from specjax.training.workdir import read_metrics
from specjax.weights import checkpoint
from conftest import mesh_for

K = 4


@pytest.fixture(scope="module")
def draft(tiny):
    return model.init_lm(dataclasses.replace(tiny.draft, parallel_draft=K), mesh_for("1x1"), seed=3)


def test_the_training_pass_is_the_drafters_pass_at_every_row(draft):
    T = 13
    batch = jax.random.randint(jax.random.key(0), (2, T + 1), 0, draft.cfg.vocab_size)
    inputs = batch[:, :-1]
    logits, positions = jax.jit(losses.parallel_forward)(draft, inputs)
    layout, masked, _ = losses.parallel_layout(T, K)
    assert masked.sum() >= T - K and set(np.diff(layout[T:].reshape(-1, K - 1), axis=1).ravel()) == {1}
    # What each row sees, as its own sequence (the tokens up to its anchor, then its masks;
    # padded on the right, which a causal pass never reads), all in one plain forward.
    mask = model.mask_id(draft.cfg)
    seen = np.zeros((len(layout), 2, T + K), np.int32)
    for r, (position, is_mask) in enumerate(zip(layout, masked)):
        offset = int(np.sum(masked[:r + 1]) - 1) % (K - 1) + 1 if is_mask else 0  # the row's mask number
        anchor = position - offset
        seen[r, :, :anchor + 1] = inputs[:, :anchor + 1]
        seen[r, :, anchor + 1:position + 1] = mask
    out = jax.jit(model.full_forward)(draft, jnp.asarray(seen.reshape(-1, T + K))).reshape(len(layout), 2, T + K, -1)
    want = jnp.stack([out[r, :, position] for r, position in enumerate(layout)], axis=1)  # [2, P, V]
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want), rtol=1e-4, atol=1e-5)
    # The loss: each row against the token after its position.
    ce = losses.make_loss(TrainConfig(), distill=False)(draft, None, batch, 0.0)[1]["ce"]
    logp = jax.nn.log_softmax(want, axis=-1)
    labels = batch[:, np.asarray(positions) + 1]
    np.testing.assert_allclose(float(ce), float(-jnp.mean(jnp.take_along_axis(logp, labels[..., None], -1))),
                               rtol=1e-5)


STEPS, SAVE = 8, 4


def config(tiny, teacher_dir):
    return dataclasses.replace(
        tiny, name="tiny_parallel", mesh=dataclasses.replace(tiny.mesh, model=1),
        target=dataclasses.replace(tiny.draft, parallel_draft=K),
        train=TrainConfig(steps=STEPS, save_every=SAVE, eval_every=STEPS, eval_batches=1, log_every=2, seq_len=16,
                          batch_size=4, warmup_steps=2, teacher="tiny", teacher_checkpoint=str(teacher_dir),
                          distill_weight=0.5))


def test_a_run_resumes_exactly_from_its_checkpoint(tiny, tmp_path):
    teacher = tmp_path / "teacher"
    checkpoint.save_lm(model.init_lm(tiny.target, mesh_for("1x1"), seed=11), teacher, config_name="tiny")
    cfg = config(tiny, teacher)
    workdir = tmp_path / "run"
    devices = jax.devices()[:1]
    done = trainer.train(cfg, workdir, progress=False, devices=devices)
    assert done.step == STEPS and done.start_step == 0
    first = read_metrics(workdir)
    params = [np.asarray(x) for x in jax.tree.leaves(checkpoint.load_lm(cfg.target, mesh_for("1x1"), workdir,
                                                                        step=STEPS).params)]
    shutil.rmtree(workdir / str(STEPS))  # as if stopped after the checkpoint at SAVE
    again = trainer.train(cfg, workdir, progress=False, devices=devices)
    assert again.start_step == SAVE and again.step == STEPS
    resumed = [np.asarray(x) for x in jax.tree.leaves(checkpoint.load_lm(cfg.target, mesh_for("1x1"), workdir,
                                                                         step=STEPS).params)]
    assert len(params) == len(resumed)
    for a, b in zip(params, resumed):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    second = read_metrics(workdir)
    assert list(first) == list(second)
    for field in ("loss", "ce", "kl", "grad_norm"):
        np.testing.assert_allclose([first[s][field] for s in first], [second[s][field] for s in second], rtol=1e-6)
    assert first[STEPS]["loss"] < first[2]["loss"]


def test_init_from_starts_with_an_autoregressive_drafts_params(tiny, tmp_path):
    """train.init_from (PARD's adaptation): every param of the named checkpoint (a plain
    draft of the same shape), the mask embedding from the fresh init; a checkpoint of
    another shape is refused before any workdir is made."""
    mesh = mesh_for("1x1")
    ar = model.init_lm(tiny.draft, mesh, seed=21)
    checkpoint.save_lm(ar, tmp_path / "ar", config_name="tiny_draft")
    cfg = dataclasses.replace(config(tiny, tmp_path), train=TrainConfig(init_from=str(tmp_path / "ar")))
    source = trainer._init_source(cfg)
    fresh = model.init_lm(cfg.target, mesh, duplicate_kv=False).params
    with jax.set_mesh(mesh):
        params = trainer._init_params(fresh, source, mesh)
    for name in ar.params:
        for a, b in zip(jax.tree.leaves(params[name]), jax.tree.leaves(ar.params[name])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(params["mask_embed"].value), np.asarray(fresh["mask_embed"].value))
    wide = dataclasses.replace(cfg, target=dataclasses.replace(cfg.target, d_model=32))
    with pytest.raises(UsageError, match="train.init_from=.*d_model=16 \\(checkpoint\\) vs 32 \\(config\\)"):
        trainer.train(wide, tmp_path / "never", progress=False, devices=jax.devices()[:1])
    assert not (tmp_path / "never").exists()
