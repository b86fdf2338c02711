"""`parallel`: a draft model trained with mask tokens proposes all K tokens from ONE forward
(PARD: An et al., "PARD: Accelerating LLM Inference with Low-Cost PARallel Draft Model
Adaptation", arXiv 2504.18583; target-independent, like the `model` drafter's draft).

Each loop the draft runs one pass over the last K+1 tokens of the row's context (ending at
the pending token) followed by K-1 mask tokens (`model.mask_id`) at the next K-1 positions,
causal: the pending token's logits predict x_1, the j-th mask's predict x_{j+1}. A mask
carries no token, so every position's distribution is a function of the context alone:
x_j is drawn from position j's warped softmax p_j, the marginal of x_j given the context,
independently of x_<j. That fixed p_j is exactly the distribution x_j was drawn from given
x_<j, so token-wise and block verification stay exact with p_j as the proposal's p (as for
Medusa's heads, whose later heads see no drafted token either). The draft's cost per loop
is one forward of 2K rows whatever the chain's acceptance, not K forwards.

With M chains every chain is an independent draw of all K tokens from the same
distributions (greedy: chain i starts with p_1's i-th most likely token, a point mass, as
the other drafters' chains do): M chains cost the same one forward.

A dynamic tree (`--draft_tree=dynamic`, `decode/growth.py`) reads the same pass: a node at
depth d gets p_{d+1} as its children's distribution whatever its path (the masks saw no
drafted token), so the root call runs the pass and each later round only reads it; growth
still ranks by the path's probabilities, and each child's p is the distribution it was
drawn from, as the proof in growth.py needs.

The state is the draft's KV cache over the context. The K+1 re-fed tokens cover what the
last pass did not see as tokens (its drafts were masks): up to K kept drafts and the new
pending token. `update` rolls the cache back to before them, which also drops the masks'
entries.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax import kv_cache
from specjax.config import ModelConfig, SamplingConfig, UsageError
from specjax.decode.drafters.base import SOURCES, Drafter, Expansion, Proposal, Verdict, point_mass
from specjax.decode.state import prefill
from specjax.decode.warping import draw, warp
from specjax.kv_cache import KVCache
from specjax.model import LM, mask_id


def masked_pass(tokens: jax.Array, length: jax.Array, window: int, lookahead: int, mask: int):
    """(ids [B, T], positions [B, T], the pass index of each of the K distributions [B, K])
    of the one draft pass: T = window + K - 1 consecutive positions from max(length -
    window, 0), the row's tokens before `length`, the mask token from there on. A row
    shorter than the window has more masks after its pending token; they are never read."""
    T = window + lookahead - 1
    start = jnp.maximum(length - window, 0)
    positions = start[:, None] + jnp.arange(T)[None, :]
    ids = jnp.take_along_axis(tokens, jnp.minimum(positions, tokens.shape[1] - 1), axis=1)
    ids = jnp.where(positions < length[:, None], ids, mask)
    at = (length - 1 - start)[:, None] + jnp.arange(lookahead)[None, :]  # the pending token, then K-1 masks
    return ids, positions, at


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ParallelDrafter(Drafter):
    """The module docstring's drafter: `lm` (with `parallel_draft` > 0) drafts, its cache
    is the state."""

    lm: LM
    window: int = dataclasses.field(default=2, metadata=dict(static=True))  # K+1 re-fed tokens

    name = "parallel"
    needs_draft_model = True
    several_chains = True
    grows_trees = True

    trained_by = "mini_parallel"

    @classmethod
    def draft_passes(cls, lookahead: int) -> tuple[int, int]:
        return 1, 2 * lookahead  # one pass: the K+1 re-fed tokens and K-1 masks

    @classmethod
    def max_lookahead(cls, draft_cfg: ModelConfig | None) -> int:
        if draft_cfg is None or not draft_cfg.parallel_draft:
            got = "no draft model" if draft_cfg is None else "a draft model without mask tokens (parallel_draft=0)"
            raise UsageError(f"drafter={cls.name!r} needs a parallel draft model (parallel_draft > 0: trained with "
                             f"mask tokens, e.g. by `python -m specjax.train --config={cls.trained_by}`; random: "
                             f"--config.draft.parallel_draft=K), got {got}")
        return draft_cfg.parallel_draft

    @classmethod
    def make(cls, sampling: SamplingConfig, target: LM, draft: LM | None, datastore, mesh):
        if draft is not None and not isinstance(draft, LM):
            raise UsageError(f"drafter={sampling.drafter!r} needs a parallel draft model, got {type(draft).__name__}")
        cap = cls.max_lookahead(None if draft is None else draft.cfg)
        if sampling.lookahead > cap:
            raise UsageError(f"lookahead={sampling.lookahead} with drafter={sampling.drafter!r}: the draft proposes at "
                             f"most {cap} tokens a loop (parallel_draft={cap})")
        return cls(draft.packed(), sampling.lookahead + 1)  # packed where the CPU kernel runs

    def init_state(self, prompts, prompt_lens, size, num_drafts, prefilled) -> KVCache:
        return prefill(self.lm, prompts, prompt_lens, size)

    def one_pass(self, state: KVCache, tokens, length, lookahead):
        """(logits [B, K, V] of the K distributions, the cache with the pass's entries)."""
        ids, positions, at = masked_pass(tokens, length, self.window, lookahead, mask_id(self.lm.cfg))
        # The unembedding only at the K positions drafted from (`features`; the pass's own
        # logits are unused, so XLA drops them).
        _, fresh = self.lm(ids, positions, state, features=True)
        hidden = jnp.take_along_axis(fresh.hidden, at[:, :, None], axis=1)
        # Every entry of the pass is written; `update` keeps those before the next window.
        return self.lm.logits(hidden), kv_cache.commit(state, fresh, positions[:, 0])

    def propose(self, state: KVCache, tokens, length, key, lookahead, num_drafts, warping):
        batch, M, K = tokens.shape[0], num_drafts, lookahead
        logits, cache = self.one_pass(state, tokens, length, K)
        probs, bad = warp(logits, warping)
        probs = jnp.broadcast_to(probs[:, None], (batch, M) + probs.shape[1:])  # [B, M, K, V]
        x, empty = draw(key, probs, warping)  # every chain and position an independent draw
        if M > 1 and warping.greedy:
            _, ranked = jax.lax.top_k(logits[:, 0], M)  # [B, M], p_1's most likely first
            x = x.at[:, :, 0].set(ranked)
            probs = probs.at[:, :, 0].set(point_mass(ranked, probs.shape[-1]))
        prop = Proposal(x, probs, jnp.full((batch, M), K, jnp.int32),
                        jnp.full((batch, M), SOURCES.index(self.name), jnp.int32))
        return prop, cache, jnp.any(bad, axis=1) | jnp.any(empty, axis=(1, 2))

    def expand(self, state: KVCache, carry, tokens, length, nodes: Expansion):
        """A grown tree's rounds (the module docstring): the root call runs the one pass
        (the window K + 1 = `window`, so K = window - 1) and carries its K distributions;
        a round's node at depth d reads the (d+1)-th of them."""
        if carry is None:
            logits, state = self.one_pass(state, tokens, length, self.window - 1)
            return logits[:, :1], state, logits
        return jnp.take_along_axis(carry, nodes.depth[:, :, None], axis=1), state, carry

    def update(self, state: KVCache, verdict: Verdict) -> KVCache:
        """Roll back to [0, length - window): the next pass re-feeds the rest (at most K
        kept drafts and the new pending token since the last pass's first position)."""
        return state.with_lengths(jnp.maximum(verdict.length - self.window, 0))

    def describe(self) -> dict:
        return {"drafter": self.name, "parallel_draft": self.lm.cfg.parallel_draft}
