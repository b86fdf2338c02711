"""Compile the C++ kernels, load the library and register its XLA FFI targets.

The sources are compiled on first use with the system C++ compiler ($CXX, g++ or c++)
for this CPU (-march=native) into $SPECJAX_CACHE/kernels/<hash of sources, compiler,
flags, CPU, jax>/ and loaded with ctypes. SPECJAX_KERNEL_FLAGS adds compiler flags after
-march=native (e.g. "-mno-avx512f": the AVX2 code on an AVX-512 machine; the tests build
each instruction set's path this way). Where that fails (no compiler, a load error)
`available()` is False, logged once, and every caller takes the jnp path.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import jax

HERE = pathlib.Path(__file__).parent
SOURCES = tuple(HERE / name for name in ("fewrow_matmul.cc", "cached_attention.cc", "nucleus.cc"))
HEADERS = (HERE / "simd.h",)
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")
# FFI target name -> the library's handler symbol.
MATMUL_TARGET = "specjax_fewrow_matmul"
MATMUL_INT8_TARGET = "specjax_fewrow_matmul_int8"
MATMUL_GROUPED_TARGET = "specjax_fewrow_matmul_grouped"
MATMUL_A8_TARGET = "specjax_fewrow_matmul_a8"
ATTENTION_TARGET = "specjax_cached_attention"
NUCLEUS_TARGET = "specjax_nucleus"
HANDLERS = {MATMUL_TARGET: "SpecjaxFewRowMatmul", MATMUL_INT8_TARGET: "SpecjaxFewRowMatmulInt8",
            MATMUL_GROUPED_TARGET: "SpecjaxFewRowMatmulGrouped",
            MATMUL_A8_TARGET: "SpecjaxFewRowMatmulA8",
            ATTENTION_TARGET: "SpecjaxCachedAttention",
            NUCLEUS_TARGET: "SpecjaxNucleus"}

log = logging.getLogger(__name__)


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
    cmd = [compiler, *FLAGS, *os.environ.get("SPECJAX_KERNEL_FLAGS", "").split(), f"-I{jax.ffi.include_dir()}"]
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
        for target, symbol in HANDLERS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
        return True
    except Exception as e:  # noqa: BLE001 -- any failure means the fallback, never an error
        log.info("specjax: CPU kernels unavailable, using the jnp ops: %s", e)
        return False
