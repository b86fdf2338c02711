"""The paper's draft model (Chen et al. 2023, section 4): 8 layers, d_model 6144,
ffw 24576, head dim 128 (so 48 heads), ~4B params, Chinchilla's 32k vocabulary,
relative positions and bf16 like its target."""
from specjax.config import Config, MeshConfig, ModelConfig

MODEL = ModelConfig(vocab_size=32000, d_model=6144, num_layers=8, num_heads=48, num_kv_heads=48,
                    head_dim=128, d_ff=24576, max_seq_len=2048, ffw="gelu", pos_encoding="relative",
                    param_dtype="bfloat16", compute_dtype="bfloat16", scan_layers=True)


def get_config() -> Config:
    return Config(name="draft_4b", target=MODEL, mesh=MeshConfig(data=1, model=16))
