"""Weights as the model multiplies by them: `project(spec, x, w, setting)` is x @ W.

A weight is a plain array (training, multi-device meshes, any dtype) or a *format*: a
pytree class that holds its own storage and implements

    project(spec, x, setting, **kwargs) -> jnp.einsum(spec, x, <the weight>, **kwargs)
    reshape(k, -1)                     -> the same weight with its contracted axes merged
    astype(dtype), dtype, shape, T     -> as an array's (T where the format holds a transpose)
    plain                              -> the array as stored (`stored`: an embedding lookup)

so the model asks for "x @ W" in one place and the weight's format picks the kernel.

`Packed` is the float32 format of the CPU few-row kernel: `LM.packed()` packs a model's
projections once, for decoding, where `should_pack` says that the kernel runs and the
copy fits in memory.

`Int8` is a quantized weight, w = q * scale with int8 q and a float32 scale per output
column (symmetric: `quantize_int8`). It is the model: every path multiplies by exactly
q * scale, as x @ q scaled per column (the same sum whichever path runs). `pack_params`
gives it int8 panels for the few-row kernel (`fewrow_matmul.cc`, dequantized in
registers: a quarter of the float32 panels' bytes); elsewhere XLA's dot multiplies by q
converted to the compute dtype. An embedding table is quantized per row (= per output
column of its transpose, the tied unembedding); `rows` looks tokens up in it.

`Grouped` (`grouped.py`) is w = (code - offset) * scale + min per output column and group
of inputs: GGUF's blocks as stored (Q4_0/1, Q5_0/1, Q8_0 and the K-quants, value for
value) and specjax's own int4 and 8-bit groups (`quantize_int4`); with
`activations='int8'` it multiplies x rounded to int8 per group (the W4A8 and W8A8 kinds).
The kernel and XLA compute the same products, w dequantized in float32, summed in their
own orders.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import pathlib

import jax
import jax.numpy as jnp

from specjax.config import QUANTIZATIONS
from specjax.kernels import dispatch
from specjax.kernels.grouped import PANEL, Grouped, heads_last, merged, pack_grouped, quantize_int4
from specjax.kernels.setting import Kernels

log = logging.getLogger(__name__)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Packed:
    """A weight w [*lead, *contracted, *out] as it is (`plain`, for XLA's dots over many
    rows: a prefill) and packed for the few-row kernel: `panels` [*lead, P, K, PANEL]
    holds columns PANEL*p .. PANEL*p + PANEL - 1 of the matrix w.reshape(*lead, K, N)
    (zeros past N), each panel one contiguous run that the kernel streams once. `out` are
    w's trailing axes (N = their product). A pytree whose leaves are the two arrays, so it
    rides inside a model's params (a scan over stacked layers slices their leading axis).

    `transposed`: the weight multiplied by is plain's transpose (a tied embedding table,
    stored [V, D] for the lookup, multiplied by as [D, V]); the panels are the transpose's."""

    plain: jax.Array
    panels: jax.Array
    out: tuple[int, ...]
    transposed: bool = False

    def tree_flatten(self):
        return (self.plain, self.panels), (self.out, self.transposed)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    @property
    def dtype(self):
        return self.panels.dtype

    @property
    def shape(self):
        """The shape of the weight as multiplied by (a transposed table's [D, V])."""
        return self.matrix.shape

    @property
    def n(self) -> int:
        return math.prod(self.out)

    @property
    def matrix(self) -> jax.Array:
        """The weight as multiplied by, unpacked (a transpose is a view XLA folds into its dot)."""
        return jnp.swapaxes(self.plain, -1, -2) if self.transposed else self.plain

    def astype(self, dtype) -> "Packed":
        if self.dtype == dtype:
            return self
        return Packed(self.plain.astype(dtype), self.panels.astype(dtype), self.out, self.transposed)

    def reshape(self, k: int, n: int = -1) -> "Packed":
        """The weight with its contracted axes merged into one of size k (as the panels are)."""
        if self.panels.shape[-2] != k or n not in (-1, self.n) or self.transposed:
            raise ValueError(f"packed weight contracts {self.panels.shape[-2]} inputs into {self.n}, not {k}")
        return Packed(self.plain.reshape(k, self.n), self.panels, (self.n,))

    @property
    def T(self) -> "Packed":
        """The transpose as a weight to multiply by: a table packed `transposed` already is
        (its panels are plain.T's), as `w.T` is for a plain matrix."""
        if not self.transposed:
            raise ValueError("only a weight packed transposed can be multiplied by as its transpose")
        return self

    def project(self, spec: str, x: jax.Array, setting: Kernels, **kwargs) -> jax.Array:
        """The kernel where it applies (float32, one CPU device; any rows), else jnp.einsum
        over the plain array, exactly as unpacked."""
        if (not dispatch.use_matmul(x, self.dtype, setting)
                or kwargs.get("preferred_element_type", jnp.float32) != jnp.float32):
            return jnp.einsum(spec, x, self.matrix, **kwargs)
        y = dispatch.fewrow_matmul(x.reshape(-1, x.shape[-1]), self.panels, self.n)  # free reshapes: row-major
        return y.reshape(*x.shape[:-1], *self.out)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Int8:
    """A weight q * scale: q int8 in the float weight's layout [*lead, *contracted, *out]
    (`transposed`: [*lead, N, K], a table multiplied by as its transpose and looked up by
    rows), scale float32 [*lead, N], one per output column (N = prod(out)); `heads`: how
    many of the last lead axes are output axes (a heads-major projection [*layers, N, D, H]:
    out (H,), scale [*layers, N, H]). `panels` [*layers, P, K, PANEL] int8: q as the few-row
    kernel reads it (`pack`'s layout, the heads among the columns), made by `pack_params`
    where the kernel runs, else None. A pytree of those arrays, so it rides
    in a model's params and a scan over stacked layers slices them all."""

    q: jax.Array
    scale: jax.Array
    out: tuple[int, ...]
    transposed: bool = False
    panels: jax.Array | None = None
    heads: int = 0

    def tree_flatten(self):
        return (self.q, self.scale, self.panels), (self.out, self.transposed, self.heads)

    @classmethod
    def tree_unflatten(cls, aux, children):
        q, scale, panels = children
        out, transposed, heads = aux
        return cls(q, scale, out, transposed, panels, heads)

    dtype = jnp.dtype(jnp.float32)  # what x @ W computes in: the scale's dtype

    @property
    def n(self) -> int:
        return math.prod(self.out)

    @property
    def columns(self) -> tuple[int, ...]:
        """One layer's output axes: its `heads` leading ones (a heads-major projection's), then `out`."""
        return (*self.scale.shape[self.scale.ndim - 1 - self.heads:-1], *self.out)

    @property
    def shape(self):
        """The shape of the weight as multiplied by (a transposed table's [D, V])."""
        s = self.q.shape
        return (*s[:-2], s[-1], s[-2]) if self.transposed else s

    def astype(self, dtype) -> "Int8":
        """Itself: q is converted to the input's dtype where it is multiplied."""
        return self

    def reshape(self, k: int, n: int = -1) -> "Int8":
        """The weight with its contracted axes merged into one of size k (one layer's)."""
        if self.transposed or self.heads or self.scale.ndim != 1 or self.q.size != k * self.n or n not in (-1, self.n):
            raise ValueError(f"int8 weight {self.q.shape} contracts into {self.n}: not [{k}, {n}]")
        return Int8(self.q.reshape(k, self.n), self.scale, (self.n,), False, self.panels)

    @property
    def T(self) -> "Int8":
        if not self.transposed:
            raise ValueError("only a weight quantized transposed can be multiplied by as its transpose")
        return self

    def dequantized(self, dtype=jnp.float32) -> jax.Array:
        """q * scale as stored (a table's [*lead, V, D] rows), in `dtype`."""
        if self.transposed:
            return self.q.astype(dtype) * self.scale[..., None].astype(dtype)
        lead = self.scale.ndim - 1
        shape = (*self.scale.shape[:lead], *[1] * (self.q.ndim - lead - len(self.out)), *self.out)
        return self.q.astype(dtype) * self.scale.reshape(shape).astype(dtype)

    def project(self, spec: str, x: jax.Array, setting: Kernels, **kwargs) -> jax.Array:
        """The int8 kernel where it applies (panels made, float32, one CPU device; any
        rows), else XLA's einsum over q in x's dtype; either way the sum over k of x * q,
        times the column's scale. `spec`'s output ends with w's `out` axes."""
        if (self.panels is not None and dispatch.use_matmul(x, self.dtype, setting)
                and kwargs.get("preferred_element_type", jnp.float32) == jnp.float32):
            P, n = self.panels.shape[-3], math.prod(self.columns)
            scale = jnp.pad(self.scale.reshape(-1), (0, P * PANEL - n)).reshape(P, PANEL)
            y = dispatch.fewrow_matmul_int8(x.reshape(-1, x.shape[-1]), self.panels, scale, n)
            return y.reshape(*x.shape[:-1], *self.columns)
        q = self.q.astype(x.dtype)
        y = jnp.einsum(spec, x, jnp.swapaxes(q, -1, -2) if self.transposed else q, **kwargs)
        return (y * self.scale.reshape(self.columns)).astype(y.dtype)


