"""Chinchilla 70B as target and the paper's 4B draft, on 16 TPU v4 chips with K=4.

Sources: Hoffmann et al. 2022 (Chinchilla), Table 4: 80 layers, d_model 8192, 64 heads,
key/value size 128, ffw 4 x d_model = 32768, 32k SentencePiece vocabulary, RMSNorm,
Transformer-XL relative positions (inherited from Gopher, Rae et al. 2021), bf16.
Chen et al. 2023, section 4: the draft has 8 layers, d_model 6144, ffw 24576 (4B
params), runs on the same 16 TPU v4 chips; Table 1 uses K=4 at batch 1.
"""
from specjax.config import Config, MeshConfig, ModelConfig, SamplingConfig

TARGET = ModelConfig(vocab_size=32000, d_model=8192, num_layers=80, num_heads=64, num_kv_heads=64,
                     head_dim=128, d_ff=32768, max_seq_len=2048, ffw="gelu", pos_encoding="relative",
                     param_dtype="bfloat16", compute_dtype="bfloat16", scan_layers=True)


def get_config() -> Config:
    from specjax.config import load_config
    draft = load_config("draft_4b").target
    return Config(name="chinchilla_70b", target=TARGET, draft=draft, mesh=MeshConfig(data=1, model=16),
                  sampling=SamplingConfig(temperature=0.8, top_p=0.95, lookahead=4, max_new_tokens=128))
