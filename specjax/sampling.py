"""Logits -> probabilities (temperature, top-k, top-p) and the ArS baseline (Algorithm 1).

`warp` is the ONE place logits become a distribution; draft and target go through it
identically, so the speculative ratio q(x)/p(x) compares like with like. The order is
temperature, then top-k, then top-p; temperature 0 is greedy (a one-hot argmax).

Generation state shared by ArS and SpS: a token buffer [B, S] holding prompt + output,
and per row `length` (tokens in the buffer; the last one is "pending": not yet in any
KV cache), `num_new`, `done`. Rows are ragged: every row has its own length and stops
on its own (end-of-sequence or max_new_tokens), never a min over rows.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from specjax.sharding import constrain
from specjax.kv_cache import KVCache, cache_shapes, CACHE_AXES
from specjax.model import LM


class Warp(NamedTuple):
    """Static (hashable) sampling settings: each distinct value compiles its own loop."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0


def warp(logits: jax.Array, w: Warp) -> jax.Array:
    """float32 probabilities over the last axis."""
    # Gather vocab-parallel logits once (one small all-gather) so every reduction below is
    # local: on a pod, a dozen latency-bound all-reduces per distribution would cost more.
    logits = constrain(logits.astype(jnp.float32), ("batch",) + (None,) * (logits.ndim - 1))
    vocab = logits.shape[-1]
    if w.temperature == 0:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), vocab, dtype=jnp.float32)
    logits = logits / w.temperature
    if 0 < w.top_k < vocab:
        kth = jax.lax.top_k(logits, w.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    probs = jax.nn.softmax(logits, axis=-1)
    if w.top_p < 1.0:
        probs = nucleus(probs, w.top_p)
    return probs


def nucleus(probs: jax.Array, top_p: float) -> jax.Array:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (ties at the
    boundary kept together), renormalised. Equivalently: keep p >= t*, the largest
    threshold whose kept mass is still >= top_p. t* is found by bisection over the bit
    patterns of the float32 probabilities (ordered like the values, as p >= 0), so it is
    one of the probabilities exactly, without sorting the vocabulary: 32 masked sums cost
    ~0.3 ms where a sort of 4096 entries cost ~4.6 ms per 5 distributions on CPU."""
    bits = jax.lax.bitcast_convert_type(probs, jnp.int32)
    lo = jnp.zeros(probs.shape[:-1] + (1,), jnp.int32)  # keeps everything: mass 1 >= top_p
    hi = jnp.max(bits, axis=-1, keepdims=True) + 1  # keeps nothing

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        enough = jnp.sum(jnp.where(bits >= mid, probs, 0.0), axis=-1, keepdims=True) >= top_p
        return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid)

    threshold, _ = jax.lax.fori_loop(0, 32, halve, (lo, hi))
    kept = jnp.where(bits >= threshold, probs, 0.0)
    return kept / jnp.sum(kept, axis=-1, keepdims=True)


def cumulative(probs: jax.Array, block: int = 64) -> jax.Array:
    """cumsum over the last axis as two small triangular matmuls (within blocks of 64,
    then the block offsets): 14 us for 4096 entries on CPU where `jnp.cumsum` took 47 us;
    same float32 error (~1e-7). `highest` keeps TPUs from rounding the operands to bf16."""
    V = probs.shape[-1]
    n = -(-V // block)
    blocks = jnp.pad(probs, [(0, 0)] * (probs.ndim - 1) + [(0, n * block - V)]).reshape(probs.shape[:-1] + (n, block))
    upper = lambda m, k: jnp.triu(jnp.ones((m, m), probs.dtype), k)
    within = jnp.einsum("...nb,bc->...nc", blocks, upper(block, 0), precision="highest")
    offsets = jnp.einsum("...n,nm->...m", within[..., -1], upper(n, 1), precision="highest")
    return (within + offsets[..., None]).reshape(probs.shape[:-1] + (n * block,))[..., :V]


def sample(key: jax.Array, probs: jax.Array) -> jax.Array:
    """One token per distribution over the last axis (zero-probability tokens never drawn).

    Inverse CDF: the first token whose cumulative mass exceeds u * total, u ~ U[0, 1).
    One uniform per distribution; `jax.random.categorical` draws a Gumbel per vocabulary
    entry, and generating 4096 of them cost ~0.38 ms per call on CPU (5 calls per K=4
    loop) against ~0.02 ms here. A zero-probability token repeats its predecessor's cumulative
    mass, so it is never the first to exceed u * total; the clamp to the last token with
    mass covers u * total rounding up to the total itself."""
    cdf = cumulative(probs)
    u = jax.random.uniform(key, probs.shape[:-1] + (1,), jnp.float32) * cdf[..., -1:]
    first_above = jnp.sum(cdf <= u, axis=-1)
    last_with_mass = probs.shape[-1] - 1 - jnp.argmax(jnp.flip(probs, axis=-1) > 0, axis=-1)
    return jnp.minimum(first_above, last_with_mass).astype(jnp.int32)


def nonfinite_rows(logits: jax.Array) -> jax.Array:
    """[B] True where a row's logits hold NaN or inf (reported at the host boundary)."""
    return ~jnp.all(jnp.isfinite(logits), axis=tuple(range(1, logits.ndim)))


# --------------------------------------------------------------------------- shared state


def empty_cache(lm: LM, batch: int, size: int) -> KVCache:
    shapes = cache_shapes(lm.cfg, batch, size)
    k = constrain(jnp.zeros(shapes.k.shape, shapes.k.dtype), CACHE_AXES)
    v = constrain(jnp.zeros(shapes.v.shape, shapes.v.dtype), CACHE_AXES)
    return KVCache(k, v, jnp.zeros((batch,), jnp.int32))


def prefill(lm: LM, prompts: jax.Array, prompt_lens: jax.Array, size: int) -> KVCache:
    """Write every prompt token into a fresh cache. Each row's last prompt token is left
    'pending' (the next step feeds it again and samples from its logits), so ragged rows
    need no per-row logit gather here; entries past a row's length are masked."""
    batch, width = prompts.shape
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
    _, cache = lm(prompts, positions, empty_cache(lm, batch, size))
    return cache.with_lengths(prompt_lens - 1)


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


def stop_after(new_tokens: jax.Array, count: jax.Array, num_new: jax.Array, max_new: int,
               eos_id: int):
    """Clip each row's `count` new tokens at the token budget and just after end-of-sequence.
    Returns (emitted count, row finished)."""
    count = jnp.minimum(count, max_new - num_new)
    finished = num_new + count >= max_new
    if eos_id >= 0:
        j = jnp.arange(new_tokens.shape[1])[None, :]
        is_eos = (new_tokens == eos_id) & (j < count[:, None])
        first = jnp.argmax(is_eos, axis=1)
        hit = jnp.any(is_eos, axis=1)
        count = jnp.where(hit, first + 1, count)
        finished = finished | hit
    return count, finished


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Stats:
    """Per-row counters, returned with the tokens."""

    loops: jax.Array  # [B] loops (ArS: steps) while the row was active
    num_new: jax.Array  # [B] tokens generated
    accepted: jax.Array  # [B] draft tokens accepted (SpS)
    accepted_at: jax.Array  # [B, K] loops in which draft position j was accepted
    histogram: jax.Array  # [B, K+1] loops that accepted exactly n draft tokens
    nonfinite: jax.Array  # [B] a NaN/inf logit was seen

    @classmethod
    def zeros(cls, batch: int, lookahead: int) -> "Stats":
        z = jnp.zeros((batch,), jnp.int32)
        return cls(z, z, z, jnp.zeros((batch, lookahead), jnp.int32),
                   jnp.zeros((batch, lookahead + 1), jnp.int32), jnp.zeros((batch,), bool))


# --------------------------------------------------------------------------- ArS (Algorithm 1)


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
                            *, warping: Warp, max_new: int, eos_id: int, size: int):
    """Algorithm 1 as one `lax.while_loop` of single decode steps (the speed and
    distribution reference). Returns (tokens [B, size], length [B], Stats)."""
    batch = prompts.shape[0]
    rows_done = jnp.zeros((batch,), bool)
    state = ArsState(token_buffer(prompts, size), prompt_lens, rows_done,
                     prefill(target, prompts, prompt_lens, size), key, Stats.zeros(batch, 1))

    def step(s: ArsState) -> ArsState:
        pending = s.length - 1
        logits, cache = target(gather_rows(s.tokens, pending)[:, None], pending[:, None], s.cache)
        key, sub = jax.random.split(s.key)
        token = sample(sub, warp(logits[:, 0], warping))
        active = ~s.done
        count, finished = stop_after(token[:, None], active.astype(jnp.int32), s.stats.num_new,
                                     max_new, eos_id)
        bad = nonfinite_rows(logits) & active
        stats = dataclasses.replace(s.stats, loops=s.stats.loops + active, num_new=s.stats.num_new + count,
                                    nonfinite=s.stats.nonfinite | bad)
        return ArsState(write_rows(s.tokens, s.length, token[:, None], count), s.length + count,
                        s.done | finished | bad, cache, key, stats)

    state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), step, state)
    return state.tokens, state.length, state.stats
