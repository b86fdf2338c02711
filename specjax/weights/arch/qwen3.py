"""Qwen3 (dense): `Qwen3ForCausalLM`, GGUF `qwen3`.

Llama's layers and names with an RMSNorm over each head's q and k before rotary
(`self_attn.q_norm` / `k_norm`, Llama's norm: weight after the cast), head_dim 128 unless
config.json says otherwise; `attention_bias` would put biases on all four projections,
o included, which the model lacks (refused). Sliding layers as Qwen2's. llama.cpp stores
q and k unpermuted.
"""
from __future__ import annotations

from specjax.config import ModelConfig, UsageError
from specjax.weights.arch import common, llama, qwen2
from specjax.weights.hf_files import BOOL, Fields

HF_ARCHITECTURES = ("Qwen3ForCausalLM",)
MODEL_TYPES = ("qwen3",)
GGUF_ARCHITECTURE = "qwen3"
GGUF_PERMUTED_QK = False
TENSORS = common.LLAMA


def from_hf(f: Fields) -> dict:
    if f.get("attention_bias", BOOL, False):
        raise UsageError(f"{f.where}: attention_bias=true: a bias on the output projection is not supported")
    out = common.fields(f, max_len=32768, kv_heads=32, head_dim=128)
    return dict(out, **common.activation(f, "hidden_act", "silu", "silu", "swiglu"),
                **common.rope(f, out["max_seq_len"]), **qwen2.sliding(f, out["num_layers"]), qk_norm=True,
                embed_scale=1.0, norm_weight_after_cast=True)


def from_gguf(m, f) -> dict:
    return dict(llama.from_gguf(m, f), qk_norm=True)


def unlike(cfg: ModelConfig) -> list[str]:
    return [d for d in llama.unlike(cfg) if not d.startswith(("qk_norm=", "attention_pattern="))] + \
        common.differences(cfg, qk_norm=True, attention_pattern=lambda v: v in ("", "G"))


def hf_embed_scale(cfg: ModelConfig) -> float:
    return 1.0  # transformers scales no input embedding


def to_hf(cfg: ModelConfig) -> dict:
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **common.hf_sizes(cfg),
            "hidden_act": "silu", "attention_bias": False, "use_sliding_window": False}
