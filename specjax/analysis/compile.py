"""Compile THE programs `generate` runs for a config at any scale, without weights.

Every parameter is a sharded `jax.ShapeDtypeStruct` (`model.abstract_lm`), the program
is built by `program.build` (the path `generate` takes) and compiled the way `generate`
compiles it; the report holds bytes per device (`memory_analysis`), collectives per SpS
loop / ArS step and outside it (`hlo`), and the roofline (`roofline`). The random init
that `init_lm` would run is compiled too (its size must not grow with the layer count).
"""
from __future__ import annotations

import dataclasses
import os
import resource
import time
from typing import Any

import jax
import jax.numpy as jnp

from specjax import kv_cache, kv_heads, sharding
from specjax.analysis import steps as steps_lib, tpu
from specjax.analysis.hlo import HloProgram, summarize
from specjax.analysis.roofline import CHIPS, Chip, compiled_estimate, fitted_latency, is_paper_scale, roofline, shard_bytes
from specjax.config import GROWN_TREES, HeadsConfig, MeshConfig, UsageError
from specjax.decode import program as program_lib
from specjax.heads import abstract_heads
from specjax.kernels import NONE as NO_KERNELS
from specjax.model import LM, abstract_lm, init_program


def planned(target, draft, sampling, batch: int, prompt_len: int, cache_len: int) -> program_lib.Program:
    """The `Program` `generate` would build for `batch` prompts of `prompt_len` tokens and
    a cache of `cache_len` slots, from abstract prompts: building it touches no device."""
    lookahead = sampling.lookahead if draft is not None else 1
    width = program_lib.bucket(prompt_len)
    max_new = cache_len - program_lib.cache_size(width, 0, lookahead)
    if max_new < 1:
        raise UsageError(f"--cache_len={cache_len} leaves no room to generate after a {width}-token "
                         f"(padded) prompt and K+1={lookahead + 1} scoring slots")
    sampling = dataclasses.replace(sampling, max_new_tokens=max_new)
    prompts = jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32)  # abstract: nothing placed on a device
    return program_lib.build(target, draft, prompts, sampling, seed=0)


def compile_program(target, draft, sampling, batch: int, prompt_len: int, cache_len: int,
                    steps_on: Chip | None = None) -> dict:
    """Lower + compile the program `generate` would run for `batch` prompts of
    `prompt_len` tokens and a cache of `cache_len` slots, built by `program.build` (from
    abstract prompts: nothing is placed on a device) and compiled by
    `program.compile_lowered` as `generate` does, for the devices of the models' mesh.
    `target` and `draft` (None: ArS) may be abstract (`model.abstract_lm`) or real.
    Returns a dict with 'per_loop' and 'outside_loop' (`summarize` of the collectives per
    SpS loop / ArS step and outside it), 'memory' (bytes per device), 'compile_seconds',
    'statics', 'fingerprint', 'compiler' (the devices' platform); with `steps_on`, also
    'steps': the loop's parts compiled and costed on that chip (`steps.cost`)."""
    prog = planned(target, draft, sampling, batch, prompt_len, cache_len)
    start = time.perf_counter()
    lowered = prog.lower()
    lower_s = time.perf_counter() - start
    compiled = program_lib.compile_lowered(lowered, prog.platform)  # as Program.compile does for generate
    compile_s = time.perf_counter() - start - lower_s
    mem = compiled.memory_analysis()
    text = compiled.as_text()
    per_loop, outside = HloProgram(text).loop_and_outside()
    total = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
    result = {"program": prog.fn.__name__, "compiler": prog.platform, "fingerprint": program_lib.fingerprint(compiled),
              "statics": {k: as_json(v) for k, v in prog.statics},
              "lower_seconds": lower_s, "compile_seconds": compile_s,
              "memory": {"arguments": mem.argument_size_in_bytes, "outputs": mem.output_size_in_bytes,
                         "temporaries": mem.temp_size_in_bytes, "aliased": mem.alias_size_in_bytes, "total": total,
                         # XLA:TPU's peak of live bytes (arguments included); XLA:CPU reports none
                         "peak": getattr(mem, "peak_memory_in_bytes", 0) or None},
              "per_loop": summarize(per_loop), "outside_loop": summarize(outside)}
    if steps_on is not None:
        result["steps"] = steps_lib.cost(prog, steps_on)
    return result


