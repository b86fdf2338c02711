"""Real models' shapes for the benchmarks (shape_sweep.py, loop_parts.py --shape): random
weights of these shapes cost what the real models cost to run."""
from __future__ import annotations

import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from specjax.config import ModelConfig, load_config  # noqa: E402


def llama(**kw) -> ModelConfig:
    """A Llama-family model as specjax's Hugging Face import builds it (SwiGLU, rotary,
    RMSNorm), float32, unrolled layers."""
    return ModelConfig(**{"ffw": "swiglu", "pos_encoding": "rope", "norm_eps": 1e-5, "norm_weight_after_cast": True,
                          "embed_scale": 1.0, **kw})


# The config.json values of each model (Hugging Face hub); Qwen2's q/k/v biases are left
# out (specjax has none; they are D-sized adds).
SHAPES = {
    "smollm2_135m": llama(vocab_size=49152, d_model=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                          d_ff=1536, max_seq_len=8192, rope_theta=100000.0, tie_embeddings=True),
    "smollm2_360m": llama(vocab_size=49152, d_model=960, num_layers=32, num_heads=15, num_kv_heads=5, head_dim=64,
                          d_ff=2560, max_seq_len=8192, rope_theta=100000.0, tie_embeddings=True),
    "qwen2.5_0.5b": llama(vocab_size=151936, d_model=896, num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
                          d_ff=4864, max_seq_len=32768, rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=True),
    "llama3.2_1b": llama(vocab_size=128256, d_model=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                         d_ff=8192, max_seq_len=131072, rope_theta=500000.0, rope_scaling="llama3",
                         rope_scaling_factor=32.0, tie_embeddings=True),
    "tinyllama_1.1b": llama(vocab_size=32000, d_model=2048, num_layers=22, num_heads=32, num_kv_heads=4, head_dim=64,
                            d_ff=5632, max_seq_len=2048, tie_embeddings=False),
    "mini_target": load_config("mini_target").target,
    # The paper's draft (configs/draft_4b.py: Transformer-XL relative positions, GELU,
    # heads of 128, ffw 4 x d_model, 32k vocab, untied) at two thirds of its width,
    # d_model 4096 instead of 6144, in float32: one full-width layer is 2 GB.
    "draft_4b_like": dataclasses.replace(load_config("draft_4b").target, d_model=4096, num_heads=32, num_kv_heads=32,
                                         d_ff=16384, param_dtype="float32", compute_dtype="float32",
                                         scan_layers=False),
}
