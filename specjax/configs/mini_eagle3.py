"""An EAGLE-3 layer for the CPU demo's target (Li et al. 2025, arXiv 2503.01840): the
EAGLE layer of `mini_eagle` (one block of mini_target's type at half its width, the
corpus's 2,048 most frequent tokens, decoding in int8) reading a fusion of three of
mini_target's six layers, low, middle and high (the residual stream after layers 2, 4
and 6; EAGLE-3's own rule, the inputs of layers 2, L // 2 and L - 3, gives only two on a
6-layer target), trained with mini_target frozen by the training-time test: each
position is unrolled for 4 steps on the layer's own features, as it drafts. mini_target
was trained on this corpus, so the corpus is the target's own data (no
`train.self_distill`).
Sample with it: `python -m specjax.sample --config=mini_eagle3` (or `--config=mini
--drafter=eagle3`)."""
from specjax.config import Config, HeadsConfig, SamplingConfig, TrainConfig, load_config


def get_config() -> Config:
    target = load_config("mini_target").target
    return Config(name="mini_eagle3", target=target, tokenizer_vocab=target.vocab_size, target_from="mini_target",
                  heads=HeadsConfig(kind="eagle3", width=256, draft_vocab=2048, quantize="int8",
                                    feature_layers=(2, 4, 6), ttt_steps=4),
                  sampling=SamplingConfig(temperature=0.8, top_p=0.95, lookahead=4, max_new_tokens=128,
                                          drafter="eagle3"),
                  # Only the layer learns: the target's forward runs every step without gradients.
                  train=TrainConfig(batch_size=16, seq_len=256, steps=200, learning_rate=3e-3,
                                    warmup_steps=20, save_every=50, eval_every=100, weight_decay=0.0,
                                    teacher="mini_target", distill_weight=1.0))
