"""Every config field is checked up front, with a message naming the field and what is
allowed; numpy integers are integers and bools are not."""
import math
import re

import numpy as np
import pytest

import specjax
from specjax import model
from specjax.config import ConfigError, HeadsConfig, SamplingConfig, TrainConfig, UsageError, load_config
from conftest import mesh_for

# (override, fragment of the message): each would have trained wrongly or crashed later.
BAD_TRAIN = [
    ("train.grad_clip=-1", "grad_clip=-1.0"),  # gradient ascent
    ("train.grad_clip=0", "grad_clip=0.0"),  # frozen model
    ("train.grad_clip=nan", "grad_clip=nan"),
    ("train.weight_decay=-0.1", "weight_decay=-0.1"),
    ("train.weight_decay=inf", "weight_decay=inf"),
    ("train.warmup_steps=-1", "warmup_steps=-1"),
    ("train.warmup_steps=16", "below train.steps=16"),
    ("train.val_fraction=0", "val_fraction=0.0"),
    ("train.val_fraction=1", "val_fraction=1.0"),
    ("train.seed=-1", "seed=-1"),
    ("train.learning_rate=inf", "learning_rate=inf"),
    ("train.distill_temperature=0", "distill_temperature=0.0"),
    ("train.corpus=", "corpus=''"),
    ("target.init_seed=-1", "init_seed=-1"),
    ("target.norm_eps=0", "norm_eps=0.0"),
    ("target.rope_theta=-1", "rope_theta=-1.0"),
]


@pytest.mark.parametrize("override,fragment", BAD_TRAIN, ids=[b[0] for b in BAD_TRAIN])
def test_bad_fields_are_refused_up_front(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config("tiny", ["train.steps=16", "train.warmup_steps=2", override])
    assert fragment in str(err.value), str(err.value)


def test_corpus_on_a_config_without_tokenizer_is_refused():
    with pytest.raises(ConfigError, match=r"train.corpus='/data/text'.*has no tokenizer.*set tokenizer_vocab"):
        load_config("tiny", ["train.corpus=/data/text"])


def test_numpy_integers_are_integers_and_bools_are_not():
    s = SamplingConfig(temperature=np.float32(0.5), top_k=np.int64(3), top_p=np.float64(0.9),
                       lookahead=np.int32(2), max_new_tokens=np.uint16(5), eos_id=np.int8(-1)).validate()
    assert s == SamplingConfig(0.5, 3, 0.9, 2, 5, -1)
    assert all(type(getattr(s, f)) is int for f in ("top_k", "lookahead", "max_new_tokens", "eos_id"))
    assert type(s.temperature) is float and type(s.top_p) is float
    assert type(TrainConfig(steps=np.int64(7), warmup_steps=np.int64(1)).validate().steps) is int
    for bad, fragment in [(dict(lookahead=True), "lookahead=True"), (dict(top_k=False), "top_k=False"),
                          (dict(max_new_tokens=np.bool_(True)), "max_new_tokens=np.True_"),
                          (dict(eos_id="3"), "eos_id='3'"), (dict(eos_id=-2), "eos_id=-2"),
                          (dict(top_k=3.0), "top_k=3.0"), (dict(temperature="0.5"), "temperature='0.5'"),
                          (dict(temperature=math.nan), "temperature=nan"), (dict(temperature=True), "temperature=True")]:
        with pytest.raises(ConfigError, match=re.escape(fragment)):
            SamplingConfig(**bad).validate()
    for bad in (dict(steps=True), dict(seed=True), dict(log_every=True)):
        with pytest.raises(ConfigError, match="=True"):
            TrainConfig(**bad).validate()


def test_eos_id_must_be_in_the_vocabulary(tiny):
    target = model.init_lm(tiny.target, mesh_for("1x1"))
    with pytest.raises(UsageError, match=r"eos_id=1000: outside the vocabulary.*0\.\.31, or -1"):
        specjax.generate(target, None, [[1, 2]], SamplingConfig(eos_id=1000, max_new_tokens=4))
    with pytest.raises(UsageError, match=r"eos_id=32"):
        specjax.generate(target, None, [[1, 2]], SamplingConfig(eos_id=32, max_new_tokens=4))
    assert specjax.generate(target, None, [[1, 2]], SamplingConfig(eos_id=np.int64(31), max_new_tokens=4)).tokens


def test_a_field_of_an_unset_group_sets_that_group_from_its_defaults():
    """tiny has no draft heads: --config.heads.num_heads=3 makes Medusa's defaults with 3
    heads (what sample --drafter=medusa --init=random and plan --drafter=medusa then use);
    a group that is set keeps its other fields; typed and validated like any field."""
    cfg = load_config("tiny", ["heads.num_heads=3"])
    assert cfg.heads == HeadsConfig(kind="medusa", num_heads=3)
    assert cfg.heads_for("medusa") is cfg.heads and cfg.heads_for("eagle") == HeadsConfig(kind="eagle")
    assert load_config("tiny").heads_for("medusa") == HeadsConfig()
    eagle = load_config("tiny", ["heads.kind=eagle", "heads.init_seed=5"]).heads
    assert (eagle.kind, eagle.init_seed, eagle.num_heads) == ("eagle", 5, HeadsConfig().num_heads)
    assert load_config("tiny", ["heads=none"]).heads is None
    for override, fragment in [("heads.num_heads=0", "num_heads=0"), ("heads.num_heads=x", "not a valid int"),
                               ("heads.colour=red", "unknown config field 'heads.colour'"),
                               ("name.x=1", "config field 'name' is 'tiny' and has no sub-field 'x'")]:
        with pytest.raises(ConfigError, match=re.escape(fragment)):
            load_config("tiny", [override])
