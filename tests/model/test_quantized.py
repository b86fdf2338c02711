"""Quantized weights (`kernels.Int8`, `kernels.Grouped`): the quantizations against float64 numpy,
the few-row kernel's int8 and grouped variants (specjax's int4 and 8-bit groups, and every form
a GGUF codec keeps: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants' two-level scales) and XLA's
path against float64 numpy references of the dequantized weight (with int8 activations: of x
rounded by numpy, next to a control that the unrounded product is far off), a quantized model
through prefill and decode against the same model with those weights dequantized in numpy, the
kernel's dispatch, and greedy SpS == greedy ArS on a quantized target."""
from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import kernels, kv_cache, model
from specjax.config import SamplingConfig
from specjax.decode import api
from specjax.kernels import NONE, Kernels, formats, library
from specjax.weights.gguf_codecs import CODECS
from conftest import mesh_for

needs_kernel = pytest.mark.skipif(not kernels.available(), reason="kernel not built here (no C++ compiler?)")
GGUF_FORMS = tuple(CODECS)  # a GGUF type's form as a kind (float activations), and with "/a8" (int8 ones)
CALLS = {"int8": library.MATMUL_INT8_TARGET, "int4": library.MATMUL_GROUPED_TARGET,
         "w4a8": library.MATMUL_A8_TARGET, "w8a8": library.MATMUL_A8_TARGET,
         **{t: library.MATMUL_GROUPED_TARGET for t in GGUF_FORMS},
         **{t + "/a8": library.MATMUL_A8_TARGET for t in GGUF_FORMS}}
FLOAT_CALL = library.MATMUL_TARGET
ON = Kernels()
KINDS = ("int8", "int4")


