"""`python -m specjax.bench --config=mini --lookahead=1,2,3,4,5,6,8`: ArS vs SpS, one process.

Same compiled models, same prompts, batch 1 (the paper's setting) unless --batch_sizes
asks for more. For every K it reports the time to generate --max_new_tokens tokens
(mean, std, P50/P90/P99 over prompts), ms/token, speedup over ArS, tokens per loop,
acceptance rate, and the time per loop next to its model: K draft steps + one target
pass over K+1 tokens (both timed separately here), which says where the time goes.
Writes --json and, with --plot, the three Figure-1 panels as one PNG.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags, logging

import specjax
from specjax import cli, kv_cache
from specjax.config import UsageError

FLAGS = flags.FLAGS
cli.define_config_flag("mini")
flags.DEFINE_string("lookahead", "1,2,3,4,5,6,8", "Comma-separated K values.")
flags.DEFINE_string("batch_sizes", "1", "Comma-separated batch sizes (SpS at the config's K vs ArS).")
flags.DEFINE_integer("num_prompts", 8, "Prompts (HumanEval with a tokenizer, random ids without).")
flags.DEFINE_integer("prompt_len", 64, "Random-id prompt length when there is no tokenizer.")
flags.DEFINE_integer("max_new_tokens", 128, "Tokens per sequence (Figure 1 uses 128).")
flags.DEFINE_enum("init", "checkpoint", ["checkpoint", "random"], "random: random weights.")
flags.DEFINE_string("json", None, "Write the results here.")
flags.DEFINE_string("plot", None, "Write the Figure-1 panels (PNG) here.")
flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.DEFINE_integer("repeats", 20, "Repeats for the single-pass timings.")


def int_list(name: str) -> list[int]:
    try:
        values = [int(v) for v in getattr(FLAGS, name).split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise UsageError(f"--{name}={getattr(FLAGS, name)!r}: expected comma-separated positive integers")
    return values


def time_forward(lm, tokens: int, context: int, repeats: int) -> float:
    """Seconds for one cached forward of `tokens` new tokens at batch 1 after `context`."""
    mesh = specjax.api.mesh_of(lm)
    with jax.set_mesh(mesh):
        cache = kv_cache.init_cache(lm.cfg, 1, context + tokens + 1, mesh).with_lengths(jnp.array([context]))
        ids = jnp.zeros((1, tokens), jnp.int32)
        pos = context + jnp.arange(tokens, dtype=jnp.int32)[None]
        step = specjax.api.compile_lowered(jax.jit(lambda lm, t, p, c: lm(t, p, c)[0]).lower(lm, ids, pos, cache))
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
        out.append(specjax.generate(target, draft, [prompt], sampling, seed=seed + i))
    return out


def describe(results) -> dict:
    seconds = np.array([r.seconds for r in results])
    tokens = np.array([r.total_tokens for r in results])
    loops = np.array([r.loops.sum() for r in results])
    row = {"seconds_mean": float(seconds.mean()), "seconds_std": float(seconds.std()),
           "p50": float(np.percentile(seconds, 50)), "p90": float(np.percentile(seconds, 90)),
           "p99": float(np.percentile(seconds, 99)),
           "ms_per_token": float(1000 * seconds.sum() / tokens.sum()),
           "tokens_per_loop": float(tokens.sum() / loops.sum()),
           "ms_per_loop": float(1000 * seconds.sum() / loops.sum())}
    if results[0].mode == "sps":
        k = results[0].lookahead
        row["acceptance_rate"] = float(sum(r.accepted.sum() for r in results) / (loops.sum() * k))
        row["accepted_per_k_plus_1"] = float(sum(r.accepted.sum() for r in results) / loops.sum() / (k + 1))
    return row


def plot(report: dict, path: str) -> None:
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
    fig.savefig(path, dpi=120)


def main(argv):
    if len(argv) > 1:
        raise UsageError(f"unexpected arguments {argv[1:]}")
    logging.set_verbosity(logging.ERROR)
    ks, batch_sizes = int_list("lookahead"), int_list("batch_sizes")
    config = cli.config()
    if config.draft is None:
        raise UsageError(f"--config={FLAGS.config}: has no draft model; bench compares ArS with SpS")
    from specjax import demo, prompts as prompts_lib  # model/tokenizer loading shared with specjax.sample
    weights = demo.Weights.locate(config, FLAGS.init, None, None, need_draft=True, train_missing=False)
    tokenizer = weights.tokenizer()
    target, draft = weights.load(demo.make_mesh(config.mesh, {"target": config.target, "draft": config.draft}),
                                 need_draft=True)
    if tokenizer is not None:
        prompts = [p.tokens for p in prompts_lib.encode(prompts_lib.humaneval(FLAGS.num_prompts), tokenizer)]
    else:
        rng = np.random.default_rng(FLAGS.seed)
        prompts = [rng.integers(0, config.target.vocab_size, FLAGS.prompt_len).tolist()
                   for _ in range(FLAGS.num_prompts)]
    base = dataclasses.replace(config.sampling, max_new_tokens=FLAGS.max_new_tokens, eos_id=-1)
    context = max(len(p) for p in prompts)
    draft_step = time_forward(draft, 1, context, FLAGS.repeats)
    target_step = time_forward(target, 1, context, FLAGS.repeats)
    report = {"config": config.name, "machine": f"{jax.device_count()}x {jax.devices()[0].device_kind}",
              "max_new_tokens": FLAGS.max_new_tokens, "num_prompts": len(prompts),
              "sampling": dataclasses.asdict(base), "init": FLAGS.init,
              "draft_forward_ms": 1000 * draft_step, "target_forward_ms": 1000 * target_step,
              "target_scoring_ms": {}}
    run_prompts(target, None, prompts[:1], base, FLAGS.seed)  # compile outside the timing
    ars = describe(run_prompts(target, None, prompts, base, FLAGS.seed))
    report["ars"] = ars
    print(f"ArS: {ars['ms_per_token']:.2f} ms/token; draft forward {1000 * draft_step:.2f} ms, "
          f"target forward {1000 * target_step:.2f} ms (1 token)")
    report["sps"] = []
    for k in ks:
        sampling = dataclasses.replace(base, lookahead=k)
        score = time_forward(target, k + 1, context, FLAGS.repeats)
        report["target_scoring_ms"][k + 1] = 1000 * score
        run_prompts(target, draft, prompts[:1], sampling, FLAGS.seed)
        results = run_prompts(target, draft, prompts, sampling, FLAGS.seed)
        row = dict(describe(results), lookahead=k, speedup=ars["ms_per_token"] / describe(results)["ms_per_token"],
                   model_ms_per_loop=1000 * (k * draft_step + score),
                   tokens_per_sequence=float(np.mean([r.total_tokens for r in results])))
        report["sps"].append(row)
        print(f"K={k}: SpS {row['ms_per_token']:.2f} ms/token ({row['speedup']:.2f}x), "
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
            specjax.generate(target, d, batch, base, seed=FLAGS.seed)
            r = specjax.generate(target, d, batch, base, seed=FLAGS.seed)
            row[f"{mode}_ms_per_token"] = r.ms_per_token
        row["speedup"] = row["ars_ms_per_token"] / row["sps_ms_per_token"]
        report["batch"].append(row)
        print(f"batch {b}: ArS {row['ars_ms_per_token']:.2f} ms/token, SpS {row['sps_ms_per_token']:.2f} "
              f"ms/token ({row['speedup']:.2f}x)")
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump(report, f, indent=1)
    if FLAGS.plot:
        plot(report, FLAGS.plot)
    sys.stdout.flush()


if __name__ == "__main__":
    cli.run(main)
