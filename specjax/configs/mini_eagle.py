"""An EAGLE layer for the CPU demo's target: one decoder layer of mini_target's block type
at half its width (256: ~1.2M params) over its features, scoring against the corpus's
2,048 most frequent tokens (94% of its tokens), trained with mini_target frozen
(`specjax.heads`), decoding with an int8 copy of itself. A layer of the target's own
width is a sixth of this 6-layer target, and the 4,096-token unembedding as much again:
the draft would cost most of what it saves (benchmarks/heads.md). Sampling stays exact
whatever the draft's precision and vocabulary.
Sample with it: `python -m specjax.sample --config=mini_eagle` (or `--config=mini
--drafter=eagle`)."""
from specjax.config import Config, HeadsConfig, SamplingConfig, TrainConfig, load_config


def get_config() -> Config:
    target = load_config("mini_target").target
    return Config(name="mini_eagle", target=target, tokenizer_vocab=target.vocab_size, target_from="mini_target",
                  heads=HeadsConfig(kind="eagle", width=256, draft_vocab=2048, quantize="int8"),
                  sampling=SamplingConfig(temperature=0.8, top_p=0.95, lookahead=4, max_new_tokens=128,
                                          drafter="eagle"),
                  # Only the layer learns: the target's forward runs every step without gradients.
                  train=TrainConfig(batch_size=16, seq_len=256, steps=200, learning_rate=3e-3,
                                    warmup_steps=20, save_every=50, eval_every=100, weight_decay=0.0,
                                    teacher="mini_target", distill_weight=1.0))