def as_json(value):
    """A compiled program's static setting as JSON: named tuples (the settings, their warp)
    as objects at every depth, and a value the program takes as an operand (a warp's
    temperature and top-p, None in the key) as "traced"."""
    if hasattr(value, "_asdict"):
        return {k: "traced" if v is None and k in ("temperature", "top_p") else as_json(v)
                for k, v in value._asdict().items()}
    return value


def compile_init(cfg, mesh) -> dict:
    """Lower + compile (never run) the random init `init_lm` runs for `cfg` on `mesh`:
    its compile seconds and size (instructions in the compiled HLO)."""
    _, init = init_program(cfg, mesh)
    start = time.perf_counter()
    with jax.set_mesh(mesh):
        text = program_lib.compile_lowered(init.lower()).as_text()
    return {"compile_seconds": time.perf_counter() - start,
            "hlo_instructions": sum(1 for line in text.splitlines() if " = " in line)}


def valid_model_axes(models: dict, limit: int = 1024) -> list[int]:
    """'model' axis sizes every model splits over (`sharding.check_divisible`'s rule)."""
    def ok(c, m):
        kv = c.num_kv_heads
        return all(getattr(c, f) % m == 0 for f in ("num_heads", "d_ff", "vocab_size")) and not (kv % m and m % kv)
    return [m for m in range(1, limit + 1) if all(ok(kv_heads.original(c), m) for c in models.values())]


def capacity(report: dict, models: dict, data: int, model: int, chip: Chip) -> dict:
    """Whether the program that runs (SpS with a draft, else ArS) fits this chip's HBM at
    this mesh, and the fewest chips (data x model) whose 'model' axis splits every model
    and whose per-chip bytes fit, taking per-chip bytes to scale as 1/model (weights,
    caches and most temporaries do; norms and the few replicated buffers do not, so it
    is an estimate to check with `--mesh=1xM`)."""
    main = report["programs"]["sps" if "sps" in report["programs"] else "ars_target"]
    per_chip = main["memory"]["total_padded"]
    need = next((m for m in valid_model_axes(models) if per_chip * model / m <= chip.hbm_bytes), None)
    return {"program": main["program"], "per_chip_bytes": per_chip, "hbm_bytes": chip.hbm_bytes,
            "fits": per_chip <= chip.hbm_bytes, "model_axis_needed": need,
            "chips_needed": None if need is None else data * need}


