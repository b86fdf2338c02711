"""`python -m specjax.sample`: speculative (SpS) and autoregressive (ArS) sampling.

With no flags it is the embedded demo: the trained mini pair (trained on first use,
cached afterwards) completes a few HumanEval prompts with ArS and SpS, side by side,
with their ms/token. Typical use:

    python -m specjax.sample --config=tiny --init=random --mode=sps --prompt_tokens=1,2,3 --temperature=0
    python -m specjax.sample --prompts_file=prompts.jsonl --num_samples=4 --batch_size=4 --output=out.jsonl

Every input is checked before a model is built or compiled; bad input is one line on
stderr and exit code 2. `--output` gets one JSON line per sample, written and flushed per
finished batch, so an interrupted run leaves only complete lines.
"""
from __future__ import annotations

import dataclasses
import itertools
import re
import sys

from absl import flags, logging

import specjax
from specjax import cli, demo, prompts as prompts_lib
from specjax.config import MeshConfig, UsageError

FLAGS = flags.FLAGS
cli.define_config_flag("mini")
flags.DEFINE_enum("mode", "both", ["sps", "ars", "both"],
                  "sps: speculative sampling with the config's draft; ars: the target alone; "
                  "both: each batch with both, printed side by side.")
flags.DEFINE_integer("lookahead", None, "K, draft tokens per loop (default: the config's).")
flags.DEFINE_float("temperature", None, "0 = greedy (default: the config's).")
flags.DEFINE_integer("top_k", None, "Keep the k most likely tokens; 0 = off (default: the config's).")
flags.DEFINE_float("top_p", None, "Nucleus sampling mass in (0, 1]; 1 = off (default: the config's).")
flags.DEFINE_integer("max_new_tokens", None, "Tokens to generate per sample (default: the config's).")
flags.DEFINE_integer("num_samples", 1, "Samples per prompt.")
flags.DEFINE_integer("batch_size", 1, "Rows per generate call (prompts x num_samples rows are split into "
                     "batches; batch 1 gives the paper's ms/token).")
flags.DEFINE_integer("seed", 0, "Batch i uses seed + i (the same in both modes).")
flags.DEFINE_multi_string("prompt", [], "A text prompt (repeatable).")
flags.DEFINE_string("prompts_file", None, "Text file (one prompt per line) or JSONL ({\"prompt\": ...} or "
                    "{\"prompt_tokens\": [...]} per line).")
flags.DEFINE_multi_string("prompt_tokens", [], "A prompt as comma-separated token ids, e.g. 1,2,3 "
                          "(repeatable; for configs without a tokenizer).")
flags.DEFINE_integer("humaneval", 3, "Without any prompt flag: use the first N HumanEval prompts.")
flags.DEFINE_string("checkpoint", None, "Target checkpoint directory (default: where "
                    "`python -m specjax.train --config=<target config>` writes).")
flags.DEFINE_string("draft_checkpoint", None, "Draft checkpoint directory (default: where the draft "
                    "config's training writes).")
flags.DEFINE_enum("init", "checkpoint", ["checkpoint", "random"],
                  "random: random weights (speed measurements before a checkpoint exists).")
flags.DEFINE_string("mesh", None, "DATAxMODEL, e.g. 1x8 or 2x4 (default: the config's mesh).")
flags.DEFINE_string("output", None, "Write one JSON line per sample to this file.")
flags.DEFINE_bool("train_missing", True, f"Train {' and '.join(demo.AUTO_TRAIN)} first when their default "
                  "checkpoints are missing (the embedded default); other configs are never trained here.")
flags.DEFINE_bool("print_samples", True, "Print each sample's text as its batch finishes.")

SAMPLING_FLAGS = ("lookahead", "temperature", "top_k", "top_p", "max_new_tokens")


def parse_mesh(value: str | None, default: MeshConfig) -> MeshConfig:
    if value is None:
        return default
    match = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*", value)
    if not match:
        raise UsageError(f"--mesh={value!r}: expected DATAxMODEL with positive integers, e.g. 1x8 or 2x4")
    return MeshConfig(int(match[1]), int(match[2])).validate()


