"""`python -m specjax.sample`: speculative (SpS) and autoregressive (ArS) sampling.

With no flags it is the embedded demo: the trained mini pair (trained on first use,
cached afterwards) completes a few HumanEval prompts with ArS and SpS, side by side,
with their ms/token. Typical use:

    python -m specjax.sample --config=tiny --init=random --mode=sps --prompt_tokens=1,2,3 --temperature=0
    python -m specjax.sample --prompts_file=prompts.jsonl --num_samples=4 --batch_size=4 --output=out.jsonl
    python -m specjax.sample --hf_target=SmolLM2-360M --hf_draft=SmolLM2-135M --prompt="def fib(n):"
    python -m specjax.sample --gguf_target=SmolLM2-135M-Instruct.Q4_1.gguf --mode=ars --prompt="def fib(n):"
    python -m specjax.sample --mode=sps --drafter=ngram --verify=block --lookahead=6
    python -m specjax.sample --gguf_target=SmolLM2-135M-Instruct.Q4_1.gguf --self_draft=layers:8 --prompt="def f"
    python -m specjax.sample --hf_target=SmolLM2-360M --hf_draft=SmolLM2-135M --quantize=int8

Every input is checked before a model is built or compiled; bad input is one line on
stderr and exit code 2. `--output` gets one JSON line per sample, written and flushed per
finished batch, so an interrupted run leaves only complete lines.
"""
from __future__ import annotations

from absl import flags

from specjax.app import cli, locate, sample_command

FLAGS = flags.FLAGS


def define_flags() -> None:
    cli.define_config_flag("mini")
    flags.DEFINE_enum("mode", "both", ["sps", "ars", "both"],
                      "sps: speculative sampling with the config's draft; ars: the target alone; "
                      "both: each batch with both, printed side by side.")
    cli.define_sampling_flags()
    flags.DEFINE_string("datastore", None, "Datastore for --drafter=retrieval|hybrid (python -m specjax.datastore).")
    flags.DEFINE_integer("num_samples", 1, "Samples per prompt.")
    flags.DEFINE_integer("batch_size", 1, "Rows per generate call (prompts x num_samples rows are split into "
                         "batches; batch 1 gives the paper's ms/token).")
    flags.DEFINE_integer("seed", 0, "Batch i uses seed + i (the same in both modes); seeds are in [0, 2**63).")
    flags.DEFINE_multi_string("prompt", [], "A text prompt (repeatable).")
    flags.DEFINE_string("prompts_file", None, "Text file (one prompt per line) or JSONL ({\"prompt\": ...} or "
                        "{\"prompt_tokens\": [...]} per line).")
    flags.DEFINE_multi_string("prompt_tokens", [], "A prompt as comma-separated token ids, e.g. 1,2,3 "
                              "(repeatable; for configs without a tokenizer).")
    flags.DEFINE_integer("humaneval", 3, "Without any prompt flag: use the first N HumanEval prompts.")
    cli.define_weight_flags()
    flags.DEFINE_string("mesh", None, "DATAxMODEL, e.g. 1x8 or 2x4 (default: the config's mesh).")
    flags.DEFINE_string("output", None, "Write one JSON line per sample to this file.")
    flags.DEFINE_bool("train_missing", True, f"Train {' and '.join(locate.AUTO_TRAIN)} first when their default "
                      "checkpoints are missing (the embedded default); other configs are never trained here.")
    flags.DEFINE_bool("print_samples", True, "Print each sample's text as its batch finishes.")
    cli.define_quantize_flag()
    cli.define_chat_flag()


def main(argv):
    config = cli.config()
    sampling = cli.sampling(config.sampling).validate()
    sample_command.run(sample_command.Request(
        config, ["ars", "sps"] if FLAGS.mode == "both" else [FLAGS.mode], sampling,
        dict(texts=FLAGS.prompt, prompts_file=FLAGS.prompts_file, token_lists=FLAGS.prompt_tokens,
             humaneval_n=FLAGS.humaneval),
        cli.parse_mesh(FLAGS.mesh, config.mesh), num_samples=cli.positive("num_samples", FLAGS.num_samples),
        batch_size=cli.positive("batch_size", FLAGS.batch_size), seed=cli.seed("seed", FLAGS.seed),
        sources=cli.sources(), output=FLAGS.output, train_missing=FLAGS.train_missing,
        print_samples=FLAGS.print_samples, datastore=FLAGS.datastore, quantize=cli.quantize(), chat=FLAGS.chat))


if __name__ == "__main__":
    define_flags()
    cli.run(main, extra_args_hint="prompts go in --prompt=TEXT or --prompt_tokens=1,2,3")
