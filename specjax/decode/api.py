"""The public Python API: `generate(target, draft, prompts, sampling, seed=...)`, and two
windows into it: `explain_loop` (one SpS loop, token by token) and `next_token_probs`
(the exact warped distributions, the reference for Theorem 1).

Everything on device happens in one compiled program (`program.build`: prefill + one
`lax.while_loop`); the host pads the prompts before it and checks the results after it.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import jax
import numpy as np

from specjax import distributed, model, sharding
from specjax.config import SamplingConfig, UsageError
from specjax.decode import drafters, program as program_lib, speculative
from specjax.decode.datastore import Datastore
from specjax.decode.sampling import warp
from specjax.model import LM


class NonFiniteLogitsError(FloatingPointError):
    """A model produced NaN or inf logits (or logits whose warped distribution has no
    finite mass); no token from such a step is returned."""


@dataclasses.dataclass
class Result:
    """What `generate` returns. `tokens[i]` holds row i's generated ids (prompt excluded)."""

    tokens: list[list[int]]
    mode: str  # 'sps' or 'ars'
    lookahead: int
    loops: np.ndarray  # [B] loops (ArS: steps) per row
    num_new: np.ndarray  # [B]
    accepted: np.ndarray  # [B] draft tokens accepted (SpS)
    accepted_at: np.ndarray  # [B, K] per draft position
    histogram: np.ndarray  # [B, K+1] loops by number of accepted drafts
    seconds: float  # device time of the run (compile excluded)
    compile_seconds: float
    drafted: np.ndarray | None = None  # [B, K+1] loops by number of proposed tokens (SpS)
    accepted_by: np.ndarray | None = None  # [B, len(SOURCES)] accepted tokens by drafter (SpS)
    proposed_by: np.ndarray | None = None  # [B, len(SOURCES)] proposed tokens by drafter (SpS)
    drafter: str = ""  # SamplingConfig.drafter of an SpS run
    verify: str = ""  # SamplingConfig.verify of an SpS run
    num_drafts: int = 1  # M, draft chains per loop (SpS)
    chain_won: np.ndarray | None = None  # [B, M] loops whose kept path ended on chain m (SpS)
    chain_accepted: np.ndarray | None = None  # [B, M] kept tokens by the chain picked at their depth (SpS)
    chain_proposed: np.ndarray | None = None  # [B, M] tokens proposed by chain m (SpS)

    def __post_init__(self):
        if self.drafted is None:  # counts not given: every loop drafted K tokens with the draft model
            rows = len(self.loops)
            self.drafted = np.zeros((rows, self.lookahead + 1), np.int64)
            self.drafted[:, self.lookahead] = self.loops if self.mode == "sps" else 0
            self.accepted_by = np.zeros((rows, len(drafters.SOURCES)), np.int64)
            self.accepted_by[:, 0] = self.accepted
            self.proposed_by = np.zeros((rows, len(drafters.SOURCES)), np.int64)
            self.proposed_by[:, 0] = self.drafted[:, self.lookahead] * self.lookahead
        if self.chain_won is None:  # one chain
            self.chain_won = (self.histogram[:, 1:].sum(1) if self.mode == "sps" else 0 * self.loops)[:, None]
            self.chain_accepted = self.accepted[:, None]
            self.chain_proposed = self.proposed_by.sum(1)[:, None]

    @property
    def total_tokens(self) -> int:
        return int(self.num_new.sum())

    @property
    def steps(self) -> int:
        """The longest row's new tokens: what the batch's time paid for."""
        return int(self.num_new.max(initial=0))

    @property
    def ms_per_token(self) -> float:
        """Wall time per generated token of the batch (batch 1: the paper's ms/token)."""
        return ms_per_token(self.seconds, self.steps)

    @property
    def tokens_per_loop(self) -> float:
        return float(self.num_new.sum() / max(1, self.loops.sum()))

    @property
    def proposed_rows(self) -> np.ndarray:
        """[B] tokens proposed per row: K per loop unless the draft length is adaptive or a
        lookup found nothing."""
        if self.mode != "sps":
            return np.zeros_like(self.loops)
        return self.proposed_by.sum(1)

    @property
    def proposed(self) -> int:
        return int(self.proposed_rows.sum())

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed tokens (SpS; with several drafts every chain's tokens count as
        proposed, so `accepted_path` and tokens per loop are the comparable figures); nan for
        ArS or when nothing was proposed."""
        return float(self.accepted.sum() / self.proposed) if self.proposed else math.nan

    @property
    def proposed_at(self) -> np.ndarray:
        """[K] loops (all rows) that proposed position j."""
        return self.drafted.sum(0)[::-1].cumsum()[::-1][1:]

    def by_drafter(self, counts: np.ndarray) -> dict:
        """{drafter: count} for the drafters that proposed (and the run's own drafter)."""
        return {name: int(n) for name, n in zip(drafters.SOURCES, counts) if n or name == self.drafter}

    @property
    def accepted_path(self) -> float:
        """Mean kept draft tokens per loop (the accepted path's length; tokens per loop - 1)."""
        return float(self.accepted.sum() / max(1, self.loops.sum()))

    def by_chain(self, rows=slice(None)) -> dict:
        """Several drafts: which chain won (loops whose kept path ended on it) and each
        chain's acceptance (its kept tokens / its proposed tokens), over `rows`."""
        won, kept = self.chain_won[rows].sum(0), self.chain_accepted[rows].sum(0)
        proposed = self.chain_proposed[rows].sum(0)
        return {"won_by_chain": won.tolist(), "accepted_by_chain": kept.tolist(),
                "acceptance_by_chain": (kept / np.maximum(1, proposed)).tolist()}

    def row_stats(self, i: int) -> dict:
        out = {"num_new": int(self.num_new[i]), "loops": int(self.loops[i])}
        if self.mode == "sps":
            out.update(accepted=int(self.accepted[i]), proposed=int(self.proposed_rows[i]),
                       accepted_histogram=self.histogram[i].tolist(), drafted_histogram=self.drafted[i].tolist(),
                       accepted_by=self.by_drafter(self.accepted_by[i]))
            if self.num_drafts > 1:
                out.update(self.by_chain(slice(i, i + 1)))
        return out

    def summary(self) -> dict:
        out = {"mode": self.mode, "rows": len(self.tokens), "tokens": self.total_tokens,
               "seconds": self.seconds, "compile_seconds": self.compile_seconds,
               "ms_per_token": self.ms_per_token, "tokens_per_loop": self.tokens_per_loop}
        if self.mode == "sps":
            out.update(lookahead=self.lookahead, drafter=self.drafter, verify=self.verify,
                       acceptance_rate=self.acceptance_rate,
                       acceptance_by_position=(self.accepted_at.sum(0) / np.maximum(1, self.proposed_at)).tolist(),
                       accepted_histogram=self.histogram.sum(0).tolist(),
                       drafted_histogram=self.drafted.sum(0).tolist(),
                       accepted_by=self.by_drafter(self.accepted_by.sum(0)),
                       proposed_by=self.by_drafter(self.proposed_by.sum(0)))
            if self.num_drafts > 1:
                out.update(num_drafts=self.num_drafts, accepted_path=self.accepted_path, **self.by_chain())
        return out


def ms_per_token(seconds: float, steps: int) -> float:
    """THE ms/token: wall time over sequential token steps (a batch's longest row; at
    batch 1, the paper's ms/token). nan before anything was generated."""
    return 1000.0 * seconds / steps if steps else math.nan


@dataclasses.dataclass
class Totals:
    """Several `Result`s of one mode added up, with the same definitions as `Result`."""

    runs: int = 0
    rows: int = 0
    tokens: int = 0
    steps: int = 0
    loops: int = 0
    accepted: int = 0
    proposed: int = 0
    seconds: float = 0.0
    compile_seconds: float = 0.0
    accepted_by: dict = dataclasses.field(default_factory=dict)  # drafter -> accepted tokens (SpS)
    proposed_by: dict = dataclasses.field(default_factory=dict)  # drafter -> proposed tokens (SpS)
    chain_won: list = dataclasses.field(default_factory=list)  # [M] loops whose kept path ended on chain m (SpS)

    def add(self, result: Result, rows: int | None = None) -> None:
        """Add a run; `rows` counts only its first rows (the others padded the batch)."""
        n = len(result.tokens) if rows is None else rows
        self.runs += 1
        self.rows += n
        self.tokens += int(result.num_new[:n].sum())
        self.loops += int(result.loops[:n].sum())
        self.accepted += int(result.accepted[:n].sum())
        self.proposed += int(result.proposed_rows[:n].sum())
        self.steps += result.steps
        self.seconds += result.seconds
        self.compile_seconds += result.compile_seconds
        if result.mode == "sps":
            won = result.chain_won[:n].sum(0).tolist()
            self.chain_won = [a + b for a, b in zip(self.chain_won, won)] if self.chain_won else won
            for total, counts in ((self.accepted_by, result.accepted_by), (self.proposed_by, result.proposed_by)):
                for name, k in result.by_drafter(counts[:n].sum(0)).items():
                    total[name] = total.get(name, 0) + k

    @property
    def ms_per_token(self) -> float:
        return ms_per_token(self.seconds, self.steps)

    @property
    def tokens_per_loop(self) -> float:
        return self.tokens / self.loops if self.loops else math.nan

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else math.nan

    def as_dict(self) -> dict:
        return {"seconds": self.seconds, "tokens": self.tokens, "steps": self.steps, "loops": self.loops,
                "ms_per_token": self.ms_per_token, "tokens_per_loop": self.tokens_per_loop,
                "acceptance_rate": None if math.isnan(self.acceptance_rate) else self.acceptance_rate,
                **({"accepted_by": self.accepted_by, "proposed_by": self.proposed_by} if self.proposed_by else {})}


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
    settings = prog.settings
    return Result(generated, prog.mode, prog.lookahead, stats.loops, stats.num_new, stats.accepted,
                  stats.accepted_at, stats.histogram, seconds, compile_seconds, stats.drafted, stats.accepted_by,
                  stats.proposed_by, settings.get("drafter", ""), settings.get("verify", ""),
                  settings.get("num_drafts", 1), stats.chain_won, stats.chain_accepted, stats.chain_proposed)


# --------------------------------------------------------------------------- explain


@dataclasses.dataclass
class LoopTrace:
    """The first SpS loop after a prompt, as `generate` with the same seed runs it."""

    draft_tokens: list[int]  # x_1..x_L, proposed (L = K unless adaptive or a lookup found less)
    p: np.ndarray  # [L, V] their distributions p_1..p_L (the draft's warped ones; point masses for lookups)
    q: np.ndarray  # [L+1, V] the target's q_1..q_{L+1}, from its one scoring pass
    num_accepted: int  # n: x_1..x_n were kept
    next_token: int  # drawn from the residual at n+1, or the bonus from q_{L+1} (n == L)
    verify: str = "tokenwise"  # the rule that decided n: 'tokenwise' (accept_prob's tests), 'block' or 'tree'
    # (several drafts: draft_tokens, p and q are the winning chain's, the one whose path was kept)

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
def explain_program(target, draft, datastore, prompts, prompt_lens, seed, *, warping, lookahead, verify, drafter,
                    ngram, draft_confidence, num_drafts, max_new, eos_id, size):
    del max_new, eos_id  # one loop: no stopping rule
    settings = speculative.Settings(lookahead, warping, verify, drafter, ngram, draft_confidence, num_drafts)
    state = speculative.start(target, draft, prompts, prompt_lens, program_lib.seed_key(seed), lookahead, size,
                              num_drafts)
    _, sp = speculative.speculate(target, draft, datastore, state, settings)
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
        raise UsageError("explain_loop shows one speculative loop and needs a draft model (got draft=None) or a "
                         "lookup drafter (sampling.drafter='ngram' or 'retrieval')")
    with jax.set_mesh(prog.mesh):
        out = explain_program(*prog.args, **prog.settings)
    x, p, length, q, n, token = distributed.fetch(out)
    m = int(length[0])
    rule = "tree" if prog.settings["num_drafts"] > 1 else prog.settings["verify"]
    return LoopTrace(x[0, :m].tolist(), p[0, :m], q[0, :m + 1], int(n[0]), int(token[0]), rule)


@functools.partial(jax.jit, static_argnames=("warping",))
def probs_program(lm, tokens, *, warping):
    return warp(model.full_forward(lm, tokens), warping)  # (probs, bad)


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
    with jax.set_mesh(mesh):
        out = probs_program(lm, tokens, warping=program_lib.warping_of(sampling))
    probs, bad = distributed.fetch(out)
    if bad.any():
        where = [tuple(int(i) for i in ix) for ix in np.argwhere(bad)[:5]]
        raise NonFiniteLogitsError(f"the model produced NaN or inf logits at (sequence, position) {where}"
                                   + (f" and {int(bad.sum()) - 5} more" if bad.sum() > 5 else "")
                                   + "; check the checkpoint and dtype")
    return probs
