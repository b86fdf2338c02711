"""Decode statistics: the per-row counters the loops keep on device (`Stats`, updated by
`counted` once per SpS loop), and what `generate` returns on the host (`Result`), with
several results added up (`Totals`). ms/token has one definition (`ms_per_token`)."""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from specjax.decode.drafters.base import SOURCES


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Stats:
    """Per-row counters, returned with the tokens."""

    loops: jax.Array  # [B] loops (ArS: steps) while the row was active
    num_new: jax.Array  # [B] tokens generated
    accepted: jax.Array  # [B] draft tokens accepted (SpS)
    accepted_at: jax.Array  # [B, K] loops in which draft position j was accepted
    histogram: jax.Array  # [B, K+1] loops that accepted exactly n draft tokens
    drafted: jax.Array  # [B, K+1] loops that proposed exactly n tokens (all K unless adaptive or a lookup)
    accepted_by: jax.Array  # [B, drafters] accepted tokens by the drafter that proposed them
    proposed_by: jax.Array  # [B, drafters] proposed tokens by drafter
    nonfinite: jax.Array  # [B] a NaN/inf logit was seen
    # Per draft chain m (SpS; one chain unless num_drafts > 1):
    chain_won: jax.Array  # [B, M] loops whose kept path ended on chain m (loops keeping nothing: none)
    chain_accepted: jax.Array  # [B, M] kept tokens, by the chain picked at their depth
    chain_proposed: jax.Array  # [B, M] tokens chain m proposed
    scored: jax.Array  # [B] positions the target's passes scored while the row was active (SpS)

    @classmethod
    def zeros(cls, batch: int, lookahead: int, drafters: int = 3, num_drafts: int = 1) -> "Stats":
        z = jnp.zeros((batch,), jnp.int32)
        hist = jnp.zeros((batch, lookahead + 1), jnp.int32)
        by = jnp.zeros((batch, drafters), jnp.int32)
        chains = jnp.zeros((batch, num_drafts), jnp.int32)
        return cls(z, z, z, jnp.zeros((batch, lookahead), jnp.int32), hist, hist, by, by,
                   jnp.zeros((batch,), bool), chains, chains, chains, z)


def counted(st: Stats, sp, active: jax.Array, count: jax.Array, bad: jax.Array) -> Stats:
    """`st` plus one loop of `sp` (a `speculative.Speculation`) for the `active` rows
    (`count` tokens emitted each).
    Kept tokens count for the chain of the node kept at their depth and for its drafter
    (with several drafts, hybrid's chain 0 may be a lookup's and the others the model's)."""
    K, M = sp.path.shape[1] - 1, st.chain_won.shape[1]
    n, nodes = sp.num_accepted, sp.nodes
    live = active[:, None].astype(jnp.int32)
    one_hot = lambda i, size: (i[..., None] == jnp.arange(size)).astype(jnp.int32)
    sources = st.accepted_by.shape[1]
    kept = (jnp.arange(K)[None, :] < n[:, None]).astype(jnp.int32)  # [B, K]
    along = lambda a: jnp.take_along_axis(a, jnp.maximum(sp.path[:, 1:] - 1, 0), axis=1)  # at the kept nodes
    drafted = nodes.drafted.astype(jnp.int32)[..., None]
    return Stats(
        loops=st.loops + active,
        num_new=st.num_new + count,
        accepted=st.accepted + jnp.where(active, n, 0),
        accepted_at=st.accepted_at + live * kept,
        histogram=st.histogram + live * (jnp.arange(K + 1)[None, :] == n[:, None]),
        drafted=st.drafted + live * (jnp.arange(K + 1)[None, :] == sp.length[:, None]),
        accepted_by=st.accepted_by + live * jnp.sum(one_hot(along(nodes.source), sources) * kept[..., None], axis=1),
        proposed_by=st.proposed_by + live * jnp.sum(one_hot(nodes.source, sources) * drafted, axis=1),
        nonfinite=st.nonfinite | bad,
        chain_won=st.chain_won + live * one_hot(sp.chain, M) * (n > 0)[:, None],
        chain_accepted=st.chain_accepted + live * jnp.sum(one_hot(along(nodes.branch), M) * kept[..., None], axis=1),
        chain_proposed=st.chain_proposed + live * jnp.sum(one_hot(nodes.branch, M) * drafted, axis=1),
        scored=st.scored + jnp.where(active, sp.scored, 0))


@dataclasses.dataclass(kw_only=True)
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
    scored: np.ndarray | None = None  # [B] positions the target's passes scored (SpS; None: K+1 a loop)

    def __post_init__(self):
        if self.drafted is None:  # counts not given: every loop drafted K tokens with the draft model
            rows = len(self.loops)
            self.drafted = np.zeros((rows, self.lookahead + 1), np.int64)
            self.drafted[:, self.lookahead] = self.loops if self.mode == "sps" else 0
            self.accepted_by = np.zeros((rows, len(SOURCES)), np.int64)
            self.accepted_by[:, 0] = self.accepted
            self.proposed_by = np.zeros((rows, len(SOURCES)), np.int64)
            self.proposed_by[:, 0] = self.drafted[:, self.lookahead] * self.lookahead
        if self.scored is None:  # every pass scored the whole chain (or tree) and the pending token
            self.scored = self.loops * (self.lookahead + 1) if self.mode == "sps" else 0 * self.loops
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
        return {name: int(n) for name, n in zip(SOURCES, counts) if n or name == self.drafter}

    @property
    def scored_per_loop(self) -> float:
        """Mean positions a loop's target pass scored (K + 1 unless pass_width='proposed')."""
        return float(self.scored.sum() / max(1, self.loops.sum()))

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
                       proposed_by=self.by_drafter(self.proposed_by.sum(0)),
                       scored_per_loop=self.scored_per_loop)
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
    scored: int = 0  # positions the target's passes scored (SpS)

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
            self.scored += int(result.scored[:n].sum())
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
