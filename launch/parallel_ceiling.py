"""How far a drafter that does not see its own earlier drafts can go on a target: the
ceiling of a parallel or block drafter (PARD's mask tokens, DFlash's block, Medusa's
heads) at draft positions 2 and 3, against the 1.0 of an autoregressive one.

    python launch/parallel_ceiling.py --config=mini --contexts=60
    python launch/parallel_ceiling.py --config=mini --contexts=20 --depth=3 --candidates=12
    python launch/parallel_ceiling.py --gguf_target=SmolLM2.gguf --quantize=w4a8 \
        --prompts_file=launch/real_prompts.jsonl --chat --contexts=20 --candidates=16

A drafter that proposes x_j without seeing x_1..x_{j-1} proposes one distribution m_j
whatever they are, and the target's verifier tests x_j against q_j(. | ctx, x_<j): given
x_<j accepted, x_j is accepted with sum_x min(q_j(x | ctx, x_<j), m_j(x)) (`verify`'s
acceptance for a token drawn from m_j). The script reports c_j, the most the mean of that
over x_<j ~ q can be for any m_j (the acceptance of a perfect parallel drafter there), and
beside it the acceptance of the marginal m_j = E_{x_<j ~ q}[q_j(. | ctx, x_<j)], which a
trained one approximates. An autoregressive drafter (the model, EAGLE) can in principle
reach 1 at every position. The question is one of sampling: at temperature 0 every x_<j is
the argmax, known in advance, and the bound is 1 at every position.

Contexts are the target's own samples (what the speculation loop sees): ArS continues
`--num_prompts` HumanEval prompts (or every prompt of `--prompts_file`, through the model's
chat template with `--chat`) by `--max_new_tokens` tokens with the config's sampling
(temperature, top-k, top-p: the same warp as every distribution here), and `--contexts`
positions are drawn from the continuations. x_1 (and x_2) are enumerated over the
`--candidates` most likely tokens of each distribution; the mass they cover is reported,
and the expectations are over that covered mass (renormalised). Every forward runs over
one fixed width (the batch right-padded: causal attention, so padding after a position
does not change its distribution) and at most 32 rows (fewer where the vocabulary is large:
a forward returns every position's distribution), so the target compiles for two or three
shapes.

The bound at position j is over x_<j drawn from the target's own distributions (as a
perfect drafter's accepted drafts are); it is an upper bound because the dual of that
concave problem gives one (`dual_bound`), and the marginal's own acceptance is printed
beside it. From them, an estimate (not a bound) of the tokens a loop of K drafts keeps at
best: 1 + sum_{j=1..K} prod_{i<=j} c_i with c_1 = 1 (a perfect first draft), c_2 (and
c_3) the means measured, and every later position at the last one measured (it is blind
to more drafts); printed for K = 2..8, to hold against an autoregressive drafter's
measured tokens per loop.
"""
from __future__ import annotations

import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

import numpy as np  # noqa: E402
from absl import flags  # noqa: E402
from tqdm import tqdm  # noqa: E402

from specjax.app import cli  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
    cli.define_config_flag("mini")
    cli.define_weight_flags()
    flags.DEFINE_integer("num_prompts", 6, "HumanEval prompts continued by the target.")
    flags.DEFINE_integer("max_new_tokens", 96, "Tokens the target samples after each prompt.")
    flags.DEFINE_integer("contexts", 60, "Positions drawn from the continuations.")
    flags.DEFINE_integer("candidates", 64, "Most likely tokens enumerated for each earlier draft position.")
    flags.DEFINE_integer("depth", 2, "The last draft position measured: 2, or 3 (candidates^2 sequences a context).")
    flags.DEFINE_integer("seed", 0, "Sampling and context-choice seed.")
    flags.DEFINE_string("prompts_file", None, "Prompts from this file instead (one per line, or JSONL with "
                        "\"prompt\" or \"prompt_tokens\", as sample's), all of them (--num_prompts is ignored).")
    cli.define_chat_flag()
    cli.define_quantize_flag()


