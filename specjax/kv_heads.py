"""kv-head duplication (Megatron-LM, vLLM): when a GQA/MQA model has fewer kv heads G
than the 'model' mesh axis m (Llama 3 70B: 8 kv heads on 16 chips), each kv head is
stored m/G times, consecutively, so that every device holds exactly the kv head its own
query heads read, and the wk/wv shards and the KV cache split m ways instead of being
replicated on every device (1/m of the duplicated total per device, against G/G of the
original).

Exact: query head n reads kv head n // (N/G); after duplication it reads stored head
n // (N/(cG)), which is copy number n // (N/(cG)) mod c of original head
n // (N/(cG)) // c = n // (N/G). So the model computes the same numbers (`model.py` is
unchanged: it sees a config with cG kv heads). The collectives do not change either:
every device already computed its own k, v.

It is a load-time transform of the config and the weights (`for_mesh`), applied by the
loaders (`model.init_lm`, `checkpoint.load_lm`, `hf.load`), and undone by what writes
weights (`checkpoint.save_lm`, `hf.export`: the original G heads). Training keeps the
original heads (the copies would drift apart under separate gradients). When m % G != 0
(G < m) nothing is duplicated and the kv heads stay replicated; `sharding.check_divisible`
refuses such meshes anyway.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from specjax.config import ModelConfig

# Params with a 'kv_heads' axis, and where it is: heads-major [G, D, H] projections and
# [G, H] biases (stacked: a leading L).
KV_PARAMS = {"attn/wk": -3, "attn/wv": -3, "attn/bk": -2, "attn/bv": -2}


def original(cfg: ModelConfig) -> ModelConfig:
    """The config with the model's own kv heads (undoes `for_mesh`)."""
    if cfg.kv_copies == 1:
        return cfg
    return dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads // cfg.kv_copies, kv_copies=1)


def copies(cfg: ModelConfig, model_axis: int) -> int:
    """How many copies of each original kv head a 'model' axis of this size wants."""
    kv = original(cfg).num_kv_heads
    return model_axis // kv if kv < model_axis and model_axis % kv == 0 else 1


def for_mesh(cfg: ModelConfig, mesh: Mesh) -> ModelConfig:
    """The config a model runs with on `mesh`: its kv heads duplicated when there are fewer
    than the 'model' axis (and it divides by them)."""
    base = original(cfg)
    c = copies(base, mesh.shape["model"])
    return base if c == 1 else dataclasses.replace(base, num_kv_heads=base.num_kv_heads * c, kv_copies=c)


def is_kv(key: str) -> bool:
    """Whether a param (its key as `hf._param_key` names it, e.g. 'attn/wk') has a kv-head axis."""
    return key in KV_PARAMS


def repeat(x, c: int, axis: int = -2):
    """x with G heads on `axis` ([..., G, H]; a projection's [..., G, D, H]: -3) -> cG
    heads, head g's copies at g*c .. g*c+c-1 (jnp or numpy)."""
    return x if c == 1 else x.repeat(c, axis=axis)


def first_copies(x, c: int, axis: int = -2):
    """cG heads on `axis` -> G: the original heads back (jnp or numpy)."""
    if c == 1:
        return x
    return x[(Ellipsis, slice(None, None, c)) + (slice(None),) * (-axis - 1)]


