"""`python -m specjax.plan --config=chinchilla_70b`: paper scale without a pod.

Lowers and compiles THE programs `generate` runs (built by `program.build`) on a mesh of
fake CPU devices, with every parameter a sharded `jax.ShapeDtypeStruct`: nothing the size
of the model is allocated. It reports compile time, bytes per device against the chip's
HBM, collectives per SpS loop / ArS step and outside the loop (counted in the
compiled HLO), and a TPU roofline ms/token set against the paper's Table 1
(`specjax.analysis`). `--chip=v4|v5e|v5p|v6e` picks the chip (HBM size and bandwidth, peak
FLOP/s: `roofline.CHIPS`); memory counts TPU padding (minor dims to 128 lanes) and kv
heads duplicated as the loaders do (`kv_heads`), and the report says how many chips the
config needs on that chip. `--quantize=int8|int4` plans the models as `--quantize` loads
them (`LM.quantized`): their bytes per device, and what XLA keeps of a dequantized weight
(the temporaries column).

Why `--xla_disable_hlo_passes=while-loop-invariant-code-motion`: XLA:CPU hoists the
bf16->f32 convert of the stacked (scanned) weights out of the layer loop, so the whole
f32 copy of every layer lives at once (benchmarks/paper_scale.md). A TPU feeds bf16 to the
MXU and converts nothing, so the numbers without the pass are the realistic ones.
`--licm` keeps XLA's default passes to show the difference. plan also passes
`--xla_backend_optimization_level=0`: it never runs the code, and LLVM's optimisation is
most of the compile time while buffer assignment (hence memory_analysis) comes before it;
and `--xla_cpu_use_fusion_emitters=false`: XLA:CPU's MLIR fusion emitters cost the same at
every optimisation level, so at level 0 they are most of what is left (chinchilla_70b's
plan in 0.6x the time and 0.4x the peak memory, the same collectives and memory within a
kilobyte: benchmarks/paper_scale.md).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import jax
from absl import flags

from specjax.analysis import compile as compile_lib, plan_report as report_lib
from specjax.analysis.roofline import CHIPS, Chip
from specjax.app import cli, output
from specjax.config import HeadsConfig, MeshConfig, SamplingConfig, UsageError

FLAGS = flags.FLAGS


def define_flags() -> None:
    cli.define_config_flag("chinchilla_70b")
    flags.DEFINE_string("mesh", None, "DATAxMODEL fake-device mesh, e.g. 1x16 (default: the config's mesh; "
                        "a config with model=-1 gets 1x8).")
    flags.DEFINE_string("json", None, "Also write the report's numbers to this JSON file.")
    flags.DEFINE_integer("batch", 1, "Rows per batch.")
    flags.DEFINE_integer("prompt_len", 128, "Prompt tokens per row (the prefill).")
    flags.DEFINE_integer("cache_len", None, "KV-cache (and token buffer) length; default min(2048, max_seq_len).")
    flags.DEFINE_enum("chip", "v4", list(CHIPS), "TPU generation: HBM size and bandwidth, peak bf16 FLOP/s, ICI.")
    flags.DEFINE_float("collective_latency_us", Chip.collective_latency_s * 1e6,
                       "Fixed latency per collective in the TPU roofline (microseconds).")
    cli.define_quantize_flag()
    # The sampling group of sample/bench/evaluate (the budget is --cache_len here): the
    # programs compiled sample with them. --drafter=medusa|eagle|eagle3 also compiles drafting by
    # random draft heads on the target (the config's, else the defaults: size them with
    # --config.heads.num_heads=N), next to the config's draft model; --num_drafts > 1 also
    # compiles the tree loop of that many chains next to the chain.
    cli.define_sampling_flags([name for name in cli.SAMPLING_FLAGS if name != "max_new_tokens"])
    flags.DEFINE_bool("licm", False, "Keep XLA's while-loop-invariant-code-motion pass (XLA:CPU then hoists "
                      "the f32 copy of the stacked weights out of the layer loop; unrealistic temporaries).")


def configure_xla(devices: int, licm: bool) -> None:
    """Fake CPU devices and XLA options; must run before JAX creates its CPU backend
    (importing jax does not; the first device or compile call does)."""
    flags_ = [f for f in os.environ.get("XLA_FLAGS", "").split()
              if not f.startswith("--xla_force_host_platform_device_count")]
    flags_.append(f"--xla_force_host_platform_device_count={devices}")
    if not licm and not any("while-loop-invariant-code-motion" in f for f in flags_):
        flags_.append("--xla_disable_hlo_passes=while-loop-invariant-code-motion")
    if not any(f.startswith("--xla_backend_optimization_level") for f in flags_):
        flags_.append("--xla_backend_optimization_level=0")  # plan never runs the code: skip LLVM optimisation
    if not any(f.startswith("--xla_cpu_use_fusion_emitters") for f in flags_):
        flags_.append("--xla_cpu_use_fusion_emitters=false")  # nor the MLIR fusion pipeline
    os.environ["XLA_FLAGS"] = " ".join(flags_)
    os.environ["JAX_PLATFORMS"] = "cpu"  # plan on fake CPU devices even on a TPU host


PLANNED_DRAFTERS = ("model", "medusa", "eagle", "eagle3")  # the lookup drafters hold no weights to plan


def drafting(cfg) -> tuple[SamplingConfig, HeadsConfig | None]:
    """(the sampling flags over the config's: the draft model's program settings, with
    num_drafts the tree's M; the draft heads --drafter asks for, or None)."""
    sampling = cli.sampling(cfg.sampling, skip=("max_new_tokens",))
    if sampling.drafter not in PLANNED_DRAFTERS:
        raise UsageError(f"--drafter={sampling.drafter}: plan compiles draft models and draft heads "
                         f"({', '.join(PLANNED_DRAFTERS)}); a lookup drafter has no weights to size")
    heads = cfg.heads_for(sampling.drafter) if sampling.drafter != "model" else None
    sampling.validate()
    if sampling.num_drafts > 1 and heads is None and cfg.draft is None:
        raise UsageError(f"--num_drafts={sampling.num_drafts}: --config={FLAGS.config} has no draft model to draw "
                         "chains from")
    return dataclasses.replace(sampling, drafter="model"), heads


def main(argv):
    cfg = cli.config()
    data, model = cli.mesh_size(cli.parse_mesh(FLAGS.mesh, cfg.mesh if cfg.mesh.model != -1 else MeshConfig(1, 8)), 0)
    batch, prompt_len = cli.positive("batch", FLAGS.batch), cli.positive("prompt_len", FLAGS.prompt_len)
    cache_len = cli.positive("cache_len", FLAGS.cache_len)
    latency = cli.finite("collective_latency_us", FLAGS.collective_latency_us, 0.0, 1e6)
    sampling, heads = drafting(cfg)
    output.check_writable(FLAGS.json, "--json")
    configure_xla(data * model, FLAGS.licm)
    jax.config.update("jax_platforms", "cpu")
    chip = dataclasses.replace(CHIPS[FLAGS.chip], collective_latency_s=latency * 1e-6)
    report = compile_lib.plan(dataclasses.replace(cfg, sampling=dataclasses.replace(sampling, num_drafts=1)), data,
                              model, batch, prompt_len, cache_len, chip, sampling.num_drafts, cli.quantize(), heads)
    print(report_lib.format_report(report))
    if FLAGS.json:
        output.save(FLAGS.json, json.dumps(report, indent=1, default=str), "--json")
        print(f"wrote {FLAGS.json}", file=sys.stderr)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
