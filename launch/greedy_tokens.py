"""Greedy tokens of a randomly initialised config, from one process or several.

    python launch/greedy_tokens.py --config=tiny --mesh=2x4 --local_devices=8 --output=out.json
    launch/multiprocess.sh launch/greedy_tokens.py --config=tiny --mesh=2x4 --output=out.json

Every process runs the same `specjax.generate` on the global mesh (with
SPECJAX_COORDINATOR etc. set, see specjax/distributed.py, each feeds only its own batch
rows) and process 0 writes the JSON. Same config, seed and prompts give the same tokens
on one process or several; tests/cli/test_multiprocess.py checks exactly that, and that
the compiled programs are the ones `plan.compile_program` compiles (HLO fingerprints)
and that prompts of other lengths in the same bucket reuse them. With
--sleep_before_compile the last process starts each mode late: process 0's timed runs
must not include the wait (the test compares the first run's seconds with the second's).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from absl import flags  # noqa: E402

from specjax.app import cli  # noqa: E402


def define_flags() -> None:
    cli.define_config_flag("tiny")
    flags.DEFINE_string("mesh", "1x8", "DATAxMODEL over all processes' devices.")
    flags.DEFINE_integer("local_devices", None, "Fake CPU devices in this process (default: all of the mesh / "
                         "processes).")
    flags.DEFINE_enum("mode", "both", ["sps", "ars", "both"], "Which loop(s) to run.")
    flags.DEFINE_integer("batch", 4, "Prompts (ragged lengths 3, 9, 17, 5, ...).")
    flags.DEFINE_integer("max_new_tokens", 12, "Tokens per row.")
    flags.DEFINE_string("output", None, "JSON file written by process 0 (default: stdout).")
    flags.DEFINE_float("sleep_before_compile", 0.0, "The last process sleeps this long before each mode's first "
                       "generate (which compiles): the others' timed runs must not include it.")


def prompts(batch: int, vocab: int) -> list[list[int]]:
    import numpy as np
    rng = np.random.default_rng(0)
    lengths = [3, 9, 17, 5, 12, 1, 7, 20]
    return [rng.integers(0, vocab, lengths[i % len(lengths)]).tolist() for i in range(batch)]


def main(argv):
    from specjax.config import UsageError
    mesh_cfg = cli.parse_mesh(flags.FLAGS.mesh, None)
    data, model = mesh_cfg.data, mesh_cfg.model
    processes = int(os.environ.get("SPECJAX_NUM_PROCESSES", "1"))
    local = flags.FLAGS.local_devices or data * model // processes
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={local}")
    import jax
    jax.config.update("jax_platforms", "cpu")  # before any device is touched

    from specjax import distributed
    distributed.maybe_initialize()
    import specjax
    from specjax.analysis import compile as compile_lib
    from specjax.app import output
    from specjax.decode import program
    from specjax.model import init_lm
    from specjax.sharding import make_mesh
    cfg = cli.config()
    mesh = make_mesh(mesh_cfg)
    target = init_lm(cfg.target, mesh)
    draft = init_lm(cfg.draft, mesh) if cfg.draft is not None else None
    sampling = dataclasses.replace(cfg.sampling, temperature=0.0, max_new_tokens=flags.FLAGS.max_new_tokens)
    rows = prompts(flags.FLAGS.batch, cfg.target.vocab_size)
    out = {"processes": jax.process_count(), "devices": jax.device_count(), "mesh": [data, model], "prompts": rows}
    # Other prompt lengths in the same bucket: the same compiled program must serve them.
    same_bucket = [r + r[:1] for r in rows]
    for mode in (["sps", "ars"] if flags.FLAGS.mode == "both" else [flags.FLAGS.mode]):
        if mode == "sps" and draft is None:
            raise UsageError(f"config {cfg.name} has no draft model; use --mode=ars")
        d = draft if mode == "sps" else None
        if flags.FLAGS.sleep_before_compile and jax.process_index() == jax.process_count() - 1:
            time.sleep(flags.FLAGS.sleep_before_compile)
        result = specjax.generate(target, d, rows, sampling, seed=0)
        out[mode] = result.tokens
        out[f"{mode}_loops"] = result.loops.tolist()
        again = specjax.generate(target, d, same_bucket, sampling, seed=1)
        # Run seconds of the first generate (compiled here) and of the second (same program).
        out[f"{mode}_seconds"] = [result.seconds, again.seconds]
        out[f"{mode}_compile_seconds"] = result.compile_seconds  # until every process had compiled
        prog = program.build(target, d, rows, sampling, seed=0)
        out[f"{mode}_fingerprint"] = program.fingerprint(prog.compile())
        out[f"{mode}_plan_fingerprint"] = compile_lib.compile_program(
            target, d, sampling, batch=len(rows), prompt_len=max(len(r) for r in rows), cache_len=prog.size)["fingerprint"]
    out["compiled_programs"] = len(program._COMPILED)
    output.print_or_save(flags.FLAGS.output, json.dumps(out))


if __name__ == "__main__":
    define_flags()
    cli.run(main)
