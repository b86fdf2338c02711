"""The CPU demo's target: ~23M params, trained on the Python standard library's sources.

Sized from measurements on 2 CPU cores (benchmarks/decode_cost.md, training.md): memory-bound at
batch 1, and a training recipe short enough to run on first use (far from converged)."""
from specjax.config import Config, ModelConfig, TrainConfig

MODEL = ModelConfig(vocab_size=4096, d_model=512, num_layers=6, num_heads=8, num_kv_heads=8,
                    head_dim=64, d_ff=2048, max_seq_len=1024, scan_layers=False)


def get_config() -> Config:
    return Config(name="mini_target", target=MODEL, tokenizer_vocab=4096,
                  # A short run, not a converged model: its time on 2 CPU cores is in
                  # benchmarks/training.md.
                  train=TrainConfig(batch_size=16, seq_len=256, steps=150, learning_rate=2e-3,
                                    warmup_steps=15, save_every=25, eval_every=75))
