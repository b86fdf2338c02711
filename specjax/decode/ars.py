"""Autoregressive sampling (ArS, Algorithm 1 of Chen et al. 2023): the baseline that
speculative sampling must match in distribution and beat in time."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.decode.warping import Warp, draw, warp
from specjax.decode.metrics import Stats
from specjax.decode.state import gather_rows, prefill, stop_after, token_buffer, write_rows
from specjax.kv_cache import KVCache
from specjax.model import LM


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ArsState:
    tokens: jax.Array
    length: jax.Array
    done: jax.Array
    cache: KVCache
    key: jax.Array
    stats: Stats


def step(target: LM, s: ArsState, warping: Warp, max_new: jax.Array, eos_id: int) -> ArsState:
    """One step of Algorithm 1 for every row: the loop's body (`plan` also compiles it
    alone, to cost one step)."""
    pending = s.length - 1
    logits, cache = target.extend(gather_rows(s.tokens, pending)[:, None], pending[:, None], s.cache)
    key, sub = jax.random.split(s.key)
    probs, bad_probs = warp(logits[:, 0], warping)
    token, empty = draw(sub, probs, warping)
    bad = (bad_probs | empty) & ~s.done
    active = ~s.done & ~bad
    count, finished = stop_after(token[:, None], active.astype(jnp.int32), s.stats.num_new, max_new, eos_id)
    stats = dataclasses.replace(s.stats, loops=s.stats.loops + active, num_new=s.stats.num_new + count,
                                nonfinite=s.stats.nonfinite | bad)
    return ArsState(write_rows(s.tokens, s.length, token[:, None], count), s.length + count,
                    s.done | finished | bad, cache, key, stats)


def start(target: LM, prompts: jax.Array, prompt_lens: jax.Array, key: jax.Array, size: int) -> ArsState:
    """The loop's state after prefilling the target's cache with the prompts."""
    batch = prompts.shape[0]
    return ArsState(token_buffer(prompts, size), prompt_lens, jnp.zeros((batch,), bool),
                    prefill(target, prompts, prompt_lens, size), key, Stats.zeros(batch, 1))


def autoregressive_generate(target: LM, prompts: jax.Array, prompt_lens: jax.Array, key: jax.Array,
                            *, warping: Warp, max_new: jax.Array, eos_id: int, size: int):
    """Algorithm 1 as one `lax.while_loop` of single decode steps (the speed and
    distribution reference). Returns (tokens [B, size], length [B], Stats)."""
    state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), lambda s: step(target, s, warping, max_new, eos_id),
                               start(target, prompts, prompt_lens, key, size))
    return state.tokens, state.length, state.stats