def plan(cfg, data: int, model: int, batch: int = 1, prompt_len: int = 128, cache_len: int | None = None,
         chip: Chip = Chip(), num_drafts: int = 1, quantize: str | None = None,
         heads: HeadsConfig | None = None, tree_nodes: int = 0, compiler: str = "cpu") -> dict:
    """Compile SpS (when the config has a draft), ArS for the target, and ArS for the
    draft alone on a data x model mesh: with compiler 'cpu', of the process's (fake CPU)
    devices; with 'tpu', of a slice of `chip`'s chips on libtpu's compile-only client
    (`tpu.devices`), each program's loop parts then also compiled and costed
    (`steps.cost`), memory as XLA:TPU lays it out (no padding added by hand); with
    num_drafts > 1 also the tree loop of that many draft chains ('sps_tree'); with
    `quantize` ('int8', 'int4') the models quantized as `LM.quantized` makes them; with
    `heads`, also SpS drafting with those (random) heads on the target ('sps_medusa' or
    'sps_eagle'; Medusa's with num_drafts chains); with tree_nodes > 0 also the loops that
    grow a dynamic draft tree of that many nodes, by the draft model ('sps_dynamic') and by
    EAGLE heads ('sps_eagle_dynamic')."""
    on_tpu = compiler == "tpu"
    chip_key = next(k for k, c in CHIPS.items() if c.name == chip.name)
    devices = tpu.devices(chip_key, data, model) if on_tpu else jax.devices()
    if len(devices) < data * model:
        raise UsageError(f"mesh {data}x{model} needs {data * model} devices, this process has {len(devices)}")
    mesh = sharding.make_mesh(MeshConfig(data, model), devices[:data * model])
    models = {"target": cfg.target} | ({"draft": cfg.draft} if cfg.draft is not None else {})
    max_len = min(c.max_seq_len for c in models.values())
    cache_len = min(2048, max_len) if cache_len is None else cache_len
    if cache_len > max_len:
        raise UsageError(f"--cache_len={cache_len} exceeds the models' max_seq_len={max_len}")
    for name, c in models.items():  # fail on a bad mesh before the (slow) abstract models are built
        sharding.check_divisible(c, mesh, name)
    # As the loaders run them: kv heads duplicated where there are fewer than the 'model' axis.
    lms = {name: abstract_lm(kv_heads.for_mesh(c, mesh), mesh) for name, c in models.items()}
    if quantize is not None:
        lms = {name: lm.quantized(quantize) for name, lm in lms.items()}
    if on_tpu:  # the CPU kernels are XLA:CPU custom calls
        lms = {name: lm.with_kernels(NO_KERNELS) for name, lm in lms.items()}
    report: dict[str, Any] = {
        "config": cfg.name,
        "setup": {"compiler": compiler, "chip": chip.name, "data": data, "model": model, "devices": data * model,
                  "batch": batch, "prompt_len": prompt_len,
                  "cache_len": cache_len, "lookahead": cfg.sampling.lookahead, "num_drafts": num_drafts,
                  "quantize": quantize,
                  "sampling": dataclasses.asdict(cfg.sampling),
                  "xla_flags": os.environ.get("XLA_FLAGS", "")},
        "models": {}, "programs": {}}
    for name, lm in lms.items():
        cache = sharding.with_shardings(kv_cache.cache_shapes(lm.cfg, batch, cache_len),
                                        kv_cache.cache_shardings(lm.cfg, batch, cache_len, mesh))
        report["models"][name] = {"params": kv_heads.original(lm.cfg).num_params, "param_dtype": lm.cfg.param_dtype,
                                  "kv_heads": lm.cfg.num_kv_heads, "kv_copies": lm.cfg.kv_copies,
                                  "weight_bytes_per_device": shard_bytes(lm.params),
                                  "cache_bytes_per_device": shard_bytes(cache),
                                  "weight_bytes_per_device_padded": shard_bytes(lm.params, padded=True),
                                  "cache_bytes_per_device_padded": shard_bytes(cache, padded=True),
                                  "position_table_bytes_per_device": shard_bytes(
                                      [kv_cache.table_shape(lm.cfg, cache_len, mesh)]),
                                  "layers": lm.cfg.num_layers,
                                  "pos_encoding": lm.cfg.pos_encoding,
                                  # The random init's size is an XLA:CPU check (`sample --init=random`).
                                  "init": None if on_tpu else compile_init(lm.cfg, mesh)}
    ars = dataclasses.replace(cfg.sampling, drafter="model")  # a model alone, whatever drafts for SpS
    runs = [("ars_target", lms["target"], None, ars)]
    if heads is not None:
        abstract = abstract_heads(heads, kv_heads.original(cfg.target), mesh)
        report["heads"] = {"kind": heads.kind, "params": abstract.num_params, "num_heads": heads.num_heads,
                           "weight_bytes_per_device": shard_bytes(abstract.params)}
        drafting = dataclasses.replace(cfg.sampling, drafter=heads.kind, num_drafts=num_drafts).validate()
        runs.insert(0, (f"sps_{heads.kind}", lms["target"], abstract, drafting))
        if tree_nodes and heads.kind in GROWN_TREES:
            grown = dataclasses.replace(drafting, num_drafts=1, draft_tree="dynamic", tree_nodes=tree_nodes).validate()
            runs.insert(1, (f"sps_{heads.kind}_dynamic", lms["target"], abstract, grown))
    if "draft" in lms:
        runs = [("sps", lms["target"], lms["draft"], cfg.sampling)] + runs + [("ars_draft", lms["draft"], None, ars)]
        if num_drafts > 1:
            tree = dataclasses.replace(cfg.sampling, num_drafts=num_drafts).validate()
            runs.insert(1, ("sps_tree", lms["target"], lms["draft"], tree))
        if tree_nodes:
            grown = dataclasses.replace(cfg.sampling, draft_tree="dynamic", tree_nodes=tree_nodes).validate()
            runs.insert(1, ("sps_dynamic", lms["target"], lms["draft"], grown))
    for name, target, draft, sampling in runs:
        result = compile_program(target, draft, sampling, batch, prompt_len, cache_len, chip if on_tpu else None)
        per = "collectives_per_loop" if name.startswith("sps") else "collectives_per_step"
        result[per] = result.pop("per_loop")
        held = ("draft",) if name == "ars_draft" else ("target", "draft") if isinstance(draft, LM) else ("target",)
        copies = lambda w: sampling.num_drafts if w == "draft" else 1  # noqa: E731 (a tree's chains: a cache each)
        # What the program's temporaries must hold: the caches and position tables it carries,
        # and the keys and values of the prompt's prefill before they are written (a pass's own).
        result["memory"]["need"] = sum(
            report["models"][w]["cache_bytes_per_device"] * (copies(w) + prompt_len / cache_len)
            + report["models"][w].get("position_table_bytes_per_device", 0) for w in held)
        if result["memory"]["peak"]:  # the temporaries live at the peak, beside the arguments and outputs
            result["memory"]["peak_temporaries"] = (result["memory"]["peak"] - result["memory"]["arguments"]
                                                    - result["memory"]["outputs"])
        if on_tpu:  # XLA:TPU's own layout: padding included
            result["memory"]["tpu_padding"] = 0
            result["memory"]["total_padded"] = result["memory"]["total"]
            result["fits"] = result["memory"]["total"] <= chip.hbm_bytes
            report["programs"][name] = result
            continue
        # XLA:CPU lays arrays out unpadded; a TPU pads their minor dims (`padded_bytes`): add
        # what that costs the program's weights (arguments) and caches (made inside it).
        def padding(which, kind):
            m = report["models"][which]
            return m[f"{kind}_bytes_per_device_padded"] - m[f"{kind}_bytes_per_device"]
        result["memory"]["tpu_padding"] = sum(padding(w, "weight") + copies(w) * padding(w, "cache") for w in held)
        result["memory"]["total_padded"] = result["memory"]["total"] + result["memory"]["tpu_padding"]
        result["fits"] = result["memory"]["total_padded"] <= chip.hbm_bytes
        report["programs"][name] = result
    report["capacity"] = capacity(report, models, data, model, chip)
    report["roofline"] = roofline(report, cfg, chip)
    if on_tpu:
        report["estimate"] = compiled_estimate(report, cfg)
    report["paper_scale"] = is_paper_scale(cfg)
    # Fit only where the paper measured: the 70B target on 16 chips.
    fit = (fitted_latency(report, cfg, chip) if is_paper_scale(cfg) and (data, model) == (1, 16)
           and chip.name == "TPU v4" else None)
    if fit is not None:
        report["roofline_fitted"] = roofline(report, cfg, dataclasses.replace(chip, collective_latency_s=fit))
    report["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return report
