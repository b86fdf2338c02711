"""Training losses: next-token cross-entropy and distillation of a draft from a target
(Chen et al.'s draft is trained on the target's data; distilling it raises acceptance).

    loss = w * T^2 * KL(teacher_T || student_T) + (1 - w) * cross-entropy

with T = `distill_temperature` (Hinton et al.'s T^2 keeps gradient scales comparable)
and w = `distill_weight`; logits come from `model.full_forward`, the forward sampling uses.

A parallel draft model (`ModelConfig.parallel_draft` = K > 1; PARD, An et al. 2025, arXiv
2504.18583) learns the positions after masks too, in the same pass (`parallel_layout`):
after the window's tokens come, for some anchor positions a, K-1 mask tokens at positions
a+1..a+K-1 that see the tokens up to a and the masks of their own anchor before them, as
the drafter's pass sees them; the mask at a+j learns token a+j+1 (the teacher's q at a+j).
Every position counts once in the mean, tokens and masks alike.
"""
from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from specjax import kv_cache
from specjax.config import TrainConfig
from specjax.model import LM, full_forward, mask_id


def mean_over(values: jax.Array, counted: jax.Array | None) -> jax.Array:
    """The mean of `values` over the positions `counted` marks (all where None; 0 where
    none is marked)."""
    if counted is None:
        return jnp.mean(values)
    counted = counted.astype(jnp.float32)
    return jnp.sum(values * counted) / jnp.maximum(jnp.sum(counted), 1.0)


def cross_entropy(logits: jax.Array, targets: jax.Array, counted: jax.Array | None = None) -> jax.Array:
    """Mean next-token negative log-likelihood (nats), float32, over the positions
    `counted` marks (all where None)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -mean_over(jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0], counted)


def distill_kl(teacher_logits: jax.Array, student_logits: jax.Array, temperature: float = 1.0,
               counted: jax.Array | None = None) -> jax.Array:
    """Mean over positions (those `counted` marks; all where None) of KL(teacher_T ||
    student_T), softmax(logits / T), float32."""
    t = jax.nn.log_softmax(teacher_logits.astype(jnp.float32) / temperature, axis=-1)
    s = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, axis=-1)
    return mean_over(jnp.sum(jnp.exp(t) * (t - s), axis=-1), counted)


def parallel_layout(length: int, lookahead: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The pass a parallel draft model trains on, for windows of `length` tokens and K =
    `lookahead`: (positions [P], masked [P], visible [P, P]). The first `length` rows are
    the window's tokens (causal); then K-1 masks for each anchor a (a + K <= length),
    at positions a+1..a+K-1, seeing the tokens up to a and their anchor's masks up to
    themselves. Row r predicts the token at positions[r] + 1. The anchors are evenly
    spaced, about length / (K-1) of them, so that the masks are about as many as the
    tokens (PARD's conditional drop-token training keeps a fraction of its mask copies
    for the same reason: a mask per token and offset would make the pass K times longer)."""
    T, K = length, lookahead
    count = min(max(1, T // (K - 1)), T - K + 1) if K > 1 else 0
    anchors = np.unique(np.linspace(0, T - K, count).round().astype(np.int64)) if count else np.zeros(0, np.int64)
    offsets = np.arange(1, K)
    positions = np.concatenate([np.arange(T), (anchors[:, None] + offsets[None, :]).ravel()])
    masked = np.arange(len(positions)) >= T
    group = np.concatenate([np.full(T, -1), np.repeat(np.arange(len(anchors)), K - 1)])  # a mask's anchor
    anchor_of = np.concatenate([np.arange(T), np.repeat(anchors, K - 1)])  # the last token each row sees
    sees_token = ~masked[None, :] & (positions[None, :] <= anchor_of[:, None])
    sees_mask = masked[None, :] & (group[None, :] == group[:, None]) & (positions[None, :] <= positions[:, None])
    return positions.astype(np.int32), masked, sees_token | sees_mask


def parallel_forward(student: LM, inputs: jax.Array) -> tuple[jax.Array, np.ndarray]:
    """(logits [B, P, V] of `parallel_layout`'s pass over `inputs` [B, T], its positions [P])."""
    batch, length = inputs.shape
    positions, masked, visible = parallel_layout(length, student.cfg.parallel_draft)
    tokens = jnp.where(masked[None, :], mask_id(student.cfg), inputs[:, np.minimum(positions, length - 1)])
    logits, _ = student(tokens, jnp.broadcast_to(jnp.asarray(positions), (batch, len(positions))),
                        kv_cache.empty(student.cfg, batch, 0), visible)
    return logits, positions


def make_loss(tc: TrainConfig, distill: bool) -> Callable:
    """loss(student LM, teacher LM or None, batch [B, T+1], distill weight, counted [B,
    T+1] or None) -> (loss, metrics): means over the positions whose target token
    `counted` marks (every position where None). The weight is a traced scalar: one
    compiled step serves every mix."""
    temp = tc.distill_temperature

    def loss_fn(student: LM, teacher: Optional[LM], batch: jax.Array, w, counted: jax.Array | None = None,
                seen=None):  # `seen`: draft heads' cached target reads; a model student has none
        inputs, targets = batch[:, :-1], batch[:, 1:]
        counted = None if counted is None else counted[:, 1:]
        if student.cfg.parallel_draft > 1:
            logits, positions = parallel_forward(student, inputs)
            targets = targets[:, positions]
            counted = None if counted is None else counted[:, positions]
        else:
            logits, positions = full_forward(student, inputs), None
        ce = cross_entropy(logits, targets, counted)
        metrics = {"ce": ce}
        loss = ce
        if distill:
            teacher_logits = jax.lax.stop_gradient(full_forward(teacher, inputs))
            if positions is not None:
                teacher_logits = teacher_logits[:, positions]
            kl = distill_kl(teacher_logits, logits, temp, counted)
            metrics["kl"] = kl if temp == 1.0 else distill_kl(teacher_logits, logits, 1.0, counted)
            loss = w * temp ** 2 * kl + (1 - w) * ce
        metrics["loss"] = loss
        return loss, metrics

    return loss_fn