def source_sharding(target: NamedSharding, c: int) -> NamedSharding:
    """A sharding of the ORIGINAL [..., G, H] kv param that puts on each device exactly the
    data its shard of the duplicated [..., cG, H] param (sharded over 'model' on the head
    axis, `target`) holds: the same devices as a mesh (data, kv=G, copy=c), heads split
    over 'kv' and replicated over 'copy'. Device j of the 'model' axis sits at
    (j // c, j % c) and gets original head j // c, which is duplicated head j. So orbax
    reads each device's head directly (no replicated copy of the whole G heads first),
    and `adopt` relabels the buffers without moving them."""
    mesh = target.mesh
    m = mesh.shape["model"]
    split = Mesh(mesh.devices.reshape(mesh.shape["data"], m // c, c), ("data", "kv", "copy"),
                 axis_types=(jax.sharding.AxisType.Auto,) * 3)
    spec = tuple("kv" if axis == "model" else axis for axis in target.spec)
    return NamedSharding(split, P(*spec))


def adopt(x: jax.Array, target: NamedSharding, shape: tuple[int, ...]) -> jax.Array:
    """The duplicated param of `shape` with `target` sharding, from the original one laid out
    by `source_sharding(target, c)`: the same per-device buffers, relabelled (no copy)."""
    by_device = {s.device: s.data for s in x.addressable_shards}
    return jax.make_array_from_single_device_arrays(
        shape, target, [by_device[d] for d in target.addressable_devices_indices_map(shape)])


def head_rows(rows: slice, c: int, head_dim: int) -> tuple[slice, callable]:
    """For a slice of the ROWS of a duplicated HF k/v projection ([cG*H, D], whole heads),
    (the rows of the original [G*H, D] tensor to read, a function turning those rows into
    the requested ones)."""
    a, b = rows.start // head_dim, rows.stop // head_dim
    first, last = a // c, (b - 1) // c + 1

    def expand(x: np.ndarray) -> np.ndarray:
        heads = x.reshape((last - first, head_dim) + x.shape[1:]).repeat(c, axis=0)
        return heads[a - first * c:b - first * c].reshape((-1,) + x.shape[1:])
    return slice(first * head_dim, last * head_dim), expand


def _keys(path) -> list[str]:
    keys = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
    return [k for k in keys if k != "value"]


def map_kv(tree, fn):
    """`tree` (params: an nnx.State or a pytree of arrays) with fn(array, head axis) applied
    to the kv projections and biases (`KV_PARAMS`) and everything else as it is."""
    from flax import nnx

    def one(path, leaf):
        keys = _keys(path)
        if not _is_kv_path(keys):
            return leaf
        axis = _head_axis(keys)
        return leaf.replace(fn(leaf.value, axis)) if isinstance(leaf, nnx.Variable) else fn(leaf, axis)
    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _is_kv_path(keys: list[str]) -> bool:
    return len(keys) >= 2 and "/".join(keys[-2:]) in KV_PARAMS


def _head_axis(keys: list[str]) -> int:
    return KV_PARAMS["/".join(keys[-2:])]


def _zip_kv(fn, tree, abstract):
    """`tree` with fn(leaf, abstract leaf, head axis) applied to the kv projections and biases."""
    from flax import nnx

    def one(path, leaf, ab):
        keys = _keys(path)
        if not _is_kv_path(keys):
            return leaf
        value = leaf.value if isinstance(leaf, nnx.Variable) else leaf
        out = fn(value, ab.value if isinstance(ab, nnx.Variable) else ab, _head_axis(keys))
        return leaf.replace(out) if isinstance(leaf, nnx.Variable) else out
    return jax.tree_util.tree_map_with_path(one, tree, abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))


def source_params(abstract, c: int):
    """The restore target of the original params for the duplicated `abstract` params
    (ShapeDtypeStructs with shardings): kv projections with G heads, laid out by
    `source_sharding` (each device reads just its own head)."""
    if c == 1:
        return abstract

    def one(value, ab, axis):
        shape = ab.shape[:axis] + (ab.shape[axis] // c,) + ab.shape[axis + 1:]
        return jax.ShapeDtypeStruct(shape, ab.dtype, sharding=source_sharding(ab.sharding, c))
    return _zip_kv(one, abstract, abstract)


def adopt_params(params, abstract):
    """Restored original params (laid out by `source_params`) as the duplicated `abstract`
    params: the kv projections relabelled in place, everything else as it is."""
    return _zip_kv(lambda x, ab, _: x if x.shape == ab.shape else adopt(x, ab.sharding, ab.shape), params, abstract)


def undo(lm):
    """`lm` with its original kv heads (the first copy of each), sharded as the original
    model is: what checkpoints and exports hold."""
    if lm.cfg.kv_copies == 1:
        return lm
    from specjax.model import LM, abstract_lm
    mesh = jax.tree.leaves(lm.params)[0].sharding.mesh
    base = original(lm.cfg)
    target = abstract_lm(base, mesh)
    shardings = jax.tree.map(lambda v: v.sharding, target.params)
    c = lm.cfg.kv_copies
    params = jax.jit(lambda p: map_kv(p, lambda x, axis: first_copies(x, c, axis)), out_shardings=shardings)(lm.params)
    return LM(base, target.graphdef, params)
