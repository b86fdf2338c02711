"""Where one cached forward's time goes, per kind of HLO op: a `jax.profiler` trace of
forward_cost's loop, aggregated over the XLA:CPU thunks it ran.

    python launch/profile_forward.py --config=mini_target --tokens=1,5 --cache=64,512

Same programs and flags as forward_cost.py (random weights, batch 1, cache one third
full, compiled as `generate` compiles). Each thunk in the trace is named after its HLO
instruction; the compiled module's text gives that instruction's opcode, the ops fused
into it and its `op_name` (the einsum spec or jax primitive), and named scopes added
here around the model's modules say which module it came from. The table gives ms per
forward summed per kind; the profiler itself slows the run, so the traced total is
printed next to the untraced median (forward_cost's number).
"""
from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from forward_cost import loop  # noqa: E402  (also defines --config, --tokens, --cache, --steps, --repeats)
from specjax import kv_cache, model, sharding  # noqa: E402
from specjax.kernels import library  # noqa: E402
from specjax.decode import program  # noqa: E402
from specjax.config import QUANTIZATIONS, MeshConfig, load_config  # noqa: E402

flags.DEFINE_integer("traced", 3, "Timed loops traced per setting.")
flags.DEFINE_bool("by_instruction", False, "Also print the 25 costliest HLO instructions per setting.")
FLAGS = flags.FLAGS

SCOPES = {model.RMSNorm: "norm", model.Attention: "attention", model.FeedForward: "ffw"}


def add_scopes():
    """Wrap each module's __call__ in a jax.named_scope, so its ops' op_name says where they came from."""
    for cls, name in SCOPES.items():
        def wrapped(self, *a, _call=cls.__call__, _name=name, **k):
            with jax.named_scope(_name):
                return _call(self, *a, **k)
        cls.__call__ = wrapped


def parse_hlo(text: str) -> dict:
    """instruction name -> (opcode, op_name, opcodes fused into it, output dims, operand dims, batched dot)."""
    computations, current, lines = collections.defaultdict(set), None, {}
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%(\S+) ", line)
        if head and line.rstrip().endswith("{"):
            current = head.group(1)
            continue
        m = re.match(r"^\s+(?:ROOT )?%(\S+) = \S+?(\[[\d,]*\])?(?:\{[^}]*\})? ([\w-]+)\(([^)]*)\)", line)
        if m:
            computations[current].add(m.group(3))
            lines[m.group(1)] = (m, line)
    dims = {name: tuple(int(d) for d in (m.group(2) or "").strip("[]").split(",") if d)
            for name, (m, _) in lines.items()}
    out = {}
    for name, (m, line) in lines.items():
        op_name = re.search(r'op_name="([^"]*)"', line)
        calls = re.search(r"calls=%([\w.-]+)", line)
        target = re.search(r'custom_call_target="([^"]*)"', line)
        operands = [dims.get(o.strip().lstrip("%"), ()) for o in m.group(4).split(",")]
        ops = computations.get(calls and calls.group(1), set()) | {m.group(3)}
        ops |= {target.group(1)} if target else set()
        out[name] = (m.group(3), op_name.group(1) if op_name else "", ops,
                     dims[name], operands, "lhs_batch_dims" in line)
    return out


def kind(cfg, opcode: str, op_name: str, ops: set, shape: tuple, operands: list, batched: bool) -> str | None:
    if opcode in ("while", "call", "conditional", "parameter", "get-tuple-element", "tuple", "bitcast", "constant"):
        return None  # containers and no-ops: their children are counted
    scope = next((s for s in SCOPES.values() if f"/{s}/" in op_name + "/"), "")
    if library.ATTENTION_TARGET in ops:
        return "attention: cached-attention kernel (all of it)"
    if (opcode == "custom-call" or "dot" in ops) and not batched:  # a weight-reading matmul (maybe fused)
        if shape and shape[-1] == cfg.vocab_size:
            return "matmul: logits (unembed)"
        if cfg.d_ff in shape or any(cfg.d_ff in o for o in operands):
            return "matmul: feed-forward"
        return "matmul: q, k, v, o projections"
    if "dot" in ops:
        return "attention: q.k and p.v over the cache"
    if scope == "attention" or not scope:
        if "scatter" in ops or "dynamic-update-slice" in ops:
            return "attention: cache write"
        if int(np.prod(shape)) >= cfg.num_kv_heads * cfg.head_dim * 64 and ops & {"copy", "slice", "transpose"}:
            return "attention: copies of a layer's cache"
        if ops & {"exponential", "reduce", "reduce-window", "divide", "maximum"} and scope:
            return "attention: mask + softmax"
        if ops & {"sine", "cosine"}:
            return "attention: rotary"
        if scope:
            return "attention: other (reshapes, small copies)"
    if scope == "norm":
        return "RMSNorm"
    if scope == "ffw":
        return "feed-forward: activation"
    return "other: embedding, residuals, loop"


