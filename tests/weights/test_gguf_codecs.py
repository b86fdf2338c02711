"""GGML block types as codecs (`specjax.weights.gguf_codecs`): every type with a codec unpacks
into codes, float16 scales (and minimums) and int8 factors whose values are the `gguf`
package's own dequantization bit for bit, on random blocks (every byte random: any code,
any scale bits) and on the blocks of files llama.cpp's `llama-quantize` wrote
(tests/fixtures/gguf/kq_*.gguf); the weights `--quantize` keeps from such a file
(`kernels.Grouped`, through the loader's sharded reads) hold those values exactly.
(tests/cli/test_gguf_cli.py: the stderr line about dequantized types names only the types
without a codec.)"""
import pathlib

import jax
import numpy as np
import pytest

from specjax import kernels
from specjax.weights import gguf
from specjax.weights.gguf_codecs import CODECS, unpack
from conftest import mesh_for

import gguf as gguf_package  # the format's own package: the independent reference

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "gguf"
LLAMA_CPP_FILES = ["kq_Q4_K_M", "kq_Q5_K_M", "kq_Q8_0"]  # llama-quantize's blocks (make_gguf_fixtures.py)


def _type(name):
    return gguf_package.GGMLQuantizationType[name]


@pytest.mark.parametrize("type_name", sorted(CODECS))
def test_random_blocks_unpack_to_the_gguf_packages_values(type_name):
    """Random bytes as 3 rows of 4 blocks (NaN where a float16 field is one: equal too):
    the codes fit the codec's bits, scales are float16 values, factors int8, and
    (code - offset) * scale + low equals gguf.quants.dequantize bit for bit."""
    block, size = gguf_package.GGML_QUANT_SIZES[_type(type_name)]
    c = CODECS[type_name]
    assert (c.size, c.block) == (size, block)
    raw = np.random.default_rng(sorted(CODECS).index(type_name)).integers(0, 256, (3, 4 * size), dtype=np.uint8)
    b = unpack(type_name, raw)
    assert b.codes.shape == (3, 4 * block) and b.codes.dtype == np.uint8 and b.codes.max() < 2 ** c.bits
    assert b.scale.shape == (3, 4 * block // (c.group * c.per))
    assert (b.low is not None) == c.minimums and (b.scale_factor is not None) == (c.per > 1)
    finite = np.isfinite(b.scale)
    np.testing.assert_array_equal(b.scale[finite].astype(np.float16).astype(np.float32), b.scale[finite])
    if c.per > 1:
        assert b.scale_factor.dtype == np.int8 and b.scale_factor.shape == (3, 4 * block // c.group)
    with np.errstate(invalid="ignore"):
        want = gguf_package.quants.dequantize(raw, _type(type_name))
        np.testing.assert_array_equal(b.dequantize(), want)
    assert np.isfinite(want).mean() > 0.5


def llama_cpp_path(name):
    return FIXTURES / f"{name}.gguf"


@pytest.mark.parametrize("name", LLAMA_CPP_FILES)
def test_llama_quantize_blocks_unpack_to_the_gguf_packages_values(name):
    """Every quantized tensor llama.cpp wrote: the codec's values are the package's, bit for bit."""
    f = gguf.open_file(llama_cpp_path(name))
    types = set()
    for tname, t in f.tensors.items():
        if f.type_name(tname) in CODECS:
            types.add(f.type_name(tname))
            raw = np.array(t.data).reshape(f.shape(tname)[0], -1)
            np.testing.assert_array_equal(unpack(f.type_name(tname), raw).dequantize(),
                                          gguf_package.quants.dequantize(raw, t.tensor_type), err_msg=tname)
    assert types == {"kq_Q4_K_M": {"Q4_K", "Q6_K"}, "kq_Q5_K_M": {"Q5_K", "Q6_K"}, "kq_Q8_0": {"Q8_0"}}[name]


@pytest.mark.parametrize("name,kind,mesh_name", [("kq_Q4_K_M", "int4", "1x1"), ("kq_Q5_K_M", "w4a8", "1x1"),
                                                 ("kq_Q4_K_M", "int4", "2x4")])
def test_kept_weights_hold_the_files_values_exactly(name, kind, mesh_name):
    """`load(quantize=kind)` keeps every matrix of a K-quant file (the tied table too) as a
    Grouped of its type's form (bits, inputs per group, offset, two-level factors), placed
    where the float weight is, whose values are the float load's bit for bit (the float load
    reads each block through its codec: the package's values, above), on one device and
    split over a 2x4 mesh (kv heads duplicated there)."""
    mesh = mesh_for(mesh_name)
    kept, _ = gguf.load(llama_cpp_path(name), mesh, quantize=kind)
    floats, _ = gguf.load(llama_cpp_path(name), mesh, param_dtype="float32")
    is_q = lambda x: isinstance(x, kernels.Grouped)  # noqa: E731
    pairs = [(a, b) for a, b in zip(jax.tree.leaves(kept.params, is_leaf=is_q), jax.tree.leaves(floats.params))
             if is_q(a)]
    f = gguf.open_file(llama_cpp_path(name))
    matrices = [n for n, t in f.tensors.items() if len(t.shape) == 2]
    assert len(pairs) == len(matrices)
    forms = set()
    for w, float_w in pairs:
        assert w.activations == ("int8" if kind == "w4a8" else "float32")
        assert w.code.sharding == float_w.sharding
        forms.add((w.bits, w.group, w.offset, w.low is not None, w.scale_factor is not None))
        np.testing.assert_array_equal(np.asarray(kernels.stored(w)), np.asarray(float_w))
    want = {CODECS[f.type_name(n)].form[:4] + (CODECS[f.type_name(n)].per > 1,) for n in matrices}
    assert forms == want and len(forms) == 2  # the K-quant and Q6_K

