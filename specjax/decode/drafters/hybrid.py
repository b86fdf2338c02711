"""`hybrid`: per row, the n-gram proposal when the context matches its full n-token suffix,
else the datastore's full-suffix match (when one is given), else the draft model's.

Each row keeps one drafter's chain with that drafter's own p (a point mass for a lookup,
the warped draft distribution for the model), so verification stays exact. With M
chains, chain 0 is the lookup's where one matched and the draft model's elsewhere; the
other chains are the draft model's: two kinds of prophet in one tree.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.config import SamplingConfig
from specjax.decode.drafters import base
from specjax.decode.drafters.base import Drafter, Proposal
from specjax.decode.drafters.draft_model import ModelDrafter
from specjax.decode.drafters.lookup import NgramDrafter, RetrievalDrafter


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridDrafter(Drafter):
    """The module docstring's drafter: `lookups` first, `model` where none matched."""

    model: ModelDrafter
    lookups: tuple  # lookup drafters, in order of preference

    name = "hybrid"
    needs_draft_model = True
    adaptive = True  # its draft-model rows stop as `model`'s do
    uses_datastore = True
    several_chains = True

    @classmethod
    def make(cls, sampling: SamplingConfig, target, draft, datastore, mesh):
        model = ModelDrafter.make(sampling, target, draft, None, mesh, after_lookups=True)
        lookups = (NgramDrafter.make(sampling, target, None, None, mesh),)
        if datastore is not None:
            lookups += (RetrievalDrafter.make(sampling, target, None, datastore, mesh),)
        return cls(model, lookups)

    def init_state(self, prompts, prompt_lens, size, num_drafts, prefilled):
        return self.model.init_state(prompts, prompt_lens, size, num_drafts, prefilled)

    def propose(self, state, tokens, length, key, lookahead, num_drafts, warping):
        found = [lookup.lookup(tokens, length, lookahead, full=True) for lookup in self.lookups]
        hit = jnp.zeros(tokens.shape[:1], bool)
        for _, h in found:
            hit = hit | h
        # The draft draws chain 0 only where no lookup matched (its other chains everywhere).
        active = jnp.concatenate([~hit[:, None], jnp.ones((hit.shape[0], num_drafts - 1), bool)], axis=1)
        prop, state, bad = self.model.propose(state, tokens, length, key, lookahead, num_drafts, warping, active)
        first = Proposal(*(a[:, 0] for a in prop))
        for chain, h in reversed(found):  # the first lookup with a match wins
            first = base.select(h, chain, first)
        return Proposal(*(a.at[:, 0].set(b) for a, b in zip(prop, first))), state, bad

    def update(self, state, verdict):
        return self.model.update(state, verdict)

    def describe(self) -> dict:
        return {**self.model.describe(), **self.lookups[0].describe(), "drafter": self.name,
                "datastore": len(self.lookups) > 1}
