"""What the families of `weights/arch/` share: the Llama layout of tensor names (which
most families keep, renaming a few), and the config.json keys every Llama-like family
reads the same way (sizes, heads, norms, rotary settings)."""
from __future__ import annotations

from typing import NamedTuple, Optional

from specjax.config import ModelConfig, UsageError
from specjax.weights.hf_files import BOOL, INT, NUMBER, OBJECT, TEXT, TEXTS, Fields


class Tensor(NamedTuple):
    """Where one specjax param lives in a Hugging Face directory and in a GGUF file ('{i}':
    the layer), and how the HF tensor's layout relates to the param's (see `hf.to_hf`):
    'same', 'transpose' (nn.Linear's [out, in]), 'heads_out' ([N*H, D] -> [N, D, H]),
    'heads_in' ([D, N*H] -> [N, H, D]), 'heads' (a bias [N*H] -> [N, H])."""

    hf: str
    gguf: str
    layout: str


_LAYER = "model.layers.{i}."
# The Llama names, keyed by the specjax param (layers[i].<key>, or a global one). A family
# whose model lacks a param (biases, q/k norms) simply has no such tensor.
LLAMA = {
    "embed": Tensor("model.embed_tokens.weight", "token_embd.weight", "same"),
    "final_norm/scale": Tensor("model.norm.weight", "output_norm.weight", "same"),
    "unembed": Tensor("lm_head.weight", "output.weight", "transpose"),
    "attn_norm/scale": Tensor(_LAYER + "input_layernorm.weight", "blk.{i}.attn_norm.weight", "same"),
    "attn/wq": Tensor(_LAYER + "self_attn.q_proj.weight", "blk.{i}.attn_q.weight", "heads_out"),
    "attn/wk": Tensor(_LAYER + "self_attn.k_proj.weight", "blk.{i}.attn_k.weight", "heads_out"),
    "attn/wv": Tensor(_LAYER + "self_attn.v_proj.weight", "blk.{i}.attn_v.weight", "heads_out"),
    "attn/wo": Tensor(_LAYER + "self_attn.o_proj.weight", "blk.{i}.attn_output.weight", "heads_in"),
    "attn/bq": Tensor(_LAYER + "self_attn.q_proj.bias", "blk.{i}.attn_q.bias", "heads"),
    "attn/bk": Tensor(_LAYER + "self_attn.k_proj.bias", "blk.{i}.attn_k.bias", "heads"),
    "attn/bv": Tensor(_LAYER + "self_attn.v_proj.bias", "blk.{i}.attn_v.bias", "heads"),
    "attn/q_norm/scale": Tensor(_LAYER + "self_attn.q_norm.weight", "blk.{i}.attn_q_norm.weight", "same"),
    "attn/k_norm/scale": Tensor(_LAYER + "self_attn.k_norm.weight", "blk.{i}.attn_k_norm.weight", "same"),
    "ffw_norm/scale": Tensor(_LAYER + "post_attention_layernorm.weight", "blk.{i}.ffn_norm.weight", "same"),
    "ffw/w_gate": Tensor(_LAYER + "mlp.gate_proj.weight", "blk.{i}.ffn_gate.weight", "transpose"),
    "ffw/w_in": Tensor(_LAYER + "mlp.up_proj.weight", "blk.{i}.ffn_up.weight", "transpose"),
    "ffw/w_out": Tensor(_LAYER + "mlp.down_proj.weight", "blk.{i}.ffn_down.weight", "transpose"),
}
SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
ROPE_TYPES = ("default", "llama3", "linear")


def fields(f: Fields, *, max_len: int, kv_heads: Optional[int] = None, head_dim: Optional[int] = None,
           eps: float = 1e-6, tied: bool = False) -> dict:
    """The ModelConfig fields of the keys every Llama-like config.json has, with the family's
    defaults for absent keys (transformers' config class's): kv_heads None = the query
    heads, head_dim None = hidden_size / heads."""
    missing = [k for k in SIZES if k not in f]
    if missing:
        raise UsageError(f"{f.where}: missing {', '.join(missing)}")
    V, D, F, L, N = (f.get(k, INT) for k in SIZES)
    kv = f.get("num_key_value_heads", INT.or_null(), kv_heads)
    H = f.get("head_dim", INT.or_null(), head_dim)
    max_len = f.get("max_position_embeddings", INT, max_len)
    return dict(vocab_size=V, d_model=D, num_layers=L, num_heads=N, num_kv_heads=N if kv is None else kv,
                head_dim=D // max(N, 1) if H is None else H, d_ff=F, max_seq_len=max_len, pos_encoding="rope",
                tie_embeddings=f.get("tie_word_embeddings", BOOL, tied), norm_eps=f.get("rms_norm_eps", NUMBER, eps))


def activation(f: Fields, key: str, allowed: str, default: str, ffw: str) -> dict:
    act = f.get(key, TEXT, default)
    if act != allowed:
        raise UsageError(f"{f.where}: {key}={act!r}: only {allowed!r} is supported (the model's {ffw})")
    return {"ffw": ffw}


