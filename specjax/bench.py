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

from specjax.analysis import timing
from specjax.app import cli, output, prompts as prompts_lib, setup
from specjax.weights import self_draft

FLAGS = flags.FLAGS
# comma lists: one Figure-1 line each
SWEPT = ("lookahead", "verify", "drafter", "draft_confidence", "num_drafts", "draft_tree", "pass_width")


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
    cli.define_chat_flag()


def main(argv):
    ks, batch_sizes = cli.int_list("lookahead", FLAGS.lookahead), cli.int_list("batch_sizes", FLAGS.batch_sizes)
    num_prompts, repeats = cli.positive("num_prompts", FLAGS.num_prompts), cli.positive("repeats", FLAGS.repeats)
    max_new, seed = cli.positive("max_new_tokens", FLAGS.max_new_tokens), cli.seed("seed", FLAGS.seed)
    prompt_len = cli.positive("prompt_len", FLAGS.prompt_len)
    output.check_writable(FLAGS.json, "--json")
    output.check_writable(FLAGS.plot, "--plot")
    raw_prompts = prompts_lib.gather(prompts_file=FLAGS.prompts_file) if FLAGS.prompts_file else None
    config = cli.config()
    base = cli.sampling(config.sampling)  # the single-valued ones: ngram, temperature, top_k, top_p
    names = cli.swept("drafter", config.sampling.drafter)
    variants = timing.variants(  # validated at the largest K measured
        dataclasses.replace(base, lookahead=max(ks + [base.lookahead])), names,
        cli.swept("verify", base.verify), cli.swept("draft_confidence", base.draft_confidence),
        cli.swept("num_drafts", base.num_drafts), cli.swept("draft_tree", base.draft_tree),
        cli.swept("pass_width", base.pass_width))
    cli.check_verify(FLAGS.verify, [(v["num_drafts"], v["draft_tree"]) for v in variants])
    sources = cli.sources()
    run = setup.prepare(setup.Request(
        config, base, tuple(dict.fromkeys(v["drafter"] for v in variants)), lookahead=max(ks), sources=sources,
        self_drafts=self_draft.split_list(FLAGS.self_draft) if FLAGS.self_draft is not None else None,
        quantize=cli.quantize(), datastore=FLAGS.datastore))
    config = run.config  # the models the weight flags name (an imported target's own shapes)
    run.locate()
    tokenizer = run.tokenizer
    if raw_prompts is not None:
        prompts = [p.tokens for p in prompts_lib.encode(raw_prompts, tokenizer, run.no_tokenizer_reason,
                                                        chat=FLAGS.chat)]
    else:
        prompts = prompts_lib.bench_prompts(FLAGS.prompts, tokenizer, num_prompts, config.target.vocab_size,
                                            prompt_len, seed, chat=FLAGS.chat)
    base = dataclasses.replace(base, max_new_tokens=max_new, eos_id=-1)
    prompts_lib.check([prompts_lib.Prompt(f"prompt {i}", p) for i, p in enumerate(prompts)],
                      config.target.vocab_size, run.context, max_new)
    run.load()
    drafts = {text: d for text, d in run.drafts.items() if text not in run.heads} or {"": None}
    heads = {kind: run.drafts[kind] for kind in run.heads}
    report = {"config": run.config.name, **{k: v for k, v in sources.named().items() if k != "self_draft"},
              **({"self_draft": [s.text for s in run.specs]} if run.specs else {}),
              "machine": f"{jax.device_count()}x {jax.devices()[0].device_kind}",
              "init": FLAGS.init, "quantize": FLAGS.quantize,
              "prompts": FLAGS.prompts_file or (FLAGS.prompts if tokenizer is not None else "random ids"),
              **timing.bench(run.target, drafts if run.specs else next(iter(drafts.values())), prompts, base, ks,
                             batch_sizes, repeats, seed, variants=variants, datastore=run.datastore, heads=heads)}
    sys.stdout.flush()
    if FLAGS.json:
        output.save(FLAGS.json, json.dumps(report, indent=1), "--json")
    if FLAGS.plot:
        output.save(FLAGS.plot, timing.plot(report), "--plot")


if __name__ == "__main__":
    define_flags()
    cli.run(main)
