"""Speculative sampling (Chen et al. 2023, Algorithm 2), fused into one `lax.while_loop`.

Each loop, for every row at once (`speculate`):
  1. the drafter proposes M chains of up to K tokens x_1..x_K with the exact
     distributions p_j they were drawn from (`drafters`; M = 1 is the paper's one chain),
     or grows a tree of N nodes at most K deep (`growth`, `Settings.tree_nodes`);
  2. the target scores [pending, every proposed token] in ONE pass -> q at every node
     (`pass_width` 'proposed': one chain's pass as wide as the longest row's proposal);
     The proposal is one tree layout (`tree.Tree`: parents per node) whose nodes share
     the pending token and each see the cache and their own path; one chain is a tree
     of one, its causal pass;
  3. a verifier keeps a path and draws the next token (`verify`): the paper's token-wise
     rule, x_j kept with probability min(1, q_j(x_j) / p_j(x_j)) left to right and the
     first rejected one replaced by a sample from norm(max(0, q - p)), a bonus token from
     q_{K+1} when all are kept; block verification (the same outputs decided jointly);
     SpecInfer's multi-round rule over several chains or a grown tree;
  4. the pending token and the kept path's nodes are written into the target's cache
     (`kv_cache.commit`; past the kept ones they are masked by the rollback).
So each loop emits 1..K+1 tokens and (Theorem 1) the output is distributed exactly as q.
`speculate` is steps 1-4 for one loop (`api.explain_loop` shows them for the first loop);
`speculative_generate` wraps it with the stopping rules, rollback, the drafter's update
and the statistics. Rows are ragged: each has its own length, proposal, accepted count
and stopping state.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from specjax import kv_cache
from specjax.decode import drafters, growth, tree, verify
from specjax.decode.drafters import Drafter, Prefill, Verdict
from specjax.decode.metrics import Stats, counted
from specjax.decode.warping import Warp, warp
from specjax.decode.state import gather_rows, prefill, stop_after, token_buffer, write_rows
from specjax.kv_cache import KVCache
from specjax.model import LM


class Settings(NamedTuple):
    """The loop's static settings (SamplingConfig's): each distinct value compiles its own loop (the
    warping as `Warp.static()`: its temperature and top-p values are traced, `bind`)."""

    lookahead: int  # K: proposed tokens per chain and loop at most
    warping: Warp
    verify: str = "block"  # the rule for one chain: 'block' | 'tokenwise' (several: the tree rule)
    num_drafts: int = 1  # M: draft chains per loop, verified jointly as a tree when > 1
    tree_nodes: int = 0  # N > 0: grow a tree of N nodes (`growth`) instead of chains
    pass_width: str = "full"  # one chain's scoring pass: 'full' (K + 1 positions) or 'proposed' (`score`)

    def bind(self, warp_values: jax.Array) -> "Settings":
        """Inside a program keyed on `warping.static()`: its traced temperature and top-p."""
        return self._replace(warping=self.warping.bind(warp_values))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpsState:
    tokens: jax.Array
    length: jax.Array
    done: jax.Array
    target_cache: KVCache
    drafter_state: Any  # the drafter's own (a draft model's cache; () for lookups)
    key: jax.Array
    stats: Stats


class Speculation(NamedTuple):
    """Steps 1-4 of one loop, for every row: what was drafted, scored and kept. x, p,
    length and source are along the kept path (its kept nodes, then the rest of its
    chain: for chains, the kept chain's)."""

    x: jax.Array  # [B, K] proposed tokens
    p: jax.Array  # [B, K, V] their distributions p_1..p_K (point masses for lookups)
    length: jax.Array  # [B] proposed tokens along it (K unless adaptive or a lookup found nothing)
    source: jax.Array  # [B] drafters.SOURCES index of its drafter
    q: jax.Array  # [B, K+1, V] target distributions q_1..q_{K+1} along the chain, from one scoring pass
    num_accepted: jax.Array  # [B] n in 0..length
    next_token: jax.Array  # [B] the residual sample at x_{n+1}, or the bonus token (n == length)
    target_cache: KVCache  # with the pending token and the kept chain written in
    drafter_state: Any  # after proposing (the loop's `update` follows verification)
    nonfinite: jax.Array  # [B] NaN/inf in either model's logits, or a distribution without mass
    path: jax.Array  # [B, K+1] the kept path's nodes (`tree.accept`)
    chain: jax.Array  # [B] the kept chain (a grown tree's branch: 0)
    nodes: tree.Tree  # the whole proposal
    features: jax.Array | None  # [B, K+1, D] the target's hidden states along the kept path (when asked)
    scored: jax.Array  # [] positions the target's pass scored (K+1 or, pass_width 'proposed', fewer)


def start(target: LM, drafter: Drafter, prompts: jax.Array, prompt_lens: jax.Array, key: jax.Array,
          settings: Settings, size: int) -> SpsState:
    """The loop's state after prefilling the target's cache (and the drafter's state) with the prompts."""
    batch = prompts.shape[0]
    prefilled = Prefill(*prefill(target, prompts, prompt_lens, size, features=drafter.features)) if drafter.features \
        else Prefill(prefill(target, prompts, prompt_lens, size))
    return SpsState(token_buffer(prompts, size), prompt_lens, jnp.zeros((batch,), bool), prefilled.cache,
                    drafter.init_state(prompts, prompt_lens, size, settings.num_drafts, prefilled), key,
                    Stats.zeros(batch, settings.lookahead, len(drafters.SOURCES), settings.num_drafts))


def speculate(target: LM, drafter: Drafter, s: SpsState, settings: Settings):
    """Propose, score [pending, the tree's nodes] in ONE target pass, verify, commit the
    kept path. Returns (the state's next key, Speculation)."""
    K, M, warping = settings.lookahead, settings.num_drafts, settings.warping
    key, draft_key, accept_key = jax.random.split(s.key, 3)
    if settings.tree_nodes:
        nodes, drafter_state, draft_bad = growth.grow(drafter, s.drafter_state, s.tokens, s.length, draft_key, K,
                                                      settings.tree_nodes, warping, target.cfg.vocab_size)
    else:
        chains, drafter_state, draft_bad = drafter.propose(s.drafter_state, s.tokens, s.length, draft_key, K, M,
                                                           warping)
        nodes = tree.of_chains(chains, K)
    pending = s.length - 1
    scored = jnp.concatenate([gather_rows(s.tokens, pending)[:, None], nodes.x], axis=1)
    positions = pending[:, None] + tree.depths(nodes)
    visible = tree.visibility(nodes)

    logits, fresh, width = score(target, scored, positions, s.target_cache, visible, drafter.features,
                                 nodes, settings.pass_width)
    q, target_bad = warp(logits, warping)
    target_bad = jnp.any(target_bad, axis=1)
    rule = verify.select(settings.verify, M, bool(settings.tree_nodes), warping.greedy)
    num_accepted, path, next_token, empty = rule(accept_key, nodes, q)
    # One chain: its nodes in order are the kept path (no gather, and the commit writes them as a block).
    kept = None if nodes.single_chain else path
    along = lambda a: a if kept is None else jnp.take_along_axis(a, kept.reshape(kept.shape + (1,) * (a.ndim - 2)),
                                                                 axis=1)
    last = lambda a: tree.column(tree.along(nodes, path, a), jnp.maximum(num_accepted - 1, 0))  # at the last kept depth
    x, p = (a if kept is None else tree.along(nodes, path, a) for a in (nodes.x, nodes.p))
    return key, Speculation(x, p, tree.reach(nodes, path), last(nodes.source), along(q), num_accepted, next_token,
                            kv_cache.commit(s.target_cache, fresh, pending, kept), drafter_state,
                            target_bad | draft_bad | empty, path, last(nodes.branch), nodes,
                            None if fresh.hidden is None else along(fresh.hidden), width)


def scored_width(nodes: tree.Tree) -> jax.Array:
    """[] int32: one chain's pass as proposed covers the pending token and the longest
    row's drafts (rows share the pass; 1 where no row proposed anything)."""
    return 1 + jnp.max(jnp.sum(nodes.drafted, axis=1, dtype=jnp.int32))


def score(target: LM, scored, positions, cache: KVCache, visible, features, nodes: tree.Tree, pass_width: str):
    """The target's one pass over the T = 1 + N nodes `scored`: (logits [B, T, V], its
    `kv_cache.Fresh`, the positions scored [] int32). pass_width 'full' scores all T.
    'proposed' (one chain) scores the pending token and as many drafts as the longest row
    proposed, through a `lax.switch` over the widths 1..T (each its own compiled pass;
    the rest zeros, never read: verification reads q up to a row's own length + 1, and
    the commit's entries past the kept ones are rolled back). The cache is only read
    inside the switch, so XLA passes it in without a copy (`test_loop`); the commit
    writes it after."""
    T = scored.shape[1]
    if pass_width == "full" or not nodes.single_chain:
        logits, fresh = target(scored, positions, cache, visible, features=features)
        return logits, fresh, jnp.int32(T)
    width = scored_width(nodes)

    def pass_of(w: int):
        def run(_):
            logits, fresh = target(scored[:, :w], positions[:, :w], cache, visible[:w, :w], features=features)
            pad = lambda a, axis: jnp.pad(a, [(0, T - w if i == axis else 0) for i in range(a.ndim)])  # noqa: E731
            return pad(logits, 1), kv_cache.Fresh(pad(fresh.k, 2), pad(fresh.v, 2),
                                                  None if fresh.hidden is None else pad(fresh.hidden, 1))
        return run

    logits, fresh = jax.lax.switch(width - 1, [pass_of(w) for w in range(1, T + 1)], None)
    return logits, fresh, width


def loop(target: LM, drafter: Drafter, s: SpsState, settings: Settings, max_new: jax.Array, eos_id) -> SpsState:
    """One loop of Algorithm 2 for every row: `speculate`, then emit, stop, roll back and
    update the drafter."""
    K = settings.lookahead
    key, sp = speculate(target, drafter, s, settings)
    x, num_accepted = sp.x, sp.num_accepted
    # Emitted: x_1..x_n, then the residual/bonus token at index n.
    new = jnp.concatenate([x, jnp.zeros_like(x[:, :1])], axis=1)
    new = jnp.where(jnp.arange(K + 1)[None, :] == num_accepted[:, None], sp.next_token[:, None], new)
    bad = sp.nonfinite & ~s.done  # such a row emits nothing and stops (NonFiniteLogitsError)
    active = ~s.done & ~bad
    count, finished = stop_after(new, jnp.where(active, num_accepted + 1, 0), s.stats.num_new, max_new, eos_id)
    length = s.length + count
    # Roll back: the target holds [0, length-1) after this loop; the drafter its own.
    verdict = Verdict(length, num_accepted, sp.next_token, sp.chain, sp.features)
    return SpsState(write_rows(s.tokens, s.length, new, count), length, s.done | finished | bad,
                    sp.target_cache.with_lengths(length - 1), drafter.update(sp.drafter_state, verdict), key,
                    counted(s.stats, sp, active, count, bad))


def speculative_generate(target: LM, drafter: Drafter, prompts: jax.Array, prompt_lens: jax.Array,
                         key: jax.Array, *, settings: Settings, max_new: jax.Array, eos_id: int, size: int):
    """Algorithm 2 as one `lax.while_loop`. Returns (tokens [B, size], length [B], Stats)."""
    state = start(target, drafter, prompts, prompt_lens, key, settings, size)
    state = jax.lax.while_loop(lambda s: ~jnp.all(s.done),
                               lambda s: loop(target, drafter, s, settings, max_new, eos_id), state)
    return state.tokens, state.length, state.stats
