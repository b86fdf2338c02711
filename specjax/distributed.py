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
import pickle
from typing import Any, Callable

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


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier `name` (no-op with one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


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


def broadcast_bytes(data: bytes) -> bytes:
    """Process 0's `data` on every process (the others pass anything, e.g. b"")."""
    if jax.process_count() == 1:
        return data
    size = multihost_utils.broadcast_one_to_all(np.array([len(data)], np.int64))
    buf = np.zeros(int(size[0]), np.uint8)
    if jax.process_index() == 0:
        buf[:] = np.frombuffer(data, np.uint8)
    return np.asarray(multihost_utils.broadcast_one_to_all(buf)).tobytes()


def agreed(fn: Callable[[], Any]) -> Any:
    """`fn()` run on process 0 only, its result (or its UsageError) on every process.

    Everything that reads host inputs (prompt files, tokenizers, checkpoint directories,
    output paths) goes through here, so a file that only worker 0 can read, or a bad
    input, ends every process the same way instead of one exiting while the others wait
    in a collective until the coordinator times out."""
    from specjax.config import UsageError
    if jax.process_count() == 1:
        return fn()
    payload = ("ok", None)
    if jax.process_index() == 0:
        try:
            payload = ("ok", fn())
        except UsageError as e:
            payload = ("usage", str(e))
        except Exception as e:  # noqa: BLE001 (told to every process, then raised here)
            payload = ("error", f"{type(e).__name__}: {e}")
            error = e
    kind, value = pickle.loads(broadcast_bytes(pickle.dumps(payload) if jax.process_index() == 0 else b""))
    if kind == "usage":
        raise UsageError(value)
    if kind == "error":
        if jax.process_index() == 0:
            raise error
        raise RuntimeError(f"process 0 failed while reading the inputs: {value}")
    return value


def everywhere(fn: Callable[[], Any], message_bytes: int = 2048) -> Any:
    """`fn()` run on every process; if it raised UsageError on any of them, the same
    UsageError (naming the process) on all of them. `fn` must not itself synchronise
    processes: it is the check that comes BEFORE anything that does (orbax managers,
    collectives), so that no process is left waiting for one that already exited."""
    from specjax.config import UsageError
    if jax.process_count() == 1:
        return fn()
    result, message = None, b""
    try:
        result = fn()
    except UsageError as e:
        message = str(e).encode("utf-8")[:message_bytes] or b"error"
    buf = np.zeros(message_bytes + 1, np.uint8)
    buf[0], buf[1:1 + len(message)] = len(message) > 0, np.frombuffer(message, np.uint8)
    gathered = np.asarray(multihost_utils.process_allgather(buf))
    for process, row in enumerate(gathered):
        if row[0]:
            text = row[1:].tobytes().rstrip(b"\0").decode("utf-8", errors="replace")
            raise UsageError(text if process == jax.process_index() else f"on process {process}: {text}")
    return result
