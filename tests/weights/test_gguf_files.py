"""GGUF files as they arrive: another byte order, damaged tensor tables, other versions,
paths that are not files, a norm stored in a block type. The edited files are the
committed fixtures changed by the gguf package itself (its writer, its reader opened for
writing, its byte-order converter gguf_convert_endian.py) or by struct writes
(tests/helpers/gguf_edit.py); references are the gguf package's own reading of a file,
or the transformers logits committed beside each fixture.

- A big-endian file (as the package's converter makes it) loads as the same model:
  every tensor's values equal the package reader's (float types) or the little-endian
  original's (Q8_0, Q4_0, Q4_K and Q6_K blocks, whose float16 scales the converter swaps;
  llama.cpp's Q4_K_M fixture), and the
  logits equal transformers' on the original; a big-endian file with a type whose blocks
  we cannot swap is refused.
- A tensor table that is misaligned, overlapping or out of order is refused ("damaged
  GGUF"), as llama.cpp's loader refuses it; so are versions other than 2 and 3, named
  pipes and empty paths, each in one line.
"""
from __future__ import annotations

import os

import jax
import numpy as np
import pytest

from specjax import kernels
from specjax.config import UsageError
from specjax.weights import gguf, hf
from conftest import mesh_for
from gguf_edit import (FIXTURES, big_endian, fixture, move_tensor, named_pipe, rewrite, set_version, tensor_offsets,
                       write_big_endian_as_is)
from models import logits_of

import gguf as gguf_package

ATOL = 4e-5  # as tests/weights/test_gguf.py


def refused(path, *fragments) -> str:
    with pytest.raises(UsageError) as err:
        info = gguf.read_config(path)
        gguf.tokenizer(path)
        gguf.check_weights(path, info.model)
    message = str(err.value)
    assert "\n" not in message and all(f in message for f in fragments), message
    return message


# ------------------------------------------------------------------ byte order


BIG = ["bpe_F32", "bpe_F16", "bpe_BF16", "bpe_Q8_0", "bpe_Q4_0", "spm_Q4_0", "llama_tp_Q8_0", "kq_Q4_K_M"]


@pytest.mark.parametrize("name", BIG)
def test_a_big_endian_file_holds_the_same_tensors(tmp_path, name):
    """Each tensor of the converted file as stored: the gguf package reader's values of that
    file for F32 and F16 (its dtype carries the byte order); the little-endian original's
    for every type, as values (GGUFWeights.read), as Blocks' codes and scales, and as the
    scale bytes alone (`block_scales`, what --quantize reads)."""
    path = big_endian(fixture(name), tmp_path / f"{name}_be.gguf")
    package = {t.name: t for t in gguf_package.GGUFReader(path).tensors}
    f = gguf.open_file(path)
    assert f.big_endian and not gguf.open_file(fixture(name)).big_endian
    cfg = gguf.read_config(path).model
    assert cfg == gguf.read_config(fixture(name)).model
    be, le = gguf.GGUFWeights(f, cfg), gguf.GGUFWeights(gguf.open_file(fixture(name)), cfg)
    for hf_name, shape in hf.expected_tensors(cfg).items():
        t = package[gguf.gguf_name(hf_name)]
        if t.tensor_type.name in ("F32", "F16"):
            rows, cols = (1, shape[0]) if len(shape) == 1 else shape
            stored = gguf.decode(t.tensor_type.name, f.raw(t.name, slice(0, rows), slice(0, cols))[0])
            np.testing.assert_array_equal(stored.reshape(t.data.shape), np.array(t.data), err_msg=t.name)
        np.testing.assert_array_equal(be.read(hf_name), le.read(hf_name), err_msg=hf_name)
        if len(shape) == 2 and t.tensor_type.name in gguf.LOSSLESS_TYPES:
            block = gguf.CODECS[t.tensor_type.name].block
            index = (slice(0, shape[0]), slice(0, shape[1] // block))
            for a, b in ((be.tensor(hf_name), le.tensor(hf_name)),
                         (be.block_scales(hf_name, index), le.block_scales(hf_name, index))):
                for field in a.FIELDS:
                    np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)


@pytest.mark.parametrize("name", ["bpe_BF16", "spm_Q4_0"])
def test_a_big_endian_file_gives_transformers_logits(tmp_path, name):
    """End to end, as stored and with --quantize (the blocks kept as stored)."""
    ref = np.load(FIXTURES / f"{name}.npz")
    path = big_endian(fixture(name), tmp_path / f"{name}_be.gguf")
    lm, tok = gguf.load(path, mesh_for("1x1"), param_dtype="float32")
    np.testing.assert_allclose(logits_of(lm, ref["input_ids"]), ref["logits"], rtol=0, atol=ATOL)
    assert tok.vocabulary() == gguf.tokenizer(fixture(name)).vocabulary() and tok.bos_id == gguf.tokenizer(
        fixture(name)).bos_id
    if name == "spm_Q4_0":
        stored, _ = gguf.load(path, mesh_for("1x1"), param_dtype="float32", quantize="int4")
        original, _ = gguf.load(fixture(name), mesh_for("1x1"), param_dtype="float32", quantize="int4")
        is_q = lambda x: isinstance(x, kernels.Grouped)  # noqa: E731
        a, b = jax.tree.leaves(stored.params, is_leaf=is_q), jax.tree.leaves(original.params, is_leaf=is_q)
        assert sum(map(is_q, a)) > 0
        for x, y in zip(a, b):
            for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y)):
                np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_a_big_endian_file_with_a_type_it_cannot_swap_is_refused(tmp_path):
    """Q4_1's two float16 fields: the package's converter refuses the type, so no file
    says which byte order they hold."""
    path = write_big_endian_as_is(fixture("bpe_Q4_1"), tmp_path / "q4_1_be.gguf")
    refused(path, "a big-endian GGUF file with Q4_1 tensors", "big-endian files are read for F32, F16, BF16")


