"""`hybrid` and `hybrid_eagle3`: per row, the n-gram proposal when the context matches its
full n-token suffix, else the datastore's full-suffix match (when one is given), else the
fallback's: the draft model's (`hybrid`) or the EAGLE-3 layer's (`hybrid_eagle3`).

Which drafter a row uses depends on its context only, never on a draw, and each row keeps
that drafter's chain with that drafter's own p (a point mass for a lookup, the warped
draft distribution for the model or the layer), so verification stays exact. With M
chains (`hybrid`), chain 0 is the lookup's where one matched and the draft model's
elsewhere; the other chains are the draft model's: two kinds of prophet in one tree.

The fallback's state follows every loop whoever proposed: the draft model re-feeds a
window as long as a lookup's chain (`refeed_window(after_lookups=True)`), and the EAGLE
layer rebuilds its window from the target's features along the kept path anyway. Where no
row needs the fallback, its draft steps are skipped (`active`).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.config import SamplingConfig
from specjax.decode.drafters import base
from specjax.decode.drafters.base import Drafter, Proposal
from specjax.decode.drafters.draft_model import ModelDrafter
from specjax.decode.drafters.eagle import Eagle3Drafter
from specjax.decode.drafters.lookup import NgramDrafter, RetrievalDrafter


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridDrafter(Drafter):
    """The module docstring's drafter: `lookups` first, `fallback` where none matched."""

    fallback: Drafter  # a ModelDrafter (`hybrid`) or an Eagle3Drafter (`hybrid_eagle3`)
    lookups: tuple  # lookup drafters, in order of preference

    name = "hybrid"
    needs_draft_model = True
    adaptive = True  # its fallback's rows stop on the fallback's confidence
    uses_datastore = True
    several_chains = True

    @classmethod
    def fallback_for(cls, sampling: SamplingConfig, target, draft, mesh) -> Drafter:
        """The drafter of the rows no lookup matched."""
        return ModelDrafter.make(sampling, target, draft, None, mesh, after_lookups=True)

    @classmethod
    def make(cls, sampling: SamplingConfig, target, draft, datastore, mesh):
        fallback = cls.fallback_for(sampling, target, draft, mesh)
        lookups = (NgramDrafter.make(sampling, target, None, None, mesh),)
        if datastore is not None:
            lookups += (RetrievalDrafter.make(sampling, target, None, datastore, mesh),)
        return cls(fallback, lookups)

    @property
    def features(self):
        return self.fallback.features

    def init_state(self, prompts, prompt_lens, size, num_drafts, prefilled):
        return self.fallback.init_state(prompts, prompt_lens, size, num_drafts, prefilled)

    def propose(self, state, tokens, length, key, lookahead, num_drafts, warping):
        found = [lookup.lookup(tokens, length, lookahead, full=True) for lookup in self.lookups]
        hit = jnp.zeros(tokens.shape[:1], bool)
        for _, h in found:
            hit = hit | h
        # The fallback draws chain 0 only where no lookup matched (its other chains everywhere).
        active = jnp.concatenate([~hit[:, None], jnp.ones((hit.shape[0], num_drafts - 1), bool)], axis=1)
        prop, state, bad = self.fallback.propose(state, tokens, length, key, lookahead, num_drafts, warping, active)
        first = Proposal(*(a[:, 0] for a in prop))
        for chain, h in reversed(found):  # the first lookup with a match wins
            first = base.select(h, chain, first)
        return Proposal(*(a.at[:, 0].set(b) for a, b in zip(prop, first))), state, bad

    def update(self, state, verdict):
        return self.fallback.update(state, verdict)

    def describe(self) -> dict:
        return {**self.fallback.describe(), **self.lookups[0].describe(), "drafter": self.name,
                "datastore": len(self.lookups) > 1}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridEagle3Drafter(HybridDrafter):
    """`HybridDrafter` over an EAGLE-3 layer (heads of kind 'eagle3'): one chain per row."""

    name = "hybrid_eagle3"
    needs_draft_model = False
    heads_kind = "eagle3"
    needs_features = True
    several_chains = False
    trained_by = Eagle3Drafter.trained_by

    @classmethod
    def fallback_for(cls, sampling: SamplingConfig, target, draft, mesh) -> Drafter:
        return Eagle3Drafter.make(sampling, target, draft, None, mesh)
