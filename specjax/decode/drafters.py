"""Drafters: who proposes the K tokens that the target verifies in each loop.

Every drafter returns a `Proposal` for all rows at once: tokens x [B, K], the
distributions p [B, K, V] they were drawn from, and a per-row `length` (0..K): positions
past it are padding that the target scores (shapes stay static) but that verification
never accepts. The verifier's exactness needs p to be exactly what x was drawn from,
after the same warping as q: the warped draft softmax for a sampled draft token, a point
mass for a token chosen deterministically from the context (n-gram or datastore lookup).

  model      the draft model samples K tokens; with draft_confidence > 0 a row stops
             after the first position whose distribution's top probability is below it.
  ngram      prompt lookup: the tokens that followed the most recent earlier occurrence
             of the row's last n tokens in its own prompt + output (no model at all).
  retrieval  the continuation that most often follows the row's last n tokens in a
             corpus (`datastore`), looked up on device.
  hybrid     per row: the n-gram proposal when the context matches its full n-token
             suffix, else the datastore's full-suffix match (when one is given), else
             the draft model's.

A lookup that finds nothing proposes no token (length 0), and the loop is one plain
sampling step for that row: the target's q at the pending token gives the next token
(the target still scores K+1 positions: see `speculative.speculate`).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from specjax.decode import datastore as datastore_lib
from specjax.decode.sampling import Warp, sample, warp
from specjax.kv_cache import KVCache
from specjax.model import LM

SOURCES = ("model", "ngram", "retrieval")  # Proposal.source indexes this


class Proposal(NamedTuple):
    """One chain of proposed tokens per row (the unit a verifier checks)."""

    x: jax.Array  # [B, K] proposed tokens; anything past `length`
    p: jax.Array  # [B, K, V] the distributions x was drawn from (a point mass for a lookup)
    length: jax.Array  # [B] proposed tokens per row, 0..K
    source: jax.Array  # [B] index into SOURCES


def uses_model(drafter: str) -> bool:
    return drafter in ("model", "hybrid")


def cache_window(drafter: str, lookahead: int, num_drafts: int = 1) -> int:
    """Tokens the draft model's first step of a loop feeds, ending at the pending token.

    Model drafting: the last TWO. When the previous loop accepted all K drafts, x_K was
    never fed to the draft, and re-feeding it keeps the draft cache complete without a
    data-dependent shape. Hybrid: K+1, because a row whose previous loop used a lookup
    proposal fed the draft nothing in it and may have emitted up to K+1 tokens since.
    Several drafts: K+1 too, as each chain has its own draft-cache row and only the
    winner's holds the kept path (the others are right only up to the old pending token)."""
    return lookahead + 1 if drafter == "hybrid" or num_drafts > 1 else 2


def model_proposal(draft: LM, cache: KVCache, tokens: jax.Array, length: jax.Array, key: jax.Array,
                   lookahead: int, warping: Warp, *, window: int = 2, confidence: float = 0.0,
                   active: jax.Array | None = None, distinct_first: int = 0):
    """K autoregressive draft steps. Returns (Proposal, cache, nonfinite [B]).

    The first step feeds the `window` tokens that end at the pending token (see
    `cache_window`). Rows that are not `active` (hybrid rows with a lookup proposal) or
    that stopped (confidence) propose nothing further; when no row still drafts, the
    remaining draft forwards are skipped (`lax.cond`), which is where a short draft saves
    time at batch 1. Stopping looks only at the draft's own distributions, so the
    proposal stays a draw from the draft model's (now variable-length) chain.

    `distinct_first` = M > 0 (greedy only): row i's first token is the draft's (i mod
    M)-th most likely instead of its argmax. M greedy chains of a tree would all be the
    same chain; this way they start with M different tokens. Each is a deterministic
    choice, so its p is a point mass, as greedy's argmax is."""
    batch = tokens.shape[0]
    positions = jnp.maximum(length[:, None] - window + jnp.arange(window)[None, :], 0)
    logits, cache = draft(jnp.take_along_axis(tokens, positions, axis=1), positions, cache)
    logits = logits[:, -1]
    keys = jax.random.split(key, lookahead)
    bad = jnp.zeros((batch,), bool)  # a draft distribution that is not one (NaN/inf logits, no mass)
    going = jnp.ones((batch,), bool) if active is None else active
    skippable = confidence > 0 or active is not None
    first = None
    if distinct_first and warping.temperature == 0:
        _, ranked = jax.lax.top_k(logits, distinct_first)  # [B, M], most likely first
        first = jnp.take_along_axis(ranked, (jnp.arange(batch) % distinct_first)[:, None], axis=1)[:, 0]

    def propose(logits, going, j):
        probs, bad_probs = warp(logits, warping)
        x, empty = sample(keys[j], probs)
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
        sure = jnp.max(probs if warping.temperature > 0 else jax.nn.softmax(logits, axis=-1), axis=-1)
        return x, probs, going & (sure >= confidence), bad_j

    def step(carry, j):
        logits, cache, going, bad = carry
        x, probs, still, bad_j = propose(logits, going, j)

        def feed():
            out, new_cache = draft(x[:, None], (length + j)[:, None], cache)
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


