"""Hand-written CPU kernels, used where XLA:CPU leaves speed on the table, with the plain
jnp ops as the fallback everywhere else. They apply only on the CPU backend, on a single
device, in float32; the decision is made at trace time.

* `einsum(spec, x, w)` is `jnp.einsum` for the model's weight projections. For a weight
  packed by `pack` (`LM.packed()` packs a model's projections once, for decoding) and at
  most MAX_ROWS rows (a decode step or SpS's scoring pass) it runs `fewrow_matmul.cc`:
  XLA:CPU's dot for 2-8 rows runs well below the rate at which the weights can be read,
  so scoring K+1 tokens cost far more than one token; the kernel streams each panel of
  the packed weight once for all rows, with the rows' sums in registers. More rows (a
  prefill) and plain arrays (training) get jnp.einsum over the weight as it was.
* `attention(...)` is attention of the new queries over one layer of the stacked cache,
  by `cached_attention.cc`, which reads the cache in place (XLA copied each layer's
  slice every step) and only its visible prefix (at most MAX_ROWS query rows).
* `nucleus(probs, top_p)` is `sampling.nucleus` by `nucleus.cc`: the same bisection,
  whose 32 masked sums XLA:CPU runs as a loop of small ops (tens of microseconds a row
  inside the decode loops, on every draft and target distribution).

The kernels are compiled on first use with the system C++ compiler ($CXX, g++ or c++)
for this CPU (-march=native) into $SPECJAX_CACHE/kernels/<hash of sources, compiler,
flags, CPU, jax>/ and loaded with ctypes. Where that fails (no compiler, a load error) or
SPECJAX_KERNELS=0, every call is the jnp path, silently (SPECJAX_KERNELS=matmul,nucleus
and the like keep the kernels named, from KERNELS).
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
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

SOURCES = tuple(pathlib.Path(__file__).with_name(name)
                for name in ("fewrow_matmul.cc", "cached_attention.cc", "nucleus.cc"))
HEADERS = (pathlib.Path(__file__).with_name("simd.h"),)
TARGET = "specjax_fewrow_matmul"
ATTENTION_TARGET = "specjax_cached_attention"
NUCLEUS_TARGET = "specjax_nucleus"
KERNELS = ("matmul", "attention", "nucleus")
MAX_ROWS = 8
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")

log = logging.getLogger(__name__)


def enabled(kernel: str) -> bool:
    """SPECJAX_KERNELS (read at trace time): 1 or unset, all kernels; 0, none; or a
    comma-separated list of KERNELS."""
    setting = os.environ.get("SPECJAX_KERNELS", "1").strip()
    return setting != "0" and (setting == "1" or kernel in setting.split(","))


def setting_value(name: str) -> str | None:
    """The SPECJAX_KERNELS value of a benchmark's kernel setting: 'on' (all), 'off' (none),
    'default' (None: as it is), or KERNELS joined by ',' or '+' (a flag that lists settings
    takes 'matmul+attention'). ValueError for anything else."""
    value = {"on": "1", "off": "0", "default": None}.get(name, name.replace("+", ","))
    if value is not None and value not in ("0", "1") and not set(value.split(",")) <= set(KERNELS):
        raise ValueError(f"kernel setting {name!r}: not on, off, default or a list of {', '.join(KERNELS)}")
    return value


@contextlib.contextmanager
def setting(name: str):
    """SPECJAX_KERNELS as `setting_value(name)` for what is traced inside (benchmarks' A/B
    runs). Functions traced under it must be fresh: jit's trace cache does not see the
    variable."""
    value = setting_value(name)
    saved = os.environ.get("SPECJAX_KERNELS")
    if value is not None:
        os.environ["SPECJAX_KERNELS"] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("SPECJAX_KERNELS", None)
        else:
            os.environ["SPECJAX_KERNELS"] = saved


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
        jax.ffi.register_ffi_target(NUCLEUS_TARGET, jax.ffi.pycapsule(lib.SpecjaxNucleus), platform="cpu")
        return True
    except Exception as e:  # noqa: BLE001 -- any failure means the fallback, never an error
        log.info("specjax: CPU kernels unavailable, using the jnp ops: %s", e)
        return False


PANEL = 64  # columns per packed panel (fewrow_matmul.cc's kPanel)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Packed:
    """A weight w [*lead, *contracted, *out] as it is (`plain`, for XLA's dots over many
    rows: a prefill) and packed for the few-row kernel: `panels` [*lead, P, K, PANEL]
    holds columns PANEL*p .. PANEL*p + PANEL - 1 of the matrix w.reshape(*lead, K, N)
    (zeros past N), each panel one contiguous run that the kernel streams once. `out` are
    w's trailing axes (N = their product). A pytree whose leaves are the two arrays, so it
    rides inside a model's params (a scan over stacked layers slices their leading axis).

    `transposed`: the weight multiplied by is plain's transpose (a tied embedding table,
    stored [V, D] for the lookup, multiplied by as [D, V]); the panels are the transpose's."""

    plain: jax.Array
    panels: jax.Array
    out: tuple[int, ...]
    transposed: bool = False

    def tree_flatten(self):
        return (self.plain, self.panels), (self.out, self.transposed)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    @property
    def dtype(self):
        return self.panels.dtype

    @property
    def n(self) -> int:
        return math.prod(self.out)

    @property
    def matrix(self) -> jax.Array:
        """The weight as multiplied by, unpacked (a transpose is a view XLA folds into its dot)."""
        return jnp.swapaxes(self.plain, -1, -2) if self.transposed else self.plain


