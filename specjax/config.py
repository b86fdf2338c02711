"""Typed, frozen configs; `configs/NAME.py` files build them with `get_config()`.

A run is described by one `Config`: the target model, an optional draft model, the
mesh, the sampling settings and the training settings. Every field is validated at
start-up and every error names the field and the value (`ConfigError`), so a bad
command line never reaches JAX.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import numbers
import os
import pathlib
import typing
from typing import Any, Optional, Union

CONFIG_DIR = pathlib.Path(__file__).resolve().parent / "configs"


class UsageError(ValueError):
    """Bad user input (flags, configs, prompts, checkpoints); entry points exit 2."""


class ConfigError(UsageError):
    """A config field has a bad value; the message names the field."""


def _plain_numbers(obj) -> None:
    """Store numpy integers and floats given for int / float fields as Python ones (they
    are hashed into jit's static settings and written to JSON metadata). Anything else
    is left for `validate` to refuse, bools included: lookahead=True is a mistake, not K=1."""
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if isinstance(value, bool):
            continue
        if field.type == "int" and isinstance(value, numbers.Integral):
            object.__setattr__(obj, field.name, int(value))
        elif field.type == "float" and isinstance(value, numbers.Real):
            object.__setattr__(obj, field.name, float(value))


def _name(obj, name) -> str:
    return f"{type(obj).__name__}.{name}"


def _integer(obj, name, low: int, high: Optional[int] = None, hint: str = "", label: str = "") -> None:
    """An int field (never a bool) in [low, high]."""
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        allowed = (f"an integer >= {low}" if high is None else "an integer in [0, 2**63)" if high == SEED_LIMIT - 1
                   else f"an integer in [{low}, {high}]")
        raise ConfigError(f"{label or _name(obj, name)}={value!r}: must be {allowed}{hint}")


def _positive(obj, *names):
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{_name(obj, name)}={value!r}: must be a positive integer")


def _number(obj, name, allowed: str, ok, label: str = "") -> None:
    """A float field (ints accepted, never a bool or NaN) for which `ok(value)` holds;
    `allowed` words the rule for the message."""
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or not ok(value):
        raise ConfigError(f"{label or _name(obj, name)}={value!r}: must be {allowed}")


def _text(obj, *names) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, str):
            raise ConfigError(f"{_name(obj, name)}={value!r}: must be a string")


def _flag(obj, *names) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, bool):
            raise ConfigError(f"{_name(obj, name)}={value!r}: must be True or False")


def _choice(obj, name, allowed):
    value = getattr(obj, name)
    if value not in allowed:
        raise ConfigError(f"{_name(obj, name)}={value!r}: allowed values are {sorted(allowed)}")


SEED_LIMIT = 2 ** 63  # seeds are integers in [0, SEED_LIMIT)


@dataclasses.dataclass(frozen=True)
class Quantization:
    """A way to quantize a model's float weights on load (`--quantize`, a quantized
    self-draft, an EAGLE layer's decode precision): THE registry is `QUANTIZATIONS`;
    `kernels.formats.QUANTIZERS` maps each to the function that makes its weight format."""

    name: str
    bits: int
    grouped: bool  # a scale (and minimum) per output column and group of 32 inputs; else per column
    activations: str  # what the weights multiply: 'float32' (x as it is) or 'int8' (x rounded per group of 32)
    help: str


QUANTIZATIONS = {q.name: q for q in (
    Quantization("int8", 8, False, "float32", "symmetric per output channel"),
    Quantization("int4", 4, True, "float32", "a scale and minimum per output channel and group of 32 inputs"),
    Quantization("w4a8", 4, True, "int8", "int4 groups times activations rounded to int8 per group of 32 "
                 "(llama.cpp's Q4 arithmetic: integer dot products on CPU)"),
    Quantization("w8a8", 8, True, "int8", "symmetric 8-bit groups of 32 (Q8_0) times int8-rounded activations"),
)}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer. Letters used across the repo: D=d_model, N=num_heads,
    K=num_kv_heads, H=head_dim, F=d_ff, V=vocab_size, L=num_layers."""

    vocab_size: int = 64
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4
    head_dim: int = 16
    d_ff: int = 256
    max_seq_len: int = 512
    ffw: str = "gelu"  # 'gelu' | 'swiglu' | 'geglu' (gelu_tanh(gate x) * up x: Gemma)
    pos_encoding: str = "rope"  # 'rope' | 'relative' (Transformer-XL, Chinchilla)
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    scan_layers: bool = False  # unrolled layers decode faster on CPU; scan keeps 80-layer compiles small
    norm_eps: float = 1e-6
    init_seed: int = 0
    # Rotary frequency scaling: 'llama3' (Llama 3.1: long wavelengths divided by the
    # factor, short ones kept, a smooth blend between), 'linear' (every frequency divided
    # by the factor: positions interpolated), 'none': plain rotary.
    rope_scaling: str = "none"
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    # Input embeddings are multiplied by this; None: sqrt(d_model) with tied embeddings
    # (Gemma-style), else 1. Llama-family models use 1 whether tied or not.
    embed_scale: Optional[float] = None
    # RMSNorm as transformers' Llama: normalise in float32, cast to the activation dtype,
    # then multiply by the weight (the same numbers in float32, one rounding apart in bf16).
    norm_weight_after_cast: bool = False
    # How many consecutive copies of each kv head num_kv_heads counts (Megatron/vLLM kv-head
    # duplication, set at load time by `kv_heads.for_mesh`, never in a config file): the
    # model's own kv heads are num_kv_heads // kv_copies.
    kv_copies: int = 1
    # Switches that the model families of weights/arch/ set (the model is named after none of
    # them). q, k and v projections add a bias (Qwen2).
    qkv_bias: bool = False
    # RMSNorm over each head's q and k (weight [head_dim]) before rotary (Qwen3, Gemma 3).
    qk_norm: bool = False
    # An RMSNorm on each sublayer's output too, before the residual add: four norms per
    # layer (Gemma 2/3's "sandwich").
    post_norms: bool = False
    # Every RMSNorm multiplies by (norm_offset + w): Gemma stores w with 1 + w applied.
    norm_offset: float = 0.0
    # The attention logits' scale; None: head_dim**-0.5 (Gemma 3: query_pre_attn_scalar**-0.5).
    query_scale: Optional[float] = None
    # Which layers attend through a sliding window: attention_pattern[i % len] is 'G' (every
    # earlier key) or 'L' (the query's own position and the sliding_window - 1 before it);
    # '' = all 'G'. Gemma 3: 'LLLLLG'; Mistral v0.1: 'L'. A sliding layer keeps a cache as
    # long as a global one (one cache layout); the window is a mask over it.
    attention_pattern: str = ""
    sliding_window: int = 0
    # The 'L' layers' rotary base, plain (no rope_scaling); 0: they rotate as the 'G' ones.
    local_rope_theta: float = 0.0
    # A parallel draft model (PARD, An et al. 2025, arXiv 2504.18583; the drafter 'parallel'):
    # the most tokens it proposes from one forward, the pending token followed by that many
    # less one mask tokens (id vocab_size, whose input embedding is one extra learned row);
    # 0: an ordinary LM, without the mask embedding.
    parallel_draft: int = 0

    def __post_init__(self):
        _plain_numbers(self)

    def validate(self) -> "ModelConfig":
        _positive(self, "vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "d_ff", "max_seq_len")
        _integer(self, "init_seed", 0, SEED_LIMIT - 1)
        _number(self, "rope_theta", "a finite number > 0", lambda v: 0 < v < math.inf)
        _number(self, "norm_eps", "a finite number > 0", lambda v: 0 < v < math.inf)
        _flag(self, "tie_embeddings", "scan_layers", "qkv_bias", "qk_norm", "post_norms")
        _choice(self, "ffw", {"gelu", "swiglu", "geglu"})
        _choice(self, "pos_encoding", {"rope", "relative"})
        _choice(self, "rope_scaling", {"none", "llama3", "linear"})
        if self.rope_scaling == "linear":
            _number(self, "rope_scaling_factor", "a finite number > 0", lambda v: 0 < v < math.inf)
        _number(self, "norm_offset", "a finite number", lambda v: abs(v) < math.inf)
        if self.query_scale is not None:
            _number(self, "query_scale", "a finite number > 0 (or None: head_dim**-0.5)", lambda v: 0 < v < math.inf)
        _text(self, "attention_pattern")
        if set(self.attention_pattern) - {"L", "G"}:
            raise ConfigError(f"ModelConfig.attention_pattern={self.attention_pattern!r}: must be letters 'L' "
                              "(sliding window) and 'G' (global), repeated over the layers ('' = all global)")
        _integer(self, "sliding_window", 0, hint=" (0: no sliding window)")
        if ("L" in self.attention_pattern) != (self.sliding_window > 0):
            raise ConfigError(f"ModelConfig.attention_pattern={self.attention_pattern!r} with sliding_window="
                              f"{self.sliding_window}: sliding ('L') layers need a window > 0, and a window needs "
                              "'L' layers")
        _number(self, "local_rope_theta", "a finite number >= 0 (0: as rope_theta)", lambda v: 0 <= v < math.inf)
        if self.pos_encoding == "relative" and (self.qk_norm or self.sliding_window):
            raise ConfigError("ModelConfig pos_encoding='relative' with qk_norm or a sliding window: those go with "
                              "rotary positions only")
        if self.rope_scaling == "llama3":
            _positive(self, "rope_original_max_len")
            if not (self.rope_scaling_factor > 0 and 0 < self.rope_low_freq_factor < self.rope_high_freq_factor):
                raise ConfigError(f"ModelConfig rope_scaling='llama3' needs rope_scaling_factor > 0 and "
                                  f"0 < rope_low_freq_factor < rope_high_freq_factor, got "
                                  f"{self.rope_scaling_factor}, {self.rope_low_freq_factor}, "
                                  f"{self.rope_high_freq_factor}")
        if self.embed_scale is not None and not self.embed_scale > 0:
            raise ConfigError(f"ModelConfig.embed_scale={self.embed_scale!r}: must be > 0 (or None)")
        _choice(self, "param_dtype", {"float32", "bfloat16", "float16"})
        _choice(self, "compute_dtype", {"float32", "bfloat16", "float16"})
        _positive(self, "kv_copies")
        _integer(self, "parallel_draft", 0, hint=" (0: an ordinary LM; K > 0: drafts K tokens in one forward)")
        if self.num_kv_heads % self.kv_copies:
            raise ConfigError(f"ModelConfig.num_kv_heads={self.num_kv_heads} is not a multiple of "
                              f"kv_copies={self.kv_copies}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"ModelConfig.num_heads={self.num_heads} is not a multiple of "
                              f"num_kv_heads={self.num_kv_heads}")
        if self.pos_encoding == "rope" and self.head_dim % 2:
            raise ConfigError(f"ModelConfig.head_dim={self.head_dim}: rotary positions need an even head_dim")
        return self

    def sliding(self, layer: int) -> bool:
        """Whether layer `layer` attends through the sliding window."""
        return bool(self.attention_pattern) and self.attention_pattern[layer % len(self.attention_pattern)] == "L"

    @property
    def input_embedding_scale(self) -> float:
        if self.embed_scale is not None:
            return float(self.embed_scale)
        return math.sqrt(self.d_model) if self.tie_embeddings else 1.0

    @property
    def num_params(self) -> int:
        D, N, K, H, F, V, L = (self.d_model, self.num_heads, self.num_kv_heads, self.head_dim,
                               self.d_ff, self.vocab_size, self.num_layers)
        attn = D * N * H * 2 + D * K * H * 2 + ((N + 2 * K) * H if self.qkv_bias else 0) + 2 * H * self.qk_norm
        ffw = D * F * (2 if self.ffw == "gelu" else 3)
        rel = (D * N * H + 2 * N * H) if self.pos_encoding == "relative" else 0
        embed = V * D * (1 if self.tie_embeddings else 2) + (D if self.parallel_draft else 0)
        return L * (attn + ffw + rel + (4 if self.post_norms else 2) * D) + embed + D


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh axes ('data', 'model'); model=-1 takes every device left after 'data'."""

    data: int = 1
    model: int = -1

    def __post_init__(self):
        _plain_numbers(self)

    def validate(self) -> "MeshConfig":
        _positive(self, "data")
        if self.model != -1:
            _positive(self, "model")
        return self


# Bounds on what a loop unrolls at trace time, so that a setting compiles in a reasonable
# time (compile time grows with each; benchmarks/bounds.md measures it): the n-gram
# match runs one shifted comparison per suffix length, and a tree of M drafts of K tokens
# is verified node by node.
MAX_NGRAM = 16
MAX_NUM_DRAFTS = 16
MAX_TREE_NODES = 64  # num_drafts * lookahead, or tree_nodes

VERIFY_RULES = ("block", "tokenwise")
EAGLE_KINDS = ("eagle", "eagle3")  # the heads kinds made of one EAGLE layer (`heads.EagleHead`)
EAGLE3_TTT_STEPS = 7  # EAGLE-3's training-time test depth (its training code unrolls 7 steps)
MAX_TTT_STEPS = 16  # each step is one more pass of the layer in every training step
MAX_SELF_DISTILL = 1 << 20  # samples of the teacher a run generates before it trains
DRAFTERS = ("model", "ngram", "retrieval", "hybrid", "medusa", "eagle", "eagle3", "parallel", "hybrid_eagle3")
# What the drafters declare (`decode.drafters`, which this layer does not import; a test
# checks the two agree): those that draw several independent chains per loop (each chain
# a fresh draw), those with an adaptive draft length (draft_confidence), and those that
# grow dynamic draft trees (`Drafter.grows_trees`: they implement `expand`).
SEVERAL_CHAINS = ("model", "hybrid", "medusa", "parallel")
ADAPTIVE = ("model", "hybrid", "eagle", "eagle3", "hybrid_eagle3")
GROWN_TREES = ("model", "eagle", "eagle3", "parallel")
DRAFT_TREES = ("chains", "dynamic")
PASS_WIDTHS = ("full", "proposed")


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Applied identically to draft and target logits: temperature, then top-k, then top-p.

    temperature: 0 is greedy (the argmax); any T > 0 is softmax(logits / T), which tends
    to greedy as T -> 0 (tiny T gives exactly the greedy token where the top logit is
    unique); inf is the T -> inf limit, uniform over the tokens top-k keeps (top-p then
    keeps all of them, as they tie). Integer fields take Python or numpy integers (stored
    as Python ints), never bools."""

    temperature: float = 1.0  # 0 = greedy, inf = uniform
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    lookahead: int = 4  # K, draft tokens per loop (with draft_confidence: the most per loop)
    max_new_tokens: int = 128
    # None = the model's own stop ids where the entry point knows them (its tokenizer's EOS,
    # a Hugging Face directory's generation_config.json), else none; -1 = never stop early,
    # whatever the model says (fixed-length runs); an id, or a tuple stopping at any of its
    # ids (Llama 3 lists several).
    eos_id: Union[int, tuple[int, ...], None] = None
    verify: str = "block"  # 'block' (Sun et al. 2025: jointly, never worse) | 'tokenwise' (the paper's rule)
    # 'model' | 'ngram' (prompt lookup) | 'retrieval' (a datastore) | 'hybrid' | 'medusa' | 'eagle' | 'eagle3'
    # (heads on the target: `specjax.heads`) | 'parallel' (a draft model with mask tokens: K tokens from one forward)
    # | 'hybrid_eagle3' (a lookup's chain where the context matches, else the EAGLE-3 layer's)
    drafter: str = "model"
    ngram: int = 3  # longest context suffix the lookup drafters match (shorter ones down to 1 as fallback)
    draft_confidence: float = 0.0  # > 0: a row stops drafting after a draft distribution whose top p is below it
    # M draft chains per loop, scored as one tree and verified jointly (multi-draft rejection
    # sampling; `verify` picks the rule for a single chain). 'model' or 'hybrid' drafters only.
    num_drafts: int = 1
    # 'chains': num_drafts chains of lookahead tokens; 'dynamic': a tree of tree_nodes draft
    # nodes at most lookahead deep, grown where the drafter is confident (decode/growth.py).
    draft_tree: str = "chains"
    tree_nodes: int = 8  # N, a dynamic tree's draft nodes (the target scores N + 1 tokens a loop)
    # What one chain's scoring pass covers: 'full', K + 1 positions every loop (one pass
    # compiled); 'proposed', the pending token and as many as the longest row proposed (a
    # switch over the K + 1 widths, each compiled): cheaper where a pass's cost grows with
    # its width (a CPU) and proposals vary in length (lookups, hybrids, draft_confidence).
    pass_width: str = "full"

    def __post_init__(self):
        _plain_numbers(self)
        if isinstance(self.eos_id, numbers.Integral) and not isinstance(self.eos_id, bool):
            object.__setattr__(self, "eos_id", int(self.eos_id))
        elif isinstance(self.eos_id, (tuple, list)):
            object.__setattr__(self, "eos_id", tuple(int(i) if isinstance(i, numbers.Integral) and not
                                                     isinstance(i, bool) else i for i in self.eos_id))

    def validate(self) -> "SamplingConfig":
        _number(self, "temperature", ">= 0 (0 means greedy, inf uniform)", lambda v: v >= 0, "temperature")
        _integer(self, "top_k", 0, hint=" (0 turns top-k off)", label="top_k")
        _number(self, "top_p", "in (0, 1] (1 turns nucleus sampling off)", lambda v: 0 < v <= 1, "top_p")
        _integer(self, "lookahead", 1, label="lookahead")
        _integer(self, "max_new_tokens", 1, label="max_new_tokens")
        ids = () if self.eos_id is None else self.eos_id if isinstance(self.eos_id, tuple) else (self.eos_id,)
        if self.eos_id is not None and (not ids or any(isinstance(i, bool) or not isinstance(i, int) for i in ids)
                                        or min(ids) < (0 if isinstance(self.eos_id, tuple) else -1)):
            raise ConfigError(f"eos_id={self.eos_id!r}: must be a token id, a tuple of token ids, -1 (never stop "
                              "early) or None (the model's own stop ids)")
        for name, allowed in (("verify", VERIFY_RULES), ("drafter", DRAFTERS)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name}={getattr(self, name)!r}: allowed values are {', '.join(allowed)}")
        _integer(self, "ngram", 1, MAX_NGRAM, hint=" (the longest context suffix the lookup drafters match; longer "
                 "ones compile slowly and rarely match)", label="ngram")
        _number(self, "draft_confidence", "in [0, 1) (0 turns the adaptive draft length off)",
                lambda v: 0 <= v < 1, "draft_confidence")
        _integer(self, "num_drafts", 1, MAX_NUM_DRAFTS, hint=" (draft chains per loop; 1 = one chain; the tree is "
                 "verified node by node, so its compile time grows with it)", label="num_drafts")
        if self.num_drafts > 1 and self.num_drafts * self.lookahead > MAX_TREE_NODES:
            raise ConfigError(f"num_drafts={self.num_drafts} x lookahead={self.lookahead} = "
                              f"{self.num_drafts * self.lookahead} tree nodes: at most {MAX_TREE_NODES} (the tree is "
                              "verified node by node, so its compile time grows with it)")
        if self.draft_confidence > 0 and self.drafter not in ADAPTIVE:
            raise ConfigError(f"draft_confidence={self.draft_confidence} with drafter={self.drafter!r}: only "
                              f"drafter {' or '.join(map(repr, ADAPTIVE))} stops drafting on its own confidence; "
                              f"{self.drafter!r} always proposes its whole chain (leave draft_confidence at 0)")
        if self.draft_tree not in DRAFT_TREES:
            raise ConfigError(f"draft_tree={self.draft_tree!r}: allowed values are {', '.join(DRAFT_TREES)}")
        _integer(self, "tree_nodes", 1, MAX_TREE_NODES, hint=" (a dynamic draft tree's nodes; the tree is verified "
                 "node by node, so its compile time grows with it)", label="tree_nodes")
        if self.draft_tree == "dynamic" and self.drafter not in GROWN_TREES:
            raise ConfigError(f"draft_tree='dynamic' with drafter={self.drafter!r}: a dynamic tree is grown by "
                              f"drafter {', '.join(map(repr, GROWN_TREES[:-1]))} or {GROWN_TREES[-1]!r}")
        if self.draft_tree == "dynamic" and self.draft_confidence > 0:
            raise ConfigError(f"draft_tree='dynamic' with draft_confidence={self.draft_confidence}: a dynamic tree "
                              "decides its own shape from the draft's probabilities (draft_confidence stops chains)")
        if self.draft_tree == "dynamic" and self.num_drafts > 1:
            raise ConfigError(f"draft_tree='dynamic' with num_drafts={self.num_drafts}: a dynamic tree replaces the "
                              "chains (its width is decided per row: tree_nodes is its size)")
        if self.pass_width not in PASS_WIDTHS:
            raise ConfigError(f"pass_width={self.pass_width!r}: allowed values are {', '.join(PASS_WIDTHS)}")
        if self.pass_width == "proposed" and (self.num_drafts > 1 or self.draft_tree == "dynamic"):
            tree = f"num_drafts={self.num_drafts}" if self.num_drafts > 1 else "draft_tree='dynamic'"
            raise ConfigError(f"pass_width='proposed' with {tree}: only one chain's pass follows its proposal (a "
                              "tree's nodes are all scored: use pass_width='full')")
        if self.num_drafts > 1 and self.drafter not in SEVERAL_CHAINS:
            raise ConfigError(f"num_drafts={self.num_drafts} with drafter={self.drafter!r}: several drafts are "
                              f"independent draws, so they need drafter {', '.join(map(repr, SEVERAL_CHAINS[:-1]))} "
                              f"or {SEVERAL_CHAINS[-1]!r} (a lookup proposes one chain)")
        return self

    def check_context(self, context: int) -> "SamplingConfig":
        """The settings bounded by the models' context (max_seq_len, the fewest tokens a
        row can hold): K draft tokens and the target's pending one must fit, and no
        suffix longer than the context can occur in it."""
        if self.lookahead >= context:
            raise ConfigError(f"lookahead={self.lookahead}: must be below the model's context of {context} tokens")
        if self.ngram > context:
            raise ConfigError(f"ngram={self.ngram}: must be at most the model's context of {context} tokens (a "
                              "longer suffix never occurs in a row)")
        return self

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The token ids that end a row (empty: only max_new_tokens does)."""
        ids = () if self.eos_id is None else self.eos_id if isinstance(self.eos_id, tuple) else (self.eos_id,)
        return tuple(i for i in ids if i >= 0)


@dataclasses.dataclass(frozen=True)
class HeadsConfig:
    """Draft heads on the target's final hidden state (`specjax.heads`): kind 'medusa',
    `num_heads` residual SiLU blocks, head m proposing the token m+1 places past the one
    the target's own unembedding predicts from the same state, through that unembedding;
    kind 'eagle', one decoder layer drafting autoregressively in feature space; kind
    'eagle3', that layer reading a fusion of low, middle and high target layers and
    trained by the training-time test (EAGLE-3). The two EAGLE kinds share every field
    below; they differ in what `feature_layers` and `ttt_steps` default to."""

    kind: str = "medusa"  # 'medusa' | 'eagle' | 'eagle3'
    num_heads: int = 4  # medusa: the longest lookahead they can propose (eagle: unused)
    init_seed: int = 0
    # eagle: the layer's width (0: the target's d_model). A narrower layer reads the
    # target's feature and the token's embedding through [D, width] projections, runs a
    # block of that width (head_dim as the target's, d_ff scaled with it) and projects its
    # output back to D, the feature the target's unembedding reads.
    width: int = 0
    # eagle: the draft vocabulary's size (0: the target's whole vocabulary). The layer's
    # feature is scored against only the N tokens most frequent in its training corpus
    # (EAGLE-3's draft vocabulary): a step's unembedding costs N/V of the whole one. Exact
    # either way: p is the softmax over those N, zero elsewhere.
    draft_vocab: int = 0
    # eagle: the precision the layer decodes in ('' float, or a `QUANTIZATIONS` name); training is
    # float either way): a quantized copy of its projections and draft-vocabulary columns,
    # made on load. The draft is whatever proposes, so sampling stays exact; a run's own
    # heads setting (`--config.heads.quantize=...` with heads of this kind) overrides the
    # checkpoint's.
    quantize: str = ""
    # eagle, eagle3: the target features the layer reads. Empty: kind 'eagle' reads the final
    # hidden state; kind 'eagle3' EAGLE-3's choice for an L-layer target, the residual stream
    # entering its 0-based layers 2, L // 2 and L - 3 (as EAGLE-3's code hooks them; clipped
    # to 1..L, repeats dropped: set them on a shallow target). Else layer counts n in 1..L,
    # increasing: the residual stream after the first n layers (n = L: the last layer's
    # output before the final norm), concatenated and fused by a learned [len * D, D]
    # projection into the feature the layer reads.
    feature_layers: tuple[int, ...] = ()
    # eagle, eagle3: the training-time test's depth (EAGLE-3): in training the layer runs
    # this many steps at every position, each step reading the feature the step before it
    # predicted (the first: the target's), as it drafts. 1 is teacher forcing (EAGLE-1's);
    # 0: the kind's own, 1 for 'eagle', EAGLE-3's 7 for 'eagle3'.
    ttt_steps: int = 0

    def __post_init__(self):
        _plain_numbers(self)
        if isinstance(self.feature_layers, list):  # read back from a checkpoint's JSON
            object.__setattr__(self, "feature_layers", tuple(self.feature_layers))

    def validate(self) -> "HeadsConfig":
        _choice(self, "kind", {"medusa", *EAGLE_KINDS})
        _integer(self, "num_heads", 1, 64)
        _integer(self, "init_seed", 0, SEED_LIMIT - 1)
        _integer(self, "width", 0, hint=" (0: the target's d_model)")
        _integer(self, "draft_vocab", 0, hint=" (0: the target's whole vocabulary)")
        _choice(self, "quantize", {"", *QUANTIZATIONS})
        layers = self.feature_layers
        if not isinstance(layers, tuple) or any(isinstance(n, bool) or not isinstance(n, int) for n in layers) \
                or any(n < 1 for n in layers) or list(layers) != sorted(set(layers)):
            raise ConfigError(f"heads.feature_layers={layers!r}: must be increasing layer counts >= 1 (the residual "
                              "stream after that many target layers), or empty for the kind's own")
        _integer(self, "ttt_steps", 0, MAX_TTT_STEPS, hint=" (the training-time test's depth; 0: the kind's own)",
                 label="heads.ttt_steps")
        if self.kind not in EAGLE_KINDS:
            given = [f"heads.{name}={getattr(self, name)!r}" for name in ("width", "draft_vocab", "quantize",
                                                                        "feature_layers", "ttt_steps")
                     if getattr(self, name)]
            if given:  # only the ones set: the defaults beside them would read as if they were at fault
                them = "it" if len(given) == 1 else "them"
                raise ConfigError(f"{', '.join(given)}: only EAGLE heads have {them}, these are {self.kind!r}; "
                                  f"set heads.kind='eagle' or 'eagle3' with {them}, or leave {them} unset")
        return self

    def layers_for(self, num_layers: int) -> tuple[int, ...]:
        """The target layer counts an EAGLE layer reads on an L-layer target (`feature_layers`,
        or the kind's own: () for 'eagle', the final hidden state)."""
        if self.feature_layers or self.kind != "eagle3":
            return self.feature_layers
        L = num_layers
        return tuple(sorted({min(max(n, 1), L) for n in (2, L // 2, L - 3)}))

    @property
    def test_steps(self) -> int:
        """The training-time test's depth (`ttt_steps`, or the kind's own)."""
        return self.ttt_steps or (EAGLE3_TTT_STEPS if self.kind == "eagle3" else 1)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    batch_size: int = 16
    seq_len: int = 256
    steps: int = 1000
    learning_rate: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    save_every: int = 100
    keep_checkpoints: int = 3
    eval_every: int = 100
    eval_batches: int = 4
    log_every: int = 10
    seed: int = 0
    corpus: str = "stdlib"  # 'stdlib', a directory, or a glob of text files
    val_fraction: float = 0.01
    # Distillation (draft from a trained target): teacher names a config; empty = plain LM loss.
    teacher: str = ""
    teacher_checkpoint: str = ""  # empty = the teacher config's default checkpoint dir
    teacher_hf: str = ""  # or: a Hugging Face model directory (specjax.weights.hf) as the teacher
    teacher_gguf: str = ""  # or: a GGUF file (specjax.weights.gguf) as the teacher
    distill_temperature: float = 1.0
    distill_weight: float = 1.0  # loss = w * KL(teacher || student) + (1 - w) * LM loss
    # Self-distillation (EAGLE-3 and its peers train their drafters on the target's own
    # generations where the corpus is not the target's): > 0 trains on this many samples of
    # the frozen teacher instead of the corpus, each `self_distill_prompt` corpus tokens at
    # a random offset continued by the teacher (the config's sampling settings, ArS) to
    # seq_len + 1 tokens or a stop token; made once per workdir (`training.samples`).
    self_distill: int = 0
    self_distill_prompt: int = 16
    # True: each sample's prompt is a user message in the teacher tokenizer's chat template
    # (an instruction of a few fixed kinds around the corpus window's text), so that a chat
    # model's drafter learns the replies it will draft (`training.samples.CHAT_KINDS`).
    self_distill_chat: bool = False
    # A prompts file (JSONL with a "prompt" per line, or one prompt per line: what
    # --prompts_file reads) as the samples' prompts instead of corpus windows: sample i is
    # the file's prompt i of a seeded shuffle (a new shuffle for each pass over the file),
    # a user message in the chat template with self_distill_chat, else plain text. A drafter
    # drafts replies to its users' requests, which corpus windows in a few fixed
    # instructions resemble less than requests of the same kinds do. Needs teacher_hf or
    # teacher_gguf (their tokenizer encodes the text). '' = corpus windows.
    self_distill_prompts: str = ""
    # True: the loss counts only the positions whose next token the teacher generated (its
    # replies), not the prompts it was given (EAGLE trains on the assistant's turns alone):
    # a drafter drafts replies, and a prompt's corpus text is not the teacher's own.
    self_distill_replies: bool = False
    # Draft heads on a self-distilled corpus: True runs the frozen target's forward once per
    # sample before the first step and keeps what the heads read of it in host memory
    # (`samples.with_target_reads`; F + D values a token, in its compute dtype); False runs it on every
    # step's windows. One process only: a run over several runs it every step.
    cache_target: bool = True
    # Start from another trained model's params instead of a random init (PARD's low-cost
    # adaptation of an autoregressive draft into a parallel one): a config name (its default
    # checkpoint) or a checkpoint directory, of the same model but for parallel_draft; the
    # params it lacks (the mask embedding) keep their init. '' = random init.
    init_from: str = ""

    def __post_init__(self):
        _plain_numbers(self)

    def validate(self) -> "TrainConfig":
        _positive(self, "batch_size", "seq_len", "steps", "save_every", "keep_checkpoints",
                  "eval_every", "eval_batches", "log_every")
        finite = lambda low, high: lambda v: low < v < high  # noqa: E731
        _number(self, "learning_rate", "a finite number > 0", finite(0, math.inf))
        _integer(self, "warmup_steps", 0, self.steps - 1, hint=f" (below train.steps={self.steps})")
        # 0 would freeze the model and a negative value would climb the loss: clipping
        # the gradient's norm at c rescales it to norm c.
        _number(self, "grad_clip", "a finite number > 0 (the largest gradient norm kept)", finite(0, math.inf))
        _number(self, "weight_decay", "a finite number >= 0", lambda v: 0 <= v < math.inf)
        _integer(self, "seed", 0, SEED_LIMIT - 1)
        _text(self, "corpus", "teacher", "teacher_checkpoint")
        if not self.corpus:
            raise ConfigError("TrainConfig.corpus='': must be 'stdlib', a directory, a file or a glob of text files")
        _number(self, "val_fraction", "in (0, 1) (the share of the token stream kept for validation)",
                finite(0, 1))
        _number(self, "distill_weight", "in [0, 1]", lambda v: 0 <= v <= 1)
        _number(self, "distill_temperature", "a finite number > 0", finite(0, math.inf))
        _text(self, "teacher_hf", "teacher_gguf", "init_from")
        _integer(self, "self_distill", 0, MAX_SELF_DISTILL, hint=" (samples of the teacher to train on; 0: the "
                 "corpus itself)", label="train.self_distill")
        _integer(self, "self_distill_prompt", 1, self.seq_len, hint=f" (corpus tokens each sample continues, at most "
                 f"train.seq_len={self.seq_len})", label="train.self_distill_prompt")
        _flag(self, "self_distill_chat")
        if self.self_distill_chat and not self.self_distill:
            raise ConfigError("train.self_distill_chat=True renders the prompts of the teacher's samples: set "
                              "train.self_distill > 0 (how many), or drop train.self_distill_chat")
        _flag(self, "self_distill_replies")
        _flag(self, "cache_target")
        _text(self, "self_distill_prompts")
        if self.self_distill_prompts and not self.self_distill:
            raise ConfigError(f"train.self_distill_prompts={self.self_distill_prompts!r} prompts the teacher's "
                              "samples: set train.self_distill > 0 (how many), or drop train.self_distill_prompts")
        if self.self_distill_replies and not self.self_distill:
            raise ConfigError("train.self_distill_replies=True counts the teacher's replies in its samples: set "
                              "train.self_distill > 0 (how many), or drop train.self_distill_replies")
        if self.self_distill_prompts and not (self.teacher_hf or self.teacher_gguf):
            raise ConfigError(f"train.self_distill_prompts={self.self_distill_prompts!r} holds text, which the "
                              "teacher's tokenizer encodes: a Hugging Face directory (train.teacher_hf) or a GGUF "
                              f"file (train.teacher_gguf) carries one; train.teacher={self.teacher!r} has none")
        if self.self_distill_chat and not (self.teacher_hf or self.teacher_gguf):
            raise ConfigError("train.self_distill_chat=True needs the teacher's chat template, which a Hugging Face "
                              "directory (train.teacher_hf) or a GGUF file (train.teacher_gguf) carries; "
                              f"train.teacher={self.teacher!r} has none")
        if self.self_distill and self.self_distill * self.val_fraction < 1:
            raise ConfigError(f"train.self_distill={self.self_distill} samples x train.val_fraction="
                              f"{self.val_fraction} "
                              "keep less than one sample for validation: raise train.self_distill to at least "
                              f"{math.ceil(1 / self.val_fraction)} or train.val_fraction")
        given = [f"{k}={getattr(self, k)!r}" for k in ("teacher", "teacher_hf", "teacher_gguf") if getattr(self, k)]
        if len(given) > 1:
            raise ConfigError(f"TrainConfig.{' and '.join(given)}: give one teacher (a config's checkpoint, a Hugging "
                              "Face directory or a GGUF file)")
        return self


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything one run needs. `target` is the model that is trained or sampled;
    `draft` (optional) is the small model that proposes tokens for it."""

    name: str = "unnamed"
    target: ModelConfig = ModelConfig()
    draft: Optional[ModelConfig] = None
    mesh: MeshConfig = MeshConfig()
    sampling: SamplingConfig = SamplingConfig()
    train: TrainConfig = TrainConfig()
    tokenizer_vocab: int = 0  # >0: a SentencePiece tokenizer of this size is trained on the corpus
    # Configs whose checkpoints hold the target / draft weights ('' = this config / none).
    target_from: str = ""
    draft_from: str = ""
    # The weights come from Hugging Face directories (--hf_target / --hf_draft), not from
    # specjax checkpoints; the config gives the shapes `plan` uses, dtypes, mesh, sampling.
    hf_weights: bool = False
    # Draft heads over the target (drafter 'medusa'), and the config whose checkpoint holds
    # them ('' = this config). A config with heads and a teacher trains the heads, with
    # the teacher as the frozen target (`specjax.train`).
    heads: Optional[HeadsConfig] = None
    heads_from: str = ""

    def __post_init__(self):
        _plain_numbers(self)

    def heads_for(self, kind: str) -> HeadsConfig:
        """The draft heads of `kind` ('medusa', 'eagle', 'eagle3') a run without their checkpoint
        makes: this config's own where they are of that kind (`--config.heads.num_heads=3`
        sets them on a config without any), else the defaults."""
        own = self.heads if self.heads is not None and self.heads.kind == kind else None
        return own or HeadsConfig(kind=kind).validate()

    def validate(self) -> "Config":
        _text(self, "name", "target_from", "draft_from", "heads_from")
        if self.heads is not None:
            if not isinstance(self.heads, HeadsConfig):
                raise ConfigError(f"Config.heads={self.heads!r}: must be a HeadsConfig or None")
            self.heads.validate()
        for name, cls in (("target", ModelConfig), ("mesh", MeshConfig), ("sampling", SamplingConfig),
                          ("train", TrainConfig)):
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"Config.{name}={getattr(self, name)!r}: must be a {cls.__name__}")
        if self.draft is not None and not isinstance(self.draft, ModelConfig):
            raise ConfigError(f"Config.draft={self.draft!r}: must be a ModelConfig or None")
        _integer(self, "tokenizer_vocab", 0, hint=" (0: no tokenizer)")
        self.target.validate()
        if self.draft is not None:
            self.draft.validate()
            if self.draft.vocab_size != self.target.vocab_size:
                raise ConfigError(f"draft.vocab_size={self.draft.vocab_size} differs from "
                                  f"target.vocab_size={self.target.vocab_size}: they must share a tokenizer")
        self.mesh.validate()
        self.sampling.validate()
        self.train.validate()
        if self.tokenizer_vocab and self.tokenizer_vocab != self.target.vocab_size:
            raise ConfigError(f"tokenizer_vocab={self.tokenizer_vocab} differs from "
                              f"target.vocab_size={self.target.vocab_size}")
        if not self.tokenizer_vocab and self.train.corpus != TrainConfig.corpus:
            # Without a tokenizer the trainer makes its own synthetic tokens: a corpus
            # would be ignored, and a run on it would silently learn something else.
            raise ConfigError(f"train.corpus={self.train.corpus!r}: config {self.name!r} has no tokenizer "
                              "(tokenizer_vocab=0) and trains on synthetic tokens; set tokenizer_vocab (and "
                              "target.vocab_size) to train a tokenizer on the corpus, or leave train.corpus unset")
        return self


# --------------------------------------------------------------------------- loading


def available_configs() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.py") if not p.stem.startswith("_"))


def load_config(name_or_path: str, overrides: typing.Sequence[str] = ()) -> Config:
    """`name` resolves `configs/NAME.py`; a path to a `.py` file works too.
    Overrides are 'field.sub=value' strings (from `--config.field.sub=value`)."""
    path = pathlib.Path(name_or_path)
    if not (path.suffix == ".py" and path.exists()):
        path = CONFIG_DIR / f"{name_or_path}.py"
    if not path.exists():
        raise ConfigError(f"unknown config {name_or_path!r}: not a file, and not one of "
                          f"{', '.join(available_configs())}")
    if not path.is_file():
        raise ConfigError(f"config {str(path)!r} is a directory, not a Python file with get_config()")
    try:
        spec = importlib.util.spec_from_file_location(f"specjax_config_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if not hasattr(module, "get_config"):
            raise ConfigError(f"config file {path} has no get_config() function")
        config = module.get_config()
    except UsageError:
        raise
    except Exception as e:  # noqa: BLE001 (a config file is user code: any error is bad input)
        raise ConfigError(f"config file {path} failed to load: {_one_line(e)}") from e
    if not isinstance(config, Config):
        raise ConfigError(f"{path}: get_config() returned {type(config).__name__}, expected specjax Config")
    for item in overrides:
        config = apply_override(config, item)
    return config.validate()


def _one_line(error: BaseException) -> str:
    """'SyntaxError: invalid syntax (line 3)', 'NameError: ...': an exception in one line."""
    if isinstance(error, SyntaxError):
        return f"{type(error).__name__}: {error.msg} (line {error.lineno})"
    text = " ".join(str(error).split()) or "(no message)"
    return f"{type(error).__name__}: {text[:300]}"


def _optional(annotation: Any) -> tuple[Any, bool]:
    """(the type, whether None is allowed) of a resolved field annotation (`Optional[X]`: X, True)."""
    if typing.get_origin(annotation) is typing.Union:
        return [a for a in typing.get_args(annotation) if a is not type(None)][0], True
    return annotation, False


def _coerce(text: str, annotation: Any, where: str) -> Any:
    annotation, optional = _optional(annotation)
    if optional and text.lower() in ("none", "null"):
        return None
    try:
        if annotation is bool:
            if text.lower() in ("true", "1", "yes"):
                return True
            if text.lower() in ("false", "0", "no"):
                return False
            raise ValueError
        if annotation is int:
            return int(text)
        if annotation is float:
            return float(text)
        if annotation is str:
            return text
        if typing.get_origin(annotation) is tuple:  # 'tuple[int, ...]': comma-separated, '' the empty one
            return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        pass
    else:
        if dataclasses.is_dataclass(annotation):
            raise ConfigError(f"--config.{where}: is a group of fields; set one of "
                              f"{[f.name for f in dataclasses.fields(annotation)]}")
    raise ConfigError(f"--config.{where}={text!r}: not a valid {getattr(annotation, '__name__', annotation)}")


def apply_override(config: Config, item: str) -> Config:
    """Return `config` with one 'a.b.c=value' override applied (typed, validated later)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected FIELD=VALUE, e.g. --config.sampling.lookahead=3")
    key, text = item.split("=", 1)
    parts = key.split(".")

    def set_in(obj, parts, where):
        types = typing.get_type_hints(type(obj))  # the fields' annotations, resolved
        if parts[0] not in types:
            raise ConfigError(f"unknown config field {where + parts[0]!r}; "
                              f"{type(obj).__name__} has {sorted(f.name for f in dataclasses.fields(obj))}")
        if len(parts) == 1:
            return dataclasses.replace(obj, **{parts[0]: _coerce(text, types[parts[0]], where + parts[0])})
        child = getattr(obj, parts[0])
        group, _ = _optional(types[parts[0]])
        if child is None and dataclasses.is_dataclass(group):
            child = group()  # an unset group (a config without heads): its defaults, then this field
        if not dataclasses.is_dataclass(child):
            raise ConfigError(f"config field {where + parts[0]!r} is {child!r} and has no sub-field {parts[1]!r}")
        return dataclasses.replace(obj, **{parts[0]: set_in(child, parts[1:], where + parts[0] + ".")})

    return set_in(config, parts, "")


def is_remote(path) -> bool:
    """A cloud path (`gs://...`): no local file semantics (permissions, locks, appends)."""
    return str(path).startswith("gs://")


# Cloud schemes and the fsspec package etils.epath reads each through (without it, the
# first file access raises ImportError from inside fsspec).
REMOTE_PACKAGES = {"gs": ("gcsfs", "pip install 'specjax[gcs]' (or: pip install gcsfs)")}


def check_remote_support(path) -> None:
    """UsageError naming the package to install when `path` is a cloud path whose
    filesystem package is missing, before anything tries to read it."""
    text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    scheme = text.split("://", 1)[0] if "://" in text else ""
    if scheme not in REMOTE_PACKAGES:
        return
    package, install = REMOTE_PACKAGES[scheme]
    try:
        importlib.import_module(package)
    except ImportError:
        raise UsageError(f"{text}: reading {scheme}:// paths needs the {package} package, which is not "
                         f"installed: {install}") from None


def user_path(text: str | os.PathLike):
    """A path the user gave (a checkpoint, an HF directory, a workdir, a prompts file, an
    output): an `etils.epath.Path`, so `gs://bucket/...` works wherever epath (and orbax)
    support it; `~` is expanded and relative paths made absolute for local ones."""
    from etils import epath
    check_remote_support(text)
    path = epath.Path(text)
    return path if is_remote(text) else path.expanduser().absolute()


def cache_dir() -> pathlib.Path:
    """Where trained checkpoints, tokenizers and token caches live ($SPECJAX_CACHE overrides)."""
    return pathlib.Path(os.environ.get("SPECJAX_CACHE", pathlib.Path.home() / ".cache" / "specjax"))
