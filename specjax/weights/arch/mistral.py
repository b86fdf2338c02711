"""Mistral: `MistralForCausalLM` (GGUF files of Mistral models say `llama`).

Llama's layers and names; transformers 5's MistralConfig applies `sliding_window` on every
layer whenever it is not null (4096 when the key is absent; it reads no
`use_sliding_window`, and no bias flags: its projections have none). A window at least
as long as the context is no window.
"""
from __future__ import annotations

from specjax.config import ModelConfig
from specjax.weights.arch import common
from specjax.weights.hf_files import INT, Fields

HF_ARCHITECTURES = ("MistralForCausalLM",)
MODEL_TYPES = ("mistral",)
GGUF_ARCHITECTURE = None
GGUF_PERMUTED_QK = True
TENSORS = common.LLAMA


def from_hf(f: Fields) -> dict:
    out = common.fields(f, max_len=4096 * 32, kv_heads=8)
    window = f.get("sliding_window", INT.or_null(), 4096)
    if window is not None and window < out["max_seq_len"]:
        out.update(attention_pattern="L", sliding_window=window)
    return dict(out, **common.activation(f, "hidden_act", "silu", "silu", "swiglu"),
                **common.rope(f, out["max_seq_len"]), embed_scale=1.0, norm_weight_after_cast=True)


def unlike(cfg: ModelConfig) -> list[str]:
    """Llama's rules, but every layer slides (Llama itself expresses a Mistral without a window)."""
    from specjax.weights.arch import llama
    return [d for d in llama.unlike(cfg) if not d.startswith("attention_pattern=")] + common.differences(
        cfg, attention_pattern="L")


def hf_embed_scale(cfg: ModelConfig) -> float:
    return 1.0  # transformers scales no input embedding


def to_hf(cfg: ModelConfig) -> dict:
    return {"architectures": ["MistralForCausalLM"], "model_type": "mistral", **common.hf_sizes(cfg),
            "hidden_act": "silu", "sliding_window": cfg.sliding_window}