def pack(w: jax.Array, contracted: int, lead: int = 0, *, transposed: bool = False) -> Packed:
    """w [*lead, *contracted, *out] -> Packed (w itself, and a copy of it in panels). With
    `transposed`, w is [*lead, N, K] and what is packed is its transpose [*lead, K, N]
    (`contracted` must then be 1)."""
    if transposed:
        if contracted != 1 or w.ndim != lead + 2:
            raise ValueError(f"a transposed weight is [*lead, N, K]: got {w.shape} with lead={lead}")
        packed = pack(jnp.swapaxes(w, -1, -2), 1, lead)
        return Packed(w, packed.panels, packed.out, True)
    shape = w.shape
    K, out = math.prod(shape[lead:lead + contracted]), tuple(shape[lead + contracted:])
    N = math.prod(out)
    P = -(-N // PANEL)
    m = jnp.pad(w.reshape(*shape[:lead], K, N), [(0, 0)] * (lead + 1) + [(0, P * PANEL - N)])
    return Packed(w, jnp.moveaxis(m.reshape(*shape[:lead], K, P, PANEL), -2, -3), out)


def stored(w) -> jax.Array:
    """The array as stored: a Packed weight's plain array (a tied table's [V, D] rows for
    the embedding lookup), a plain one itself."""
    return w.plain if isinstance(w, Packed) else w


def transpose(w):
    """w's transpose as a weight to multiply by: for a plain matrix w.T; a Packed table
    packed `transposed` already is that transpose (its panels are w.T's)."""
    if isinstance(w, Packed):
        if not w.transposed:
            raise ValueError("only a weight packed transposed can be multiplied by as its transpose")
        return w
    return w.T


def panel_dot(x: jax.Array, panels: jax.Array, n: int) -> jax.Array:
    """x [T, K] @ the packed matrix with `n` columns, by XLA (the kernel's gradient)."""
    return jnp.einsum("TK,PKC->TPC", x, panels).reshape(x.shape[0], -1)[:, :n]


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def fewrow_matmul(x: jax.Array, panels: jax.Array, n: int) -> jax.Array:
    """x [T, K] @ the packed matrix with `n` columns, float32, by the kernel (call only where
    `available()`)."""
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(x, panels)


@fewrow_matmul.defjvp
def _fewrow_matmul_jvp(n, primals, tangents):  # so that a gradient through a small batch still works
    (x, panels), (dx, dpanels) = primals, tangents
    return fewrow_matmul(x, panels, n), panel_dot(dx, panels, n) + panel_dot(x, dpanels, n)


def _single_device() -> bool:
    """Multi-device meshes (fake CPU devices included) keep XLA's SPMD-partitioned dot."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.size == 1 if not mesh.empty else jax.device_count() == 1


def _runs(kernel: str) -> bool:
    """The conditions every kernel shares: enabled, the CPU backend, the library built
    (last: the first call builds it)."""
    return enabled(kernel) and jax.default_backend() == "cpu" and available()


def use_kernel(x, w) -> bool:
    """Decided at trace time from static facts: packed weights, backend, devices, dtypes, row count."""
    rows = math.prod(x.shape[:-1])
    return (isinstance(w, Packed) and x.dtype == jnp.float32 and w.dtype == jnp.float32 and 1 <= rows <= MAX_ROWS
            and _single_device() and _runs("matmul"))


def einsum(spec: str, x: jax.Array, w, **kwargs) -> jax.Array:
    """`jnp.einsum(spec, x, w, **kwargs)` for a weight projection (`spec` contracts x's last
    axis with w's leading ones): for a Packed w, the kernel where it applies, else (a
    prefill, the kernels off) jnp.einsum over its plain array, exactly as unpacked."""
    if not isinstance(w, Packed):
        return jnp.einsum(spec, x, w, **kwargs)
    if not use_kernel(x, w) or kwargs.get("preferred_element_type", jnp.float32) != jnp.float32:
        return jnp.einsum(spec, x, w.matrix, **kwargs)
    y = fewrow_matmul(x.reshape(-1, x.shape[-1]), w.panels, w.n)  # the reshapes are free: row-major
    return y.reshape(*x.shape[:-1], *w.out)


def cast(w, dtype):
    """w.astype(dtype) for a plain or a Packed weight."""
    if isinstance(w, Packed):
        return w if w.dtype == dtype else Packed(w.plain.astype(dtype), w.panels.astype(dtype), w.out, w.transposed)
    return w.astype(dtype)


def as_matrix(w, k: int):
    """w with its leading axes merged into one of size k (as a Packed weight's panels are)."""
    if isinstance(w, Packed):
        if w.panels.shape[-2] != k or w.transposed:
            raise ValueError(f"packed weight contracts {w.panels.shape[-2]} inputs, not {k}")
        return Packed(w.plain.reshape(k, -1), w.panels, (w.n,))
    return w.reshape(k, -1)


def _memory_available() -> int | None:
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def should_pack(params, dtypes: tuple[str, str], *, new_copy: bool = True) -> bool:
    """Whether a model's decoding pays for a packed copy of its projections: the kernel would
    run (CPU backend, params on one device, float32 params and compute, kernel enabled and
    built), and, for a `new_copy`, the copy (as large as the weights) fits in half the free
    memory."""
    leaves = jax.tree.leaves(params)
    one_device = lambda x: getattr(x, "sharding", None) is not None and len(x.sharding.device_set) == 1
    if not (dtypes == ("float32", "float32") and leaves and all(one_device(x) for x in leaves) and _runs("matmul")):
        return False
    if not new_copy or not all(isinstance(x, jax.Array) for x in leaves):  # abstract (`plan`): nothing allocated
        return True
    size, free = sum(x.nbytes for x in leaves), _memory_available()
    if free is not None and size > free // 2:
        log.info("specjax: not packing %d MB of weights for the CPU kernel (%d MB free)", size >> 20, free >> 20)
        return False
    return True


def pack_params(params, contracted: dict[str, tuple[int, int]], transposed: tuple[str, ...] = ()):
    """params with every weight named in `contracted` (name -> (contracted axes, axes of
    one layer's weight); more axes are stacked layers) replaced by its Packed copy, the
    panels made by one jitted program on the params' device (or, for abstract params,
    their shapes). Names in `transposed` are [N, K] weights multiplied by as their
    transpose (`pack`). The Packed weights hold the params' own arrays as `plain`: only
    the panels are new (a jitted program returning the arrays too would copy them)."""
    is_packed = lambda x: isinstance(x, Packed)  # noqa: E731

    def recipe(path, w) -> dict | None:
        names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey) and isinstance(k.key, str)]
        if is_packed(w) or not names or names[-1] not in contracted:
            return None
        axes, ndim = contracted[names[-1]]
        return dict(contracted=axes, lead=len(w.shape) - ndim, transposed=names[-1] in transposed)

    def panels(p):
        return {jax.tree_util.keystr(path): pack(w, **r).panels
                for path, w in jax.tree_util.tree_leaves_with_path(p, is_leaf=is_packed)
                if (r := recipe(path, w)) is not None}

    leaves = jax.tree.leaves(params)
    if all(isinstance(x, jax.Array) for x in leaves):
        made = jax.jit(panels)(params)
    else:  # abstract params (what `plan` compiles): the shapes, on the params' one-device mesh
        first = leaves[0].sharding
        where = (jax.sharding.NamedSharding(first.mesh, jax.sharding.PartitionSpec())
                 if isinstance(first, jax.sharding.NamedSharding) else first)
        made = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where),
                            jax.eval_shape(panels, params))

    def one(path, w):
        r = recipe(path, w)
        if r is None:
            return w
        layout = jax.eval_shape(lambda w: pack(w, **r), jax.ShapeDtypeStruct(w.shape, w.dtype))
        return Packed(w, made[jax.tree_util.keystr(path)], layout.out, layout.transposed)

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=is_packed)


def use_attention(q, k_all, v_all) -> bool:
    """q [B, T, N, H] against caches [L, B, G, S, H]: the same static conditions as `use_kernel`."""
    B, T = q.shape[:2]
    return (all(a.dtype == jnp.float32 for a in (q, k_all, v_all)) and 1 <= B * T <= MAX_ROWS and _single_device()
            and _runs("attention"))


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


def use_nucleus(probs) -> bool:
    """probs [..., V] float32 on one CPU device, the kernel enabled and built (trace time)."""
    return probs.dtype == jnp.float32 and _single_device() and _runs("nucleus")


def nucleus(probs: jax.Array, top_p: float) -> jax.Array:
    """`sampling.nucleus(probs, top_p)` by `nucleus.cc` (call only where `use_nucleus`):
    the same rule; its masked sums add in another order than XLA's, so a row whose mass
    at the threshold is within float32 rounding of top_p may be cut one value apart."""
    call = jax.ffi.ffi_call(NUCLEUS_TARGET, jax.ShapeDtypeStruct(probs.shape, jnp.float32), vmap_method="sequential")
    return call(probs, top_p=np.float32(top_p))
