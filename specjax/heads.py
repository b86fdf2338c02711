"""Draft heads on the target's own hidden state (Medusa: Cai et al. 2024, "Medusa: Simple
LLM Inference Acceleration Framework with Multiple Decoding Heads", arXiv 2401.10774).

The target's final hidden state h_t (after its final norm) already predicts token t+1
through the unembedding. Head m (m = 1..num_heads) is one residual SiLU block,

    g_m(h) = h + silu(h W_m + b_m),

whose output goes through the TARGET's unembedding (shared, not copied), and predicts
token t+1+m from the same h_t. All heads read one state, so a loop's K proposals come
from one call (non-autoregressive): x_j is drawn from head j's warped softmax, which is
exactly the distribution it was drawn from given any x_<j (the drafter `medusa`).

`W_m` starts at zero (Medusa's init: every head begins as the target's next-token
prediction) for training; random init (`init_heads(..., random=True)`) serves tests and
plans. `Heads` is the loop's handle, a pytree whose leaves are the params (as `LM`).
Training (`heads_loss`): with the target frozen, head m at position t learns the
target's own distribution at position t+m (KL(target || head), the token at t+1+m),
mixed with cross-entropy on the corpus token as distillation mixes it.

The EAGLE layer (`EagleHead`, kinds 'eagle' and 'eagle3') is one module whose options
make EAGLE-1/2 or EAGLE-3 (Li et al. 2025, "EAGLE-3", arXiv 2503.01840): which target
features it reads (`HeadsConfig.feature_layers`: the final hidden state, or several
layers' residual streams fused by a learned projection) and how deep its training-time
test runs (`HeadsConfig.ttt_steps`). `eagle` is the layer over the top feature with
teacher forcing (and EAGLE's feature regression); `eagle3` reads low, middle and high
layers and trains on its own fed-back features, by the token loss alone.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import kv_cache, sharding
from specjax.config import EAGLE_KINDS, HeadsConfig, ModelConfig, TrainConfig, UsageError
from specjax.kernels import DEFAULT as DEFAULT_KERNELS, Kernels
from specjax.kernels.formats import pack_params, project, quantize_params, should_pack, stored
from specjax.kv_cache import Fresh, KVCache
from specjax.model import LM, PROJECTIONS, Block, Keys, cache_limit, causal, full_forward, ordered_after


class MedusaHeads(nnx.Module):
    def __init__(self, hcfg: HeadsConfig, cfg: ModelConfig, keys: Keys, random: bool):
        H, D, dt = hcfg.num_heads, cfg.d_model, cfg.param_dtype
        w = (D ** -0.5) * jax.random.normal(keys(), (H, D, D), jnp.float32) if random else jnp.zeros((H, D, D))
        # Split over 'model' on the input axis (as an attention-out projection): each device
        # multiplies its slice of the whole-row state, and ONE all-reduce sums the heads'
        # states, which stay whole rows for the vocab-parallel unembedding.
        self.w = nnx.Param(w.astype(dt), logical=(None, "mlp", "embed"))
        b = 0.1 * jax.random.normal(keys(), (H, D), jnp.float32) if random else jnp.zeros((H, D))
        self.b = nnx.Param(b.astype(dt), logical=(None, "embed"))
        self.compute_dtype = cfg.compute_dtype

    def __call__(self, h: jax.Array, count: int | None = None) -> jax.Array:
        """h [..., D] -> the first `count` (default: all) heads' states [..., count, D],
        before the unembedding."""
        ct = jnp.dtype(self.compute_dtype)
        h = h.astype(ct)
        w, b = self.w.value[:count], self.b.value[:count]
        z = jnp.einsum("...D,HDE->...HE", h, w.astype(ct)) + b.astype(ct)
        return h[..., None, :] + jax.nn.silu(z)


def eagle_block_config(cfg: ModelConfig, hcfg: HeadsConfig | None = None) -> ModelConfig:
    """The EAGLE layer's block: one layer of the target's block type (its widths, heads,
    ffw and norm), with rotary positions whatever the target uses and no sliding window. With `hcfg.width` a
    narrower block: width // head_dim heads (kv heads: as many of the target's as divide
    them), d_ff scaled by width / d_model."""
    cfg = dataclasses.replace(cfg, num_layers=1, pos_encoding="rope", scan_layers=False, attention_pattern="",
                              sliding_window=0)  # its one layer sees the whole context
    width = hcfg.width if hcfg is not None else 0
    if not width or width == cfg.d_model:
        return cfg
    heads = width // cfg.head_dim
    if heads < 1 or width % cfg.head_dim:
        raise UsageError(f"heads.width={width}: must be a multiple of the target's head_dim={cfg.head_dim}")
    return dataclasses.replace(cfg, d_model=width, num_heads=heads, num_kv_heads=math.gcd(heads, cfg.num_kv_heads),
                               d_ff=max(1, cfg.d_ff * width // cfg.d_model), kv_copies=1)


def feature_layers(hcfg: HeadsConfig, cfg: ModelConfig) -> tuple[int, ...]:
    """The target layer counts an EAGLE layer of `hcfg` reads on a target of `cfg`
    (`HeadsConfig.layers_for`; () for the final hidden state), checked against its depth."""
    layers = hcfg.layers_for(cfg.num_layers)
    if layers and layers[-1] > cfg.num_layers:
        raise UsageError(f"heads.feature_layers={layers}: the target has {cfg.num_layers} "
                         f"layer{'s' if cfg.num_layers > 1 else ''} (each must be in 1..{cfg.num_layers})")
    return layers


class EagleHead(nnx.Module):
    """EAGLE (Li et al. 2024, arXiv 2401.15077): one decoder layer over the target's
    feature at position j and the embedding of token j+1 (concatenated, projected to the
    layer's width), predicting the target's feature at j+1, whose unembedding (the
    target's) gives token j+2. Autoregressive in feature space, with its own one-layer KV
    cache. A layer narrower than the target (`HeadsConfig.width`) projects its output
    back to the target's d_model.

    EAGLE-3 (arXiv 2503.01840): with `feature_layers`, the target's feature is several
    layers' residual streams [len * D] fused by `w_fuse` [len * D, D] (EAGLE-3's fc) into
    the D-wide feature the layer reads (`fuse`); the layer's own output, fed back while it
    drafts, is read unfused. No norm sits between the output and the target's unembedding,
    so a narrow layer's w_up still folds into the draft steps (`Folded`)."""

    def __init__(self, hcfg: HeadsConfig, cfg: ModelConfig, keys: Keys, random: bool):
        D, W, dt = cfg.d_model, eagle_block_config(cfg, hcfg).d_model, cfg.param_dtype
        F = len(feature_layers(hcfg, cfg)) * D
        self.w_fuse = (nnx.Param(((F ** -0.5) * jax.random.normal(keys(), (F, D))).astype(dt), logical=(None, "embed"))
                       if F else None)
        self.w_feature = nnx.Param(((D ** -0.5) * jax.random.normal(keys(), (D, W))).astype(dt), logical=("embed", None))
        self.w_token = nnx.Param(((D ** -0.5) * jax.random.normal(keys(), (D, W))).astype(dt), logical=("embed", None))
        self.block = Block(eagle_block_config(cfg, hcfg), keys)
        self.w_up = (nnx.Param(((W ** -0.5) * jax.random.normal(keys(), (W, D))).astype(dt), logical=(None, "embed"))
                     if W != D else None)
        self.compute_dtype = cfg.compute_dtype
        self.norm_eps = cfg.norm_eps

    def fuse(self, features, kernels: Kernels = DEFAULT_KERNELS) -> jax.Array:
        """The target's features [B, T, len * D] -> the D-wide feature the layer reads (the
        final hidden state, without `feature_layers`, as it is). Each layer's residual
        stream is RMS-normalised first: its scale grows with depth (mini_target's, after
        layers 2, 4 and 6: RMS 3.8, 7.0, 9.2 against the final norm's 1.0; a random
        layer fusing them raw started training at KL ~26 nats), and the layer's output,
        whose scale the target's unembedding reads directly, starts from them. EAGLE-3
        normalises inside its layer (its hidden_norm) and before its own head; the draft
        steps here feed the output back unnormalised, so that a narrow layer's w_up still
        folds (`Folded`)."""
        if self.w_fuse is None:
            return features
        ct = jnp.dtype(self.compute_dtype)
        return project("BTF,FD->BTD", self.normalized(features), self.w_fuse.value, kernels, ct)

    def normalized(self, features) -> jax.Array:
        """The target's layers [B, T, len * D], each RMS-normalised (`fuse`'s first step)."""
        D = self.w_fuse.value.shape[-1]
        x = features.astype(jnp.float32).reshape(features.shape[:-1] + (-1, D))
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.norm_eps)
        return x.reshape(features.shape).astype(jnp.dtype(self.compute_dtype))

    def __call__(self, features, embedded, positions, cache: KVCache, visible=None,
                 kernels: Kernels = DEFAULT_KERNELS, feature_weight=None, up: bool = True,
                 prior: kv_cache.Prior | None = None, cache_visible=None) -> tuple[jax.Array, Fresh]:
        """features, embedded [B, T, D] (the target's feature at positions[t] and the
        embedding of the token after it) -> (predicted features [B, T, D] of the next
        positions, Fresh: this pass's keys and values for the layer's cache, read only).
        Decoding a narrow layer (`Folded`): up=False returns the block's output [B, T, W]
        before w_up, and `feature_weight` (w_up @ w_feature, [W, W]) reads such an output
        as the feature input in place of w_feature. `prior`: the layer's keys of earlier
        passes that its cache does not hold (a grown draft tree's, `kv_cache.Prior` with
        one layer), seen where `visible` [.., T, U + T] says. `cache_visible`: a bool [T, S]
        of the cache entries each position sees, in place of the row's length (the
        training-time test's, `training_time_test`)."""
        ct = jnp.dtype(self.compute_dtype)
        x = (project("BTD,DW->BTW", features.astype(ct), self.w_feature.value if feature_weight is None
                     else feature_weight, kernels, ct)
             + project("BTD,DW->BTW", embedded.astype(ct), self.w_token.value, kernels, ct))
        T = x.shape[1]
        visible = causal(T) if visible is None else visible
        limit = cache_limit(cache, positions) if cache_visible is None else jnp.asarray(cache_visible, bool)
        layer_prior = None if prior is None else (prior.k[0], prior.v[0], prior.positions)
        x, k, v = self.block(x, positions, cache.k, cache.v, None, 0, limit, visible, kernels, layer_prior)
        if self.w_up is not None and up:
            x = project("BTW,WD->BTD", x, self.w_up.value, kernels, ct)
        return x, Fresh(*ordered_after(k[None], v[None], x))


