"""A Chinchilla-style decoder-only transformer in Flax NNX.

Pre-RMSNorm blocks, multi-head attention with `num_kv_heads` (MHA/GQA/MQA), GELU,
SwiGLU or GeGLU feed-forward, rotary or Transformer-XL relative positions, and the
switches the model families of `weights/arch/` set (qkv biases, q/k norms, norms after
each sublayer, Gemma's 1 + w norm weight, sliding-window layers with their own rotary
base, the query scale, the embedding scale). Every parameter
carries logical axis names (`logical=` metadata) that `sharding.RULES` maps to the mesh.

ONE forward serves prefill of ragged prompts, one-token decode, scoring of K+1 tokens
and scoring of a tree of draft chains: `forward(tokens[B,T], positions[B,T], cache,
visible) -> (logits[B,T,V] float32, kv_cache.Fresh)`. Every query attends, in ONE
softmax, to the row's cache entries before the pass (below its length) and to the
pass's own keys that `visible` [T, T] allows: the causal triangle by default (a chain,
a prefill), a tree's ancestors when several draft chains share positions. The pass's
keys and values come back in `Fresh` and nothing is written: `kv_cache.commit` writes
a chain's T entries or a tree's kept path. A chain is a tree of one.

Letters: B batch, T query, S key/cache, N heads, G kv heads (groups of query heads),
R = N // G query heads per kv head, H head dim,
D model, F ffw, V vocab, L layers.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import kv_cache, kv_heads, sharding
from specjax.config import QUANTIZATIONS, ModelConfig
from specjax.kernels import (DEFAULT as DEFAULT_KERNELS, QUANTIZED, Kernels, Packed, dispatch, pack_params, project,
                             quantize_params, rows, should_pack)
from specjax.kv_cache import CACHE_AXES, Fresh, KVCache

MASKED = -1e30


class Keys:
    """A fresh key per parameter (fold_in of a counter) from a seed or a key. Cheaper to
    trace than nnx.Rngs, whose per-call state update made tracing a deep model's init
    quadratic in L (benchmarks/micro.md)."""

    def __init__(self, seed: int | jax.Array):
        self.base = seed if isinstance(seed, jax.Array) else jax.random.key(seed)
        self.count = 0

    def __call__(self) -> jax.Array:
        self.count += 1
        return jax.random.fold_in(self.base, self.count)


def _param(keys: Keys, shape, logical, std, dtype) -> nnx.Param:
    value = std * jax.random.normal(keys(), shape, jnp.float32)
    return nnx.Param(value.astype(dtype), logical=logical)


def _heads_major(keys: Keys, D: int, heads: int, H: int, logical: str, dtype) -> nnx.Param:
    """A q/k/v projection [heads, D, H] (the values a [D, heads, H] draw gives, so a seed
    makes the same model in either layout). Heads-major is the shape both a one-token step
    and a pass over several tokens read as they are: XLA:TPU copied a [D, heads, H] weight
    into [heads, D, H] order before every multi-token pass (SpS's scoring and draft loops)."""
    value = D ** -0.5 * jax.random.normal(keys(), (D, heads, H), jnp.float32)
    return nnx.Param(value.transpose(1, 0, 2).astype(dtype), logical=(logical, "embed", "head_dim"))


def _ones(shape, logical, dtype) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, dtype), logical=logical)


class RMSNorm(nnx.Module):
    """x / rms(x) times (cfg.norm_offset + scale) over the last axis (of size d_model, or
    head_dim for the q/k norms). The scale starts where the product is 1."""

    def __init__(self, cfg: ModelConfig, size: int | None = None, logical=("embed",)):
        size = cfg.d_model if size is None else size
        self.scale = nnx.Param(jnp.full((size,), 1.0 - cfg.norm_offset, cfg.param_dtype), logical=logical)
        self.eps = cfg.norm_eps
        self.offset = cfg.norm_offset
        self.weight_after_cast = cfg.norm_weight_after_cast

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.weight_after_cast:
            return y.astype(x.dtype) * (self.scale.value.astype(x.dtype) + self.offset)
        return (y * (self.scale.value.astype(jnp.float32) + self.offset)).astype(x.dtype)


