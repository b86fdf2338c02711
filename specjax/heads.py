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
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from specjax import kv_cache, sharding
from specjax.config import HeadsConfig, ModelConfig, TrainConfig, UsageError
from specjax.kernels import DEFAULT as DEFAULT_KERNELS, Kernels
from specjax.kv_cache import Fresh, KVCache
from specjax.model import LM, Block, Keys, cache_limit, causal, full_forward, ordered_after


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


def eagle_block_config(cfg: ModelConfig) -> ModelConfig:
    """The EAGLE layer's block: one layer of the target's block type (its widths, heads,
    ffw and norm), with rotary positions whatever the target uses."""
    return dataclasses.replace(cfg, num_layers=1, pos_encoding="rope", scan_layers=False)


class EagleHead(nnx.Module):
    """EAGLE (Li et al. 2024, arXiv 2401.15077): one decoder layer over the target's
    feature at position j and the embedding of token j+1 (concatenated, projected to D),
    predicting the target's feature at j+1, whose unembedding (the target's) gives token
    j+2. Autoregressive in feature space, with its own one-layer KV cache."""

    def __init__(self, hcfg: HeadsConfig, cfg: ModelConfig, keys: Keys, random: bool):
        D, dt = cfg.d_model, cfg.param_dtype
        self.w_feature = nnx.Param(((D ** -0.5) * jax.random.normal(keys(), (D, D))).astype(dt), logical=("embed", None))
        self.w_token = nnx.Param(((D ** -0.5) * jax.random.normal(keys(), (D, D))).astype(dt), logical=("embed", None))
        self.block = Block(eagle_block_config(cfg), keys)
        self.compute_dtype = cfg.compute_dtype

    def __call__(self, features, embedded, positions, cache: KVCache, visible=None,
                 kernels: Kernels = DEFAULT_KERNELS) -> tuple[jax.Array, Fresh]:
        """features, embedded [B, T, D] (the target's feature at positions[t] and the
        embedding of the token after it) -> (predicted features [B, T, D] of the next
        positions, Fresh: this pass's keys and values for the layer's cache, read only)."""
        ct = jnp.dtype(self.compute_dtype)
        x = features.astype(ct) @ self.w_feature.value.astype(ct) + embedded.astype(ct) @ self.w_token.value.astype(ct)
        T = x.shape[1]
        visible = causal(T) if visible is None else visible
        x, k, v = self.block(x, positions, cache.k, cache.v, None, 0, cache_limit(cache, positions), visible, kernels)
        return x, Fresh(*ordered_after(k[None], v[None], x))


MODULES = {"medusa": MedusaHeads, "eagle": EagleHead}


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Heads:
    """Draft heads as the loops see them: static configs and graph, the params as leaves."""

    cfg: HeadsConfig
    model: ModelConfig  # the target they were made for (its d_model; a checkpoint records it)
    graphdef: Any
    params: Any

    def __call__(self, *args, **kwargs):
        """The module's forward: Medusa's (hidden, count), EAGLE's (features, embedded,
        positions, cache, visible, kernels)."""
        return nnx.merge(self.graphdef, self.params)(*args, **kwargs)

    def eagle_step(self, target: LM, features, tokens, positions, cache: KVCache,
                   table=None) -> tuple[jax.Array, KVCache]:
        """EAGLE's pass over T (feature, next token) pairs at `positions`, written into its
        cache at positions[:, 0]: -> (predicted features [B, T, D], cache). The tokens are
        embedded from `table` (`model.whole_table(target)`) where given."""
        predicted, fresh = self(features, target.embed(tokens, table), positions, cache, None, target.kernels)
        return predicted, kv_cache.commit(cache, fresh, positions[:, 0])

    def empty_cache(self, batch: int, size: int) -> KVCache:
        """EAGLE's own one-layer cache (its rows sharded as the target's)."""
        return kv_cache.empty(eagle_block_config(self.model), batch, size)

    def logits(self, target: LM, hidden: jax.Array, count: int | None = None) -> jax.Array:
        """The target's final hidden states [B, ..., D] -> the first `count` heads' logits
        [B, ..., count, V] through the target's own unembedding."""
        states = self(hidden, count)
        flat = states.reshape(states.shape[0], -1, states.shape[-1])
        return target.logits(flat).reshape(states.shape[:-1] + (-1,))

    @property
    def num_params(self) -> int:
        return sum(math.prod(x.shape) for x in jax.tree.leaves(self.params))

    def tree_flatten(self):
        return (self.params,), (self.cfg, self.model, self.graphdef)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(aux[0], aux[1], aux[2], children[0])


