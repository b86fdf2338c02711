"""Speculative sampling (Chen et al. 2023, Algorithm 2), fused into one `lax.while_loop`.

Each loop, for every row at once:
  1. `draft_tokens`: the draft samples K tokens autoregressively (x_1..x_K, with p_j).
  2. the target scores [pending, x_1..x_K] in ONE pass -> q_1..q_{K+1}.
  3. `accept`: x_j is kept with probability min(1, q_j(x_j) / p_j(x_j)), left to right;
     the first rejected one is replaced by a `residual` sample from norm(max(0, q - p)),
     and if all K are kept a `bonus` token comes from q_{K+1}.
So each loop emits 1..K+1 tokens and (Theorem 1) the output is distributed exactly as q.
`speculate` is steps 1-3 for one loop (`api.explain_loop` shows them for the first loop);
`speculative_generate` wraps it with the stopping rules, rollback and statistics.
Rows are ragged: each has its own length, accepted count and stopping state.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from specjax.decode.sampling import Warp, sample, warp
from specjax.decode.state import Stats, gather_rows, prefill, stop_after, token_buffer, write_rows
from specjax.kv_cache import KVCache
from specjax.model import LM


def draft_tokens(draft: LM, cache: KVCache, tokens: jax.Array, length: jax.Array, key: jax.Array,
                 lookahead: int, warping: Warp):
    """K autoregressive draft steps. Returns (x [B,K], p [B,K,V], cache, bad [B]): bad
    marks rows where a draft distribution was not one (NaN/inf logits, no mass).

    The first step feeds the last TWO tokens (positions length-2, length-1): when the
    previous loop accepted all K drafts, x_K was never fed to the draft, and this keeps
    its cache complete without a data-dependent shape."""
    before = jnp.maximum(length - 2, 0)
    first = jnp.stack([gather_rows(tokens, before), gather_rows(tokens, length - 1)], axis=1)
    logits, cache = draft(first, jnp.stack([before, length - 1], axis=1), cache)
    keys = jax.random.split(key, lookahead)

    def propose(logits, j):
        probs, bad = warp(logits, warping)
        x, empty = sample(keys[j], probs)
        return x, probs, bad | empty

    def step(carry, j):
        logits, cache, bad = carry
        x, probs, bad_j = propose(logits, j)
        logits, cache = draft(x[:, None], (length + j)[:, None], cache)
        return (logits[:, 0], cache, bad | bad_j), (x, probs)

    (logits, cache, bad), (xs, ps) = jax.lax.scan(step, (logits[:, -1], cache, jnp.zeros(length.shape, bool)),
                                                  jnp.arange(lookahead - 1))
    x_last, probs, bad_last = propose(logits, lookahead - 1)
    xs = jnp.concatenate([xs, x_last[None]], axis=0).T  # [B, K]
    ps = jnp.concatenate([ps, probs[None]], axis=0).transpose(1, 0, 2)  # [B, K, V]
    return xs, ps, cache, bad | bad_last


def accept(key: jax.Array, x: jax.Array, p: jax.Array, q: jax.Array):
    """Modified rejection sampling, vectorised over rows and draft positions.

    x [B,K] draft tokens, p [B,K,V] draft probs, q [B,K+1,V] target probs.
    Returns (num_accepted [B] in 0..K, next_token [B], empty [B]): the residual sample at
    the first rejection, or the bonus sample from q_{K+1} when all K were accepted; empty
    marks a row whose distribution for it had no mass (only when p or q was not one)."""
    batch, lookahead = x.shape
    accept_key, resample_key = jax.random.split(key)
    p_x = jnp.take_along_axis(p, x[..., None], axis=-1)[..., 0]
    q_x = jnp.take_along_axis(q[:, :lookahead], x[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(accept_key, (batch, lookahead))
    accepted = u * p_x < q_x  # u < q/p without dividing; p_x > 0 as x was drawn from p
    num_accepted = jnp.sum(jnp.cumprod(accepted, axis=1), axis=1)
    p_ext = jnp.concatenate([p, jnp.zeros_like(p[:, :1])], axis=1)  # p = 0 at K+1: residual = q (bonus)
    q_n = jnp.take_along_axis(q, num_accepted[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(q_n - jnp.take_along_axis(p_ext, num_accepted[:, None, None], axis=1)[:, 0], 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), q_n)  # q - p <= 0 everywhere: use q
    next_token, empty = sample(resample_key, residual)
    return num_accepted.astype(jnp.int32), next_token, empty


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpsState:
    tokens: jax.Array
    length: jax.Array
    done: jax.Array
    target_cache: KVCache
    draft_cache: KVCache
    key: jax.Array
    stats: Stats


class Speculation(NamedTuple):
    """Steps 1-3 of one loop, for every row: what was drafted, scored and accepted."""

    x: jax.Array  # [B, K] draft tokens
    p: jax.Array  # [B, K, V] draft distributions p_1..p_K
    q: jax.Array  # [B, K+1, V] target distributions q_1..q_{K+1}, from one scoring pass
    num_accepted: jax.Array  # [B] n in 0..K
    next_token: jax.Array  # [B] the residual sample at x_{n+1}, or the bonus token (n == K)
    target_cache: KVCache
    draft_cache: KVCache
    nonfinite: jax.Array  # [B] NaN/inf in either model's logits, or a distribution without mass


def start(target: LM, draft: LM, prompts: jax.Array, prompt_lens: jax.Array, key: jax.Array,
          lookahead: int, size: int) -> SpsState:
    """The loop's state after prefilling both models' caches with the prompts."""
    batch = prompts.shape[0]
    return SpsState(token_buffer(prompts, size), prompt_lens, jnp.zeros((batch,), bool),
                    prefill(target, prompts, prompt_lens, size), prefill(draft, prompts, prompt_lens, size),
                    key, Stats.zeros(batch, lookahead))


def speculate(target: LM, draft: LM, s: SpsState, lookahead: int, warping: Warp):
    """Draft K tokens, score [pending, x_1..x_K] in ONE target pass, accept/reject.
    Returns (the state's next key, Speculation)."""
    key, draft_key, accept_key = jax.random.split(s.key, 3)
    x, p, draft_cache, draft_bad = draft_tokens(draft, s.draft_cache, s.tokens, s.length, draft_key,
                                                lookahead, warping)
    pending = s.length - 1
    scored = jnp.concatenate([gather_rows(s.tokens, pending)[:, None], x], axis=1)
    positions = pending[:, None] + jnp.arange(lookahead + 1)[None, :]
    logits, target_cache = target(scored, positions, s.target_cache)
    q, target_bad = warp(logits, warping)
    num_accepted, next_token, empty = accept(accept_key, x, p, q)
    return key, Speculation(x, p, q, num_accepted, next_token, target_cache, draft_cache,
                            jnp.any(target_bad, axis=1) | draft_bad | empty)


def speculative_generate(target: LM, draft: LM, prompts: jax.Array, prompt_lens: jax.Array,
                         key: jax.Array, *, warping: Warp, lookahead: int, max_new: int, eos_id: int,
                         size: int):
    """Algorithm 2 as one `lax.while_loop`. Returns (tokens [B, size], length [B], Stats)."""
    state = start(target, draft, prompts, prompt_lens, key, lookahead, size)

    def loop(s: SpsState) -> SpsState:
        key, sp = speculate(target, draft, s, lookahead, warping)
        x, num_accepted = sp.x, sp.num_accepted
        # Emitted: x_1..x_n, then the residual/bonus token at index n.
        new = jnp.concatenate([x, jnp.zeros_like(x[:, :1])], axis=1)
        new = jnp.where(jnp.arange(lookahead + 1)[None, :] == num_accepted[:, None], sp.next_token[:, None], new)
        bad = sp.nonfinite & ~s.done
        active = ~s.done & ~bad
        count, finished = stop_after(new, jnp.where(active, num_accepted + 1, 0), s.stats.num_new,
                                     max_new, eos_id)
        length = s.length + count
        # Roll back: the target holds [0, length-1) after this loop; the draft's cache may
        # lack x_K, which its next first step re-feeds at position length-2.
        target_cache = sp.target_cache.with_lengths(length - 1)
        draft_cache = sp.draft_cache.with_lengths(jnp.maximum(length - 2, 0))
        live = active[:, None].astype(jnp.int32)
        st = s.stats
        stats = Stats(
            loops=st.loops + active,
            num_new=st.num_new + count,
            accepted=st.accepted + jnp.where(active, num_accepted, 0),
            accepted_at=st.accepted_at + live * (jnp.arange(lookahead)[None, :] < num_accepted[:, None]),
            histogram=st.histogram + live * (jnp.arange(lookahead + 1)[None, :] == num_accepted[:, None]),
            nonfinite=st.nonfinite | bad)
        return SpsState(write_rows(s.tokens, s.length, new, count), length, s.done | finished | bad,
                        target_cache, draft_cache, key, stats)

    state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), loop, state)
    return state.tokens, state.length, state.stats