def dual_bound(w: np.ndarray, q: np.ndarray, grid: int = 201) -> float:
    """An upper bound on max over distributions m of f(m) = sum_x sum_r w_r min(q_r(x), m(x))
    (w sums to 1): f is separable and concave, so by Lagrangian duality f(m) <= D(lam) = lam +
    sum_x max_v [g_x(v) - lam v] for every lam >= 0, g_x(v) = sum_r w_r min(q_r(x), v). The
    inner maximum is at v = the value where the weight of rows with q_r(x) above it falls
    to lam (g_x's slope), one of the q_r(x); min over a grid of lam in [0, 1] (f's slopes
    lie there) is within the grid's step of max f, and never below it."""
    order = np.argsort(-q, axis=0)
    qs = np.take_along_axis(q, order, axis=0)  # [R, V] each column descending
    cw = np.cumsum(w[order], axis=0)  # weight of the rows at or above each
    best = np.inf
    for lam in np.linspace(0.0, 1.0, grid):
        k = (cw <= lam).sum(0)  # the first row whose cumulative weight passes lam
        v = np.where(k < len(w), qs[np.minimum(k, len(w) - 1), np.arange(q.shape[1])], 0.0)
        g = (w[:, None] * np.minimum(q, v[None])).sum(0)
        best = min(best, lam + float((g - lam * v).sum()))
    return min(best, 1.0)


