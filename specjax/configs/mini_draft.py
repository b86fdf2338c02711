"""The CPU demo's draft: ~1.4M params, same tokenizer and corpus as mini_target,
distilled from it (Chen et al. train the draft on the same data; distillation raises
the acceptance rate further)."""
from specjax.config import Config, ModelConfig, TrainConfig

MODEL = ModelConfig(vocab_size=4096, d_model=128, num_layers=2, num_heads=8, num_kv_heads=8,
                    head_dim=16, d_ff=512, max_seq_len=1024, tie_embeddings=False, scan_layers=False)


def get_config() -> Config:
    return Config(name="mini_draft", target=MODEL, tokenizer_vocab=4096,
                  # Distilled from mini_target (the teacher's forward runs every step); its
                  # time on 2 CPU cores is in benchmarks/training.md.
                  train=TrainConfig(batch_size=16, seq_len=256, steps=250, learning_rate=3e-3,
                                    warmup_steps=25, save_every=50, eval_every=125,
                                    teacher="mini_target", distill_weight=0.7))
