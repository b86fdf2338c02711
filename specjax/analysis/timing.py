"""ArS vs SpS in one process, same compiled models, same prompts (what `specjax.bench`
runs): time per sequence with its spread and percentiles, ms/token, speedup, tokens per
loop, acceptance, and the time per loop next to its model, K draft steps + one target
pass over K+1 tokens (both timed on their own), which says where the time goes; SpS
variants (verifier, drafter, adaptive draft length) side by side; the three Figure-1
panels as one PNG, one line per variant."""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax import kv_cache
from specjax.config import UsageError
from specjax.decode import retrieval_index as datastore_lib, drafters, program as program_lib, tree as tree_lib
from specjax.decode.api import generate
from specjax.decode.metrics import Totals


def time_forward(lm, tokens: int, context: int, repeats: int, batch: int = 1, tree: tuple[int, int] | None = None
                 ) -> float:
    """Seconds for one cached forward of `tokens` new tokens per row after `context`; with
    `tree` = (M, K), the tree pass over 1 + M*K tokens that several drafts score."""
    lm = lm.packed()  # as the decode programs run it
    mesh = program_lib.mesh_of(lm)
    if tree is not None:
        tokens = 1 + tree[0] * tree[1]
    with jax.set_mesh(mesh):
        cache = kv_cache.init_cache(lm.cfg, batch, context + tokens + 1, mesh).with_lengths(
            jnp.full((batch,), context))
        cache = lm.with_position_table(cache)  # as after a prefill: not timed as part of the step
        ids = jnp.zeros((batch, tokens), jnp.int32)
        parent, depth = tree_lib.chain_parents(*tree) if tree is not None else (None, None)
        offsets = jnp.arange(tokens, dtype=jnp.int32) if tree is None else jnp.asarray(np.concatenate([[0], depth]))
        pos = jnp.broadcast_to(context + offsets[None], (batch, tokens))
        ancestors = None if tree is None else tree_lib.ancestors(parent)
        step = program_lib.compile_lowered(
            jax.jit(lambda lm, t, p, c: lm(t, p, c, ancestors)[0]).lower(lm, ids, pos, cache))
        jax.block_until_ready(step(lm, ids, pos, cache))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(step(lm, ids, pos, cache))
            times.append(time.perf_counter() - start)
    return float(np.median(times))


def time_lookup(mesh, datastore, lookahead: int, ngram: int, context: int, repeats: int) -> dict:
    """Milliseconds of the lookup drafters' device work alone at batch 1 after `context`
    tokens: the n-gram match over the token buffer and (given a datastore) its query."""
    size = context + 256
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (1, size)), jnp.int32)
    length = jnp.array([context], jnp.int32)
    parts = {"ngram": (jax.jit(drafters.ngram_match, static_argnums=(2, 3)), (tokens, length, ngram, lookahead))}
    if datastore is not None:
        index = datastore.on_mesh(mesh)
        parts["retrieval"] = (jax.jit(datastore_lib.lookup, static_argnums=(3, 4)),
                              (index, tokens, length, ngram, lookahead))
    out = {}
    with jax.set_mesh(mesh):
        for name, (fn, args) in parts.items():
            jax.block_until_ready(fn(*args))
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                jax.block_until_ready(fn(*args))
                times.append(time.perf_counter() - start)
            out[name] = 1000 * float(np.median(times))
    return out


