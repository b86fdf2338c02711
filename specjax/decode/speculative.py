"""Speculative sampling (Chen et al. 2023, Algorithm 2), fused into one `lax.while_loop`.

Each loop, for every row at once:
  1. `drafters.propose`: up to K tokens x_1..x_K with the distributions p_j they were
     drawn from (the draft model samples them; the lookup drafters copy them from the
     context or a datastore, as point masses); rows may propose fewer (`length`).
  2. the target scores [pending, x_1..x_K] in ONE pass -> q_1..q_{K+1}.
  3. a verifier keeps a prefix of the proposal and draws the next token:
     `accept` (the paper's rule): x_j is kept with probability min(1, q_j(x_j) / p_j(x_j)),
     left to right; the first rejected one is replaced by a residual sample from
     norm(max(0, q - p)), and if all are kept a bonus token comes from q_{length+1};
     `accept_block` (block verification): the same outputs decided jointly.
So each loop emits 1..K+1 tokens and (Theorem 1) the output is distributed exactly as q.
With num_drafts = M > 1 (`speculate_tree`) step 1 draws M chains, step 2 scores them as
one tree (a shared pending token, then M branches) and step 3 is `tree.accept`'s
multi-draft rule; only the kept path's keys/values enter the target's cache.
`speculate` is steps 1-3 for one loop (`api.explain_loop` shows them for the first loop);
`speculative_generate` wraps it with the stopping rules, rollback and statistics.
Rows are ragged: each has its own length, proposal, accepted count and stopping state.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from specjax import kv_cache
from specjax.decode import drafters, tree
from specjax.decode.sampling import Warp, sample, warp
from specjax.decode.state import Stats, gather_rows, prefill, stop_after, token_buffer, write_rows
from specjax.kv_cache import KVCache
from specjax.model import LM


def acceptance_draws(key: jax.Array, shape) -> jax.Array:
    """The U[0, 1) draws that decide acceptance (Algorithm 2's r; block verification's eta)."""
    return jax.random.uniform(key, shape)


def drafted_mask(x: jax.Array, length: jax.Array | None) -> jax.Array:
    """[B, K] True at the proposed positions j < length (all K when length is None)."""
    if length is None:
        return jnp.ones(x.shape, bool)
    return jnp.arange(x.shape[1])[None, :] < length[:, None]


def resample(key: jax.Array, q: jax.Array, p: jax.Array, weight: jax.Array, n: jax.Array):
    """The token after n accepted drafts: a sample from norm(max(0, weight * q_{n+1} - p_{n+1})),
    with p = 0 past the proposed positions (so after a full accept it is the bonus q_{n+1}),
    and q_{n+1} itself when that has no mass. q [B, K+1, V], p [B, K, V] (masked), n [B].
    Returns (token [B], empty [B]: the distribution had no mass, only when q was not one)."""
    p_ext = jnp.concatenate([p, jnp.zeros_like(p[:, :1])], axis=1)
    q_n = jnp.take_along_axis(q, n[:, None, None], axis=1)[:, 0]
    p_n = jnp.take_along_axis(p_ext, n[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(weight[:, None] * q_n - p_n, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), q_n)  # q - p <= 0 everywhere: use q
    return sample(key, residual)


def accept(key: jax.Array, x: jax.Array, p: jax.Array, q: jax.Array, length: jax.Array | None = None):
    """Modified rejection sampling (Algorithm 2), token by token, vectorised over rows.

    x [B,K] proposed tokens, p [B,K,V] their distributions, q [B,K+1,V] target probs,
    length [B] proposed tokens per row (None: all K). Returns (num_accepted [B] in
    0..length, next_token [B], empty [B]): the residual sample at the first rejection, or
    the bonus sample from q_{length+1} when every proposed token was accepted; empty marks
    a row whose distribution for it had no mass (only when p or q was not one)."""
    batch, lookahead = x.shape
    drafted = drafted_mask(x, length)
    accept_key, resample_key = jax.random.split(key)
    p_x = jnp.take_along_axis(p, x[..., None], axis=-1)[..., 0]
    q_x = jnp.take_along_axis(q[:, :lookahead], x[..., None], axis=-1)[..., 0]
    u = acceptance_draws(accept_key, (batch, lookahead))
    accepted = (u * p_x < q_x) & drafted  # u < q/p without dividing; p_x > 0 as x was drawn from p
    num_accepted = jnp.sum(jnp.cumprod(accepted, axis=1), axis=1).astype(jnp.int32)
    p = jnp.where(drafted[..., None], p, 0.0)
    return (num_accepted, *resample(resample_key, q, p, jnp.ones((batch,), q.dtype), num_accepted))


def accept_block(key: jax.Array, x: jax.Array, p: jax.Array, q: jax.Array, length: jax.Array | None = None):
    """Block verification (Sun et al., "Block Verification Accelerates Speculative
    Decoding", ICLR 2025, arXiv 2403.10444, Algorithm 2): the proposed block is verified
    jointly. Same signature and meaning as `accept`; exact like it, and never fewer
    accepted tokens in expectation (optimal among verifiers that see only the block).

    With weights w_0 = 1, w_i = min(1, w_{i-1} q_i(x_i) / p_i(x_i)) and, for i < L,
    h_i = S_i / (S_i + 1 - w_i) where S_i = sum_x max(0, w_i q_{i+1}(x) - p_{i+1}(x)),
    and h_L = w_L (L = the row's length): draw eta_i ~ U(0, 1) and keep x_1..x_tau for
    the largest tau with eta_tau < h_tau (0 if none); the next token comes from
    norm(max(0, w_tau q_{tau+1} - p_{tau+1})), the bonus q_{L+1} when tau = L.
    (S_i = 0 gives h_i = 0: no residual mass there, so the block never stops there.)"""
    batch, lookahead = x.shape
    drafted = drafted_mask(x, length)
    size = jnp.full((batch,), lookahead, jnp.int32) if length is None else length
    accept_key, resample_key = jax.random.split(key)
    p = jnp.where(drafted[..., None], p, 0.0)
    p_x = jnp.take_along_axis(p, x[..., None], axis=-1)[..., 0]
    q_x = jnp.take_along_axis(q[:, :lookahead], x[..., None], axis=-1)[..., 0]
    ratio = jnp.where(drafted, q_x / jnp.where(drafted, p_x, 1.0), 0.0)  # p_x > 0: x was drawn from p
    weights = [jnp.ones((batch,), q.dtype)]
    for j in range(lookahead):
        weights.append(jnp.minimum(1.0, weights[-1] * ratio[:, j]))
    w = jnp.stack(weights, axis=1)  # [B, K+1]: w_0..w_K
    mass = jnp.sum(jnp.maximum(w[:, :lookahead, None] * q[:, :lookahead] - p, 0.0), axis=-1)  # S_0..S_{K-1}
    s_i, w_i = mass[:, 1:], w[:, 1:lookahead]  # i = 1..K-1
    h = jnp.where(s_i > 0, s_i / jnp.where(s_i > 0, s_i + 1.0 - w_i, 1.0), 0.0)
    i = jnp.arange(1, lookahead + 1)[None, :]
    h = jnp.concatenate([h, jnp.zeros((batch, 1), h.dtype)], axis=1)  # [B, K]: h_1..h_K
    h = jnp.where(i < size[:, None], h, jnp.where(i == size[:, None], w[:, 1:], 0.0))
    eta = acceptance_draws(accept_key, (batch, lookahead))
    tau = jnp.max(jnp.where(eta < h, i, 0), axis=1).astype(jnp.int32)
    weight = jnp.take_along_axis(w, tau[:, None], axis=1)[:, 0]
    return (tau, *resample(resample_key, q, p, weight, tau))


def verifier(name: str):
    """The acceptance rule named by SamplingConfig.verify (looked up when the loop is traced)."""
    return {"tokenwise": accept, "block": accept_block}[name]


class Settings(NamedTuple):
    """The loop's static settings (SamplingConfig's): each distinct value compiles its own loop."""

    lookahead: int  # K: proposed tokens per loop at most
    warping: Warp
    verify: str = "block"  # 'block' | 'tokenwise'
    drafter: str = "model"  # drafters.propose
    ngram: int = 3
    draft_confidence: float = 0.0
    num_drafts: int = 1  # M: draft chains per loop, verified jointly as a tree when > 1 (`verify` is for one chain)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpsState:
    tokens: jax.Array
    length: jax.Array
    done: jax.Array
    target_cache: KVCache
    draft_cache: KVCache | None  # None without a draft model (lookup drafters)
    key: jax.Array
    stats: Stats


class Speculation(NamedTuple):
    """Steps 1-3 of one loop, for every row: what was drafted, scored and accepted."""

    x: jax.Array  # [B, K] proposed tokens
    p: jax.Array  # [B, K, V] their distributions p_1..p_K (point masses for lookups)
    length: jax.Array  # [B] proposed tokens per row (K unless adaptive or a lookup found nothing)
    source: jax.Array  # [B] drafters.SOURCES index of the row's proposal
    q: jax.Array  # [B, K+1, V] target distributions q_1..q_{K+1}, from one scoring pass
    num_accepted: jax.Array  # [B] n in 0..length
    next_token: jax.Array  # [B] the residual sample at x_{n+1}, or the bonus token (n == length)
    target_cache: KVCache
    draft_cache: KVCache | None
    nonfinite: jax.Array  # [B] NaN/inf in either model's logits, or a distribution without mass
    picks: jax.Array  # [B, K] the chain kept at each depth, -1 past n
    chains: drafters.Proposal  # all M chains, fields [B, M, ...] (one chain: the proposal itself)


def start(target: LM, draft: LM | None, prompts: jax.Array, prompt_lens: jax.Array, key: jax.Array,
          lookahead: int, size: int, num_drafts: int = 1) -> SpsState:
    """The loop's state after prefilling both models' caches with the prompts (the
    draft's with every prompt once per chain: one draft-cache row per chain)."""
    batch = prompts.shape[0]
    draft_cache = None
    if draft is not None:
        rows = lambda a: jnp.repeat(a, num_drafts, axis=0) if num_drafts > 1 else a
        draft_cache = prefill(draft, rows(prompts), rows(prompt_lens), size)
    return SpsState(token_buffer(prompts, size), prompt_lens, jnp.zeros((batch,), bool),
                    prefill(target, prompts, prompt_lens, size), draft_cache, key,
                    Stats.zeros(batch, lookahead, len(drafters.SOURCES), num_drafts))


def speculate(target: LM, draft: LM | None, datastore, s: SpsState, settings: Settings):
    """Propose up to K tokens, score [pending, x_1..x_K] in ONE target pass, verify.
    Returns (the state's next key, Speculation)."""
    if settings.num_drafts > 1:
        return speculate_tree(target, draft, datastore, s, settings)
    K, warping = settings.lookahead, settings.warping
    key, draft_key, accept_key = jax.random.split(s.key, 3)
    prop, draft_cache, draft_bad = drafters.propose(
        settings.drafter, draft, s.draft_cache, datastore, s.tokens, s.length, draft_key, K, warping,
        target.cfg.vocab_size, ngram=settings.ngram, confidence=settings.draft_confidence)
    pending = s.length - 1
    scored = jnp.concatenate([gather_rows(s.tokens, pending)[:, None], prop.x], axis=1)
    positions = pending[:, None] + jnp.arange(K + 1)[None, :]

    # Always the K+1 positions, even in a lookup loop that proposed nothing for any row: a
    # lax.cond choosing a 1-token pass there made XLA copy the whole KV cache into and out
    # of the conditional in every loop, which cost more than the K extra positions do with
    # the few-row kernel (BENCHMARKS.md section 10).
    logits, target_cache = target(scored, positions, s.target_cache)
    q, target_bad = warp(logits, warping)
    target_bad = jnp.any(target_bad, axis=1)
    num_accepted, next_token, empty = verifier(settings.verify)(accept_key, prop.x, prop.p, q, prop.length)
    picks = jnp.where(jnp.arange(K)[None, :] < num_accepted[:, None], 0, -1)  # one chain: chain 0 at every kept depth
    return key, Speculation(prop.x, prop.p, prop.length, prop.source, q, num_accepted, next_token, target_cache,
                            draft_cache, target_bad | draft_bad | empty, picks,
                            drafters.Proposal(*(a[:, None] for a in prop)))


def speculate_tree(target: LM, draft: LM, datastore, s: SpsState, settings: Settings):
    """`speculate` with M draft chains: the target scores the tree [pending, M chains of
    K] in ONE pass (`tree` module), `tree.accept` keeps a path, and the pending token and
    the winning chain's K nodes are written into the target's cache at consecutive
    positions (past the kept ones they are masked by the rollback, as in a chain loop).
    The returned Speculation describes the winning chain."""
    K, M, warping = settings.lookahead, settings.num_drafts, settings.warping
    batch = s.tokens.shape[0]
    key, draft_key, accept_key = jax.random.split(s.key, 3)
    chains, draft_cache, draft_bad = drafters.propose_chains(
        settings.drafter, draft, s.draft_cache, datastore, s.tokens, s.length, draft_key, K, M, warping,
        target.cfg.vocab_size, ngram=settings.ngram, confidence=settings.draft_confidence)
    pending = s.length - 1
    scored = jnp.concatenate([gather_rows(s.tokens, pending)[:, None], chains.x.reshape(batch, M * K)], axis=1)
    positions = pending[:, None] + tree.depths(M, K)[None, :]
    logits, (k_tree, v_tree) = target(scored, positions, s.target_cache, tree.ancestors(M, K))
    q_tree, bad = warp(logits, warping)
    num_accepted, picks, next_token, empty = tree.accept(accept_key, chains.x, chains.p, q_tree, chains.length)
    win = tree.winner(picks, num_accepted)
    path = tree.path_nodes(win, K)
    target_cache = kv_cache.commit(s.target_cache, k_tree, v_tree, path, pending)
    chain = lambda a: jnp.take_along_axis(a, win.reshape((batch, 1) + (1,) * (a.ndim - 2)), axis=1)[:, 0]
    q = jnp.take_along_axis(q_tree, path[:, :, None], axis=1)
    return key, Speculation(chain(chains.x), chain(chains.p), chain(chains.length), chain(chains.source), q,
                            num_accepted, next_token, target_cache, draft_cache,
                            jnp.any(bad, axis=1) | draft_bad | empty, picks, chains)


def counted(st: Stats, sp: Speculation, active: jax.Array, count: jax.Array, bad: jax.Array) -> Stats:
    """`st` plus one loop of `sp` for the `active` rows (`count` tokens emitted each).
    Kept tokens count for the chain picked at their depth and for its drafter (with
    several drafts, hybrid's chain 0 may be a lookup's and the others the model's)."""
    K, M = sp.picks.shape[1], sp.chains.length.shape[1]
    n = sp.num_accepted
    live = active[:, None].astype(jnp.int32)
    one_hot = lambda i, size: (i[..., None] == jnp.arange(size)).astype(jnp.int32)
    sources = len(drafters.SOURCES)
    source_at = jnp.take_along_axis(sp.chains.source, jnp.maximum(sp.picks, 0), axis=1)  # [B, K]
    return Stats(
        loops=st.loops + active,
        num_new=st.num_new + count,
        accepted=st.accepted + jnp.where(active, n, 0),
        accepted_at=st.accepted_at + live * (jnp.arange(K)[None, :] < n[:, None]),
        histogram=st.histogram + live * (jnp.arange(K + 1)[None, :] == n[:, None]),
        drafted=st.drafted + live * (jnp.arange(K + 1)[None, :] == sp.length[:, None]),
        accepted_by=st.accepted_by + live * jnp.sum(one_hot(source_at, sources) * (sp.picks >= 0)[..., None], axis=1),
        proposed_by=st.proposed_by + live * jnp.sum(one_hot(sp.chains.source, sources)
                                                    * sp.chains.length[..., None], axis=1),
        nonfinite=st.nonfinite | bad,
        chain_won=st.chain_won + live * one_hot(tree.winner(sp.picks, n), M) * (n > 0)[:, None],
        chain_accepted=st.chain_accepted + live * jnp.sum(one_hot(sp.picks, M), axis=1),
        chain_proposed=st.chain_proposed + live * sp.chains.length)


def speculative_generate(target: LM, draft: LM | None, datastore, prompts: jax.Array, prompt_lens: jax.Array,
                         key: jax.Array, *, settings: Settings, max_new: int, eos_id: int, size: int):
    """Algorithm 2 as one `lax.while_loop`. Returns (tokens [B, size], length [B], Stats)."""
    K, M = settings.lookahead, settings.num_drafts
    state = start(target, draft, prompts, prompt_lens, key, K, size, M)
    window = drafters.cache_window(settings.drafter, K, M)

    def loop(s: SpsState) -> SpsState:
        key, sp = speculate(target, draft, datastore, s, settings)
        x, num_accepted = sp.x, sp.num_accepted
        # Emitted: x_1..x_n, then the residual/bonus token at index n.
        new = jnp.concatenate([x, jnp.zeros_like(x[:, :1])], axis=1)
        new = jnp.where(jnp.arange(K + 1)[None, :] == num_accepted[:, None], sp.next_token[:, None], new)
        bad = sp.nonfinite & ~s.done  # such a row emits nothing and stops (NonFiniteLogitsError)
        active = ~s.done & ~bad
        count, finished = stop_after(new, jnp.where(active, num_accepted + 1, 0), s.stats.num_new,
                                     max_new, eos_id)
        length = s.length + count
        # Roll back: the target holds [0, length-1) after this loop. The draft's cache holds
        # at least [0, length - window): its next first step re-feeds the rest.
        target_cache = sp.target_cache.with_lengths(length - 1)
        if sp.draft_cache is not None:
            draft_length = jnp.repeat(length, M, axis=0) if M > 1 else length
            draft_cache = sp.draft_cache.with_lengths(jnp.maximum(draft_length - window, 0))
        else:
            draft_cache = None
        return SpsState(write_rows(s.tokens, s.length, new, count), length, s.done | finished | bad,
                        target_cache, draft_cache, key, counted(s.stats, sp, active, count, bad))

    state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), loop, state)
    return state.tokens, state.length, state.stats
