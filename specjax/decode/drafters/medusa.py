"""`medusa`: draft heads on the target's hidden state propose all K tokens in one call
(`specjax.heads`; non-autoregressive, the lectures' "non-autoregressive prophet").

The state is the target's final hidden state [B, D] at the last token in the target's
cache, the one whose logits gave the pending token: head j applied to it predicts the
token j places past the pending one. Each x_j is drawn from head j's softmax after the
same warping as q, which is exactly its distribution given x_<j (the heads do not read
the chain), so the proposal's p_j are the heads' warped softmaxes and verification is
unchanged. With M chains each chain is an independent draw of all K tokens (greedy:
chain i starts with head 1's i-th most likely token, a point mass, as the draft model's
chains do), so the tree rule applies as to any independent chains.

After verification the state becomes the target's hidden state at the kept path's last
node (`Verdict.features`): the node whose q gave the new pending token. After the
prompts it is the prefill's state at the row's second-to-last prompt token (a one-token
prompt has none: its own state stands in, a worse guess but still a proposal with its
exact p).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.config import SamplingConfig, UsageError
from specjax.decode.drafters.base import SOURCES, Drafter, Proposal, Verdict, point_mass
from specjax.decode.warping import sample, warp
from specjax import heads as heads_lib
from specjax.heads import Heads
from specjax.model import LM


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MedusaDrafter(Drafter):
    """The module docstring's drafter: `heads` over `target`'s hidden state."""

    heads: Heads
    target: LM  # the loop's target: its unembedding turns the heads' states into logits

    name = "medusa"
    heads_kind = "medusa"
    several_chains = True
    needs_features = True
    trained_by = "mini_medusa"

    @classmethod
    def max_lookahead(cls, draft_cfg) -> int:
        return draft_cfg.num_heads  # head j proposes the token j places on: K heads, K tokens

    @classmethod
    def make(cls, sampling: SamplingConfig, target: LM, draft, datastore, mesh):
        draft = heads_lib.checked(draft, target.cfg, cls.heads_kind, sampling.drafter)
        if sampling.lookahead > cls.max_lookahead(draft.cfg):
            raise UsageError(f"lookahead={sampling.lookahead} with drafter={sampling.drafter!r}: the heads propose "
                             f"at most {draft.cfg.num_heads} tokens a loop (num_heads={draft.cfg.num_heads})")
        return cls(draft, target)

    def init_state(self, prompts, prompt_lens, size, num_drafts, prefilled) -> jax.Array:
        features = prefilled.features
        last = jnp.maximum(prompt_lens - 2, 0)
        return jnp.take_along_axis(features, last[:, None, None], axis=1)[:, 0]

    def propose(self, state, tokens, length, key, lookahead, num_drafts, warping):
        batch, M, K = tokens.shape[0], num_drafts, lookahead
        logits = self.heads.logits(self.target, state, K)  # [B, K, V]
        probs, bad = warp(logits, warping)
        probs = jnp.broadcast_to(probs[:, None], (batch, M) + probs.shape[1:])  # [B, M, K, V]
        x, empty = sample(key, probs)  # [B, M, K]: every chain and position an independent draw
        if M > 1 and warping.greedy:
            _, ranked = jax.lax.top_k(logits[:, 0], M)  # [B, M], head 1's most likely first
            x = x.at[:, :, 0].set(ranked)
            probs = probs.at[:, :, 0].set(point_mass(ranked, probs.shape[-1]))
        prop = Proposal(x, probs, jnp.full((batch, M), K, jnp.int32), jnp.full((batch, M), SOURCES.index(self.name),
                                                                              jnp.int32))
        return prop, state, jnp.any(bad, axis=1) | jnp.any(empty, axis=(1, 2))

    def update(self, state, verdict: Verdict) -> jax.Array:
        return jnp.take_along_axis(verdict.features, verdict.num_accepted[:, None, None], axis=1)[:, 0]

    def describe(self) -> dict:
        return {"drafter": self.name, "num_heads": self.heads.cfg.num_heads}
