"""The KV cache: a pytree passed into the forward and returned, never module state.

k, v: [L, B, G, S, H] (layers, batch, kv_heads, cache_seq, head_dim); lengths: [B].
Heads before positions: a layer's slice [B, G, S, H] is already the layout both
attention dots contract over (with [.., S, K, ..] XLA:CPU transposed a copy of every
layer's keys and values on every step; benchmarks/micro.md). On a TPU a head_dim under
the 128 lanes is stored positions-minor (`stored`): no lane padding, and the layout the
attention reads.
A forward reads the cache and returns its own T keys and values (`Fresh`); `commit`
writes them in, all T of a chain at consecutive positions or a tree's kept path, in
place (the cache is loop-carried; one block of T slots per row; a prefill's block, one
dynamic-update-slice). `lengths` says how many entries
of each row are valid. Rolling back rejected draft tokens is just setting `lengths` (the
stale entries beyond it are masked, and overwritten later).

Models with Transformer-XL relative positions also carry `position_table` [L, N, S, H]:
W_r R for every distance a query can see in S slots (`model.position_table`). It
depends only on the weights and S, so the first forward over an empty cache (the
prefill) computes it and every later step of the program reuses it.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.layout import Layout, with_layout_constraint

from specjax import sharding
from specjax.config import ModelConfig

CACHE_AXES = ("layers", "batch", "kv_heads", "cache_seq", "head_dim")
TABLE_AXES = ("layers", "heads", "cache_seq", "head_dim")
FRESH_AXES = ("layers", "batch", None, "kv_heads", "head_dim")  # a pass's own keys/values [L, B, T, G, H]


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
    k, v = (stored(jnp.zeros(s.shape, s.dtype)) for s in (shapes.k, shapes.v))
    return KVCache(k, v, jnp.zeros((batch,), jnp.int32))


def stored(buf: jax.Array) -> jax.Array:
    """A cache buffer [L, B, G, S, H] sharded by CACHE_AXES and, on a TPU (the mesh set
    with `jax.set_mesh`), held in one memory layout from its creation through every write:
    positions-minor (H in the sublanes, S in the lanes) for a head_dim under the 128 lanes,
    H-minor otherwise. With H minor a head_dim of 64 fills half of every lane tile
    (Llama-3.2-1B: 8 MiB of padding per chip for 4 MiB of keys), and XLA:TPU copied the
    cache positions-minor for every forward's attention, which reads it so. Pinned for
    every head_dim, since left to choose XLA takes the layout a write prefers (for
    `commit`'s [L, 1, G, T, H] blocks, the layers in the sublanes) and copies the cache
    back for each forward (Llama-3.1-70B's 80-layer cache: 2 x 40 MiB per chip). The
    constraint is placed on each device's shard: on the sharded array, XLA's partitioner
    gathered its operand (EAGLE's one-layer cache, twice a step)."""
    buf = sharding.constrain(buf, CACHE_AXES)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.abstract_device.platform != "tpu":
        return buf
    layout = Layout(major_to_minor=(0, 1, 2, 4, 3) if buf.shape[-1] < sharding.LANES else (0, 1, 2, 3, 4))
    return sharding.local(lambda shard: with_layout_constraint(shard, layout), (CACHE_AXES,), CACHE_AXES)(buf)


def init_cache(cfg: ModelConfig, batch: int, size: int, mesh: jax.sharding.Mesh | None = None) -> KVCache:
    """An empty cache as arrays, created directly with its sharding when a mesh is given."""
    if mesh is None:
        return empty(cfg, batch, size)
    return jax.jit(lambda: empty(cfg, batch, size), out_shardings=cache_shardings(cfg, batch, size, mesh))()


class Fresh(NamedTuple):
    """What one forward pass adds to the context: its keys and values for every layer,
    [L, B, T, G, H] (not yet in any cache: `commit` writes them), and, when the forward was
    asked for them, its final hidden states [B, T, D] (the features that heads such as
    Medusa or EAGLE read)."""

    k: jax.Array
    v: jax.Array
    hidden: jax.Array | None = None


class Prior(NamedTuple):
    """Keys and values that a pass attends to beside its own and that no cache holds: a
    draft tree's nodes from earlier rounds (`decode/growth.py`), [L, B, U, G, H], at
    `positions` [B, U]. Which of them each query sees is the pass's `visible`."""

    k: jax.Array
    v: jax.Array
    positions: jax.Array


def commit(cache: KVCache, fresh: Fresh, start: jax.Array | int, nodes: jax.Array | None = None) -> KVCache:
    """Write a pass's entries into every layer at consecutive positions start[b]..: all T
    of them in order (`nodes` None: a chain, a prefill), or the pass's nodes `nodes` [B, P]
    (a tree's kept path: the pending token, then one chain's nodes). One block of slots
    per row and buffer, in place; writes past the cache's end are dropped. `lengths`
    becomes start + P: the caller's rollback sets the accepted length. `start` the Python int 0 (a prefill:
    every row from slot 0) writes the block with one dynamic-update-slice instead of a
    scatter of L x B x T rows (which XLA:CPU expands into a loop over the rows)."""
    k, v = fresh.k, fresh.v
    if nodes is not None:
        index = nodes[None, :, :, None, None]
        k, v = (jnp.take_along_axis(a, index, axis=2) for a in (k, v))  # [L, B, P, G, H]
    batch, width = k.shape[1:3]
    if isinstance(start, int):
        if start != 0 or width > cache.size:
            raise ValueError(f"a dense commit writes slots 0..{width - 1} of a {cache.size}-slot cache (start=0)")

        def put(buf, new):  # buf[l, b, :, j] = new[l, b, j]; [L, B, T, G, H] -> the cache's [L, B, G, T, H]
            return jax.lax.dynamic_update_slice(buf, jnp.swapaxes(new, 2, 3).astype(buf.dtype), (0,) * buf.ndim)
    else:
        if width > cache.size:
            raise ValueError(f"a commit writes at most the cache's {cache.size} slots a row, got {width}")
        # Each row rewrites one block of `width` slots, placed to end inside the cache
        # (`corner`): its slots from start[b] get the pass's entries, those before keep
        # what they held, and entries past the end are dropped. One dynamic-update-slice
        # per row, on the device that holds the row (`sharding.local`): XLA:TPU writes it
        # in place in either layout of `stored`. (A scatter of single slots made XLA:TPU
        # copy a positions-minor cache to H-minor for it; a scatter of the rows' blocks,
        # at a batch over 1, copied the cache with its layers in the sublanes.)
        corner = jnp.clip(start, 0, cache.size - width)
        shift = corner - start  # <= 0: slot corner + j gets entry j + shift, none where that is negative

        def rows(buf, new, corner, shift):  # buf [L, b, G, S, H], new [L, b, T, G, H]: this device's rows
            new = jnp.swapaxes(new, 2, 3).astype(buf.dtype)  # [L, b, G, T, H]
            new = jnp.concatenate([jnp.zeros_like(new), new], axis=3)  # T unused slots, then the entries
            size = (buf.shape[0], 1, buf.shape[2], width, buf.shape[4])

            def one(b, buf):
                at = (0, b, 0, corner[b], 0)
                moved = jax.lax.dynamic_slice(new, (0, b, 0, width + shift[b], 0), size)
                kept = (jnp.arange(width) + shift[b] < 0)[:, None]
                return jax.lax.dynamic_update_slice(buf, jnp.where(kept, jax.lax.dynamic_slice(buf, at, size), moved), at)
            if buf.shape[1] == 1:  # one row a device (every batch-1 program): no loop at all
                return one(0, buf)
            # Rows in a loop, written in place in its carry. Unrolled, a row's read of its
            # old slots fused with the write of the row before it, and XLA:CPU copied the
            # cache to keep both alive (a grown tree's draft cache, 1x8); thousands of rows
            # (a statistical test's) also compiled for minutes.
            return jax.lax.fori_loop(0, buf.shape[1], one, buf)

        def put(buf, new):  # buf[l, b, :, start[b] + j] = new[l, b, j]
            return sharding.local(rows, (CACHE_AXES, FRESH_AXES, ("batch",), ("batch",)), CACHE_AXES)(
                buf, new, corner, shift)

    lengths = jnp.broadcast_to(start + width, (batch,)).astype(jnp.int32)
    k, v = (stored(put(buf, new)) for buf, new in ((cache.k, k), (cache.v, v)))
    return KVCache(k, v, lengths, cache.position_table)