def traced_events(trace_dir: str):
    path = sorted(glob.glob(os.path.join(trace_dir, "**", "*perfetto_trace.json.gz"), recursive=True))[-1]
    events = json.load(gzip.open(path))
    return events["traceEvents"] if isinstance(events, dict) else events


def profile(lm, cfg, size: int, tokens: int):
    fresh = lambda: lm.with_position_table(kv_cache.init_cache(lm.cfg, 1, size)).with_lengths(  # noqa: E731
        jnp.array([size // 3], jnp.int32))
    fn = jax.jit(loop, static_argnums=(2, 3), donate_argnums=1)
    prog = program.compile_lowered(fn.lower(lm, fresh(), tokens, FLAGS.steps))
    hlo = parse_hlo(prog.as_text())
    times = []
    for _ in range(FLAGS.repeats):
        c = jax.block_until_ready(fresh())
        start = time.perf_counter()
        jax.block_until_ready(prog(lm, c))
        times.append((time.perf_counter() - start) / FLAGS.steps * 1e3)
    with tempfile.TemporaryDirectory() as trace_dir:
        traced = []
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(FLAGS.traced):
                c = jax.block_until_ready(fresh())
                start = time.perf_counter()
                jax.block_until_ready(prog(lm, c))
                traced.append((time.perf_counter() - start) / FLAGS.steps * 1e3)
        events = traced_events(trace_dir)
    forwards = FLAGS.traced * FLAGS.steps
    per_kind, per_name = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") != "X" or e["name"] not in hlo:
            continue
        k = kind(cfg, *hlo[e["name"]])
        if k is not None:
            per_kind[k] += e["dur"] / 1e3 / forwards
            per_name[f"{e['name']} ({k})"] += e["dur"] / 1e3 / forwards
    return float(np.median(times)), float(np.median(traced)), per_kind, per_name


def main(argv):
    add_scopes()
    cfg = load_config(FLAGS.config).target
    lm = model.init_lm(cfg, sharding.make_mesh(MeshConfig(1, 1), jax.devices()[:1]))
    if len(FLAGS.quantize) != 1:
        raise app.UsageError(f"--quantize={','.join(FLAGS.quantize)}: one kind here "
                             f"(none or {', '.join(QUANTIZATIONS)})")
    if FLAGS.quantize[0] != "none":
        lm = lm.quantized(FLAGS.quantize[0])
    lm = lm.packed()  # as decoding runs it
    ts = [int(t) for t in FLAGS.tokens.split(",")]
    for size in (int(s) for s in FLAGS.cache.split(",")):
        results = {t: profile(lm, cfg, size, t) for t in ts}
        kinds = sorted({k for r in results.values() for k in r[2]}, key=lambda k: -results[ts[-1]][2][k])
        print(f"\n{FLAGS.config}, cache S={size}: ms per forward, summed over thunks (both threads)")
        print("| op kind | " + " | ".join(f"T={t}" for t in ts) + " |")
        print("|---" * (len(ts) + 1) + "|")
        for k in kinds:
            print(f"| {k} | " + " | ".join(f"{results[t][2][k]:.3f}" for t in ts) + " |")
        print("| **sum of thunks** | " + " | ".join(f"**{sum(results[t][2].values()):.2f}**" for t in ts) + " |")
        print("| wall, traced | " + " | ".join(f"{results[t][1]:.2f}" for t in ts) + " |")
        print("| wall, untraced (median) | " + " | ".join(f"{results[t][0]:.2f}" for t in ts) + " |")
        if FLAGS.by_instruction:
            for t in ts:
                print(f"\nT={t}, S={size}: costliest instructions (ms per forward)")
                for name, ms in results[t][3].most_common(25):
                    print(f"  {ms:7.3f}  {name}")


if __name__ == "__main__":
    app.run(main)
