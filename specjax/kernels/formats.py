"""Weights as the model multiplies by them: `project(spec, x, w, setting)` is x @ W.

A weight is a plain array (training, multi-device meshes, any dtype) or a *format*: a
pytree class that holds its own storage and implements

    project(spec, x, setting, **kwargs) -> jnp.einsum(spec, x, <the weight>, **kwargs)
    reshape(k, -1)                     -> the same weight with its contracted axes merged
    astype(dtype), dtype, shape        -> as an array's

so the model asks for "x @ W" in one place and the weight's format picks the kernel. A
new format (int8 per output channel; int4 in groups along the input with a scale and a
minimum, onto which GGUF's Q8_0/Q4_0/Q4_1 map) is one more such class with its own
kernel and its own packing function, used by `pack_params` in the same way.

`Packed` is the float32 format of the CPU few-row kernel: `LM.packed()` packs a model's
projections once, for decoding, where `should_pack` says that the kernel runs and the
copy fits in memory.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import pathlib

import jax
import jax.numpy as jnp

from specjax.kernels import dispatch
from specjax.kernels.setting import Kernels

PANEL = 64  # columns per packed panel (fewrow_matmul.cc's kPanel)

log = logging.getLogger(__name__)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Packed:
    """A weight w [*lead, *contracted, *out] as it is (`plain`, for XLA's dots over many
    rows: a prefill) and packed for the few-row kernel: `panels` [*lead, P, K, PANEL]
    holds columns PANEL*p .. PANEL*p + PANEL - 1 of the matrix w.reshape(*lead, K, N)
    (zeros past N), each panel one contiguous run that the kernel streams once. `out` are
    w's trailing axes (N = their product). A pytree whose leaves are the two arrays, so it
    rides inside a model's params (a scan over stacked layers slices their leading axis)."""

    plain: jax.Array
    panels: jax.Array
    out: tuple[int, ...]

    def tree_flatten(self):
        return (self.plain, self.panels), self.out

    @classmethod
    def tree_unflatten(cls, out, children):
        return cls(*children, out)

    @property
    def dtype(self):
        return self.panels.dtype

    @property
    def shape(self):
        return self.plain.shape

    @property
    def n(self) -> int:
        return math.prod(self.out)

    def astype(self, dtype) -> "Packed":
        return self if self.dtype == dtype else Packed(self.plain.astype(dtype), self.panels.astype(dtype), self.out)

    def reshape(self, k: int, n: int = -1) -> "Packed":
        """The weight with its contracted axes merged into one of size k (as the panels are)."""
        if self.panels.shape[-2] != k or n not in (-1, self.n):
            raise ValueError(f"packed weight contracts {self.panels.shape[-2]} inputs into {self.n}, not {k}")
        return Packed(self.plain.reshape(k, self.n), self.panels, (self.n,))

    def project(self, spec: str, x: jax.Array, setting: Kernels, **kwargs) -> jax.Array:
        """The kernel where it applies (float32, few rows, one CPU device), else jnp.einsum
        over the plain array, exactly as unpacked."""
        if (not dispatch.use_matmul(x, self.dtype, setting)
                or kwargs.get("preferred_element_type", jnp.float32) != jnp.float32):
            return jnp.einsum(spec, x, self.plain, **kwargs)
        y = dispatch.fewrow_matmul(x.reshape(-1, x.shape[-1]), self.panels, self.n)  # free reshapes: row-major
        return y.reshape(*x.shape[:-1], *self.out)


def project(spec: str, x: jax.Array, w, setting: Kernels, dtype=None, **kwargs) -> jax.Array:
    """x @ W as `jnp.einsum(spec, x, w, **kwargs)`, `spec` contracting x's last axis with
    w's leading ones, w first cast to `dtype` (the compute dtype) when given. A plain
    array is multiplied by XLA; a format (`Packed`, ...) picks its kernel under `setting`."""
    if dtype is not None:
        w = w.astype(dtype)
    if not hasattr(w, "project"):  # a plain array (a traced one too)
        return jnp.einsum(spec, x, w, **kwargs)
    return w.project(spec, x, setting, **kwargs)


def pack(w: jax.Array, contracted: int, lead: int = 0) -> Packed:
    """w [*lead, *contracted, *out] -> Packed (w itself, and a copy of it in panels)."""
    shape = w.shape
    K, out = math.prod(shape[lead:lead + contracted]), tuple(shape[lead + contracted:])
    N = math.prod(out)
    P = -(-N // PANEL)
    m = jnp.pad(w.reshape(*shape[:lead], K, N), [(0, 0)] * (lead + 1) + [(0, P * PANEL - N)])
    return Packed(w, jnp.moveaxis(m.reshape(*shape[:lead], K, P, PANEL), -2, -3), out)


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


def pack_params(params, contracted: dict[str, tuple[int, int]]):
    """params with every weight named in `contracted` (name -> (contracted axes, axes of
    one layer's weight); more axes are stacked layers) replaced by its Packed copy, made
    by one jitted program on the params' device (or, for abstract params, their shapes)."""

    def one(path, w):
        names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey) and isinstance(k.key, str)]
        if isinstance(w, Packed) or not names or names[-1] not in contracted:
            return w
        axes, ndim = contracted[names[-1]]
        return pack(w, axes, lead=w.ndim - ndim)

    fn = lambda p: jax.tree_util.tree_map_with_path(one, p, is_leaf=lambda x: isinstance(x, Packed))
    leaves = jax.tree.leaves(params)
    if all(isinstance(x, jax.Array) for x in leaves):
        return jax.jit(fn)(params)
    # Abstract params (what `plan` compiles): the shapes, on the params' one-device mesh.
    first = leaves[0].sharding
    where = (jax.sharding.NamedSharding(first.mesh, jax.sharding.PartitionSpec())
             if isinstance(first, jax.sharding.NamedSharding) else first)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where), jax.eval_shape(fn, params))
