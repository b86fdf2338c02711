"""The public Python API: `generate(target, draft, prompts, sampling, seed=...)`, and two
windows into it: `explain_loop` (one SpS loop, token by token) and `next_token_probs`
(the exact warped distributions, the reference for Theorem 1).

Everything on device happens in one compiled program (`program.build`: prefill + one
`lax.while_loop`); the host pads the prompts before it and checks the results after it.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import numpy as np

from specjax import distributed, model, sharding
from specjax.config import SamplingConfig, UsageError
from specjax.decode import program as program_lib, speculative, verify
from specjax.decode.retrieval_index import Datastore
from specjax.decode.metrics import Result
from specjax.decode.warping import warp
from specjax.model import LM


class NonFiniteLogitsError(FloatingPointError):
    """A model produced NaN or inf logits (or logits whose warped distribution has no
    finite mass); no token from such a step is returned."""


def generate(target: LM, draft: LM | None, prompts: Sequence[Sequence[int]],
             sampling: SamplingConfig = SamplingConfig(), *, seed: int = 0, pad_to: int = program_lib.PAD_TO,
             names: Sequence[str] | None = None, datastore: Datastore | None = None) -> Result:
    """Sample continuations of `prompts` (lists of token ids) from `target`.

    With a `draft`, speculative sampling with K = sampling.lookahead (Algorithm 2);
    with draft=None, plain autoregressive sampling (Algorithm 1). sampling.drafter
    'ngram' (prompt lookup) or 'retrieval' (from `datastore`) is speculative sampling
    without a draft model; 'hybrid' falls back to the draft where a lookup finds nothing.
    Every mode gives samples distributed exactly as the target's (warped) distribution;
    greedy (temperature 0) gives identical tokens. Prompts are right-padded to a power of
    two >= `pad_to` tokens, so prompts of similar length share one compiled program. With
    several processes, every process passes the same prompts and gets the same Result."""
    prog = program_lib.build(target, draft, prompts, sampling, seed, pad_to, names, datastore)
    (tokens, length, stats), seconds, compile_seconds = prog.run()
    if stats.nonfinite.any():
        rows = np.flatnonzero(stats.nonfinite).tolist()
        raise NonFiniteLogitsError(f"the model produced NaN or inf logits for batch rows {rows}; "
                                   "check the checkpoint and dtype (no tokens from those steps were used)")
    generated = [tokens[i, n:length[i]].tolist() for i, n in enumerate(prog.prompt_lens)]
    sps = prog.mode == "sps"
    return Result(tokens=generated, mode=prog.mode, lookahead=prog.lookahead, loops=stats.loops,
                  num_new=stats.num_new, accepted=stats.accepted, accepted_at=stats.accepted_at,
                  histogram=stats.histogram, seconds=seconds, compile_seconds=compile_seconds,
                  drafted=stats.drafted, accepted_by=stats.accepted_by, proposed_by=stats.proposed_by,
                  drafter=prog.sampling.drafter if sps else "", verify=prog.sampling.verify if sps else "",
                  num_drafts=prog.sampling.num_drafts if sps else 1, chain_won=stats.chain_won,
                  chain_accepted=stats.chain_accepted, chain_proposed=stats.chain_proposed,
                  scored=stats.scored if sps else None)


# --------------------------------------------------------------------------- explain


@dataclasses.dataclass
class LoopTrace:
    """The first SpS loop after a prompt, as `generate` with the same seed runs it."""

    draft_tokens: list[int]  # x_1..x_L, proposed (L = K unless adaptive or a lookup found less)
    p: np.ndarray  # [L, V] their distributions p_1..p_L (the draft's warped ones; point masses for lookups)
    q: np.ndarray  # [L+1, V] the target's q_1..q_{L+1}, from its one scoring pass
    num_accepted: int  # n: x_1..x_n were kept
    next_token: int  # drawn from the residual at n+1, or the bonus from q_{L+1} (n == L)
    # The rule that decided n: 'tokenwise' (accept_prob's tests), 'block', 'greedy', 'tree' or 'tree_greedy'.
    verify: str = "tokenwise"
    # (several drafts: draft_tokens, p and q are the winning chain's, the one whose path was kept; a grown
    # tree's: its kept path, then the first child of each node below it)

    @property
    def lookahead(self) -> int:
        return len(self.draft_tokens)

    @property
    def p_draft(self) -> np.ndarray:
        """[K] p_j(x_j)."""
        return self.p[np.arange(self.lookahead), self.draft_tokens]

    @property
    def q_draft(self) -> np.ndarray:
        """[K] q_j(x_j)."""
        return self.q[np.arange(self.lookahead), self.draft_tokens]

    @property
    def accept_prob(self) -> np.ndarray:
        """[L] min(1, q_j(x_j) / p_j(x_j)): the chance each draft token passes the token-wise
        test (block verification decides jointly, and keeps at least as many in expectation)."""
        return np.minimum(1.0, self.q_draft / self.p_draft)

    @property
    def status(self) -> list[str]:
        """Per draft position: 'accepted', 'rejected' (the first failed test) or 'not reached'."""
        n = self.num_accepted
        return ["accepted" if j < n else "rejected" if j == n else "not reached" for j in range(self.lookahead)]

    @property
    def bonus(self) -> bool:
        """True when all proposed tokens were accepted and `next_token` came from q_{L+1}."""
        return self.num_accepted == self.lookahead

    @property
    def tokens(self) -> list[int]:
        """What the loop emits: x_1..x_n, then the residual or bonus token."""
        return self.draft_tokens[:self.num_accepted] + [self.next_token]


@functools.partial(jax.jit, static_argnames=program_lib.SPS_STATICS)
def explain_program(target, drafter, prompts, prompt_lens, warp_values, seed, max_new, *, settings, eos_id, size):
    del max_new, eos_id  # one loop: no stopping rule
    settings = settings.bind(warp_values)
    state = speculative.start(target, drafter, prompts, prompt_lens, program_lib.seed_key(seed), settings, size)
    _, sp = speculative.speculate(target, drafter, state, settings)
    return sp.x, sp.p, sp.length, sp.q, sp.num_accepted, sp.next_token


def explain_loop(target: LM, draft: LM | None, prompt: Sequence[int], sampling: SamplingConfig = SamplingConfig(),
                 *, seed: int = 0, pad_to: int = program_lib.PAD_TO, datastore: Datastore | None = None) -> LoopTrace:
    """Run the first SpS loop for one prompt and return what happened in it: the proposed
    tokens with p and q, the verifier's outcome and the residual or bonus token. It calls
    the same `speculative.speculate` as the fused loop, with the same key, so
    `trace.tokens` are the first tokens `generate(target, draft, [prompt], sampling,
    seed=seed)` emits (when max_new_tokens allows)."""
    prog = program_lib.build(target, draft, [prompt], sampling, seed, pad_to, datastore=datastore)
    if prog.mode != "sps":
        raise UsageError("explain_loop shows one speculative loop and needs a draft model or draft heads (got draft=None) or a "
                         "lookup drafter (sampling.drafter='ngram' or 'retrieval')")
    with jax.set_mesh(prog.mesh):
        out = explain_program(*prog.args, **prog.settings)
    x, p, length, q, n, token = distributed.fetch(out)
    m = int(length[0])
    rule = verify.chosen(prog.sampling.verify, prog.sampling.num_drafts, prog.sampling.draft_tree == "dynamic",
                         prog.sampling.temperature == 0)
    return LoopTrace(x[0, :m].tolist(), p[0, :m], q[0, :m + 1], int(n[0]), int(token[0]), rule)


@functools.partial(jax.jit, static_argnames=("warping",))
def probs_program(lm, tokens, warp_values, *, warping):
    return warp(model.full_forward(lm, tokens), warping.bind(warp_values))  # (probs, bad)


def next_token_probs(lm: LM, sequences: Sequence[Sequence[int]],
                     sampling: SamplingConfig = SamplingConfig()) -> np.ndarray:
    """probs[b, t] = the distribution of the token after sequences[b][:t+1], warped as
    `sampling` says (temperature, top-k, top-p), float32 [B, T, V]. One full forward pass
    of equal-length sequences; nothing is sampled. Multiplying these along enumerated
    continuations gives the exact distribution that ArS and SpS samples follow (Theorem 1)."""
    sampling.validate()
    program_lib.check_models(lm, None)
    sequences = program_lib.as_token_lists(sequences)
    lengths = {len(s) for s in sequences}
    if len(lengths) > 1:
        raise UsageError(f"sequences have different lengths {sorted(lengths)}: next_token_probs needs equal lengths")
    program_lib.check_prompts(sequences, lm.cfg.vocab_size, lm.cfg.max_seq_len + 1, 0)
    tokens = np.asarray(sequences, np.int32)
    mesh = program_lib.mesh_of(lm)
    tokens = distributed.put(tokens, sharding.named(mesh, ("batch", None), tokens.shape))
    warping = program_lib.warping_of(sampling, lm.kernels)
    values = distributed.put(warping.values(), sharding.replicated(mesh))
    with jax.set_mesh(mesh):
        out = probs_program(lm, tokens, values, warping=warping.static())
    probs, bad = distributed.fetch(out)
    if bad.any():
        where = [tuple(int(i) for i in ix) for ix in np.argwhere(bad)[:5]]
        raise NonFiniteLogitsError(f"the model produced NaN or inf logits at (sequence, position) {where}"
                                   + (f" and {int(bad.sum()) - 5} more" if bad.sum() > 5 else "")
                                   + "; check the checkpoint and dtype")
    return probs