def rope_frequencies(cfg: ModelConfig, local: bool = False) -> np.ndarray:
    """The H/2 rotary frequencies theta^(-i/(H/2)), float32, with Llama 3.1's scaling
    when cfg.rope_scaling == 'llama3': wavelengths longer than original_max_len /
    low_freq_factor are stretched by the factor, shorter than original_max_len /
    high_freq_factor kept, and the band between blends the two; all divided by the factor
    for 'linear'. `local`: the sliding layers' frequencies (`local_rope_theta`, unscaled,
    where set). Computed in float64 on the host: a constant of the compiled program."""
    half = cfg.head_dim // 2
    if local and cfg.local_rope_theta:
        return (cfg.local_rope_theta ** (-np.arange(half, dtype=np.float64) / half)).astype(np.float32)
    inv = cfg.rope_theta ** (-np.arange(half, dtype=np.float64) / half)
    if cfg.rope_scaling == "linear":
        inv = inv / cfg.rope_scaling_factor
    if cfg.rope_scaling == "llama3":
        factor, low, high, old = (cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                                  cfg.rope_original_max_len)
        wavelen = 2 * np.pi / inv
        smooth = (old / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv / factor + smooth * inv
        inv = np.where(wavelen > old / low, inv / factor, np.where(wavelen < old / high, inv, blended))
    return inv.astype(np.float32)


ROPE_TABLE_LIMIT = 1 << 18  # entries per rotary table (1 MiB of float32): past it, sin and cos are evaluated


@functools.lru_cache(maxsize=16)
def rope_tables(cfg: ModelConfig, local: bool = False) -> tuple[np.ndarray, np.ndarray] | None:
    """(cos, sin) of position * frequency for every position below max_seq_len,
    [max_seq_len, H/2] float32: the angle rounded to float32 as the on-device product
    is, its cos and sin taken in float64. None where a table would pass
    ROPE_TABLE_LIMIT entries (a long-context model). A lookup costs less than sin and cos
    on CPU, where XLA evaluates them per element inside every q and k consumer, 12 times a
    forward for a 6-layer model, even when written once (benchmarks/kernels.md)."""
    half = cfg.head_dim // 2
    if cfg.max_seq_len * half > ROPE_TABLE_LIMIT:
        return None
    angles = (np.arange(cfg.max_seq_len, dtype=np.float32)[:, None]
              * rope_frequencies(cfg, local)[None]).astype(np.float64)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def rope_angles(cfg: ModelConfig, positions, local=False) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) [B,T,1,H/2] at `positions` [B,T]: from `rope_tables`, or evaluated. A
    position past the table (a scored slot past the token budget, whose output is never
    kept) reads its last row. `local`: of the sliding layers (a bool, or traced under a
    scan over layers: both are computed and one is selected)."""
    if not cfg.local_rope_theta or local is False:
        local = False
    elif local is not True:  # traced
        pairs = [rope_angles(cfg, positions, flag) for flag in (False, True)]
        return tuple(jnp.where(local, b, a) for a, b in zip(*pairs))
    tables = rope_tables(cfg, local)
    if tables is None:
        angles = positions.astype(jnp.float32)[:, :, None, None] * jnp.asarray(rope_frequencies(cfg, local))
        return jnp.cos(angles), jnp.sin(angles)
    return tuple(jnp.take(jnp.asarray(t), positions, axis=0, mode="clip")[:, :, None] for t in tables)


def layer_window(cfg: ModelConfig, layer):
    """Layer `layer`'s sliding window (0: none), a Python int for an int layer, traced
    int32 for a traced one (a scan over layers); with it, whether it is a sliding layer."""
    if not cfg.sliding_window:
        return 0, False
    if isinstance(layer, int):
        local = cfg.sliding(layer)
        return (cfg.sliding_window if local else 0), local
    local = jnp.asarray([cfg.sliding(i) for i in range(cfg.num_layers)])[layer]
    return jnp.where(local, cfg.sliding_window, 0).astype(jnp.int32), local


def rotary(x, cos, sin):
    """Rotate pairs (x[..., :H/2], x[..., H/2:]) by the angles whose cos and sin are given
    (`rope_angles`), the layout transformers' Llama uses too (rotate_half). x: [B,T,N,H]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def sinusoid(distances, dim):
    """Transformer-XL's relative position embedding R_{i-j}: [..., dim] for integer distances."""
    half = dim // 2
    inv = 1.0 / (10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
    angles = distances.astype(jnp.float32)[..., None] * inv
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


def position_table(wr, size: int, dtype):
    """W_r R_{S-1-r} for r = 0..S-1: [N, S, H] from one layer's W_r [D, N, H], distances
    in reverse order so that `relative_shift` is one slice per query.

    Terms (b) + (d) of Dai et al. 2019, eq. 4 are (q_i + v) . W_r R_{i-j}, and W_r R
    depends only on the weights and S: built once per program (at prefill), a step reads
    N/m x S x H of it per layer and device (m = 'model' shards). The alternatives read
    more per step: projecting (q_i + v) W_r^T reads W_r itself (D x N/m x H, more while
    S < D) and then an [S, D] sinusoid table that every device holds whole; rotating by
    sin((i-j)w) = sin(iw)cos(jw) - cos(iw)sin(jw) drops the shift, not those reads."""
    rel = sinusoid(jnp.arange(size - 1, -1, -1), wr.shape[0]).astype(dtype)  # [S, D]
    return jnp.einsum("SD,DNH->NSH", rel, wr.astype(dtype), preferred_element_type=jnp.float32).astype(dtype)


def relative_shift(by_reversed, positions):
    """by_reversed[b, ..., t, r] scores distance S-1-r; returns [b, ..., t, j], the score at
    distance positions[b, t] - j for keys j <= positions[b, t] (entries for later keys
    are zeros or left-overs, masked by the caller).

    One contiguous S-wide slice per (row, query), at each query's own position (ragged
    rows): no [B, N, T, S] index tensor and no element-by-element gather."""
    S = by_reversed.shape[-1]
    padded = jnp.concatenate([by_reversed, jnp.zeros_like(by_reversed)], axis=-1)

    def query(x, position):  # x [..., 2S] of one (row, query)
        return jax.lax.dynamic_slice_in_dim(x, S - 1 - position, S, axis=-1)

    def row(x, pos):  # x [..., T, 2S], pos [T]
        return jax.vmap(query, in_axes=(-2, 0), out_axes=-2)(x, pos)

    return jax.vmap(row)(padded, positions)


def project_heads(x: jax.Array, w, kernels: Kernels, dtype) -> jax.Array:
    """x [B, T, D] @ a heads-major w [N, D, H] -> [B, T, N, H]. A format (packed, quantized)
    picks its kernel (`project`); a plain array is one dot batched over the heads, which
    reads each head's [D, H] as stored: as an einsum "BTD,NDH->BTNH", XLA:CPU copied the
    whole weight into [D, N, H] order at every call."""
    if hasattr(w, "project"):
        return project("BTD,NDH->BTNH", x, w, kernels, dtype)
    w = w.astype(dtype)
    B, T, D = x.shape
    rows = jnp.broadcast_to(x.reshape(1, B * T, D), (w.shape[0], B * T, D))  # [N, B*T, D]: activations only
    y = jax.lax.dot_general(rows, w, (((2,), (1,)), ((0,), (0,))))
    return y.reshape(w.shape[0], B, T, -1).transpose(1, 2, 0, 3)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, keys: Keys, out_std: float):
        D, N, G, H, dt = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.param_dtype
        self.cfg = cfg
        self.wq = _heads_major(keys, D, N, H, "heads", dt)
        self.wk = _heads_major(keys, D, G, H, "kv_heads", dt)
        self.wv = _heads_major(keys, D, G, H, "kv_heads", dt)
        self.wo = _param(keys, (N, H, D), ("heads", "head_dim", "embed"), out_std, dt)
        if cfg.qkv_bias:
            self.bq = nnx.Param(jnp.zeros((N, H), dt), logical=("heads", "head_dim"))
            self.bk = nnx.Param(jnp.zeros((G, H), dt), logical=("kv_heads", "head_dim"))
            self.bv = nnx.Param(jnp.zeros((G, H), dt), logical=("kv_heads", "head_dim"))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg, H, ("head_dim",))
            self.k_norm = RMSNorm(cfg, H, ("head_dim",))
        if cfg.pos_encoding == "relative":
            # Transformer-XL (Dai et al. 2019, eq. 4): W_r projects R_{i-j}; u, v are the
            # content and position biases shared across positions.
            self.wr = _param(keys, (D, N, H), ("embed", "heads", "head_dim"), D ** -0.5, dt)
            self.u = nnx.Param(jnp.zeros((N, H), dt), logical=("heads", "head_dim"))
            self.v = nnx.Param(jnp.zeros((N, H), dt), logical=("heads", "head_dim"))

    def __call__(self, x, positions, k_all, v_all, table, layer, limit, visible, kernels: Kernels, prior=None):
        """x [B,T,D] -> (out [B,T,D], k, v): `attend` over the stacked cache k_all/v_all
        [L,B,G,S,H] (layer `layer`, read only) and this pass's keys, after `prior`'s (this
        layer's (k, v [B,U,G,H], positions [B,U]) of earlier passes that no cache holds, or
        None); table: the stacked position table [L,N,S,H] (relative positions) or None.
        k, v [B,T,G,H] are the pass's own keys/values (the caller commits them)."""
        cfg = self.cfg
        ct = jnp.dtype(cfg.compute_dtype)
        q, k, v = (project_heads(x, w.value, kernels, ct) for w in (self.wq, self.wk, self.wv))
        if cfg.qkv_bias:
            q, k, v = (a + b.value.astype(ct) for a, b in ((q, self.bq), (k, self.bk), (v, self.bv)))
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        window, local = layer_window(cfg, layer)
        if cfg.pos_encoding == "rope":
            cos, sin = rope_angles(cfg, positions, local)
            q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        # Under MQA/GQA with fewer kv heads than 'model' devices the cache is replicated:
        # every device computes the (small) k, v itself instead of gathering them.
        k = sharding.constrain(k, ("batch", None, "kv_heads", "head_dim"))
        v = sharding.constrain(v, ("batch", None, "kv_heads", "head_dim"))
        # Pinned as the commit writes it: left free, XLA:CPU resharded the loop-carried cache
        # over the query-head groups and gathered it back whole in the commit.
        k_all = sharding.constrain(k_all, CACHE_AXES)
        v_all = sharding.constrain(v_all, CACHE_AXES)
        own_k, own_v, key_positions = k, v, positions
        if prior is not None:
            prior_k, prior_v, prior_positions = prior
            own_k = jnp.concatenate([prior_k.astype(k.dtype), k], axis=1)
            own_v = jnp.concatenate([prior_v.astype(v.dtype), v], axis=1)
            key_positions = jnp.concatenate([prior_positions, positions], axis=1)
        out = self.attend(q, own_k, own_v, k_all, v_all, table, layer, positions, key_positions, limit, visible,
                          kernels, window)
        return self.project_out(out, kernels), k, v

    def project_out(self, out, kernels: Kernels):
        """[B,T,N*H] -> [B,T,D]. One [N*H, D] contraction: as "BTNH,NHD" XLA:CPU transposed
        wo (a weight copy per step)."""
        wo = self.wo.value.reshape(out.shape[-1], -1)
        return project("BTF,FD->BTD", out, wo, kernels, jnp.dtype(self.cfg.compute_dtype))

    def attend(self, q, k, v, k_all, v_all, table, layer, positions, key_positions, limit, visible,
               kernels: Kernels, window=0):
        """THE attention -> [B,T,N*H]: one softmax per query over the row's cache entries
        below limit[b] (or, `limit` a bool [T, S], the entries s with limit[t, s]) and the own
        keys k, v [B,U,G,H] (at `key_positions` [B,U]: the pass's, after any earlier passes'
        that no cache holds) u with visible[t, u] ([T,U], or [B,T,U] where each row's tree
        differs), with the content and position terms of a plain forward over the query's
        own path (a key's distance is the difference of the positions: rotary has it in k;
        Transformer-XL's term reads the cache part through the precomputed table and
        `relative_shift`, the own part at the position differences). A sliding layer
        (`window` > 0, an int or traced) also masks every key `window` or more positions
        before the query (cache slot s holds position s). On one CPU device and for rotary
        positions `cached_attention.cc` computes it; `reference` (jnp) elsewhere and for
        gradients."""
        cfg = self.cfg
        ct = jnp.dtype(cfg.compute_dtype)
        B, T, N, H = q.shape
        U = k.shape[1]
        visible = jnp.asarray(visible, bool)
        seen = visible[:, None, None] if visible.ndim == 3 else visible[None, None, None]  # [B|1,1,1,T,U]
        S, G = k_all.shape[3], cfg.num_kv_heads
        R = N // G
        scale = H ** -0.5 if cfg.query_scale is None else cfg.query_scale

        def reference(q, k, v, k_all, v_all):
            k_cache, v_cache = k_all[layer].astype(ct), v_all[layer].astype(ct)
            qc = q + self.u.value.astype(ct) if cfg.pos_encoding == "relative" else q
            qc = qc.reshape(B, T, G, R, H)
            f32 = dict(preferred_element_type=jnp.float32)
            cached = jnp.einsum("BTGRH,BGSH->BGRTS", qc, k_cache, **f32)
            own = jnp.einsum("BTGRH,BUGH->BGRTU", qc, k.astype(ct), **f32)
            if cfg.pos_encoding == "relative":
                # (q_i + v) . W_r R_{i-j}: every distance scored once against the table, then
                # each query's scores shifted to its own position (cache) or read at the
                # position difference (own keys).
                width = table.shape[2]
                qr = (q + self.v.value.astype(ct)).reshape(B, T, G, R, H)
                by_reversed = jnp.einsum("BTGRH,GRSH->BGRTS", qr, table[layer].reshape(G, R, width, H), **f32)
                if S:
                    cached = cached + relative_shift(by_reversed, positions)[..., :S]
                distance = jnp.clip(positions[:, :, None] - key_positions[:, None, :], 0, width - 1)  # [B,T,U]
                index = jnp.broadcast_to((width - 1 - distance)[:, None, None], (B, G, R, T, U))
                own = own + jnp.take_along_axis(by_reversed, index, axis=-1)
            if limit.dtype == bool:  # the caller's [T, S] visibility of the cache (an EAGLE training-time test)
                cached_seen = limit[None, None, None]
            else:  # [B,S]: the same for every query of a row
                cached_seen = (jnp.arange(S)[None, :] < limit[:, None])[:, None, None, None]
            own_seen = seen
            if not isinstance(window, int) or window:
                reach = jnp.where(window > 0, window, jnp.iinfo(jnp.int32).max)  # 0 (traced): no window
                near = lambda d: (d < reach)[:, None, None]  # noqa: E731 ([B, T, keys] -> [B, 1, 1, T, keys])
                cached_seen = cached_seen & near(positions[:, :, None] - jnp.arange(S)[None, None])
                own_seen = own_seen & near(positions[:, :, None] - key_positions[:, None, :])
            cached = jnp.where(cached_seen, cached, MASKED)
            own = jnp.where(own_seen, own, MASKED)
            weights = jax.nn.softmax(jnp.concatenate([cached, own], axis=-1) * scale, axis=-1).astype(ct)
            out = (jnp.einsum("BGRTS,BGSH->BTGRH", weights[..., :S], v_cache)
                   + jnp.einsum("BGRTU,BUGH->BTGRH", weights[..., S:], v.astype(ct)))
            return out.reshape(B, T, N, H)

        if cfg.pos_encoding != "relative" and limit.dtype != bool and dispatch.use_attention(q, k_all, kernels):
            # Reads this layer of the cache in place (XLA copies each layer's slice per step).
            out = dispatch.attention(q, k, v, k_all, v_all, layer, limit, visible, scale, reference, key_positions,
                                     window)
        else:
            out = reference(q, k, v, k_all, v_all)
        return out.reshape(B, T, N * H)


