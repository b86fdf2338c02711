"""`model`: the draft model samples the K tokens (Algorithm 2's draft), one autoregressive
step at a time; with draft_confidence > 0 a row stops after the first position whose
distribution's top probability is below it (a rule that looks only at the draft's side).
With M chains the draft cache has a row per chain and the M chains are M independent
draws (greedy: they start with the draft's M most likely tokens). A grown tree
(`decode/growth.py`) asks `expand` for one forward per round over the round's nodes.

The state is the draft's KV cache. It must hold every token the target accepted
(invariant 4): each loop's first step re-feeds the last `window` tokens of the context,
ending at the pending token, and `update` rolls the cache back to just before them. A
self-draft (`model.SelfDraft`: the target's first N layers, or its quantized copy) starts
from the target's prefilled cache, its first N layers, instead of a prefill of its own.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.config import SamplingConfig, UsageError
from specjax.decode.drafters.base import SOURCES, Drafter, Expansion, Proposal, Verdict, point_mass
from specjax.decode.warping import Warp, draw, warp
from specjax.decode.state import prefill
from specjax import kv_cache, sharding
from specjax.kv_cache import KVCache
from specjax.model import LM, SelfDraft


def refeed_window(lookahead: int, num_drafts: int, after_lookups: bool = False, grown: bool = False) -> int:
    """Tokens the draft model's first step of a loop feeds, ending at the pending token.

    The last TWO for one chain: when the previous loop accepted all K drafts, x_K was
    never fed to the draft, and re-feeding it keeps the draft cache complete without a
    data-dependent shape. K+1 behind lookups (hybrid), because a row whose previous loop
    used a lookup proposal fed the draft nothing in it and may have emitted up to K+1
    tokens since; for several chains, as each chain has its own draft-cache row and
    only the winner's holds the kept path (the others are right only up to the old
    pending token); and for a grown tree, whose nodes never enter the draft cache."""
    return lookahead + 1 if after_lookups or num_drafts > 1 or grown else 2


def refeed(draft: LM, cache: KVCache, tokens: jax.Array, length: jax.Array, window: int):
    """A loop's first draft step: the `window` tokens that end at the pending token, into
    the cache. -> (the logits after the pending token [B, V], the cache holding the row's
    context, pending token included)."""
    # Consecutive positions from max(length - window, 0): a row shorter than the window
    # feeds tokens past its pending one too (their entries are overwritten before any
    # query sees them, and lengths stop at the pending token), and its pending token's
    # logits are taken where it sits.
    start = jnp.maximum(length - window, 0)
    positions = start[:, None] + jnp.arange(window)[None, :]
    logits, cache = draft.extend(jnp.take_along_axis(tokens, positions, axis=1), positions, cache)
    return jnp.take_along_axis(logits, (length - 1 - start)[:, None, None], axis=1)[:, 0], cache.with_lengths(length)


def model_proposal(draft: LM, cache: KVCache, tokens: jax.Array, length: jax.Array, key: jax.Array,
                   lookahead: int, warping: Warp, *, window: int = 2, confidence: float = 0.0,
                   active: jax.Array | None = None, distinct_first: int = 0):
    """K autoregressive draft steps. Returns (Proposal, cache, nonfinite [B]).

    The first step feeds the `window` tokens that end at the pending token (see
    `refeed_window`). Rows that are not `active` (hybrid rows with a lookup proposal) or
    that stopped (confidence) propose nothing further; when no row still drafts, the
    remaining draft forwards are skipped (`lax.cond`), which is where a short draft saves
    time at batch 1. Stopping looks only at the draft's own distributions, so the
    proposal stays a draw from the draft model's (now variable-length) chain.

    `distinct_first` = M > 0 (greedy only): row i's first token is the draft's (i mod
    M)-th most likely instead of its argmax. M greedy chains of a tree would all be the
    same chain; this way they start with M different tokens. Each is a deterministic
    choice, so its p is a point mass, as greedy's argmax is."""
    batch = tokens.shape[0]
    logits, cache = refeed(draft, cache, tokens, length, window)
    keys = jax.random.split(key, lookahead)
    bad = jnp.zeros((batch,), bool)  # a draft distribution that is not one (NaN/inf logits, no mass)
    going = jnp.ones((batch,), bool) if active is None else active
    skippable = confidence > 0 or active is not None
    first = None
    if distinct_first and warping.greedy:
        _, ranked = jax.lax.top_k(logits, distinct_first)  # [B, M], most likely first
        first = jnp.take_along_axis(ranked, (jnp.arange(batch) % distinct_first)[:, None], axis=1)[:, 0]

    def propose(logits, going, j):
        probs, bad_probs = warp(logits, warping)
        x, empty = draw(keys[j], probs, warping)
        if first is not None:
            x = jnp.where(j == 0, first, x)
            probs = jnp.where(j == 0, point_mass(x, probs.shape[-1]), probs)
        bad_j = (bad_probs | empty) & going
        if confidence == 0:
            return x, probs, going, bad_j
        # Greedy warps to a point mass, which carries no confidence: there the rule reads
        # the draft's plain softmax (still only the draft's side). The token at a
        # low-confidence position is still proposed: p_j is paid for, and the target
        # scores the position anyway.
        sure = jnp.max(probs if not warping.greedy else jax.nn.softmax(logits, axis=-1), axis=-1)
        return x, probs, going & (sure >= confidence), bad_j

    def step(carry, j):
        logits, cache, going, bad = carry
        x, probs, still, bad_j = propose(logits, going, j)

        def feed():
            out, new_cache = draft.extend(x[:, None], (length + j)[:, None], cache)
            return out[:, 0], new_cache

        if skippable:
            logits_next, cache = jax.lax.cond(jnp.any(still), feed, lambda: (logits, cache))
        else:
            logits_next, cache = feed()
        return (logits_next, cache, still, bad | bad_j), (x, probs, going)

    (logits, cache, going_last, bad), (xs, ps, drafted) = jax.lax.scan(
        step, (logits, cache, going, bad), jnp.arange(lookahead - 1))
    x_last, p_last, _, bad_last = propose(logits, going_last, lookahead - 1)
    bad = bad | bad_last
    xs = jnp.concatenate([xs, x_last[None]], axis=0).T  # [B, K]
    ps = jnp.concatenate([ps, p_last[None]], axis=0).transpose(1, 0, 2)  # [B, K, V]
    drafted = jnp.concatenate([drafted, going_last[None]], axis=0).T  # [B, K]: prefixes of True
    length = jnp.sum(drafted, axis=1).astype(jnp.int32)
    return Proposal(xs, ps, length, jnp.full((batch,), SOURCES.index("model"), jnp.int32)), cache, bad