def quantize_int8(w: jax.Array, contracted: int, lead: int = 0, *, transposed: bool = False, heads: int = 0) -> Int8:
    """w [*lead, *contracted, *out] (`transposed`: [*lead, N, K]) -> Int8, symmetric per
    output column: scale = max |w| over the column / 127, q = round(w / scale) (a zero
    column gets scale 1 and q 0). `heads`: the last of the lead axes that are output axes."""
    w = jnp.asarray(w, jnp.float32)
    if transposed:
        if contracted != 1 or w.ndim != lead + 2:
            raise ValueError(f"a transposed weight is [*lead, N, K]: got {w.shape} with lead={lead}")
        amax = jnp.max(jnp.abs(w), axis=-1)
        scale = jnp.where(amax > 0, amax / 127, 1.0)
        q = jnp.clip(jnp.round(w / scale[..., None]), -127, 127).astype(jnp.int8)
        return Int8(q, scale, (w.shape[-2],), True)
    out = tuple(w.shape[lead + contracted:])
    axes = tuple(range(lead, lead + contracted))
    amax = jnp.max(jnp.abs(w), axis=axes, keepdims=True)
    scale = jnp.where(amax > 0, amax / 127, 1.0)
    q = jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8)
    return Int8(q, scale.reshape(*w.shape[:lead], math.prod(out)), out, heads=heads)


