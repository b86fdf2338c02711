"""XLA:TPU without a TPU: the devices of a TPU slice on libtpu's compile-only client.

`jax.experimental.topologies.get_topology_desc` loads libtpu (the `tpu` extra:
`pip install 'specjax[tpu]'`) and describes a slice by name; its devices can be put in a
mesh, programs lowered with sharded `ShapeDtypeStruct`s compile to real XLA:TPU
executables (memory, cost and HLO), and nothing can run. maxtext's train_compile.py
works the same way.
"""
from __future__ import annotations

import importlib.util
import os

from specjax.config import UsageError

EXTRA = "pip install 'specjax[tpu]'"

# Slices by chip count, as libtpu names them. v4 and v5p are 3-D tori whose chips show as
# one device each ("megacore": the chip's two TensorCores act as one); v5e and v6e are 2-D,
# one TensorCore per chip. Below a host's 4 chips the slice is named with its own host
# bounds (`chips_per_host_bounds`).
_3D = {1: (1, 1, 1), 2: (2, 1, 1), 4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4),
       128: (4, 4, 8), 256: (4, 8, 8)}
_2D = {1: (1, 1), 2: (2, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16), 256: (16, 16)}
SLICES = {"v4": (_3D, "megacore", "v4-8"), "v5p": (_3D, "megacore", "v5p-8"),
          "v5e": (_2D, "default", "v5litepod-4"), "v6e": (_2D, "default", "v6e-4")}


def available() -> bool:
    try:
        return importlib.util.find_spec("libtpu") is not None
    except ImportError:
        return False


def check(chip: str, data: int, model: int) -> str:
    """The slice name for a data x model mesh of `chip` chips, after checking that libtpu
    is installed and that such a slice exists (UsageError naming what is allowed)."""
    if chip not in SLICES:
        raise UsageError(f"--chip={chip}: --compiler=tpu compiles for {', '.join(SLICES)}")
    shapes, _, _ = SLICES[chip]
    if data * model not in shapes:
        raise UsageError(f"--mesh={data}x{model}: {data * model} {chip} chips form no slice; the mesh's "
                         f"DATAxMODEL must multiply to one of {', '.join(map(str, shapes))} chips")
    if not available():
        raise UsageError(f"--compiler=tpu needs libtpu, XLA:TPU's compiler: {EXTRA} (jax[tpu] of the pinned jax)")
    return f"{chip}:" + "x".join(map(str, shapes[data * model]))


def devices(chip: str, data: int, model: int) -> list:
    """The devices of the slice `check` names, on libtpu's compile-only client."""
    name = check(chip, data, model)
    shapes, core_config, host = SLICES[chip]
    bounds = shapes[data * model]
    # A TPU VM learns these from its metadata server; here there is none, and without them
    # libtpu prints a page of start-up complaints. They name no slice: the topology does.
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", host)
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    # libtpu locks a host's TPUs for one process; a compile-only client has none to lock, and
    # two plans (or test workers) compiling at once would otherwise refuse each other.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies
    small = {"chips_per_host_bounds": bounds + (1,) * (3 - len(bounds))} if data * model < 4 else {}
    return list(topologies.get_topology_desc(platform="tpu", topology_name=name, chip_config_name=core_config,
                                             **small).devices)
