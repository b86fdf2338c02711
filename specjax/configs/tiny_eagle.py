"""An EAGLE layer for the tiny target (tests): trained with tiny's target frozen
(`train.teacher`; point `train.teacher_checkpoint` at a trained tiny run)."""
from specjax.config import Config, HeadsConfig, SamplingConfig, TrainConfig, load_config


def get_config() -> Config:
    tiny = load_config("tiny")
    return Config(name="tiny_eagle", target=tiny.target, target_from="tiny", heads=HeadsConfig(kind="eagle"),
                  sampling=SamplingConfig(temperature=1.0, lookahead=3, max_new_tokens=16, drafter="eagle"),
                  train=TrainConfig(teacher="tiny", distill_weight=1.0, weight_decay=0.0))
