"""`python -m specjax.plan --config=chinchilla_70b`: paper scale without a pod.

Lowers and compiles THE programs `generate` runs (built by `program.build`) on a mesh of
fake CPU devices, with every parameter and prompt a sharded `jax.ShapeDtypeStruct`: nothing
the size of the model is allocated. `--compiler=tpu` compiles them with XLA:TPU instead,
for a slice of `--chip` chips on libtpu's compile-only client (`analysis.tpu`; the `tpu`
extra, no TPU needed): memory per chip is XLA:TPU's own, and the loop's parts are compiled
as programs of their own and costed (`analysis.steps`: HBM bytes read against the ideal,
an estimated ms/token; docs/pods.md). It reports compile time, bytes per device against the chip's
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

from specjax.analysis import compile as compile_lib, plan_report as report_lib, tpu
from specjax.analysis.roofline import CHIPS, Chip
from specjax.app import cli, output, setup
from specjax.app.locate import Sources
from specjax.config import HeadsConfig, MeshConfig, SamplingConfig, UsageError
from specjax.decode import drafters

FLAGS = flags.FLAGS


def define_flags() -> None:
    cli.define_config_flag("chinchilla_70b")
    flags.DEFINE_string("mesh", None, "DATAxMODEL fake-device mesh, e.g. 1x16 (default: the config's mesh; "
                        "a config with model=-1 gets 1x8).")
    flags.DEFINE_string("json", None, "Also write the report's numbers to this JSON file.")
    flags.DEFINE_integer("batch", 1, "Rows per batch.")
    flags.DEFINE_integer("prompt_len", 128, "Prompt tokens per row (the prefill).")
    flags.DEFINE_integer("cache_len", None, "KV-cache (and token buffer) length; default min(2048, max_seq_len).")
    flags.DEFINE_enum("chip", "v4", list(CHIPS), "TPU generation: HBM size and bandwidth, peak bf16 FLOP/s, ICI; "
                      "with --compiler=tpu also the slice compiled for.")
    flags.DEFINE_enum("compiler", "cpu", ["cpu", "tpu"], "cpu: XLA:CPU on fake CPU devices (TPU padding and the "
                      "roofline added by hand); tpu: XLA:TPU through libtpu's compile-only client for a slice of "
                      "--chip (pip install 'specjax[tpu]'; no TPU needed), with the loop's parts costed.")
    flags.DEFINE_float("collective_latency_us", Chip.collective_latency_s * 1e6,
                       "Fixed latency per collective in the TPU roofline (microseconds).")
    cli.define_quantize_flag()
    # The sampling group of sample/bench/evaluate (the budget is --cache_len here): the
    # programs compiled sample with them. --drafter=medusa|eagle|eagle3 also compiles drafting by
    # random draft heads on the target (the config's, else the defaults: size them with
    # --config.heads.num_heads=N), next to the config's draft model; --num_drafts > 1 also
    # compiles the tree loop of that many chains next to the chain, --draft_tree=dynamic the
    # loops that grow a tree of --tree_nodes nodes (by the draft model, and by EAGLE heads).
    cli.define_sampling_flags([name for name in cli.SAMPLING_FLAGS if name != "max_new_tokens"])
    flags.DEFINE_bool("licm", False, "Keep XLA's while-loop-invariant-code-motion pass (XLA:CPU then hoists "
                      "the f32 copy of the stacked weights out of the layer loop; unrealistic temporaries).")


def configure_xla(devices: int, licm: bool, compiler: str = "cpu") -> None:
    """Fake CPU devices and XLA options; must run before JAX creates its CPU backend
    (importing jax does not; the first device or compile call does). For XLA:TPU none:
    the CPU backend only hosts the process, and libtpu reads XLA_FLAGS as they are."""
    os.environ["JAX_PLATFORMS"] = "cpu"  # plan on fake CPU devices even on a TPU host
    if compiler == "tpu":
        return
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


def drafting(cfg) -> tuple[SamplingConfig, HeadsConfig | None]:
    """(the sampling flags over the config's: the draft model's program settings, with
    num_drafts the tree's M; the draft heads --drafter asks for, or None), checked by the
    one run setup as every command's (`app.setup.prepare`: what the drafter declares it
    draws from, its cap on K, the settings it honours), with random weights."""
    sampling = cli.sampling(cfg.sampling, skip=("max_new_tokens",)).validate()
    cls = drafters.kind(sampling.drafter)
    planned = [n for n, c in drafters.REGISTRY.items() if (c.heads_kind or c.needs_draft_model) and not c.uses_datastore]
    if sampling.drafter not in planned:
        raise UsageError(f"--drafter={sampling.drafter}: plan compiles draft models and draft heads "
                         f"({', '.join(planned)}); a lookup has no weights to size")
    if sampling.num_drafts > 1 and not cls.heads_kind and cfg.draft is None:
        raise UsageError(f"--num_drafts={sampling.num_drafts}: --config={FLAGS.config} has no draft model to draw "
                         "chains from")
    if sampling.draft_tree == "dynamic" and not cls.heads_kind and cfg.draft is None:
        raise UsageError(f"--draft_tree=dynamic: --config={FLAGS.config} has no draft model to grow a tree with "
                         "(or pass --drafter=eagle or eagle3)")
    # A config without a draft model plans ArS (and any heads drafting) alone.
    used = () if cls.needs_draft_model and cfg.draft is None else (sampling.drafter,)
    setup.prepare(setup.Request(cfg, sampling, used, sources=Sources(init="random")))
    heads = cfg.heads_for(cls.heads_kind) if cls.heads_kind else None
    # A draft-model drafter (model, parallel) drafts the 'sps' program; heads draft 'sps_<kind>'.
    return dataclasses.replace(sampling, drafter=sampling.drafter if cls.needs_draft_model else "model"), heads


def main(argv):
    cfg = cli.config()
    data, model = cli.mesh_size(cli.parse_mesh(FLAGS.mesh, cfg.mesh if cfg.mesh.model != -1 else MeshConfig(1, 8)), 0)
    batch, prompt_len = cli.positive("batch", FLAGS.batch), cli.positive("prompt_len", FLAGS.prompt_len)
    cache_len = cli.positive("cache_len", FLAGS.cache_len)
    latency = cli.finite("collective_latency_us", FLAGS.collective_latency_us, 0.0, 1e6)
    if FLAGS.compiler == "tpu":
        tpu.check(FLAGS.chip, data, model)
    # Before anything asks JAX for devices: the run setup's checks do (`distributed.everywhere`
    # counts processes), and a backend made first has one CPU device, not the mesh's.
    configure_xla(data * model, FLAGS.licm, FLAGS.compiler)
    jax.config.update("jax_platforms", "cpu")
    sampling, heads = drafting(cfg)
    output.check_writable(FLAGS.json, "--json")
    chip = dataclasses.replace(CHIPS[FLAGS.chip], collective_latency_s=latency * 1e-6)
    chains = dataclasses.replace(sampling, num_drafts=1, draft_tree="chains")
    report = compile_lib.plan(dataclasses.replace(cfg, sampling=chains), data, model, batch, prompt_len, cache_len,
                              chip, sampling.num_drafts, cli.quantize(), heads,
                              sampling.tree_nodes if sampling.draft_tree == "dynamic" else 0, FLAGS.compiler)
    print(report_lib.format_report(report))
    if FLAGS.json:
        output.save(FLAGS.json, json.dumps(report, indent=1, default=str), "--json")
        print(f"wrote {FLAGS.json}", file=sys.stderr)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