MODULES = {"medusa": MedusaHeads, "eagle": EagleHead, "eagle3": EagleHead}


def reads_of(hcfg: HeadsConfig, model: ModelConfig) -> bool | tuple[int, ...]:
    """What heads of `hcfg` read of `model`'s forward (`Heads.features`)."""
    return (hcfg.kind in EAGLE_KINDS and hcfg.layers_for(model.num_layers)) or True


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Heads:
    """Draft heads as the loops see them: static configs and graph, the params as leaves."""

    cfg: HeadsConfig
    model: ModelConfig  # the target they were made for (its d_model; a checkpoint records it)
    graphdef: Any
    params: Any
    # EAGLE's draft vocabulary (`HeadsConfig.draft_vocab`): the token ids [N] its feature
    # is scored against, most frequent first; None: the target's whole vocabulary.
    vocab: Any = None

    def __call__(self, *args, **kwargs):
        """The module's forward: Medusa's (hidden, count), EAGLE's (features, embedded,
        positions, cache, visible, kernels)."""
        return nnx.merge(self.graphdef, self.params)(*args, **kwargs)

    @property
    def features(self) -> bool | tuple[int, ...]:
        """What these heads read of the target's forward (`model.Transformer`'s `features`):
        its final hidden state (True), or the layer counts an EAGLE-3 layer fuses."""
        return reads_of(self.cfg, self.model)

    def fused(self, features: jax.Array, kernels: Kernels = DEFAULT_KERNELS) -> jax.Array:
        """The target's features as the EAGLE layer reads them (`EagleHead.fuse`)."""
        return nnx.merge(self.graphdef, self.params).fuse(features, kernels)

    def normalized(self, features: jax.Array) -> jax.Array:
        """The target's layers each RMS-normalised, not yet fused: for a window pass that
        reads them through w_fuse w_feature folded (`Folded.window`)."""
        return nnx.merge(self.graphdef, self.params).normalized(features)

    def eagle_step(self, target: LM, features, tokens, positions, cache: KVCache,
                   table=None, feature_weight=None, up: bool = True) -> tuple[jax.Array, KVCache]:
        """EAGLE's pass over T (feature, next token) pairs at `positions`, written into its
        cache at positions[:, 0]: -> (predicted features [B, T, D], cache). The tokens are
        embedded from `table` (`model.whole_table(target)`) where given. `feature_weight`,
        `up`: a folded narrow layer's decoding (`EagleHead.__call__`, `Folded`)."""
        predicted, fresh = self(features, target.embed(tokens, table), positions, cache, None, target.kernels,
                                feature_weight, up)
        return predicted, kv_cache.commit(cache, fresh, positions[:, 0])

    def empty_cache(self, batch: int, size: int) -> KVCache:
        """EAGLE's own one-layer cache (its rows sharded as the target's)."""
        return kv_cache.empty(eagle_block_config(self.model, self.cfg), batch, size)

    def logits(self, target: LM, hidden: jax.Array, count: int | None = None) -> jax.Array:
        """The target's final hidden states [B, ..., D] -> the first `count` heads' logits
        [B, ..., count, V] through the target's own unembedding."""
        states = self(hidden, count)
        flat = states.reshape(states.shape[0], -1, states.shape[-1])
        return target.logits(flat).reshape(states.shape[:-1] + (-1,))

    def packed(self, target: LM) -> "Heads":
        """These heads as decoding runs them: EAGLE's projections quantized where
        `cfg.quantize` asks, and packed for the CPU few-row kernel where it runs for
        `target` (`kernels.should_pack`), as `LM.packed` packs the target's; else
        themselves. Made once per Heads."""
        made = self.__dict__.get("_packed")
        if made is not None:
            return made
        made = self
        if self.cfg.kind in EAGLE_KINDS:
            names = {**PROJECTIONS, "w_fuse": (1, 2), "w_feature": (1, 2), "w_token": (1, 2), "w_up": (1, 2)}
            params = decoding_weights(self.params, names, self.cfg.quantize, self.model, target)
            made = dataclasses.replace(self, params=params)
            object.__setattr__(made, "_packed", made)
        object.__setattr__(self, "_packed", made)
        return made

    @property
    def num_params(self) -> int:
        return sum(math.prod(x.shape) for x in jax.tree.leaves(self.params))

    def tree_flatten(self):
        return (self.params, self.vocab), (self.cfg, self.model, self.graphdef)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(aux[0], aux[1], aux[2], children[0], children[1])


