"""Logits -> probabilities (temperature, top-k, top-p) and one draw from them.

`warp` is the ONE place logits become a distribution; draft and target go through it
identically, so the speculative ratio q(x)/p(x) compares like with like. The order is
temperature, then top-k, then top-p; temperature 0 is greedy (a one-hot argmax), and
temperature inf is uniform over the tokens top-k keeps.

Nothing downstream may use a distribution that is not one: `warp` flags rows whose logits
hold NaN or inf or whose probabilities came out non-finite, `sample` flags rows with no
finite positive mass, and the loops stop such rows and report them at the host boundary
(never a token drawn from them).
"""
from __future__ import annotations

import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kernels import DEFAULT as DEFAULT_KERNELS, Kernels, dispatch
from specjax.sharding import LANES, gather_rows


class Warp(NamedTuple):
    """Sampling settings. As given (Python numbers) they are hashable; a compiled loop is
    keyed on `static()`, which keeps only what changes the program (greedy or not, top-k,
    whether top-p cuts, the kernels), and gets temperature and top-p as traced values
    (`values()`, `bind`): one compiled program serves every temperature > 0 and top-p < 1."""

    temperature: float | jax.Array | None = 1.0  # None: traced, given by `bind`
    top_k: int = 0
    top_p: float | jax.Array | None = 1.0  # None: traced, given by `bind`
    kernels: Kernels = DEFAULT_KERNELS  # whether the nucleus cut may run as its CPU kernel

    @property
    def greedy(self) -> bool:
        """Temperature 0 (a static choice: the argmax replaces the softmax)."""
        return isinstance(self.temperature, numbers.Real) and self.temperature == 0

    @property
    def cuts(self) -> bool:
        """Whether top-p cuts (a static choice: top_p = 1 skips the nucleus search)."""
        return not isinstance(self.top_p, numbers.Real) or self.top_p < 1.0

    def static(self) -> "Warp":
        """The program's key: temperature and top-p as None (traced) where they are values."""
        return self._replace(temperature=0.0 if self.greedy else None, top_p=None if self.cuts else 1.0)

    def values(self) -> np.ndarray:
        """[temperature, top_p] as float32, the traced operand of a program keyed on `static()`."""
        return np.array([self.temperature, self.top_p], np.float32)

    def bind(self, values: jax.Array) -> "Warp":
        """A `static()` Warp with its traced temperature and top-p taken from `values`."""
        return self._replace(temperature=values[0] if self.temperature is None else self.temperature,
                             top_p=values[1] if self.top_p is None else self.top_p)


def warp(logits: jax.Array, w: Warp) -> tuple[jax.Array, jax.Array]:
    """(float32 probabilities over the last axis, bad [logits.shape[:-1]]): bad marks a
    distribution that must not be sampled (NaN/inf logits, or probabilities that are not
    finite). Every temperature > 0 gives a valid distribution: logits are shifted so the
    largest is exactly 0 before dividing by T, so exp never overflows, the top token keeps
    weight 1 however small T is (even where gap / T overflows to -inf), and small T tends
    to the greedy one-hot."""
    # Gather vocab-parallel logits once (one small all-gather) so every reduction below is
    # local: on a pod, a dozen latency-bound all-reduces per distribution would cost more.
    # The NaN/inf checks run on the gathered copy for the same reason.
    logits = gather_rows(logits.astype(jnp.float32), ("batch",) + (None,) * (logits.ndim - 2) + ("vocab",))
    bad = ~jnp.all(jnp.isfinite(logits), axis=-1)
    vocab = logits.shape[-1]
    if w.greedy:
        return jax.nn.one_hot(first_max(logits), vocab, dtype=jnp.float32), bad
    gap = logits - jnp.max(logits, axis=-1, keepdims=True)  # <= 0, exactly 0 at the top
    # gap / T as 0 at the top whatever T is: with T a constant XLA turns the division into a
    # multiply by 1/T, which is inf for T below ~3e-39, and 0 * inf is NaN; with T traced (the
    # loops) a subnormal T may be read as 0 by the CPU, and 0 / 0 is NaN.
    scaled = jnp.where(gap == 0, 0.0, gap / w.temperature)
    if 0 < w.top_k < vocab:
        # On the logits, not the scaled values: the same tokens for any finite T (dividing
        # by T > 0 keeps the order), and still the top k at T = inf, where all scaled values are 0.
        kth = jax.lax.top_k(logits, w.top_k)[0][..., -1:]
        scaled = jnp.where(logits < kth, -jnp.inf, scaled)
    weights = jnp.exp(scaled)  # in [0, 1], with 1 at the top: the sum is in [1, V]
    probs = weights / jnp.sum(weights, axis=-1, keepdims=True)
    if w.cuts:
        probs = nucleus(probs, w.top_p, w.kernels)
    return probs, bad | ~jnp.all(jnp.isfinite(probs), axis=-1)


