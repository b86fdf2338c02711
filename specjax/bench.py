"""`python -m specjax.bench --config=mini --lookahead=1,2,3,4,5,6,8`: ArS vs SpS, one process.

Same compiled models, same prompts, batch 1 (the paper's setting) unless --batch_sizes
asks for more. For every K it reports the time to generate --max_new_tokens tokens
(mean, std, P50/P90/P99 over prompts), ms/token (over whole runs, and after each prompt's
first token, as llama.cpp's benchmarks count), speedup over ArS, tokens per loop,
acceptance rate, and the time per loop next to its model: K draft steps + one target
pass over K+1 tokens (both timed separately here), which says where the time goes.
Writes --json and, with --plot, the three Figure-1 panels as one PNG.

SpS variants are compared side by side, each at every K (one Figure-1 line each):

    python -m specjax.bench --verify=tokenwise,block --lookahead=2,4,6,8
    python -m specjax.bench --draft_confidence=0,0.2,0.4,0.6 --lookahead=8
    python -m specjax.bench --drafter=model,ngram,retrieval,hybrid --datastore=stdlib.npz --prompts=rewrite
    python -m specjax.bench --self_draft=layers:1,layers:2 --lookahead=2,3,4   # the target's own first layers
"""
from __future__ import annotations

import dataclasses
import json
import sys

import jax
from absl import flags

from specjax import sharding
from specjax.analysis import timing
from specjax.app import cli, locate, output, prompts as prompts_lib
from specjax.config import UsageError
from specjax.decode import drafters
from specjax.weights import self_draft

FLAGS = flags.FLAGS
# comma lists: one Figure-1 line each
SWEPT = ("lookahead", "verify", "drafter", "draft_confidence", "num_drafts", "draft_tree")


def define_flags() -> None:
    cli.define_config_flag("mini")
    flags.DEFINE_string("batch_sizes", "1", "Comma-separated batch sizes (SpS at the config's K vs ArS).")
    flags.DEFINE_integer("num_prompts", 8, "Prompts (HumanEval with a tokenizer, random ids without).")
    flags.DEFINE_integer("prompt_len", 64, "Random-id prompt length when there is no tokenizer.")
    cli.define_sampling_flags(sweep=SWEPT, defaults={"lookahead": "1,2,3,4,5,6,8", "max_new_tokens": 128})
    cli.define_weight_flags(self_draft_list=True)
    flags.DEFINE_string("json", None, "Write the results here.")
    flags.DEFINE_string("plot", None, "Write the Figure-1 panels (PNG) here.")
    flags.DEFINE_integer("seed", 0, "Sampling seed.")
    flags.DEFINE_integer("repeats", 20, "Repeats for the single-pass timings.")
    flags.DEFINE_string("datastore", None, "Datastore for the retrieval and hybrid drafters.")
    flags.DEFINE_enum("prompts", "humaneval", ["humaneval", "rewrite"], "With a tokenizer: HumanEval prompts, or "
                      "'rewrite' (held-out standard-library functions, each followed by its own def line: a "
                      "copy-heavy task).")
    flags.DEFINE_string("prompts_file", None, "Prompts from this file instead (one per line, or JSONL with "
                        "\"prompt\" or \"prompt_tokens\", as sample's), all of them (--num_prompts is ignored).")
    cli.define_quantize_flag()


