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

import jax
import numpy as np
from absl import flags

from specjax import sharding
from specjax.analysis import timing
from specjax.app import cli, output, prompts as prompts_lib
from specjax.app.locate import Weights, with_hf_models
from specjax.config import UsageError

FLAGS = flags.FLAGS


def define_flags() -> None:
    cli.define_config_flag("mini")
    flags.DEFINE_string("lookahead", "1,2,3,4,5,6,8", "Comma-separated K values.")
    flags.DEFINE_string("batch_sizes", "1", "Comma-separated batch sizes (SpS at the config's K vs ArS).")
    flags.DEFINE_integer("num_prompts", 8, "Prompts (HumanEval with a tokenizer, random ids without).")
    flags.DEFINE_integer("prompt_len", 64, "Random-id prompt length when there is no tokenizer.")
    flags.DEFINE_integer("max_new_tokens", 128, "Tokens per sequence (Figure 1 uses 128).")
    flags.DEFINE_enum("init", "checkpoint", ["checkpoint", "random"], "random: random weights.")
    flags.DEFINE_string("hf_target", None, "Hugging Face model directory holding the target (with --hf_draft).")
    flags.DEFINE_string("hf_draft", None, "Hugging Face model directory holding the draft.")
    flags.DEFINE_string("json", None, "Write the results here.")
    flags.DEFINE_string("plot", None, "Write the Figure-1 panels (PNG) here.")
    flags.DEFINE_integer("seed", 0, "Sampling seed.")
    flags.DEFINE_integer("repeats", 20, "Repeats for the single-pass timings.")


def main(argv):
    ks, batch_sizes = cli.int_list("lookahead", FLAGS.lookahead), cli.int_list("batch_sizes", FLAGS.batch_sizes)
    num_prompts, repeats = cli.positive("num_prompts", FLAGS.num_prompts), cli.positive("repeats", FLAGS.repeats)
    max_new, seed = cli.positive("max_new_tokens", FLAGS.max_new_tokens), cli.seed("seed", FLAGS.seed)
    prompt_len = cli.positive("prompt_len", FLAGS.prompt_len)
    output.check_writable(FLAGS.json, "--json")
    output.check_writable(FLAGS.plot, "--plot")
    if FLAGS.hf_target and not FLAGS.hf_draft:
        raise UsageError("--hf_target needs --hf_draft: bench compares ArS with SpS")
    config = with_hf_models(cli.config(), FLAGS.hf_target, FLAGS.hf_draft, init=FLAGS.init, checkpoint=None,
                            draft_checkpoint=None)
    if config.draft is None:
        raise UsageError(f"--config={FLAGS.config}: has no draft model; bench compares ArS with SpS")
    weights = Weights.locate(config, FLAGS.init, None, None, need_draft=True, train_missing=False,
                             hf_target=FLAGS.hf_target, hf_draft=FLAGS.hf_draft)
    tokenizer = weights.tokenizer()
    if tokenizer is not None:
        prompts = [p.tokens for p in prompts_lib.encode(prompts_lib.humaneval(num_prompts), tokenizer)]
    else:
        rng = np.random.default_rng(seed)
        prompts = [rng.integers(0, config.target.vocab_size, prompt_len).tolist() for _ in range(num_prompts)]
    base = dataclasses.replace(config.sampling, max_new_tokens=max_new, eos_id=-1)
    prompts_lib.check([prompts_lib.Prompt(f"prompt {i}", p) for i, p in enumerate(prompts)],
                      config.target.vocab_size, min(config.target.max_seq_len, config.draft.max_seq_len), max_new)
    mesh = sharding.make_checked_mesh(config.mesh, {"target": config.target, "draft": config.draft})
    target, draft = weights.load(mesh, need_draft=True)
    report = {"config": config.name, **({"hf_target": FLAGS.hf_target, "hf_draft": FLAGS.hf_draft} if FLAGS.hf_target
                                         else {}),
              "machine": f"{jax.device_count()}x {jax.devices()[0].device_kind}",
              "init": FLAGS.init, **timing.bench(target, draft, prompts, base, ks, batch_sizes, repeats, seed)}
    sys.stdout.flush()
    if FLAGS.json:
        output.save(FLAGS.json, json.dumps(report, indent=1), "--json")
    if FLAGS.plot:
        output.save(FLAGS.plot, timing.plot(report), "--plot")


if __name__ == "__main__":
    define_flags()
    cli.run(main)
