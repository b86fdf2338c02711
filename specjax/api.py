"""The public Python API: `generate(target, draft, prompts, sampling, seed=...)`, and two
windows into it: `explain_loop` (one SpS loop, token by token) and `next_token_probs`
(the exact warped distributions, the reference for Theorem 1).

Everything on device happens in one compiled program (prefill + one `lax.while_loop`);
the host pads the prompts before it and checks the results after it.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import sharding, speculative
from specjax.config import SamplingConfig, UsageError
from specjax.model import LM
from specjax.sampling import Warp, autoregressive_generate, empty_cache, warp
from specjax.speculative import speculative_generate


class NonFiniteLogitsError(FloatingPointError):
    """A model produced NaN or inf logits; no token from such a step is returned."""


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

    @property
    def total_tokens(self) -> int:
        return int(self.num_new.sum())

    @property
    def ms_per_token(self) -> float:
        """Wall time per generated token of the batch (batch 1: the paper's ms/token)."""
        return 1000.0 * self.seconds / max(1, int(self.num_new.max(initial=0)))

    @property
    def tokens_per_loop(self) -> float:
        return float(self.num_new.sum() / max(1, self.loops.sum()))

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (SpS); nan for ArS."""
        proposed = self.loops.sum() * self.lookahead
        return float(self.accepted.sum() / proposed) if self.mode == "sps" and proposed else float("nan")

    def row_stats(self, i: int) -> dict:
        out = {"num_new": int(self.num_new[i]), "loops": int(self.loops[i])}
        if self.mode == "sps":
            out.update(accepted=int(self.accepted[i]), proposed=int(self.loops[i] * self.lookahead),
                       accepted_histogram=self.histogram[i].tolist())
        return out

    def summary(self) -> dict:
        out = {"mode": self.mode, "rows": len(self.tokens), "tokens": self.total_tokens,
               "seconds": self.seconds, "compile_seconds": self.compile_seconds,
               "ms_per_token": self.ms_per_token, "tokens_per_loop": self.tokens_per_loop}
        if self.mode == "sps":
            out.update(lookahead=self.lookahead, acceptance_rate=self.acceptance_rate,
                       acceptance_by_position=(self.accepted_at.sum(0) / max(1, self.loops.sum())).tolist(),
                       accepted_histogram=self.histogram.sum(0).tolist())
        return out


def mesh_of(lm: LM) -> jax.sharding.Mesh:
    return jax.tree.leaves(lm.params)[0].sharding.mesh


@functools.partial(jax.jit, static_argnames=("warping", "lookahead", "max_new", "eos_id", "size"))
def sps_program(target, draft, prompts, prompt_lens, key, *, warping, lookahead, max_new, eos_id, size):
    return speculative_generate(target, draft, prompts, prompt_lens, key, warping=warping,
                                lookahead=lookahead, max_new=max_new, eos_id=eos_id, size=size)


@functools.partial(jax.jit, static_argnames=("warping", "max_new", "eos_id", "size"))
def ars_program(target, prompts, prompt_lens, key, *, warping, max_new, eos_id, size):
    return autoregressive_generate(target, prompts, prompt_lens, key, warping=warping, max_new=max_new,
                                   eos_id=eos_id, size=size)


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int, max_seq_len: int,
                  max_new_tokens: int) -> None:
    if not prompts:
        raise UsageError("no prompts given")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise UsageError(f"prompt {i} is empty: every prompt needs at least one token")
        bad = [t for t in prompt if not 0 <= int(t) < vocab_size]
        if bad:
            raise UsageError(f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {vocab_size})")
        if len(prompt) + max_new_tokens > max_seq_len:
            raise UsageError(f"prompt {i} has {len(prompt)} tokens; with max_new_tokens={max_new_tokens} "
                             f"that exceeds the model's context of {max_seq_len} tokens")


def prepare(target: LM, draft: LM | None, prompts, sampling: SamplingConfig, seed: int, pad_to: int = 16):
    """Validate and pad prompts; returns the jitted function and its arguments, placed
    on the mesh (so the run itself needs no host<->device transfer)."""
    sampling.validate()
    lm_cfgs = [target.cfg] + ([draft.cfg] if draft is not None else [])
    check_prompts(prompts, target.cfg.vocab_size, min(c.max_seq_len for c in lm_cfgs), sampling.max_new_tokens)
    mesh = mesh_of(target)
    lookahead = sampling.lookahead if draft is not None else 1
    longest = max(len(p) for p in prompts)
    width = max(pad_to, 1 << (longest - 1).bit_length())  # power-of-two buckets: few recompiles
    size = width + sampling.max_new_tokens + lookahead + 1
    padded = np.zeros((len(prompts), width), np.int32)
    for i, prompt in enumerate(prompts):
        padded[i, :len(prompt)] = prompt
    lens = np.array([len(p) for p in prompts], np.int32)
    batch = len(prompts)
    args = (jax.device_put(padded, sharding.named(mesh, ("batch", None), padded.shape)),
            jax.device_put(lens, sharding.named(mesh, ("batch",), lens.shape)),
            jax.device_put(jax.random.key(seed), sharding.replicated(mesh)))
    warping = Warp(float(sampling.temperature), int(sampling.top_k), float(sampling.top_p))
    statics = dict(warping=warping, max_new=sampling.max_new_tokens, eos_id=sampling.eos_id, size=size)
    if draft is not None:
        return mesh, sps_program, (target, draft) + args, dict(statics, lookahead=lookahead), batch, width
    return mesh, ars_program, (target,) + args, statics, batch, width


# XLA:CPU (jaxlib 0.10) hands multi-row dots to YNNPACK fusions by default; for the
# few-row matmuls of decoding they are slower than XLA's own dot emitter: mini_target's
# 5-token scoring pass 24 -> 16 ms with them off, one token unchanged, a 128-token prefill
# 100 -> 91 ms (BENCHMARKS.md section 5). Every program compiled here for a CPU turns them
# off; other backends get no options.
CPU_COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


def compile_lowered(lowered):
    """Compile with CPU_COMPILER_OPTIONS on a CPU backend (without them where this jaxlib
    does not know the option)."""
    if jax.default_backend() == "cpu":
        try:
            return lowered.compile(compiler_options=CPU_COMPILER_OPTIONS)
        except jax.errors.JaxRuntimeError as e:
            if "No such compile option" not in str(e):
                raise
    return lowered.compile()


_COMPILED: dict = {}


def compile_cached(fn, args, statics):
    """AOT-compile once per (program, shapes, shardings, settings), so timings exclude compiles."""
    leaves, treedef = jax.tree.flatten(args)
    key = (fn, treedef, tuple((x.shape, str(x.dtype), x.sharding) for x in leaves), tuple(sorted(statics.items())))
    if key not in _COMPILED:
        _COMPILED[key] = compile_lowered(fn.lower(*args, **statics))
    return _COMPILED[key]


def generate(target: LM, draft: LM | None, prompts: Sequence[Sequence[int]],
             sampling: SamplingConfig = SamplingConfig(), *, seed: int = 0, pad_to: int = 16) -> Result:
    """Sample continuations of `prompts` (lists of token ids) from `target`.

    With a `draft`, speculative sampling with K = sampling.lookahead (Algorithm 2);
    with draft=None, plain autoregressive sampling (Algorithm 1). Both give samples
    distributed exactly as the target's (warped) distribution; greedy (temperature 0)
    gives identical tokens. Prompts are right-padded to a power of two >= `pad_to`
    tokens, so prompts of similar length share one compiled program."""
    mesh, fn, args, statics, batch, width = prepare(target, draft, prompts, sampling, seed, pad_to)
    start = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = compile_cached(fn, args, statics)
        compile_seconds = time.perf_counter() - start
        start = time.perf_counter()
        with jax.transfer_guard("disallow"):
            out = compiled(*args)
            jax.block_until_ready(out)
    seconds = time.perf_counter() - start
    tokens, length, stats = jax.device_get(out)
    if stats.nonfinite.any():
        rows = np.flatnonzero(stats.nonfinite).tolist()
        raise NonFiniteLogitsError(f"the model produced NaN or inf logits for batch rows {rows}; "
                                   "check the checkpoint and dtype (no tokens from those steps were used)")
    lens = [len(p) for p in prompts]
    generated = [tokens[i, lens[i]:length[i]].tolist() for i in range(batch)]
    return Result(generated, "sps" if draft is not None else "ars", statics.get("lookahead", 1),
                  stats.loops, stats.num_new, stats.accepted, stats.accepted_at, stats.histogram,
                  seconds, compile_seconds)


# --------------------------------------------------------------------------- explain


@dataclasses.dataclass
class LoopTrace:
    """The first SpS loop after a prompt, as `generate` with the same seed runs it."""

    draft_tokens: list[int]  # x_1..x_K, sampled by the draft
    p: np.ndarray  # [K, V] the draft's warped distributions p_1..p_K
    q: np.ndarray  # [K+1, V] the target's q_1..q_{K+1}, from its one scoring pass
    num_accepted: int  # n: x_1..x_n were kept
    next_token: int  # drawn from norm(max(0, q_{n+1} - p_{n+1})), or the bonus from q_{K+1} (n == K)

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
        """[K] min(1, q_j(x_j) / p_j(x_j)): the chance each draft token passes its test."""
        return np.minimum(1.0, self.q_draft / self.p_draft)

    @property
    def status(self) -> list[str]:
        """Per draft position: 'accepted', 'rejected' (the first failed test) or 'not reached'."""
        n = self.num_accepted
        return ["accepted" if j < n else "rejected" if j == n else "not reached" for j in range(self.lookahead)]

    @property
    def bonus(self) -> bool:
        """True when all K drafts were accepted and `next_token` came from q_{K+1}."""
        return self.num_accepted == self.lookahead

    @property
    def tokens(self) -> list[int]:
        """What the loop emits: x_1..x_n, then the residual or bonus token."""
        return self.draft_tokens[:self.num_accepted] + [self.next_token]


@functools.partial(jax.jit, static_argnames=("warping", "lookahead", "size"))
def explain_program(target, draft, prompts, prompt_lens, key, *, warping, lookahead, size):
    state = speculative.start(target, draft, prompts, prompt_lens, key, lookahead, size)
    _, sp = speculative.speculate(target, draft, state, lookahead, warping)
    return sp.x, sp.p, sp.q, sp.num_accepted, sp.next_token


def explain_loop(target: LM, draft: LM, prompt: Sequence[int], sampling: SamplingConfig = SamplingConfig(),
                 *, seed: int = 0, pad_to: int = 16) -> LoopTrace:
    """Run the first SpS loop for one prompt and return what happened in it: the K draft
    tokens with p and q, the accept/reject outcome and the residual or bonus token. It
    calls the same `speculative.speculate` as the fused loop, with the same key, so
    `trace.tokens` are the first tokens `generate(target, draft, [prompt], sampling,
    seed=seed)` emits (when max_new_tokens allows)."""
    mesh, _, args, statics, _, _ = prepare(target, draft, [prompt], sampling, seed, pad_to)
    with jax.set_mesh(mesh):
        out = explain_program(*args, warping=statics["warping"], lookahead=statics["lookahead"],
                              size=statics["size"])
    x, p, q, n, token = jax.device_get(out)
    return LoopTrace(x[0].tolist(), p[0], q[0], int(n[0]), int(token[0]))


@functools.partial(jax.jit, static_argnames=("warping",))
def probs_program(lm, tokens, *, warping):
    batch, length = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    logits, _ = lm(tokens, positions, empty_cache(lm, batch, length))
    return warp(logits, warping)


def next_token_probs(lm: LM, sequences: Sequence[Sequence[int]],
                     sampling: SamplingConfig = SamplingConfig()) -> np.ndarray:
    """probs[b, t] = the distribution of the token after sequences[b][:t+1], warped as
    `sampling` says (temperature, top-k, top-p), float32 [B, T, V]. One full forward pass
    of equal-length sequences; nothing is sampled. Multiplying these along enumerated
    continuations gives the exact distribution that ArS and SpS samples follow (Theorem 1)."""
    sampling.validate()
    sequences = [[int(t) for t in s] for s in sequences]
    lengths = {len(s) for s in sequences}
    if len(lengths) > 1:
        raise UsageError(f"sequences have different lengths {sorted(lengths)}: next_token_probs needs equal lengths")
    check_prompts(sequences, lm.cfg.vocab_size, lm.cfg.max_seq_len, 0)
    tokens = np.asarray(sequences, np.int32)
    mesh = mesh_of(lm)
    tokens = jax.device_put(tokens, sharding.named(mesh, ("batch", None), tokens.shape))
    with jax.set_mesh(mesh):
        probs = probs_program(lm, tokens, warping=Warp(float(sampling.temperature), int(sampling.top_k),
                                                         float(sampling.top_p)))
    return np.asarray(jax.device_get(probs))
