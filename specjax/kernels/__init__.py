"""Hand-written CPU kernels, used where XLA:CPU leaves speed on the table, with the plain
jnp ops as the fallback everywhere else. They apply only on the CPU backend, on a single
device, in float32, and where the program's static `Kernels` setting allows them:

* the few-row matmul (`fewrow_matmul.cc`) multiplies a decode step's or a scoring pass's
  few rows by a weight in the `Packed` format, or by an `Int8` or `Grouped` weight's panels
  (`LM.packed()` packs a model's projections once, for decoding): XLA:CPU's dot for 2-8
  rows runs well below the rate at which the weights can be read; the kernel streams each
  panel once for all rows, with the rows' sums in registers. A prefill's many rows go
  through it in tiles of a few, each sweeping the panel while it is in cache. Plain arrays
  (training) use jnp.einsum.
* the attention (`cached_attention.cc`) of a pass's queries over one layer of the stacked
  cache, read in place (XLA copied each layer's slice every step) and only below each
  row's length, and over the pass's own keys under the caller's visibility mask.
* the nucleus cut (`nucleus.cc`): the bisection of `sampling.nucleus`, whose 32 masked
  sums XLA:CPU runs as a loop of small ops on every draft and target distribution.

Modules: `setting` (the static `Kernels` value and its default from SPECJAX_KERNELS),
`library` (compile, load, register), `dispatch` (when each kernel runs, and its FFI call),
`formats` (`project`, the one "x @ W", and the `Packed`, `Int8` and `Grouped` weight formats).
"""
from specjax.kernels.library import available, build
from specjax.kernels.dispatch import MAX_ROWS
from specjax.kernels.setting import DEFAULT, KERNELS, NONE, Kernels
from specjax.kernels.formats import (PANEL, QUANTIZED, Grouped, Int8, Packed, pack, pack_params, project, quantize_int4,
                                     quantize_int8, quantize_params, rows, should_pack, stored, is_quantized)

__all__ = ["DEFAULT", "KERNELS", "MAX_ROWS", "NONE", "PANEL", "QUANTIZED", "Grouped", "Int8", "Kernels", "Packed",
           "available", "build", "pack", "pack_params", "project", "quantize_int4", "quantize_int8", "quantize_params",
           "rows", "should_pack", "stored", "is_quantized"]
