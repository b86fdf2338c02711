"""The three choices in `specjax/decode/warping.py` against the obvious alternative each:

    python launch/micro_sampling.py --vocab=4096 --rows=1,5

  nucleus     top-p by bisection over float32 bit patterns   vs  a sort of the vocabulary
  cumulative  cumsum as two triangular matmuls                vs  jnp.cumsum
  sample      inverse CDF, one uniform per distribution       vs  jax.random.categorical

`rows` distributions of `vocab` entries (1: a draft step at batch 1; 5: the K+1
distributions of one K=4 target pass). Each function runs N times inside one jitted
`fori_loop`, each iteration fed from the one before (so XLA can neither hoist it out of
the loop nor drop it), and per-iteration time = (time of 5 + N iterations - time of 5) / N:
the launch and the copy in cancel, and both sides of a pair pay the same feed-through (one
add and one max over the entries). Medians over repeats. Before timing, each pair is
checked to compute the same thing (for `sample`: valid tokens of the distribution; the
two draw different tokens from it).
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import flags  # noqa: E402

from specjax.app import cli  # noqa: E402
from specjax.decode import warping  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_integer("vocab", 4096, "Entries per distribution (the mini pair's vocabulary).")
    flags.DEFINE_string("rows", "1,5", "Comma-separated numbers of distributions per call.")
    flags.DEFINE_float("top_p", 0.95, "Top-p for the nucleus pair (the mini config's).")
    flags.DEFINE_float("temperature", 0.8, "Softmax temperature of the random test distributions.")
    flags.DEFINE_integer("iterations", 200, "N: timed iterations beyond the 5 that cancel the launch.")
    flags.DEFINE_integer("repeats", 15, "Timed pairs of runs per function; medians.")


def nucleus_by_sort(probs: jax.Array, top_p: float) -> jax.Array:
    """Textbook top-p: sort descending, keep every entry whose predecessors' mass is below
    top_p, renormalise (ties at the boundary kept together, as `warping.nucleus` does)."""
    desc = -jnp.sort(-probs, axis=-1)
    before = jnp.cumsum(desc, axis=-1) - desc
    threshold = jnp.min(jnp.where(before < top_p, desc, jnp.inf), axis=-1, keepdims=True)
    kept = jnp.where(probs >= threshold, probs, 0.0)
    return kept / jnp.sum(kept, axis=-1, keepdims=True)


def categorical(key: jax.Array, probs: jax.Array) -> jax.Array:
    return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)


def pairs(top_p: float):
    """{name: (ours, alternative)}: each (key, probs) -> an array."""
    return {
        "nucleus": (lambda k, p: warping.nucleus(p, top_p), lambda k, p: nucleus_by_sort(p, top_p)),
        "cumulative": (lambda k, p: warping.cumulative(p), lambda k, p: jnp.cumsum(p, axis=-1)),
        "sample": (lambda k, p: warping.sample(k, p)[0], categorical),
    }


def check(name: str, ours, alternative, key, probs) -> None:
    a, b = np.asarray(jax.jit(ours)(key, probs)), np.asarray(jax.jit(alternative)(key, probs))
    if name == "sample":
        p = np.asarray(probs)
        ok = all(p[r, a[r]] > 0 and p[r, b[r]] > 0 for r in range(p.shape[0]))
    else:
        ok = np.allclose(a, b, rtol=1e-5, atol=1e-6)
    if not ok:
        raise cli.RunError(f"{name}: the two sides disagree; the timing would compare different work")


def per_iteration_ms(fn, key, probs, iterations: int, repeats: int) -> float:
    def program(key, probs, n):
        def body(i, carry):
            out = fn(jax.random.fold_in(key, i), probs + carry)
            return jnp.where(jnp.max(out) == -7, 1.0, 0.0).astype(probs.dtype)  # never true
        return jax.lax.fori_loop(0, n, body, jnp.zeros((), probs.dtype))

    runs = {n: jax.jit(program, static_argnums=2).lower(key, probs, n).compile() for n in (5, 5 + iterations)}
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        runs[5 + iterations](key, probs).block_until_ready()
        middle = time.perf_counter()
        runs[5](key, probs).block_until_ready()
        times.append(((middle - start) - (time.perf_counter() - middle)) / iterations * 1e3)
    return float(np.median(times))


def main(argv):
    rows = cli.int_list("rows", FLAGS.rows)
    cli.positive("vocab", FLAGS.vocab)
    cli.positive("iterations", FLAGS.iterations)
    cli.positive("repeats", FLAGS.repeats)
    if not 0 < FLAGS.top_p < 1:
        raise cli.UsageError(f"--top_p={FLAGS.top_p}: must be in (0, 1)")
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; vocab {FLAGS.vocab}, top_p {FLAGS.top_p}, "
          f"median of {FLAGS.repeats} x {FLAGS.iterations} iterations")
    print(f"{'function':12s} {'rows':>4s} {'ours ms':>9s} {'alternative ms':>15s} {'alternative / ours':>19s}")
    key = jax.random.key(0)
    for r in rows:
        logits = jax.random.normal(jax.random.key(r), (r, FLAGS.vocab), jnp.float32) * 3
        probs = jax.nn.softmax(logits / FLAGS.temperature, axis=-1)
        for name, (ours, alternative) in pairs(FLAGS.top_p).items():
            check(name, ours, alternative, key, probs)
            a = per_iteration_ms(ours, key, probs, FLAGS.iterations, FLAGS.repeats)
            b = per_iteration_ms(alternative, key, probs, FLAGS.iterations, FLAGS.repeats)
            print(f"{name:12s} {r:4d} {a:9.4f} {b:15.4f} {b / a:18.1f}x")


if __name__ == "__main__":
    define_flags()
    cli.run(main)
