"""When each kernel runs, and its XLA FFI call.

Decided at trace time from static facts only: the `Kernels` setting the program was traced
with, the backend (CPU), the devices (one: multi-device meshes, fake CPU devices included,
keep XLA's SPMD-partitioned ops), dtypes (float32), for attention the number of queries
per batch row (at most ATTENTION_ROWS: a decode step, a scoring pass, a tree's, a parallel
draft's pass; its work is split over (row, kv head) pairs; the matmul takes any number of
rows, in tiles), and whether the
library could be built.
Every kernel has the plain jnp computation as its fallback and as its gradient.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kernels.library import (ATTENTION_TARGET, MATMUL_A8_TARGET, MATMUL_GROUPED_TARGET, MATMUL_INT8_TARGET,
                                     MATMUL_TARGET, NUCLEUS_TARGET, available)
from specjax.kernels.setting import Kernels

MAX_ROWS = 8
# Queries per row the attention kernel takes. 9-16 (a scoring pass at K >= 8, a tree of
# M*K+1 nodes, a parallel draft's K+1 tokens and K-1 masks) ran 25-35% faster through it
# than through XLA's dots over a 400-slot cache (mini_target's shape; the parallel draft's
# 12- and 16-row pass 0.65 -> 0.26 and 0.71 -> 0.33 ms; benchmarks/heads.md).
ATTENTION_ROWS = 16
GROUP = 32  # A8 formats: inputs per activation scale (fewrow_matmul.cc's kGroup; GGUF's block)
# The grouped formats the kernel reads, as (bits, inputs per group) (fewrow_matmul.cc's ByFormat).
GROUPED_FORMATS = ((4, 32), (4, 16), (5, 32), (6, 16), (8, 32))


def single_device() -> bool:
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.size == 1 if not mesh.empty else jax.device_count() == 1


def runs(enabled: bool) -> bool:
    """The conditions every kernel shares: enabled by the setting, the CPU backend, the
    library built (last: the first call builds it)."""
    return enabled and jax.default_backend() == "cpu" and available()


# --------------------------------------------------------------------------- few-row matmul


def use_matmul(x: jax.Array, dtype, setting: Kernels) -> bool:
    """x [..., K] times a packed weight of `dtype`: float32 both, any number of rows. The
    kernel sweeps each panel once per tile of a few rows, so a prompt's prefill is tiles of
    a decode step's arithmetic over weights in cache. For float32 weights on SmolLM2's
    shape it measured faster than XLA's dot from 9 to 256 rows with AVX-512 and level with
    it with AVX2 (benchmarks/real_model.md); for a quantized weight XLA would first
    dequantize all of it to float32, each call."""
    rows = math.prod(x.shape[:-1])
    return (x.dtype == jnp.float32 and dtype == jnp.float32 and rows >= 1 and single_device()
            and runs(setting.matmul))


def panel_dot(x: jax.Array, panels: jax.Array, n: int) -> jax.Array:
    """x [T, K] @ the packed matrix with `n` columns, by XLA (the kernel's gradient)."""
    return jnp.einsum("TK,PKC->TPC", x, panels).reshape(x.shape[0], -1)[:, :n]


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def fewrow_matmul(x: jax.Array, panels: jax.Array, n: int) -> jax.Array:
    """x [T, K] @ the packed matrix with `n` columns, float32, by `fewrow_matmul.cc` (call
    only where `available()`)."""
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    return jax.ffi.ffi_call(MATMUL_TARGET, out, vmap_method="sequential")(x, panels)


@fewrow_matmul.defjvp
def _fewrow_matmul_jvp(n, primals, tangents):  # so that a gradient through a small batch still works
    (x, panels), (dx, dpanels) = primals, tangents
    return fewrow_matmul(x, panels, n), panel_dot(dx, panels, n) + panel_dot(x, dpanels, n)


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def fewrow_matmul_int8(x: jax.Array, panels: jax.Array, scale: jax.Array, n: int) -> jax.Array:
    """x [T, K] @ (int8 panels [P, K, PANEL] times scale [P, PANEL] per column), the first
    `n` columns, float32, by `fewrow_matmul.cc`'s int8 variant (call only where
    `available()`). Differentiable in x (the weight is a constant)."""
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    return jax.ffi.ffi_call(MATMUL_INT8_TARGET, out, vmap_method="sequential")(x, panels, scale)


@fewrow_matmul_int8.defjvp
def _fewrow_matmul_int8_jvp(n, primals, tangents):
    (x, panels, scale), (dx, _, _) = primals, tangents
    dy = panel_dot(dx, panels.astype(dx.dtype), n) * scale.reshape(-1)[:n]
    return fewrow_matmul_int8(x, panels, scale, n), dy


def fewrow_matmul_grouped(x: jax.Array, panels: jax.Array, aux: jax.Array, factors: jax.Array, n: int, *, bits: int,
                          group: int, offset: int, int8_activations: bool) -> jax.Array:
    """x [T, K] @ a grouped weight's panels (`grouped.pack_grouped`: codes of `bits` in groups
    of `group` inputs, aux [P, S, parts, PANEL] float16 scales and minimums, factors
    [P, G or 0, parts, PANEL] int8, `offset` subtracted from the codes where parts = 1), the
    first `n` columns, float32, by `fewrow_matmul.cc`'s grouped variant, or its A8 one with
    x rounded to int8 per group of GROUP (`round_activations`). Call only where
    `available()`; no derivative (`grouped.Grouped.project` gives it one)."""
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    target = MATMUL_A8_TARGET if int8_activations else MATMUL_GROUPED_TARGET
    return jax.ffi.ffi_call(target, out, vmap_method="sequential")(
        x, panels, aux, factors, bits=np.int32(bits), group=np.int32(group), offset=np.int32(offset))


def round_activations(x: jax.Array) -> jax.Array:
    """x as the A8 formats multiply by it: each row (last axis) rounded to int8 per group
    of GROUP inputs, q = round(x / d) with d = the group's max |x| / 127 (ties to even),
    and returned as q * d in x's dtype. `fewrow_matmul.cc`'s A8 variant rounds the same way."""
    K = x.shape[-1]
    g = jnp.pad(x.astype(jnp.float32), [(0, 0)] * (x.ndim - 1) + [(0, -K % GROUP)])
    g = g.reshape(*x.shape[:-1], -1, GROUP)
    d = jnp.max(jnp.abs(g), axis=-1, keepdims=True) / 127
    q = jnp.where(d > 0, jnp.clip(jnp.round(g / jnp.where(d > 0, d, 1)), -127, 127), 0)
    return (q * d).reshape(*x.shape[:-1], -1)[..., :K].astype(x.dtype)


# --------------------------------------------------------------------------- attention


def use_attention(q: jax.Array, k_all: jax.Array, setting: Kernels) -> bool:
    """q [B, T, N, H] against caches [L, B, G, S, H]: float32, T <= ATTENTION_ROWS queries per row,
    any batch (for batch 16 XLA:CPU's batched dots were ~3x slower: benchmarks/kernels.md)."""
    B, T = q.shape[:2]
    return (q.dtype == k_all.dtype == jnp.float32 and B >= 1 and 1 <= T <= ATTENTION_ROWS and single_device()
            and runs(setting.attention))


def attention(q, k, v, k_all, v_all, layer, limit, visible, scale: float, reference, positions, window=0):
    """`cached_attention.cc`: softmax(q . key * scale) over [layer `layer` of the caches
    below limit[b]; the own keys k [B, U, G, H] (the pass's T last, after any of earlier
    passes that no cache holds) where visible[t, u] ([T, U], or [B, T, U] where each row's
    tree differs)], times the values, where a sliding layer (`window` > 0, an int or traced)
    also drops the keys `window` or more positions before the query (`positions` [B, U]: the
    own keys', the queries' the last T; cache slot s is position s); q [B, T, N, H] ->
    [B, T, N, H] float32, as `reference(q, k, v, k_all, v_all)` (the jnp
    path, also used for gradients) computes it. Call only where `use_attention`."""

    @jax.custom_jvp
    def run(q, k, v, k_all, v_all):
        call = jax.ffi.ffi_call(ATTENTION_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32), vmap_method="sequential")
        return call(q, k_all, v_all, jnp.asarray(layer, jnp.int32), k, v, jnp.asarray(visible, bool),
                    limit.astype(jnp.int32), positions.astype(jnp.int32), jnp.asarray(window, jnp.int32),
                    scale=np.float32(scale))

    @run.defjvp
    def _(primals, tangents):
        return run(*primals), jax.jvp(reference, primals, tangents)[1]

    return run(q, k, v, k_all, v_all)


# --------------------------------------------------------------------------- nucleus


def use_nucleus(probs: jax.Array, setting: Kernels) -> bool:
    return probs.dtype == jnp.float32 and single_device() and runs(setting.nucleus)


def nucleus(probs: jax.Array, top_p) -> jax.Array:
    """`warping.nucleus(probs, top_p)` by `nucleus.cc` (call only where `use_nucleus`):
    the same rule; its masked sums add in another order than XLA's, so a row whose mass
    at the threshold is within float32 rounding of top_p may be cut one value apart.
    top_p: a float or a (traced) array that broadcasts to the rows, probs.shape[:-1]."""
    call = jax.ffi.ffi_call(NUCLEUS_TARGET, jax.ShapeDtypeStruct(probs.shape, jnp.float32), vmap_method="sequential")
    rows = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), probs.shape[:-1])
    return call(probs, rows)
