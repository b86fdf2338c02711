"""A tree pass against a plain forward of the same width (what several drafts cost).

    python launch/tree_forward.py --config=mini --trees=1x4,2x3,4x2,4x4 [--kernels=0]

For each tree M x K (M chains of K tokens after the pending token: 1 + M*K tokens), the
target scores it once as the tree loop does (ancestor mask, per-node positions) and once
as a plain forward of 1 + M*K consecutive tokens, at batch 1 after a 64-token context in
a 256-slot cache; jitted and compiled as `generate` compiles, medians of --repeats.
The weights are the config's trained checkpoint when it exists, else random. Run once
with SPECJAX_KERNELS=0 for the jnp path everywhere.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from specjax import kv_cache, model, sharding
from specjax.app.locate import Sources
from specjax.config import MeshConfig, UsageError, load_config
from specjax.decode import program, tree

flags.DEFINE_string("config", "mini", "Config whose target is measured.")
flags.DEFINE_list("trees", ["1x4", "2x3", "4x2", "4x4"], "Trees as MxK.")
flags.DEFINE_integer("context", 64, "Tokens already in the cache.")
flags.DEFINE_integer("repeats", 40, "Timed calls per setting (median).")
FLAGS = flags.FLAGS


def median_ms(fn, *args) -> float:
    compiled = program.compile_lowered(jax.jit(fn).lower(*args))
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(FLAGS.repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return 1000 * float(np.median(times))


def main(argv):
    del argv
    cfg = load_config(FLAGS.config)
    mesh = sharding.make_mesh(MeshConfig(1, 1), jax.devices()[:1])
    try:
        target, _ = Sources().locate(cfg, need_draft=False, train_missing=False).load(
            mesh, need_draft=False)
        weights = "trained"
    except UsageError:  # no checkpoint: random weights time the same
        target, weights = model.init_lm(cfg.target, mesh), "random"
    target = target.packed()  # as decoding runs it
    context = FLAGS.context
    with jax.set_mesh(mesh):
        cache = target.with_position_table(kv_cache.init_cache(target.cfg, 1, 4 * context, mesh)).with_lengths(
            jnp.array([context]))
        print(f"{FLAGS.config} target ({weights} weights), context {context}, cache {4 * context}, 1 device")
        for spec in FLAGS.trees:
            M, K = (int(v) for v in spec.split("x"))
            T = 1 + M * K
            tokens = jnp.zeros((1, T), jnp.int32)
            parent, depth = tree.chain_parents(M, K)
            tree_pos = (context + jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.asarray(depth)]))[None]
            plain_pos = (context + jnp.arange(T))[None]
            ancestors = tree.ancestors(parent)
            t = median_ms(lambda c: target(tokens, tree_pos, c, ancestors)[0], cache)
            p = median_ms(lambda c: target(tokens, plain_pos, c)[0], cache)
            print(f"M={M} K={K} ({T} tokens): tree pass {t:.2f} ms, plain forward {p:.2f} ms")


if __name__ == "__main__":
    app.run(main)