def variants(base, drafter_names, verify_rules, confidences, num_drafts, draft_trees=("chains",),
             pass_widths=("full",)) -> list[dict]:
    """The SpS variants to compare: every combination of the given drafters, verifiers,
    adaptive-length thresholds, draft counts, tree kinds and pass widths that the drafters
    declare they honour (an adaptive length for `adaptive` ones, several chains for
    `several_chains` ones, a dynamic tree, one per drafter and without either, for
    `grows_trees` ones; pass_width 'proposed' for one chain), each validated. A value
    asked for that no combination would measure is refused, naming it, rather than
    dropped."""
    def honoured(d, m, v, c, t):
        cls = drafters.kind(d)
        if t == "dynamic":  # verified by the tree rule whatever --verify says: one line per drafter
            return cls.grows_trees and m == 1 and c == 0 and v == verify_rules[0]
        return (c == 0 or cls.adaptive) and (m == 1 or cls.several_chains)
    out = [dict(verify=v, drafter=d, draft_confidence=c, num_drafts=m, draft_tree=t, pass_width=w)
           for d in drafter_names for t in draft_trees for m in num_drafts for v in verify_rules for c in confidences
           for w in pass_widths if honoured(d, m, v, c, t) and (w == "full" or (m == 1 and t == "chains"))]
    adaptive, several = drafters.using("adaptive"), drafters.using("several_chains")
    grown = drafters.using("grows_trees")
    listed = lambda values: ",".join(map(str, values))  # noqa: E731
    if "full" not in pass_widths and (1 not in num_drafts or "chains" not in draft_trees):
        raise UsageError(f"--pass_width={listed(pass_widths)}: only one chain's pass follows its proposal, and "
                         f"{'--num_drafts=' + listed(num_drafts) if 1 not in num_drafts else '--draft_tree=dynamic'} "
                         "compares trees only (add full to --pass_width, or one chain to the values)")
    for d in drafter_names:
        cls = drafters.kind(d)
        if not any(v["drafter"] == d for v in out):
            why = []
            if 0 not in confidences and not cls.adaptive:
                why.append(f"--draft_confidence={listed(confidences)} needs an adaptive draft length, which only "
                           f"{', '.join(adaptive)} have (add 0 to the list to run {d} too)")
            if 1 not in num_drafts and not cls.several_chains:
                why.append(f"--num_drafts={listed(num_drafts)} needs several chains, which only {', '.join(several)} "
                           f"draw (add 1 to the list to run {d} too)")
            if "chains" not in draft_trees and not cls.grows_trees:
                why.append(f"--draft_tree={listed(draft_trees)} needs a drafter that grows trees ({', '.join(grown)}; "
                           f"add chains to the list to run {d} too)")
            if "chains" not in draft_trees and cls.grows_trees:
                why.append("a dynamic tree takes --num_drafts=1 and --draft_confidence=0")
            raise UsageError(f"--drafter={d}: nothing to measure: " + "; ".join(why))
    for key, values, users in (("draft_confidence", confidences, adaptive), ("num_drafts", num_drafts, several)):
        for value in values:
            if not any(v[key] == value for v in out):
                raise UsageError(f"--{key}={value}: none of --drafter={','.join(drafter_names)} honours it (only "
                                 f"{', '.join(users)} do): drop the value or add such a drafter")
    if "dynamic" in draft_trees and not any(v["draft_tree"] == "dynamic" for v in out):
        raise UsageError(f"--draft_tree=dynamic: none of --drafter={','.join(drafter_names)} grows a tree here (a "
                         f"dynamic tree needs drafter {' or '.join(grown)}, --num_drafts=1 and --draft_confidence=0 "
                         "among the values compared)")
    for v in out:
        dataclasses.replace(base, **v).validate()
    return out


def run_prompts(target, draft, prompts, sampling, seed, datastore=None):
    """One generate call per prompt (batch 1); returns per-sequence results."""
    out = []
    for i, prompt in enumerate(prompts):
        out.append(generate(target, draft, [prompt], sampling, seed=seed + i,
                            datastore=datastore if drafters.kind(sampling.drafter).uses_datastore else None))
    return out


def first_token_seconds(target, prompts, sampling, seed: int, repeats: int = 3, draft=None,
                        datastore=None) -> list[float]:
    """Per prompt, the median seconds of a run that generates one token: the prompt's
    prefill and one step, what a run of that prompt pays before its first token (ArS; or,
    given the drafter's `draft`, SpS: the target's prefill, the drafter's own and one loop)."""
    one = dataclasses.replace(sampling, max_new_tokens=1)
    run_prompts(target, draft, prompts[:1], one, seed, datastore)  # compile outside the timing
    return [float(np.median([r.seconds for r in run_prompts(target, draft, [p] * repeats, one, seed, datastore)]))
            for p in prompts]


def after(row: dict) -> str:
    value = row.get("ms_per_token_after_first")
    return "n/a (one new token)" if value is None else f"{value:.2f} ms/token"