def checked(draft, target_cfg: ModelConfig, kind: str, drafter: str) -> Heads:
    """`draft` if it is heads of `kind` made for a target as wide as `target_cfg`, else a
    UsageError naming what was given (a drafter's `make`)."""
    what = {"medusa": "Medusa heads (heads of kind 'medusa'", "eagle": "an EAGLE layer (heads of kind 'eagle'"}[kind]
    if not isinstance(draft, Heads) or draft.cfg.kind != kind:
        got = f"{draft.cfg.kind} heads" if isinstance(draft, Heads) else type(draft).__name__
        raise UsageError(f"drafter={drafter!r} needs {what}: a config with `heads`, trained by `python -m "
                         f"specjax.train`, or specjax.heads.init_heads), got {got}")
    if draft.model.d_model != target_cfg.d_model:
        raise UsageError(f"the {kind} heads were made for d_model={draft.model.d_model}, the target has "
                         f"d_model={target_cfg.d_model}")
    return draft


def abstract_heads(hcfg: HeadsConfig, cfg: ModelConfig, mesh: jax.sharding.Mesh | None = None) -> Heads:
    """Shapes (and shardings, given a mesh) of the heads' params, nothing allocated."""
    module = MODULES[hcfg.kind]
    graphdef, state = nnx.split(nnx.eval_shape(lambda: module(hcfg, cfg, Keys(hcfg.init_seed), False)))
    if mesh is not None:
        state = sharding.with_shardings(state, sharding.param_shardings(state, mesh))
    return Heads(hcfg, cfg, graphdef, state)


def init_heads(hcfg: HeadsConfig, cfg: ModelConfig, mesh: jax.sharding.Mesh, *, random: bool = False) -> Heads:
    """New heads, created sharded: Medusa's zero blocks (training's start) or random ones
    (`random`); an EAGLE layer is random either way (a zero layer would pass no feature on)."""
    abstract = abstract_heads(hcfg, cfg, mesh)
    shardings = sharding.param_shardings(abstract.params, mesh)
    module = MODULES[hcfg.kind]
    init = jax.jit(lambda: nnx.split(module(hcfg, cfg, Keys(hcfg.init_seed), random))[1],
                   out_shardings=shardings)
    return dataclasses.replace(abstract, params=init())


def heads_loss(tc: TrainConfig):
    """loss(heads, target LM, batch [B, T+1], distill weight w) -> (loss, metrics), the
    target frozen (no gradient reaches it). Medusa: the mean over heads of
    w * T^2 * KL(target_T at t+m || head m at t) + (1 - w) * CE on token t+1+m. EAGLE: the
    same mix for the token its predicted feature gives, plus the smooth-L1 error of that
    feature against the target's (EAGLE's regression term)."""
    from specjax.training.losses import cross_entropy, distill_kl
    temp = tc.distill_temperature

    def eagle_loss(heads: Heads, target: LM, batch: jax.Array, w):
        # Teacher forcing: the target's true feature at j and token j+1 in, its feature at j+1 out.
        inputs = batch[:, :-1]
        B, T = inputs.shape
        target_logits, hidden = jax.lax.stop_gradient(full_forward(target, inputs, features=True))
        positions = jnp.broadcast_to(jnp.arange(T - 1, dtype=jnp.int32), (B, T - 1))
        predicted, _ = heads(hidden[:, :-1], target.embed(inputs[:, 1:]), positions, heads.empty_cache(B, 0))
        logits = target.logits(predicted)  # token j+2
        ce = cross_entropy(logits, batch[:, 2:])
        kl = distill_kl(target_logits[:, 1:], logits, temp)
        error = jnp.abs(predicted.astype(jnp.float32) - hidden[:, 1:].astype(jnp.float32))
        regression = jnp.mean(jnp.where(error < 1.0, 0.5 * error ** 2, error - 0.5))  # smooth L1, as EAGLE's
        loss = w * temp ** 2 * kl + (1 - w) * ce + regression
        return loss, {"ce": ce, "kl": kl if temp == 1.0 else distill_kl(target_logits[:, 1:], logits),
                      "regression": regression, "loss": loss}

    def loss_fn(heads: Heads, target: LM, batch: jax.Array, w):
        if heads.cfg.kind == "eagle":
            return eagle_loss(heads, target, batch, w)
        inputs = batch[:, :-1]
        target_logits, hidden = jax.lax.stop_gradient(full_forward(target, inputs, features=True))
        logits = heads.logits(target, hidden)  # [B, T, H, V]
        T = inputs.shape[1]
        ce, kl, kl1 = [], [], []
        for m in range(min(heads.cfg.num_heads, T - 1)):  # head m+1 at t: token t+2+m, target's q at t+1+m
            mine = logits[:, :T - 1 - m, m]
            ce.append(cross_entropy(mine, batch[:, 2 + m:]))
            kl.append(distill_kl(target_logits[:, 1 + m:], mine, temp))
            kl1.append(kl[-1] if temp == 1.0 else distill_kl(target_logits[:, 1 + m:], mine))
        ce, kl = jnp.mean(jnp.stack(ce)), jnp.mean(jnp.stack(kl))
        loss = w * temp ** 2 * kl + (1 - w) * ce
        return loss, {"ce": ce, "kl": jnp.mean(jnp.stack(kl1)), "loss": loss}

    return loss_fn
