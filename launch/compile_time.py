"""What the settings that unroll at trace time cost: seconds to compile the SpS program
`generate` builds, by tree size (num_drafts x lookahead) and by n-gram length, and
seconds to build a datastore, by its n-gram length. The reasons for the bounds in
`specjax.config` (MAX_NUM_DRAFTS, MAX_TREE_NODES, MAX_NGRAM); benchmarks/bounds.md.

    python launch/compile_time.py --config=tiny --trees=1x4,2x4,4x4,8x4,4x8,16x2 --ngrams=3,16 \
        --datastore_ngrams=3,8,16

Random weights; one compile per setting (no persistent cache), one line of JSON each.
"""
from __future__ import annotations

import json
import time

import jax
from absl import app, flags

from specjax.config import SamplingConfig, load_config
from specjax.decode import program
from specjax.decode.retrieval_index import Datastore
from specjax.model import init_lm
from specjax.sharding import make_mesh
from specjax.training.corpus import load_corpus

flags.DEFINE_string("config", "tiny", "Config whose target and draft are compiled.")
flags.DEFINE_list("trees", ["1x4", "2x4", "4x4", "8x4"], "Trees as MxK (1xK: a chain).")
flags.DEFINE_list("ngrams", ["3", "16"], "n-gram lengths of the prompt-lookup drafter (K=4).")
flags.DEFINE_list("datastore_ngrams", [], "n-gram lengths of datastores built from the config's corpus.")
FLAGS = flags.FLAGS


def compile_seconds(target, draft, **settings) -> float:
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=16, **settings)
    uses_draft = sampling.drafter in ("model", "hybrid")
    built = program.build(target, draft if uses_draft else None, [[1, 2, 3]], sampling)
    start = time.perf_counter()
    built.compile()
    return time.perf_counter() - start


def main(argv):
    del argv
    config = load_config(FLAGS.config)
    mesh = make_mesh(config.mesh, jax.devices()[:1])
    target, draft = init_lm(config.target, mesh), init_lm(config.draft, mesh)
    for tree in FLAGS.trees:
        m, k = (int(x) for x in tree.split("x"))
        print(json.dumps({"num_drafts": m, "lookahead": k, "nodes": m * k,
                          "compile_s": round(compile_seconds(target, draft, num_drafts=m, lookahead=k), 2)}),
              flush=True)
    for n in map(int, FLAGS.ngrams):
        print(json.dumps({"drafter": "ngram", "ngram": n,
                          "compile_s": round(compile_seconds(target, draft, drafter="ngram", ngram=n), 2)}),
              flush=True)
    if FLAGS.datastore_ngrams:
        tokens = load_corpus(config).train
        for n in map(int, FLAGS.datastore_ngrams):
            start = time.perf_counter()
            store = Datastore.build(tokens, vocab_size=config.target.vocab_size, ngram=n)
            print(json.dumps({"datastore_ngram": n, "corpus_tokens": len(tokens), "entries": store.meta["entries"],
                              "build_s": round(time.perf_counter() - start, 2)}), flush=True)


if __name__ == "__main__":
    app.run(main)
