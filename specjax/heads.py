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

from specjax import sharding
from specjax.config import HeadsConfig, ModelConfig, TrainConfig
from specjax.model import LM, Keys, full_forward


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


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Heads:
    """Draft heads as the loops see them: static configs and graph, the params as leaves."""

    cfg: HeadsConfig
    model: ModelConfig  # the target they were made for (its d_model; a checkpoint records it)
    graphdef: Any
    params: Any

    def __call__(self, hidden: jax.Array, count: int | None = None) -> jax.Array:
        return nnx.merge(self.graphdef, self.params)(hidden, count)

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


def abstract_heads(hcfg: HeadsConfig, cfg: ModelConfig, mesh: jax.sharding.Mesh | None = None) -> Heads:
    """Shapes (and shardings, given a mesh) of the heads' params, nothing allocated."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: MedusaHeads(hcfg, cfg, Keys(hcfg.init_seed), False)))
    if mesh is not None:
        state = sharding.with_shardings(state, sharding.param_shardings(state, mesh))
    return Heads(hcfg, cfg, graphdef, state)


def init_heads(hcfg: HeadsConfig, cfg: ModelConfig, mesh: jax.sharding.Mesh, *, random: bool = False) -> Heads:
    """New heads, created sharded: zero blocks (training's start), or random (`random`)."""
    abstract = abstract_heads(hcfg, cfg, mesh)
    shardings = sharding.param_shardings(abstract.params, mesh)
    init = jax.jit(lambda: nnx.split(MedusaHeads(hcfg, cfg, Keys(hcfg.init_seed), random))[1],
                   out_shardings=shardings)
    return dataclasses.replace(abstract, params=init())


def heads_loss(tc: TrainConfig):
    """loss(heads, target LM, batch [B, T+1], distill weight w) -> (loss, metrics): the
    mean over heads of w * T^2 * KL(target_T at t+m || head m at t) + (1 - w) * CE on
    token t+1+m, the target frozen (no gradient reaches it)."""
    from specjax.training.losses import cross_entropy, distill_kl
    temp = tc.distill_temperature

    def loss_fn(heads: Heads, target: LM, batch: jax.Array, w):
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