def first_max(values: jax.Array) -> jax.Array:
    """`jnp.argmax` over the last axis (the first of tied maxima), as a maximum and then
    the least index holding it: two plain reductions, where XLA:CPU's argmax (one
    reduction over (value, index) pairs) runs element by element, ~3x the time over a
    49k vocabulary (benchmarks/real_model.md, the greedy rule's section). A row holding
    NaN, which `warp` marks bad, gets its last index (jnp.argmax: its first NaN's)."""
    top = jnp.max(values, axis=-1, keepdims=True)
    size = values.shape[-1]
    index = jnp.min(jnp.where(values == top, jnp.arange(size, dtype=jnp.int32), size), axis=-1)
    return jnp.minimum(index, size - 1)


def nucleus(probs: jax.Array, top_p: float, kernels: Kernels = DEFAULT_KERNELS) -> jax.Array:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (ties at the
    boundary kept together), renormalised. Equivalently: keep p >= t*, the largest
    threshold whose kept mass is still >= top_p. t* is searched for over the bit patterns
    of the float32 probabilities (ordered like the values, as p >= 0), so it is one of the
    probabilities exactly, without sorting the vocabulary: on CPU a sort of the vocabulary
    costs far more than 32 masked sums, and top-p runs on every distribution of every
    loop (benchmarks/micro.md). On one CPU device `nucleus.cc` runs the same bisection
    where `kernels` allows it: XLA:CPU's loops of 32 small reductions cost more than the
    rest of a draft step's sampling."""
    if dispatch.use_nucleus(probs, kernels):
        return dispatch.nucleus(probs, top_p)
    bits = jax.lax.bitcast_convert_type(probs, jnp.uint32)
    kept = jnp.where(bits >= _nucleus_threshold(bits, jnp.asarray(top_p, probs.dtype)), probs, 0.0)
    return kept / jnp.sum(kept, axis=-1, keepdims=True)