def rope_section(f: Fields, rope: Fields, *, theta: float, max_len: int, where: str = "") -> dict:
    """The rotary fields of one rope object ({'rope_type', 'rope_theta', factors}); theta:
    its base when the object does not say. For llama3 a top-level
    `original_max_position_embeddings` wins over the object's, which defaults to
    max_position_embeddings (as transformers 5 merges them)."""
    theta = rope.get("rope_theta", NUMBER, theta)
    rope_type = rope.get("rope_type", TEXT, None) or rope.get("type", TEXT, "default")
    if rope_type not in ROPE_TYPES:
        raise UsageError(f"{f.where}: {where}rope scaling type {rope_type!r} is not supported; supported: "
                         f"{', '.join(ROPE_TYPES)} (plain rotary, Llama 3.1's, positions interpolated)")
    partial = rope.get("partial_rotary_factor", NUMBER, None)
    if partial is None:
        partial = f.get("partial_rotary_factor", NUMBER, 1.0)
    if partial != 1.0:
        raise UsageError(f"{f.where}: partial_rotary_factor={partial}: only full rotary (1.0) is supported")
    out = {"rope_theta": theta}
    if rope_type == "linear":
        out.update(rope_scaling="linear", rope_scaling_factor=rope.get("factor", NUMBER))
    if rope_type == "llama3":
        out.update(rope_scaling="llama3", rope_scaling_factor=rope.get("factor", NUMBER),
                   rope_low_freq_factor=rope.get("low_freq_factor", NUMBER),
                   rope_high_freq_factor=rope.get("high_freq_factor", NUMBER))
        original = f.get("original_max_position_embeddings", INT, None)
        out["rope_original_max_len"] = (original if original is not None else
                                        rope.get("original_max_position_embeddings", INT, max_len))
    return out


def rope(f: Fields, max_len: int, theta: float = 10000.0) -> dict:
    """Rope settings, merged as transformers 5 merges them: a (legacy) `rope_scaling`
    object wins over `rope_parameters`; its `rope_theta` wins over the top-level one."""
    section = f.section("rope_scaling" if f.get("rope_scaling", OBJECT.or_null(), None) else "rope_parameters")
    return rope_section(f, section, theta=f.get("rope_theta", NUMBER, theta), max_len=max_len)


def attention_pattern(f: Fields, layer_types: Optional[list[str]], window: Optional[int], layers: int) -> dict:
    """ModelConfig's attention_pattern and sliding_window from transformers' per-layer
    `layer_types` ('full_attention' | 'sliding_attention'; config.json's own list where it
    has one), the pattern as its shortest repeating unit."""
    layer_types = f.get("layer_types", TEXTS.or_null(), None) or layer_types or []
    if len(layer_types) != layers or set(layer_types) - {"full_attention", "sliding_attention"}:
        raise UsageError(f"{f.where}: layer_types={layer_types[:4]}...: must list 'full_attention' or "
                         f"'sliding_attention' for each of the {layers} layers")
    letters = "".join("L" if t == "sliding_attention" else "G" for t in layer_types)
    if "L" not in letters:
        return {}
    if not window:
        raise UsageError(f"{f.where}: sliding layers but sliding_window={window}")
    return dict(attention_pattern=shortest(letters), sliding_window=window)


def shortest(letters: str) -> str:
    """The shortest pattern that, repeated, spells every layer's letter."""
    n = len(letters)
    return letters[:next(p for p in range(1, n + 1) if all(letters[i] == letters[i % p] for i in range(n)))]


def hf_layer_types(cfg: ModelConfig) -> list[str]:
    return ["sliding_attention" if cfg.sliding(i) else "full_attention" for i in range(cfg.num_layers)]


def hf_rope(cfg: ModelConfig) -> dict:
    """The global layers' rotary settings as top-level `rope_theta` and `rope_scaling`: the
    layout transformers 4.x wrote, which 5.x reads too."""
    scaling = None
    if cfg.rope_scaling == "linear":
        scaling = {"rope_type": "linear", "factor": cfg.rope_scaling_factor}
    if cfg.rope_scaling == "llama3":
        scaling = {"rope_type": "llama3", "factor": cfg.rope_scaling_factor,
                   "low_freq_factor": cfg.rope_low_freq_factor, "high_freq_factor": cfg.rope_high_freq_factor,
                   "original_max_position_embeddings": cfg.rope_original_max_len}
    return {"rope_theta": cfg.rope_theta, "rope_scaling": scaling}


def hf_sizes(cfg: ModelConfig) -> dict:
    return {"vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, **hf_rope(cfg),
            "tie_word_embeddings": cfg.tie_embeddings}


def differences(cfg: ModelConfig, **wanted) -> list[str]:
    """The fields of `cfg` that differ from what a family can express (`wanted`: field ->
    the value it must have, or a predicate)."""
    out = []
    for name, want in wanted.items():
        value = getattr(cfg, name)
        if not (want(value) if callable(want) else value == want):
            out.append(f"{name}={value!r}")
    return out
