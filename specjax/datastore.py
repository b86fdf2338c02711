"""`python -m specjax.datastore --config=mini --out=stdlib.npz`: build the retrieval drafter's datastore.

The corpus is the target's training corpus (the config named by `target_from`, or this
one), tokenised with the target checkpoint's own tokenizer, without the validation tail
that training holds out, so prompts taken from there are held out here too. Then

    python -m specjax.sample --drafter=retrieval --datastore=stdlib.npz

proposes, in every loop, the continuation that most often follows each row's last
--ngram tokens in that corpus (see `specjax.decode.retrieval_index`). Prints the index size and
the build time; both are recorded in the file with the tokenizer's sha256, so the file is
refused with any other tokenizer.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np
from absl import flags

from specjax.app import cli, output, setup
from specjax.app.locate import Sources, train_command
from specjax.config import MAX_NGRAM, UsageError, load_config, user_path
from specjax.decode.retrieval_index import Datastore, file_sha256
from specjax.training import data
from specjax.training.corpus import load_corpus
from specjax.weights import checkpoint as ckpt_lib

FLAGS = flags.FLAGS


def define_flags() -> None:
    cli.define_config_flag("mini")
    flags.DEFINE_string("out", None, "Write the datastore here (.npz).")
    flags.DEFINE_string("corpus", None, "Corpus instead of the training one: 'stdlib', a directory, a file or a "
                        "glob (tokenised with the target's tokenizer).")
    flags.DEFINE_string("checkpoint", None, "Target checkpoint directory whose tokenizer to use (default: where "
                        "`python -m specjax.train --config=<target config>` writes).")
    flags.DEFINE_integer("ngram", 3, "Longest context (tokens) indexed; every shorter one down to 1 is too.")
    flags.DEFINE_integer("continuation", 8, "Tokens stored per context: the most K a lookup can propose.")
    flags.DEFINE_integer("min_count", 2, "Keep a context only if its most frequent next token follows it at least "
                         "this often.")
    flags.DEFINE_bool("include_validation", False, "Index the validation tail too (then it is not held out).")


def main(argv):
    if FLAGS.out is None:
        raise UsageError("--out=PATH is required: where to write the datastore")
    output.check_writable(FLAGS.out, "--out")
    for name in ("ngram", "continuation", "min_count"):
        cli.positive(name, getattr(FLAGS, name))
    if FLAGS.ngram > MAX_NGRAM:
        raise UsageError(f"--ngram={FLAGS.ngram}: at most {MAX_NGRAM} (every context length up to it is indexed, "
                         "and the build's cost grows with it)")
    config = cli.config()
    source = load_config(config.target_from) if config.target_from else config
    if FLAGS.corpus is not None:
        if not source.tokenizer_vocab:
            raise UsageError(f"--corpus={FLAGS.corpus!r}: config {source.name!r} has no tokenizer (tokenizer_vocab=0) "
                             "and trains on synthetic tokens, which its datastore indexes; a corpus needs a config "
                             "with a tokenizer")
        try:
            data.resolve_corpus(FLAGS.corpus)
        except ValueError as e:
            raise UsageError(f"--corpus={FLAGS.corpus!r}: {e}") from None
        source = dataclasses.replace(source, train=dataclasses.replace(source.train, corpus=FLAGS.corpus))
    tokenizer = None
    if source.tokenizer_vocab:  # the target checkpoint's tokenizer, never a freshly trained one
        name = config.target_from or config.name
        directory = user_path(FLAGS.checkpoint) if FLAGS.checkpoint else ckpt_lib.default_dir(name)
        if not directory.is_dir():  # said for this command, which has no --init=random to offer
            where = f"--checkpoint={FLAGS.checkpoint!r}" if FLAGS.checkpoint else f"no checkpoint for config {name!r}"
            raise UsageError(f"{where}: {directory} {'is a file' if directory.exists() else 'does not exist'}; the "
                             f"datastore is tokenised with the target checkpoint's tokenizer: train it first "
                             f"(`{train_command(name)}`) or pass --checkpoint=DIR")
        # The one run setup (ArS: the target alone) finds the checkpoint and its tokenizer.
        run = setup.prepare(setup.Request(config, sources=Sources(checkpoint=FLAGS.checkpoint))).locate()
        tokenizer = run.tokenizer
        if tokenizer is None:
            raise UsageError(f"{run.no_tokenizer_reason}: the datastore must use the target's tokenizer")
    start = time.perf_counter()
    corpus = load_corpus(source, teacher_tokenizer=tokenizer)
    tokens = np.concatenate([corpus.train, corpus.val]) if FLAGS.include_validation else corpus.train
    read_seconds = time.perf_counter() - start
    store = Datastore.build(tokens, vocab_size=config.target.vocab_size, ngram=FLAGS.ngram,
                            continuation=FLAGS.continuation, min_count=FLAGS.min_count,
                            tokenizer_sha256=file_sha256(corpus.tokenizer_file) if corpus.tokenizer_file else None,
                            corpus=corpus.description + ("" if FLAGS.include_validation else
                                                         ", validation tail held out"))
    store.save(FLAGS.out)
    m = store.meta
    print(f"datastore {FLAGS.out}: {m['entries']:,} contexts of 1..{m['ngram']} tokens from {m['corpus_tokens']:,} "
          f"corpus tokens ({m['corpus']}), {m['continuation']} tokens each, {m['bytes'] / 2 ** 20:.1f} MiB; "
          f"built in {m['build_seconds']:.1f} s (+{read_seconds:.1f} s reading the corpus)")


if __name__ == "__main__":
    define_flags()
    cli.run(main)