def decoding_weights(params, names: dict, quantize: str, cfg: ModelConfig, target: LM):
    """`params` as a draft decodes with them: the weights in `names` quantized to
    `quantize` (if any), then packed for the CPU kernel where it runs for `target`."""
    if quantize:
        params = quantize_params(params, names, (), quantize)
    if should_pack(params, (cfg.param_dtype, cfg.compute_dtype), target.kernels):
        params = pack_params(params, names)
    return params


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Unembedding:
    """What EAGLE's predicted feature is scored against: the target's whole unembedding,
    or its columns for the layer's draft vocabulary (`Heads.vocab`), a [D, N] copy whole on
    every device (so the draft's logits need no collective) and packed where the CPU
    kernel runs. `logits` gives the N (or V) logits, `tokens` maps an index among them to
    a token id, `spread` puts a distribution over them into the whole vocabulary (zero
    outside the draft vocabulary: the p verification reads)."""

    target: LM
    ids: Any = None  # [N] int32, or None: the whole vocabulary
    columns: Any = None  # [D, N]

    def logits(self, hidden: jax.Array) -> jax.Array:
        if self.ids is None:
            return self.target.logits(hidden)
        return project("BTD,DN->BTN", hidden, self.columns, self.target.kernels,
                       jnp.dtype(self.target.cfg.compute_dtype), preferred_element_type=jnp.float32)

    def tokens(self, index: jax.Array) -> jax.Array:
        return index if self.ids is None else jnp.take(self.ids, index)

    def spread(self, probs: jax.Array) -> jax.Array:
        if self.ids is None:
            return probs
        whole = jnp.zeros(probs.shape[:-1] + (self.target.cfg.vocab_size,), probs.dtype)
        return whole.at[..., self.ids].set(probs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Folded:
    """A narrow EAGLE layer with a draft vocabulary, as its K-1 draft steps run it. Its
    predicted feature (block output x [W] times w_up [W, D]) is read twice per step, by
    the draft vocabulary's columns C [D, N] (the logits) and by the next step's w_feature
    [D, W]; both products are linear in x, so they are folded into `columns` = w_up C
    [W, N] and `feature` = w_up w_feature [W, W], and the step never forms the D-wide
    feature: a step reads W x (N + W) weights where it read W x D + D x (N + W). Only the
    window pass, which reads the target's true D-wide features, runs w_feature itself;
    an EAGLE-3 layer's window pass reads its fused layers [len * D] through w_fuse then
    w_feature, also linear, folded into `window` = w_fuse w_feature [len * D, W] (a
    3-layer fusion at D = 512, W = 256: 3 x 512 x 256 weights where it read
    3 x 512 x 512 + 512 x 256). The draft's numbers differ from the unfolded layer's by
    float rounding; p is whatever it computes, so sampling stays exact."""

    unembed: Unembedding  # with columns = w_up C [W, N]
    feature: Any  # w_up w_feature [W, W]
    window: Any = None  # w_fuse w_feature [len * D, W] (an EAGLE-3 layer), else None


def unembedding(heads: Heads, target: LM, fold: bool = False) -> Unembedding:
    """`heads`' draft vocabulary's `Unembedding` on `target` (its whole one without);
    with `fold`, its columns premultiplied by the layer's w_up (`Folded`)."""
    if heads.vocab is None:
        return Unembedding(target)
    table = target.params["embed"].value if target.cfg.tie_embeddings else target.params["unembed"].value
    tied = target.cfg.tie_embeddings
    leaf = jax.tree.leaves(table)[0]
    where = getattr(leaf, "sharding", None)
    everywhere = sharding.replicated(where.mesh) if isinstance(where, jax.sharding.NamedSharding) else None
    up = heads.params["w_up"].value if fold else None
    if not isinstance(leaf, jax.Array):  # `plan`'s abstract params
        D, N = (up.shape[0] if fold else target.cfg.d_model), heads.vocab.shape[0]
        ids = jax.ShapeDtypeStruct((N,), jnp.int32, sharding=everywhere)
        return Unembedding(target, ids, jax.ShapeDtypeStruct((D, N), leaf.dtype, sharding=everywhere))

    def gather(table, ids, up):
        columns = vocabulary_columns(table, ids, tied)
        return columns if up is None else float_product(up, columns)

    columns = jax.jit(gather, out_shardings=everywhere)(table, heads.vocab, up)
    ids = heads.vocab if everywhere is None else jax.device_put(heads.vocab, everywhere)
    columns = decoding_weights({"columns": columns}, {"columns": (1, 2)}, heads.cfg.quantize, target.cfg,
                               target)["columns"]
    return Unembedding(target, ids, columns)


def vocabulary_columns(table, ids, tied: bool) -> jax.Array:
    """The [D, N] columns of a target's unembedding `table` (as stored: [V, D] when `tied`
    to the embedding, else [D, V]) for the token ids [N]."""
    whole = stored(table)
    return whole[ids].T if tied else whole[:, ids]


def float_product(a, b) -> jax.Array:
    """a @ b in float32 at full precision, in b's dtype: `Folded`'s products of two weights
    (either as stored: a quantized one dequantized)."""
    return jnp.matmul(stored(a).astype(jnp.float32), stored(b).astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST).astype(stored(b).dtype)


def folded(heads: Heads, target: LM) -> Folded | None:
    """`Folded` for an EAGLE layer narrower than the target with a draft vocabulary
    (float `heads`, before `packed`), its weights quantized and packed as the layer's
    (`HeadsConfig.quantize`); None for any other layer."""
    if heads.cfg.kind not in EAGLE_KINDS or heads.vocab is None or "w_up" not in heads.params:
        return None
    feature = heads.params["w_feature"].value

    def fold(a):  # a @ w_feature, quantized and packed as the layer's weights
        if not isinstance(jax.tree.leaves(a)[0], jax.Array):  # `plan`'s abstract params
            return jax.ShapeDtypeStruct((a.shape[0], feature.shape[1]), feature.dtype,
                                        sharding=getattr(feature, "sharding", None))
        product = jax.jit(float_product)(a, feature)
        return decoding_weights({"w": product}, {"w": (1, 2)}, heads.cfg.quantize, target.cfg, target)["w"]

    return Folded(unembedding(heads, target, fold=True), fold(heads.params["w_up"].value),
                  fold(heads.params["w_fuse"].value) if "w_fuse" in heads.params else None)


def checked(draft, target_cfg: ModelConfig, kind: str, drafter: str) -> Heads:
    """`draft` if it is heads of `kind` made for a target as wide as `target_cfg`, else a
    UsageError naming what was given (a drafter's `make`)."""
    what = {"medusa": "Medusa heads (heads of kind 'medusa'", "eagle": "an EAGLE layer (heads of kind 'eagle'",
            "eagle3": "an EAGLE-3 layer (heads of kind 'eagle3'"}[kind]
    if not isinstance(draft, Heads) or draft.cfg.kind != kind:
        got = f"{draft.cfg.kind} heads" if isinstance(draft, Heads) else type(draft).__name__
        raise UsageError(f"drafter={drafter!r} needs {what}: a config with `heads`, trained by `python -m "
                         f"specjax.train`, or specjax.heads.init_heads), got {got}")
    if draft.model.d_model != target_cfg.d_model:
        raise UsageError(f"the {kind} heads were made for d_model={draft.model.d_model}, the target has "
                         f"d_model={target_cfg.d_model}")
    return draft


def draft_vocabulary(hcfg: HeadsConfig, cfg: ModelConfig, ids=None, mesh: jax.sharding.Mesh | None = None):
    """The draft vocabulary `hcfg` asks for on a target of `cfg`'s vocabulary, as the
    [N] int32 array `Heads.vocab` holds (replicated on `mesh`): `ids` (a corpus's most
    frequent tokens, `most_frequent`), or without them the first N ids (random heads for
    tests and plans); None for the whole vocabulary."""
    N, V = hcfg.draft_vocab, cfg.vocab_size
    if not N:
        return None
    if N > V:
        raise UsageError(f"heads.draft_vocab={N}: the target has only {V} tokens (0 uses them all)")
    ids = np.arange(N, dtype=np.int32) if ids is None else np.asarray(ids, dtype=np.int64)
    if ids.shape != (N,) or ids.min() < 0 or ids.max() >= V or len(np.unique(ids)) != N:
        raise UsageError(f"a draft vocabulary of heads.draft_vocab={N} distinct token ids below {V} was "
                         f"expected, got {ids.shape[0]} ids in [{ids.min()}, {ids.max()}]")
    ids = jnp.asarray(ids, jnp.int32)
    return ids if mesh is None else jax.device_put(ids, sharding.replicated(mesh))


def most_frequent(tokens: np.ndarray, count: int, vocab_size: int) -> np.ndarray:
    """The `count` token ids most frequent in `tokens`, most frequent first (ties: the
    smaller id first): a draft vocabulary from a training corpus."""
    counts = np.bincount(np.asarray(tokens).reshape(-1), minlength=vocab_size)
    return np.argsort(-counts, kind="stable")[:count].astype(np.int32)


def abstract_heads(hcfg: HeadsConfig, cfg: ModelConfig, mesh: jax.sharding.Mesh | None = None) -> Heads:
    """Shapes (and shardings, given a mesh) of the heads' params, nothing allocated."""
    module = MODULES[hcfg.kind]
    graphdef, state = nnx.split(nnx.eval_shape(lambda: module(hcfg, cfg, Keys(hcfg.init_seed), False)))
    if mesh is not None:
        state = sharding.with_shardings(state, sharding.param_shardings(state, mesh))
    vocab = jax.eval_shape(lambda: draft_vocabulary(hcfg, cfg))
    if vocab is not None and mesh is not None:
        vocab = jax.ShapeDtypeStruct(vocab.shape, vocab.dtype, sharding=sharding.replicated(mesh))
    return Heads(hcfg, cfg, graphdef, state, vocab)


def init_heads(hcfg: HeadsConfig, cfg: ModelConfig, mesh: jax.sharding.Mesh, *, random: bool = False,
               vocab=None) -> Heads:
    """New heads, created sharded: Medusa's zero blocks (training's start) or random ones
    (`random`); an EAGLE layer is random either way (a zero layer would pass no feature on).
    `vocab`: the draft vocabulary's ids (`draft_vocabulary`; default the first N)."""
    abstract = abstract_heads(hcfg, cfg, mesh)
    shardings = sharding.param_shardings(abstract.params, mesh)
    module = MODULES[hcfg.kind]
    init = jax.jit(lambda: nnx.split(module(hcfg, cfg, Keys(hcfg.init_seed), random))[1],
                   out_shardings=shardings)
    return dataclasses.replace(abstract, params=init(), vocab=draft_vocabulary(hcfg, cfg, vocab, mesh))


def test_visibility(T: int, j: int) -> np.ndarray:
    """The training-time test over a sequence of T tokens: which earlier keys step j's rows
    see, [T-1-j, S] over the keys of steps 0..j-1 laid end to end (step i: T-1-i rows).
    Row t of step j reads the feature at t (the target's for step 0, else the one step j-1
    predicted at t) and token t+1+j at position t+j, and predicts token t+2+j; it sees what
    the same row sees when the layer drafts its j-th step after a window ending at t: step
    0's rows up to t (the pairs of true features) and its own row of steps 1..j-1 (the
    features it fed back itself), then its own key; as EAGLE-3's training code does."""
    t = np.arange(T - 1 - j)
    blocks = [np.arange(T - 1)[None, :] <= t[:, None]]  # step 0: the true pairs up to t
    blocks += [np.arange(T - 1 - i)[None, :] == t[:, None] for i in range(1, j)]  # steps 1..j-1: row t's own
    return np.concatenate(blocks, axis=1)


def training_time_test(heads: Heads, target: LM, inputs: jax.Array, hidden: jax.Array, steps: int) -> list:
    """The EAGLE layer's predicted features over token rows `inputs` [B, T] whose target
    features (`heads.features` of the target's forward) are `hidden` [B, T, ...], for
    `steps` steps of the training-time test (`test_visibility`): step j's [B, T-1-j, D],
    row t the feature at t+1+j, the layer having fed back its own features j times. Step
    j is one pass over its T-1-j rows, reading the keys of the steps before it as a cache
    with a per-row visibility (as drafting reads its cache) and its own key."""
    B, T = inputs.shape
    embedded = target.embed(inputs)
    features = heads.fused(hidden[:, :-1])  # step 0 reads the target's
    keys, values, out = [], [], []
    for j in range(steps):
        rows = T - 1 - j
        positions = jnp.broadcast_to(jnp.arange(j, T - 1, dtype=jnp.int32), (B, rows))
        cache, seen = heads.empty_cache(B, 0), None
        if j:  # the steps before: [L=1, B, G, S, H], as a cache holds them
            cache = dataclasses.replace(cache, k=jnp.concatenate(keys, axis=3), v=jnp.concatenate(values, axis=3))
            seen = test_visibility(T, j)
        visible = causal(rows) if j == 0 else jnp.eye(rows, dtype=bool)
        predicted, fresh = heads(features, embedded[:, 1 + j:], positions, cache, visible, cache_visible=seen)
        keys.append(jnp.swapaxes(fresh.k, 2, 3))
        values.append(jnp.swapaxes(fresh.v, 2, 3))
        out.append(predicted)
        features = predicted[:, :rows - 1]  # step j+1 reads them
    return out


def target_reads(reads: bool | tuple[int, ...], target: LM, inputs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The frozen target's forward over `inputs` [B, T] as heads training reads it:
    (what the heads read (`Heads.features`: the final hidden states, or the layers an
    EAGLE-3 layer fuses) [B, T, F], the final hidden states [B, T, D] the loss's target
    logits come from). The forward's own logits are not formed (XLA drops them): the loss
    projects the final states onto the columns it scores (`scored_vocabulary`)."""
    if reads is True:
        _, final = full_forward(target, inputs, features=True)
        return final, final
    D = target.cfg.d_model
    _, hidden = full_forward(target, inputs, features=tuple(reads) + (target.cfg.num_layers,))
    return hidden[..., :-D], target.final_norm(hidden[..., -D:])


def scored_vocabulary(heads: Heads, target: LM):
    """(unembedding, labels): what training scores an EAGLE layer's predicted feature
    against, the tokens it drafts from. With a draft vocabulary (`Heads.vocab`), its N
    columns of the target's unembedding (float, as trained; taken inside the step) and
    labels(tokens, counted) -> (each token's index among the N, counted where the token is
    one of them: the others cannot be predicted); without one, the whole unembedding and
    the tokens as they are."""
    if heads.vocab is None:
        return Unembedding(target), lambda tokens, counted: (tokens, counted)
    tied = target.cfg.tie_embeddings
    columns = jax.lax.stop_gradient(vocabulary_columns(target.params["embed" if tied else "unembed"].value,
                                                       heads.vocab, tied))
    N = heads.vocab.shape[0]
    index = jnp.full((target.cfg.vocab_size,), -1, jnp.int32).at[heads.vocab].set(jnp.arange(N, dtype=jnp.int32))

    def labels(tokens, counted):
        i = index[tokens]
        inside = (i >= 0).astype(jnp.int32)
        return jnp.maximum(i, 0), inside if counted is None else counted * inside

    return Unembedding(target, heads.vocab, columns), labels


def heads_loss(tc: TrainConfig):
    """loss(heads, target LM, batch [B, T+1], distill weight w, counted [B, T+1] or None,
    seen: the target's `target_reads` of batch[:, :-1], or None to run its forward here)
    -> (loss, metrics), the target frozen (no gradient reaches it); each mean is over the
    rows whose predicted token `counted` marks (every row where None). Medusa: the mean over heads of
    w * T^2 * KL(target_T at t+m || head m at t) + (1 - w) * CE on token t+1+m. EAGLE: the
    same mix for the token its predicted feature gives, plus, where it reads the final
    hidden state, the smooth-L1 error of that feature against the target's (EAGLE's
    regression term; EAGLE-3's fused features have no target to regress to, and it drops
    the term). With a training-time test of n steps (`HeadsConfig.test_steps`), step j's
    terms, for the token j places further on from the layer's own fed-back feature
    (`training_time_test`), weigh 0.8^j (EAGLE-3's weights), summed; the logged 'ce' and
    'kl' are step 0's (teacher-forced, as an n = 1 layer's), 'kl_last' the last step's. A
    layer with a draft vocabulary is scored on it (`scored_vocabulary`): the KL to the
    target conditioned on its N tokens, the cross-entropy on the rows whose token is one."""
    from specjax.training.losses import cross_entropy, distill_kl, mean_over
    temp = tc.distill_temperature

    def eagle_loss(heads: Heads, target: LM, batch: jax.Array, w, counted=None, seen=None):
        inputs = batch[:, :-1]
        T = inputs.shape[1]
        reads = heads.features
        hidden, final = jax.lax.stop_gradient(seen if seen is not None else target_reads(reads, target, inputs))
        unembed, labels = scored_vocabulary(heads, target)
        target_logits = unembed.logits(final)
        loss, metrics = 0.0, {}
        predictions = training_time_test(heads, target, inputs, hidden, min(heads.cfg.test_steps, T - 1))
        for j, mine in enumerate(predictions):  # features at t+1+j
            logits = unembed.logits(mine)  # token t+2+j
            mine_counted = None if counted is None else counted[:, 2 + j:]  # the token each row predicts
            tokens, in_vocab = labels(batch[:, 2 + j:], mine_counted)
            ce = cross_entropy(logits, tokens, in_vocab)
            kl = distill_kl(target_logits[:, 1 + j:], logits, temp, mine_counted)
            term = w * temp ** 2 * kl + (1 - w) * ce
            if reads is True:
                error = jnp.abs(mine.astype(jnp.float32) - hidden[:, 1 + j:].astype(jnp.float32))
                regression = mean_over(jnp.mean(jnp.where(error < 1.0, 0.5 * error ** 2, error - 0.5), axis=-1),
                                       mine_counted)  # smooth L1, as EAGLE's
                term = term + regression
                metrics.setdefault("regression", regression)
            loss = loss + 0.8 ** j * term
            plain_kl = kl if temp == 1.0 else distill_kl(target_logits[:, 1 + j:], logits, 1.0, mine_counted)
            if j == 0:
                metrics.update(ce=ce, kl=plain_kl)
            elif j == len(predictions) - 1:
                metrics["kl_last"] = plain_kl
        return loss, {**metrics, "loss": loss}

    def loss_fn(heads: Heads, target: LM, batch: jax.Array, w, counted=None, seen=None):
        if heads.cfg.kind in EAGLE_KINDS:
            return eagle_loss(heads, target, batch, w, counted, seen)
        inputs = batch[:, :-1]
        hidden, _ = jax.lax.stop_gradient(seen if seen is not None else target_reads(True, target, inputs))
        target_logits = target.logits(hidden)
        logits = heads.logits(target, hidden)  # [B, T, H, V]
        T = inputs.shape[1]
        ce, kl, kl1 = [], [], []
        for m in range(min(heads.cfg.num_heads, T - 1)):  # head m+1 at t: token t+2+m, target's q at t+1+m
            mine = logits[:, :T - 1 - m, m]
            mine_counted = None if counted is None else counted[:, 2 + m:]
            ce.append(cross_entropy(mine, batch[:, 2 + m:], mine_counted))
            kl.append(distill_kl(target_logits[:, 1 + m:], mine, temp, mine_counted))
            kl1.append(kl[-1] if temp == 1.0 else distill_kl(target_logits[:, 1 + m:], mine, 1.0, mine_counted))
        ce, kl = jnp.mean(jnp.stack(ce)), jnp.mean(jnp.stack(kl))
        loss = w * temp ** 2 * kl + (1 - w) * ce
        return loss, {"ce": ce, "kl": jnp.mean(jnp.stack(kl1)), "loss": loss}

    return loss_fn
