"""Tiny target + draft for tests: a 32-token vocabulary, small enough to enumerate
every 3-token continuation exactly (Theorem 1 tests), with 8 query heads and 4 kv heads
so it shards over a 1x8 mesh (kv replicated) and a 2x4 mesh (kv sharded)."""
from specjax.config import Config, ModelConfig, SamplingConfig


def get_config() -> Config:
    target = ModelConfig(vocab_size=32, d_model=32, num_layers=2, num_heads=8, num_kv_heads=4,
                         head_dim=8, d_ff=64, max_seq_len=512, init_seed=0)
    draft = ModelConfig(vocab_size=32, d_model=16, num_layers=1, num_heads=8, num_kv_heads=8,
                        head_dim=4, d_ff=32, max_seq_len=512, init_seed=1)
    return Config(name="tiny", target=target, draft=draft,
                  sampling=SamplingConfig(temperature=1.0, lookahead=4, max_new_tokens=16))
