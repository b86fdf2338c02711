"""`python -m specjax.plan --config=chinchilla_70b`: paper scale without a pod.

Lowers and compiles THE programs `generate` runs (`api.sps_program`, `api.ars_program`,
with the arguments and static settings `api.prepare` builds) on a mesh of fake CPU
devices, with every parameter a sharded `jax.ShapeDtypeStruct`: nothing the size of
the model is allocated. From the compiled executables it reports

  * compile time, and bytes per device (arguments, outputs, temporaries) from
    `compiled.memory_analysis()`, against a 32 GiB TPU v4 chip;
  * collectives by kind and message size, counted in `compiled.as_text()`: per SpS
    loop / per ArS step (the body of the generation `while`, with nested loops such
    as the layer scan (L trips) and the draft scan (K-1 trips) multiplied by their
    trip counts) and, separately, outside it (prefill);
  * a roofline latency for TPU v4 (ms/token for ArS, for the draft alone, and for SpS
    as a function of the acceptance rate), set against the paper's Table 1.

Why `--xla_disable_hlo_passes=while-loop-invariant-code-motion`: XLA:CPU hoists the
bf16->f32 convert of the stacked (scanned) weights out of the layer loop, so the whole
f32 copy of every layer lives at once (chinchilla_70b SpS on 1x16: 18.5 GiB of
temporaries with the pass, 1.2 GiB without; the difference is 2 x 8.2 GiB of weights). A TPU feeds bf16 to
the MXU and converts nothing, so the numbers without the pass are the realistic ones.
`--licm` keeps XLA's default passes to show the difference. plan also passes
`--xla_backend_optimization_level=0`: it never runs the code, and LLVM's optimisation is
most of the compile time while buffer assignment (hence memory_analysis) comes before it.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import resource
import sys
import time
from collections import Counter
from typing import Any

from absl import flags

from specjax import cli

GiB = 1024 ** 3
ALPHAS = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4,
               "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator chip for the roofline. TPU v4 numbers from the Cloud TPU v4 page
    (275 bf16 TFLOP/s, 32 GiB HBM2 at 1200 GB/s) and the v4 paper (Jouppi et al. 2023:
    ICI links 400 Gb/s = 50 GB/s per direction).

    collective_latency_s: the fixed cost of one small collective. At batch 1 every
    Megatron all-reduce carries at most (K+1) x d_model values (80-160 KiB), so it is
    latency-bound, not bandwidth-bound. A 16-chip v4-32 slice is a 2x2x4 ICI mesh;
    XLA's multi-dimensional all-reduce walks each dimension twice (reduce-scatter then
    all-gather): 2 x ((2-1) + (2-1) + (4-1)) = 10 dependent neighbour transfers, at
    ~1 us each (link + DMA issue + sync), so ~10 us. This is an assumption, not a
    measurement; `--collective_latency_us` changes it and the report also prints the
    latency that would make the roofline meet the paper's 14.1 ms/token.
    ici_bandwidth: a ring collective over one axis uses one link in each direction."""

    name: str = "TPU v4"
    hbm_bytes: int = 32 * GiB
    hbm_bandwidth: float = 1.2e12
    flops: float = 275e12
    ici_bandwidth: float = 2 * 50e9
    collective_latency_s: float = 10e-6


PAPER = {
    # Chen et al. 2023, section 4 and Table 1 (batch 1, K=4, 16 TPU v4 chips).
    "target_ms_per_token": 14.1,
    "draft_ms_per_token": 1.8,
    "lookahead": 4,
    "table1": [
        # (setting, ArS ms/token, SpS ms/token, speedup as printed in the paper; 14.1 / 7.52 is
        # 1.875, so the printed 1.92x was presumably computed before rounding the ms)
        ("XSum nucleus p=0.8", 14.1, 7.52, 1.92),
        ("XSum greedy", 14.1, 7.00, 2.01),
        ("HumanEval T=0.8 p=0.95", 14.1, 5.73, 2.46),
    ],
}

# --------------------------------------------------------------------------- HLO collectives


