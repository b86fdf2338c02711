"""A real speculative pair at pod scale: Llama-3.1-70B as the target and Llama-3.2-1B as
the draft (one 128k-token tokenizer), bf16, on 16 TPU v4 chips, K=4.

The weights come from Hugging Face directories (`hf_weights`):

    python -m specjax.sample --config=llama3_70b_1b --hf_target=DIR_70B --hf_draft=DIR_1B

and the architecture is read from their config.json; the shapes below are the published
ones (Meta's config.json of each model), so `python -m specjax.plan --config=llama3_70b_1b`
sizes the pod without them:
  Llama-3.1-70B: 80 layers, hidden 8192, 64 heads, 8 kv heads (GQA), head_dim 128,
      intermediate 28672, vocab 128256, rope_theta 500000 with llama3 scaling (factor 8,
      low 1, high 4, original 8192), 131072 positions, rms_norm_eps 1e-5, untied.
  Llama-3.2-1B: 16 layers, hidden 2048, 32 heads, 8 kv heads, head_dim 64, intermediate
      8192, the same vocabulary and rope, TIED embeddings.
Mesh 1x16: every head, ffw and vocab split divides 16. The 8 kv heads do not split
16 ways, so each chip computes and keeps its own copy of the (small, GQA) KV cache:
8 kv heads x 128 x 2 bytes x 2 (k, v) x 80 layers = 320 KiB per token of context (plan
reports the bytes per chip). Sampling: nucleus 0.9 at temperature 0.6, Llama 3's
generation_config defaults; K=4 as in the paper's Table 1. scan_layers keeps the
80-layer compile small.
"""
from specjax.config import Config, MeshConfig, ModelConfig, SamplingConfig

LLAMA = dict(vocab_size=128256, max_seq_len=131072, ffw="swiglu", pos_encoding="rope", rope_theta=500000.0,
             rope_scaling="llama3", rope_scaling_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
             rope_original_max_len=8192, norm_eps=1e-5, embed_scale=1.0, norm_weight_after_cast=True,
             param_dtype="bfloat16", compute_dtype="bfloat16", scan_layers=True)
TARGET = ModelConfig(d_model=8192, num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128, d_ff=28672,
                     tie_embeddings=False, **LLAMA)
DRAFT = ModelConfig(d_model=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64, d_ff=8192,
                    tie_embeddings=True, **LLAMA)


def get_config() -> Config:
    return Config(name="llama3_70b_1b", target=TARGET, draft=DRAFT, mesh=MeshConfig(data=1, model=16),
                  sampling=SamplingConfig(temperature=0.6, top_p=0.9, lookahead=4, max_new_tokens=128),
                  hf_weights=True)