class FeedForward(nnx.Module):
    def __init__(self, cfg: ModelConfig, keys: Keys, out_std: float):
        D, F, dt = cfg.d_model, cfg.d_ff, cfg.param_dtype
        self.cfg = cfg
        self.w_in = _param(keys, (D, F), ("embed", "mlp"), D ** -0.5, dt)
        if cfg.ffw != "gelu":  # gated: SwiGLU, GeGLU
            self.w_gate = _param(keys, (D, F), ("embed", "mlp"), D ** -0.5, dt)
        self.w_out = _param(keys, (F, D), ("mlp", "embed"), out_std, dt)

    def __call__(self, x, kernels: Kernels):
        ct = jnp.dtype(self.cfg.compute_dtype)
        h = project("BTD,DF->BTF", x, self.w_in.value, kernels, ct)
        if self.cfg.ffw == "gelu":
            h = jax.nn.gelu(h)  # tanh approximation (approximate=True)
        else:
            gate = project("BTD,DF->BTF", x, self.w_gate.value, kernels, ct)
            h = (jax.nn.silu(gate) if self.cfg.ffw == "swiglu" else jax.nn.gelu(gate, approximate=True)) * h
        return project("BTF,FD->BTD", h, self.w_out.value, kernels, ct)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, keys: Keys):
        out_std = cfg.d_model ** -0.5 / math.sqrt(2 * cfg.num_layers)
        self.cfg = cfg
        self.attn_norm = RMSNorm(cfg)
        self.attn = Attention(cfg, keys, out_std)
        self.ffw_norm = RMSNorm(cfg)
        self.ffw = FeedForward(cfg, keys, out_std)
        if cfg.post_norms:
            self.attn_post_norm = RMSNorm(cfg)
            self.ffw_post_norm = RMSNorm(cfg)

    def __call__(self, x, positions, k_all, v_all, table, layer, limit, visible, kernels: Kernels, prior=None):
        h, k, v = self.attn(self.attn_norm(x), positions, k_all, v_all, table, layer, limit, visible, kernels, prior)
        x = x + (self.attn_post_norm(h) if self.cfg.post_norms else h)
        h = self.ffw(self.ffw_norm(x), kernels)
        x = x + (self.ffw_post_norm(h) if self.cfg.post_norms else h)
        return x, k, v


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, keys: Keys):
        D, V, dt = cfg.d_model, cfg.vocab_size, cfg.param_dtype
        self.cfg = cfg
        self.embed = _param(keys, (V, D), ("vocab", "embed"), 1.0, dt)
        # One Block's init under vmap over per-layer keys: the init program holds one set
        # of normal() calls whatever the depth (80 unrolled copies made a huge program and
        # a long TPU compile). Both layouts come from the same stacked params, so scanned
        # and unrolled layers compute the same model.
        graphdef = nnx.split(nnx.eval_shape(lambda: Block(cfg, Keys(0))))[0]
        stacked = jax.vmap(lambda key: nnx.split(Block(cfg, Keys(key)))[1])(
            jax.random.split(keys(), cfg.num_layers))
        if cfg.scan_layers:  # one Block whose params carry a leading layer axis
            self.layers = nnx.merge(graphdef, stacked)
        else:
            self.layers = nnx.List([nnx.merge(graphdef, jax.tree.map(lambda x, i=i: x[i], stacked))
                                    for i in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg)
        if not cfg.tie_embeddings:
            self.unembed = _param(keys, (D, V), ("embed", "vocab"), D ** -0.5, dt)
        if cfg.parallel_draft:  # made last: the other params are those of the same model without it
            self.mask_embed = _param(keys, (D,), ("embed",), 1.0, dt)

    def position_table(self, size: int) -> jax.Array | None:
        """Every layer's W_r R for a cache of `size` slots, [L, N, S, H] sharded over heads
        (None without relative positions)."""
        cfg = self.cfg
        if cfg.pos_encoding != "relative":
            return None
        ct = jnp.dtype(cfg.compute_dtype)
        if cfg.scan_layers:  # one layer at a time: no [L, ...] float32 temporaries
            # A self-draft's stack holds more layers than it runs: the table (made once per
            # prefill) is of its own layers only.
            wr = self.layers.attn.wr.value[:cfg.num_layers]
            table = jax.lax.map(lambda wr: position_table(wr, size, ct), wr)
        else:
            table = jnp.stack([position_table(block.attn.wr.value, size, ct) for block in self.layers])
        return sharding.constrain(table, kv_cache.TABLE_AXES)

    def logits(self, x, kernels: Kernels = DEFAULT_KERNELS) -> jax.Array:
        """Final hidden states [B, T, D] -> logits [B, T, V] float32: the unembedding
        (which draft heads over the target share: `specjax.heads`)."""
        # A tied table is stored [V, D]; packed for decoding, it holds panels of its transpose
        # (`Packed.T`), as XLA:CPU's dot against its transpose at 2-7 rows ran at a fraction
        # of the read rate.
        table = self.embed.value.T if self.cfg.tie_embeddings else self.unembed.value
        logits = project("BTD,DV->BTV", x, table, kernels, jnp.dtype(self.cfg.compute_dtype),
                         preferred_element_type=jnp.float32)
        # Pinned vocab-parallel (Megatron): otherwise a consumer that wants whole rows (the
        # sampler) can make XLA gather the [D, V] table instead of the small logits.
        return sharding.constrain(logits, ("batch", None, "vocab"))

    def embed_tokens(self, tokens, table=None) -> jax.Array:
        """Token ids [B, T] -> input embeddings [B, T, D] (which EAGLE's layer shares); with
        `table` (`whole_table`'s copy of this table) a local gather from it."""
        cfg = self.cfg
        ct = jnp.dtype(cfg.compute_dtype)
        mesh = jax.sharding.get_abstract_mesh()
        masked = tokens == mask_id(cfg) if cfg.parallel_draft else None
        if masked is not None:  # PARD's mask token: an input row of its own, never an output
            tokens = jnp.where(masked, 0, tokens)
        if table is not None:
            x = rows(table, tokens, ct)
        elif not mesh.empty and mesh.shape.get("model", 1) > 1:
            x = vocab_parallel_rows(self.embed.value, tokens, ct, mesh)
        else:  # one device holds the table: a gather costs B*T*D, not B*T*V*D
            x = rows(self.embed.value, tokens, ct)
        if masked is not None:
            x = jnp.where(masked[..., None], self.mask_embed.value.astype(ct), x)
        if cfg.input_embedding_scale != 1.0:
            x = x * cfg.input_embedding_scale
        return x

    def __call__(self, tokens, positions, cache: KVCache, visible=None, kernels: Kernels = DEFAULT_KERNELS,
                 features: bool | tuple[int, ...] = False, prior: kv_cache.Prior | None = None):
        """-> (logits [B,T,V] float32, Fresh): the module docstring's forward. `visible`: a
        [T, T] mask of the pass's own keys each query sees, or [B, T, T] where each row's
        tree differs (None: causal); `features`: also return in Fresh.hidden the final
        hidden states (True), or (a tuple of layer counts n in 1..L) the residual stream
        after the first n layers for each n, concatenated [B, T, len * D] (EAGLE-3's low,
        middle and high features; n = L is the last layer's output before the final norm).
        A static choice: False costs nothing. `prior`: keys and values of earlier passes
        that no cache holds (a draft tree's earlier rounds, `kv_cache.Prior`), seen before
        the pass's own: `visible` is then [.., T, U + T]. The cache is only read."""
        cfg = self.cfg
        T = tokens.shape[1]
        x = self.embed_tokens(tokens)
        if visible is None and prior is not None:
            raise ValueError("a pass over prior keys needs its visibility over them")
        visible = causal(T) if visible is None else jnp.asarray(visible, bool)
        layer_prior = (lambda i: None) if prior is None else (lambda i: (prior.k[i], prior.v[i], prior.positions))
        # The cache part: entries before the pass's first position that the row holds.
        limit = cache_limit(cache, positions)
        table = cache.position_table
        if table is None:  # no table carried (prefill, training): computed here, for the pass's distances too
            table = self.position_table(max(cache.size, T))
        args = (positions, cache.k, cache.v, table)
        taps = features if isinstance(features, tuple) else ()
        if cfg.scan_layers:
            graphdef, stacked = nnx.split(self.layers)

            def body(carry, layer_params):
                x, i = carry
                if layer_params is None:  # the first num_layers of a longer stack (a self-draft)
                    layer_params = jax.tree.map(lambda a: a[i], stacked)
                x, k, v = nnx.merge(graphdef, layer_params)(x, *args, i, limit, visible, kernels, layer_prior(i))
                return (x, i + 1), (k, v, x if taps else None)

            if stacked_layers(stacked) == cfg.num_layers:
                (x, _), (k, v, xs) = jax.lax.scan(body, (x, 0), stacked)
            else:
                # A model made of the first layers of another's stacked params
                # (`weights.self_draft`) indexes the stack in the loop, as scan over xs
                # does, rather than slicing it, which would copy those layers.
                (x, _), (k, v, xs) = jax.lax.scan(body, (x, 0), None, length=cfg.num_layers)
            tapped = {n: xs[n - 1] for n in taps}
        else:
            kv, tapped = [], {}
            for i, block in enumerate(self.layers):
                x, k, v = block(x, *args, i, limit, visible, kernels, layer_prior(i))
                kv.append((k, v))
                if i + 1 in taps:
                    tapped[i + 1] = x
            k, v = (jnp.stack(a) for a in zip(*kv))
        x = self.final_norm(x)
        logits = self.logits(x, kernels)
        k, v = ordered_after(k, v, x)
        hidden = jnp.concatenate([tapped[n] for n in taps], axis=-1) if taps else x if features else None
        # The hidden states stay whole rows (like the residual stream): a consumer that
        # wanted them split over 'model' would otherwise split the pass's own activations.
        return logits, Fresh(k, v, None if hidden is None else sharding.constrain(hidden, ("batch", None, "embed")))


def mask_id(cfg: ModelConfig) -> int:
    """The mask token of a parallel draft model (`ModelConfig.parallel_draft`): the id
    past its vocabulary, embedded by its own row and never predicted."""
    return cfg.vocab_size


def vocab_parallel_rows(table, tokens: jax.Array, dtype, mesh) -> jax.Array:
    """Rows `tokens` [B, T] of a table split over 'model' by vocabulary (Megatron's
    vocab-parallel embedding): each shard reads the rows in its own range, zeros elsewhere,
    and one all-reduce sums them; the table is never gathered. As a one-hot contraction
    over the shard every forward read the whole shard (XLA:TPU: 125 MiB per chip and step
    for Llama-3.1-70B's table on 16 chips; for the tied 1B draft the table was read twice a
    step, as embedding and unembedding: docs/pods.md)."""
    batch = sharding.logical_to_spec(("batch", None), tokens.shape, mesh)

    def local(shard, ids):
        size = jax.tree.leaves(shard)[0].shape[0]
        first = jax.lax.axis_index("model") * size
        here = (ids >= first) & (ids < first + size)
        x = rows(shard, jnp.where(here, ids - first, 0), dtype)
        return jax.lax.psum(jnp.where(here[..., None], x, jnp.zeros((), dtype)), "model")
    return jax.shard_map(local, mesh=mesh, in_specs=(jax.sharding.PartitionSpec("model"), batch),
                         out_specs=jax.sharding.PartitionSpec(*batch, None))(table, tokens)


def cache_limit(cache: KVCache, positions: jax.Array) -> jax.Array:
    """[B] the cache entries a pass at `positions` reads: those before its first position
    that the row holds."""
    return jnp.clip(jnp.minimum(cache.lengths, positions[:, 0]), 0, cache.size).astype(jnp.int32)


def ordered_after(k: jax.Array, v: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A pass's keys/values [L, B, T, G, H] tied by a zero term to its final hidden states
    x [B, T, D], which depend on every layer's read of the cache, so a commit that writes
    them into the cache is ordered after those reads and done in place. Untied, XLA copied
    the loop-carried cache every step to keep the reads safe (an optimization barrier did
    not order them on XLA:CPU). Per row: no collective; a row whose state is not finite stops."""
    tie = 0 * jnp.sum(x, axis=(1, 2)).astype(k.dtype)[None, :, None, None, None]
    return tuple(sharding.constrain(a + tie, kv_cache.FRESH_AXES) for a in (k, v))


def stacked_layers(stacked) -> int:
    """The leading (layer) axis of stacked params: a scanned model's num_layers, or more
    where a self-draft runs the first layers of its target's stack."""
    return jax.tree.leaves(stacked)[0].shape[0]


def causal(size: int) -> jax.Array:
    """[T, T] True where key u is at or before query t: a chain's (or prefill's) visibility
    of its own keys (built from iotas: no [T, T] constant in the program)."""
    return jnp.arange(size)[:, None] >= jnp.arange(size)[None, :]


# --------------------------------------------------------------------------- LM handle

# The weights the few-row kernel multiplies by: name -> (contracted axes, axes of one
# layer's weight[, heads: its leading axes that are output axes]): q, k and v are
# heads-major [N, D, H] (`_heads_major`), the contracted axis after the heads.
PROJECTIONS = {"wq": (1, 3, 1), "wk": (1, 3, 1), "wv": (1, 3, 1), "wo": (2, 3), "w_in": (1, 2), "w_gate": (1, 2),
               "w_out": (1, 2), "unembed": (1, 2)}


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class LM:
    """A model as the loops see it: static config, graph and kernel setting, and the
    (sharded) params.

    A pytree whose only leaves are the params, so it can be passed into `jax.jit`; the
    `kernels` setting is static data, so each setting traces its own program."""

    cfg: ModelConfig
    graphdef: Any
    params: Any
    kernels: Kernels = DEFAULT_KERNELS

    def __call__(self, tokens, positions, cache: KVCache, visible=None, features: bool | tuple[int, ...] = False,
                 prior: kv_cache.Prior | None = None):
        return nnx.merge(self.graphdef, self.params)(tokens, positions, cache, visible, self.kernels, features, prior)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Final hidden states [B, T, D] (Fresh.hidden) -> logits [B, T, V]: the unembedding alone."""
        return nnx.merge(self.graphdef, self.params).logits(hidden, self.kernels)

    def final_norm(self, x: jax.Array) -> jax.Array:
        """The last layer's output [B, T, D] -> the final hidden states `logits` reads."""
        return nnx.merge(self.graphdef, self.params).final_norm(x)

    def embed(self, tokens: jax.Array, table=None) -> jax.Array:
        """Token ids [B, T] -> input embeddings [B, T, D]: the embedding alone (read from
        `table`, `whole_table(self)`, where given)."""
        return nnx.merge(self.graphdef, self.params).embed_tokens(tokens, table)

    def extend(self, tokens, positions, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """A chain pass written into the cache: the forward, then `kv_cache.commit` of its
        T entries at positions[:, 0].. (a prefill, a decode step). -> (logits, cache)."""
        logits, fresh = self(tokens, positions, cache)
        return logits, kv_cache.commit(cache, fresh, positions[:, 0])

    def with_position_table(self, cache: KVCache) -> KVCache:
        """`cache` holding this model's position table (for relative positions: what every
        forward over it reads), for loops that start from `kv_cache.init_cache`."""
        table = nnx.merge(self.graphdef, self.params).position_table(cache.size)
        return cache if table is None else dataclasses.replace(cache, position_table=table)

    def tree_flatten(self):
        return (self.params,), (self.cfg, self.graphdef, self.kernels)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(aux[0], aux[1], children[0], aux[2])

    @property
    def num_params(self) -> int:
        """The weights' count as the model defines them (a quantized or packed weight counts
        its logical shape, not its codes, scales or panels)."""
        formats = lambda x: isinstance(x, (Packed, *QUANTIZED))  # noqa: E731
        return sum(math.prod(x.plain.shape if isinstance(x, Packed) else x.shape)
                   for x in jax.tree.leaves(self.params, is_leaf=formats))

    def with_kernels(self, kernels: Kernels) -> LM:
        """This model under another kernel setting (a packed copy already made is shared)."""
        out = dataclasses.replace(self, kernels=kernels)
        made = self.__dict__.get("_packed")
        if made is not None:
            _remember(out, out if made is self else dataclasses.replace(made, kernels=kernels))
        return out

    def quantized(self, kind: str) -> LM:
        """This model with its weights quantized (`config.QUANTIZATIONS`; 'int8': `kernels.Int8`,
        symmetric per output column; 'int4': `kernels.Grouped` of 4 bits, a scale and minimum per output
        column and group of 32 inputs; 'w4a8' / 'w8a8': int4 / symmetric 8-bit groups (GGUF's
        Q8_0) multiplying activations rounded to int8 per group of 32, as llama.cpp does): every
        projection, the unembedding, and the embedding
        table (per row: a tied table is then the unembedding's quantization too, and the
        lookup dequantizes only the rows it reads). The norms, Transformer-XL's W_r and
        biases stay float. The result is a model of its own, the one that sampling from it
        (SpS included) samples exactly; `packed()` gives it the kernel's panels."""
        if kind not in QUANTIZATIONS:
            raise ValueError(f"quantization {kind!r}: not one of {', '.join(QUANTIZATIONS)}")
        names = {**PROJECTIONS, "embed": (1, 2)}
        return dataclasses.replace(self, params=quantize_params(self.params, names, ("embed",), kind))  # subclasses stay

    def packed(self) -> LM:
        """This model as decoding runs it: its projections packed for the CPU few-row kernel
        where that kernel runs under `self.kernels` (`kernels.should_pack`), else itself;
        the same function either way. The decode programs call it. The copy is made once
        and lives as long as this LM."""
        dtypes = (self.cfg.param_dtype, self.cfg.compute_dtype)
        made = self.__dict__.get("_packed")
        if made is not None:  # made: only whether the kernel runs now decides
            return made if should_pack(self.params, dtypes, self.kernels, new_copy=False) else self
        if not should_pack(self.params, dtypes, self.kernels):
            return self
        # A tied table is packed too (as its transpose, for the logits): it is read every step.
        tied = ("embed",) if self.cfg.tie_embeddings else ()
        projections = {**PROJECTIONS, **{name: (1, 2) for name in tied}}
        packed = dataclasses.replace(self, params=pack_params(self.params, projections, tied))  # subclasses stay
        _remember(self, packed)
        return packed


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class SelfDraft(LM):
    """A draft made of a target's own weights (`weights.self_draft`): its first N layers,
    and/or a quantized copy of them (the norms and Transformer-XL's W_r stay the target's
    float ones). Its keys and values over a prompt are then the target's first N layers'
    (exactly for layers:N; to rounding for a quantized copy), so a loop starts its cache
    from the target's prefilled one (`drafters.ModelDrafter`) instead of running a second
    prefill; a run of a target-sized quantized copy paid about one more prompt prefill
    for that. Sampling stays exact either way: p is whatever the draft computes from the
    cache it holds."""


def whole_table(lm: LM):
    """`lm`'s embedding table whole on every device of its mesh; None where its lookup needs
    no collective (one device, no 'model' split). For a loop that embeds tokens it drew
    itself (EAGLE, K times a loop): a gather from this copy is local, where the
    vocab-parallel lookup all-reduces [B, T, D] each time; it costs the table's V x D
    bytes per chip, less its own shard. Made once per LM (abstract for abstract params)."""
    if "_whole_table" in lm.__dict__:
        return lm.__dict__["_whole_table"]
    table = lm.params["embed"].value
    where = getattr(jax.tree.leaves(table)[0], "sharding", None)
    copy = None
    if isinstance(where, jax.sharding.NamedSharding) and where.mesh.shape.get("model", 1) > 1:
        everywhere = sharding.replicated(where.mesh)
        if isinstance(jax.tree.leaves(table)[0], jax.Array):
            copy = jax.jit(lambda t: t, out_shardings=everywhere)(table)
        else:  # `plan`'s abstract params
            copy = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=everywhere), table)
    object.__setattr__(lm, "_whole_table", copy)
    return copy


def _remember(lm: LM, packed: LM) -> None:
    object.__setattr__(packed, "_packed", packed)
    object.__setattr__(lm, "_packed", packed)


def abstract_lm(cfg: ModelConfig, mesh: jax.sharding.Mesh | None = None) -> LM:
    """Shapes (and shardings, given a mesh) of every param, without allocating any."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, Keys(cfg.init_seed))))
    if mesh is not None:
        state = sharding.with_shardings(state, sharding.param_shardings(state, mesh))
    return LM(cfg, graphdef, state)


def init_program(cfg: ModelConfig, mesh: jax.sharding.Mesh, seed: int | None = None):
    """(graphdef, the jitted random init `() -> params`), params created already sharded
    (out_shardings: no host copy). `plan` compiles the same function without running it.
    A config with duplicated kv heads (`kv_heads.for_mesh`) draws the original model's
    params (the same numbers as without duplication) and repeats its kv heads."""
    seed = cfg.init_seed if seed is None else seed
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, Keys(seed))))
    shardings = sharding.param_shardings(abstract, mesh)

    def init():
        state = nnx.split(Transformer(kv_heads.original(cfg), Keys(seed)))[1]
        return kv_heads.map_kv(state, lambda x, axis: kv_heads.repeat(x, cfg.kv_copies, axis))
    return graphdef, jax.jit(init, out_shardings=shardings)


def init_lm(cfg: ModelConfig, mesh: jax.sharding.Mesh, seed: int | None = None, *, duplicate_kv: bool = True) -> LM:
    """Random params created already sharded; with fewer kv heads than the 'model' axis,
    each is duplicated (`kv_heads`) unless duplicate_kv=False (training)."""
    cfg = kv_heads.for_mesh(cfg, mesh) if duplicate_kv else kv_heads.original(cfg)
    sharding.check_divisible(cfg, mesh)
    graphdef, init = _kept_init_program(cfg, mesh, cfg.init_seed if seed is None else seed)
    return LM(cfg, graphdef, init())


# A notebook, the tests and a bench sweep build the same random models again and again;
# each `init_program` is a fresh jit, traced and compiled anew (a second or two even for
# tiny). Keeping the last few per (config, mesh, seed) makes a repeat cost only the run.
_kept_init_program = functools.lru_cache(maxsize=16)(init_program)


def full_forward(lm: LM, tokens: jax.Array, features: bool | tuple[int, ...] = False):
    """Logits [B, T, V] of whole sequences through the same forward that sampling uses,
    over an empty cache (no slots: every position sees its own keys before it, causally):
    the training loss and the exact reference distributions both come from here. With
    `features` (True, or layer counts: the forward's): (logits, those hidden states)."""
    batch, length = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    logits, fresh = lm(tokens, positions, kv_cache.empty(lm.cfg, batch, 0), features=features)
    return (logits, fresh.hidden) if features else logits
