"""`eagle` and `eagle3`: one decoder layer drafts autoregressively in the target's feature
space (`specjax.heads.EagleHead`; Li et al. 2024, arXiv 2401.15077; EAGLE-3: Li et al.
2025, arXiv 2503.01840).

The layer reads (the target's feature at position j, the embedding of token j+1) and
predicts the feature at j+1, whose unembedding (the target's) gives token j+2. Each
loop: a first pass over a window of K+1 pairs built from the TRUE features the previous
scoring pass returned (`Verdict.features`, the kept path's nodes) and the tokens after
them; its output at the last true pair predicts the feature at the pending token, which
gives x_1; then K-1 steps feed the layer's own predicted feature with the token just
drawn. Each x_j is drawn from its warped softmax, p_j is exactly that distribution, and
verification is unchanged (exact). One chain (M = 1), or a grown tree (`expand`: one
pass of the layer per round over that round's nodes, `decode/growth.py`). A layer with a
draft vocabulary
(`HeadsConfig.draft_vocab`) scores its feature against those N tokens only (a copy of
the unembedding's N columns, whole on every device: no collective, N/V of the reads): x_j
is drawn from the warped softmax over them and p_j is that distribution, zero on the
other tokens, so verification still yields the target's distribution.

The state: the layer's own KV cache (one layer), the window of true features [B, K+1, D],
how many of them are real (`count`: the kept tokens + 1) and the position of the first
(`start`). The cache holds the pairs of true features before `start`; the window pass
rewrites the rest, so the next loop always starts from the target's features for the
accepted prefix, never from the layer's own predictions. After the prompts the window is
the prefill's feature at the second-to-last prompt token (count 1), and the cache the
pairs before it.

`eagle3` is the same drafter over heads of kind 'eagle3': the target's feature is then
several layers' residual streams (`HeadsConfig.feature_layers`), which the scoring pass
and the prefill return concatenated (the forward's `features`, this drafter's
`features`) and the window holds as they are; the window pass fuses them into the
layer's D-wide feature (`EagleHead.fuse`), and the draft steps read the layer's own
output, unfused, as it was trained to (the training-time test).
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from specjax.config import SamplingConfig
from specjax.decode.drafters.base import SOURCES, Drafter, Expansion, Proposal, Verdict
from specjax.decode.warping import draw, warp
from specjax import heads as heads_lib
from specjax.heads import Heads
from specjax import kv_cache
from specjax.kv_cache import KVCache
from specjax.model import LM, whole_table


class EagleState(NamedTuple):
    cache: KVCache  # the layer's own, holding the pairs of true features before `start`
    window: jax.Array  # [B, K+1, D] true features from `start` on (eagle3: [B, K+1, len(feature_layers) * D])
    count: jax.Array  # [B] how many window features are real (1..K+1)
    start: jax.Array  # [B] the position of window[:, 0]


def window_at(features: jax.Array, start: jax.Array, width: int) -> jax.Array:
    """features [B, W, D] at positions start[b] .. start[b] + width - 1 (clipped) -> [B, width, D]."""
    index = jnp.clip(start[:, None] + jnp.arange(width)[None, :], 0, features.shape[1] - 1)
    return jnp.take_along_axis(features, index[:, :, None], axis=1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EagleDrafter(Drafter):
    """The module docstring's drafter: `heads` (kind 'eagle') over `target`'s features."""

    heads: Heads
    target: LM  # the loop's target: its embedding and unembedding, shared
    lookahead: int = dataclasses.field(metadata=dict(static=True))
    # On a 'model'-split mesh, the target's embedding whole on every device
    # (`model.whole_table`): the token each step drew is embedded by a local gather, so a
    # step's only collectives are the layer's own 2 all-reduces (the vocab-parallel
    # lookup was a third), for V x D more bytes per chip. None on one device.
    table: Any = None
    # What a predicted feature is scored against: the target's unembedding, or its columns
    # for the layer's draft vocabulary (`heads.Unembedding`).
    unembed: Any = None
    # A narrow layer with a draft vocabulary: its draft steps fold w_up into the columns
    # and the next step's w_feature (`heads.Folded`; then `unembed` is the folded one).
    feature_weight: Any = None
    # ... and an EAGLE-3 one's window pass w_fuse into w_feature (`heads.Folded.window`).
    window_weight: Any = None
    # > 0: a row stops drafting after a draft distribution whose top probability is below
    # it (SamplingConfig.draft_confidence; EAGLE-2's confidence, on the layer's side only).
    confidence: float = dataclasses.field(default=0.0, metadata=dict(static=True))

    name = "eagle"
    heads_kind = "eagle"
    needs_features = True
    adaptive = True
    trained_by = "mini_eagle"
    grows_trees = True

    @property
    def features(self):
        return self.heads.features

    @classmethod
    def make(cls, sampling: SamplingConfig, target: LM, draft, datastore, mesh):
        heads = heads_lib.checked(draft, target.cfg, cls.heads_kind, sampling.drafter)
        fold = heads_lib.folded(heads, target)  # from the float layer, quantized and packed as the layer is
        unembed = fold.unembed if fold is not None else heads_lib.unembedding(heads, target)
        return cls(heads.packed(target), target, sampling.lookahead, whole_table(target), unembed,
                   None if fold is None else fold.feature, None if fold is None else fold.window,
                   sampling.draft_confidence)

    def init_state(self, prompts, prompt_lens, size, num_drafts, prefilled) -> EagleState:
        features = prefilled.features
        batch, width = prompts.shape
        positions = jnp.broadcast_to(jnp.arange(width - 1, dtype=jnp.int32), (batch, width - 1))
        _, cache = self.heads.eagle_step(self.target, self.heads.fused(features[:, :-1], self.target.kernels),
                                         prompts[:, 1:], positions, self.heads.empty_cache(batch, size), self.table)
        start = jnp.maximum(prompt_lens - 2, 0)
        return EagleState(cache.with_lengths(start), window_at(features, start, self.lookahead + 1),
                          jnp.ones((batch,), jnp.int32), start)

    def window_pass(self, state: EagleState, tokens):
        """A loop's first pass, over the window of true features and the tokens after them.
        -> (the predicted feature at the pending token [B, 1, D, or W when folded], the
        layer's cache holding the pairs before the pending token, its position [B])."""
        positions = state.start[:, None] + jnp.arange(state.window.shape[1])[None, :]
        after = jnp.take_along_axis(tokens, jnp.clip(positions + 1, 0, tokens.shape[1] - 1), axis=1)
        if self.window_weight is None:
            window, weight = self.heads.fused(state.window, self.target.kernels), None
        else:  # w_fuse folded into w_feature: the layers only normalised
            window, weight = self.heads.normalized(state.window), self.window_weight
        predicted, cache = self.heads.eagle_step(self.target, window, after, positions, state.cache,
                                                 self.table, weight, up=self.feature_weight is None)
        pending = state.start + state.count  # the pending token's position
        cache = cache.with_lengths(pending)  # the pairs of true features; the rest is rewritten
        return jnp.take_along_axis(predicted, (state.count - 1)[:, None, None], axis=1), cache, pending

    def propose(self, state: EagleState, tokens, length, key, lookahead, num_drafts, warping, active=None):
        """`active` [B, 1] (hybrid): rows whose chain is drawn; the others propose nothing.
        A row also stops after a draw whose top probability is below `confidence` (the
        plain softmax's at temperature 0, where the warped one is a point mass), its later
        positions scored but never accepted. Where no row drafts on, the rest of the draws
        and layer steps are skipped (`lax.cond`; only with `active` or `confidence`, so a
        plain chain compiles as before). The window pass always runs: the layer's cache
        needs the pairs it writes, whoever proposed this loop's tokens."""
        batch, K = tokens.shape[0], lookahead
        folded = self.feature_weight is not None  # then `feature` below is the block's W-wide output
        feature, cache, pending = self.window_pass(state, tokens)
        keys = jax.random.split(key, K)
        unembed = self.unembed if self.unembed is not None else heads_lib.Unembedding(self.target)
        skippable = self.confidence > 0 or active is not None

        def drafted(feature, going, j):
            # Over the draft vocabulary where the layer has one: x is drawn from the warped
            # softmax over its N tokens, and p is that distribution, zero elsewhere.
            logits = unembed.logits(feature)[:, 0]
            probs, bad = warp(logits, warping)
            x, empty = draw(keys[j], probs, warping)
            still = going
            if self.confidence > 0:
                sure = jnp.max(probs if not warping.greedy else jax.nn.softmax(logits, axis=-1), axis=-1)
                still = going & (sure >= self.confidence)
            return (unembed.tokens(x), unembed.spread(probs), (bad | empty) & going), still

        def nothing(feature, going, j):  # no row drafts position j: what `drafted` gives, all zero
            shapes = jax.eval_shape(drafted, feature, going, j)[0]
            return tuple(jnp.zeros(a.shape, a.dtype) for a in shapes), going

        def draw_at(feature, going, j):  # position j's draw, skipped where no row drafts on
            return jax.lax.cond(jnp.any(going), drafted, nothing, feature, going, j) if skippable \
                else drafted(feature, going, j)

        def step(carry, j):
            feature, cache, going = carry
            drawn, still = draw_at(feature, going, j)

            def feed():
                return self.heads.eagle_step(self.target, feature, drawn[0][:, None], (pending + j)[:, None], cache,
                                             self.table, self.feature_weight, up=not folded)

            feature, cache = jax.lax.cond(jnp.any(still), feed, lambda: (feature, cache)) if skippable else feed()
            return (feature, cache, still), (*drawn, going)

        going = jnp.ones((batch,), bool) if active is None else active[:, 0]
        (feature, cache, going), (xs, ps, bads, drafting) = jax.lax.scan(step, (feature, cache, going),
                                                                         jnp.arange(K - 1))
        (x_last, p_last, bad_last), _ = draw_at(feature, going, K - 1)
        x = jnp.concatenate([xs, x_last[None]], axis=0).T  # [B, K]
        p = jnp.concatenate([ps, p_last[None]], axis=0).transpose(1, 0, 2)  # [B, K, V]
        bad = jnp.any(bads, axis=0) | bad_last
        drafted_length = jnp.sum(drafting, axis=0) + going  # each row's positions drawn while it drafted
        prop = Proposal(x[:, None], p[:, None], drafted_length.astype(jnp.int32)[:, None],
                        jnp.full((batch, 1), SOURCES.index(self.name), jnp.int32))
        return prop, state._replace(cache=cache), bad

    def expand(self, state: EagleState, carry, tokens, length, nodes: Expansion):
        """A grown tree's rounds (`decode/growth.py`): the root call is the window pass;
        each round one pass of the layer over its nodes' pairs (the parent's predicted
        feature, the node's token) at the parent's position, attending to the layer's
        cache and, through `carry`, to the pairs of their ancestors in earlier rounds."""
        unembed = self.unembed if self.unembed is not None else heads_lib.Unembedding(self.target)
        batch, W = nodes.tokens.shape
        if carry is None:
            feature, cache, pending = self.window_pass(state, tokens)
            block = heads_lib.eagle_block_config(self.heads.model, self.heads.cfg)
            shape = (1, batch, nodes.num_nodes, block.num_kv_heads, block.head_dim)
            empty = jnp.zeros(shape, jnp.dtype(block.compute_dtype))
            features = jnp.zeros((batch, nodes.num_nodes + 1, feature.shape[-1]), feature.dtype).at[:, :1].set(feature)
            prior = kv_cache.Prior(empty, empty, jnp.zeros((batch, nodes.num_nodes), jnp.int32))
            return unembed.logits(feature), state._replace(cache=cache), (prior, features, pending)
        prior, features, pending = carry
        positions = (pending - 1)[:, None] + nodes.depth  # a node's pair sits at its parent's position, as in `propose`
        visible = jnp.concatenate([nodes.above, jnp.broadcast_to(jnp.eye(W, dtype=bool), (batch, W, W))], axis=2)
        parents = jnp.take_along_axis(features, nodes.parent[:, :, None], axis=1)
        predicted, fresh = self.heads(parents, self.target.embed(nodes.tokens, self.table), positions, state.cache,
                                      visible, self.target.kernels, self.feature_weight, self.feature_weight is None,
                                      prior)
        put = lambda buffer, new, at, axis: jax.lax.dynamic_update_slice_in_dim(  # noqa: E731
            buffer, new.astype(buffer.dtype), at, axis)
        at = nodes.first - 1  # among nodes 1..N; `features` holds node 0's too
        prior = kv_cache.Prior(put(prior.k, fresh.k, at, 2), put(prior.v, fresh.v, at, 2),
                               put(prior.positions, positions, at, 1))
        return unembed.logits(predicted), state, (prior, put(features, predicted, nodes.first, 1), pending)

    @property
    def draft_vocab(self):
        return None if self.unembed is None else self.unembed.ids

    def update(self, state: EagleState, verdict: Verdict) -> EagleState:
        """The kept path's true features become the next window: the old pending token's
        (node 0) through the last kept node's; the cache rolls back to before them."""
        start = jnp.maximum(verdict.length - 2 - verdict.num_accepted, 0)  # the old pending token's position
        return EagleState(state.cache.with_lengths(start), verdict.features, verdict.num_accepted + 1, start)

    def describe(self) -> dict:
        return {"drafter": self.name, "draft_confidence": self.confidence}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Eagle3Drafter(EagleDrafter):
    """`EagleDrafter` over an EAGLE-3 layer (heads of kind 'eagle3'): the module docstring.
    It grows trees as EAGLE does: the root call's window pass fuses the target's layers,
    and each round reads its parents' predicted features, unfused, as the draft steps do."""

    name = "eagle3"
    heads_kind = "eagle3"
    trained_by = "mini_eagle3"
