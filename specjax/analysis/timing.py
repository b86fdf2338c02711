"""ArS vs SpS in one process, same compiled models, same prompts (what `specjax.bench`
runs): time per sequence with its spread and percentiles, ms/token, speedup, tokens per
loop, acceptance, and the time per loop next to its model, K draft steps + one target
pass over K+1 tokens (both timed on their own), which says where the time goes; the
three Figure-1 panels as one PNG."""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax import kv_cache
from specjax.decode import program as program_lib
from specjax.decode.api import Totals, generate


def time_forward(lm, tokens: int, context: int, repeats: int) -> float:
    """Seconds for one cached forward of `tokens` new tokens at batch 1 after `context`."""
    mesh = program_lib.mesh_of(lm)
    with jax.set_mesh(mesh):
        cache = kv_cache.init_cache(lm.cfg, 1, context + tokens + 1, mesh).with_lengths(jnp.array([context]))
        cache = lm.with_position_table(cache)  # as after a prefill: not timed as part of the step
        ids = jnp.zeros((1, tokens), jnp.int32)
        pos = context + jnp.arange(tokens, dtype=jnp.int32)[None]
        step = program_lib.compile_lowered(jax.jit(lambda lm, t, p, c: lm(t, p, c)[0]).lower(lm, ids, pos, cache))
        jax.block_until_ready(step(lm, ids, pos, cache))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(step(lm, ids, pos, cache))
            times.append(time.perf_counter() - start)
    return float(np.median(times))


def run_prompts(target, draft, prompts, sampling, seed):
    """One generate call per prompt (batch 1); returns per-sequence results."""
    out = []
    for i, prompt in enumerate(prompts):
        out.append(generate(target, draft, [prompt], sampling, seed=seed + i))
    return out


def describe(results) -> dict:
    """Per-sequence spread and percentiles, and the totals (`Totals`: the one ms/token)."""
    seconds = np.array([r.seconds for r in results])
    totals = Totals()
    for r in results:
        totals.add(r)
    row = {"seconds_mean": float(seconds.mean()), "seconds_std": float(seconds.std()),
           "p50": float(np.percentile(seconds, 50)), "p90": float(np.percentile(seconds, 90)),
           "p99": float(np.percentile(seconds, 99)),
           "ms_per_token": totals.ms_per_token, "tokens_per_loop": totals.tokens_per_loop,
           "ms_per_loop": 1000 * totals.seconds / totals.loops}
    if results[0].mode == "sps":
        row["acceptance_rate"] = totals.acceptance_rate
        row["accepted_per_k_plus_1"] = totals.accepted / totals.loops / (results[0].lookahead + 1)
    return row


def plot(report: dict) -> bytes:
    """The three Figure-1 panels (time per sequence, acceptance, time per loop vs K), as PNG."""
    import io

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ks = [r["lookahead"] for r in report["sps"]]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    n = report["max_new_tokens"]
    axes[0].errorbar(ks, [r["seconds_mean"] * 1000 for r in report["sps"]],
                     yerr=[r["seconds_std"] * 1000 for r in report["sps"]], marker="o", capsize=3, label="SpS")
    axes[0].axhline(report["ars"]["seconds_mean"] * 1000, color="gray", ls="--", label="ArS")
    axes[0].set(xlabel="K (lookahead)", ylabel=f"ms per {n} tokens", title="Time per sequence (mean, std)")
    axes[0].legend()
    axes[1].plot(ks, [r["acceptance_rate"] for r in report["sps"]], marker="o", label="acceptance rate")
    axes[1].plot(ks, [r["accepted_per_k_plus_1"] for r in report["sps"]], marker="s",
                 label="mean accepted / (K+1)")
    axes[1].set(xlabel="K (lookahead)", title="Acceptance efficiency", ylim=(0, 1))
    axes[1].legend()
    axes[2].plot(ks, [r["ms_per_loop"] for r in report["sps"]], marker="o", label="measured")
    axes[2].plot(ks, [r["model_ms_per_loop"] for r in report["sps"]], marker="x", ls=":",
                 label="K x draft step + target(K+1)")
    axes[2].set(xlabel="K (lookahead)", ylabel="ms", title="Time per loop")
    axes[2].legend()
    fig.suptitle(f"{report['config']}: {report['machine']}")
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    plt.close(fig)
    return png.getvalue()


def bench(target, draft, prompts, base, ks, batch_sizes, repeats: int, seed: int, log=print) -> dict:
    """The whole comparison: single-pass costs, ArS, SpS for every K, batch scaling.
    `base` is the SamplingConfig (eos_id -1: every sequence has the same length)."""
    context = max(len(p) for p in prompts)
    draft_step = time_forward(draft, 1, context, repeats)
    target_step = time_forward(target, 1, context, repeats)
    report = {"max_new_tokens": base.max_new_tokens, "num_prompts": len(prompts),
              "sampling": dataclasses.asdict(base), "draft_forward_ms": 1000 * draft_step,
              "target_forward_ms": 1000 * target_step, "target_scoring_ms": {}}
    run_prompts(target, None, prompts[:1], base, seed)  # compile outside the timing
    ars = describe(run_prompts(target, None, prompts, base, seed))
    report["ars"] = ars
    log(f"ArS: {ars['ms_per_token']:.2f} ms/token; draft forward {1000 * draft_step:.2f} ms, "
        f"target forward {1000 * target_step:.2f} ms (1 token)")
    report["sps"] = []
    for k in ks:
        sampling = dataclasses.replace(base, lookahead=k)
        score = time_forward(target, k + 1, context, repeats)
        report["target_scoring_ms"][k + 1] = 1000 * score
        run_prompts(target, draft, prompts[:1], sampling, seed)
        results = run_prompts(target, draft, prompts, sampling, seed)
        row = describe(results)
        row.update(lookahead=k, speedup=ars["ms_per_token"] / row["ms_per_token"],
                   model_ms_per_loop=1000 * (k * draft_step + score),
                   tokens_per_sequence=float(np.mean([r.total_tokens for r in results])))
        report["sps"].append(row)
        log(f"K={k}: SpS {row['ms_per_token']:.2f} ms/token ({row['speedup']:.2f}x), "
            f"{row['tokens_per_loop']:.2f} tokens/loop, acceptance {row['acceptance_rate']:.3f}, "
            f"loop {row['ms_per_loop']:.2f} ms vs model {row['model_ms_per_loop']:.2f} ms "
            f"(target scoring {k + 1} tokens: {1000 * score:.2f} ms = {score / target_step:.2f}x one token)")
    report["batch"] = []
    for b in batch_sizes:
        if b == 1:
            continue
        batch = [prompts[i % len(prompts)] for i in range(b)]
        row = {"batch": b}
        for mode, d in (("ars", None), ("sps", draft)):
            generate(target, d, batch, base, seed=seed)
            row[f"{mode}_ms_per_token"] = generate(target, d, batch, base, seed=seed).ms_per_token
        row["speedup"] = row["ars_ms_per_token"] / row["sps_ms_per_token"]
        report["batch"].append(row)
        log(f"batch {b}: ArS {row['ars_ms_per_token']:.2f} ms/token, SpS {row['sps_ms_per_token']:.2f} "
            f"ms/token ({row['speedup']:.2f}x)")
    return report