def _shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string; a tuple is the sum of its arrays."""
    total = 0
    for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", shape):
        if dtype in DTYPE_BYTES:
            total += DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _group_size(line: str) -> int:
    """Devices per replica group, from any of the three HLO spellings (the mesh form may
    carry `device_ids=(...)` before the axes it names)."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", line)
    if m:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", m.group(2)))
    m = re.search(r"replica_groups=\[([\d,]+)\]<=", line)
    if m:
        return int(m.group(1).split(",")[-1])
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"source_target_pairs=\{([^}]*)\}", line)  # collective-permute
    return 2 if m else 1


_COMP_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\(")
_CALLED = re.compile(r"\b(?:to_apply|calls|body|condition)=%?([\w.\-]+)|"
                     r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # 'all-reduce', 'all-gather', ...
    shape: str  # HLO result shape without layout, e.g. 'f32[1,5,8192]'
    bytes: int  # per device: the reduced buffer (all-reduce) or the gathered result (all-gather)
    group: int  # devices that take part


class HloProgram:
    """The computations of a compiled module's text, and who calls whom."""

    def __init__(self, text: str):
        self.computations: dict[str, list[str]] = {}
        self.entry = None
        current = None
        for line in text.splitlines():
            header = _COMP_HEADER.match(line)
            if header and not line.startswith(" "):
                current = header.group(2)
                self.computations[current] = []
                if header.group(1):
                    self.entry = current
            elif line.startswith("}"):
                current = None
            elif current is not None:
                self.computations[current].append(line)
        if self.entry is None:
            raise ValueError("no ENTRY computation in the HLO text")
        self._memo: dict[tuple, Counter] = {}

    @staticmethod
    def _callees(line: str) -> list[str]:
        return [name.strip().lstrip("%") for one, many in _CALLED.findall(line)
                for name in ([one] if one else many.split(",")) if name.strip()]

    @staticmethod
    def trip_count(line: str) -> int | None:
        m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
        return int(m.group(1)) if m else None

    def instructions(self, name: str):
        """(instruction name, result shape, opcode, line) of one computation."""
        for line in self.computations.get(name, ()):
            m = _INSTR.match(line)
            if m:
                yield m.group(1), m.group(2), m.group(3), line

    def tally(self, name: str, skip: frozenset = frozenset()) -> Counter:
        """Collectives executed by one run of computation `name`, nested loops multiplied
        by their known trip counts; instructions named in `skip` are not entered (at any
        depth). All branches of a conditional are counted (none occur in our programs)."""
        key = (name, skip)
        if key in self._memo:
            return self._memo[key]
        counts: Counter = Counter()
        for instr, shape, op, line in self.instructions(name):
            if instr in skip:
                continue
            base = op[:-len("-start")] if op.endswith("-start") else op
            if base in COLLECTIVES:
                shape = re.sub(r"\{[\d,]*\}", "", shape)
                size = _shape_bytes(shape)
                if op.endswith("-start") and base != "all-reduce" and shape.startswith("("):
                    size = max(_shape_bytes(a) for a in re.findall(r"\w+\[[\d,]*\]", shape))  # (in, out): out
                counts[Collective(base, shape, size, _group_size(line))] += 1
            times = (self.trip_count(line) or 1) if op == "while" else 1
            for callee in self._callees(line):
                for c, n in self.tally(callee, skip).items():
                    counts[c] += n * times
        self._memo[key] = counts
        return counts

    def generation_loop(self) -> tuple[str, str]:
        """(name, line) of the one `while` whose trip count is unknown: the ArS step / SpS
        loop (layer scans, the draft scan and RNG loops all have known trip counts)."""
        loops = [(instr, line) for comp in self.computations for instr, _, op, line in self.instructions(comp)
                 if op == "while" and self.trip_count(line) is None]
        if len(loops) != 1:
            raise ValueError(f"expected one data-dependent while loop, found {[n for n, _ in loops]}")
        return loops[0]

    def loop_and_outside(self) -> tuple[Counter, Counter]:
        """(collectives per iteration of the generation loop, collectives outside it)."""
        name, line = self.generation_loop()
        per_loop = Counter()
        for callee in self._callees(line):  # body and condition both run once per iteration
            per_loop.update(self.tally(callee))
        return per_loop, self.tally(self.entry, skip=frozenset({name}))


def summarize(counts: Counter) -> dict:
    """{kind: {'count', 'bytes', 'messages': [{'shape', 'bytes', 'group', 'count'}]}}."""
    out = {}
    for kind in COLLECTIVES:
        items = sorted(((c, n) for c, n in counts.items() if c.kind == kind), key=lambda cn: (-cn[1], cn[0].shape))
        if items:
            out[kind] = {"count": sum(n for _, n in items), "bytes": sum(c.bytes * n for c, n in items),
                         "messages": [{"shape": c.shape, "bytes": c.bytes, "group": c.group, "count": n}
                                      for c, n in items]}
    return out


def collective_load(summary: dict, chip: Chip) -> tuple[int, float]:
    """(number of collectives, seconds their bytes spend on the ICI wire) for ring
    algorithms: an all-reduce moves 2(n-1)/n of its buffer, the others (n-1)/n."""
    count, wire = 0, 0.0
    for kind, entry in summary.items():
        for msg in entry["messages"]:
            n = msg["group"]
            factor = 2 * (n - 1) / n if kind == "all-reduce" else (n - 1) / n
            count += msg["count"]
            wire += msg["count"] * factor * msg["bytes"] / chip.ici_bandwidth
    return count, wire


# --------------------------------------------------------------------------- roofline


def shard_bytes(tree) -> int:
    """Bytes one device holds of a pytree of sharded ShapeDtypeStructs / arrays (the max
    over devices is the same for the even shardings used here)."""
    import jax
    import numpy as np
    total = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) else leaf.shape
        total += math.prod(shard) * np.dtype(leaf.dtype).itemsize
    return total


def forward_cost(cfg, weight_bytes: int, cache_bytes: int, model_shards: int, batch_shards: int,
                 batch: int, tokens: int, cache_len: int) -> dict:
    """HBM bytes and FLOPs per device of one forward over `tokens` new tokens per row.

    Bytes: every weight shard once, plus the whole KV cache shard (the attention reads
    all `cache_len` slots and masks; it does not skip the empty ones). FLOPs: 2 per
    weight per token (the embedding lookup is a one-hot matmul here, so it counts),
    q.k and p.v over all cache slots, and the Transformer-XL position term
    ((q+v) W_r^T, then against R for every distance)."""
    B, T, S = batch / batch_shards, tokens, cache_len
    N, H, D, L = cfg.num_heads, cfg.head_dim, cfg.d_model, cfg.num_layers
    weights = 2 * B * T * cfg.num_params / model_shards
    attention = L * 4 * B * T * S * N * H / model_shards
    relative = L * (2 * B * T * N * H * D + 2 * B * T * N * D * S) / model_shards if cfg.pos_encoding == "relative" else 0
    return {"hbm_bytes": weight_bytes + cache_bytes, "flops": weights + attention + relative}


def tokens_per_loop(alpha: float, lookahead: int) -> float:
    """Expected tokens per SpS loop when each draft token is accepted with prob alpha
    (independently): 1 + alpha + ... + alpha^K = (1 - alpha^(K+1)) / (1 - alpha)."""
    return float(lookahead + 1) if alpha >= 1 else (1 - alpha ** (lookahead + 1)) / (1 - alpha)


def implied_alpha(tokens: float, lookahead: int) -> float:
    """Inverse of `tokens_per_loop` (bisection; it is increasing in alpha)."""
    if tokens >= lookahead + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tokens_per_loop(mid, lookahead) < tokens else (lo, mid)
    return (lo + hi) / 2


def roofline(report: dict, cfg, chip: Chip) -> dict:
    """ms/token on TPU v4: a target ArS step, a draft step alone, the SpS loop and
    SpS ms/token as a function of the acceptance rate, and the paper's Table 1 rows.

    Each forward costs max(HBM bytes / bandwidth, FLOPs / peak) (`forward_cost`), plus
    the collectives that the compiled program runs per step/loop (count x latency +
    bytes on the wire). Nothing overlaps: a lower bound only where that holds."""
    programs, setup = report["programs"], report["setup"]
    batch, batch_shards = setup["batch"], (setup["data"] if setup["batch"] % setup["data"] == 0 else 1)

    def forward_s(which: str, lm_cfg, tokens: int) -> tuple[dict, float]:
        m = report["models"][which]
        cost = forward_cost(lm_cfg, m["weight_bytes_per_device"], m["cache_bytes_per_device"], setup["model"],
                            batch_shards, batch, tokens, setup["cache_len"])
        return cost, max(cost["hbm_bytes"] / chip.hbm_bandwidth, cost["flops"] / chip.flops)

    def step(which, lm_cfg, program) -> dict:
        cost, compute = forward_s(which, lm_cfg, 1)
        count, wire = collective_load(programs[program]["collectives_per_step"], chip)
        coll = count * chip.collective_latency_s + wire
        return {"hbm_bytes": cost["hbm_bytes"], "flops": cost["flops"], "compute_ms": 1e3 * compute,
                "collectives": count, "collective_ms": 1e3 * coll, "ms_per_token": 1e3 * (compute + coll)}

    out = {"chip": dataclasses.asdict(chip), "ars": step("target", cfg.target, "ars_target")}
    if "sps" not in programs:
        return out
    K = setup["lookahead"]
    out["draft"] = step("draft", cfg.draft, "ars_draft")
    score_cost, score = forward_s("target", cfg.target, K + 1)
    first_cost, first = forward_s("draft", cfg.draft, 2)  # the first draft step feeds two tokens (invariant 4)
    rest_cost, rest = forward_s("draft", cfg.draft, 1)
    count, wire = collective_load(programs["sps"]["collectives_per_loop"], chip)
    coll = count * chip.collective_latency_s + wire
    loop = score + first + (K - 1) * rest + coll
    ars_ms = out["ars"]["ms_per_token"]
    passes = ((score_cost, 1), (first_cost, 1), (rest_cost, K - 1))
    out["sps"] = {"hbm_bytes": sum(c["hbm_bytes"] * n for c, n in passes),
                  "flops": sum(c["flops"] * n for c, n in passes),
                  "score_hbm_bytes": score_cost["hbm_bytes"], "score_flops": score_cost["flops"],
                  "score_ms": 1e3 * score, "draft_ms": 1e3 * (first + (K - 1) * rest), "collectives": count,
                  "collective_ms": 1e3 * coll, "loop_ms": 1e3 * loop,
                  "by_alpha": [{"alpha": a, "tokens_per_loop": tokens_per_loop(a, K),
                                "ms_per_token": 1e3 * loop / tokens_per_loop(a, K),
                                "speedup": ars_ms / (1e3 * loop / tokens_per_loop(a, K))} for a in ALPHAS]}
    if K == PAPER["lookahead"] and is_paper_scale(cfg):
        out["table1"] = []
        for row in paper_table1():
            ms = 1e3 * loop / tokens_per_loop(row["implied_alpha"], K)
            out["table1"].append(dict(row, sps_ms=ms, speedup=ars_ms / ms))
    return out


def is_paper_scale(cfg) -> bool:
    """The paper's timings only say something about a Chinchilla-70B-shaped target."""
    t = cfg.target
    return (t.num_layers, t.d_model, t.num_heads, t.d_ff) == (80, 8192, 64, 32768)


def paper_table1() -> list[dict]:
    """Each Table 1 row with the acceptance rate it implies under the paper's own
    timings: a loop is K draft steps of 1.8 ms plus one scoring pass, taken to cost one
    14.1 ms target step (scoring K+1 tokens is memory-bound like one token; if it costs
    more, the implied rates are a little higher)."""
    K = PAPER["lookahead"]
    loop = K * PAPER["draft_ms_per_token"] + PAPER["target_ms_per_token"]
    return [{"setting": name, "paper_ars_ms": ars, "paper_sps_ms": sps, "paper_speedup": speedup,
             "implied_tokens_per_loop": loop / sps, "implied_alpha": implied_alpha(loop / sps, K)}
            for name, ars, sps, speedup in PAPER["table1"]]


def fitted_latency(report: dict, cfg, chip: Chip) -> float | None:
    """The per-collective latency at which the ArS roofline equals the paper's 14.1 ms/token."""
    ars = roofline(report, cfg, dataclasses.replace(chip, collective_latency_s=0.0))["ars"]
    gap = PAPER["target_ms_per_token"] - ars["ms_per_token"]
    return 1e-3 * gap / ars["collectives"] if gap > 0 and ars["collectives"] else None


# --------------------------------------------------------------------------- compile


def abstract_lm(cfg, mesh, what: str):
    """Sharded ShapeDtypeStructs of every param (no data), after the divisibility check."""
    from specjax import model, sharding
    sharding.check_divisible(cfg, mesh, what)
    return model.abstract_lm(cfg, mesh)


def compile_program(target, draft, sampling, batch: int, prompt_len: int, cache_len: int) -> dict:
    """Lower + compile the program `generate` would run, through `api.prepare` (so the
    arguments and static settings are exactly the ones it builds). `target` and `draft`
    (None: ArS) may be abstract (`model.abstract_lm`) or real. Returns a dict with
    'per_loop' and 'outside_loop' (`summarize` of the collectives per SpS loop / ArS
    step and outside it), 'memory' (bytes per device), 'compile_seconds', 'statics'."""
    import jax
    from specjax import api
    from specjax.config import UsageError
    lookahead = sampling.lookahead if draft is not None else 1
    width = max(16, 1 << (prompt_len - 1).bit_length())  # api.prepare's power-of-two buckets (pad_to=16)
    max_new = cache_len - width - lookahead - 1  # api.prepare: size = width + max_new + K + 1
    if max_new < 1:
        raise UsageError(f"--cache_len={cache_len} leaves no room to generate after a {width}-token "
                         f"(padded) prompt and K+1={lookahead + 1} scoring slots")
    sampling = dataclasses.replace(sampling, max_new_tokens=max_new)
    prompts = [[1] * prompt_len for _ in range(batch)]
    mesh, fn, args, statics, _, _ = api.prepare(target, draft, prompts, sampling, seed=0)
    assert statics["size"] == cache_len, statics
    start = time.perf_counter()
    with jax.set_mesh(mesh):
        lowered = fn.lower(*args, **statics)
        lower_s = time.perf_counter() - start
        compiled = lowered.compile()
    compile_s = time.perf_counter() - start - lower_s
    mem = compiled.memory_analysis()
    hlo = HloProgram(compiled.as_text())
    per_loop, outside = hlo.loop_and_outside()
    total = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
    return {"program": fn.__name__ if hasattr(fn, "__name__") else str(fn),
            "statics": {k: (v._asdict() if hasattr(v, "_asdict") else v) for k, v in statics.items()},
            "lower_seconds": lower_s, "compile_seconds": compile_s,
            "memory": {"arguments": mem.argument_size_in_bytes, "outputs": mem.output_size_in_bytes,
                       "temporaries": mem.temp_size_in_bytes, "aliased": mem.alias_size_in_bytes, "total": total},
            "per_loop": summarize(per_loop), "outside_loop": summarize(outside)}


def plan(cfg, data: int, model: int, batch: int = 1, prompt_len: int = 128, cache_len: int | None = None,
         chip: Chip = Chip()) -> dict:
    """Compile SpS (when the config has a draft), ArS for the target, and ArS for the
    draft alone on a data x model mesh of the process's (fake CPU) devices."""
    import jax
    from specjax import kv_cache, sharding
    from specjax.config import MeshConfig, UsageError
    devices = jax.devices()
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
    lms = {name: abstract_lm(c, mesh, name) for name, c in models.items()}
    report: dict[str, Any] = {
        "config": cfg.name,
        "setup": {"data": data, "model": model, "devices": data * model, "batch": batch, "prompt_len": prompt_len,
                  "cache_len": cache_len, "lookahead": cfg.sampling.lookahead,
                  "sampling": dataclasses.asdict(cfg.sampling),
                  "xla_flags": os.environ.get("XLA_FLAGS", "")},
        "models": {}, "programs": {}}
    for name, lm in lms.items():
        cache = kv_cache.cache_shapes(lm.cfg, batch, cache_len)
        shard = kv_cache.cache_shardings(lm.cfg, batch, cache_len, mesh)
        cache = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), cache, shard)
        report["models"][name] = {"params": lm.num_params, "param_dtype": lm.cfg.param_dtype,
                                  "weight_bytes_per_device": shard_bytes(lm.params),
                                  "cache_bytes_per_device": shard_bytes(cache), "layers": lm.cfg.num_layers,
                                  "pos_encoding": lm.cfg.pos_encoding}
    runs = [("ars_target", lms["target"], None)]
    if "draft" in lms:
        runs = [("sps", lms["target"], lms["draft"])] + runs + [("ars_draft", lms["draft"], None)]
    for name, target, draft in runs:
        result = compile_program(target, draft, cfg.sampling, batch, prompt_len, cache_len)
        per = "collectives_per_loop" if name == "sps" else "collectives_per_step"
        result[per] = result.pop("per_loop")
        result["fits"] = result["memory"]["total"] <= chip.hbm_bytes
        report["programs"][name] = result
    report["roofline"] = roofline(report, cfg, chip)
    # Fit only where the paper measured: the 70B target on 16 chips.
    fit = fitted_latency(report, cfg, chip) if is_paper_scale(cfg) and (data, model) == (1, 16) else None
    if fit is not None:
        report["roofline_fitted"] = roofline(report, cfg, dataclasses.replace(chip, collective_latency_s=fit))
    report["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return report


# --------------------------------------------------------------------------- report


def _gib(n: float) -> str:
    if n < 0.01 * GiB:
        return _size(n)
    return f"{n / GiB:.2f} GiB"


def _count(n: int) -> str:
    return next(f"{n / d:.2f}{u}" for d, u in ((1e9, "B"), (1e6, "M"), (1e3, "K"), (1, "")) if n >= d or d == 1)


def _size(n: float) -> str:
    return f"{n / 1024:.1f} KiB" if n < 1024 ** 2 else f"{n / 1024 ** 2:.1f} MiB"


def _collective_lines(summary: dict) -> list[str]:
    if not summary:
        return ["      (none)"]
    lines = []
    for kind, e in summary.items():
        msgs = ", ".join(f"{m['count']} x {m['shape']} ({_size(m['bytes'])}, {m['group']} dev)" for m in e["messages"])
        lines.append(f"      {kind:<18} {e['count']:>4}  {_size(e['bytes']):>10} total: {msgs}")
    return lines


def format_report(r: dict) -> str:
    s, rf = r["setup"], r["roofline"]
    chip = rf["chip"]
    out = [f"specjax plan: {r['config']} on a {s['data']}x{s['model']} mesh of fake CPU devices; batch {s['batch']}, "
           f"prompt {s['prompt_len']} tokens, cache {s['cache_len']}, K={s['lookahead']}",
           f"XLA_FLAGS: {s['xla_flags']}", "",
           f"{'model':<8} {'params':>10} {'dtype':>9} {'layers':>6} {'positions':>9} {'weights/dev':>12} "
           f"{'kv cache/dev':>12}"]
    for name, m in r["models"].items():
        out.append(f"{name:<8} {_count(m['params']):>10} {m['param_dtype']:>9} {m['layers']:>6} "
                   f"{m['pos_encoding']:>9} {_gib(m['weight_bytes_per_device']):>12} "
                   f"{_gib(m['cache_bytes_per_device']):>12}")
    out += ["", f"{'program':<11} {'compile':>8} {'arguments':>11} {'outputs':>9} {'temporaries':>12} "
                f"{'total/dev':>11}  fits {chip['name']} ({_gib(chip['hbm_bytes'])})"]
    for name, p in r["programs"].items():
        mem = p["memory"]
        out.append(f"{name:<11} {p['compile_seconds']:>7.1f}s {_gib(mem['arguments']):>11} "
                   f"{_size(mem['outputs']):>9} {_gib(mem['temporaries']):>12} {_gib(mem['total']):>11}  "
                   f"{'yes' if p['fits'] else 'NO'} ({_gib(chip['hbm_bytes'] - mem['total'])} free)")
    out += ["", "collectives (counted in compiled HLO; nested loops x trip count; all-reduce bytes = the "
                "reduced buffer, all-gather bytes = the gathered result; XLA:CPU promotes bf16 all-reduces to f32)"]
    for name, p in r["programs"].items():
        per = "per SpS loop" if name == "sps" else "per step"
        out.append(f"  {name} {per}:")
        out += _collective_lines(p.get("collectives_per_loop") or p.get("collectives_per_step"))
        out.append(f"  {name} outside the loop (prefill, set-up):")
        out += _collective_lines(p["outside_loop"])
    out += ["", f"roofline on {chip['name']}: {chip['hbm_bandwidth'] / 1e12:.1f} TB/s HBM, "
                f"{chip['flops'] / 1e12:.0f} TFLOP/s; collectives {chip['collective_latency_s'] * 1e6:.0f} us each "
                f"+ bytes at {chip['ici_bandwidth'] / 1e9:.0f} GB/s ICI"]
    fit = r.get("roofline_fitted")
    if fit:
        out[-1] += (f"; 'fit': {fit['chip']['collective_latency_s'] * 1e6:.1f} us per collective, the latency "
                    f"that makes ArS match the paper's {PAPER['target_ms_per_token']} ms/token")
    out.append(f"  {'step':<22} {'HBM/chip':>10} {'GFLOP/chip':>10} {'compute':>8} {'coll.':>5} {'coll. ms':>8} "
               f"{'ms/token':>8} {'fit' if fit else '':>6}  paper")
    rows = [("ArS target step", "ars", PAPER["target_ms_per_token"]), ("draft step (alone)", "draft",
                                                                       PAPER["draft_ms_per_token"])]
    for label, key, paper in rows:
        if key in rf:
            x = rf[key]
            fitted = f"{fit[key]['ms_per_token']:>6.2f}" if fit else f"{'':>6}"
            out.append(f"  {label:<22} {_gib(x['hbm_bytes']):>10} {x['flops'] / 1e9:>10.1f} {x['compute_ms']:>6.2f}ms "
                       f"{x['collectives']:>5} {x['collective_ms']:>8.2f} {x['ms_per_token']:>8.2f} {fitted}  {paper}")
    if "sps" in rf:
        sp = rf["sps"]
        fitted = f"{fit['sps']['loop_ms']:>6.2f}" if fit else f"{'':>6}"
        out.append(f"  {'SpS loop (K=' + str(s['lookahead']) + ')':<22} {_gib(sp['hbm_bytes']):>10} "
                   f"{sp['flops'] / 1e9:>10.1f} {sp['score_ms'] + sp['draft_ms']:>6.2f}ms {sp['collectives']:>5} "
                   f"{sp['collective_ms']:>8.2f} {sp['loop_ms']:>8.2f} {fitted}  (per loop: score K+1 "
                   f"{sp['score_ms']:.2f} ms + K draft steps {sp['draft_ms']:.2f} ms + collectives)")
        out += ["", "  SpS ms/token = loop / E[tokens per loop], E = (1 - alpha^(K+1)) / (1 - alpha)",
                f"    {'alpha':>6} {'tokens/loop':>12} {'ms/token':>9} {'speedup':>8}"
                + (f" {'fit ms':>7} {'speedup':>8}" if fit else "")]
        for i, row in enumerate(sp["by_alpha"]):
            f = fit["sps"]["by_alpha"][i] if fit else None
            out.append(f"    {row['alpha']:>6.2f} {row['tokens_per_loop']:>12.2f} {row['ms_per_token']:>9.2f} "
                       f"{row['speedup']:>7.2f}x" + (f" {f['ms_per_token']:>7.2f} {f['speedup']:>7.2f}x" if f else ""))
    if "table1" in rf:
        out += ["", "  paper Table 1 (K=4, 16 TPU v4): alpha implied by the paper's own timings (4 x 1.8 ms draft + "
                    "one 14.1 ms scoring pass per loop), and this roofline at that alpha",
                f"    {'setting':<24} {'paper ms':>8} {'speedup':>8} {'alpha':>6} {'ms/token':>9} {'speedup':>8}"
                + (f" {'fit ms':>7} {'speedup':>8}" if fit else "")]
        for i, row in enumerate(rf["table1"]):
            f = fit["table1"][i] if fit else None
            out.append(f"    {row['setting']:<24} {row['paper_sps_ms']:>8.2f} {row['paper_speedup']:>7.2f}x "
                       f"{row['implied_alpha']:>6.2f} {row['sps_ms']:>9.2f} {row['speedup']:>7.2f}x"
                       + (f" {f['sps_ms']:>7.2f} {f['speedup']:>7.2f}x" if f else ""))
    if fit:
        lat, a = fit["chip"]["collective_latency_s"] * 1e6, rf["ars"]
        worst = max(abs(row["sps_ms"] / row["paper_sps_ms"] - 1) for row in fit.get("table1", [])) if "table1" in fit else 0
        out += ["", f"  Reading: at peak HBM bandwidth the target step is {a['compute_ms']:.1f} ms of weight and cache "
                    f"reads; the paper's {PAPER['target_ms_per_token']} ms leaves {lat:.0f} us for each of its "
                    f"{a['collectives']} collectives: {100 * (1 - a['compute_ms'] / PAPER['target_ms_per_token']):.0f}% of "
                    f"a batch-1 step is fixed per-collective cost.",
                f"  The same fitted latency gives the draft {fit['draft']['ms_per_token']:.2f} ms/token (paper "
                f"{PAPER['draft_ms_per_token']}) and Table 1's SpS ms/token within {100 * worst:.0f}%; the draft's "
                f"remaining gap is per-step cost outside the layers (sampling over the vocabulary, dispatch), which "
                f"weighs more on 8 layers than on 80."] if "draft" in fit else []
    out.append(f"\npeak RSS of this process: {r['peak_rss_bytes'] / 1024 ** 2:.0f} MiB (nothing model-sized allocated)")
    return "\n".join(out)


# --------------------------------------------------------------------------- entry point


def define_flags() -> None:
    """Flags of the entry point (defined only when run as a program, so importing this
    module next to another entry point's flags is safe)."""
    cli.define_config_flag("chinchilla_70b")
    flags.DEFINE_string("mesh", None, "DATAxMODEL fake-device mesh, e.g. 1x16 (default: the config's mesh; "
                        "a config with model=-1 gets 1x8).")
    flags.DEFINE_string("json", None, "Also write the report's numbers to this JSON file.")
    flags.DEFINE_integer("batch", 1, "Rows per batch.")
    flags.DEFINE_integer("prompt_len", 128, "Prompt tokens per row (the prefill).")
    flags.DEFINE_integer("cache_len", None, "KV-cache (and token buffer) length; default min(2048, max_seq_len).")
    flags.DEFINE_float("collective_latency_us", Chip.collective_latency_s * 1e6,
                       "Fixed latency per collective in the TPU v4 roofline (microseconds).")
    flags.DEFINE_bool("licm", False, "Keep XLA's while-loop-invariant-code-motion pass (XLA:CPU then hoists "
                      "the f32 copy of the stacked weights out of the layer loop; unrealistic temporaries).")


def parse_mesh(text: str):
    from specjax.config import UsageError
    m = re.fullmatch(r"(\d+)x(\d+)", text or "")
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise UsageError(f"--mesh={text!r}: expected DATAxMODEL with positive sizes, e.g. 1x16")
    return int(m.group(1)), int(m.group(2))


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
    os.environ["XLA_FLAGS"] = " ".join(flags_)
    os.environ["JAX_PLATFORMS"] = "cpu"  # plan on fake CPU devices even on a TPU host


def main(argv):
    from specjax.config import UsageError
    if len(argv) > 1:
        raise UsageError(f"unexpected arguments {argv[1:]}")
    cfg = cli.config()
    FLAGS = flags.FLAGS
    if FLAGS.mesh:
        data, model = parse_mesh(FLAGS.mesh)
    else:
        data, model = cfg.mesh.data, (cfg.mesh.model if cfg.mesh.model != -1 else 8)
    if FLAGS.batch < 1 or FLAGS.prompt_len < 1:
        raise UsageError("--batch and --prompt_len must be >= 1")
    configure_xla(data * model, FLAGS.licm)
    import jax
    jax.config.update("jax_platforms", "cpu")
    chip = dataclasses.replace(Chip(), collective_latency_s=FLAGS.collective_latency_us * 1e-6)
    report = plan(cfg, data, model, FLAGS.batch, FLAGS.prompt_len, FLAGS.cache_len, chip)
    print(format_report(report))
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(f"wrote {FLAGS.json}", file=sys.stderr)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