def shares_cache_layout(draft, target) -> bool:
    """Whether a draft's cache (ModelConfig `draft`) is the first layers of `target`'s."""
    fields = lambda c: (c.num_kv_heads, c.head_dim, c.compute_dtype, c.pos_encoding)  # noqa: E731
    return draft.num_layers <= target.num_layers and fields(draft) == fields(target)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelDrafter(Drafter):
    """The module docstring's drafter: `lm` drafts, its cache is the state."""

    lm: LM
    confidence: float = dataclasses.field(default=0.0, metadata=dict(static=True))
    window: int = dataclasses.field(default=2, metadata=dict(static=True))
    # A self-draft of this target: its cache over the prompts is the target's first N
    # layers' (exactly for layers:N; to rounding for a quantized copy, whose draws stay
    # exact as p is whatever it computes), so it starts from the target's prefill. A
    # target-sized quantized copy otherwise paid a second prompt prefill per run.
    from_target: bool = dataclasses.field(default=False, metadata=dict(static=True))

    name = "model"
    needs_draft_model = True
    several_chains = True
    adaptive = True
    grows_trees = True

    @classmethod
    def make(cls, sampling: SamplingConfig, target: LM, draft: LM | None, datastore, mesh,
             after_lookups: bool = False):
        if draft is None:
            if after_lookups:
                raise UsageError(f"drafter={sampling.drafter!r} falls back to a draft model, and none was given "
                                 "(draft=None)")
            return None  # the paper's baseline: autoregressive sampling
        return cls(draft.packed(), float(sampling.draft_confidence),  # packed where the CPU kernel runs
                   refeed_window(sampling.lookahead, sampling.num_drafts, after_lookups,
                                 sampling.draft_tree == "dynamic"),
                   isinstance(draft, SelfDraft) and shares_cache_layout(draft.cfg, target.cfg))

    def init_state(self, prompts, prompt_lens, size, num_drafts, prefilled) -> KVCache:
        rows = lambda a, axis=0: jnp.repeat(a, num_drafts, axis=axis) if num_drafts > 1 else a  # noqa: E731
        if not self.from_target:
            return prefill(self.lm, rows(prompts), rows(prompt_lens), size)
        # The first N layers of every array with a layer axis (the position table too: W_r
        # is float in every self-draft, so the draft's table is the target's).
        first = lambda a: None if a is None else a[:self.lm.cfg.num_layers]  # noqa: E731
        cache = prefilled.cache
        return KVCache(sharding.constrain(rows(first(cache.k), axis=1), kv_cache.CACHE_AXES),
                       sharding.constrain(rows(first(cache.v), axis=1), kv_cache.CACHE_AXES),
                       rows(cache.lengths), first(cache.position_table))

    def propose(self, state: KVCache, tokens, length, key, lookahead, num_drafts, warping, active=None):
        """`active` [B, M] (hybrid): chains to draw; the others propose nothing."""
        batch, drafts = tokens.shape[0], num_drafts
        rows = lambda a: jnp.repeat(a, drafts, axis=0) if drafts > 1 else a  # noqa: E731
        prop, cache, bad = model_proposal(self.lm, state, rows(tokens), rows(length), key, lookahead, warping,
                                          window=self.window, confidence=self.confidence,
                                          active=None if active is None else active.reshape(-1),
                                          distinct_first=drafts if drafts > 1 else 0)
        prop = Proposal(*(a.reshape((batch, drafts) + a.shape[1:]) for a in prop))
        return prop, cache, jnp.any(bad.reshape(batch, drafts), axis=1)

    def expand(self, state: KVCache, carry, tokens, length, nodes: Expansion):
        """A grown tree's rounds (`decode/growth.py`): the root call re-feeds the window into
        the cache; each round is one forward over its nodes, which attend to the cache
        and, through `carry` (every node's keys and values, `kv_cache.Prior`), to their
        ancestors among the earlier rounds' nodes."""
        batch, W = nodes.tokens.shape
        if carry is None:
            logits, cache = refeed(self.lm, state, tokens, length, self.window)
            cfg = self.lm.cfg
            shape = (cfg.num_layers, batch, nodes.num_nodes, cfg.num_kv_heads, cfg.head_dim)
            empty = sharding.constrain(jnp.zeros(shape, jnp.dtype(cfg.compute_dtype)), kv_cache.FRESH_AXES)
            return logits[:, None], cache, kv_cache.Prior(empty, empty, jnp.zeros((batch, nodes.num_nodes), jnp.int32))
        positions = (length - 1)[:, None] + nodes.depth
        visible = jnp.concatenate([nodes.above, jnp.broadcast_to(jnp.eye(W, dtype=bool), (batch, W, W))], axis=2)
        logits, fresh = self.lm(nodes.tokens, positions, state, visible, prior=carry)
        at = nodes.first - 1  # the round's nodes' slots among nodes 1..N
        put = lambda buffer, new, axis: jax.lax.dynamic_update_slice_in_dim(buffer, new.astype(buffer.dtype), at, axis)
        return logits, state, kv_cache.Prior(put(carry.k, fresh.k, 2), put(carry.v, fresh.v, 2),
                                             put(carry.positions, positions, 1))

    def update(self, state: KVCache, verdict: Verdict) -> KVCache:
        """Roll back to [0, length - window): the next loop's first step re-feeds the rest."""
        chains = state.lengths.shape[0] // verdict.length.shape[0]
        length = jnp.repeat(verdict.length, chains) if chains > 1 else verdict.length
        return state.with_lengths(jnp.maximum(length - self.window, 0))

    def describe(self) -> dict:
        return {"drafter": self.name, "draft_confidence": self.confidence}
