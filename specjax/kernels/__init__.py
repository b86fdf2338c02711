"""Hand-written CPU kernels, used where XLA:CPU leaves speed on the table, with the plain
jnp ops as the fallback everywhere else. Both apply only on the CPU backend, on a single
device, in float32, with at most MAX_ROWS new rows (a decode step or SpS's scoring pass,
never training or a long prefill); the decision is made at trace time.

* `einsum(spec, x, w)` is `jnp.einsum` for the model's weight projections, by
  `fewrow_matmul.cc`: XLA:CPU's dot for 2-8 rows runs well below the rate at which the
  weights can be read, so scoring K+1 tokens cost far more than one token; the kernel
  reads each weight once for all rows.
* `attention(...)` is attention of the new queries over one layer of the stacked cache,
  by `cached_attention.cc`, which reads the cache in place (XLA copied each layer's
  slice every step) and only its visible prefix.

The kernels are compiled on first use with the system C++ compiler ($CXX, g++ or c++)
for this CPU (-march=native) into $SPECJAX_CACHE/kernels/<hash of sources, compiler,
flags, CPU, jax>/ and loaded with ctypes. Where that fails (no compiler, a load error) or
SPECJAX_KERNELS=0, every call is the jnp path, silently (SPECJAX_KERNELS=matmul or
=attention keeps one of them).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

SOURCES = tuple(pathlib.Path(__file__).with_name(name) for name in ("fewrow_matmul.cc", "cached_attention.cc"))
HEADERS = (pathlib.Path(__file__).with_name("simd.h"),)
TARGET = "specjax_fewrow_matmul"
ATTENTION_TARGET = "specjax_cached_attention"
KERNELS = ("matmul", "attention")
MAX_ROWS = 8
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")

log = logging.getLogger(__name__)


def enabled(kernel: str) -> bool:
    """SPECJAX_KERNELS (read at trace time): 1 or unset, all kernels; 0, none; or a
    comma-separated list of KERNELS."""
    setting = os.environ.get("SPECJAX_KERNELS", "1").strip()
    return setting != "0" and (setting == "1" or kernel in setting.split(","))


def _cpu_id() -> str:
    """What -march=native compiles for: a cache shared by different CPUs keeps one build each."""
    try:
        info = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({line for line in info if line.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor()


def build(cache: pathlib.Path | None = None) -> pathlib.Path:
    """The compiled library, built if absent. Two processes may build at once: each compiles
    to its own temporary file and renames it into place (atomic; the results are equal)."""
    from specjax.config import cache_dir

    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise FileNotFoundError("no C++ compiler ($CXX, g++, c++)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    cmd = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}"]
    key = hashlib.sha256("\0".join([*(s.read_text() for s in SOURCES + HEADERS), version, *cmd, _cpu_id(),
                                    platform.machine(), jax.__version__]).encode()).hexdigest()[:16]
    out = (cache or cache_dir()) / "kernels" / key / "libspecjax_kernels.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".build-", suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run([*cmd, *map(str, SOURCES), "-o", tmp], capture_output=True, text=True, timeout=600)
        if done.returncode:
            raise RuntimeError(f"{compiler} failed: {done.stderr[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def available() -> bool:
    """Build (once per process), load and register the kernels; False, logged, on any failure."""
    try:
        lib = ctypes.cdll.LoadLibrary(str(build()))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.SpecjaxFewRowMatmul), platform="cpu")
        jax.ffi.register_ffi_target(ATTENTION_TARGET, jax.ffi.pycapsule(lib.SpecjaxCachedAttention), platform="cpu")
        return True
    except Exception as e:  # noqa: BLE001 -- any failure means the fallback, never an error
        log.info("specjax: CPU kernels unavailable, using the jnp ops: %s", e)
        return False


@jax.custom_jvp
def fewrow_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [T, K] @ w [K, N] float32 by the kernel (call only where `available()`)."""
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(x, w)


@fewrow_matmul.defjvp
def _fewrow_matmul_jvp(primals, tangents):  # so that a gradient through a small batch still works
    (x, w), (dx, dw) = primals, tangents
    return fewrow_matmul(x, w), jnp.dot(dx, w) + jnp.dot(x, dw)


def _single_device() -> bool:
    """Multi-device meshes (fake CPU devices included) keep XLA's SPMD-partitioned dot."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.size == 1 if not mesh.empty else jax.device_count() == 1


def _matmul_spec(spec: str) -> bool:
    """'<lead>c,c<rest>-><lead><rest>': x's last axis contracted with w's first, nothing else."""
    lhs, _, out = spec.replace(" ", "").partition("->")
    x_axes, _, w_axes = lhs.partition(",")
    return (len(x_axes) >= 1 and len(w_axes) >= 2 and x_axes[-1] == w_axes[0]
            and out == x_axes[:-1] + w_axes[1:] and len(set(x_axes + w_axes[1:])) == len(x_axes + w_axes[1:]))


def use_kernel(spec: str, x, w) -> bool:
    """Decided at trace time from static facts: backend, devices, dtypes, row count."""
    rows = math.prod(x.shape[:-1])
    return (enabled("matmul") and x.dtype == jnp.float32 and w.dtype == jnp.float32 and 1 <= rows <= MAX_ROWS
            and _matmul_spec(spec) and jax.default_backend() == "cpu" and _single_device() and available())


def einsum(spec: str, x: jax.Array, w: jax.Array, **kwargs) -> jax.Array:
    """`jnp.einsum(spec, x, w, **kwargs)` for a weight projection; the kernel where it applies
    (the reshapes to and from 2-D are free: both operands are row-major)."""
    if not use_kernel(spec, x, w) or kwargs.get("preferred_element_type", jnp.float32) != jnp.float32:
        return jnp.einsum(spec, x, w, **kwargs)
    k = x.shape[-1]
    y = fewrow_matmul(x.reshape(-1, k), w.reshape(k, -1))
    return y.reshape(*x.shape[:-1], *w.shape[1:])


def use_attention(q, k_all, v_all) -> bool:
    """q [B, T, N, H] against caches [L, B, G, S, H]: the same static conditions as `use_kernel`."""
    B, T = q.shape[:2]
    return (enabled("attention") and all(a.dtype == jnp.float32 for a in (q, k_all, v_all)) and 1 <= B * T <= MAX_ROWS
            and jax.default_backend() == "cpu" and _single_device() and available())


def attention(q, k_all, v_all, layer, positions, lengths, scale: float, reference):
    """softmax(q k^T * scale over the visible keys) v for layer `layer` of the caches, as
    `reference(q, k_all, v_all)` (the jnp path, also used for gradients) computes it:
    q [B, T, N, H] -> [B, T, N, H]. Call only where `use_attention`."""

    @jax.custom_jvp
    def run(q, k_all, v_all):
        call = jax.ffi.ffi_call(ATTENTION_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32), vmap_method="sequential")
        return call(q, k_all, v_all, jnp.asarray(layer, jnp.int32), positions.astype(jnp.int32),
                    lengths.astype(jnp.int32), scale=np.float32(scale))

    @run.defjvp
    def _(primals, tangents):
        return run(*primals), jax.jvp(reference, primals, tangents)[1]

    return run(q, k_all, v_all)
