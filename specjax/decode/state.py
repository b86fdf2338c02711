"""Generation state shared by ArS and SpS.

A token buffer [B, S] holds prompt + output; per row, `length` counts the tokens in the
buffer (the last one is "pending": not yet in any KV cache). Rows are ragged: every row has its own length and stops on its own
(end-of-sequence or max_new_tokens), never a min over rows.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax import kv_cache
from specjax.model import LM
from specjax.sharding import constrain


def prefill(lm: LM, prompts: jax.Array, prompt_lens: jax.Array, size: int, features: bool | tuple[int, ...] = False):
    """Write every prompt token into a fresh cache. Each row's last prompt token is left
    'pending' (the next step feeds it again and samples from its logits), so ragged rows
    need no per-row logit gather here; entries past a row's length are masked. With
    `features`: (cache, the hidden states the forward returns for it at every prompt position)."""
    batch, width = prompts.shape
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
    cache = lm.with_position_table(kv_cache.empty(lm.cfg, batch, size))
    # The prompt attends to its own keys only: over the cache's `size` slots, all empty yet,
    # the pass would score (and copy per layer) slots in proportion to max_new_tokens. Its
    # distances are below `width`: the table's last `width` entries (it is in reverse order).
    table = None if cache.position_table is None else cache.position_table[:, :, -width:]
    own_only = dataclasses.replace(kv_cache.empty(lm.cfg, batch, 0), position_table=table)
    _, fresh = lm(prompts, positions, own_only, features=features)
    cache = kv_cache.commit(cache, fresh, 0).with_lengths(prompt_lens - 1)  # every row from slot 0
    return (cache, fresh.hidden) if features else cache


def token_buffer(prompts: jax.Array, size: int) -> jax.Array:
    batch, width = prompts.shape
    buf = jnp.zeros((batch, size), jnp.int32).at[:, :width].set(prompts)
    return constrain(buf, ("batch", None))


def gather_rows(buf: jax.Array, index: jax.Array) -> jax.Array:
    """buf[b, index[b]] for every row b."""
    return jnp.take_along_axis(buf, index[:, None], axis=1)[:, 0]


def write_rows(buf: jax.Array, start: jax.Array, values: jax.Array, count: jax.Array) -> jax.Array:
    """buf[b, start[b] + j] = values[b, j] for j < count[b]; other writes are dropped."""
    batch, width = values.shape
    j = jnp.arange(width)[None, :]
    cols = jnp.where(j < count[:, None], start[:, None] + j, buf.shape[1])  # out of range = dropped
    return buf.at[jnp.arange(batch)[:, None], cols].set(values, mode="drop")


def stop_after(new_tokens: jax.Array, count: jax.Array, num_new: jax.Array, max_new: jax.Array | int,
               eos_id: int | tuple[int, ...]):
    """Clip each row's `count` new tokens at the token budget `max_new` (a traced scalar:
    one compiled program serves every budget) and just after end-of-sequence
    (`eos_id`: one id, -1 for none, or a tuple of ids any of which ends a row).
    Returns (emitted count, row finished)."""
    count = jnp.minimum(count, max_new - num_new)
    finished = num_new + count >= max_new
    stop_ids = [i for i in (eos_id if isinstance(eos_id, tuple) else (eos_id,)) if i >= 0]
    if stop_ids:
        j = jnp.arange(new_tokens.shape[1])[None, :]
        is_eos = jnp.isin(new_tokens, jnp.asarray(stop_ids, new_tokens.dtype)) & (j < count[:, None])
        first = jnp.argmax(is_eos, axis=1)
        hit = jnp.any(is_eos, axis=1)
        count = jnp.where(hit, first + 1, count)
        finished = finished | hit
    return count, finished
