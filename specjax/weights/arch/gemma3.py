"""Gemma 3, text only: `Gemma3ForCausalLM` (model_type `gemma3_text`), GGUF `gemma3`.

Against Llama: four norms per layer (`post_attention_layernorm` is the norm on the
attention's OUTPUT here, `pre_feedforward_layernorm` the one before the MLP), every norm
(the q/k norms too) multiplying by 1 + w in float32 before the cast; GeGLU with the tanh
GELU (`gelu_pytorch_tanh`); input embeddings times sqrt(hidden_size); attention logits
scaled by query_pre_attn_scalar**-0.5; sliding-window layers (five to one global in the
releases: `layer_types`, or every `sliding_window_pattern`-th layer global) rotating with
their own base (`rope_local_base_freq`, or `rope_parameters.sliding_attention`), the
global ones with `rope_theta` and its scaling (linear in the 4B-27B releases); a tied
262k vocabulary. llama.cpp's converter stores q and k unpermuted and every norm weight as
1 + w (so a GGUF model reads its norms with norm_offset 0).

Refused: logit softcapping (Gemma 2's; null in Gemma 3's releases), bidirectional
attention (EmbeddingGemma), attention biases, and the multimodal
`Gemma3ForConditionalGeneration` (`weights/arch/__init__.py`).
"""
from __future__ import annotations

import math

from specjax.config import ModelConfig, UsageError
from specjax.weights.arch import common
from specjax.weights.arch.common import Tensor
from specjax.weights.hf_files import BOOL, INT, NUMBER, OBJECT, Fields

HF_ARCHITECTURES = ("Gemma3ForCausalLM",)
MODEL_TYPES = ("gemma3_text",)
GGUF_ARCHITECTURE = "gemma3"
GGUF_PERMUTED_QK = False
_LAYER = "model.layers.{i}."
TENSORS = {
    **common.LLAMA,
    "attn_post_norm/scale": Tensor(_LAYER + "post_attention_layernorm.weight", "blk.{i}.post_attention_norm.weight",
                                   "same"),
    "ffw_norm/scale": Tensor(_LAYER + "pre_feedforward_layernorm.weight", "blk.{i}.ffn_norm.weight", "same"),
    "ffw_post_norm/scale": Tensor(_LAYER + "post_feedforward_layernorm.weight", "blk.{i}.post_ffw_norm.weight",
                                  "same"),
}
REFUSED = {"final_logit_softcapping": "a final logit softcap", "attn_logit_softcapping": "an attention logit softcap"}


def _rope(f: Fields, max_len: int) -> dict:
    """Global and local rotary settings from either layout: transformers 5's
    rope_parameters {full_attention: {...}, sliding_attention: {...}}, or top-level
    rope_theta (1e6), rope_scaling (the global layers') and rope_local_base_freq (1e4)."""
    params = f.section("rope_parameters")
    if "full_attention" in params or "sliding_attention" in params:
        full, local = params.section("full_attention"), params.section("sliding_attention")
        theta, local_theta = 1e6, 1e4
    else:
        full = f.section("rope_scaling") if f.get("rope_scaling", OBJECT.or_null(), None) else params
        local = Fields({}, f.where)
        theta, local_theta = f.get("rope_theta", NUMBER, 1e6), f.get("rope_local_base_freq", NUMBER, 1e4)
    out = common.rope_section(f, full, theta=theta, max_len=max_len)
    sliding = common.rope_section(f, local, theta=local_theta, max_len=max_len, where="sliding layers' ")
    if set(sliding) != {"rope_theta"}:
        raise UsageError(f"{f.where}: the sliding layers' rotary scaling {sliding}: only plain rotary is supported "
                         "there")
    return dict(out, local_rope_theta=sliding["rope_theta"])


def from_hf(f: Fields) -> dict:
    for key, what in REFUSED.items():
        if f.get(key, NUMBER.or_null(), None) is not None:
            raise UsageError(f"{f.where}: {key}={f.raw[key]}: {what} is not supported")
    for key in ("use_bidirectional_attention", "attention_bias"):
        if f.get(key, BOOL.or_null(), False):
            raise UsageError(f"{f.where}: {key}=true: not supported (Gemma 3's causal language models have neither)")
    out = common.fields(f, max_len=131072, kv_heads=4, head_dim=256, tied=True)
    L = out["num_layers"]
    every = f.get("sliding_window_pattern", INT, 6)
    default = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(L)]
    window = f.get("sliding_window", INT.or_null(), 4096)
    return dict(out, **common.activation(f, "hidden_activation", "gelu_pytorch_tanh", "gelu_pytorch_tanh", "geglu"),
                **_rope(f, out["max_seq_len"]), **common.attention_pattern(f, default, window, L), qk_norm=True,
                post_norms=True, norm_offset=1.0, norm_weight_after_cast=False,
                query_scale=f.get("query_pre_attn_scalar", NUMBER, 256.0) ** -0.5,
                embed_scale=math.sqrt(out["d_model"]))


