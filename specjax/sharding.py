"""The mesh ('data', 'model') and the ONE table from logical axis names to mesh axes.

Megatron tensor parallelism falls out of the table: q/k/v and ffw-in are split over
'model' on their output axis (heads, mlp), attention-out and ffw-out on their input
axis, so each block needs one all-reduce after attention and one after the ffw.
Embedding and logits are vocab-parallel. The KV cache follows the kv heads. With fewer
kv heads than 'model' devices (MQA/GQA) the loaders duplicate each kv head so that there
are as many as devices (`kv_heads`); only where the 'model' axis is not a multiple of the
kv heads would they stay replicated (and `check_divisible` refuses that mesh).
"""
from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from specjax.config import ConfigError, MeshConfig, ModelConfig

AXES = ("data", "model")

RULES: dict[str, str | None] = {
    "batch": "data",
    "embed": None,
    "heads": "model",
    "kv_heads": "model",
    "head_dim": None,
    "mlp": "model",
    "vocab": "model",
    "layers": None,
    "cache_seq": None,
}


def make_mesh(mesh_cfg: MeshConfig = MeshConfig(), devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
    """Explicit axis types (Auto: XLA propagates shardings from the params, as Megatron needs)."""
    devices = list(devices if devices is not None else jax.devices())
    data = mesh_cfg.data
    model = mesh_cfg.model if mesh_cfg.model != -1 else len(devices) // max(data, 1)
    if data * model != len(devices) or model < 1:
        raise ConfigError(f"mesh {data}x{model} (data x model) needs {data * model} devices, "
                          f"but {len(devices)} are available")
    return jax.make_mesh((data, model), AXES, axis_types=(AxisType.Auto, AxisType.Auto),
                         devices=devices)


def check_divisible(cfg: ModelConfig, mesh: jax.sharding.Mesh, what: str = "model") -> None:
    """Fail at start-up, naming the numbers, when a tensor-parallel axis does not split."""
    m = mesh.shape["model"]
    for field in ("num_heads", "d_ff", "vocab_size"):
        value = getattr(cfg, field)
        if value % m:
            raise ConfigError(f"{what}.{field}={value} is not divisible by the 'model' mesh axis "
                              f"of size {m} (mesh {mesh.shape['data']}x{m}); choose a mesh whose "
                              f"model axis divides it")
    kv = cfg.num_kv_heads
    if kv % m and m % kv:
        raise ConfigError(f"{what}.num_kv_heads={kv} neither divides nor is a multiple of the 'model' "
                          f"mesh axis of size {m}")


def make_checked_mesh(mesh_cfg: MeshConfig, models: dict[str, ModelConfig]) -> jax.sharding.Mesh:
    """The device mesh, after checking that every model ({'target': cfg, ...}) splits over
    its 'model' axis (the message names the model, the field and the numbers)."""
    mesh = make_mesh(mesh_cfg)
    for what, cfg in models.items():
        check_divisible(cfg, mesh, what)
    return mesh


def logical_to_spec(names: Sequence[str | None], shape: Sequence[int] | None = None,
                    mesh: jax.sharding.Mesh | None = None) -> P:
    """Map logical names through RULES. An axis that does not divide its dimension is
    replicated (kv heads under MQA/GQA, a batch smaller than 'data'); params are checked
    beforehand by `check_divisible`, so nothing big is replicated silently."""
    out, used = [], set()
    for i, name in enumerate(names):
        if name is not None and name not in RULES:
            raise ValueError(f"logical axis {name!r} is not in the sharding table {sorted(RULES)}")
        axis = RULES.get(name) if name else None
        if axis is not None and mesh is not None and shape is not None and shape[i] % mesh.shape[axis]:
            axis = None
        if axis is not None and axis in used:
            raise ValueError(f"logical axes {tuple(names)} map mesh axis {axis!r} twice")
        if axis is not None:
            used.add(axis)
        out.append(axis)
    return P(*out)


def _logical_names(variable: nnx.Variable) -> tuple:
    names = tuple(variable.get_metadata().get("logical", ()))
    extra = variable.value.ndim - len(names)
    return ("layers",) * extra + names  # stacked (scanned) layers carry a leading layer axis


def param_shardings(state: nnx.State, mesh: jax.sharding.Mesh):
    """NamedShardings for every parameter of an nnx State, from its logical names."""
    def one(v):
        return NamedSharding(mesh, logical_to_spec(_logical_names(v), v.value.shape, mesh))
    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def named(mesh: jax.sharding.Mesh, names: Sequence[str | None], shape: Sequence[int]) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(names, shape, mesh))


def shard_fraction(array: jax.Array) -> float:
    """Fraction of an array's elements each device holds (1.0 = replicated)."""
    shard = array.sharding.shard_shape(array.shape)
    return math.prod(shard) / max(1, math.prod(array.shape))


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def with_shardings(abstract, shardings):
    """`abstract` (a pytree of arrays or ShapeDtypeStructs, or of nnx.Variables holding
    them) as ShapeDtypeStructs carrying `shardings` (a matching tree): the form AOT
    compiles and orbax restores take. Nothing is allocated."""
    def one(a, sh):
        if isinstance(a, nnx.Variable):
            return a.replace(jax.ShapeDtypeStruct(a.value.shape, a.value.dtype, sharding=sh))
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)
    return jax.tree.map(one, abstract, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Shard a traced value by logical names on the mesh set with `jax.set_mesh` (no-op
    without one). Pins what XLA would otherwise guess, e.g. a replicated MQA cache."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(names, x.shape, mesh))


def local(fn, names: Sequence[Sequence[str | None]], out: Sequence[str | None]):
    """`fn` applied to each device's shards of its arguments (sharded by the logical
    `names`, one per argument, on the mesh set with `jax.set_mesh`); its result, shaped as
    its first argument, sharded by `out`. For work that never needs another device's
    part, written per shard (a loop over the rows a device holds). Without a mesh, `fn`."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return fn

    def run(*args):
        specs = tuple(logical_to_spec(n, a.shape, mesh) for n, a in zip(names, args))
        return jax.shard_map(fn, in_specs=specs, out_specs=logical_to_spec(out, args[0].shape, mesh))(*args)
    return run


LANES = 128  # a TPU vector register's minor dimension


def gather_rows(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """x [..., V], split over its last axis as `names` say (e.g. vocab-parallel logits),
    with that axis whole on every device and the others as `names` say: one all-gather.
    Each shard is padded to whole 128-lane tiles and gathered along a new major axis
    ([..., m, V/m + pad], then the padding dropped): a gather whose shards are not whole
    tiles (chinchilla's 32000 / 16 = 2000) XLA:TPU writes as an all-reduce of a zero-filled
    copy of the whole row, one more all-reduce per distribution than XLA:CPU (docs/pods.md)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    spec = logical_to_spec(names, x.shape, mesh)
    *lead, split = spec  # a mesh axis name (RULES maps each logical name to one) or None
    m = mesh.shape[split] if split else 1
    if m == 1:
        return jax.lax.with_sharding_constraint(x, P(*lead, None))
    width = x.shape[-1] // m
    shards = jax.lax.with_sharding_constraint(x, spec).reshape(*x.shape[:-1], m, width)
    shards = jax.lax.with_sharding_constraint(shards, P(*lead, split, None))
    shards = jnp.pad(shards, [(0, 0)] * (shards.ndim - 1) + [(0, -width % LANES)])
    shards = jax.lax.with_sharding_constraint(shards, P(*lead, split, None))
    gathered = jax.lax.with_sharding_constraint(shards, P(*lead, None, None))
    return gathered[..., :width].reshape(x.shape)