def main(argv):
    ks, batch_sizes = cli.int_list("lookahead", FLAGS.lookahead), cli.int_list("batch_sizes", FLAGS.batch_sizes)
    num_prompts, repeats = cli.positive("num_prompts", FLAGS.num_prompts), cli.positive("repeats", FLAGS.repeats)
    max_new, seed = cli.positive("max_new_tokens", FLAGS.max_new_tokens), cli.seed("seed", FLAGS.seed)
    prompt_len = cli.positive("prompt_len", FLAGS.prompt_len)
    output.check_writable(FLAGS.json, "--json")
    output.check_writable(FLAGS.plot, "--plot")
    raw_prompts = prompts_lib.gather(prompts_file=FLAGS.prompts_file) if FLAGS.prompts_file else None
    sources = cli.sources()
    # Each self-draft of the list as sample's --self_draft; the run's config and weights
    # are those of the first (every one is checked against the target's layers).
    each = [dataclasses.replace(sources, self_draft=text) for text in self_draft.split_list(FLAGS.self_draft)] \
        if FLAGS.self_draft is not None else [sources]
    specs = [s.self_draft_spec() for s in each if s.self_draft is not None]
    for spec in specs:
        self_draft.check_quantize(spec, cli.quantize())
    target, draft = sources.imported()
    config = cli.config()
    names = cli.swept("drafter", config.sampling.drafter)
    # --draft_checkpoint names the heads where every drafter compared draws from heads.
    heads_only = all(drafters.draft_kind(name) == "heads" for name in names)
    config = each[0].configure(config, heads=heads_only)  # the other items differ only in their self-draft:
    for spec in specs[1:]:  # each checked against the target's layers, as configure checks the first
        spec.check(config.target.num_layers)
    base = cli.sampling(config.sampling)  # the single-valued ones: ngram, temperature, top_k, top_p
    variants = timing.variants(  # validated at the largest K measured
        dataclasses.replace(base, lookahead=max(ks + [base.lookahead])), names,
        cli.swept("verify", base.verify), cli.swept("draft_confidence", base.draft_confidence),
        cli.swept("num_drafts", base.num_drafts), cli.swept("draft_tree", base.draft_tree))
    need_draft = any(drafters.draft_kind(v["drafter"]) == "model" for v in variants)
    need_heads = sorted({v["drafter"] for v in variants if drafters.draft_kind(v["drafter"]) == "heads"})
    if target is not None and need_draft and draft is None and not specs:
        raise UsageError("--drafter=model|hybrid needs a draft: pass --hf_draft=DIR or --gguf_draft=FILE (a model "
                         "with the target's tokenizer), --self_draft=layers:N, or compare --drafter=ngram (no draft "
                         "model)")
    if need_draft and config.draft is None:
        raise UsageError(f"--config={FLAGS.config}: has no draft model, which --drafter=model|hybrid needs")
    locate.check_datastore_flag(FLAGS.datastore, sorted({v["drafter"] for v in variants}))
    models = {"target": config.target, **({"draft": config.draft} if need_draft else {})}
    dataclasses.replace(base, lookahead=max(ks)).check_context(min(m.max_seq_len for m in models.values()))
    weights = each[0].locate(config, need_draft=need_draft, train_missing=False, need_heads=need_heads)
    tokenizer = weights.tokenizer()
    store = locate.load_datastore(FLAGS.datastore, config.target.vocab_size, tokenizer)
    if raw_prompts is not None:
        prompts = [p.tokens for p in prompts_lib.encode(raw_prompts, tokenizer, weights.no_tokenizer_reason)]
    else:
        prompts = prompts_lib.bench_prompts(FLAGS.prompts, tokenizer, num_prompts, config.target.vocab_size,
                                            prompt_len, seed)
    base = dataclasses.replace(base, max_new_tokens=max_new, eos_id=-1)
    prompts_lib.check([prompts_lib.Prompt(f"prompt {i}", p) for i, p in enumerate(prompts)],
                      config.target.vocab_size, min(m.max_seq_len for m in models.values()), max_new)
    mesh = sharding.make_checked_mesh(config.mesh, models)
    target, draft = weights.load(mesh, need_draft=need_draft, quantize=cli.quantize())
    if specs and need_draft:  # every self-draft made of the one target's arrays
        draft = {spec.text: self_draft.self_draft(target, spec) for spec in specs}
    heads = {kind: weights.heads(target, mesh, kind) for kind in need_heads}
    if "medusa" in heads and max(ks) > heads["medusa"].cfg.num_heads:  # before any timing, not at that K
        raise UsageError(f"--lookahead={','.join(map(str, ks))}: the Medusa heads propose at most "
                         f"{heads['medusa'].cfg.num_heads} tokens a loop (num_heads={heads['medusa'].cfg.num_heads})")
    report = {"config": config.name, **{k: v for k, v in sources.named().items() if k != "self_draft"},
              **({"self_draft": [s.text for s in specs]} if specs else {}),
              "machine": f"{jax.device_count()}x {jax.devices()[0].device_kind}",
              "init": FLAGS.init, "quantize": FLAGS.quantize,
              "prompts": FLAGS.prompts_file or (FLAGS.prompts if tokenizer is not None else "random ids"),
              **timing.bench(target, draft, prompts, base, ks, batch_sizes, repeats, seed, variants=variants,
                             datastore=store, heads=heads)}
    sys.stdout.flush()
    if FLAGS.json:
        output.save(FLAGS.json, json.dumps(report, indent=1), "--json")
    if FLAGS.plot:
        output.save(FLAGS.plot, timing.plot(report), "--plot")


if __name__ == "__main__":
    define_flags()
    cli.run(main)