# ------------------------------------------------------------------ damaged tensor tables


def test_a_misaligned_tensor_is_refused(tmp_path):
    offsets = tensor_offsets(fixture("bpe_Q8_0"))
    path = move_tensor(fixture("bpe_Q8_0"), tmp_path / "a.gguf", "blk.0.ffn_up.weight",
                       offsets["blk.0.ffn_up.weight"] + 4)
    refused(path, "damaged GGUF: tensor blk.0.ffn_up.weight starts at data offset",
            "not a multiple of general.alignment=32")


def test_overlapping_tensors_are_refused(tmp_path):
    offsets = tensor_offsets(fixture("bpe_Q8_0"))
    path = move_tensor(fixture("bpe_Q8_0"), tmp_path / "a.gguf", "blk.1.attn_q.weight", offsets["blk.0.attn_q.weight"])
    refused(path, "damaged GGUF: tensors blk.0.attn_q.weight and blk.1.attn_q.weight overlap")


def test_tensors_out_of_table_order_are_refused(tmp_path):
    """k and v of one layer (same size) trade places: nothing overlaps, but the table no
    longer lists the tensors in the order their bytes lie (llama.cpp refuses it; read by
    offset it would be the model with k and v swapped)."""
    offsets = tensor_offsets(fixture("bpe_F32"))
    move_tensor(fixture("bpe_F32"), tmp_path / "a.gguf", "blk.0.attn_k.weight", offsets["blk.0.attn_v.weight"])
    path = move_tensor(tmp_path / "a.gguf", tmp_path / "b.gguf", "blk.0.attn_v.weight", offsets["blk.0.attn_k.weight"])
    refused(path, f"damaged GGUF: tensor blk.0.attn_k.weight starts at data offset {offsets['blk.0.attn_v.weight']}, "
                  "but blk.0.attn_q.weight ends at")


# ------------------------------------------------------------------ versions, paths, types


@pytest.mark.parametrize("version", [1, 4, 0, 65535])
def test_an_unsupported_version_is_named(tmp_path, version):
    path = tmp_path / "v.gguf"
    path.write_bytes(fixture("bpe_F32").read_bytes())
    set_version(path, version)
    refused(path, f"GGUF version {version} is not supported; supported: 2, 3")


def test_version_2_is_read(tmp_path):
    path = tmp_path / "v2.gguf"
    path.write_bytes(fixture("bpe_F32").read_bytes())
    set_version(path, 2)
    assert gguf.read_config(path).model == gguf.read_config(fixture("bpe_F32")).model


def test_a_named_pipe_is_refused_without_waiting_for_a_writer(tmp_path):
    """A writer that appears while the reader waits would feed it garbage: the reader must
    not open the pipe at all."""
    pipe = named_pipe(tmp_path / "model.gguf")
    refused(pipe, f"{pipe}: is a named pipe, not a GGUF file")


@pytest.mark.parametrize("text", ["", "  "])
def test_an_empty_path_is_not_the_working_directory(text):
    with pytest.raises(UsageError) as err:
        gguf.read_config(text)
    assert "empty path" in str(err.value) and os.getcwd() not in str(err.value)


def test_a_norm_stored_in_a_block_type_loads_as_its_values(tmp_path):
    """blk.0.attn_norm.weight as Q8_0 (the package's quantizer): the model equals the F32
    file whose norm holds the package's dequantization of those blocks."""
    quantized = rewrite(fixture("bpe_F32"), tmp_path / "q.gguf", types={"blk.0.attn_norm.weight": "Q8_0"})
    values = rewrite(quantized, tmp_path / "f.gguf", types={"blk.0.attn_norm.weight": "F32"})
    assert gguf.open_file(quantized).type_name("blk.0.attn_norm.weight") == "Q8_0"
    ids = np.load(FIXTURES / "bpe_F32.npz")["input_ids"]
    a, _ = gguf.load(quantized, mesh_for("1x1"))
    b, _ = gguf.load(values, mesh_for("1x1"))
    np.testing.assert_array_equal(logits_of(a, ids), logits_of(b, ids))
