"""Drafters: who proposes the tokens that the target verifies in each loop.

A drafter is a small frozen dataclass registered as a pytree (its arrays, such as a draft
model's params or a datastore's index, are leaves; its settings are static), passed into
the compiled loop, plus a pytree `state` the loop carries. Its interface (`base.Drafter`):

  make(sampling, target, draft, datastore, mesh)  the drafter for a run, or None (ArS);
                                                  checks that what it needs was given
  init_state(prompts, prompt_lens, size, M, Prefill)  its state after the prompts (a
      draft cache), given the target's prefill of them (its cache, and its hidden states
      when `needs_features`)
  propose(state, tokens, length, key, K, M, warping)
      -> (Proposal [B, M, ...], state, nonfinite [B])
      up to K tokens per chain x, the EXACT distributions p they were drawn from after the
      same warping as q (invariant 8: the warped draft softmax for a sampled token, a point
      mass for a deterministic one), and per-chain lengths (0..K: positions past a length
      are scored, as shapes stay static, but never accepted)
  update(state, Verdict)  after verification: rows' new lengths, the kept count, the next
                          token, the kept chain and (when `needs_features`) the target's
                          hidden states along the kept path (the draft cache's rollback)

and, to grow dynamic draft trees (`grows_trees`; `decode/growth.py`), one more method:

  expand(state, carry, tokens, length, Expansion) -> (logits [B, W, V'], state, carry)
      the next-token logits after each node of a round (the first call: after the
      pending token), given its path; `draft_vocab` says which tokens V' are

and declarations (class attributes, `base.Drafter`): what it draws from
(`needs_draft_model`, `heads_kind`), `uses_datastore` / `needs_datastore`,
`several_chains`, `adaptive` (honours draft_confidence), `needs_features`, `grows_trees`,
its cap on K (`max_lookahead`) and the config that trains what it draws from
(`trained_by`). The loop, the run setup (`specjax.app.setup`), plan, bench and the flag
checks read those, never the drafter's name. Any rule that decides how much to draft looks
at the drafter's side only (invariant 9).

  model      the draft model samples K tokens (`draft_model`)
  ngram      prompt lookup in the row's own context (`lookup`)
  retrieval  a corpus's most frequent continuation (`lookup`, `datastore`)
  hybrid     per row a full-suffix lookup, else the draft model (`hybrid`)
  medusa     heads on the target's last hidden state propose all K at once (`medusa`)
  eagle      one layer drafts autoregressively in the target's feature space (`eagle`)
  eagle3     that layer over a fusion of low, middle and high target layers (`eagle`)
  parallel   a draft model with mask tokens proposes all K from one forward (`parallel`)
  hybrid_eagle3  per row a full-suffix lookup, else the EAGLE-3 layer (`hybrid`)

A new drafter is one more class and one line in REGISTRY (and its name in
`config.DRAFTERS`, with `SEVERAL_CHAINS` / `ADAPTIVE` where it declares them: the config
layer does not import this one; a test checks they agree): a self-draft (the target's own
int8/int4 copy, or its first N layers) is `model` over a derived LM (`model.SelfDraft`,
whose cache starts as the target's prefilled one: no second prefill); the heads drafters
(`heads_kind`: the run's draft is a `specjax.heads.Heads` of that kind) read the target's hidden
states (`needs_features`: `init_state` gets the prefill's, `update` the scoring pass's
along the kept path).
"""
from __future__ import annotations

from specjax.config import SamplingConfig, UsageError
from specjax.decode.drafters.base import (SOURCES, Drafter, Expansion, Prefill, Proposal, Verdict, point_mass,
                                          select)
from specjax.decode.drafters.draft_model import ModelDrafter, model_proposal, refeed_window
from specjax.decode.drafters.hybrid import HybridDrafter, HybridEagle3Drafter
from specjax.decode.drafters.lookup import NgramDrafter, RetrievalDrafter, ngram_match
from specjax.decode.drafters.eagle import Eagle3Drafter, EagleDrafter
from specjax.decode.drafters.medusa import MedusaDrafter
from specjax.decode.drafters.parallel import ParallelDrafter

REGISTRY: dict[str, type[Drafter]] = {cls.name: cls for cls in (ModelDrafter, NgramDrafter, RetrievalDrafter,
                                                                 HybridDrafter, MedusaDrafter, EagleDrafter,
                                                                 Eagle3Drafter, ParallelDrafter, HybridEagle3Drafter)}

__all__ = ["REGISTRY", "SOURCES", "Drafter", "Eagle3Drafter", "EagleDrafter", "Expansion", "HybridDrafter",
           "HybridEagle3Drafter", "MedusaDrafter", "ModelDrafter", "NgramDrafter", "ParallelDrafter", "Prefill", "Proposal",
           "RetrievalDrafter", "Verdict", "kind", "make", "model_proposal", "ngram_match", "point_mass",
           "refeed_window", "select"]


def kind(name: str) -> type[Drafter]:
    """The drafter class SamplingConfig.drafter names (its needs as class attributes)."""
    return REGISTRY[name]


def using(attribute: str) -> list[str]:
    """Names of the drafters whose class sets `attribute`, e.g. 'uses_datastore'."""
    return [name for name, cls in REGISTRY.items() if getattr(cls, attribute)]


def draft_kind(name: str) -> str | None:
    """What the drafter `name` draws from beside the target: 'model' (a draft LM),
    'heads' (draft heads on the target) or None (nothing: a lookup)."""
    cls = kind(name)
    return "heads" if cls.heads_kind else "model" if cls.needs_draft_model else None


def make(sampling: SamplingConfig, target, draft, datastore, mesh) -> Drafter | None:
    """THE place a drafter is chosen: the one `sampling.drafter` names, for a run of
    `target` (as the loop runs it) with `draft` (an LM, `Heads` or None) and `datastore`
    (a `Datastore` or None) on `mesh`; None where the run is plain autoregressive
    sampling (drafter 'model' without a draft model). A draft given to a drafter that
    needs none is not used."""
    cls = kind(sampling.drafter)
    if datastore is not None and not cls.uses_datastore:
        raise UsageError(f"a datastore is used only by drafter={' or '.join(map(repr, using('uses_datastore')))} "
                         f"(drafter={sampling.drafter!r})")
    return cls.make(sampling, target, draft if draft_kind(sampling.drafter) else None, datastore, mesh)
