"""Train a config's target model (the draft too: a draft config's target IS the draft).

    python -m specjax.train --config=mini_target            # then:
    python -m specjax.train --config=mini_draft             # distilled from mini_target
    python -m specjax.train --config=tiny --workdir=/tmp/t --config.train.steps=30
    python -m specjax.train --config=MY_DRAFT --config.train.teacher_hf=HF_DIR --export_hf=OUT_DIR
    python -m specjax.train --config=MY_DRAFT --config.train.teacher_gguf=FILE.gguf --export_hf=OUT_DIR

Checkpoints, the tokenizer and metrics.jsonl go to --workdir (default: where
`specjax.sample` looks, $SPECJAX_CACHE/checkpoints/NAME). Running the same command again
resumes from the newest checkpoint. SIGTERM or Ctrl-C: checkpoint, then exit 143 / 130.
"""
from __future__ import annotations

import os
import sys

from absl import flags, logging

from specjax import distributed
from specjax.app import cli
from specjax.config import UsageError
from specjax.training import trainer
from specjax.training.export import check_exportable, export_hf

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_string("workdir", None, "Checkpoint + metrics directory (default: "
                        "$SPECJAX_CACHE/checkpoints/CONFIG_NAME, where specjax.sample looks).")
    flags.DEFINE_bool("progress", True, "Show a tqdm progress bar.")
    flags.DEFINE_string("export_hf", None, "After training, write the model as a Hugging Face Llama directory "
                        "here (with the tokenizer of --config.train.teacher_hf or teacher_gguf when distilled from "
                        "one).")
    cli.define_config_flag("mini_target")


def main(argv):
    # Join a multi-process run (launch/multiprocess.sh, a TPU pod) before anything touches a device.
    distributed.maybe_initialize()
    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
    cli.use_compilation_cache(FLAGS.workdir)  # restarts (resume after preemption) and the draft run reuse compiled programs
    config = cli.config()
    if FLAGS.export_hf is not None:  # refused before training, not after it
        from specjax.weights import hf
        check_exportable(config)
        teacher = config.train.teacher_hf
        if teacher and os.path.realpath(os.path.expanduser(teacher)) == os.path.realpath(
                os.path.expanduser(FLAGS.export_hf)):
            raise UsageError(f"--export_hf={FLAGS.export_hf!r} is the teacher's directory (train.teacher_hf): the "
                             "export would replace the model it is distilled from; give a new directory")
        distributed.agreed(lambda: hf.check_export_dir(FLAGS.export_hf, "--export_hf") and None)
    if config.train.teacher_gguf:
        from specjax.weights import gguf
        gguf.read_config(config.train.teacher_gguf)  # a bad file fails before the workdir is made
    result = trainer.train(config, FLAGS.workdir, progress=FLAGS.progress)
    summary = f"step {result.step} in {result.workdir}"
    if result.val_loss is not None:
        summary += f"; validation loss {result.val_loss:.4f}"
    if result.tokens_per_second:
        summary += f"; {result.tokens_per_second:,.0f} tokens/s"
    print(summary)
    if result.stopped_by:
        sys.exit({"SIGTERM": 143, "SIGINT": 130}[result.stopped_by])
    if FLAGS.export_hf is not None:
        print(f"exported to {export_hf(config, result.workdir, FLAGS.export_hf)}")


if __name__ == "__main__":
    define_flags()
    cli.run(main)
