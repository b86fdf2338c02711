"""What a T-token scoring pass costs against one token, on the shapes of real models.

    python launch/shape_sweep.py                       # every shape, T=1..8
    python launch/shape_sweep.py --shapes=smollm2_135m,qwen2.5_0.5b --kernels=off,on

Random weights (the cost does not depend on their values) in float32 on one CPU device,
packed as decoding packs them, measured by forward_cost.py's loop (`forward_times`: N
forwards in one jitted fori_loop, cache one third full, programs interleaved). Per
shape: ms per forward at each T, T/T=1, and the roofline (the weights' bytes over the
read bandwidth measured first); a T whose cost exceeds --limit x T=1 is flagged (SpS
on CPU needs T = K+1 <= 8 at about the cost of one token). Shapes run one at a time,
each freed before the next; where weights plus their packed copy would pass
--max_gb (or --max_layers), layers are cut (every layer costs the same, so the ratios
keep their meaning; the unembedding weighs more in them) and the table says how many of
how many ran.
"""
from __future__ import annotations

import dataclasses
import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

import jax  # noqa: E402
from absl import app, flags  # noqa: E402

from forward_cost import check_settings, forward_times, read_bandwidth  # noqa: E402  (defines --steps, --repeats, --kernels, --bandwidth_mb, --clock)
from shapes import SHAPES  # noqa: E402
from specjax import model, sharding  # noqa: E402
from specjax.config import MeshConfig, ModelConfig  # noqa: E402

flags.DEFINE_list("shapes", None, "Shapes to measure (default: all of SHAPES).")
flags.DEFINE_integer("max_tokens", 8, "T = 1 .. this.")
flags.DEFINE_integer("context", 512, "Cache slots (one third full).")
flags.DEFINE_float("limit", 1.3, "Flag a T whose forward costs more than this times T=1's.")
flags.DEFINE_float("max_gb", 6.0, "Weights + packed copy above this: fewer layers.")
flags.DEFINE_integer("max_layers", None, "At most this many layers per shape (compile time on a slow host).")
FLAGS = flags.FLAGS


def sizes(cfg: ModelConfig) -> tuple[int, int]:
    """(bytes of the weights, bytes of their packed copy) without allocating them."""
    params = model.abstract_lm(cfg).params
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    embed = cfg.vocab_size * cfg.d_model * 4
    return weights, weights - (0 if cfg.tie_embeddings else embed)  # the input table is packed only when tied


def fitted(cfg: ModelConfig, max_bytes: float, max_layers: int | None) -> ModelConfig:
    """cfg with as many of its layers (at most max_layers) as keep weights + packed copy
    under max_bytes."""
    if max_layers is not None and cfg.num_layers > max_layers:
        cfg = dataclasses.replace(cfg, num_layers=max_layers)
    while cfg.num_layers > 1 and sum(sizes(cfg)) > max_bytes:
        cfg = dataclasses.replace(cfg, num_layers=cfg.num_layers - 1)
    return cfg


def main(argv):
    names = FLAGS.shapes or list(SHAPES)
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        raise app.UsageError(f"--shapes: unknown {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    if not 1 <= FLAGS.max_tokens <= 64:
        raise app.UsageError(f"--max_tokens={FLAGS.max_tokens}: must be in [1, 64]")
    if FLAGS.max_layers is not None and FLAGS.max_layers < 1:
        raise app.UsageError(f"--max_layers={FLAGS.max_layers}: must be a positive integer")
    check_settings(FLAGS.kernels)
    ts = list(range(1, FLAGS.max_tokens + 1))
    mesh = sharding.make_mesh(MeshConfig(1, 1), jax.devices()[:1])
    gbps = max(read_bandwidth(FLAGS.bandwidth_mb or 512).values())
    print(f"read bandwidth {gbps:.1f} GB/s; cache {FLAGS.context} slots, {FLAGS.context // 3} filled; "
          f"{FLAGS.clock} ms per forward, median of {FLAGS.repeats} loops of {FLAGS.steps}; "
          f"'!' marks T > {FLAGS.limit} x T=1")
    head = " ".join(f"{f'T={t}':>7}" for t in ts)
    print(f"| shape | layers | weights + packed GB | kernels | roofline ms | {head} | worst T/T=1 |")
    flagged = []
    for name in names:
        full = SHAPES[name]
        cfg = fitted(full, FLAGS.max_gb * 1e9, FLAGS.max_layers)
        weights, packed = sizes(cfg)
        lm = model.init_lm(cfg, mesh)
        med = forward_times(lm, ts, [FLAGS.context], FLAGS.kernels, FLAGS.steps, FLAGS.repeats, FLAGS.clock)
        for setting in FLAGS.kernels:
            row = [med[FLAGS.context, setting, t] for t in ts]
            ratios = [m / row[0] for m in row]
            cells = " ".join(f"{m:6.1f}{'!' if r > FLAGS.limit else ' '}" for m, r in zip(row, ratios))
            print(f"| {name} | {cfg.num_layers}/{full.num_layers} | {weights / 1e9:.2f} + {packed / 1e9:.2f} | "
                  f"{setting} | {weights / gbps / 1e6:.1f} | {cells} | {max(ratios):.2f} |")
            print("|   T/T=1 |  |  |  |  | " + " ".join(f"{r:6.2f} " for r in ratios) + " |  |")
            flagged += [f"{name} [{setting}] T={t}: {r:.2f}x" for t, r in zip(ts, ratios) if r > FLAGS.limit]
        del lm
        gc.collect()  # a packed LM refers to itself: free both before the next shape
        jax.clear_caches()
    print("over the limit: " + ("; ".join(flagged) if flagged else "none"))


if __name__ == "__main__":
    app.run(main)
