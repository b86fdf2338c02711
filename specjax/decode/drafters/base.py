"""What every drafter implements and returns (the interface is described in the package
docstring), and what several drafters share."""
from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from specjax.config import SamplingConfig

# Proposal.source indexes this: the drafters that propose tokens of their own (hybrid
# picks one of theirs per row and chain). A new such drafter adds its name here.
SOURCES = ("model", "ngram", "retrieval", "medusa", "eagle", "eagle3")


class Proposal(NamedTuple):
    """Proposed tokens with the exact distributions they were drawn from. The loop sees
    M chains per row (fields [B, M, ...]); inside a drafter one chain is [B, ...]."""

    x: jax.Array  # [..., K] proposed tokens; anything past `length`
    p: jax.Array  # [..., K, V] the distributions x was drawn from (a point mass for a lookup)
    length: jax.Array  # [...] proposed tokens, 0..K
    source: jax.Array  # [...] index into SOURCES


class Prefill(NamedTuple):
    """The target's side of the prompts, for `Drafter.init_state`."""

    cache: Any  # kv_cache.KVCache: the target's cache over the prompts (each row's last token pending)
    features: jax.Array | None = None  # [B, W, D] its final hidden states at every prompt position (when
    # the drafter `needs_features`; [B, W, len * D] the layers an EAGLE-3 drafter reads: `Drafter.features`),
    # else None


class Verdict(NamedTuple):
    """What verification decided in one loop, for `Drafter.update`."""

    length: jax.Array  # [B] the row's tokens after the loop (the last one pending, in no cache yet)
    num_accepted: jax.Array  # [B] kept draft tokens
    next_token: jax.Array  # [B] the residual or bonus token (the new pending one)
    chain: jax.Array  # [B] the chain whose path was kept
    # [B, K+1, D] the target's final hidden states at the kept path's nodes (the old pending
    # token, then the kept chain's K nodes), when the drafter asks for them (the layers it
    # reads, `Drafter.features`: [B, K+1, len * D] for EAGLE-3); else None.
    features: jax.Array | None = None


class Drafter:
    """The interface (see the package docstring). Subclasses are frozen dataclasses
    registered as pytrees: their arrays (a draft model's params, a datastore's index) are
    leaves, their settings static. The class attributes say what a drafter needs, so
    nothing outside the registry asks which drafter it is."""

    name: ClassVar[str]
    needs_draft_model: ClassVar[bool] = False  # a run without a draft model cannot use it
    uses_datastore: ClassVar[bool] = False  # accepts a datastore
    needs_datastore: ClassVar[bool] = False  # cannot run without one
    several_chains: ClassVar[bool] = False  # draws M > 1 independent chains per loop
    needs_heads: ClassVar[bool] = False  # draws from draft heads on the target (`specjax.heads`)
    needs_features: ClassVar[bool] = False  # reads the target's hidden states (init_state, Verdict.features)

    @property
    def features(self) -> bool | tuple[int, ...]:
        """Which of the target's hidden states Prefill.features and Verdict.features carry:
        the forward's static `features` (False: none; True: the final ones; layer counts:
        those layers' residual streams, EAGLE-3's)."""
        return self.needs_features

    @classmethod
    def make(cls, sampling: SamplingConfig, target, draft, datastore, mesh) -> "Drafter | None":
        """This drafter for a run of `target` (the LM as the loop runs it: packed where the
        kernel runs), with `draft` (an LM, `Heads` or None) and `datastore` (a
        `Datastore` or None), its arrays placed as decoding runs them (a packed draft, the
        index on `mesh`); None where the run is plain autoregressive sampling. UsageError
        naming what is missing."""
        raise NotImplementedError

    def init_state(self, prompts: jax.Array, prompt_lens: jax.Array, size: int, num_drafts: int,
                   prefilled: Prefill) -> Any:
        """The drafter's state after the prompts (a pytree carried by the loop); `prefilled`:
        the target's prefill of them (its cache; its hidden states when `needs_features`)."""
        return ()

    def propose(self, state, tokens: jax.Array, length: jax.Array, key: jax.Array, lookahead: int,
                num_drafts: int, warping) -> tuple[Proposal, Any, jax.Array]:
        """(Proposal [B, M, ...] of up to K tokens per chain after each row's context
        tokens[b, :length[b]], the new state, nonfinite [B]: a distribution of the drafter
        was not one)."""
        raise NotImplementedError

    def update(self, state, verdict: Verdict):
        """The state after verification (e.g. a draft cache rolled back to what was kept)."""
        return state

    def describe(self) -> dict:
        return {"drafter": self.name}


def point_mass(x: jax.Array, vocab: int) -> jax.Array:
    """The distribution of a deterministic proposal: all mass on the proposed token."""
    return jax.nn.one_hot(x, vocab, dtype=jnp.float32)


def select(use: jax.Array, first: Proposal, second: Proposal) -> Proposal:
    """Per row: `first` where `use`, else `second` (each row keeps one drafter's chain,
    with that drafter's own p)."""
    return Proposal(*(jnp.where(use.reshape(use.shape + (1,) * (a.ndim - 1)), a, b) for a, b in zip(first, second)))


def as_chains(prop: Proposal) -> Proposal:
    """One chain per row [B, ...] as the loop's M = 1 chains [B, 1, ...]."""
    return Proposal(*(a[:, None] for a in prop))