def point_mass(x: jax.Array, vocab: int) -> jax.Array:
    """The distribution of a deterministic proposal: all mass on the proposed token."""
    return jax.nn.one_hot(x, vocab, dtype=jnp.float32)


def ngram_match(tokens: jax.Array, length: jax.Array, n: int, lookahead: int):
    """Prompt lookup on device, vectorised over rows and buffer positions.

    The row's context is tokens[:length]. For m = n down to 1, an occurrence of its last
    m tokens that ends at t < length-1 is found with m shifted equality tests over the
    whole buffer; the longest m with any occurrence wins, and among its occurrences the
    most recent (largest t). The proposal is what followed it, tokens[t+1 ...]; when that
    runs into the end of the context it continues the copy periodically (period
    length-1-t), as a repeated pattern would. Returns (x [B, K], m [B]: the matched
    suffix's length, 0 without a match)."""
    batch, size = tokens.shape
    t = jnp.arange(size)[None, :]
    match = t < (length - 1)[:, None]
    best = jnp.full((batch,), -1, jnp.int32)
    matched = jnp.zeros((batch,), jnp.int32)
    padded = jnp.concatenate([jnp.full((batch, n), -1, tokens.dtype), tokens], axis=1)
    for k in range(n):  # k-th token back from the end; m = k + 1
        last = jnp.take_along_axis(tokens, jnp.maximum(length - 1 - k, 0)[:, None], axis=1)
        match = match & (padded[:, n - k:n - k + size] == last)  # tokens[t - k] (-1 before the start)
        end = jnp.max(jnp.where(match, t, -1), axis=1).astype(jnp.int32)
        best = jnp.where(end >= 0, end, best)
        matched = jnp.where(end >= 0, k + 1, matched)
    period = jnp.maximum(length - 1 - best, 1)
    index = best[:, None] + 1 + jnp.arange(lookahead)[None, :] % period[:, None]
    return jnp.take_along_axis(tokens, jnp.clip(index, 0, size - 1), axis=1), matched


def lookup_proposal(x: jax.Array, found: jax.Array, vocab: int, source: str, length=None) -> Proposal:
    batch, lookahead = x.shape
    full = jnp.full((batch,), lookahead, jnp.int32) if length is None else length
    return Proposal(x, point_mass(x, vocab), jnp.where(found, full, 0).astype(jnp.int32),
                    jnp.full((batch,), SOURCES.index(source), jnp.int32))


def select(use: jax.Array, first: Proposal, second: Proposal) -> Proposal:
    """Per row: `first` where `use`, else `second` (each row keeps one drafter's chain,
    with that drafter's own p)."""
    return Proposal(*(jnp.where(use.reshape(use.shape + (1,) * (a.ndim - 1)), a, b) for a, b in zip(first, second)))