def _nucleus_threshold(bits: jax.Array, top_p: jax.Array) -> jax.Array:
    """t* [..., 1] (uint32) for probabilities given by their bits [..., V]: the largest t
    whose mass sum(p where bits >= t) is still >= top_p (0, keeping everything, where none
    is). One distribution at a time (`lax.map`; on XLA:CPU a row at a time is also the
    faster, cache-sized), its bits made once into rows of 128 (a TPU's lanes; zeros pad
    them and are never kept) that every pass reads, the probabilities their bitcast.
    XLA:CPU computes, so there the search fixes one bit a pass (a bisection: least work);
    a TPU or GPU reads the row from memory at each pass, so there it fixes 4 (15
    candidates from one read, 8 passes). Over all rows at once, with the probabilities
    read beside their bits, the 32 passes of a bisection each read them from HBM: a 128k
    vocabulary on a TPU v5p, 32 MiB a draft step of Llama-3.2-1B, its costed step 1.19x its
    weights and cache (docs/pods.md)."""
    lead, V = bits.shape[:-1], bits.shape[-1]
    rows = jnp.pad(bits.reshape(-1, V), [(0, 0), (0, -V % LANES)]).reshape(-1, (V + -V % LANES) // LANES, LANES)
    rows = jax.lax.optimization_barrier(rows)  # made once: fused into each pass, each pass re-read its source
    top_p = jnp.broadcast_to(top_p, lead + (1,)).reshape(-1)
    search = lambda width: lambda rows, top_p: jax.lax.map(lambda a: _bits_search(*a, width), (rows, top_p))  # noqa: E731
    threshold = jax.lax.platform_dependent(rows, top_p, cpu=search(1), default=search(4))
    return threshold.reshape(lead + (1,))


def _bits_search(tiles: jax.Array, top_p: jax.Array, width: int) -> jax.Array:
    """One distribution's t* from its bits `tiles` [rows, 128], `width` bits a pass from
    the top. A pass tries the bits fixed so far plus d << shift for d = 1 .. 2^width - 1;
    the mass falls as the threshold rises, so the candidates that keep enough are d = 1 ..
    count, and count is t*'s next digit. uint32 holds every candidate (a probability's
    bits are at most inf's, 0x7f800000; above them the mass is 0)."""
    probs = jax.lax.bitcast_convert_type(tiles, jnp.float32)
    digits = jnp.arange(1, 2 ** width, dtype=jnp.uint32)[:, None, None]

    def fix(i, threshold):
        shift = (32 - width * (i + 1)).astype(jnp.uint32)
        candidates = threshold + (digits << shift)  # [2^width - 1, 1, 1]
        kept = jnp.sum(jnp.where(tiles >= candidates, probs, 0.0), axis=(1, 2))
        return threshold + (jnp.sum(kept >= top_p, dtype=jnp.uint32) << shift)

    return jax.lax.fori_loop(0, 32 // width, fix, jnp.uint32(0))


def cumulative(probs: jax.Array, block: int = 64) -> jax.Array:
    """cumsum over the last axis as two small triangular matmuls (within blocks of 64,
    then the block offsets): on CPU the two small dots cost less than `jnp.cumsum`, and
    this runs on every draw of every loop (benchmarks/micro.md); the same float32 error
    (~1e-7). `highest` keeps TPUs from rounding the operands to bf16."""
    V = probs.shape[-1]
    n = -(-V // block)
    blocks = jnp.pad(probs, [(0, 0)] * (probs.ndim - 1) + [(0, n * block - V)]).reshape(probs.shape[:-1] + (n, block))
    upper = lambda m, k: jnp.triu(jnp.ones((m, m), probs.dtype), k)
    within = jnp.einsum("...nb,bc->...nc", blocks, upper(block, 0), precision="highest")
    offsets = jnp.einsum("...n,nm->...m", within[..., -1], upper(n, 1), precision="highest")
    return (within + offsets[..., None]).reshape(probs.shape[:-1] + (n * block,))[..., :V]


def sample(key: jax.Array, probs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(one token per distribution over the last axis, empty): zero-probability tokens are
    never drawn, and `empty` marks a distribution with no finite positive mass (all
    zeros, NaN or inf), whose token means nothing and must not be emitted.

    Inverse CDF: the first token whose cumulative mass exceeds u * total, u ~ U[0, 1).
    One uniform per distribution; `jax.random.categorical` draws a Gumbel per vocabulary
    entry, and generating a vocabulary's worth of random bits costs far more on CPU than
    this CDF, on every one of the K+1 draws of a loop (benchmarks/micro.md). A
    zero-probability token repeats its predecessor's cumulative mass, so it is never the
    first to exceed u * total; the clamp to the last token with mass covers u * total
    rounding up to the total itself."""
    cdf = cumulative(probs)
    total = cdf[..., -1:]
    u = jax.random.uniform(key, probs.shape[:-1] + (1,), jnp.float32) * total
    first_above = jnp.sum(cdf <= u, axis=-1)
    size = probs.shape[-1]
    last_with_mass = jnp.max(jnp.where(probs > 0, jnp.arange(size, dtype=jnp.int32), -1), axis=-1)
    last_with_mass = jnp.where(last_with_mass < 0, size - 1, last_with_mass)  # none: the last token
    empty = ~((total > 0) & (total < jnp.inf))[..., 0]  # NaN fails both comparisons
    return jnp.minimum(first_above, last_with_mass).astype(jnp.int32), empty


def draw(key: jax.Array, probs: jax.Array, w: Warp) -> tuple[jax.Array, jax.Array]:
    """`sample` from `warp(..., w)`'s probabilities; at temperature 0 they are a one-hot,
    whose token is read off (`first_max`) without the cumulative sum a draw over the
    vocabulary costs: the same token, and never empty."""
    if w.greedy:
        return first_max(probs), jnp.zeros(probs.shape[:-1], bool)
    return sample(key, probs)