def main(argv):
    from specjax.app import prompts as prompts_lib, setup
    from specjax.decode import api, program

    contexts, candidates = cli.positive("contexts", FLAGS.contexts), cli.positive("candidates", FLAGS.candidates)
    num_prompts, max_new = cli.positive("num_prompts", FLAGS.num_prompts), cli.positive("max_new_tokens",
                                                                                         FLAGS.max_new_tokens)
    if FLAGS.depth not in (2, 3):
        raise cli.UsageError(f"--depth={FLAGS.depth}: must be 2 or 3")
    if FLAGS.depth == 3 and candidates > 64:  # checked before any weights load
        raise cli.UsageError(f"--candidates={candidates} with --depth=3: at most 64 (candidates^2 sequences a "
                             "context are scored)")
    seed = cli.seed("seed", FLAGS.seed)
    raw = prompts_lib.gather(prompts_file=FLAGS.prompts_file) if FLAGS.prompts_file else None
    config = cli.config()
    sampling = dataclasses.replace(config.sampling, max_new_tokens=max_new, eos_id=-1)
    sources = cli.sources()
    run = setup.prepare(setup.Request(config, sampling, (), sources=sources, quantize=cli.quantize()))
    run.locate()
    run.load()
    target = run.target
    vocab = target.cfg.vocab_size
    if candidates > vocab:
        raise cli.UsageError(f"--candidates={candidates}: the vocabulary has {vocab} tokens")
    if raw is not None:
        prompts = [p.tokens for p in prompts_lib.encode(raw, run.tokenizer, run.no_tokenizer_reason, chat=FLAGS.chat)]
    else:
        prompts = prompts_lib.bench_prompts("humaneval", run.tokenizer, num_prompts, vocab, 64, seed, chat=FLAGS.chat)
    out = api.generate(target, None, prompts, sampling, seed=seed)
    rng = np.random.default_rng(seed)
    pool = [(i, t) for i, (p, new) in enumerate(zip(prompts, out.tokens)) for t in range(len(p) + 1, len(p) + len(new))]
    if not pool:
        raise cli.UsageError("the continuations are empty: raise --max_new_tokens")
    chosen = [pool[k] for k in rng.choice(len(pool), min(contexts, len(pool)), replace=False)]
    width = program.bucket(max(len(p) + len(n) for p, n in zip(prompts, out.tokens)) + FLAGS.depth)

    rows_a_forward = max(1, min(32, (256 << 20) // (width * vocab * 4)))  # its output at most 256 MiB

    def last_probs(rows: list[list[int]]) -> np.ndarray:
        """The warped distribution after each row ([len(rows), V]), rows padded to `width`,
        at most `rows_a_forward` rows a forward, the last forward padded with empty rows (a
        forward returns every position's distribution: a depth-3 context's candidates^2 rows
        at once would hold candidates^2 * width * V floats)."""
        chunk, found = min(rows_a_forward, len(rows)), []
        for i in range(0, len(rows), chunk):
            part = rows[i:i + chunk]
            padded = [r + [0] * (width - len(r)) for r in part] + [[0] * width] * (chunk - len(part))
            probs = api.next_token_probs(target, padded, sampling)
            found.append(probs[np.arange(len(part)), [len(r) - 1 for r in part]])
        return np.concatenate(found)

    def ceiling(weights: np.ndarray, q: np.ndarray) -> tuple[float, float]:
        """(the best any one m can do, the marginal's): over the rows r (probabilities
        `weights`, renormalised) of distributions q_r, E_r[sum_x min(q_r(x), m(x))] for the
        weighted marginal m, and an upper bound on its maximum over every distribution m,
        from the dual of that concave problem (module docstring)."""
        w = weights / weights.sum()
        marginal = (w[:, None] * q).sum(0)
        return dual_bound(w, q), float((np.minimum(q, marginal[None]).sum(1) * w).sum())

    c2, c3, cover, entropy = [], [], [], []
    for i, t in tqdm(chosen, unit="context", file=sys.stderr):
        ctx = (prompts[i] + out.tokens[i])[:t]
        q1 = last_probs([ctx])[0]
        top1 = np.argsort(-q1)[:candidates]
        q2 = last_probs([ctx + [int(x)] for x in top1])
        c2.append(ceiling(q1[top1], q2))
        kept = q1[q1 > 0]
        entropy.append(float(-(kept * np.log(kept)).sum()))
        mass = q1[top1]
        if FLAGS.depth == 3:
            top2 = np.argsort(-q2, axis=1)[:, :candidates]  # [N, N]
            rows = [ctx + [int(a), int(b)] for a, bs in zip(top1, top2) for b in bs]
            q3 = last_probs(rows)
            joint = (mass[:, None] * np.take_along_axis(q2, top2, axis=1)).reshape(-1)
            c3.append(ceiling(joint, q3))
            mass = joint
        cover.append(float(mass.sum()))
    named = ", ".join(f"{k} {os.path.basename(str(v))}" for k, v in sources.named().items())
    print(f"{run.config.name}{f' ({named})' if named else ''}{f', {FLAGS.quantize}' if cli.quantize() else ''}: "
          f"{len(chosen)} contexts from the target's samples (temperature {sampling.temperature}, "
          f"top-k {sampling.top_k}, top-p {sampling.top_p}); q_1's entropy {np.mean(entropy):.2f} nats (mean)")
    for j, cs in ((2, c2), (3, c3)):
        if cs:
            best, marginal = np.array(cs).T
            print(f"  position {j}, blind to x_<{j}: at most {best.mean():.3f} (mean; median {np.median(best):.3f}, "
                  f"quartiles {np.percentile(best, 25):.3f}-{np.percentile(best, 75):.3f}); the marginal's "
                  f"{marginal.mean():.3f}")
    print(f"  the {candidates} candidates per position cover {np.mean(cover):.3f} of the mass (mean)")
    cs = [1.0] + [float(np.mean([c[0] for c in cj])) for cj in (c2, c3) if cj]
    estimate = []
    for K in range(2, 9):
        prod, total = 1.0, 1.0
        for j in range(K):
            prod *= cs[min(j, len(cs) - 1)]
            total += prod
        estimate.append(f"K={K} {total:.2f}")
    print(f"  tokens a loop keeps at best, estimated (c_1 = 1, c_j = c_{len(cs)} past position {len(cs)}): "
          + ", ".join(estimate))

if __name__ == "__main__":
    define_flags()
    cli.run(main)
