"""Draft heads on the teacher's samples read the frozen target's forward from a cache
(`samples.with_target_reads`): each sample's forward runs once, from its first token, and
a window's reads are cut from it (`Batches`). Checked against the model's own forward:
the cached reads of a sample are those of a forward over that sample alone (features and
final states, the final states giving the forward's logits), a batch's cached reads are
its windows' (aligned token for token), and the loss on a window that is one whole sample
is the same read from the cache as with the target's forward in the step."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import model
from specjax.config import HeadsConfig, TrainConfig
from specjax.heads import heads_loss, init_heads, reads_of
from specjax.training import data, samples
from specjax.training.corpus import Batches, Corpus
from conftest import mesh_for

LENGTHS = [9, 17, 13, 17, 5, 11, 17, 8]  # the samples, end to end; at most seq_len + 1 = 17 tokens
SEQ_LEN = 16
LAYERS = {"medusa": dict(num_heads=2), "eagle": {}, "eagle3": dict(feature_layers=(1, 2), ttt_steps=3)}


@pytest.fixture(scope="module")
def target(tiny):
    return model.init_lm(tiny.target, mesh_for("1x1"), seed=1)


def sample_corpus(vocab):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, sum(LENGTHS)).astype(np.int32)
    begins = np.cumsum([0] + LENGTHS[:-1])
    train, val = tokens[:-LENGTHS[-1]], tokens[-LENGTHS[-1]:]  # the last sample is validation
    return Corpus(train, val, None, "samples", samples=begins), tokens, begins


def config_for(tiny):
    import dataclasses
    return dataclasses.replace(tiny, train=TrainConfig(seq_len=SEQ_LEN, batch_size=2, eval_batches=1))


@pytest.mark.parametrize("kind,width_step", [("eagle", 64), ("eagle3", 64), ("eagle3", 4)])
def test_cached_reads_are_each_samples_own_forward(tiny, target, kind, width_step, monkeypatch):
    """width_step 4: the samples run in chunks sorted by length, padded to 8, 12 and 17."""
    monkeypatch.setattr(samples, "WIDTH_STEP", width_step)
    reads = reads_of(HeadsConfig(kind=kind, **LAYERS[kind]), target.cfg)
    corpus, tokens, begins = sample_corpus(target.cfg.vocab_size)
    cached = samples.with_target_reads(corpus, target, reads, config_for(tiny), progress=False)
    features, final = (np.concatenate([t, v]) for t, v in zip(cached.train_seen, cached.val_seen))
    assert len(features) == len(final) == len(tokens)
    for b, n in zip(begins, LENGTHS):
        alone = jnp.asarray(tokens[None, b:b + n])
        logits, hidden = model.full_forward(target, alone, features=reads)
        np.testing.assert_allclose(features[b:b + n], np.asarray(hidden[0]), rtol=2e-5, atol=2e-5)
        # the final states are what the forward's logits come from
        np.testing.assert_allclose(np.asarray(target.logits(jnp.asarray(final[None, b:b + n]))[0]),
                                   np.asarray(logits[0]), rtol=2e-5, atol=2e-5)
    # The control: a forward over the stream, not sample by sample, reads otherwise after the first sample.
    _, stream = model.full_forward(target, jnp.asarray(tokens[None, :sum(LENGTHS[:2])]), features=reads)
    b = begins[1]
    assert not np.allclose(features[b:b + LENGTHS[1]], np.asarray(stream[0, b:]), atol=1e-3)


def test_a_cache_beyond_the_memory_it_may_take_is_not_made(tiny, target, capsys):
    """The cache's size is known before its forward: where it exceeds the memory it may take
    the corpus comes back without one (the step runs the forward) and a line says so; with
    room it is made (the control)."""
    reads = reads_of(HeadsConfig(kind="eagle3", **LAYERS["eagle3"]), target.cfg)
    corpus, tokens, _ = sample_corpus(target.cfg.vocab_size)
    need = len(tokens) * 3 * target.cfg.d_model * 4  # two layers fused and the final states, float32
    assert samples.with_target_reads(corpus, target, reads, config_for(tiny), False, memory=need - 1).train_seen is None
    said = capsys.readouterr().out
    assert f"would take {need / 2**30:.2f} GiB" in said and "each step runs the target's forward instead" in said, said
    assert samples.with_target_reads(corpus, target, reads, config_for(tiny), False, memory=need).train_seen is not None
    assert "would take" not in capsys.readouterr().out
    assert samples.available_memory() > 0  # this machine's, read from /proc/meminfo


def test_a_batchs_cached_reads_are_its_windows(tiny):
    """Cached reads that are the token ids themselves: every window's reads are its inputs'."""
    corpus, tokens, _ = sample_corpus(32)
    n = len(corpus.train)
    as_floats = tokens.astype(np.float32)[:, None] * np.ones((1, 3), np.float32)
    corpus.train_seen = (as_floats[:n], as_floats[:n, :1] + 0.5)
    corpus.val_seen = (as_floats[n:], as_floats[n:, :1] + 0.5)
    batches = Batches(corpus, TrainConfig(seq_len=4, batch_size=2, eval_batches=2, val_fraction=0.1), mesh_for("1x1"))
    windows = [batches.train(step) for step in (0, 3)] + batches.validation()
    for batch, _, (features, final) in windows:
        inputs = np.asarray(batch)[:, :-1]
        assert features.shape == (2, 4, 3) and final.shape == (2, 4, 1)
        np.testing.assert_array_equal(np.asarray(features), np.repeat(inputs[..., None], 3, -1))
        np.testing.assert_array_equal(np.asarray(final)[..., 0], inputs + 0.5)
    assert batches.abstract()[2][0].shape == (2, 4, 3)
    # A corpus without a cache hands none.
    assert Batches(Corpus(corpus.train, corpus.val, None, "plain"), batches.tc, mesh_for("1x1")).train(0)[2] is None


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3"])
def test_the_loss_from_the_cache_is_the_loss_from_the_forward(tiny, target, kind):
    """A window that is one whole sample (17 tokens): its loss with the cached reads is the
    one the step computes with the target's forward; a cache with the features of another
    window moves it (the control)."""
    vocab = np.arange(0, 32, 2, dtype=np.int32)[::-1] if kind != "medusa" else None
    hcfg = HeadsConfig(kind=kind, draft_vocab=0 if vocab is None else len(vocab), **LAYERS[kind])
    heads = init_heads(hcfg, target.cfg, mesh_for("1x1"), random=True, vocab=vocab)
    corpus, tokens, begins = sample_corpus(target.cfg.vocab_size)
    cached = samples.with_target_reads(corpus, target, heads.features, config_for(tiny), progress=False)
    fn = jax.jit(heads_loss(TrainConfig(distill_weight=0.5)))
    whole = [i for i, n in enumerate(LENGTHS) if n == SEQ_LEN + 1]
    for i in whole:
        b = begins[i]
        batch = jnp.asarray(tokens[None, b:b + SEQ_LEN + 1])
        seen = tuple(jnp.asarray(a[None, b:b + SEQ_LEN]) for a in cached.train_seen)
        forward = float(fn(heads, target, batch, 0.5, None, None)[0])
        np.testing.assert_allclose(float(fn(heads, target, batch, 0.5, None, seen)[0]), forward, rtol=1e-5)
        other = begins[whole[0] if i != whole[0] else whole[1]]
        wrong = tuple(jnp.asarray(a[None, other:other + SEQ_LEN]) for a in cached.train_seen)
        assert not np.isclose(float(fn(heads, target, batch, 0.5, None, wrong)[0]), forward, rtol=1e-3)


def test_the_samples_begin_where_the_marks_say():
    """`samples._as_corpus` finds each sample's first token: a prompt (0s) after a reply (1s)."""
    from specjax.config import Config
    generated = np.uint8([0, 0, 1, 1, 0, 1, 0, 0, 0, 1, 1, 1, 0, 1])
    corpus = Corpus(np.zeros(1), np.zeros(1), None, "corpus")
    config = Config(train=TrainConfig(self_distill=4, val_fraction=0.25))
    got = samples._as_corpus(corpus, np.arange(len(generated), dtype=np.int32), generated, config, "made")
    np.testing.assert_array_equal(got.samples, [0, 4, 6, 12])
    assert data.split_train_val(np.arange(14), 0.25)[0].tolist() == got.train.tolist()
