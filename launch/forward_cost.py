"""What one cached forward costs: T tokens scored against a KV cache of S slots.

    python launch/forward_cost.py --config=mini_target --tokens=1,2,5 --cache=64,512,1024

Each measurement is N forwards inside one jitted `fori_loop` with the cache donated, as
in the sampling loops (in-place cache writes), at batch 1 (`--batch`) with the cache one third full,
compiled as `generate` compiles (program.compile_lowered); medians over repeats. T=1 is an
ArS step or a draft step; T=K+1 is SpS's scoring pass. `--kernels=off,on` compiles each
program without and with specjax's CPU kernels (the model's static `Kernels` setting)
and interleaves all of them, for an A/B within one run; `--quantize=none,int8` does the
same for the float model and its int8 quantization (`LM.quantized`).
"""
from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from specjax import kernels, kv_cache, model, sharding
from specjax.decode import program
from specjax.config import QUANTIZATIONS, MeshConfig, load_config
from specjax.kernels import Kernels, dispatch

flags.DEFINE_string("config", "mini_target", "Config whose target model is measured.")
flags.DEFINE_string("tokens", "1,2,5", "Tokens per forward (T).")
flags.DEFINE_string("cache", "64,512,1024", "Cache slots (S).")
flags.DEFINE_integer("batch", 1, "Rows per forward (B): the kernels gate on queries per row, not B x T.")
flags.DEFINE_integer("steps", 16, "Forwards per timed loop.")
flags.DEFINE_integer("repeats", 10, "Timed loops per setting (median).")
flags.DEFINE_list("kernels", ["default"], "Kernel settings to compare: on, off, default ($SPECJAX_KERNELS at start), "
                  "or kernels' names joined by + (matmul, attention, nucleus; e.g. matmul+attention).")
flags.DEFINE_integer("bandwidth_mb", 512, "Array size for the memory-bandwidth measurement (0: skip).")
flags.DEFINE_enum("clock", "wall", ["wall", "cpu"], "wall: elapsed time; cpu: this process's CPU time (all its "
                  "threads), which other jobs on a shared host inflate far less than the elapsed time.")
flags.DEFINE_list("quantize", ["none"], "Weights to compare: none (the float model) and/or int8, int4, w4a8, w8a8 "
                  "(quantized).")
FLAGS = flags.FLAGS


def loop(lm, cache, tokens: int, steps: int):
    def body(_, c):
        pos = c.lengths[:, None] + jnp.arange(tokens)[None]
        logits, c = lm.extend(jnp.zeros((c.lengths.shape[0], tokens), jnp.int32), pos, c)
        # Advance one slot; the logits feed the carry so the forward cannot be dropped.
        return c.with_lengths(c.lengths + 1 + (logits[0, 0, 0] > 1e30).astype(jnp.int32))
    return jax.lax.fori_loop(0, steps, body, cache)


