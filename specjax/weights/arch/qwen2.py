"""Qwen2 and Qwen2.5: `Qwen2ForCausalLM`, GGUF `qwen2`.

Llama's layers and names with a bias on the q, k and v projections (not on o), tied or
untied embeddings. transformers 5's Qwen2Config slides the layers from
`max_window_layers` on only when `use_sliding_window` is true (or as config.json's
`layer_types` says); Qwen2.5's releases have it off. llama.cpp stores q and k unpermuted.
"""
from __future__ import annotations

from specjax.config import ModelConfig
from specjax.weights.arch import common, llama
from specjax.weights.hf_files import BOOL, INT, Fields

HF_ARCHITECTURES = ("Qwen2ForCausalLM",)
MODEL_TYPES = ("qwen2",)
GGUF_ARCHITECTURE = "qwen2"
GGUF_PERMUTED_QK = False
TENSORS = common.LLAMA


def sliding(f: Fields, layers: int) -> dict:
    """The sliding layers of Qwen2/Qwen3's config: from max_window_layers on, when use_sliding_window."""
    window = f.get("sliding_window", INT.or_null(), 4096) if f.get("use_sliding_window", BOOL, False) else None
    first = f.get("max_window_layers", INT, 28)
    default = ["sliding_attention" if window is not None and i >= first else "full_attention" for i in range(layers)]
    return common.attention_pattern(f, default, window, layers)


def from_hf(f: Fields) -> dict:
    out = common.fields(f, max_len=32768, kv_heads=32)
    return dict(out, **common.activation(f, "hidden_act", "silu", "silu", "swiglu"),
                **common.rope(f, out["max_seq_len"]), **sliding(f, out["num_layers"]), qkv_bias=True,
                embed_scale=1.0, norm_weight_after_cast=True)


def from_gguf(m, f) -> dict:
    return dict(llama.from_gguf(m, f), qkv_bias=True)


def unlike(cfg: ModelConfig) -> list[str]:
    return [d for d in llama.unlike(cfg) if not d.startswith(("qkv_bias=", "attention_pattern="))] + \
        common.differences(cfg, qkv_bias=True, attention_pattern=lambda v: v in ("", "G"))


def hf_embed_scale(cfg: ModelConfig) -> float:
    return 1.0  # transformers scales no input embedding


def to_hf(cfg: ModelConfig) -> dict:
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **common.hf_sizes(cfg),
            "hidden_act": "silu", "use_sliding_window": False}
