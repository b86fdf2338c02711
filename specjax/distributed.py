"""Multi-process JAX: start-up, global inputs from per-process rows, outputs gathered.

One process per host (a TPU pod worker) or, for local tests, several processes on one
machine with fake CPU devices. Every process runs the same program on the same global
mesh; each feeds the rows its own devices hold (`jax.make_array_from_process_local_data`)
and the results are gathered with `multihost_utils.process_allgather`. Only process 0
should print or write files (`is_main()`).

Environment read by `maybe_initialize()`:
  SPECJAX_COORDINATOR=host:port, SPECJAX_NUM_PROCESSES=n, SPECJAX_PROCESS_ID=i
      explicit cluster (e.g. two processes on 127.0.0.1; CPU collectives via gloo);
  SPECJAX_DISTRIBUTED=auto   (or TPU_WORKER_HOSTNAMES naming more than one worker)
      a TPU pod slice: `jax.distributed.initialize()` finds the workers itself.
"""
from __future__ import annotations

import os
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

_INITIALIZED = False


def maybe_initialize() -> bool:
    """Call `jax.distributed.initialize` when the environment asks for more than one
    process; must run before anything touches a JAX device. Returns whether it did."""
    global _INITIALIZED
    if _INITIALIZED:
        return True
    coordinator = os.environ.get("SPECJAX_COORDINATOR")
    workers = [w for w in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if w]
    if coordinator:
        try:
            num_processes = int(os.environ["SPECJAX_NUM_PROCESSES"])
            process_id = int(os.environ["SPECJAX_PROCESS_ID"])
        except (KeyError, ValueError) as e:
            from specjax.config import UsageError
            raise UsageError("SPECJAX_COORDINATOR is set, so SPECJAX_NUM_PROCESSES and SPECJAX_PROCESS_ID "
                             f"must be integers too ({e})") from None
        # CPU collectives across processes go through gloo: today's default, pinned so that
        # a changed default cannot leave cross-process CPU collectives unimplemented.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id)
    elif os.environ.get("SPECJAX_DISTRIBUTED") == "auto" or len(workers) > 1:
        jax.distributed.initialize()  # TPU pod: coordinator, process count and id from the TPU metadata
    else:
        return False
    _INITIALIZED = True
    return True


def is_main() -> bool:
    """Process 0 prints and writes files; the others only compute."""
    return jax.process_index() == 0


def process_rows(sharding: jax.sharding.Sharding, global_shape: tuple[int, ...]) -> slice:
    """The rows (leading axis) of a global array that this process's devices hold."""
    starts, stops = [], []
    for index in sharding.addressable_devices_indices_map(global_shape).values():
        rows = index[0] if index else slice(None)
        start, stop, _ = rows.indices(global_shape[0])
        starts.append(start)
        stops.append(stop)
    lo, hi = min(starts), max(stops)
    covered = np.zeros(global_shape[0], bool)
    for s, e in zip(starts, stops):
        covered[s:e] = True
    if not covered[lo:hi].all():
        raise ValueError(f"this process's rows of {global_shape} under {sharding} are not contiguous")
    return slice(lo, hi)


def put(host: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """A global array from a host array every process knows: each process passes only
    the rows its devices hold (what a per-host input pipeline would load)."""
    host = np.asarray(host)
    return jax.make_array_from_process_local_data(sharding, host[process_rows(sharding, host.shape)], host.shape)


def fetch(tree):
    """Numpy values of a pytree of (possibly multi-process) arrays, on every process."""
    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return multihost_utils.process_allgather(x, tiled=True)
        return np.asarray(jax.device_get(x))
    return jax.tree.map(one, tree)


def replicated_key(seed: int, mesh: jax.sharding.Mesh) -> jax.Array:
    """A PRNG key on every device of `mesh` (a device_put of a key that already lives on
    one local device cannot target other processes' devices)."""
    from specjax import sharding
    return jax.jit(lambda: jax.random.key(seed), out_shardings=sharding.replicated(mesh))()


def generate(target, draft, prompts, sampling, *, seed: int = 0, pad_to: int = 16):
    """`specjax.generate` that also works with several processes (same arguments and
    `Result`; every process passes the same prompts and gets the same Result).

    It differs from `api.generate` only where multi-process needs it: inputs are built
    with `put` (process-local rows) and `replicated_key`, outputs read with `fetch`."""
    from specjax import api, sharding
    from specjax.sampling import Warp
    sampling.validate()
    lm_cfgs = [target.cfg] + ([draft.cfg] if draft is not None else [])
    api.check_prompts(prompts, target.cfg.vocab_size, min(c.max_seq_len for c in lm_cfgs), sampling.max_new_tokens)
    mesh = api.mesh_of(target)
    lookahead = sampling.lookahead if draft is not None else 1
    width = -(-max(len(p) for p in prompts) // pad_to) * pad_to
    size = width + sampling.max_new_tokens + lookahead + 1
    padded = np.zeros((len(prompts), width), np.int32)
    for i, prompt in enumerate(prompts):
        padded[i, :len(prompt)] = prompt
    lens = np.array([len(p) for p in prompts], np.int32)
    args = (put(padded, sharding.named(mesh, ("batch", None), padded.shape)),
            put(lens, sharding.named(mesh, ("batch",), lens.shape)), replicated_key(seed, mesh))
    warping = Warp(float(sampling.temperature), int(sampling.top_k), float(sampling.top_p))
    statics = dict(warping=warping, max_new=sampling.max_new_tokens, eos_id=sampling.eos_id, size=size)
    if draft is not None:
        fn, args, statics = api.sps_program, (target, draft) + args, dict(statics, lookahead=lookahead)
    else:
        fn, args = api.ars_program, (target,) + args
    start = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = api.compile_cached(fn, args, statics)
        compile_seconds = time.perf_counter() - start
        start = time.perf_counter()
        out = compiled(*args)
        jax.block_until_ready(out)
    seconds = time.perf_counter() - start
    tokens, length, stats = fetch(out)
    if stats.nonfinite.any():
        rows = np.flatnonzero(stats.nonfinite).tolist()
        raise api.NonFiniteLogitsError(f"the model produced NaN or inf logits for batch rows {rows}")
    generated = [tokens[i, len(p):length[i]].tolist() for i, p in enumerate(prompts)]
    return api.Result(generated, "sps" if draft is not None else "ars", lookahead, stats.loops, stats.num_new,
                      stats.accepted, stats.accepted_at, stats.histogram, seconds, compile_seconds)
