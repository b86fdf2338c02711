"""Medusa heads for the tiny target (tests): 3 heads trained with tiny's target frozen
(`train.teacher`; point `train.teacher_checkpoint` at a trained tiny run)."""
from specjax.config import Config, HeadsConfig, SamplingConfig, TrainConfig, load_config


def get_config() -> Config:
    tiny = load_config("tiny")
    return Config(name="tiny_medusa", target=tiny.target, target_from="tiny", heads=HeadsConfig(num_heads=3),
                  sampling=SamplingConfig(temperature=1.0, lookahead=3, max_new_tokens=16, drafter="medusa"),
                  train=TrainConfig(teacher="tiny", distill_weight=1.0, weight_decay=0.0))
