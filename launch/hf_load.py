"""Load a Hugging Face model directory (or a GGUF file) onto a mesh, from one process or
several, and report what it cost; or write a random Llama of a config's shape to load.

    python launch/hf_load.py --hf=DIR --mesh=1x8 --output=load.json
    python launch/hf_load.py --gguf=FILE.gguf --mesh=1x8 --output=load.json [--quantize=int4]
    NUM_PROCESSES=2 LOCAL_DEVICES=4 launch/multiprocess.sh launch/hf_load.py --hf=DIR --mesh=1x8 --output=load.json
    python launch/hf_load.py --write_random=DIR --config=llama3_70b_1b --model=draft   # Llama-3.2-1B's shape

Loading: every process runs `specjax.weights.hf.load_with_stats` (`gguf.load_with_stats`)
on the global mesh (each reads the safetensors or GGUF slices its own devices hold) and
process 0 writes the JSON:
seconds, the bytes each process read from the weight files and its peak RSS, the
tensors' total size, and with --logits_of=IDS the logits of those token ids (a sharded
multi-process load must compute the same ones). --reads=auto,remote loads twice, the
second time reading the local files through the ranged requests a gs:// path gets
(keys bytes_read_remote, ...). tests/cli/test_multiprocess.py and
benchmarks/hf_import.md use it.

Writing: seeded random bf16 tensors of the config's model, one tensor in memory at a
time, as `model.safetensors` + config.json (the exporter's own `hf_config` and writer),
so a ~1B-parameter directory needs no download.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from absl import flags  # noqa: E402

from specjax.app import cli  # noqa: E402


def define_flags() -> None:
    cli.define_config_flag("llama3_70b_1b")
    flags.DEFINE_string("hf", None, "Hugging Face model directory to load.")
    flags.DEFINE_string("gguf", None, "GGUF file to load (instead of --hf).")
    flags.DEFINE_string("mesh", "1x8", "DATAxMODEL over all processes' devices.")
    flags.DEFINE_integer("local_devices", None, "Fake CPU devices in this process (default: the mesh / processes).")
    flags.DEFINE_string("param_dtype", None, "Load as this dtype (default: as stored).")
    flags.DEFINE_string("quantize", None, "--gguf: take the file's quantized weights (every type with a codec) as "
                        "stored, as --quantize=KIND (int8, int4, w4a8, w8a8) does, and quantize the rest "
                        "(LM.quantized).")
    flags.DEFINE_string("logits_of", None, "Comma-separated token ids whose logits go into the JSON.")
    flags.DEFINE_string("output", None, "JSON file written by process 0 (default: stdout).")
    flags.DEFINE_string("write_random", None, "Write a random Llama directory here instead of loading.")
    flags.DEFINE_enum("model", "target", ["target", "draft"], "--write_random: which of the config's models.")
    flags.DEFINE_integer("seed", 0, "--write_random: seed of the tensors.")
    flags.DEFINE_list("reads", ["auto"], "How to read the files, one load each: 'auto' (local files by os.pread, "
                      "gs:// by ranged requests), 'remote' (local files through the ranged requests gs:// uses).")
    flags.DEFINE_integer("remote_gap_bytes", None, "Ranged requests: fetch ranges closer than this as one "
                         "(default: safetensors_io.REMOTE_GAP_BYTES).")


def write_random(directory: str, cfg, seed: int) -> dict:
    import dataclasses

    import ml_dtypes
    import numpy as np
    from etils import epath

    from specjax.weights import hf, safetensors_io
    cfg = dataclasses.replace(cfg, param_dtype="bfloat16")
    shapes = hf.expected_tensors(cfg)
    rng = np.random.default_rng(seed)

    def value(name):
        shape = shapes[name]
        if name.endswith("norm.weight"):
            return np.ones(shape, ml_dtypes.bfloat16)
        std = 0.02 if len(shape) == 2 else 1.0
        return (std * rng.standard_normal(shape, np.float32)).astype(ml_dtypes.bfloat16)

    out = epath.Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    size = safetensors_io.write(out / "model.safetensors", [(n, ml_dtypes.bfloat16, s) for n, s in shapes.items()],
                                value, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf.hf_config(cfg, 0, (1,)), indent=2) + "\n")
    return {"directory": str(out), "params": sum(int(np.prod(s)) for s in shapes.values()), "bytes": size,
            "seconds": time.perf_counter() - start}


def main(argv):
    FLAGS = flags.FLAGS
    if FLAGS.write_random:
        config = cli.config()
        model_cfg = config.draft if FLAGS.model == "draft" else config.target
        print(json.dumps(write_random(FLAGS.write_random, model_cfg, FLAGS.seed)))
        return
    from specjax.config import QUANTIZATIONS, UsageError
    if bool(FLAGS.hf) == bool(FLAGS.gguf):
        raise UsageError("one of --hf=DIR (a Hugging Face model directory), --gguf=FILE (a GGUF file) or "
                         "--write_random=DIR is required")
    mesh_cfg = cli.parse_mesh(FLAGS.mesh, None)
    processes = int(os.environ.get("SPECJAX_NUM_PROCESSES", "1"))
    local = FLAGS.local_devices or mesh_cfg.data * mesh_cfg.model // processes
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={local}")
    import jax
    jax.config.update("jax_platforms", "cpu")  # before any device is touched
    import numpy as np

    from specjax import distributed, model, sharding
    if FLAGS.quantize is not None and (not FLAGS.gguf or FLAGS.quantize not in QUANTIZATIONS):
        raise UsageError(f"--quantize={FLAGS.quantize!r}: takes one of {', '.join(QUANTIZATIONS)}, with --gguf")
    from specjax.app import output
    from specjax.weights import gguf, hf
    distributed.maybe_initialize()
    mesh = sharding.make_mesh(mesh_cfg)
    from specjax.weights import safetensors_io
    if FLAGS.remote_gap_bytes is not None:
        safetensors_io.REMOTE_GAP_BYTES = FLAGS.remote_gap_bytes
    from jax.experimental import multihost_utils
    out = {"processes": jax.process_count(), "devices": jax.device_count(), "mesh": [mesh_cfg.data, mesh_cfg.model]}
    for reads in FLAGS.reads:
        if reads not in ("auto", "remote"):
            raise UsageError(f"--reads={reads!r}: allowed are auto, remote")
        if reads == "remote" and not FLAGS.hf:
            raise UsageError("--reads=remote: only a Hugging Face directory (--hf) is read through ranged requests")
        start = time.perf_counter()
        if FLAGS.hf:
            lm, _, stats = hf.load_with_stats(FLAGS.hf, mesh, param_dtype=FLAGS.param_dtype,
                                              local=False if reads == "remote" else None)
        else:
            lm, _, stats = gguf.load_with_stats(FLAGS.gguf, mesh, param_dtype=FLAGS.param_dtype,
                                                quantize=FLAGS.quantize)
            lm = lm.quantized(FLAGS.quantize) if FLAGS.quantize else lm
        seconds = time.perf_counter() - start
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        # int32 words (high, low): without 64-bit mode an allgather would truncate int64 counts.
        mine = np.array([divmod(v, 1 << 30) for v in (stats["bytes_read"], rss, int(seconds * 1e6))], np.int32)
        words = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, 3, 2).astype(np.int64)
        every = words[..., 0] * (1 << 30) + words[..., 1]
        suffix = "" if reads == FLAGS.reads[0] else f"_{reads}"
        out.update({"params": lm.num_params, "param_dtype": lm.cfg.param_dtype, "file_bytes": stats["file_bytes"],
                    f"bytes_read{suffix}": every[:, 0].tolist(), f"peak_rss_bytes{suffix}": every[:, 1].tolist(),
                    f"load_seconds{suffix}": (every[:, 2] / 1e6).tolist()})
    if FLAGS.logits_of:
        ids = np.asarray([[int(t) for t in FLAGS.logits_of.split(",")]], np.int32)
        tokens = distributed.put(ids, sharding.replicated(mesh))
        with jax.set_mesh(mesh):
            out["logits"] = distributed.fetch(jax.jit(model.full_forward)(lm, tokens)).tolist()
    output.print_or_save(FLAGS.output, json.dumps(out))


if __name__ == "__main__":
    define_flags()
    cli.run(main)