def describe(results, first: list[float] | None = None) -> dict:
    """Per-sequence spread and percentiles, and the totals (`Totals`: the one ms/token).
    With `first` (seconds before the first token of each prompt, `first_token_seconds`;
    results cycle through the prompts in order), also ms per token after the first: the
    rate a long run approaches, as llama.cpp's `llama-bench` tg and `llama-lookup` report
    theirs (without the prompt). `bench` gives each mode its own first token: for SpS the
    target's prefill, the drafter's own (a draft model's or an EAGLE layer's over the
    prompt; a lookup's or a self-draft's on the target's cache adds none) and one loop,
    reported as the row's `first_token_ms`."""
    seconds = np.array([r.seconds for r in results])
    totals = Totals()
    for r in results:
        totals.add(r)
    row = {"seconds_mean": float(seconds.mean()), "seconds_std": float(seconds.std()),
           "p50": float(np.percentile(seconds, 50)), "p90": float(np.percentile(seconds, 90)),
           "p99": float(np.percentile(seconds, 99)),
           "ms_per_token": totals.ms_per_token, "tokens_per_loop": totals.tokens_per_loop,
           "ms_per_loop": 1000 * totals.seconds / totals.loops}
    if first is not None:
        later = sum(r.steps - 1 for r in results)  # batch 1: every token but the first
        before = sum(first[i % len(first)] for i in range(len(results)))
        row["ms_per_token_after_first"] = 1000 * (totals.seconds - before) / later if later > 0 else None
    if results[0].mode == "sps":
        row["acceptance_rate"] = totals.acceptance_rate
        row["accepted_per_k_plus_1"] = totals.accepted / totals.loops / (results[0].lookahead + 1)
        row["proposed_per_loop"] = totals.proposed / totals.loops
        row["scored_per_loop"] = totals.scored / totals.loops
        row["drafted_histogram"] = np.sum([r.drafted.sum(0) for r in results], axis=0).tolist()
        row["accepted_by"], row["proposed_by"] = totals.accepted_by, totals.proposed_by
    return row


def label(row: dict) -> str:
    """A Figure-1 line's name: drafter and verifier (the paper's is 'model, tokenwise'),
    and which draft model where several are compared (self-drafts)."""
    drafter = f"{row['drafter']} {row['draft']}" if row.get("draft") else row["drafter"]
    text = f"{drafter}, {row['verify']}" if row.get("num_drafts", 1) == 1 else \
        f"{drafter}, {row['num_drafts']} drafts"
    if row.get("draft_tree") == "dynamic":
        text = f"{drafter}, dynamic tree of {row['tree_nodes']}"
    text += f", confidence {row['draft_confidence']}" if row.get("draft_confidence") else ""
    return text + (", pass as proposed" if row.get("pass_width") == "proposed" else "")


def plot(report: dict) -> bytes:
    """The three Figure-1 panels (time per sequence, acceptance, time per loop vs K), as PNG."""
    import io

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    n = report["max_new_tokens"]
    lines = {}
    for r in report["sps"]:
        lines.setdefault(label(r), []).append(r)
    for name, rows in lines.items():
        ks = [r["lookahead"] for r in rows]
        axes[0].errorbar(ks, [r["seconds_mean"] * 1000 for r in rows], yerr=[r["seconds_std"] * 1000 for r in rows],
                         marker="o", capsize=3, label=f"SpS ({name})")
        axes[1].plot(ks, [r["acceptance_rate"] for r in rows], marker="o", label=f"acceptance ({name})")
        axes[1].plot(ks, [r["accepted_per_k_plus_1"] for r in rows], marker="s", ls="--",
                     label=f"accepted / (K+1) ({name})")
        axes[2].plot(ks, [r["ms_per_loop"] for r in rows], marker="o", label=f"measured ({name})")
        axes[2].plot(ks, [r["model_ms_per_loop"] for r in rows], marker="x", ls=":", label=f"model ({name})")
    axes[0].axhline(report["ars"]["seconds_mean"] * 1000, color="gray", ls="--", label="ArS")
    axes[0].set(xlabel="K (lookahead)", ylabel=f"ms per {n} tokens", title="Time per sequence (mean, std)")
    axes[1].set(xlabel="K (lookahead)", title="Acceptance efficiency", ylim=(0, 1))
    axes[2].set(xlabel="K (lookahead)", ylabel="ms", title="Time per loop (model: K draft steps + target(K+1))")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.suptitle(f"{report['config']}: {report['machine']}")
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    plt.close(fig)
    return png.getvalue()