def quantize_params(params, contracted: dict[str, tuple[int, ...]], transposed: tuple[str, ...] = (),
                    kind: str = "int8"):
    """params with every float weight named in `contracted` (as `pack_params`'s) replaced by
    its `kind` quantization (`QUANTIZERS`: `Int8`, 4-bit `Grouped`), one jitted program per weight
    (the float weights are not copied), the codes placed as the weight was (its sharding
    on the mesh); int8's scales (one per column) replicated, a grouped weight's scales and
    minimums (one per 32 weights: replicated, 70B's would fill a chip) split as their
    columns and groups are (`group_sharding`); names in `transposed` are [N, K] tables
    quantized per row. An A8 kind (`A8_KINDS`) also turns a grouped weight that multiplies
    float activations (a GGUF file's codes as stored, an int4 model) into the same codes
    multiplying int8 ones; other quantized weights stay as they are."""
    quantizer = QUANTIZERS[kind]
    is_format = lambda x: isinstance(x, (Packed, *QUANTIZED))  # noqa: E731

    def one(path, w):
        names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey) and isinstance(k.key, str)]
        if isinstance(w, Grouped) and kind in A8_KINDS and w.activations != "int8":  # its codes, times int8 x
            return dataclasses.replace(w, activations="int8", panels=None, aux=None, aux_factor=None)
        if is_format(w) or not names or names[-1] not in contracted:
            return w
        axes, ndim, heads = layout(contracted[names[-1]])
        lead = len(w.shape) - ndim + heads  # a heads-major weight's heads: lead axes of its format
        fn = functools.partial(quantizer, contracted=axes, lead=lead, transposed=names[-1] in transposed,
                               heads=heads)
        where = getattr(w, "sharding", None)
        if not isinstance(where, jax.sharding.NamedSharding):
            return jax.jit(fn)(w) if isinstance(w, jax.Array) else jax.eval_shape(fn, w)
        everywhere = jax.sharding.NamedSharding(where.mesh, jax.sharding.PartitionSpec())
        shape = jax.eval_shape(fn, w)
        groups = group_sharding(where, lead, axes, len(w.shape), names[-1] in transposed,
                                shape.scale.shape if isinstance(shape, Grouped) else ())

        def place(a):
            if a.shape == w.shape:
                return where
            return groups if isinstance(shape, Grouped) else everywhere
        placed = jax.tree.map(place, shape)
        if not isinstance(w, jax.Array):  # abstract params (`plan`): the shapes, placed
            return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shape, placed)
        return jax.jit(fn, out_shardings=placed)(w)

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=is_format)


