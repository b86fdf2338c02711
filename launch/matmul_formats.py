"""The few-row kernel alone, per weight format: ms per x[T, K] @ W[K, N] for each `quantize`
kind (and float32) or GGUF type's form, T rows, in one jitted loop of `--calls` calls (so no
dispatch per call), min and median of `--repeats` loops.

    python launch/matmul_formats.py --shape=2048x8192 --tokens=1,5,8
    python launch/matmul_formats.py --shape=576x1536 --formats=int4,w4a8 --calls=2000
    python launch/matmul_formats.py --shape=1536x576 --formats=Q4_K,Q4_K/a8,Q6_K/a8,Q5_0/a8

Random float32 weights quantized as `LM.quantized` does, then packed as decoding packs them;
a GGUF type (`weights.gguf_codecs.CODECS`; '/a8': times int8 activations) is random codes
and scales of its form (bits, group, offset or minimums, two-level factors).
GB/s counts the panels and their scales (what the kernel reads); a matrix that fits in the
CPU's caches is read from there, so a model's many matrices (read from memory) run slower.
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from specjax.kernels import Kernels, available, formats  # noqa: E402
from specjax.weights.gguf_codecs import CODECS  # noqa: E402

flags.DEFINE_string("shape", "2048x8192", "KxN of the weight.")
flags.DEFINE_list("tokens", ["1", "5", "8"], "Rows T (1..8).")
flags.DEFINE_list("formats", ["float32", "int8", "int4", "w4a8", "w8a8"],
                  "float32, kernels.formats.QUANTIZERS kinds and/or GGUF types (Q4_K, Q6_K/a8, ...).")
flags.DEFINE_integer("calls", 200, "Calls per timed loop.")
flags.DEFINE_integer("repeats", 7, "Timed loops.")
FLAGS = flags.FLAGS


def gguf_form(kind: str, K: int, N: int, rng) -> formats.Grouped:
    """Random codes and float16 scales of a GGUF type's form ('Q4_K', 'Q4_K/a8')."""
    c = CODECS[kind.split("/")[0]]
    G = -(-K // c.group)
    S = -(-G // c.per)
    half = lambda: jnp.asarray(rng.uniform(-1, 1, (S, N)).astype(np.float16).astype(np.float32) / K)  # noqa: E731
    factor = lambda: jnp.asarray(rng.integers(0, 64, (S * c.per, N)).astype(np.int8)) if c.per > 1 else None  # noqa: E731
    return formats.Grouped(jnp.asarray(rng.integers(0, 2 ** c.bits, (K, N)).astype(np.uint8)), half(),
                           half() if c.minimums else None, (N,), bits=c.bits, group=c.group, offset=c.offset,
                           activations="int8" if kind.endswith("/a8") else "float32", scale_factor=factor(),
                           low_factor=factor() if c.minimums else None)


def weight(kind: str, w: jax.Array, rng):
    if kind == "float32":
        return formats.pack(w, 1)
    q = gguf_form(kind, *w.shape, rng) if kind.split("/")[0] in CODECS else formats.QUANTIZERS[kind](w, 1)
    return formats.pack_params({"w": q}, {"w": (1, 2)})["w"]


def read_bytes(w) -> int:
    """What the kernel reads: the panels, and an int8 weight's column scales or a grouped one's
    scales and factors."""
    if isinstance(w, formats.Grouped):
        return w.panels.nbytes + w.aux.nbytes + w.aux_factor.nbytes
    return w.panels.nbytes + (w.scale.nbytes if isinstance(w, formats.Int8) else 0)


def main(argv):
    try:
        K, N = (int(v) for v in FLAGS.shape.split("x"))
        ts = [int(t) for t in FLAGS.tokens]
    except ValueError:
        raise app.UsageError(f"--shape={FLAGS.shape} --tokens={','.join(FLAGS.tokens)}: want KxN and integers")
    if not all(1 <= t <= 8 for t in ts) or K < 1 or N < 1:
        raise app.UsageError(f"--tokens={','.join(FLAGS.tokens)}: each in 1..8; --shape={FLAGS.shape}: positive")
    unknown = set(FLAGS.formats) - {"float32", *formats.QUANTIZERS, *CODECS, *(t + "/a8" for t in CODECS)}
    if unknown:
        raise app.UsageError(f"--formats: {sorted(unknown)} not float32, one of {', '.join(formats.QUANTIZERS)} or "
                             f"a GGUF type ({', '.join(CODECS)}, with or without /a8)")
    if not available():
        raise app.UsageError("the CPU kernels are not built here (no C++ compiler?): nothing to time")
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((K, N)).astype(np.float32) * K ** -0.5)
    print(f"{K}x{N}, {FLAGS.calls} calls per loop, min (median) of {FLAGS.repeats} loops, ms per call")
    for kind in FLAGS.formats:
        packed = weight(kind, w, rng)
        for T in ts:
            x = jnp.asarray(rng.standard_normal((T, K)).astype(np.float32))

            @jax.jit
            def loop(x, packed):
                def body(_, x):  # each call depends on the last: nothing is hoisted or overlapped
                    y = packed.project("tk,kn->tn", x, Kernels())
                    return x + 1e-9 * jnp.resize(y, x.shape)
                return jax.lax.fori_loop(0, FLAGS.calls, body, x)
            loop(x, packed).block_until_ready()
            times = []
            for _ in range(FLAGS.repeats):
                start = time.perf_counter()
                loop(x, packed).block_until_ready()
                times.append((time.perf_counter() - start) / FLAGS.calls * 1e3)
            best = min(times)
            print(f"  {kind:8s} T={T}: {best:.3f} ({float(np.median(times)):.3f}) ms, "
                  f"{read_bytes(packed) / best / 1e6:.1f} GB/s")


if __name__ == "__main__":
    app.run(main)