def positive_flag(name: str) -> int:
    value = getattr(FLAGS, name)
    if value < 1:
        raise UsageError(f"--{name}={value}: must be a positive integer")
    return value


def main(argv):
    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.ERROR)  # library INFO/WARNING lines (no TPU, orbax) drown the output
    if len(argv) > 1:
        raise UsageError(f"unexpected arguments {argv[1:]}; prompts go in --prompt=TEXT or --prompt_tokens=1,2,3")
    config = cli.config()
    overrides = {k: getattr(FLAGS, k) for k in SAMPLING_FLAGS if getattr(FLAGS, k) is not None}
    sampling = dataclasses.replace(config.sampling, **overrides).validate()
    num_samples, batch_size = positive_flag("num_samples"), positive_flag("batch_size")
    modes = ["ars", "sps"] if FLAGS.mode == "both" else [FLAGS.mode]
    if "sps" in modes and config.draft is None:
        raise UsageError(f"--mode={FLAGS.mode} needs a draft model, and config {config.name!r} has none; "
                         "use --mode=ars or a config with a draft")
    mesh_cfg = parse_mesh(FLAGS.mesh, config.mesh)
    raw = prompts_lib.gather(FLAGS.prompt, FLAGS.prompts_file, FLAGS.prompt_tokens, FLAGS.humaneval)
    models = {"target": config.target, **({"draft": config.draft} if "sps" in modes else {})}
    context = min(m.max_seq_len for m in models.values())
    raw_ids = prompts_lib.encode([r for r in raw if r.text is None], None)
    prompts_lib.check(raw_ids, config.target.vocab_size, context, sampling.max_new_tokens)

    demo.maybe_initialize_distributed()
    demo.use_compilation_cache()
    with demo.JsonlWriter(FLAGS.output) as writer:
        weights = demo.Weights.locate(config, FLAGS.init, FLAGS.checkpoint, FLAGS.draft_checkpoint,
                                      need_draft="sps" in modes, train_missing=FLAGS.train_missing)
        tokenizer = weights.tokenizer()
        prompts = prompts_lib.encode(raw, tokenizer, weights.no_tokenizer_reason)
        prompts_lib.check(prompts, config.target.vocab_size, context, sampling.max_new_tokens)
        if tokenizer is not None and sampling.eos_id == -1:
            sampling = dataclasses.replace(sampling, eos_id=tokenizer.eos_id)

        mesh = demo.make_mesh(mesh_cfg, models)  # first device work: all input is valid by now
        target, draft = weights.load(mesh, need_draft="sps" in modes)
        rows = [(i, s) for i in range(len(prompts)) for s in range(num_samples)]
        batches = [rows[b:b + batch_size] for b in range(0, len(rows), batch_size)]
        report = demo.Report(modes, sampling, tokenizer, print_samples=FLAGS.print_samples)
        try:
            for b, batch in enumerate(batches):
                # Pad the last batch to the same shape: one compiled program serves every batch.
                padded = list(itertools.islice(itertools.cycle(batch), batch_size))
                tokens = [prompts[i].tokens for i, _ in padded]
                results = {mode: demo.generate(target, draft if mode == "sps" else None, tokens, sampling,
                                               seed=FLAGS.seed + b) for mode in modes}
                writer.write(report.add_batch(b, FLAGS.seed + b, prompts, batch, results))
        except specjax.NonFiniteLogitsError as e:
            print(f"{sys.argv[0].rsplit('/', 1)[-1]}: error: {e}", file=sys.stderr)
            sys.exit(1)
        except KeyboardInterrupt:
            report.print_summary(interrupted=f"{report.done_batches} of {len(batches)} batches",
                                 output=FLAGS.output)
            raise
    report.print_summary(output=FLAGS.output)


if __name__ == "__main__":
    cli.run(main)