def group_sharding(where: jax.sharding.NamedSharding, lead: int, contracted: int, ndim: int, transposed: bool,
                   shape: tuple[int, ...]) -> jax.sharding.NamedSharding:
    """Where a grouped weight's scales [*lead, G, N] (a transposed table's [*lead, N, G])
    go, to match its codes' sharding `where` over [*lead, *contracted, *out]: a merged axis
    is split where its first (major) part is, so each device holds the scales of its own
    columns and groups; an axis split elsewhere, or whose size the mesh axis does not
    divide (a few groups), is kept whole."""
    spec = tuple(where.spec) + (None,) * (ndim - len(where.spec))
    head = spec[:lead]
    if transposed:
        parts = (*head, spec[lead], None)
    else:
        inner, outer = spec[lead:lead + contracted], spec[lead + contracted:]
        merged = lambda axes: axes[0] if all(a is None for a in axes[1:]) else None  # noqa: E731
        parts = (*head, merged(inner), merged(outer))

    def size(name) -> int:
        return math.prod(where.mesh.shape[n] for n in ((name,) if isinstance(name, str) else name))
    parts = tuple(None if a is None or dim % size(a) else a for a, dim in zip(parts, shape))
    return jax.sharding.NamedSharding(where.mesh, jax.sharding.PartitionSpec(*parts))


# `config.QUANTIZATIONS`, each kind's quantizer: per-channel int8, or groups of its bits.
QUANTIZERS = {q.name: functools.partial(quantize_int4, bits=q.bits, activations=q.activations) if q.grouped
              else quantize_int8 for q in QUANTIZATIONS.values()}
A8_KINDS = tuple(q.name for q in QUANTIZATIONS.values() if q.activations == "int8")  # multiply int8 activations
QUANTIZED = (Int8, Grouped)  # the quantized formats


def is_quantized(params) -> bool:
    """Whether any weight in `params` is in a quantized format."""
    return any(isinstance(x, QUANTIZED) for x in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QUANTIZED)))


def project(spec: str, x: jax.Array, w, setting: Kernels, dtype=None, **kwargs) -> jax.Array:
    """x @ W as `jnp.einsum(spec, x, w, **kwargs)`, `spec` contracting x's last axis with
    w's contracted ones (its leading ones, or those after a heads-major weight's heads), w
    first cast to `dtype` (the compute dtype) when given. A plain
    array is multiplied by XLA; a format (`Packed`, ...) picks its kernel under `setting`."""
    if dtype is not None:
        w = w.astype(dtype)
    if not hasattr(w, "project"):  # a plain array (a traced one too)
        return jnp.einsum(spec, x, w, **kwargs)
    return w.project(spec, x, setting, **kwargs)


