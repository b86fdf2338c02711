"""The grouped weight format: GGUF's blocks as stored, and specjax's own int4 / 8-bit groups.

    w[k, n] = (code[k, n] - offset) * scale[g, n] + low[g, n],   g = k // group

per output column n and group of `group` consecutive inputs (of the contracted axes
merged), with unsigned codes of `bits` = 4, 5, 6 or 8 bits, and per group either

* a float16-valued scale and minimum (Q4_1, Q5_1, specjax's int4), or a scale alone with
  an integer `offset` (symmetric blocks: Q4_0's 8, Q5_0's 16, Q8_0's 128; `low` is None);
* two levels, the K-quants': a float16-valued `scale` (and `low`) per super-block of
  groups times an int8 factor per group (`scale_factor`, `low_factor`): Q4_K's group scale
  d * sc is an 11-bit significand times a 6-bit integer, exact in float32 but not in
  float16, and its minimum -dmin * m likewise. Q6_K is 6-bit codes, offset 32, in groups of
  16; Q2_K's and Q3_K's 2- and 3-bit codes are kept as 4-bit ones.

Every value is the file's exactly: each product above is exact in float32 (at most 24
significant bits), so one rounding, at the minimum's addition, as ggml and the `gguf`
package dequantize. The codes are kept one per byte for XLA's paths (a prefill off the
kernel, meshes: the weight is dequantized into the dot); `pack_grouped` gives the few-row
kernel its panels (`fewrow_matmul.cc`: 4-bit nibbles plus one bit plane per bit above 4,
scales as float16 and int8 factors), read as many bytes per weight as the file's blocks
(Q4_K 4.625 bits, Q5_0 5.5, Q6_K 6.56, Q8_0 8.5).

With `activations='int8'` (the W4A8 and W8A8 formats: GGUF's tensors as llama.cpp multiplies
them) x is rounded to int8 per row and group of 32 inputs (`dispatch.round_activations`),
and the kernel sums integer products (VNNI's byte dot products where the CPU has them).
Rounding x changes the model's numbers (about as much as the weights' own rounding), so it
is a model of its own, chosen by the user; both paths round x the same way and then
multiply by the same weight.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from specjax.kernels import dispatch
from specjax.kernels.setting import Kernels

PANEL = 64  # columns per packed panel (fewrow_matmul.cc's kPanel)
GROUP = dispatch.GROUP  # inputs per activation scale of the A8 formats (and the default weight group)
ACTIVATIONS = ("float32", "int8")  # what a Grouped weight multiplies: x as it is, or rounded to int8
BITS = (4, 5, 6, 8)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Grouped:
    """A grouped weight (the module doc): `code` uint8 in the float weight's layout
    [*lead, *contracted, *out] (`transposed`: [*lead, N, K], a table multiplied by as its
    transpose and looked up by rows); `scale`, `low` float32 [*lead, S, N] (a transposed
    table's [*lead, N, S]) whose values are float16's (the kernel reads them so), S = G =
    ceil(K / group) groups, or S super-blocks of a power of two of groups each when
    `scale_factor` (and `low_factor`) int8 [*lead, S * per, N] (at least G rows: the last
    super-block padded) are given; `low` None: the scale alone, with
    `offset`. `heads`: how many of the last lead axes are output axes (a heads-major
    projection [*layers, N, D, H]: heads 1, out (H,), scales [*layers, N, S, H]).
    `panels`, `aux` [*lead, P, S, 1 or 2, PANEL] float16 and `aux_factor`
    [*lead, P, G, 1 or 2, PANEL] int8 are the kernel's (`pack_grouped`, of the matrix with
    the heads among its columns: lead without them), made by `pack_params` where it runs,
    else None."""

    code: jax.Array
    scale: jax.Array
    low: jax.Array | None
    out: tuple[int, ...]
    transposed: bool = False
    panels: jax.Array | None = None
    aux: jax.Array | None = None
    bits: int = 4
    activations: str = "float32"
    group: int = GROUP
    offset: int = 0
    heads: int = 0
    scale_factor: jax.Array | None = None
    low_factor: jax.Array | None = None
    aux_factor: jax.Array | None = None

    def __post_init__(self):
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"activations {self.activations!r}: not one of {', '.join(ACTIVATIONS)}")
        if self.bits not in BITS:
            raise ValueError(f"bits {self.bits}: not one of {BITS}")
        if self.scale_factor is not None and hasattr(self.scale, "shape"):  # (not a pytree's placeholder)
            axis = -1 if self.transposed else -2
            f, s = self.scale_factor.shape[axis], self.scale.shape[axis]
            if f % s or (f // s) & (f // s - 1):
                raise ValueError(f"{f} group factors for {s} super-block scales: want whole super-blocks of a "
                                 "power of two of groups")

    _CHILDREN = ("code", "scale", "low", "scale_factor", "low_factor", "panels", "aux", "aux_factor")
    _STATIC = ("out", "transposed", "bits", "activations", "group", "offset", "heads")

    def tree_flatten(self):
        return tuple(getattr(self, f) for f in self._CHILDREN), tuple(getattr(self, f) for f in self._STATIC)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(**dict(zip(cls._CHILDREN, children)), **dict(zip(cls._STATIC, aux)))

    dtype = jnp.dtype(jnp.float32)

    @property
    def n(self) -> int:
        return math.prod(self.out)

    @property
    def columns(self) -> tuple[int, ...]:
        """One layer's output axes: its `heads` leading ones (a heads-major projection's), then `out`."""
        return (*self.scale.shape[self.scale.ndim - 2 - self.heads:-2], *self.out)

    @property
    def shape(self):
        s = self.code.shape
        return (*s[:-2], s[-1], s[-2]) if self.transposed else s

    def astype(self, dtype) -> "Grouped":
        return self

    def reshape(self, k: int, n: int = -1) -> "Grouped":
        """The weight with its contracted axes merged into one of size k (one layer's)."""
        if self.transposed or self.scale.ndim != 2 or self.code.size != k * self.n or n not in (-1, self.n):
            raise ValueError(f"grouped weight {self.code.shape} contracts into {self.n}: not [{k}, {n}]")
        return dataclasses.replace(self, code=self.code.reshape(k, self.n), out=(self.n,))

    @property
    def T(self) -> "Grouped":
        if not self.transposed:
            raise ValueError("only a weight quantized transposed can be multiplied by as its transpose")
        return self

    def group_scales(self) -> tuple[jax.Array, jax.Array | None]:
        """(scale, low) float32 per group ([*lead, G, N]; transposed [*lead, N, G]): two
        levels multiplied out (exactly: float16 values times int8 factors)."""
        axis = -1 if self.transposed else -2

        def one(top, factor):
            if top is None or factor is None:
                return top
            return jnp.repeat(top, factor.shape[axis] // top.shape[axis], axis=axis) * factor.astype(jnp.float32)
        return one(self.scale, self.scale_factor), one(self.low, self.low_factor)

    def dequantized(self, dtype=jnp.float32) -> jax.Array:
        """(code - offset) * scale + low as stored (a table's [*lead, V, D] rows), in `dtype`."""
        scale, low = self.group_scales()
        if self.transposed:  # groups along the last axis
            return groups_apply(self.code, scale, low, -1, self.group, self.offset).astype(dtype)
        lead = self.scale.ndim - 2
        shape = self.code.shape
        K = math.prod(shape[lead:len(shape) - len(self.out)])
        code = self.code.reshape(*shape[:lead], K, self.n)
        return groups_apply(code, scale, low, -2, self.group, self.offset).reshape(shape).astype(dtype)

    def project(self, spec: str, x: jax.Array, setting: Kernels, **kwargs) -> jax.Array:
        """The grouped kernel where it applies (panels made, float32, one CPU device; any
        rows), else XLA's einsum over the dequantized weight; with int8 activations, x
        rounded first (the A8 kernel rounds it itself)."""
        if (self.panels is not None and dispatch.use_matmul(x, self.dtype, setting)
                and kwargs.get("preferred_element_type", jnp.float32) == jnp.float32):
            y = _by_kernel(x.reshape(-1, x.shape[-1]), self)
            return y.reshape(*x.shape[:-1], *self.columns)
        if self.activations == "int8":
            x = dispatch.round_activations(x)
        w = self.dequantized(x.dtype)
        return jnp.einsum(spec, x, jnp.swapaxes(w, -1, -2) if self.transposed else w, **kwargs)

    def rows(self, tokens: jax.Array, dtype) -> jax.Array:
        """Rows `tokens` of a table [V, D] (groups along D), only those dequantized."""
        take = lambda a: None if a is None else jnp.take(a, tokens, axis=0)  # noqa: E731
        part = dataclasses.replace(self, **{f: take(getattr(self, f)) for f in
                                            ("code", "scale", "low", "scale_factor", "low_factor")},
                                   panels=None, aux=None, aux_factor=None)
        scale, low = part.group_scales()
        return groups_apply(part.code, scale, low, -1, self.group, self.offset).astype(dtype)


def matrix(w: Grouped) -> jax.Array:
    """The [K, N] matrix a grouped weight (one layer's) multiplies by, float32 (a heads-major
    weight's columns head by head)."""
    m = w.dequantized()
    if w.transposed:
        return jnp.swapaxes(m, -1, -2)
    m = heads_last(m, 0, w.heads, m.ndim - w.heads - len(w.out))
    return m.reshape(-1, math.prod(w.columns))


def heads_last(a, lead: int, heads: int, contracted: int):
    """a [*lead, *heads, *contracted, ...] -> [*lead, *contracted, *heads, ...]: a heads-major
    projection's heads moved among its output axes (the matrix the kernel's panels hold)."""
    if not heads:
        return a
    axes = list(range(a.ndim))
    return a.transpose(axes[:lead] + axes[lead + heads:lead + heads + contracted] + axes[lead:lead + heads]
                       + axes[lead + heads + contracted:])


def merged(w: Grouped, lead: int) -> Grouped:
    """A heads-major Grouped [*lead, *heads, K, *out] as the [*lead, K, heads x out] matrix
    (its scales likewise): what its panels are made from."""
    if not w.heads:
        return w
    def one(a):
        if a is None:
            return None
        a = heads_last(a, lead, w.heads, a.ndim - lead - w.heads - 1)
        return a.reshape(*a.shape[:-1 - w.heads], -1)
    return dataclasses.replace(w, code=one(w.code), scale=one(w.scale), low=one(w.low),
                               scale_factor=one(w.scale_factor), low_factor=one(w.low_factor),
                               out=(math.prod(w.scale.shape[lead:lead + w.heads]) * w.n,), heads=0)


@jax.custom_jvp
def _by_kernel(x: jax.Array, w: Grouped) -> jax.Array:
    """x [T, K] @ w by the few-row kernel (x rounded there for int8 activations)."""
    kernel_offset = w.offset - 128 if w.bits == 8 and w.activations == "float32" else w.offset  # signed bytes
    return dispatch.fewrow_matmul_grouped(x, w.panels, w.aux, w.aux_factor, math.prod(w.columns), bits=w.bits, group=w.group,
                                          offset=kernel_offset, int8_activations=w.activations == "int8")


@_by_kernel.defjvp
def _by_kernel_jvp(primals, tangents):  # in x only (the weight is a constant; A8's rounding passed straight through)
    x, w = primals
    return _by_kernel(x, w), tangents[0] @ matrix(w)


def groups_apply(code: jax.Array, scale: jax.Array, low: jax.Array | None, axis: int, group: int = GROUP,
                 offset: int = 0) -> jax.Array:
    """(code - offset) * scale + low in float32, scale and low given per group of `group`
    along `axis` (-2: code [..., K, N], scale [..., G, N]; -1: code [..., N, K], scale
    [..., N, G]); low None: none."""
    K = code.shape[axis]
    pad, G = -K % group, -(-K // group)
    c = jnp.moveaxis(code, axis, -1) if axis == -2 else code  # [..., N, K]
    s = (jnp.swapaxes(scale, -1, -2) if axis == -2 else scale)[..., :G]  # [..., N, G] (a padded super-block cut)
    c = jnp.pad(c, [(0, 0)] * (c.ndim - 1) + [(0, pad)]).astype(jnp.float32) - offset
    w = c.reshape(*c.shape[:-1], -1, group) * s[..., None]
    if low is not None:
        w = w + (jnp.swapaxes(low, -1, -2) if axis == -2 else low)[..., :G, None]
    w = w.reshape(*c.shape[:-1], -1)[..., :K]
    return jnp.moveaxis(w, -1, -2) if axis == -2 else w


def _half(a: jax.Array) -> jax.Array:
    """a rounded to the nearest float16 value (kept float32; past float16's range, its largest)."""
    return jnp.clip(a, -65504, 65504).astype(jnp.float16).astype(jnp.float32)


def _groups_of(w: jax.Array, axis: int, bits: int = 4):
    """(code, scale, low) of w with groups of GROUP along `axis` (-2 or -1), as `groups_apply`
    reads them: 4 bits, the group's min and (max - min) / 15; 8, symmetric (GGUF's Q8_0):
    max |w| / 127, codes q + 128 with offset 128, low None. Scales and minimums are rounded
    to float16 values first (the kernel stores them so), and the codes made against the
    rounded ones."""
    K = w.shape[axis]
    pad = -K % GROUP
    g = jnp.moveaxis(w, -2, -1) if axis == -2 else w  # [..., N, K]
    # Pad by repeating the row's last value: the padding never widens the last group's range.
    g = jnp.concatenate([g, jnp.repeat(g[..., -1:], pad, axis=-1)], axis=-1) if pad else g
    g = g.reshape(*g.shape[:-1], -1, GROUP)
    if bits == 8:
        scale = _half(jnp.max(jnp.abs(g), axis=-1) / 127)
        scale = jnp.where(scale > 0, scale, 1.0)
        low = None
        code = (jnp.clip(jnp.round(g / scale[..., None]), -127, 127) + 128).astype(jnp.uint8)
    else:
        low, high = jnp.min(g, axis=-1), jnp.max(g, axis=-1)
        low = _half(low)
        scale = _half((high - low) / 15)
        scale = jnp.where(scale > 0, scale, 1.0)
        code = jnp.clip(jnp.round((g - low[..., None]) / scale[..., None]), 0, 15).astype(jnp.uint8)
    code = code.reshape(*code.shape[:-2], -1)[..., :K]
    if axis == -2:
        swap = lambda a: None if a is None else jnp.swapaxes(a, -1, -2)  # noqa: E731
        return jnp.moveaxis(code, -1, -2), swap(scale), swap(low)
    return code, scale, low


def quantize_int4(w: jax.Array, contracted: int, lead: int = 0, *, transposed: bool = False, bits: int = 4,
                  activations: str = "float32", heads: int = 0) -> Grouped:
    """w [*lead, *contracted, *out] (`transposed`: [*lead, N, K]) -> Grouped, 4 bits: per output
    column and group of GROUP inputs (of the contracted axes merged), min = the group's
    minimum, scale = (max - min) / 15 (1 for a constant group), code = round((w - min) /
    scale) in 0..15. `bits=8`: symmetric codes per group (scale = max |w| / 127, as GGUF's
    Q8_0). `activations`: the Grouped's (int8: the W4A8 / W8A8 formats); `heads`: the last of
    the lead axes that are output axes (a heads-major projection's)."""
    w = jnp.asarray(w, jnp.float32)
    offset = 128 if bits == 8 else 0
    if transposed:
        if contracted != 1 or w.ndim != lead + 2:
            raise ValueError(f"a transposed weight is [*lead, N, K]: got {w.shape} with lead={lead}")
        code, scale, low = _groups_of(w, -1, bits)
        return Grouped(code, scale, low, (w.shape[-2],), True, bits=bits, activations=activations, offset=offset)
    shape = w.shape
    out = tuple(shape[lead + contracted:])
    K = math.prod(shape[lead:lead + contracted])
    code, scale, low = _groups_of(w.reshape(*shape[:lead], K, math.prod(out)), -2, bits)
    return Grouped(code.reshape(shape), scale, low, out, bits=bits, activations=activations, offset=offset,
                   heads=heads)


# --------------------------------------------------------------------------- the kernel's layout


def _bit_bytes(bits: jax.Array) -> jax.Array:
    """[..., 8m] 0/1 -> [..., m] uint8, bit i of byte j = bits[8j + i]."""
    b = bits.astype(jnp.uint8).reshape(*bits.shape[:-1], -1, 8)
    return jnp.sum(b << jnp.arange(8, dtype=jnp.uint8), axis=-1, dtype=jnp.uint8)


def _row_panels(c: jax.Array, bits: int) -> jax.Array:
    """Codes [..., K, PANEL] (one panel) as `fewrow_matmul.cc`'s rows: [..., K, bytes]."""
    if bits == 8:  # signed bytes: code - 128
        return jax.lax.bitcast_convert_type((c.astype(jnp.int32) - 128).astype(jnp.int8), jnp.uint8)
    half = PANEL // 2
    nib = c & 15
    parts = [nib[..., :half] | (nib[..., half:] << 4)]
    parts += [_bit_bytes((c >> (4 + j)) & 1) for j in range(bits - 4)]
    return jnp.concatenate(parts, axis=-1).astype(jnp.uint8)


def _quad_panels(c: jax.Array, bits: int) -> jax.Array:
    """Codes [..., Q, 4, PANEL] (quad-rows of inputs) as the A8 layout: [..., Q, bytes], 4
    inputs of a column side by side."""
    c = jnp.swapaxes(c, -1, -2)  # [..., Q, PANEL columns, 4 inputs]
    if bits == 8:
        return c.reshape(*c.shape[:-2], -1).astype(jnp.uint8)
    half = PANEL // 2
    nib = c & 15
    parts = [(nib[..., :half, :] | (nib[..., half:, :] << 4)).reshape(*c.shape[:-2], -1)]
    parts += [_bit_bytes(((c >> (4 + j)) & 1).reshape(*c.shape[:-2], -1)) for j in range(bits - 4)]
    return jnp.concatenate(parts, axis=-1).astype(jnp.uint8)


def pack_grouped(w: Grouped) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(panels, aux, aux_factor) of a Grouped weight as the kernel reads them: panels
    [*lead, P, K, row bytes] uint8 (float activations) or the A8 quad-rows [*lead, P,
    ceil(K/32) * 8, quad-row bytes] (K padded with zero codes, which zero inputs multiply);
    aux [*lead, P, S, parts, PANEL] float16 the scales (then minimums: parts 2), aux_factor
    [*lead, P, S * per, parts, PANEL] int8 the two-level factors of S super-blocks of `per`
    groups (0 rows: one level). Columns past N are zeros."""
    def untransposed(a):
        return None if a is None else jnp.swapaxes(a, -1, -2)
    if w.transposed:
        lead = w.code.ndim - 2
        code = jnp.swapaxes(w.code, -1, -2)
        scale, low, sf, lf = map(untransposed, (w.scale, w.low, w.scale_factor, w.low_factor))
    else:
        lead = w.scale.ndim - 2
        K = math.prod(w.code.shape[lead:w.code.ndim - len(w.out)])
        code = w.code.reshape(*w.code.shape[:lead], K, w.n)
        scale, low, sf, lf = w.scale, w.low, w.scale_factor, w.low_factor
    K, N = code.shape[-2:]
    P = -(-N // PANEL)
    lead_shape = code.shape[:-2]
    a8 = w.activations == "int8"
    Kp = -(-K // GROUP) * GROUP if a8 else K
    G = -(-Kp // w.group)

    def by_panel(parts, rows, dtype):  # [*lead, rows, N] each -> [*lead, P, rows, parts, PANEL]
        a = jnp.stack([jnp.pad(p, [(0, 0)] * lead + [(0, rows - p.shape[-2]), (0, P * PANEL - N)]) for p in parts],
                      axis=-2)
        return jnp.moveaxis(a.reshape(*lead_shape, rows, len(parts), P, PANEL), -2, -4).astype(dtype)

    tops = [scale] if low is None else [scale, low]
    if sf is None:
        aux, aux_factor = by_panel(tops, G, jnp.float16), jnp.zeros((*lead_shape, P, 0, len(tops), PANEL), jnp.int8)
    else:  # whole super-blocks of factors (the last one padded with zeros)
        per = sf.shape[-2] // scale.shape[-2]
        S = -(-G // per)
        aux = by_panel(tops, S, jnp.float16)
        aux_factor = by_panel([sf] if low is None else [sf, lf], S * per, jnp.int8)
    c = jnp.pad(code, [(0, 0)] * lead + [(0, Kp - K), (0, P * PANEL - N)])
    if a8:
        c = jnp.moveaxis(c.reshape(*lead_shape, Kp // 4, 4, P, PANEL), -2, -4)  # [*lead, P, Q, 4, PANEL]
        panels = _quad_panels(c, w.bits)
    else:
        panels = _row_panels(jnp.moveaxis(c.reshape(*lead_shape, K, P, PANEL), -2, -3), w.bits)
    return panels, aux, aux_factor
