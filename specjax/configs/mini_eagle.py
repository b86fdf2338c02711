"""An EAGLE layer for the CPU demo's target: one decoder layer of mini_target's block type
(~3.7M params) over its features, trained with mini_target frozen (`specjax.heads`).
Sample with it: `python -m specjax.sample --config=mini_eagle` (or `--config=mini
--drafter=eagle`)."""
from specjax.config import Config, HeadsConfig, SamplingConfig, TrainConfig, load_config


def get_config() -> Config:
    target = load_config("mini_target").target
    return Config(name="mini_eagle", target=target, tokenizer_vocab=target.vocab_size, target_from="mini_target",
                  heads=HeadsConfig(kind="eagle"),
                  sampling=SamplingConfig(temperature=0.8, top_p=0.95, lookahead=4, max_new_tokens=128,
                                          drafter="eagle"),
                  # Only the layer learns: the target's forward runs every step without gradients.
                  train=TrainConfig(batch_size=16, seq_len=256, steps=200, learning_rate=3e-3,
                                    warmup_steps=20, save_every=50, eval_every=100, weight_decay=0.0,
                                    teacher="mini_target", distill_weight=1.0))
