"""Training losses: next-token cross-entropy and distillation of a draft from a target
(Chen et al.'s draft is trained on the target's data; distilling it raises acceptance).

    loss = w * T^2 * KL(teacher_T || student_T) + (1 - w) * cross-entropy

with T = `distill_temperature` (Hinton et al.'s T^2 keeps gradient scales comparable)
and w = `distill_weight`; logits come from `model.full_forward`, the forward sampling uses.
"""
from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

from specjax.config import TrainConfig
from specjax.model import LM, full_forward


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token negative log-likelihood (nats), float32."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def distill_kl(teacher_logits: jax.Array, student_logits: jax.Array, temperature: float = 1.0) -> jax.Array:
    """Mean over positions of KL(teacher_T || student_T), softmax(logits / T), float32."""
    t = jax.nn.log_softmax(teacher_logits.astype(jnp.float32) / temperature, axis=-1)
    s = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, axis=-1)
    return jnp.mean(jnp.sum(jnp.exp(t) * (t - s), axis=-1))


def make_loss(tc: TrainConfig, distill: bool) -> Callable:
    """loss(student LM, teacher LM or None, batch [B, T+1], distill weight) -> (loss,
    metrics). The weight is a traced scalar: one compiled step serves every mix."""
    temp = tc.distill_temperature

    def loss_fn(student: LM, teacher: Optional[LM], batch: jax.Array, w):
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = full_forward(student, inputs)
        ce = cross_entropy(logits, targets)
        metrics = {"ce": ce}
        loss = ce
        if distill:
            teacher_logits = jax.lax.stop_gradient(full_forward(teacher, inputs))
            kl = distill_kl(teacher_logits, logits, temp)
            metrics["kl"] = kl if temp == 1.0 else distill_kl(teacher_logits, logits)
            loss = w * temp ** 2 * kl + (1 - w) * ce
        metrics["loss"] = loss
        return loss, metrics

    return loss_fn
