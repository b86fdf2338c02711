"""What every drafter implements and returns (the interface is described in the package
docstring), and what several drafters share."""
from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from specjax.config import SamplingConfig

# Proposal.source indexes this: the drafters that propose tokens of their own (hybrid
# picks one of theirs per row and chain). A new such drafter adds its name here.
SOURCES = ("model", "ngram", "retrieval", "medusa", "eagle", "parallel", "eagle3")


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


class Expansion(NamedTuple):
    """Nodes of a draft tree being grown (`decode/growth.py`) whose children's distribution
    the drafter is asked for (`Drafter.expand`): first the root alone (node 0, the row's
    pending token; `first` = 0), then each round's new nodes `first`..`first` + W - 1."""

    first: int  # the first new node's index (static); 0: the root call
    tokens: jax.Array  # [B, W] the new nodes' tokens (the root call: the pending token)
    parent: jax.Array  # [B, W] their parents' node indices (0: the pending token)
    depth: jax.Array  # [B, W] their depths 1..K (the root: 0): a node sits at the pending token's position + depth
    # [B, W, N] which of the nodes 1..N are each new node's ancestors (the pending token,
    # node 0, is every node's and is in no buffer of this loop: the root call put it in the
    # drafter's cache). New nodes of one round are never each other's ancestors.
    above: jax.Array
    num_nodes: int  # N, the tree's node budget (static)


class Drafter:
    """The interface (see the package docstring). Subclasses are frozen dataclasses
    registered as pytrees: their arrays (a draft model's params, a datastore's index) are
    leaves, their settings static. The class attributes DECLARE what a drafter needs and
    what it does with the settings; the run setup (`specjax.app.setup`), plan, bench, train
    and the flag checks read them, so nothing outside the registry asks which drafter it is."""

    name: ClassVar[str]
    needs_draft_model: ClassVar[bool] = False  # draws from a draft LM: a run without one cannot use it
    heads_kind: ClassVar[str | None] = None  # draws from draft heads of this `HeadsConfig.kind` on the target
    uses_datastore: ClassVar[bool] = False  # accepts a datastore
    needs_datastore: ClassVar[bool] = False  # cannot run without one
    several_chains: ClassVar[bool] = False  # draws M > 1 independent chains per loop
    adaptive: ClassVar[bool] = False  # honours draft_confidence (stops on the draft's own side: invariant 9)
    needs_features: ClassVar[bool] = False  # reads the target's hidden states (init_state, Verdict.features)
    grows_trees: ClassVar[bool] = False  # implements `expand`: SamplingConfig.draft_tree='dynamic'
    # A config whose `python -m specjax.train` makes what this drafter draws from (for
    # messages: '' where it draws from nothing trained, or from a draft model of any config).
    trained_by: ClassVar[str] = ""

    @classmethod
    def draft_passes(cls, lookahead: int) -> tuple[int, int]:
        """(draft forwards, tokens each) a chain of K costs a draft-model drafter: K steps of
        one token (bench prices a loop's parts by it)."""
        return lookahead, 1

    @classmethod
    def max_lookahead(cls, draft_cfg) -> int | None:
        """The most tokens one loop can propose with these weights (`draft_cfg`: the heads'
        `HeadsConfig` for a heads drafter, else the draft's `ModelConfig` or None); None:
        no cap but the context's. UsageError where these weights cannot serve it at all
        (a draft model without what the drafter needs)."""
        return None

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

    def expand(self, state, carry, tokens: jax.Array, length: jax.Array, nodes: Expansion):
        """A dynamic draft tree's one drafter-specific step (`decode/growth.py` does the rest:
        which nodes to grow, their draws without replacement, the layout): the logits of
        the token after each of `nodes` given its path, [B, W, V'] over `draft_vocab`, ->
        (logits, state, carry). The first call (carry None) is the root's: the drafter
        brings its state up to the row's context tokens[b, :length[b]] (as `propose`'s
        first step does: the rollback of `update` must leave the next root call what it
        needs) and returns the logits after the pending token and its own `carry`, a pytree
        it keeps for this loop's later calls (a draft model: every node's keys and
        values, which the next rounds' nodes attend to as `kv_cache.Prior` where `above`
        says). Each later call gets one round's new nodes; a drafter may compute their
        logits however it likes (one forward over the W nodes with the tree's visibility;
        a parallel drafter may read them from its root call). Exactness needs nothing of
        it: each node's p is whatever distribution its logits give."""
        raise NotImplementedError

    @property
    def draft_vocab(self) -> jax.Array | None:
        """The token ids [V'] that `expand`'s logits score (a draft vocabulary), or None: the
        target's whole vocabulary."""
        return None

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
