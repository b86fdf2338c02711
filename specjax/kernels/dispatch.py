"""When each kernel runs, and its XLA FFI call.

Decided at trace time from static facts only: the `Kernels` setting the program was traced
with, the backend (CPU), the devices (one: multi-device meshes, fake CPU devices included,
keep XLA's SPMD-partitioned ops), dtypes (float32), for attention the number of queries
per batch row (at most MAX_ROWS: a decode step or a scoring pass; its work is split over
(row, kv head) pairs; the matmul takes any number of rows, in tiles), and whether the
library could be built.
Every kernel has the plain jnp computation as its fallback and as its gradient.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kernels.library import (ATTENTION_TARGET, MATMUL_A8_TARGET, MATMUL_GROUPED8_TARGET, MATMUL_INT4_TARGET,
                                     MATMUL_INT8_TARGET,
                                     MATMUL_TARGET, NUCLEUS_TARGET, available)
from specjax.kernels.setting import Kernels

MAX_ROWS = 8
GROUP = 32  # grouped weights: consecutive inputs per scale and minimum (fewrow_matmul.cc's kGroup; GGUF's block)


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


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def fewrow_matmul_grouped(x: jax.Array, panels: jax.Array, aux: jax.Array, n: int) -> jax.Array:
    """x [T, K] @ (grouped panels, dequantized by the groups' scales and minimums aux
    [P, G, 2, PANEL] float16), the first `n` columns, float32, by `fewrow_matmul.cc`'s grouped
    variants (call only where `available()`): uint8 panels [P, K, PANEL // 2] hold two
    4-bit codes per byte, int8 panels [P, K, PANEL] one 8-bit code each. Differentiable in x."""
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    target = MATMUL_INT4_TARGET if panels.dtype == jnp.uint8 else MATMUL_GROUPED8_TARGET
    return jax.ffi.ffi_call(target, out, vmap_method="sequential")(x, panels, aux)


def grouped_panel_matrix(panels: jax.Array, aux: jax.Array) -> jax.Array:
    """The dequantized [P, K, PANEL] panels of grouped `panels` and `aux` (the kernel's weight, by XLA)."""
    codes = (jnp.concatenate([panels & 15, panels >> 4], axis=-1) if panels.dtype == jnp.uint8 else panels)
    codes = codes.astype(jnp.float32)  # [P, K, PANEL]
    K = codes.shape[-2]
    scale = jnp.repeat(aux[..., 0, :].astype(jnp.float32), GROUP, axis=-2)[..., :K, :]
    low = jnp.repeat(aux[..., 1, :].astype(jnp.float32), GROUP, axis=-2)[..., :K, :]
    return codes * scale + low


@fewrow_matmul_grouped.defjvp
def _fewrow_matmul_grouped_jvp(n, primals, tangents):
    (x, panels, aux), (dx, _, _) = primals, tangents
    return fewrow_matmul_grouped(x, panels, aux, n), panel_dot(dx, grouped_panel_matrix(panels, aux), n)


def round_activations(x: jax.Array) -> jax.Array:
    """x as the A8 formats multiply by it: each row (last axis) rounded to int8 per group
    of GROUP inputs, q = round(x / d) with d = the group's max |x| / 127 (ties to even),
    and returned as q * d in x's dtype. `fewrow_matmul_a8` rounds the same way in C++."""
    K = x.shape[-1]
    g = jnp.pad(x.astype(jnp.float32), [(0, 0)] * (x.ndim - 1) + [(0, -K % GROUP)])
    g = g.reshape(*x.shape[:-1], -1, GROUP)
    d = jnp.max(jnp.abs(g), axis=-1, keepdims=True) / 127
    q = jnp.where(d > 0, jnp.clip(jnp.round(g / jnp.where(d > 0, d, 1)), -127, 127), 0)
    return (q * d).reshape(*x.shape[:-1], -1)[..., :K].astype(x.dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def fewrow_matmul_a8(x: jax.Array, panels: jax.Array, aux: jax.Array, n: int) -> jax.Array:
    """`round_activations(x)` [T, K] @ the A8 panels (uint8 [P, ceil(K/GROUP) * GROUP/4, 128]
    for 4-bit codes or [.., 256] for 8-bit ones + 128, aux [P, G, 2, PANEL]: `pack_grouped`
    of a weight with int8 activations), the first `n` columns, float32, by
    `fewrow_matmul.cc`'s integer dot products (call only where `available()`). Its
    derivative in x is the weight's (the rounding passed straight through)."""
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    return jax.ffi.ffi_call(MATMUL_A8_TARGET, out, vmap_method="sequential")(x, panels, aux)


def a8_panel_matrix(panels: jax.Array, aux: jax.Array, k: int) -> jax.Array:
    """The dequantized [P, k, PANEL] panels of A8 `panels` and `aux` (the kernel's weight, by XLA)."""
    P, Q = panels.shape[:2]
    quads = panels.reshape(P, Q, -1, 4)  # [P, Q, columns in a byte, 4 inputs]
    if panels.shape[-1] == 2 * 64:
        quads = jnp.concatenate([quads & 15, quads >> 4], axis=-2)
    codes = jnp.swapaxes(quads, -1, -2).reshape(P, 4 * Q, -1).astype(jnp.float32)  # [P, Kp, PANEL]
    scale = jnp.repeat(aux[..., 0, :].astype(jnp.float32), GROUP, axis=-2)
    low = jnp.repeat(aux[..., 1, :].astype(jnp.float32), GROUP, axis=-2)
    return (codes * scale + low)[:, :k]


@fewrow_matmul_a8.defjvp
def _fewrow_matmul_a8_jvp(n, primals, tangents):
    (x, panels, aux), (dx, _, _) = primals, tangents
    return fewrow_matmul_a8(x, panels, aux, n), panel_dot(dx, a8_panel_matrix(panels, aux, x.shape[-1]), n)


# --------------------------------------------------------------------------- attention


def use_attention(q: jax.Array, k_all: jax.Array, setting: Kernels) -> bool:
    """q [B, T, N, H] against caches [L, B, G, S, H]: float32, T <= MAX_ROWS queries per row,
    any batch (for batch 16 XLA:CPU's batched dots were ~3x slower: benchmarks/kernels.md)."""
    B, T = q.shape[:2]
    return (q.dtype == k_all.dtype == jnp.float32 and B >= 1 and 1 <= T <= MAX_ROWS and single_device()
            and runs(setting.attention))


def attention(q, k, v, k_all, v_all, layer, limit, visible, scale: float, reference, positions, window=0):
    """`cached_attention.cc`: softmax(q . key * scale) over [layer `layer` of the caches
    below limit[b]; this pass's keys k [B, T, G, H] where visible[t, u]], times the values,
    where a sliding layer (`window` > 0, an int or traced) also drops the keys `window` or
    more positions before the query (`positions` [B, T]; cache slot s is position s);
    q [B, T, N, H] -> [B, T, N, H] float32, as `reference(q, k, v, k_all, v_all)` (the jnp
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