def from_gguf(m, f) -> dict:
    """What llama.cpp reads from a `gemma3` file (llama-model's gemma3 loader): the window
    (`attention.sliding_window`; none: every layer global), its pattern
    (`attention.sliding_window_pattern`: an int n, layer i sliding unless i % n == n - 1,
    default 6; or one bool per layer), the sliding layers' base (`rope.freq_base_swa`,
    default 1e4, unscaled); the query scale head_dim**-0.5, or (hidden / heads)**-0.5 for
    the 62-layer 27B (query_pre_attn_scalar, which the file does not hold); the norms as
    stored (1 + w: norm_offset 0); embeddings times sqrt(hidden)."""
    from specjax.weights.gguf_meta import BOOL_TYPE, INT, INTEGER_TYPES, NUMBER, Kind
    cap = m.get("{arch}.final_logit_softcapping", NUMBER, 0.0)
    if cap:
        raise m.refuse("{arch}.final_logit_softcapping", cap, "a final logit softcap is not supported")
    d_model, layers = m.get("{arch}.embedding_length", INT), m.get("{arch}.block_count", INT)
    heads = m.get("{arch}.attention.head_count", INT.layered())
    head_dim = m.get("{arch}.attention.key_length", INT, d_model // heads)
    out = dict(ffw="geglu", qk_norm=True, post_norms=True, norm_offset=0.0, norm_weight_after_cast=False,
               embed_scale=math.sqrt(d_model), query_scale=(d_model // heads if layers == 62 else head_dim) ** -0.5)
    window = m.get("{arch}.attention.sliding_window", INT, 0)
    if window:
        key = "{arch}.attention.sliding_window_pattern"
        pattern = m.get(key, Kind("an integer, or one bool per layer", scalar=INTEGER_TYPES,
                                  items=frozenset({BOOL_TYPE})), 6)
        if isinstance(pattern, list):
            if len(pattern) != layers:
                raise m.refuse(key, pattern, f"must hold one bool per layer ({layers})")
            letters = "".join("L" if x else "G" for x in pattern)
        else:
            letters = "".join("L" if pattern == 0 or i % pattern < pattern - 1 else "G" for i in range(layers))
        if "L" in letters:
            out.update(attention_pattern=common.shortest(letters), sliding_window=window,
                       local_rope_theta=m.get("{arch}.rope.freq_base_swa", NUMBER, 10000.0))
    return out


def gguf_tokenizer(tokens: list[str], bpe):
    """The `tokenizers` pipeline of a `gemma3` file's SentencePiece vocabulary, built as
    transformers' GGUF loader builds it (and as the directory's tokenizer.json runs):
    runs of spaces stored as spaces are spelled with U+2581 as Gemma's BPE looks them up;
    the file holds no merges, so they are the vocabulary's splits ordered by the tokens'
    places in the file (Gemma's scores do not follow its merge order); spaces become U+2581
    before the BPE, no prefix space, byte fallback. `bpe(vocab, merges, **options)` makes
    the model (`gguf`'s, which refuses a bad vocabulary in one line)."""
    from tokenizers import decoders, normalizers, pre_tokenizers
    spelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    place = {t: -i for i, t in enumerate(spelled)}
    merges = []
    for piece, score in place.items():
        local = [(piece[:k], piece[k:], score) for k in range(1, len(piece))
                 if piece[:k] in vocab and piece[k:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    tok = bpe(vocab, [(a, b) for a, b, _ in merges], fuse_unk=True, unk_token="<unk>", byte_fallback=True)
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok


def unlike(cfg: ModelConfig) -> list[str]:
    return common.differences(
        cfg, ffw="geglu", pos_encoding="rope", qkv_bias=False, qk_norm=True, post_norms=True,
        norm_offset=lambda v: v in (0.0, 1.0), norm_weight_after_cast=False,
        embed_scale=lambda v: not cfg.tie_embeddings or math.isclose(cfg.input_embedding_scale,
                                                                     math.sqrt(cfg.d_model), rel_tol=1e-6),
        local_rope_theta=lambda v: v or cfg.rope_scaling == "none")


def hf_embed_scale(cfg: ModelConfig) -> float:
    return math.sqrt(cfg.d_model)


def to_hf(cfg: ModelConfig) -> dict:
    scalar = cfg.head_dim if cfg.query_scale is None else cfg.query_scale ** -2
    return {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", **common.hf_sizes(cfg),
            "hidden_activation": "gelu_pytorch_tanh", "rope_local_base_freq": cfg.local_rope_theta or cfg.rope_theta,
            "query_pre_attn_scalar": int(scalar) if float(scalar).is_integer() else scalar,
            "sliding_window": cfg.sliding_window or cfg.max_seq_len, "layer_types": common.hf_layer_types(cfg),
            "final_logit_softcapping": None, "attn_logit_softcapping": None, "attention_bias": False,
            "use_bidirectional_attention": False}


def to_hf_value(cfg: ModelConfig, key: str, x):
    """A param as transformers' Gemma holds it: a norm weight w of a model whose offset is 0
    (read from a GGUF file, which stores 1 + w) as w - 1."""
    return x - 1.0 if key.endswith("norm/scale") and cfg.norm_offset == 0.0 else x
