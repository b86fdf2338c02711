"""The KV cache: a pytree passed into the forward and returned, never module state.

k, v: [L, B, G, S, H] (layers, batch, kv_heads, cache_seq, head_dim); lengths: [B].
Heads before positions: a layer's slice [B, G, S, H] is already the layout both
attention dots contract over (with [.., S, K, ..] XLA:CPU transposed a copy of every
layer's keys and values on every step; BENCHMARKS.md, "Micro-benchmarks behind design choices").
A forward writes its T new entries at the rows' own positions; `lengths` says how many
entries of each row are valid. Rolling back rejected draft tokens is just setting
`lengths` (the stale entries beyond it are masked, and overwritten later).

Models with Transformer-XL relative positions also carry `position_table` [L, N, S, H]:
W_r R for every distance a query can see in S slots (`model.position_table`). It
depends only on the weights and S, so the first forward over an empty cache (the
prefill) computes it and every later step of the program reuses it.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax import sharding
from specjax.config import ModelConfig

CACHE_AXES = ("layers", "batch", "kv_heads", "cache_seq", "head_dim")
TABLE_AXES = ("layers", "heads", "cache_seq", "head_dim")
TREE_AXES = ("layers", "batch", None, "kv_heads", "head_dim")  # a tree pass's own keys/values [L, B, T, G, H]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: jax.Array
    v: jax.Array
    lengths: jax.Array  # int32 [B]
    position_table: jax.Array | None = None  # [L, N, S, H], relative positions only

    @property
    def size(self) -> int:
        return self.k.shape[3]

    def with_lengths(self, lengths: jax.Array) -> "KVCache":
        return dataclasses.replace(self, lengths=lengths.astype(jnp.int32))


def cache_shapes(cfg: ModelConfig, batch: int, size: int) -> KVCache:
    """ShapeDtypeStructs of a cache (for AOT compiles: nothing allocated)."""
    dtype = jnp.dtype(cfg.compute_dtype)
    kv = jax.ShapeDtypeStruct((cfg.num_layers, batch, cfg.num_kv_heads, size, cfg.head_dim), dtype)
    return KVCache(kv, kv, jax.ShapeDtypeStruct((batch,), jnp.int32))


def table_shape(cfg: ModelConfig, size: int, mesh: jax.sharding.Mesh | None = None) -> jax.ShapeDtypeStruct | None:
    """The position table's ShapeDtypeStruct (sharded over heads, given a mesh), or None
    without relative positions."""
    if cfg.pos_encoding != "relative":
        return None
    shape = (cfg.num_layers, cfg.num_heads, size, cfg.head_dim)
    return jax.ShapeDtypeStruct(shape, jnp.dtype(cfg.compute_dtype),
                                sharding=sharding.named(mesh, TABLE_AXES, shape) if mesh is not None else None)


def cache_shardings(cfg: ModelConfig, batch: int, size: int, mesh: jax.sharding.Mesh) -> KVCache:
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, size, cfg.head_dim)
    kv = sharding.named(mesh, CACHE_AXES, shape)
    return KVCache(kv, kv, sharding.named(mesh, ("batch",), (batch,)))


def empty(cfg: ModelConfig, batch: int, size: int) -> KVCache:
    """An empty cache inside a traced function, sharded by logical names on the mesh set
    with `jax.set_mesh` (a replicated MQA/GQA cache is pinned, not guessed)."""
    shapes = cache_shapes(cfg, batch, size)
    k = sharding.constrain(jnp.zeros(shapes.k.shape, shapes.k.dtype), CACHE_AXES)
    v = sharding.constrain(jnp.zeros(shapes.v.shape, shapes.v.dtype), CACHE_AXES)
    return KVCache(k, v, jnp.zeros((batch,), jnp.int32))


def init_cache(cfg: ModelConfig, batch: int, size: int, mesh: jax.sharding.Mesh | None = None) -> KVCache:
    """An empty cache as arrays, created directly with its sharding when a mesh is given."""
    if mesh is None:
        return empty(cfg, batch, size)
    return jax.jit(lambda: empty(cfg, batch, size), out_shardings=cache_shardings(cfg, batch, size, mesh))()


def commit(cache: KVCache, k_tree: jax.Array, v_tree: jax.Array, nodes: jax.Array, start: jax.Array) -> KVCache:
    """Write the tree nodes `nodes` [B, P] (a path: the pending token, then one chain's
    nodes) into every layer at consecutive positions start[b]..start[b]+P-1. One scatter
    of P entries per layer and row, in place; `lengths` is left to the caller's rollback."""
    batch, width = nodes.shape
    index = nodes[None, :, :, None, None]
    layers = jnp.arange(cache.k.shape[0])[:, None, None]
    rows = jnp.arange(batch)[None, :, None]
    positions = (start[:, None] + jnp.arange(width)[None, :])[None]

    def put(buf, tree):  # buf[l, b, :, start[b] + j] = tree[l, b, nodes[b, j]]
        path = jnp.take_along_axis(tree, index, axis=2).astype(buf.dtype)  # [L, B, P, G, H]
        return sharding.constrain(buf.at[layers, rows, :, positions].set(path, mode="drop"), CACHE_AXES)

    return dataclasses.replace(cache, k=put(cache.k, k_tree), v=put(cache.v, v_tree))
