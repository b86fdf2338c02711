"""An EAGLE-3 layer for the tiny target (tests): it reads both of tiny's layers (the
kind's default on a 2-layer target) and trains with a training-time test of 3 steps,
with tiny's target frozen (`train.teacher`; point `train.teacher_checkpoint` at a
trained tiny run)."""
from specjax.config import Config, HeadsConfig, SamplingConfig, TrainConfig, load_config


def get_config() -> Config:
    tiny = load_config("tiny")
    return Config(name="tiny_eagle3", target=tiny.target, target_from="tiny",
                  heads=HeadsConfig(kind="eagle3", ttt_steps=3),
                  sampling=SamplingConfig(temperature=1.0, lookahead=3, max_new_tokens=16, drafter="eagle3"),
                  train=TrainConfig(teacher="tiny", distill_weight=1.0, weight_decay=0.0))
