"""Llama (Llama 2/3.x, SmolLM2, TinyLlama): `LlamaForCausalLM`, GGUF `llama`.

The reference layout: pre-norm blocks, SwiGLU, RMSNorm with its weight applied after the
cast (`norm_weight_after_cast`), no biases, no embedding scale, default rotary or Llama
3.1's `llama3` scaling (GGUF: `rope_freqs.weight`). q and k need no permutation from
transformers: its Llama rotates the halves (x[:H/2], x[H/2:]) as `model.rotary` does;
llama.cpp's converter permutes their rows to adjacent pairs (2i, 2i + 1), which the GGUF
reader undoes (`GGUF_PERMUTED_QK`).
"""
from __future__ import annotations

from specjax.config import ModelConfig, UsageError
from specjax.weights.arch import common
from specjax.weights.hf_files import BOOL, Fields

HF_ARCHITECTURES = ("LlamaForCausalLM",)
MODEL_TYPES = ("llama",)
GGUF_ARCHITECTURE = "llama"
GGUF_PERMUTED_QK = True
TENSORS = common.LLAMA


def from_hf(f: Fields) -> dict:
    """LlamaConfig's keys (transformers 5): no sliding window is read."""
    out = common.fields(f, max_len=2048)
    for key in ("attention_bias", "mlp_bias"):
        if f.get(key, BOOL, False):
            raise UsageError(f"{f.where}: {key}=true: biases are not supported (Llama has none)")
    return dict(out, **common.activation(f, "hidden_act", "silu", "silu", "swiglu"),
                **common.rope(f, out["max_seq_len"]), embed_scale=1.0, norm_weight_after_cast=True)


def from_gguf(m, f) -> dict:
    """The fields a `llama` file's metadata sets beyond the ones every family shares
    (`gguf.read_config`): no window (llama.cpp's Llama has none)."""
    from specjax.weights.gguf_meta import INT
    experts = m.get("{arch}.expert_count", INT, 0)
    if experts:  # Mixtral's files say `llama`
        raise m.refuse("{arch}.expert_count", experts, "MoE layers are not supported")
    window = m.get("{arch}.attention.sliding_window", INT, 0)
    if window:
        raise m.refuse("{arch}.attention.sliding_window", window, "sliding-window attention is not read for this "
                       "architecture")
    return dict(ffw="swiglu", embed_scale=1.0, norm_weight_after_cast=True)


def unlike(cfg: ModelConfig) -> list[str]:
    """What Llama cannot express in `cfg` (an untied model's input scale is folded into its table)."""
    out = common.differences(cfg, ffw="swiglu", pos_encoding="rope", qkv_bias=False, qk_norm=False, post_norms=False,
                             norm_offset=0.0, query_scale=lambda v: v is None or v == cfg.head_dim ** -0.5,
                             attention_pattern="", local_rope_theta=0.0)
    if cfg.tie_embeddings and cfg.input_embedding_scale != 1.0:
        out.append(f"tied embeddings scaled by {cfg.input_embedding_scale:g} (the one table cannot fold it)")
    return out


def hf_embed_scale(cfg: ModelConfig) -> float:
    return 1.0  # transformers scales no input embedding


def to_hf(cfg: ModelConfig) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common.hf_sizes(cfg),
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
