"""Compile (never run) a config's random init for several layer counts: compile seconds
and compiled HLO instructions, on fake CPU devices, nothing allocated.

    python launch/init_compile.py --config=chinchilla_70b --layers=8,80 --devices=16

What is compiled is what `model.init_lm` jits: `Transformer(cfg, Keys(seed))` split into
its params, created with their shardings on a 1 x devices mesh (target model). Only
`model.Transformer`, `model.Keys` and `sharding` are used, so older trees run it too.
"""
from __future__ import annotations

import os
import time

from absl import app, flags

flags.DEFINE_string("config", "chinchilla_70b", "Config whose target model's init is compiled.")
flags.DEFINE_string("layers", "8,80", "Layer counts to compile.")
flags.DEFINE_integer("devices", 16, "Fake CPU devices: the mesh is 1 x devices.")
FLAGS = flags.FLAGS


def main(argv):
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={FLAGS.devices}"  # before JAX starts
    import dataclasses

    import jax
    from flax import nnx

    from specjax import model, sharding
    from specjax.config import MeshConfig, load_config

    base = load_config(FLAGS.config).target
    mesh = sharding.make_mesh(MeshConfig(1, FLAGS.devices))
    for layers in (int(n) for n in FLAGS.layers.split(",")):
        cfg = dataclasses.replace(base, num_layers=layers)

        def make(cfg=cfg):
            return nnx.split(model.Transformer(cfg, model.Keys(0)))[1]

        shardings = sharding.param_shardings(nnx.eval_shape(make), mesh)
        start = time.perf_counter()
        lowered = jax.jit(make, out_shardings=shardings).lower()
        compiled = lowered.compile()
        seconds = time.perf_counter() - start
        instructions = sum(1 for line in compiled.as_text().splitlines() if " = " in line)
        print(f"{FLAGS.config} target, {layers} layers: lower + compile {seconds:.1f} s, "
              f"{instructions} compiled HLO instructions", flush=True)


if __name__ == "__main__":
    app.run(main)