def bench(target, draft, prompts, base, ks, batch_sizes, repeats: int, seed: int, log=print,
          variants=({},), datastore=None, heads=None) -> dict:
    """The whole comparison: single-pass costs, ArS, SpS for every variant and K, batch
    scaling. `base` is the SamplingConfig (eos_id -1: every sequence has the same length);
    `variants` are SamplingConfig overrides (verify, drafter, draft_confidence, num_drafts)
    compared side by side, each at every K, and ArS again next to them, prompt by prompt,
    so machine noise hits both sides of every speedup alike (a K's speedup is over the ArS
    runs made next to it; the reported ArS is all of them). With M > 1 drafts the model of
    a loop is K draft steps over M rows plus the tree pass over 1 + M*K tokens, each timed
    on its own. `draft` may be a dict {name: LM} of draft models (self-drafts), each
    compared with every variant that uses a draft model; `heads` {kind: Heads} serve the
    variants whose drafter draws from draft heads of that kind (`Drafter.heads_kind`)."""
    context = max(len(p) for p in prompts)
    drafts = draft if isinstance(draft, dict) else {"": draft}

    def at(k):
        """(draft name, sampling) of every variant at K=k, each with every draft model (a
        drafter that uses none, once)."""
        return [(name, dataclasses.replace(base, lookahead=k, **variant)) for variant in variants
                for name in (drafts if drafters.kind(variant.get("drafter", base.drafter)).needs_draft_model
                             else list(drafts)[:1])]

    def uses(name, sampling):
        """What a variant drafts with: its heads, its draft model, or nothing (a lookup)."""
        cls = drafters.kind(sampling.drafter)
        return heads[cls.heads_kind] if cls.heads_kind else drafts[name] if cls.needs_draft_model else None
    draft_steps = {name: time_forward(d, 1, context, repeats) if d is not None else 0.0 for name, d in drafts.items()}
    draft_step = draft_steps[next(iter(drafts))]
    target_step = time_forward(target, 1, context, repeats)
    ars_sampling = dataclasses.replace(base, drafter="model")
    report = {"max_new_tokens": base.max_new_tokens, "num_prompts": len(prompts),
              "sampling": dataclasses.asdict(base), "draft_forward_ms": 1000 * draft_step,
              **({"draft_forward_ms_by_draft": {n: 1000 * t for n, t in draft_steps.items()}} if any(drafts)
                 else {}),
              "target_forward_ms": 1000 * target_step, "target_scoring_ms": {},
              "lookup_ms": time_lookup(program_lib.mesh_of(target), datastore, max(ks), base.ngram, context, repeats)}
    if datastore is not None:
        report["datastore"] = datastore.meta
    run_prompts(target, None, prompts[:1], ars_sampling, seed)  # compile outside the timing
    ars_runs = run_prompts(target, None, prompts, ars_sampling, seed)
    first = first_token_seconds(target, prompts, ars_sampling, seed)
    report["first_token_ms"] = 1000 * float(np.mean(first))
    log(f"ArS, first pass over the prompts: {describe(ars_runs)['ms_per_token']:.2f} ms/token; first token after "
        f"{report['first_token_ms']:.1f} ms (the prompt's prefill and one step); draft forward "
        f"{1000 * draft_step:.2f} ms, target forward {1000 * target_step:.2f} ms (1 token); lookups "
        + ", ".join(f"{k} {v:.3f} ms" for k, v in report["lookup_ms"].items()))
    report["sps"] = []
    for k in ks:
        score = time_forward(target, k + 1, context, repeats)
        report["target_scoring_ms"][k + 1] = 1000 * score
        samplings = at(k)
        for name, sampling in samplings:
            run_prompts(target, uses(name, sampling), prompts[:1], sampling, seed, datastore)
        # Prompt by prompt, ArS next to every variant: the machine's drift (on a shared
        # host the same program's speed wanders by a third within minutes) hits both sides
        # of each speedup alike. The ArS runs of every K together are the reported ArS.
        ars_k, runs = [], [[] for _ in samplings]
        for i, prompt in enumerate(prompts):
            ars_k += run_prompts(target, None, [prompt], ars_sampling, seed + i)
            for j, (name, sampling) in enumerate(samplings):
                runs[j] += run_prompts(target, uses(name, sampling), [prompt], sampling, seed + i, datastore)
        ars_runs += ars_k
        ars_near, ars_near_after = (describe(ars_k, first)[key] for key in ("ms_per_token", "ms_per_token_after_first"))
        for (name, sampling), results in zip(samplings, runs):
            # After SpS's own first token (the target's prefill, the drafter's own, one loop):
            # the rate a long run approaches, as ArS's after its own.
            own_first = first_token_seconds(target, prompts, sampling, seed, draft=uses(name, sampling),
                                            datastore=datastore)
            row = describe(results, own_first)
            row["first_token_ms"] = 1000 * float(np.mean(own_first))
            if name:
                row["draft"] = name
            m = sampling.num_drafts
            cls = drafters.kind(sampling.drafter)
            passes, rows = cls.draft_passes(k)
            step, scoring = draft_steps[name], score
            if cls.needs_draft_model and rows > 1:  # one pass of several tokens (the parallel drafter's:
                step = time_forward(drafts[name], rows, context, repeats)  # its M chains draw from that one pass)
            elif cls.needs_draft_model and m > 1:  # M chains: M rows of each step
                step = time_forward(drafts[name], 1, context, repeats, batch=m)
            if m > 1:
                scoring = time_forward(target, 0, context, repeats, tree=(m, k))
                report["target_scoring_ms"][f"tree {m}x{k}"] = 1000 * scoring
            if sampling.draft_tree == "dynamic":  # (its tree pass's visibility is per row: timed as a chain of N + 1)
                scoring = time_forward(target, sampling.tree_nodes + 1, context, repeats)
                report["target_scoring_ms"][f"dynamic {sampling.tree_nodes}"] = 1000 * scoring
            scored_tokens = sampling.tree_nodes + 1 if sampling.draft_tree == "dynamic" else 1 + m * k
            steps = passes * step if cls.needs_draft_model else 0.0
            parts = ("the proposal, not timed" if not steps else f"{k} draft steps" if rows == 1
                     else f"{passes} draft pass of {rows} tokens")
            row.update(lookahead=k, verify=sampling.verify, drafter=sampling.drafter, num_drafts=m,
                       draft_tree=sampling.draft_tree, tree_nodes=sampling.tree_nodes,
                       draft_confidence=sampling.draft_confidence, pass_width=sampling.pass_width,
                       speedup=ars_near / row["ms_per_token"],
                       speedup_after_first=(ars_near_after / row["ms_per_token_after_first"]
                                            if ars_near_after and row["ms_per_token_after_first"] else None),
                       ars_ms_per_token=ars_near,
                       model_ms_per_loop=1000 * (steps + scoring), scoring_ms=1000 * scoring,
                       tokens_per_sequence=float(np.mean([r.total_tokens for r in results])))
            report["sps"].append(row)
            log(f"K={k} {label(row)}: SpS {row['ms_per_token']:.2f} ms/token ({row['speedup']:.2f}x the "
                f"{ars_near:.2f} of ArS runs interleaved with these; after the first token {after(row)}"
                + (f" ({row['speedup_after_first']:.2f}x their {ars_near_after:.2f})" if row["speedup_after_first"]
                   else "")
                + f", the first after {row['first_token_ms']:.1f} ms, ArS's {report['first_token_ms']:.1f}), "
                f"{row['tokens_per_loop']:.2f} tokens/loop, acceptance {row['acceptance_rate']:.3f} of "
                f"{row['proposed_per_loop']:.2f} proposed/loop"
                + (f", {row['scored_per_loop']:.2f} positions scored/loop" if sampling.pass_width == "proposed" else "")
                + f"; a loop took {row['ms_per_loop']:.2f} ms, its parts "
                f"timed alone {row['model_ms_per_loop']:.2f} ms ({parts} + the target scoring {scored_tokens} "
                f"tokens in {1000 * scoring:.2f} ms = {scoring / target_step:.2f}x one token)")
    report["ars"] = describe(ars_runs, first)
    log(f"ArS over every pass above (the reported ArS): {report['ars']['ms_per_token']:.2f} ms/token; after the "
        f"first token "
        f"{after(report['ars'])}")
    report["batch"] = []
    for b in batch_sizes:  # every variant, at the run's own K (the config's, or --lookahead's first)
        if b == 1:
            continue
        batch = [prompts[i % len(prompts)] for i in range(b)]
        ars = [generate(target, None, batch, ars_sampling, seed=seed) for _ in range(2)][-1].ms_per_token
        for name, sampling in at(base.lookahead if base.lookahead in ks else ks[0]):
            ds = datastore if drafters.kind(sampling.drafter).uses_datastore else None
            d = uses(name, sampling)
            sps = [generate(target, d, batch, sampling, seed=seed, datastore=ds) for _ in range(2)][-1].ms_per_token
            row = {"batch": b, "lookahead": sampling.lookahead, "verify": sampling.verify, "drafter": sampling.drafter,
                   "num_drafts": sampling.num_drafts, "draft_confidence": sampling.draft_confidence,
                   "pass_width": sampling.pass_width,
                   **({"draft": name} if name else {}), "ars_ms_per_token": ars, "sps_ms_per_token": sps,
                   "speedup": ars / sps}
            report["batch"].append(row)
            log(f"batch {b}, K={sampling.lookahead} {label(row)}: ArS {ars:.2f} ms/token, SpS {sps:.2f} ms/token "
                f"({row['speedup']:.2f}x)")
    return report