def quantize_reference(w: np.ndarray, axes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 in float64: scale = max |w| over `axes` (the contracted ones) / 127."""
    w = np.asarray(w, np.float64)
    scale = np.abs(w).max(axis=axes, keepdims=True) / 127
    scale = np.where(scale > 0, scale, 1.0)
    return np.clip(np.round(w / scale), -127, 127), scale


def dequantized(w) -> np.ndarray:
    """The weight in float64 as stored (a transposed table's [V, D] rows), from its arrays:
    q * scale (int8), (code - offset) * scale + min per group of inputs (grouped; two-level
    scales multiplied out)."""
    if isinstance(w, formats.Grouped):
        code = np.asarray(w.code, np.float64) - w.offset
        axis = -1 if w.transposed else -2

        def per_group(top, factor):
            if top is None:
                return None
            top = np.asarray(top, np.float64)
            if factor is None:
                return top
            return np.repeat(top, factor.shape[axis] // top.shape[axis], axis=axis) * np.asarray(factor, np.float64)
        scale, low = per_group(w.scale, w.scale_factor), per_group(w.low, w.low_factor)
        if w.transposed:  # [.., V, D], groups along D
            g = np.arange(code.shape[-1]) // w.group
            return code * scale[..., g] + (0 if low is None else low[..., g])
        lead = scale.ndim - 2
        shape = code.shape
        m = code.reshape(*shape[:lead], -1, int(np.prod(w.out)))
        g = np.arange(m.shape[-2]) // w.group
        return (m * scale[..., g, :] + (0 if low is None else low[..., g, :])).reshape(shape)
    q, s = np.asarray(w.q, np.float64), np.asarray(w.scale, np.float64)
    if w.transposed:
        return q * s[..., None]
    lead = s.ndim - 1
    return q * s.reshape(*s.shape[:lead], *[1] * (q.ndim - lead - len(w.out)), *w.out)


def random_grouped(type_name: str, K: int, N: int, rng, activations: str = "float32", transposed: bool = False):
    """A Grouped weight [K, N] of a GGUF type's form (`gguf_codecs.CODECS`: its bits, group,
    offset, minimums, two-level factors), with random codes over the whole width, float16
    scales and minimums of both signs, and int8 factors over the whole byte."""
    c = CODECS[type_name]
    G = -(-K // c.group)
    S = -(-G // c.per)
    two = c.per > 1

    def half(shape, size):  # float16 values, as the kernel stores them
        return (rng.uniform(0.5, 1.5, shape) * rng.choice([-1, 1], shape) * size).astype(np.float16).astype(np.float32)
    scale = half((S, N), 1 / (2 ** c.bits * K ** 0.5 * (64 if two else 1)))
    low = half((S, N), 1 / (K ** 0.5 * (64 if two else 1))) if c.minimums else None
    factor = lambda: rng.integers(-128, 128, (S * c.per, N)).astype(np.int8) if two else None  # noqa: E731
    sf, lf = factor(), factor() if c.minimums else None
    code = rng.integers(0, 2 ** c.bits, (K, N)).astype(np.uint8)
    arrays = dict(code=code, scale=scale, low=low, scale_factor=sf, low_factor=lf)
    if transposed:
        arrays = {k: None if a is None else a.T for k, a in arrays.items()}
    return formats.Grouped(**{k: None if a is None else jnp.asarray(a) for k, a in arrays.items()},
                           out=(N,), transposed=transposed, bits=c.bits, activations=activations, group=c.group,
                           offset=c.offset)


def test_quantization_is_symmetric_per_output_channel():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 20, 4, 5)).astype(np.float32)  # two stacked layers of [20] x [4, 5]
    w[1, :, 2, 3] = 0  # a zero column: scale 1, q 0
    qw = kernels.quantize_int8(jnp.asarray(w), 1, lead=1)
    q_ref, s_ref = quantize_reference(w, (1,))
    assert qw.q.dtype == jnp.int8 and qw.scale.shape == (3, 20) and qw.out == (4, 5)
    np.testing.assert_array_equal(np.asarray(qw.q), q_ref)
    np.testing.assert_allclose(np.asarray(qw.scale), s_ref.reshape(3, 20), rtol=1e-6)
    assert np.abs(np.asarray(qw.q)).max() == 127
    table = rng.standard_normal((50, 8)).astype(np.float32)  # [V, D]: per row
    qt = kernels.quantize_int8(jnp.asarray(table), 1, transposed=True)
    q_ref, s_ref = quantize_reference(table, (1,))
    np.testing.assert_array_equal(np.asarray(qt.q), q_ref)
    np.testing.assert_allclose(np.asarray(qt.scale), s_ref[:, 0], rtol=1e-6)
    assert qt.shape == (8, 50) and qt.T is qt
    tokens = jnp.array([[3, 49, 0]])
    np.testing.assert_allclose(np.asarray(kernels.rows(qt, tokens, jnp.float32)), (q_ref * s_ref)[[[3, 49, 0]]],
                               rtol=1e-6)


def test_int4_quantization_has_a_scale_and_minimum_per_group_of_32_inputs():
    """Per output column and group of 32 inputs (the last group short: K = 70), against
    float64 numpy: min = the group's minimum, scale = its range / 15, both float16 values
    (the nearest: within one float16 step of numpy's rounding), every weight within half a
    step of its code's value (plus the minimum's rounding); a constant group gets scale 1
    and codes 0. A table [V, D] is grouped along D, per row, and looked up by rows."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((2, 70, 3, 5)).astype(np.float32)  # two stacked layers of [70] x [3, 5]
    w[1, 32:64, 2, 4] = 0.25  # a constant group
    qw = kernels.quantize_int4(jnp.asarray(w), 1, lead=1)
    assert qw.code.dtype == jnp.uint8 and qw.code.shape == w.shape and qw.scale.shape == (2, 3, 15)
    m = w.astype(np.float64).reshape(2, 70, 15)
    for g, (a, b) in enumerate(((0, 32), (32, 64), (64, 70))):
        lo, hi = m[:, a:b].min(axis=1), m[:, a:b].max(axis=1)
        lo16 = lo.astype(np.float16).astype(np.float64)
        np.testing.assert_array_equal(np.asarray(qw.low)[:, g], lo16)
        np.testing.assert_allclose(np.asarray(qw.scale)[:, g],
                                   np.where(hi > lo, ((hi - lo16) / 15).astype(np.float16), 1.0), rtol=1e-3)
    for a in (qw.scale, qw.low):  # float16 values, as the kernel stores them
        np.testing.assert_array_equal(np.asarray(a).astype(np.float16).astype(np.float32), np.asarray(a))
    code = np.asarray(qw.code)
    assert code.max() <= 15 and code[1, 32:64, 2, 4].max() == 0
    step = np.repeat(np.asarray(qw.scale, np.float64), [32, 32, 6], axis=1).reshape(2, 70, 3, 5)
    low = np.repeat(np.asarray(qw.low, np.float64), [32, 32, 6], axis=1).reshape(2, 70, 3, 5)
    assert (np.abs(dequantized(qw) - w) <= 0.5 * step * (1 + 1e-3) + np.abs(low) * 2 ** -11 + 1e-7).all()
    table = rng.standard_normal((50, 40)).astype(np.float32)  # [V, D]: groups along D
    qt = kernels.quantize_int4(jnp.asarray(table), 1, transposed=True)
    assert qt.shape == (40, 50) and qt.T is qt and qt.scale.shape == (50, 2)
    assert np.abs(dequantized(qt) - table).max() <= 0.5 * np.asarray(qt.scale).max() * (1 + 1e-5)
    tokens = jnp.array([[3, 49, 0]])
    np.testing.assert_allclose(np.asarray(kernels.rows(qt, tokens, jnp.float32)), dequantized(qt)[[[3, 49, 0]]],
                               rtol=1e-6, atol=1e-6)


def quantize(kind, w):
    """`kind`'s weight of the shape of w: a quantizer's (of w's values), or a GGUF type's form
    ('Q6_K', 'Q6_K/a8': int8 activations) with random codes and scales."""
    if kind.split("/")[0] in CODECS:
        K, N = w.shape
        return random_grouped(kind.split("/")[0], K, N, np.random.default_rng(K + N),
                              "int8" if kind.endswith("/a8") else "float32")
    return formats.QUANTIZERS[kind](jnp.asarray(w), 1)


def rounded(x: np.ndarray) -> np.ndarray:
    """x as the A8 formats multiply it, by numpy: per row and group of 32 inputs, d = max |x|
    / 127 and q = round(x / d) (ties to even) in float32 arithmetic, as IEEE defines it; in
    float64, q * d."""
    T, K = x.shape
    g = np.zeros((T, -(-K // 32) * 32), np.float32)
    g[:, :K] = x
    g = g.reshape(T, -1, 32)
    d = np.abs(g).max(axis=-1, keepdims=True) / np.float32(127)
    q = np.round(g / np.where(d > 0, d, np.float32(1)))
    return (np.where(d > 0, q, 0).astype(np.float64) * d).reshape(T, -1)[:, :K]


A8 = ("w4a8", "w8a8") + tuple(t + "/a8" for t in GGUF_FORMS)  # int8 activations
# Rows per call: every tile size, then runs of rows as a prefill makes them; LONG rows of
# K >= 301 inputs take more than one pass of the kernel over the panels (its passes hold
# about 256 KiB of inputs: 216 float rows of 301, 816 rows of 320 int8 codes).
LONG = 820
ROWS = (*range(1, 9), 9, 13, LONG)
GGUF_ROWS = (1, 4, 5, 8, 13, LONG)  # for the GGUF forms (every T: the slow per-instruction-set test)


SHAPES = [(1, 1), (3, 17), (33, 47), (7, 130), (64, 64), (129, 200), (301, 1000)]
# The GGUF forms share the int4 / 8-bit code paths but for their bits and groups: one shape
# each, a short last group (one level) or two super-blocks (K-quants), and a partial panel;
# Q4_K and Q6_K also with a last super-block cut short (K = 300: the format takes any K).
A8_SHAPES = {"w4a8": SHAPES[1:], "w8a8": SHAPES[1:],
             **{t + suffix: [(100, 150)] if CODECS[t].per == 1 else [(512, 150)] + [(300, 70)] * (t in ("Q4_K", "Q6_K"))
                for t in GGUF_FORMS for suffix in ("", "/a8")}}
ROW_BYTES = {4: 32, 5: 40, 6: 48, 8: 64}  # per panel row of 64 columns: nibbles, then a bit plane per bit above 4
QUAD_BYTES = {4: 128, 5: 160, 6: 192, 8: 256}  # per A8 quad-row: 4 inputs of 64 columns


@needs_kernel
@pytest.mark.parametrize("kind,K,N", [(kind, K, N) for kind in KINDS + GGUF_FORMS + A8
                                      for K, N in A8_SHAPES.get(kind, SHAPES)])
def test_kernel_and_xla_path_match_float64_of_the_dequantized_weight(kind, K, N):
    """Every T in 1..8 (one tile), a prompt's runs of rows (9 and 13: tiles of 4 and a
    short one; LONG: more than one pass over the panels for every K here), partial panels
    (N not a multiple of 64), odd K (and, for int4, K not a multiple of its groups), every
    GGUF codec's form (bits, group, offset or minimums, two-level scales): the kernel
    (packed) and XLA's path (not packed) against x @ the dequantized weight in float64
    (with int8 activations, x rounded by numpy, and the product of x unrounded far off: the
    rounding is really done); a row's value does not depend on the rows beside it,
    bitwise. The panels hold as many bytes per weight as the format's bits (plus float16
    scales, int8 factors)."""
    rng = np.random.default_rng(K * 1000 + N)
    w = (rng.standard_normal((K, N)) * K ** -0.5).astype(np.float32)
    qw = quantize(kind, w)
    packed = formats.pack_params({"w": qw}, {"w": (1, 2)})["w"]
    P = -(-N // 64)
    if kind == "int8":
        assert packed.panels.dtype == jnp.int8 and packed.panels.shape == (P, K, 64)
    else:
        a8 = kind in A8
        Kp = -(-K // 32) * 32 if a8 else K  # A8: K padded to whole activation groups
        shape = (P, Kp // 4, QUAD_BYTES[qw.bits]) if a8 else (P, K, ROW_BYTES[qw.bits])
        assert packed.panels.dtype == jnp.uint8 and packed.panels.shape == shape
        G = -(-Kp // qw.group)
        per = CODECS[kind.split("/")[0]].per if kind.split("/")[0] in CODECS else 1
        parts = 1 if qw.low is None else 2
        assert packed.aux.dtype == jnp.float16 and packed.aux_factor.dtype == jnp.int8
        assert packed.aux.shape == (P, -(-G // per), parts, 64)
        assert packed.aux_factor.shape == (P, -(-G // per) * per if per > 1 else 0, parts, 64)
    deq = dequantized(qw)
    x_all = rng.standard_normal((LONG, K)).astype(np.float32)
    lowered = jax.jit(lambda x, w: kernels.project("TK,KN->TN", x, w, ON))
    rows = GGUF_ROWS if kind.split("/")[0] in CODECS else ROWS
    with jax.set_mesh(mesh_for("1x1")):
        assert CALLS[kind] in lowered.lower(x_all[:3], packed).as_text()
        assert CALLS[kind] in lowered.lower(x_all, packed).as_text()  # a prompt's rows too
        assert CALLS[kind] not in lowered.lower(x_all[:3], qw).as_text()  # no panels: XLA
        by_kernel = {T: np.asarray(lowered(x_all[:T], packed)) for T in rows}
        by_xla = {T: np.asarray(lowered(x_all[:T], qw)) for T in rows}
    for T in rows:
        x = rounded(x_all[:T]) if kind in A8 else x_all[:T].astype(np.float64)
        want = x @ deq
        atol = 1e-5 * max(1.0, np.abs(want).max())
        np.testing.assert_allclose(by_kernel[T], want, rtol=1e-5, atol=atol)
        np.testing.assert_allclose(by_xla[T], want, rtol=1e-5, atol=atol)
        np.testing.assert_array_equal(by_kernel[T], by_kernel[LONG][:T])
        if kind in A8 and K > 1:  # one input is its own group's max: rounded exactly
            assert np.abs(x_all[:T].astype(np.float64) @ deq - want).max() > 1e-3 * np.abs(want).max()


@needs_kernel
@pytest.mark.parametrize("bits,group,offset", [(8, 32, 128), (4, 16, 8)])
def test_a8_kernel_rounds_activations_half_to_even_per_group(bits, group, offset):
    """The A8 kernel's rounding of x, seen through an identity weight of 8-bit codes (each
    output column is one input times its group's d, exactly): ties go to even (0.5 -> 0,
    2.5 -> 2, -2.5 -> -2, 126.5 -> 126 where the group's max is 127, i.e. d = 1), a group
    of zeros stays zero, values are clamped to +-127, and a short last group (K = 100) is
    rounded like a whole one; each row and group on its own. Against numpy's round (ties to
    even) in float32. 4-bit codes in weight groups of 16 inputs (two per activation group)
    check the codes' sums per weight group, which the offset is taken away with."""
    K = 100
    x = np.random.default_rng(1).standard_normal((5, K)).astype(np.float32) * 3
    x[0, :32] = np.r_[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 3.5, -126.5, np.arange(22) + 0.5]
    x[1, 32:64] = 0.0
    x[2, 64:96] = np.linspace(-7.5, 7.5, 32) * np.float32(1 / 3)
    x[3, 96:] = [5.5, -2.5, 0.5, 2.0]  # the short group: max 5.5, d = 5.5 / 127
    code = (offset + np.eye(K, dtype=np.int32)).astype(np.uint8)  # w = (code - offset) * 1
    w = formats.Grouped(jnp.asarray(code), jnp.ones((-(-K // group), K), jnp.float32), None, (K,), bits=bits,
                        group=group, offset=offset, activations="int8")
    packed = formats.pack_params({"w": w}, {"w": (1, 2)})["w"]
    call = jax.jit(lambda x, w: kernels.project("TK,KN->TN", x, w, ON))
    with jax.set_mesh(mesh_for("1x1")):
        assert CALLS["w8a8"] in call.lower(x, packed).as_text()
        got = {T: np.asarray(call(x[:T], packed)) for T in (1, 3, 5)}
    want = rounded(x).astype(np.float32)
    np.testing.assert_array_equal(got[5], want)
    for T in (1, 3):
        np.testing.assert_array_equal(got[T], want[:T])
    np.testing.assert_array_equal(got[5][0, :10], [127, 0, 2, 2, 0, -2, -2, 126, 4, -126])
    assert not got[5][1, 32:64].any()


def kernel_outputs(text: str, kind: str) -> list[tuple[int, int]]:
    """(rows, columns) of every few-row matmul of `kind` in a lowered program's text."""
    return [(int(m[1]), int(m[2]))
            for m in re.finditer(rf"custom_call @{CALLS[kind]}\(.*-> tensor<(\d+)x(\d+)xf32>", text)]


def as_float(q_lm: model.LM) -> model.LM:
    """The quantized model's own weights, dequantized in float64 numpy, as a float model."""
    is_q = lambda x: isinstance(x, formats.QUANTIZED)  # noqa: E731
    where = lambda w: (w.q if isinstance(w, formats.Int8) else w.code).sharding  # noqa: E731
    params = jax.tree.map(lambda w: jax.device_put(dequantized(w).astype(np.float32), where(w)) if is_q(w)
                          else w, q_lm.params, is_leaf=is_q)
    return dataclasses.replace(q_lm, params=params)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_quantized_model_equals_its_dequantized_float_model(tiny, tied, kind):
    """Prefill (11 tokens), then decode passes of T = 1 and 5, each by the kernel of that
    format where built (checked on the lowered programs), against the float model of
    the dequantized weights with no kernels; every projection, the unembedding and the
    table are quantized. The model's parameter count is the float model's."""
    cfg = dataclasses.replace(tiny.target, tie_embeddings=tied)
    mesh = mesh_for("1x1")
    lm = model.init_lm(cfg, mesh)
    q_lm = lm.quantized(kind)
    fmt = formats.Int8 if kind == "int8" else formats.Grouped
    leaves = jax.tree.leaves(q_lm.params, is_leaf=lambda x: isinstance(x, fmt))
    per_layer = 7 if cfg.ffw == "swiglu" else 6
    assert sum(isinstance(x, fmt) for x in leaves) == cfg.num_layers * per_layer + (1 if tied else 2)
    assert q_lm.num_params == q_lm.packed().num_params == lm.num_params == cfg.num_params
    reference = as_float(q_lm).with_kernels(NONE)
    decoding = q_lm.packed()
    assert (decoding is not q_lm) == kernels.available()
    prompt = 11
    tokens = jax.random.randint(jax.random.key(3), (1, prompt + 6), 0, cfg.vocab_size)
    extend = jax.jit(lambda lm, t, p, c: lm.extend(t, p, c))
    with jax.set_mesh(mesh):
        first = (tokens[:, :prompt], jnp.arange(prompt)[None], kv_cache.init_cache(cfg, 1, 32))

        def check_calls(*args):
            T = args[1].shape[1]
            calls = kernel_outputs(extend.lower(*args).as_text(), kind)
            # Every layer's projections and the logits run the format's kernel, on T rows.
            want = [(T, n) for n in [cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2
                    + [cfg.d_model, cfg.d_ff, cfg.d_model]] * cfg.num_layers + [(T, cfg.vocab_size)]
            assert sorted(calls) == (sorted(want) if kernels.available() else []), (T, calls)
            assert FLOAT_CALL + "(" not in extend.lower(*args).as_text()

        check_calls(decoding, *first)  # the prompt's 11 rows too
        logits = {}
        for name, subject in (("quantized", decoding), ("float", reference)):
            out, cache = extend(subject, *first)
            steps = [out]
            start = prompt
            for T in (1, 5):
                args = (subject, tokens[:, start:start + T], (start + jnp.arange(T))[None], cache)
                if name == "quantized":
                    check_calls(*args)
                out, cache = extend(*args)
                steps.append(out)
                start += T
            logits[name] = np.concatenate([np.asarray(s) for s in steps], axis=1)
    scale = np.abs(logits["float"]).max()
    np.testing.assert_allclose(logits["quantized"], logits["float"], rtol=1e-4, atol=1e-5 * scale)
    # The quantization changed the model (the comparison above is not between equal weights).
    float_logits = np.asarray(jax.jit(model.full_forward)(lm.with_kernels(NONE), tokens[:, :prompt + 6]))
    assert np.abs(float_logits - logits["float"]).max() > 1e-4 * scale


@needs_kernel
@pytest.mark.parametrize("kind", ["w4a8", "w8a8"])
def test_an_a8_model_decodes_by_the_kernel_as_xla_computes_it(tiny, kind):
    """A W4A8 / W8A8 model (tied table; every projection and the logits): prefill (11
    tokens) then decode passes of T = 1 and 5 by the A8 kernel (checked on the lowered
    program: no float or float-activation grouped call left) against the same weights with
    no kernels (XLA: x rounded by `round_activations`, times the dequantized weight, which
    the kernel test checks against numpy). Where the two paths' x differ in a last bit, a
    value on a rounding tie may land one step apart, hence 1e-4 of the largest logit (seen:
    1e-7). The control: the same codes multiplying float activations are 10x further off."""
    cfg = dataclasses.replace(tiny.target, tie_embeddings=True)
    mesh = mesh_for("1x1")
    a8 = model.init_lm(cfg, mesh).quantized(kind)
    assert all(w.activations == "int8" for w in jax.tree.leaves(a8.params, is_leaf=lambda x: isinstance(
        x, formats.Grouped)) if isinstance(w, formats.Grouped))
    tokens = jax.random.randint(jax.random.key(4), (1, 17), 0, cfg.vocab_size)
    extend = jax.jit(lambda lm, t, p, c: lm.extend(t, p, c))

    def logits(lm, check=False):
        out, cache = extend(lm, tokens[:, :11], jnp.arange(11)[None], kv_cache.init_cache(cfg, 1, 32))
        steps, start = [out], 11
        for T in (1, 5):
            args = (lm, tokens[:, start:start + T], (start + jnp.arange(T))[None], cache)
            if check:
                text = extend.lower(*args).as_text()
                per_layer = 7 if cfg.ffw == "swiglu" else 6
                assert len(kernel_outputs(text, kind)) == per_layer * cfg.num_layers + 1
                assert not any(f"@{c}(" in text for c in (FLOAT_CALL, CALLS["int4"]))
            out, cache = extend(*args)
            steps.append(out)
            start += T
        return np.concatenate([np.asarray(s) for s in steps], axis=1)
    with jax.set_mesh(mesh):
        by_kernel = logits(a8.packed(), check=True)
        by_xla = logits(a8.with_kernels(NONE))
        float_x = logits(dataclasses.replace(a8, params=jax.tree.map(
            lambda w: dataclasses.replace(w, activations="float32") if isinstance(w, formats.Grouped) else w,
            a8.params, is_leaf=lambda x: isinstance(x, formats.Grouped))).with_kernels(NONE))
    scale = np.abs(by_xla).max()
    print(f"{kind}: kernel vs XLA {np.abs(by_kernel - by_xla).max() / scale:.2e}, float activations "
          f"{np.abs(float_x - by_xla).max() / scale:.2e} of the largest logit")
    np.testing.assert_allclose(by_kernel, by_xla, rtol=0, atol=1e-4 * scale)
    assert np.abs(float_x - by_xla).max() > 1e-3 * scale


@pytest.mark.parametrize("kind,draft_kind", [pytest.param("int8", "int8", marks=pytest.mark.slow), ("int4", "int4"),
                                             ("w4a8", "w4a8"),
                                             pytest.param("int8", "float", marks=pytest.mark.slow)])
def test_greedy_sps_equals_greedy_ars_on_a_quantized_target(tiny, kind, draft_kind):
    mesh = mesh_for("1x1")
    with jax.set_mesh(mesh):
        target = model.init_lm(tiny.target, mesh).quantized(kind)
        draft = model.init_lm(tiny.draft, mesh)
        draft = draft.quantized(draft_kind) if draft_kind != "float" else draft
        sampling = SamplingConfig(temperature=0.0, lookahead=3, max_new_tokens=20)
        prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
        sps = api.generate(target, draft, prompts, sampling, seed=0)
        ars = api.generate(target, None, prompts, sampling, seed=1)
    assert all(len(t) == 20 for t in ars.tokens)
    assert sps.tokens == ars.tokens


@pytest.mark.parametrize("kind", KINDS)
def test_a_quantized_model_sharded_over_2x4_gives_the_one_device_logits(tiny, kind):
    """On a mesh the codes sit where the float weights did and a grouped weight's scales
    and minimums are split with their columns and groups (not replicated: at 70B they would
    fill a chip); the sharded model's logits are the one-device model's."""
    tokens = jax.random.randint(jax.random.key(5), (2, 9), 0, tiny.target.vocab_size)
    logits = {}
    for name in ("1x1", "2x4"):
        mesh = mesh_for(name)
        lm = model.init_lm(tiny.target, mesh).quantized(kind)
        if name == "2x4" and kind == "int4":
            wq = lm.params["layers"][0]["attn"]["wq"].value
            # [N, G, H] (heads-major): split on the heads, like q's codes
            assert wq.scale.sharding.spec == jax.sharding.PartitionSpec("model", None, None)
        with jax.set_mesh(mesh):
            logits[name] = np.asarray(jax.jit(model.full_forward)(lm.with_kernels(NONE), tokens))
    np.testing.assert_allclose(logits["2x4"], logits["1x1"], rtol=1e-5, atol=1e-5)


# Each instruction set's integer dot product, built on this machine by turning features off
# (a feature the CPU lacks is skipped: its code would not run here).
ISAS = {
    "avx512-vnni": ("", ("avx512f", "avx512_vnni")),
    "avx512bw": ("-mno-avx512vnni", ("avx512f", "avx512bw")),
    "avx2-vnni": ("-mno-avx512f", ("avx2", "avx_vnni")),
    "avx2": ("-mno-avx512f -mno-avxvnni", ("avx2",)),
    "portable": ("-mno-avx512f -mno-avxvnni -mno-avx2 -mno-avx", ()),
}
ISA_ROWS = (*range(1, 9), 13)  # one tile each, then a run of tiles (A8: 4 rows; float, AVX2: 6) and a short one
# The grouped weights: specjax's quantizers, and every GGUF codec's form with float and int8 activations.
ISA_GROUPED = ("int4", "w4a8", "w8a8") + GGUF_FORMS + tuple(t + "/a8" for t in GGUF_FORMS)
GROUPED_FIELDS = ("code", "scale", "low", "scale_factor", "low_factor")
ISA_SCRIPT = f"ROWS = {ISA_ROWS}\nFIELDS = {GROUPED_FIELDS}\n" + """
import sys, numpy as np, jax, jax.numpy as jnp
from specjax.kernels import Kernels, formats, available
assert available()
data = np.load(sys.argv[1])
out = {}
run = jax.jit(lambda x, w: w.project("TK,KN->TN", x, Kernels()))
for kind in sorted({k.split(".")[0] for k in data.files if k.endswith(".meta")}):
    bits, group, offset, int8 = (int(v) for v in data[kind + ".meta"])
    arrays = {f: jnp.asarray(data[f"{kind}.{f}"]) if f"{kind}.{f}" in data.files else None for f in FIELDS}
    w = formats.Grouped(**arrays, out=(arrays["code"].shape[1],), bits=bits, group=group, offset=offset,
                        activations="int8" if int8 else "float32")
    packed = formats.pack_params({"w": w}, {"w": (1, 2)})["w"]
    out[kind] = np.concatenate([np.asarray(run(jnp.asarray(data[kind + ".x"][:T]), packed)) for T in ROWS])
# The float-activation formats without groups: float32 panels and int8 with column scales.
for kind, w in (("f32", formats.pack(jnp.asarray(data["f32_w"]), 1)),
                ("i8", formats.pack_params({"w": formats.Int8(jnp.asarray(data["i8_q"]), jnp.asarray(data["i8_scale"]),
                                                              (data["i8_scale"].shape[0],))}, {"w": (1, 2)})["w"])):
    run = jax.jit(lambda x, w: w.project("TK,KN->TN", x, Kernels()))
    out[kind] = np.concatenate([np.asarray(run(jnp.asarray(data["x"][:T]), w)) for T in ROWS])
np.savez(sys.argv[2], **out)
"""


def cpu_flags() -> set[str]:
    try:
        return {f for line in open("/proc/cpuinfo") if line.startswith("flags") for f in line.split(":")[1].split()}
    except OSError:
        return set()


@needs_kernel
@pytest.mark.slow  # a build of the kernels per instruction set (~30 s each)
@pytest.mark.parametrize("isa", sorted(ISAS))
def test_every_instruction_sets_matmul_kernels_match_float64(isa, tmp_path):
    """The few-row matmul's formats (float32, int8, and every grouped form: specjax's int4
    and 8-bit groups, each GGUF codec's bits, groups, offsets and two-level scales, with
    float and int8 activations) compiled for each instruction set this CPU has (VNNI's byte
    dot products, AVX-512BW / AVX2 pair sums and bit-plane expansions, plain integer
    vectors; AVX2's register-sized tiles for a run of rows), in a fresh process with
    SPECJAX_KERNEL_FLAGS, against numpy: x (rounded for A8) @ the dequantized weight,
    T = 1..8 and 13, K = 100 (a short last group; the K-quants' forms 512), N = 150 (a
    partial panel)."""
    import platform
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"the flags name x86 features; this is {platform.machine()}")
    extra, needs = ISAS[isa]
    if not set(needs) <= cpu_flags():
        pytest.skip(f"this CPU lacks {sorted(set(needs) - cpu_flags())}")
    import os
    import subprocess
    import sys
    rng = np.random.default_rng(7)
    K, N = 100, 150  # a short last group, a partial panel; the K-quants' forms: two super-blocks of 256
    data = dict(x=rng.standard_normal((max(ISA_ROWS), K)).astype(np.float32) * 2,
                f32_w=rng.standard_normal((K, N)).astype(np.float32) / 10,
                i8_q=rng.integers(-128, 128, (K, N)).astype(np.int8),
                i8_scale=rng.uniform(0.5, 1.5, N).astype(np.float32) / 100)
    weights = {}
    for kind in ISA_GROUPED:
        k = 512 if kind.split("/")[0] in CODECS and CODECS[kind.split("/")[0]].per > 1 else K
        weights[kind] = w = quantize(kind, rng.standard_normal((k, N)).astype(np.float32) / 10)
        name = kind.replace("/", "-")
        data[name + ".meta"] = np.array([w.bits, w.group, w.offset, w.activations == "int8"])
        data[name + ".x"] = rng.standard_normal((max(ISA_ROWS), k)).astype(np.float32) * 2
        data.update({f"{name}.{f}": np.asarray(getattr(w, f)) for f in GROUPED_FIELDS if getattr(w, f) is not None})
    np.savez(tmp_path / "in.npz", **data)
    env = {**os.environ, "SPECJAX_KERNEL_FLAGS": extra, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    done = subprocess.run([sys.executable, "-c", ISA_SCRIPT, str(tmp_path / "in.npz"), str(tmp_path / "out.npz")],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    got = np.load(tmp_path / "out.npz")
    ends = np.cumsum(ISA_ROWS)
    for kind, w in weights.items():
        deq, x_all = dequantized(w), data[kind.replace("/", "-") + ".x"]
        for T, end in zip(ISA_ROWS, ends):
            x = rounded(x_all[:T]) if w.activations == "int8" else x_all[:T].astype(np.float64)
            rows = got[kind.replace("/", "-")][end - T:end]
            np.testing.assert_allclose(rows, x @ deq, rtol=1e-5, atol=1e-5 * np.abs(x @ deq).max(), err_msg=kind)
    for kind, w in (("f32", data["f32_w"].astype(np.float64)),
                    ("i8", data["i8_q"].astype(np.float64) * data["i8_scale"])):
        want = data["x"][:max(ISA_ROWS)].astype(np.float64) @ w
        for T, end in zip(ISA_ROWS, ends):
            np.testing.assert_allclose(got[kind][end - T:end], want[:T], rtol=1e-5, atol=1e-5 * np.abs(want).max(),
                                       err_msg=kind)


@pytest.mark.parametrize("kind", ["float32", "int8", "int4", "w4a8", "w8a8"])
def test_a_heads_major_projection_is_quantized_per_head_column_and_packed_with_heads_among_columns(kind):
    """q, k, v are [*layers, N, D, H] (heads-major: the contracted axis after the heads).
    Quantized (`quantize_params` with `model.PROJECTIONS`' entry), each output column (n, h)
    gets its own scale ([*layers, N, H]; grouped: [*layers, N, G, H]); packed (`pack_params`),
    the panels hold the [D, N*H] matrix, so H = 24 heads share panels of 64 columns. Each
    layer's "BTD,NDH->BTNH", by the kernel and by XLA, is float64 numpy's over the weight
    dequantized from its own arrays (int8 activations: x rounded as the A8 formats do)."""
    rng = np.random.default_rng(7)
    L, N, D, H = 2, 3, 64, 24
    w = rng.standard_normal((L, N, D, H)).astype(np.float32) * D ** -0.5
    params = {"layers": {"wq": jnp.asarray(w)}}
    entry = {"wq": model.PROJECTIONS["wq"]}
    assert entry["wq"] == (1, 3, 1)
    quantized = params if kind == "float32" else formats.quantize_params(params, entry, (), kind)
    qw = quantized["layers"]["wq"]
    if kind == "int8":
        q_ref, s_ref = quantize_reference(w, (2,))
        assert qw.scale.shape == (L, N, H)
        np.testing.assert_array_equal(np.asarray(qw.q), q_ref)
        np.testing.assert_allclose(np.asarray(qw.scale), s_ref[:, :, 0], rtol=1e-6)
    elif kind != "float32":
        assert qw.scale.shape == (L, N, D // 32, H) and qw.heads == 1
    stored = w.astype(np.float64) if kind == "float32" else dequantized(qw)
    assert np.abs(stored - w).max() < 0.1  # the weight itself, per head
    packed = formats.pack_params(quantized, entry)["layers"]["wq"]
    x = jnp.asarray(rng.standard_normal((2, 3, D)).astype(np.float32))
    xr = np.asarray(dispatch_round(x) if kind in ("w4a8", "w8a8") else x, np.float64)
    call = FLOAT_CALL if kind == "float32" else CALLS[kind]
    with jax.set_mesh(mesh_for("1x1")):
        for layer in range(L):
            want = np.einsum("btd,ndh->btnh", xr, stored[layer])
            one = jax.tree.map(lambda a: a[layer], packed)
            for setting in (ON, NONE):
                fn = jax.jit(lambda x, w: kernels.project("BTD,NDH->BTNH", x, w, setting))
                if setting is ON and kernels.available():
                    assert call in fn.lower(x, one).as_text()
                np.testing.assert_allclose(np.asarray(fn(x, one)), want, rtol=2e-5, atol=2e-5)


def dispatch_round(x):
    from specjax.kernels import dispatch
    return dispatch.round_activations(x)