def read_bandwidth(megabytes: int, repeats: int = 10) -> dict[str, float]:
    """GB/s reading `megabytes` (far larger than the caches) two ways: a jitted float32 row
    sum (64 rows so that XLA:CPU can spread them over its threads), and, where specjax's
    CPU kernels are available, a one-row matmul by the few-row kernel (which streams the
    weights faster than XLA's reduction does, so the row sum alone understates the rate)."""
    rows = 64
    x = jnp.ones((rows, megabytes * 2**20 // 4 // rows), jnp.float32)
    readers = {"XLA row sum": (jax.jit(lambda a: a.sum(axis=1)), x)}
    if jax.default_backend() == "cpu" and kernels.available():
        w = kernels.pack(x.reshape(-1, 4096), 1)
        matmul = jax.jit(dispatch.fewrow_matmul, static_argnums=2)
        readers["few-row kernel, 1 row"] = (matmul, jnp.ones((1, w.panels.shape[1])), w.panels, w.n)
    rates = {}
    for name, (fn, *args) in readers.items():
        fn(*args).block_until_ready()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn(*args).block_until_ready()
            times.append(time.perf_counter() - start)
        rates[name] = x.nbytes / float(np.median(times)) / 1e9
    return rates


def forward_times(lm, ts, sizes, settings, steps: int, repeats: int, clock: str = "wall", quantize=("none",),
                  batch: int = 1, memory: dict | None = None) -> dict[tuple[int, str, int], float]:
    """Median ms per forward of `lm` for every (cache size, kernel setting, T), and each of
    `quantize` ('none' or a `QUANTIZATIONS` kind: the label is then 'setting/kind'): `steps`
    forwards per timed loop (`loop`), `repeats` loops, every program interleaved with the
    others of its cache size so that machine noise hits every T and setting alike.
    `clock`: 'wall' or 'cpu' (CPU ms of the process, summed over its threads). `memory`, if
    given, receives each program's compiled temporaries in bytes under the same keys (a
    quantized model whose dots materialise a float copy of a weight per step shows it
    there: the whole loop's temporaries, the cache excluded, it is donated), and each
    kind's weight bytes under ('weights', kind)."""
    now = time.perf_counter if clock == "wall" else time.process_time
    cfg = lm.cfg
    out = {}
    weights = {kind: lm if kind == "none" else lm.quantized(kind) for kind in quantize}
    if memory is not None:
        memory.update({("weights", kind): sum(x.nbytes for x in jax.tree.leaves(w.params))
                       for kind, w in weights.items()})
    labels = {(s if kind == "none" else f"{s}/{kind}"): (s, w) for kind, w in weights.items() for s in settings}
    for size in sizes:
        # A relative-position model's table is made at prefill, so outside the timed loop.
        fresh = lambda: lm.with_position_table(kv_cache.init_cache(cfg, batch, size)).with_lengths(  # noqa: E731
            jnp.full((batch,), size // 3, jnp.int32))
        progs, subject = {}, {}
        for setting, (name, weights_lm) in labels.items():
            # Packed where the matmul kernel runs, as decoding has it; the setting is the
            # model's static data, so each setting traces and compiles its own programs.
            subject[setting] = weights_lm.with_kernels(Kernels.parse(name)).packed()
            for t in ts:
                fn = jax.jit(functools.partial(loop), static_argnums=(2, 3), donate_argnums=1)
                progs[setting, t] = program.compile_lowered(fn.lower(subject[setting], fresh(), t, steps))
                if memory is not None:
                    analysis = progs[setting, t].memory_analysis()
                    memory[size, setting, t] = getattr(analysis, "temp_size_in_bytes", float("nan"))
        times = {key: [] for key in progs}
        for _ in range(repeats):
            for key, prog in progs.items():
                c = jax.block_until_ready(fresh())
                start = now()
                jax.block_until_ready(prog(subject[key[0]], c))
                times[key].append((now() - start) / steps * 1e3)
        out.update({(size, *key): float(np.median(t)) for key, t in times.items()})
    return out


def check_settings(settings) -> None:
    for setting in settings:
        try:
            Kernels.parse(setting)
        except ValueError as e:
            raise app.UsageError(f"--kernels: {e}")


def main(argv):
    cfg = load_config(FLAGS.config).target
    ts = [int(t) for t in FLAGS.tokens.split(",")]
    sizes = [int(s) for s in FLAGS.cache.split(",")]
    check_settings(FLAGS.kernels)
    if not set(FLAGS.quantize) <= {"none", *QUANTIZATIONS}:
        raise app.UsageError(f"--quantize={','.join(FLAGS.quantize)}: expected none and/or {', '.join(QUANTIZATIONS)}")
    lm = model.init_lm(cfg, sharding.make_mesh(MeshConfig(1, 1), jax.devices()[:1]))
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(lm.params))
    print(f"{FLAGS.config}: {lm.num_params / 1e6:.1f}M params, {weight_bytes / 1e6:.1f} MB")
    if FLAGS.bandwidth_mb:
        rates = read_bandwidth(FLAGS.bandwidth_mb)
        gbps = max(rates.values())
        print("memory read bandwidth " + ", ".join(f"{v:.1f} GB/s ({k})" for k, v in rates.items())
              + f" -> 1-token roofline {weight_bytes / gbps / 1e6:.2f} ms"
              " (weights read once at the best rate, cache ignored)")
    print(f"{FLAGS.clock} ms per forward of batch {FLAGS.batch} (median of {FLAGS.repeats})")
    rows = [s if q == "none" else f"{s}/{q}" for q in FLAGS.quantize for s in FLAGS.kernels]
    label = len(rows) > 1
    wide = max(8, *(len(k) for k in rows))
    print("cache S  " + (f"{'kernels':<{wide}} " if label else "") + "  ".join(f"T={t:<6}" for t in ts) + "  T_max/T_1")
    temps = {}
    med = forward_times(lm, ts, sizes, FLAGS.kernels, FLAGS.steps, FLAGS.repeats, FLAGS.clock, FLAGS.quantize,
                        FLAGS.batch, memory=temps)
    for size in sizes:
        for setting in rows:
            row = [med[size, setting, t] for t in ts]
            print(f"{size:<8} " + (f"{setting:<{wide}} " if label else "") + "  ".join(f"{m:<8.2f}" for m in row)
                  + f"  {row[-1] / row[0]:.2f}")
    for kind in FLAGS.quantize:
        print(f"weights {kind}: {temps['weights', kind] / 1e6:.3f} MB")
    print("compiled temporaries per program, MB (cache S, setting: T=...)")
    for size in sizes:
        for setting in rows:
            print(f"{size:<8} {setting:<{wide}} " + "  ".join(f"{temps[size, setting, t] / 1e6:<8.1f}" for t in ts))


if __name__ == "__main__":
    app.run(main)
