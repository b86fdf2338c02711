"""The lookup drafters: tokens copied from the context or from a corpus, no model at all.

  ngram      prompt lookup: the tokens that followed the most recent earlier occurrence
             of the row's last n tokens in its own prompt + output.
  retrieval  the continuation that most often follows the row's last n tokens in a
             corpus (`datastore`), looked up on device.

A lookup proposes one chain of tokens chosen deterministically from the context, so its
p is a point mass. On its own a lookup falls back to shorter suffixes down to one token;
hybrid trusts one only when it matched the full suffix (`lookup(..., full=True)`), as a
one-token match is a weaker prophet than the draft model. A row whose lookup finds
nothing proposes no token (length 0), and its loop is one plain sampling step (the
target still scores K+1 positions: see `speculative.speculate`).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.config import SamplingConfig, UsageError
from specjax.decode import retrieval_index as datastore_lib
from specjax.decode.drafters.base import SOURCES, Drafter, Proposal, as_chains, point_mass


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


def chain(x: jax.Array, hit: jax.Array, length: jax.Array, vocab: int, source: str) -> Proposal:
    """A lookup's chain [B, K]: x as point masses, `length` tokens where it hit, else none."""
    return Proposal(x, point_mass(x, vocab), jnp.where(hit, length, 0).astype(jnp.int32),
                    jnp.full(x.shape[:1], SOURCES.index(source), jnp.int32))


class Lookup(Drafter):
    """A lookup drafter: `lookup` is its one chain; proposing is that chain, alone."""

    def lookup(self, tokens, length, lookahead: int, full: bool = False) -> tuple[Proposal, jax.Array]:
        """(chain [B, K], hit [B]): the proposal where the context's suffix was found (all
        of it, with `full`)."""
        raise NotImplementedError

    def propose(self, state, tokens, length, key, lookahead, num_drafts, warping):
        prop, _ = self.lookup(tokens, length, lookahead)
        return as_chains(prop), state, jnp.zeros(tokens.shape[:1], bool)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NgramDrafter(Lookup):
    """Prompt lookup (module docstring)."""

    n: int = dataclasses.field(metadata=dict(static=True))  # the longest suffix matched
    vocab: int = dataclasses.field(metadata=dict(static=True))

    name = "ngram"

    @classmethod
    def make(cls, sampling: SamplingConfig, target, draft, datastore, mesh):
        return cls(sampling.ngram, target.cfg.vocab_size)

    def lookup(self, tokens, length, lookahead, full=False):
        x, matched = ngram_match(tokens, length, self.n, lookahead)
        hit = matched >= (self.n if full else 1)
        return chain(x, hit, jnp.full_like(length, lookahead), self.vocab, self.name), hit

    def describe(self) -> dict:
        return {"drafter": self.name, "ngram": self.n}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RetrievalDrafter(Lookup):
    """A datastore's continuation (module docstring)."""

    index: datastore_lib.Index  # the datastore on the devices
    n: int = dataclasses.field(metadata=dict(static=True))
    vocab: int = dataclasses.field(metadata=dict(static=True))

    name = "retrieval"
    uses_datastore = True
    needs_datastore = True

    @classmethod
    def make(cls, sampling: SamplingConfig, target, draft, datastore, mesh):
        if datastore is None:
            raise UsageError(f"drafter={sampling.drafter!r} needs a datastore (--datastore=PATH; build one with "
                             "`python -m specjax.datastore`)")
        return cls(datastore.on_mesh(mesh), sampling.ngram, target.cfg.vocab_size)

    def lookup(self, tokens, length, lookahead, full=False):
        x, size, matched = datastore_lib.lookup(self.index, tokens, length, self.n, lookahead)
        hit = (size > 0) & (matched >= (min(self.n, self.index.contexts.shape[1]) if full else 1))
        return chain(x, hit, size, self.vocab, self.name), hit

    def describe(self) -> dict:
        return {"drafter": self.name, "ngram": self.n}
