"""Autoregressive sampling (ArS, Algorithm 1 of Chen et al. 2023): the baseline that
speculative sampling must match in distribution and beat in time."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.decode.warping import Warp, sample, warp
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


def autoregressive_generate(target: LM, prompts: jax.Array, prompt_lens: jax.Array, key: jax.Array,
                            *, warping: Warp, max_new: jax.Array, eos_id: int, size: int):
    """Algorithm 1 as one `lax.while_loop` of single decode steps (the speed and
    distribution reference). Returns (tokens [B, size], length [B], Stats)."""
    batch = prompts.shape[0]
    rows_done = jnp.zeros((batch,), bool)
    state = ArsState(token_buffer(prompts, size), prompt_lens, rows_done,
                     prefill(target, prompts, prompt_lens, size), key, Stats.zeros(batch, 1))

    def step(s: ArsState) -> ArsState:
        pending = s.length - 1
        logits, cache = target.extend(gather_rows(s.tokens, pending)[:, None], pending[:, None], s.cache)
        key, sub = jax.random.split(s.key)
        probs, bad_probs = warp(logits[:, 0], warping)
        token, empty = sample(sub, probs)
        bad = (bad_probs | empty) & ~s.done
        active = ~s.done & ~bad
        count, finished = stop_after(token[:, None], active.astype(jnp.int32), s.stats.num_new,
                                     max_new, eos_id)
        stats = dataclasses.replace(s.stats, loops=s.stats.loops + active, num_new=s.stats.num_new + count,
                                    nonfinite=s.stats.nonfinite | bad)
        return ArsState(write_rows(s.tokens, s.length, token[:, None], count), s.length + count,
                        s.done | finished | bad, cache, key, stats)

    state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), step, state)
    return state.tokens, state.length, state.stats
