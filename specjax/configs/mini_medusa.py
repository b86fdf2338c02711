"""Medusa heads for the CPU demo's target: 5 residual blocks (~1.3M params) on mini_target's
final hidden state, trained with mini_target frozen (its own next-token distributions
at the later positions are the labels; `specjax.heads`). Sample with them:
`python -m specjax.sample --config=mini_medusa` (or `--config=mini --drafter=medusa`)."""
from specjax.config import Config, HeadsConfig, SamplingConfig, TrainConfig, load_config


def get_config() -> Config:
    target = load_config("mini_target").target
    return Config(name="mini_medusa", target=target, tokenizer_vocab=target.vocab_size, target_from="mini_target",
                  heads=HeadsConfig(num_heads=5),
                  sampling=SamplingConfig(temperature=0.8, top_p=0.95, lookahead=3, max_new_tokens=128,
                                          drafter="medusa"),
                  # Only the heads learn: the target's forward runs every step without gradients.
                  train=TrainConfig(batch_size=16, seq_len=256, steps=200, learning_rate=3e-3,
                                    warmup_steps=20, save_every=50, eval_every=100, weight_decay=0.0,
                                    teacher="mini_target", distill_weight=1.0))