def pack(w: jax.Array, contracted: int, lead: int = 0, *, transposed: bool = False, heads: int = 0) -> Packed:
    """w [*lead, *contracted, *out] -> Packed (w itself, and a copy of it in panels). With
    `transposed`, w is [*lead, N, K] and what is packed is its transpose [*lead, K, N]
    (`contracted` must then be 1). With `heads`, w is [*lead, *heads, *contracted, *out]
    (heads-major) and the panels hold the matrix with the heads among its columns."""
    if transposed:
        if contracted != 1 or w.ndim != lead + 2:
            raise ValueError(f"a transposed weight is [*lead, N, K]: got {w.shape} with lead={lead}")
        packed = pack(jnp.swapaxes(w, -1, -2), 1, lead)
        return Packed(w, packed.panels, packed.out, True)
    matrix = heads_last(w, lead, heads, contracted)  # [*lead, *contracted, *heads, *out]
    shape = matrix.shape
    K = math.prod(shape[lead:lead + contracted])
    out = (*w.shape[lead:lead + heads], *w.shape[lead + heads + contracted:])
    N = math.prod(out)
    P = -(-N // PANEL)
    m = jnp.pad(matrix.reshape(*shape[:lead], K, N), [(0, 0)] * (lead + 1) + [(0, P * PANEL - N)])
    return Packed(w, jnp.moveaxis(m.reshape(*shape[:lead], K, P, PANEL), -2, -3), out)


def stored(w) -> jax.Array:
    """The array as stored: a format's plain array (a tied table's [V, D] rows for the
    embedding lookup), a quantized one dequantized, a plain one itself."""
    if isinstance(w, QUANTIZED):
        return w.dequantized()
    return w.plain if isinstance(w, Packed) else w


def rows(table, tokens: jax.Array, dtype) -> jax.Array:
    """An embedding lookup: rows `tokens` of a [V, D] table in `dtype` (of a quantized table,
    only those rows dequantized)."""
    if isinstance(table, Int8):
        return jnp.take(table.q, tokens, axis=0).astype(dtype) * jnp.take(table.scale, tokens, axis=0)[..., None].astype(dtype)
    if isinstance(table, Grouped):  # a table [V, D] with groups along D
        return table.rows(tokens, dtype)
    return jnp.take(stored(table), tokens, axis=0).astype(dtype)


def memory_available() -> int | None:
    """Free memory in bytes (MemAvailable), None where unknown."""
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def should_pack(params, dtypes: tuple[str, str], setting: Kernels, *, new_copy: bool = True) -> bool:
    """Whether a model's decoding pays for a packed copy of its projections: the kernel would
    run (CPU backend, params on one device, float32 params and compute, enabled in
    `setting` and built), and, for a `new_copy`, the copy (as large as the weights) fits
    in half the free memory."""
    leaves = jax.tree.leaves(params)
    one_device = lambda x: getattr(x, "sharding", None) is not None and len(x.sharding.device_set) == 1
    if not (dtypes == ("float32", "float32") and leaves and all(one_device(x) for x in leaves)
            and dispatch.runs(setting.matmul)):
        return False
    if not new_copy or not all(isinstance(x, jax.Array) for x in leaves):  # abstract (`plan`): nothing allocated
        return True
    size, free = sum(x.nbytes for x in leaves), memory_available()
    if free is not None and size > free // 2:
        log.info("specjax: not packing %d MB of weights for the CPU kernel (%d MB free)", size >> 20, free >> 20)
        return False
    return True


def layout(entry: tuple[int, ...]) -> tuple[int, int, int]:
    """A `contracted` entry (contracted axes, axes of one layer's weight[, heads]) with its
    heads (0: none) spelled out: a heads-major projection [N, D, H] is (1, 3, 1)."""
    return (*entry, 0)[:3]


def pack_params(params, contracted: dict[str, tuple[int, ...]], transposed: tuple[str, ...] = ()):
    """params with every weight named in `contracted` (name -> (contracted axes, axes of
    one layer's weight[, heads: leading axes of it that are output axes]); more axes are
    stacked layers) replaced by its Packed copy (an
    `Int8` given its int8 panels), the
    panels made by one jitted program on the params' device (or, for abstract params,
    their shapes). Names in `transposed` are [N, K] weights multiplied by as their
    transpose (`pack`). The Packed weights hold the params' own arrays as `plain`: only
    the panels are new (a jitted program returning the arrays too would copy them)."""
    is_packed = lambda x: isinstance(x, (Packed, *QUANTIZED))  # noqa: E731
    source = lambda w: w.q if isinstance(w, Int8) else w  # what is packed: an Int8's q  # noqa: E731

    def recipe(path, w) -> dict | None:
        names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey) and isinstance(k.key, str)]
        if isinstance(w, Packed) or (isinstance(w, QUANTIZED) and w.panels is not None) or not names \
                or names[-1] not in contracted:
            return None
        if isinstance(w, Grouped) and (w.bits, w.group) not in dispatch.GROUPED_FORMATS:
            return None  # a format the kernel does not read: XLA's path
        axes, ndim, heads = layout(contracted[names[-1]])
        shape = w.code.shape if isinstance(w, Grouped) else source(w).shape
        return dict(contracted=axes, lead=len(shape) - ndim, transposed=names[-1] in transposed, heads=heads)

    def made_for(w, r):
        return pack_grouped(merged(w, r["lead"])) if isinstance(w, Grouped) else pack(source(w), **r).panels

    def panels(p):
        return {jax.tree_util.keystr(path): made_for(w, r)
                for path, w in jax.tree_util.tree_leaves_with_path(p, is_leaf=is_packed)
                if (r := recipe(path, w)) is not None}

    leaves = jax.tree.leaves(params)
    if all(isinstance(x, jax.Array) for x in leaves):
        made = jax.jit(panels)(params)
    else:  # abstract params (what `plan` compiles): the shapes, on the params' one-device mesh
        first = leaves[0].sharding
        where = (jax.sharding.NamedSharding(first.mesh, jax.sharding.PartitionSpec())
                 if isinstance(first, jax.sharding.NamedSharding) else first)
        made = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where),
                            jax.eval_shape(panels, params))

    def one(path, w):
        r = recipe(path, w)
        if r is None:
            return w
        if isinstance(w, Int8):
            return dataclasses.replace(w, panels=made[jax.tree_util.keystr(path)])
        if isinstance(w, Grouped):
            panels, aux, aux_factor = made[jax.tree_util.keystr(path)]
            return dataclasses.replace(w, panels=panels, aux=aux, aux_factor=aux_factor)
        shape = jax.eval_shape(lambda w: pack(w, **r), jax.ShapeDtypeStruct(w.shape, w.dtype))
        return Packed(w, made[jax.tree_util.keystr(path)], shape.out, shape.transposed)

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=is_packed)