def propose(drafter: str, draft: LM | None, cache: KVCache | None, datastore, tokens: jax.Array,
            length: jax.Array, key: jax.Array, lookahead: int, warping: Warp, vocab: int, *, ngram: int,
            confidence: float):
    """The loop's proposal for every row. Returns (Proposal, draft cache, nonfinite [B]).

    The lookup drafters alone fall back to shorter suffixes down to one token; hybrid
    trusts a lookup only when it matched the full suffix (`ngram` tokens, or all the
    datastore holds), as a one-token match is a weaker prophet than the draft model."""
    batch = tokens.shape[0]
    lookups = lookup_proposals(drafter, datastore, tokens, length, lookahead, vocab, ngram)
    if uses_model(drafter):
        found = jnp.zeros((batch,), bool)
        for hit, _ in lookups:
            found = found | hit
        prop, cache, bad = model_proposal(draft, cache, tokens, length, key, lookahead, warping,
                                          window=cache_window(drafter, lookahead), confidence=confidence,
                                          active=~found if lookups else None)
    else:
        prop, bad = lookups[-1][1], jnp.zeros((batch,), bool)
    for hit, lookup in reversed(lookups):  # the first drafter with a proposal wins
        prop = select(hit, lookup, prop)
    return prop, cache, bad


def lookup_proposals(drafter: str, datastore, tokens: jax.Array, length: jax.Array, lookahead: int, vocab: int,
                     ngram: int) -> list[tuple[jax.Array, Proposal]]:
    """[(hit [B], Proposal)] of the lookup drafters `drafter` uses, in order of preference."""
    lookups = []
    if drafter in ("ngram", "hybrid"):
        x, matched = ngram_match(tokens, length, ngram, lookahead)
        hit = matched >= (ngram if drafter == "hybrid" else 1)
        lookups.append((hit, lookup_proposal(x, hit, vocab, "ngram")))
    if drafter == "retrieval" or (drafter == "hybrid" and datastore is not None):
        x, size, matched = datastore_lib.lookup(datastore, tokens, length, ngram, lookahead)
        full = min(ngram, datastore.contexts.shape[1])
        hit = (size > 0) & (matched >= (full if drafter == "hybrid" else 1))
        lookups.append((hit, lookup_proposal(x, hit, vocab, "retrieval", size)))
    return lookups


def propose_chains(drafter: str, draft: LM, cache: KVCache, datastore, tokens: jax.Array, length: jax.Array,
                   key: jax.Array, lookahead: int, num_drafts: int, warping: Warp, vocab: int, *, ngram: int,
                   confidence: float):
    """M = num_drafts chains per row for a tree loop. Returns (Proposal with fields
    [B, M, ...], draft cache, nonfinite [B]).

    The draft cache has B*M rows, one per chain (row b's chains are rows b*M .. b*M+M-1),
    so the M chains are M independent draws of the draft's chain, batched (greedy: the
    chains start with the draft's M most likely tokens, see `model_proposal`). With
    'hybrid' chain 0 is the lookup's proposal where a lookup matched (the draft's chain
    there is drawn but not proposed): two different prophets in one tree."""
    batch, drafts = tokens.shape[0], num_drafts
    prop, cache, bad = model_proposal(draft, cache, jnp.repeat(tokens, drafts, axis=0),
                                      jnp.repeat(length, drafts, axis=0), key, lookahead, warping,
                                      window=cache_window(drafter, lookahead, drafts), confidence=confidence,
                                      distinct_first=drafts)
    prop = Proposal(*(a.reshape((batch, drafts) + a.shape[1:]) for a in prop))
    bad = jnp.any(bad.reshape(batch, drafts), axis=1)
    lookups = lookup_proposals(drafter, datastore, tokens, length, lookahead, vocab, ngram) if drafter == "hybrid" else []
    if lookups:
        first = Proposal(*(a[:, 0] for a in prop))
        for hit, lookup in reversed(lookups):
            first = select(hit, lookup, first)
        prop = Proposal(*(a.at[:, 0].set(b) for a, b in zip(prop, first)))
    return prop, cache, bad
