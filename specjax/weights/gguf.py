"""GGUF files (llama.cpp's format): import a model of the families `weights/arch/` reads
(`general.architecture` `llama`, `qwen2`, `qwen3`, `gemma3`) as a sharded `LM`, with the
tokenizer its metadata describes.

Read with the `gguf` package (the format's own reader, memory-mapped). The file holds the
model's hyperparameters as `{arch}.*` metadata, the tokenizer as `tokenizer.ggml.*`
metadata (every key read with its type through `gguf_meta.Metadata`), and the tensors
under llama.cpp's names, each in its GGML type (in a big-endian file, byte-swapped as
read: `GGUFFile._little_endian`). What every family shares (sizes, heads, context, rotary
base and scaling, tied output) is read here; what is the family's (its feed-forward and
norms, biases, windows, query scale; its tensor names `Tensor.gguf`; whether q and k rows
are permuted; Gemma's tokenizer pipeline) is its module's (`from_gguf`, `TENSORS`,
`GGUF_PERMUTED_QK`, `gguf_tokenizer`). Llama's, for example:

    token_embd.weight        [V, D]   -> embed            output_norm.weight -> final_norm.scale
    output.weight            [V, D]   -> unembed (absent: tied to token_embd)
    blk.{i}.attn_norm.weight          -> layers[i].attn_norm.scale
    blk.{i}.attn_q / attn_k / attn_v  -> attn.wq / wk / wv   (q, k rows un-permuted, below)
    blk.{i}.attn_output               -> attn.wo
    blk.{i}.ffn_norm.weight           -> layers[i].ffw_norm.scale
    blk.{i}.ffn_gate / ffn_up / ffn_down -> ffw.w_gate / w_in / w_out
    rope_freqs.weight        [H/2]    Llama 3.1's rotary scaling, as per-frequency divisors

A 2-D tensor's numpy shape is [out, in] with GGML's blocks running along `in` (the
input dimension of every projection), which is exactly transformers' nn.Linear layout,
so each tensor is read as the Hugging Face tensor of the same role and handed to
`hf.load_params`: one loading path for both formats. Each device's slice is read from
the memory map by rows and by whole blocks (`GGUFWeights.read`), so no host reads a
whole tensor it does not hold.

For `llama` files llama.cpp's converter permutes the rows of q and k within each head, from the
rotate-half pairs (i, i + H/2) that transformers' Llama rotates to the adjacent pairs
(2i, 2i + 1) its own rotary kernel rotates; `unpermute` undoes it exactly (transformers'
GGUF loader does the same), on raw blocks as well, since it only reorders rows.

Types. F32, F16 and BF16 are floats. Every type with a codec (`gguf_codecs.CODECS`: Q8_0,
Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants Q2_K..Q6_K) is unpacked into integer codes with
their scales (`Blocks`), the form a quantized weight keeps (`stored_maker`, with
`--quantize`); without it the model dequantizes them to its float param_dtype, exactly.
Every other type the `gguf` package can dequantize (the IQ types, ...) is dequantized to
the compute dtype, which is said once on stderr. Only local files: the reader memory-maps
them.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import mmap
import os
import re
import sys
from typing import Optional, Union

import ml_dtypes
import numpy as np

from specjax.config import ConfigError, ModelConfig, UsageError
from specjax.weights import arch, hf, hf_files
from specjax.weights.arch.common import LLAMA, Tensor
from specjax.weights.gguf_meta import BOOL, INT, INTS, NUMBER, NUMBERS, TEXT, TEXTS, Metadata
from specjax.weights.gguf_codecs import CODECS, Blocks, unpack
from specjax.weights.tokenizer import HFTokenizer

FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
LOSSLESS_TYPES = tuple(CODECS)  # kept as stored, value for value (`gguf_codecs`)

# Tensors a file may hold that are not weights of the model (recomputed or folded in).
KNOWN_EXTRA = ("rope_freqs.weight",)
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def gguf_name(hf_name: str, tensors: dict[str, Tensor] = LLAMA) -> str:
    """llama.cpp's name of the tensor that transformers calls `hf_name`, in a family's
    `tensors` (`weights/arch/`)."""
    m = _LAYER.fullmatch(hf_name)
    template = f"model.layers.{{i}}.{m[2]}" if m else hf_name
    found = next(t.gguf for t in tensors.values() if t.hf == template)
    return found.format(i=m[1]) if m else found


def _gguf():
    try:
        import gguf
    except ImportError:  # pragma: no cover (a dependency; a broken install)
        raise UsageError("reading GGUF files needs the `gguf` package: pip install gguf") from None
    return gguf


# --------------------------------------------------------------------------- blocks


def decode(type_name: str, raw: np.ndarray) -> Union[np.ndarray, Blocks]:
    """A [rows, bytes] uint8 slice of whole blocks as values: a float array for the float
    types, `Blocks` for the types with a codec, float32 for every other type."""
    if type_name == "F32":
        return raw.view(np.float32)
    if type_name == "F16":
        return raw.view(np.float16)
    if type_name == "BF16":
        return raw.view(ml_dtypes.bfloat16)
    if type_name == "F64":
        return raw.view(np.float64).astype(np.float32)
    if type_name in CODECS:
        return unpack(type_name, raw)
    gguf = _gguf()
    return gguf.quants.dequantize(np.ascontiguousarray(raw), gguf.GGMLQuantizationType[type_name])


def as_float(x: Union[np.ndarray, Blocks]) -> np.ndarray:
    return x.dequantize() if isinstance(x, Blocks) else x


def unpermute(x, heads: int):
    """The rows of llama.cpp's q (heads = query heads) or k (heads = kv heads) in
    transformers' order: within each head, row 2i + j goes to j * H/2 + i."""
    if isinstance(x, Blocks):
        order = unpermute(np.arange(x.shape[0]), heads)
        return x.rows(order)
    rows = x.shape[0]
    return x.reshape(heads, rows // heads // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


# --------------------------------------------------------------------------- the file


class _Reader:
    """gguf.GGUFReader, whose per-field reads go through a plain ndarray view of its
    memory map: np.memmap's bookkeeping on each of the ~250k small slices of a 49k-token
    vocabulary dominated the parse. Same results (the tests compare it with the stock
    reader)."""

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def cls():
        gguf = _gguf()

        class Reader(gguf.GGUFReader):
            def _get(self, offset, dtype, count=1, override_order=None):
                plain = self.__dict__.get("_plain")
                if plain is None:
                    plain = self._plain = self.data.view(np.ndarray)
                count = int(count)
                arr = plain[offset:offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
                return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

        return Reader


SUPPORTED_VERSIONS = (2, 3)  # the gguf package's reader's, and llama.cpp's
# The 2-byte float16 fields inside each block of a type, which a big-endian file stores
# big-endian (`Codec.big_endian`: what gguf_convert_endian.py, the gguf package's byte-order
# converter, swaps); the float types are swapped element by element. Other types are refused
# in such a file.
BIG_ENDIAN_HALVES = {t: c.big_endian for t, c in CODECS.items() if c.big_endian is not None}
_FLOAT_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}


class GGUFFile:
    """One GGUF file's metadata and tensors (the reader's memory map; nothing read yet).
    Refused in one line: anything but a local regular file in GGUF versions 2 or 3, a
    damaged header or tensor table, a big-endian file holding a type it cannot swap."""

    def __init__(self, path):
        text = os.fspath(path)
        if not text.strip():
            raise UsageError(f"{text!r}: an empty path, not a GGUF file")
        if "://" in text:
            raise UsageError(f"{text}: GGUF files are read from local disk (memory-mapped); copy it to this machine")
        self.path = os.path.abspath(os.path.expanduser(text))
        if os.path.isdir(self.path):
            raise UsageError(f"{self.path} is a directory, not a GGUF file (for a Hugging Face directory use "
                             "--hf_target / --hf_draft)")
        if not os.path.exists(self.path):
            raise UsageError(f"{self.path}: no such file")
        what = hf_files.special_file(os.stat(self.path).st_mode)
        if what is not None:  # opening a pipe waits for a writer; a device never ends
            raise UsageError(f"{self.path}: is {what}, not a GGUF file (GGUF files are memory-mapped from disk)")
        with open(self.path, "rb") as f:
            head = f.read(8)
        if head[:4] != b"GGUF":
            raise UsageError(f"{self.path}: not a GGUF file (it starts with {head[:4]!r}, not b'GGUF')")
        if len(head) == 8:
            version = int.from_bytes(head[4:], "little")
            if version & 0xFFFF == 0 and version:  # a big-endian file (as the gguf reader decides)
                version = int.from_bytes(head[4:], "big")
            if version not in SUPPORTED_VERSIONS:
                raise UsageError(f"{self.path}: GGUF version {version} is not supported; supported: "
                                 f"{', '.join(map(str, SUPPORTED_VERSIONS))} (llama.cpp's converter writes 3)")
        try:
            self.reader = _Reader.cls()(self.path)
        except Exception as e:  # noqa: BLE001 (a damaged or cut file fails anywhere inside the reader)
            raise UsageError(f"{self.path}: damaged or truncated GGUF file ({type(e).__name__}: "
                             f"{str(e).splitlines()[0][:200] if str(e) else 'unreadable header'})") from None
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.meta = Metadata(self.reader.fields, self.path)
        self.big_endian = self.reader.byte_order == "S"  # the reader swaps the header and metadata for us
        self._check_table()
        self.bytes_read = 0

    def _check_table(self) -> None:
        """llama.cpp's rule for the tensor table: each tensor starts where the one before it
        ends, padded to general.alignment, in table order (so none overlaps another, none is
        misaligned); and in a big-endian file, only types whose byte order we can swap."""
        align, end, before = int(self.reader.alignment), 0, None
        for t in self.reader.tensors:
            offset = int(t.field.parts[-1][0])
            if offset % align:
                raise UsageError(f"{self.path}: damaged GGUF: tensor {t.name} starts at data offset {offset}, not a "
                                 f"multiple of general.alignment={align}")
        spans = sorted((int(t.field.parts[-1][0]), int(t.n_bytes), t.name) for t in self.reader.tensors)
        for (a, n, first), (b, _, second) in zip(spans, spans[1:]):
            if b < a + n:
                raise UsageError(f"{self.path}: damaged GGUF: tensors {first} and {second} overlap (data offsets "
                                 f"{a}..{a + n} and {b}..)")
        for t in self.reader.tensors:
            offset = int(t.field.parts[-1][0])
            if offset != end:
                raise UsageError(f"{self.path}: damaged GGUF: tensor {t.name} starts at data offset {offset}, but "
                                 + (f"{before} ends at {end}" if before else "the first tensor starts at 0")
                                 + " (tensors lie back to back in table order, each padded to general.alignment)")
            end, before = offset + -(-int(t.n_bytes) // align) * align, t.name
        if self.big_endian:
            for t in self.reader.tensors:
                name = t.tensor_type.name
                if name not in _FLOAT_BYTES and name not in BIG_ENDIAN_HALVES:
                    raise UsageError(f"{self.path}: a big-endian GGUF file with {name} tensors ({t.name}); big-endian "
                                     f"files are read for {', '.join([*_FLOAT_BYTES, *BIG_ENDIAN_HALVES])} only")

    def _little_endian(self, type_name: str, raw: np.ndarray) -> np.ndarray:
        """`raw` ([rows, bytes] of whole elements or blocks, or [rows, blocks, head bytes]),
        byte-swapped in place into little-endian order if the file is big-endian."""
        if not self.big_endian:
            return raw
        if type_name in _FLOAT_BYTES:
            raw.view(f"u{_FLOAT_BYTES[type_name]}").byteswap(inplace=True)
            return raw
        _, size = _gguf().GGML_QUANT_SIZES[_gguf().GGMLQuantizationType[type_name]]
        blocks = raw if raw.ndim == 3 else raw.reshape(raw.shape[0], -1, size)
        for at in BIG_ENDIAN_HALVES[type_name]:
            if at + 2 <= blocks.shape[-1]:
                blocks[..., at:at + 2] = blocks[..., at:at + 2][..., ::-1].copy()
        return raw

    def type_name(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def shape(self, name: str) -> tuple[int, ...]:
        """numpy order: [out, in] for a matrix (ggml lists its dimensions innermost first)."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape.tolist()))

    def raw(self, name: str, rows: slice, cols: slice) -> tuple[np.ndarray, slice]:
        """The bytes of rows `rows` and of the whole blocks covering columns `cols` of a
        2-D tensor (a 1-D one is one row), copied out of the memory map; and where
        `cols` lies within the values of those blocks."""
        t = self.tensors[name]
        gguf = _gguf()
        block, size = gguf.GGML_QUANT_SIZES[t.tensor_type]
        data = t.data if t.data.ndim == 2 else t.data.reshape(1, -1)
        data = data.view(np.uint8)
        first, last = cols.start // block, -(-cols.stop // block)
        out = self._little_endian(t.tensor_type.name, np.array(data[rows, first * size:last * size]))
        self.bytes_read += out.nbytes
        self._release(t)
        return out, slice(cols.start - first * block, cols.stop - first * block)

    def block_heads(self, name: str, rows: slice, blocks: slice) -> np.ndarray:
        """Blocks `blocks` of rows `rows` of a tensor whose type has a codec, [rows, blocks,
        bytes] uint8, with only the leading bytes that hold the blocks' scales copied out of
        the memory map (`Codec.head`; the rest zeros), counted in `bytes_read` as those
        bytes alone; a type whose scales are spread over its blocks is read whole."""
        t = self.tensors[name]
        _, size = _gguf().GGML_QUANT_SIZES[t.tensor_type]
        head = CODECS[self.type_name(name)].head or size
        data = t.data.view(np.uint8)
        blocks_of = data.reshape(data.shape[0], -1, size)[rows, blocks]
        out = np.zeros(blocks_of.shape, np.uint8)
        out[..., :head] = self._little_endian(t.tensor_type.name, np.array(blocks_of[..., :head]))
        self.bytes_read += head * math.prod(blocks_of.shape[:-1])
        self._release(t)
        return out

    def _release(self, t) -> None:
        """Drop the tensor's mapped pages from this process (the page cache keeps them),
        as the safetensors reader does: a load's peak RSS stays its slices."""
        m = getattr(self.reader.data, "_mmap", None)
        if not isinstance(m, mmap.mmap):
            return
        start = t.data_offset - t.data_offset % mmap.PAGESIZE
        try:
            m.madvise(mmap.MADV_DONTNEED, start, min(len(m), t.data_offset + t.n_bytes) - start)
        except (AttributeError, OSError, ValueError):
            pass


@functools.lru_cache(maxsize=8)
def _open(path: str, size: int, mtime: int) -> GGUFFile:
    return GGUFFile(path)


def open_file(path) -> GGUFFile:
    """The file, parsed once per process (config, tokenizer and weights read the same
    metadata, and a large vocabulary takes seconds to parse)."""
    given = os.fspath(path)
    if "://" in given or not given.strip():
        return GGUFFile(given)  # says what is wrong
    text = os.path.abspath(os.path.expanduser(given))
    try:
        st = os.stat(text)
    except OSError:
        return GGUFFile(text)  # says what is wrong
    return _open(text, st.st_size, st.st_mtime_ns)


# --------------------------------------------------------------------------- config


PER_LAYER = INT.layered()  # keys llama.cpp reads as one value or one per layer
_BLOCK = re.compile(r"blk\.([0-9]+)\.")


def _llama3_scaling(f: GGUFFile, theta: float, head_dim: int, context: int) -> dict:
    """ModelConfig's llama3 rope fields reproducing `rope_freqs.weight`, the divisor of
    each rotary frequency that llama.cpp's converter writes for rope_type llama3 (long
    wavelengths divided by the factor, short ones kept, a linear blend of 1/divisor in
    between). Llama 3.1/3.2's own values (low 1, high 4, original 8192) when they
    reproduce it; else the band edges fitted to it (only where they fall relative to the
    frequencies, and the blend's line, matter). Refused when nothing reproduces it."""
    name = "rope_freqs.weight"
    if f.shape(name) != (head_dim // 2,) or f.type_name(name) not in FLOAT_TYPES:
        raise UsageError(f"{f.path}: {name} has shape {list(f.shape(name))} and type {f.type_name(name)}, "
                         f"expected [{head_dim // 2}] floats")
    divisors = as_float(decode(f.type_name(name), f.raw(name, slice(0, 1), slice(0, head_dim // 2))[0]))
    divisors = divisors.reshape(-1).astype(np.float64)
    if np.all(divisors == 1):
        return {}
    half = head_dim // 2
    inv = theta ** (-np.arange(half, dtype=np.float64) / half)
    wanted = (inv / divisors).astype(np.float32)
    factor = float(divisors.max())
    base = dict(rope_scaling="llama3", rope_scaling_factor=factor)

    def fits(low, high, old) -> Optional[dict]:
        fields = dict(base, rope_low_freq_factor=float(low), rope_high_freq_factor=float(high),
                      rope_original_max_len=int(old))
        if not 0 < low < high:
            return None
        from specjax.model import rope_frequencies
        cfg = ModelConfig(head_dim=head_dim, rope_theta=theta, **fields)
        return fields if np.allclose(rope_frequencies(cfg), wanted, rtol=1e-5, atol=0) else None

    originals = [8192, f.meta.get("{arch}.rope.scaling.original_context_length", INT, context), context]
    for old in originals:
        if fields := fits(1.0, 4.0, old):
            return fields
    old = originals[1]
    x = old * inv / (2 * np.pi)  # original_max_len / wavelength: kept above high, divided below low
    kept, scaled = np.isclose(divisors, 1, rtol=1e-6), np.isclose(divisors, factor, rtol=1e-6)
    blend = ~(kept | scaled)
    # In the blend, 1/divisor = (1 - s)/factor + s with s = (x - low) / (high - low).
    s = (1 / divisors[blend] - 1 / factor) / (1 - 1 / factor)
    floor = x[scaled].max() if scaled.any() else 0.0  # low must lie above every divided frequency's x
    ceiling = x[kept].min() if kept.any() else math.inf  # and high below every kept one's
    if blend.sum() >= 2:
        slope, intercept = np.polyfit(x[blend], s, 1)
        low, high = -intercept / slope, (1 - intercept) / slope
    elif blend.sum() == 1:
        x0, s0 = x[blend][0], s[0]
        low = (floor + x0) / 2
        high = low + (x0 - low) / s0
    else:
        low = floor * 1.01 if floor else (ceiling / 2 if math.isfinite(ceiling) else 1.0)
        high = (low + ceiling) / 2 if math.isfinite(ceiling) else 2 * low
    if fields := fits(low, high, old):
        return fields
    raise UsageError(f"{f.path}: {name} (rotary frequency divisors {np.round(divisors, 4).tolist()[:8]}...) does not "
                     "follow Llama 3.1's frequency scaling, the only rotary scaling supported")


def read_config(path, *, param_dtype: Optional[str] = None, compute_dtype: Optional[str] = None,
                scan_layers: bool = False) -> hf.HFModel:
    """The file's model and generation ids, from its metadata (no tensor data read);
    refuses what specjax's model cannot compute exactly, naming the key. dtypes default
    to float16 / bfloat16 when every matrix is stored so, else float32."""
    f = open_file(path)
    m = f.meta
    family = arch.for_gguf(m.arch, f.path)
    if "token_embd.weight" not in f.tensors:
        raise UsageError(f"{f.path}: tensor token_embd.weight is missing")
    V, D = f.shape("token_embd.weight") if len(f.shape("token_embd.weight")) == 2 else (0, 0)
    layers = m.get("{arch}.block_count", INT)
    # Against the tensor table before anything counts layers: a wrong count must not make
    # a billion tensor names.
    blocks = {int(b[1]) for n in f.tensors if (b := _BLOCK.match(n))}
    if layers != len(blocks) or (blocks and max(blocks) != layers - 1):
        raise m.refuse("{arch}.block_count", layers, f"the tensor table holds {len(blocks)} blocks"
                       + (f" (blk.{min(blocks)} .. blk.{max(blocks)})" if blocks else ""))
    d_model = m.get("{arch}.embedding_length", INT)
    heads = m.get("{arch}.attention.head_count", PER_LAYER)
    if heads < 1:
        raise m.refuse("{arch}.attention.head_count", heads, "must be at least 1")
    kv_heads = m.get("{arch}.attention.head_count_kv", PER_LAYER, heads)
    if kv_heads < 1:
        raise m.refuse("{arch}.attention.head_count_kv", kv_heads, "must be at least 1")
    if "{arch}.attention.key_length" not in m and d_model % heads:
        raise m.refuse("{arch}.attention.head_count", heads, f"must divide embedding_length={d_model} (the head "
                       "size, as no attention.key_length gives it)")
    head_dim = m.get("{arch}.attention.key_length", INT, d_model // heads)
    value_dim = m.get("{arch}.attention.value_length", INT, head_dim)
    rotary = m.get("{arch}.rope.dimension_count", INT, head_dim)
    if value_dim != head_dim:
        raise m.refuse("{arch}.attention.value_length", value_dim, f"differs from key_length={head_dim}: not "
                       "supported")
    if rotary != head_dim:
        raise m.refuse("{arch}.rope.dimension_count", rotary, f"differs from the head size {head_dim}: only full "
                       "rotary (every dimension of a head) is supported")
    vocab = m.get("{arch}.vocab_size", INT, V)
    if (V, D) != (vocab, d_model):
        raise UsageError(f"{f.path}: token_embd.weight has shape {[V, D]}, the metadata says vocab_size={vocab}, "
                         f"embedding_length={d_model}")
    scaling = m.get("{arch}.rope.scaling.type", TEXT, "none")
    if scaling not in ("none", "", "linear"):
        raise m.refuse("{arch}.rope.scaling.type", scaling, "is not supported; supported: none, linear, and Llama "
                       "3.1's frequency scaling (rope_freqs.weight)")
    factor = m.get("{arch}.rope.scaling.factor", NUMBER, 1.0) if scaling == "linear" else 1.0
    theta = m.get("{arch}.rope.freq_base", NUMBER, 10000.0)
    context = m.get("{arch}.context_length", INT, 2048)
    matrices = {f.type_name(n) for n, t in f.tensors.items() if len(t.shape) == 2}
    stored = {"F16": "float16", "BF16": "bfloat16"}.get(matrices.pop(), "float32") if len(matrices) == 1 \
        else "float32"
    fields = dict(vocab_size=vocab, d_model=d_model, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                  head_dim=head_dim, d_ff=m.get("{arch}.feed_forward_length", PER_LAYER), max_seq_len=context,
                  pos_encoding="rope", rope_theta=theta, tie_embeddings="output.weight" not in f.tensors,
                  norm_eps=m.get("{arch}.attention.layer_norm_rms_epsilon", NUMBER, 1e-5),
                  param_dtype=param_dtype or stored, compute_dtype=compute_dtype or param_dtype or stored,
                  scan_layers=scan_layers, **family.from_gguf(m, f))
    if factor != 1.0:
        fields.update(rope_scaling="linear", rope_scaling_factor=factor)
    if "rope_freqs.weight" in f.tensors:
        fields.update(_llama3_scaling(f, theta, head_dim, context))
    try:
        cfg = ModelConfig(**fields).validate()
    except ConfigError as e:
        raise UsageError(f"{f.path}: {e}") from None
    eos, eot = (m.token_id(f"tokenizer.ggml.{k}_token_id", vocab) for k in ("eos", "eot"))
    eos_ids = tuple(dict.fromkeys(i for i in (eos, eot) if i is not None))
    return hf.HFModel(f.path, cfg, m.arch, stored, m.token_id("tokenizer.ggml.bos_token_id", vocab), eos_ids,
                      arch.name(family))


# --------------------------------------------------------------------------- weights


_SAID: set = set()


class GGUFWeights:
    """The file's tensors under transformers' names and in its layout: what
    `hf.load_params` reads, slice by slice. The names, and whether q and k rows are
    permuted, are the family's (`weights/arch/`, from `general.architecture`)."""

    def __init__(self, f: GGUFFile, cfg: ModelConfig):
        self.file, self.cfg = f, cfg
        self.family = arch.for_gguf(f.meta.arch, f.path)
        self.tensors = self.family.TENSORS

    def name(self, hf_name: str) -> str:
        return gguf_name(hf_name, self.tensors)

    @property
    def bytes_read(self) -> int:
        return self.file.bytes_read

    def tensor(self, name: str, index=None) -> Union[np.ndarray, Blocks]:
        """HF tensor `name`[index] (a tuple of unit-step slices): float values, or the
        Blocks of the types with a codec where `index` covers whole blocks of every row it takes."""
        f, gname = self.file, self.name(name)
        shape = f.shape(gname)
        index = tuple(slice(None) for _ in shape) if index is None else tuple(index)
        rows, cols = (slice(0, 1), index[0]) if len(shape) == 1 else index
        n_rows, n_cols = (1, shape[0]) if len(shape) == 1 else shape
        rows, cols = slice(*rows.indices(n_rows)[:2]), slice(*cols.indices(n_cols)[:2])
        read_rows, finish = self._rows(gname, rows, n_rows)
        raw, within = f.raw(gname, read_rows, cols)
        value = finish(decode(f.type_name(gname), raw))
        if within != slice(0, value.shape[1]):
            value = as_float(value)[:, within]
        return as_float(value).reshape(-1) if len(shape) == 1 else value  # a norm in a block type: its values

    def _rows(self, gname: str, rows: slice, n_rows: int):
        """(the file rows to read for `rows` of tensor `gname`, a function from what was read
        to those rows): llama.cpp stores q and k with each head's rows permuted, and
        un-permuting needs whole heads, so those around the slice are read."""
        role = gname.rsplit(".", 2)[-2] if gname.startswith("blk.") and self.family.GGUF_PERMUTED_QK else ""
        heads = {"attn_q": self.cfg.num_heads, "attn_k": self.cfg.num_kv_heads}.get(role)
        if not heads:
            return rows, lambda value: value
        per = n_rows // heads
        read_rows = slice(rows.start // per * per, -(-rows.stop // per) * per)

        def finish(value):
            value = unpermute(value, (read_rows.stop - read_rows.start) // per)
            offset = rows.start - read_rows.start
            taken = slice(offset, offset + rows.stop - rows.start)
            return value.rows(taken) if isinstance(value, Blocks) else value[taken]
        return read_rows, finish

    def block_scales(self, name: str, index) -> Blocks:
        """The Blocks of HF tensor `name`'s rows and blocks `index` read from the blocks'
        scale bytes alone (`GGUFFile.block_heads`): their scales, minimums and factors are
        the file's, their codes not."""
        f, gname = self.file, self.name(name)
        rows, blocks = index
        read_rows, finish = self._rows(gname, rows, f.shape(gname)[0])
        heads = f.block_heads(gname, read_rows, blocks)
        return finish(unpack(f.type_name(gname), heads))

    def read(self, name: str, index=None) -> np.ndarray:
        return as_float(self.tensor(name, index))

    def check(self, cfg: ModelConfig) -> None:
        """Every tensor the model needs is there with its shape, nothing else is, and the
        types that are not kept as stored are named once on stderr."""
        f = self.file
        gguf = _gguf()
        wanted = {self.name(n): s for n, s in hf.expected_tensors(cfg, self.tensors).items()}
        missing = [n for n in wanted if n not in f.tensors]
        if missing:
            raise UsageError(f"{f.path}: tensor {missing[0]} is missing"
                             + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                             + f"; the metadata describes a {cfg.num_layers}-layer model")
        for name, shape in wanted.items():
            if f.shape(name) != tuple(shape):
                raise UsageError(f"{f.path}: tensor {name} has shape {list(f.shape(name))}, the metadata needs "
                                 f"{list(shape)}")
            t = f.type_name(name)
            if t not in FLOAT_TYPES and not hasattr(gguf.quants, t):  # its (de)quantizer class is named so
                raise UsageError(f"{f.path}: tensor {name} has GGML type {t}, which the gguf package cannot "
                                 "dequantize")
        extra = [n for n in f.tensors if n not in wanted and n not in KNOWN_EXTRA]
        if extra:
            raise UsageError(f"{f.path}: unexpected tensors {extra[:3]}" + (f" and {len(extra) - 3} more"
                                                                          if len(extra) > 3 else "")
                             + f": the model of a {f.meta.arch!r} file has no such weights")
        others = sorted({f.type_name(n) for n in wanted} - set(FLOAT_TYPES) - set(LOSSLESS_TYPES))
        import jax
        if others and (f.path, cfg.compute_dtype) not in _SAID and jax.process_index() == 0:
            _SAID.add((f.path, cfg.compute_dtype))
            print(f"specjax: {os.path.basename(f.path)}: {', '.join(others)} tensors are dequantized to "
                  f"{cfg.compute_dtype} (only F32, F16, BF16, {', '.join(LOSSLESS_TYPES)} have an exact weight "
                  "format)", file=sys.stderr)

    def nbytes(self, cfg: ModelConfig) -> int:
        return sum(int(self.file.tensors[self.name(n)].n_bytes) for n in hf.expected_tensors(cfg, self.tensors))


def check_weights(path, cfg: ModelConfig) -> None:
    """`GGUFWeights.check` from the file's header alone: bad tensors fail before device work."""
    GGUFWeights(open_file(path), cfg).check(cfg)


def load(path, mesh, *, param_dtype: Optional[str] = None, compute_dtype: Optional[str] = None,
         scan_layers: bool = False, quantize: Optional[str] = None):
    """(LM, tokenizer or None) of a GGUF file, the params sharded on `mesh` as
    `sharding.RULES` says, each device's slice read from the memory map. With a quantized
    kind `quantize` (`model.QUANTIZE`), the file's weights of the types with a codec are
    taken as stored (`stored_maker`), never read as floats; the rest stay float
    (`LM.quantized` quantizes them). Every problem a file can have is a one-line UsageError raised before
    any device work."""
    lm, tok, _ = load_with_stats(path, mesh, param_dtype=param_dtype, compute_dtype=compute_dtype,
                                 scan_layers=scan_layers, quantize=quantize)
    return lm, tok


def load_with_stats(path, mesh, *, param_dtype=None, compute_dtype=None, scan_layers=False, quantize=None):
    """`load`, plus {'bytes_read': bytes this process read from the file, 'file_bytes':
    the model's tensors' size in the file}."""
    import jax

    from specjax import kv_heads, sharding
    info = read_config(path, param_dtype=param_dtype, compute_dtype=compute_dtype, scan_layers=scan_layers)
    tok = tokenizer(path)
    weights = GGUFWeights(open_file(path), info.model)
    weights.check(info.model)
    cfg = kv_heads.for_mesh(info.model, mesh)
    sharding.check_divisible(cfg, mesh)
    before = weights.bytes_read
    keep = stored_maker(cfg, path, quantize) if quantize is not None else None
    lm = hf.load_params(cfg, mesh, weights, keep=keep, tensors=weights.tensors)
    jax.block_until_ready(lm.params)
    return lm, tok, {"bytes_read": weights.bytes_read - before, "file_bytes": weights.nbytes(info.model)}


def take_stored(lm, path, kind: Optional[str]):
    """`lm` (loaded from the GGUF file `path`) with the weights the file holds quantized
    taken as stored when a quantized `kind` (`model.QUANTIZE`) is asked for (`stored_maker`;
    `load(..., quantize=kind)` does the same without reading those tensors as floats
    first). With no `kind`, `lm` itself."""
    import jax
    from flax import nnx
    if kind is None:
        return lm
    make = stored_maker(lm.cfg, path, kind)

    def one(where, v):
        made = make(where, v)
        return v if made is None else made
    params = jax.tree_util.tree_map_with_path(one, lm.params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return dataclasses.replace(lm, params=params)


@functools.lru_cache(maxsize=None)
def _swap_last(out):
    """The last two axes swapped on the devices, into sharding `out`: one program per
    sharding (a fresh jit per tensor compiled ~430 times for a 30-layer model)."""
    import jax
    return jax.jit(lambda a: a.swapaxes(-1, -2), out_shardings=out)


def stored_maker(cfg: ModelConfig, path, kind: str):
    """`make(tree_path, variable)`: the variable with its weight as stored in the GGUF file
    `path` for the model `cfg` (`kv_heads.for_mesh`'s), or None where it is not taken (a
    norm; a tensor of a type with no codec; a stack of layers whose types keep different
    forms: each stays float, quantized from its values by `LM.quantized(kind)`). The
    variable's array (a loaded float one, or an abstract one) gives the shape and sharding.
    Every projection, unembedding and embedding of a type in `gguf_codecs.CODECS` becomes a
    `kernels.Grouped` of the file's own codes, scales, minimums and factors, re-blocked into
    specjax's layout without changing a value; with 'w4a8' or 'w8a8' it multiplies
    activations rounded to int8, as llama.cpp multiplies them. The codes are placed as the
    float weight is, the scales and factors as `LM.quantized` places a grouped weight's;
    stacked layers (scan) take every layer's blocks; duplicated kv heads repeat the file's
    heads' blocks as the float load repeats their rows. Each process reads only the blocks
    of the boxes its own devices hold (`hf.read_once`), once: codes and scales of a box
    come from one read of its blocks, and scales held beyond a process's codes (a matrix
    with too few groups to split) from their blocks' scale bytes alone. A column split
    inside a block reads that block on both sides."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from specjax import kv_heads
    from specjax.kernels import Grouped
    from specjax.kernels.formats import group_sharding, layout as projection_layout
    from specjax.model import PROJECTIONS
    weights = GGUFWeights(open_file(path), kv_heads.original(cfg))
    activations = "int8" if kind in ("w4a8", "w8a8") else "float32"
    contracted = {**PROJECTIONS, "embed": (1, 2)}
    hf_shapes = hf.expected_tensors(dataclasses.replace(cfg, scan_layers=False), weights.tensors)
    c, H = cfg.kv_copies, cfg.head_dim

    def one(key: str, name: str, layer: Optional[int], layout: str, w) -> Optional[Grouped]:
        shape, where = tuple(w.shape), w.sharding
        stacked = layer is None and name.startswith("model.layers.")
        names = [name.format(i=i) for i in range(shape[0])] if stacked else [name.format(i=layer)]
        types = {weights.file.type_name(weights.name(n)) for n in names}
        if not types <= set(CODECS) or len({CODECS[t].form for t in types}) > 1:
            return None  # one Grouped has one form
        codec = CODECS[min(types)]
        block = max(CODECS[t].block for t in types)
        lead = int(stacked)
        spec = tuple(where.spec) + (None,) * (len(shape) - len(where.spec))
        rows, cols = hf_shapes[names[0]]
        transposed = layout == "same"
        axes, _, heads = (1, 2, 0) if transposed else projection_layout(contracted[key.rsplit("/", 1)[-1]])
        # What is read, as Blocks fields, each [*lead, rows, width] in the file's layout, with the
        # values each entry of a row covers.
        units = {"codes": 1, "scale": codec.group * codec.per}
        if codec.minimums:
            units["low"] = units["scale"]
        if codec.per > 1:
            units.update({"scale_factor": codec.group, **({"low_factor": codec.group} if codec.minimums else {})})
        # Duplicated kv heads: the file's heads' blocks repeated as the float load repeats their rows.
        source = hf.kv_source(c, H, stacked) if kv_heads.is_kv(key) and c > 1 else None

        boxes: dict = {}  # (layer name, rows, first block, last block) -> Blocks read for the codes
        alone: dict = {}  # the same from the blocks' scale bytes alone

        def read(part: str, box):
            unit = units[part]

            def layer_box(n, r, cs):
                first, last = cs.start * unit // block, -(-min(cs.stop * unit, cols) // block)
                skip = cs.start - first * block // unit
                if part == "codes":  # the blocks covering the columns, then the columns' codes
                    b = weights.tensor(n, (r, slice(first * block, min(last * block, cols))))
                    boxes[n, r.start, r.stop, first, last] = b
                else:
                    near = [(f, z) for (m, a, e, f, z) in boxes if (m, a, e) == (n, r.start, r.stop)
                            and f <= first and last <= z]
                    if near:
                        f, z = near[0]
                        b, skip = boxes[n, r.start, r.stop, f, z], cs.start - f * block // unit
                    else:
                        at = (n, r.start, r.stop, first, last)
                        if at not in alone:
                            alone[at] = weights.block_scales(n, (r, slice(first, last)))
                        b = alone[at]
                return getattr(b, part)[:, skip:skip + cs.stop - cs.start]
            if not stacked:
                return layer_box(names[0], *box)
            return np.stack([layer_box(names[i], *box[1:]) for i in range(box[0].start, box[0].stop)])

        arrays = {}
        for part, unit in units.items():
            width = -(-cols // unit)
            hf_shape = (len(names),) * lead + (rows, width)
            if part == "codes":
                hf_at = NamedSharding(where.mesh, P(*spec[:lead], *hf.hf_spec(layout, spec[lead:])))
                a = hf.read_once(hf_shape, hf_at, functools.partial(read, part), source)
                arrays[part] = hf._on_device(layout, shape, a.dtype, where)(a)
                continue
            # A heads-major projection's scales [*lead, N, width, H]; any other's [*lead, width, rows].
            at_shape = (*shape[:lead + heads], width, *shape[lead + heads + axes:]) if heads else (
                hf_shape if transposed else (len(names),) * lead + (width, rows))
            at = group_sharding(where, lead + heads, axes, len(shape), transposed, at_shape)
            g = tuple(at.spec) + (None,) * (len(at_shape) - len(at.spec))
            if transposed:
                hf_at = at
            elif heads:
                hf_at = NamedSharding(where.mesh, P(*g[:lead], *hf.hf_spec(layout, g[lead:])))
            else:
                hf_at = NamedSharding(where.mesh, P(*g[:lead], g[lead + 1], g[lead]))
            a = hf.read_once(hf_shape, hf_at, functools.partial(read, part), source)
            if heads:  # [*lead, N*H, width] -> [*lead, N, width, H], as the codes
                a = hf._on_device(layout, at_shape, a.dtype, at)(a)
            elif not transposed:  # [*lead, rows, width] -> [*lead, width, N]
                a = _swap_last(at)(a)
            arrays[part] = a
        out = (shape[lead],) if transposed else tuple(shape[lead + heads + axes:])
        return Grouped(arrays["codes"], arrays["scale"], arrays.get("low"), out, transposed, heads=heads, bits=codec.bits,
                       activations=activations, group=codec.group, offset=codec.offset,
                       scale_factor=arrays.get("scale_factor"), low_factor=arrays.get("low_factor"))

    def make(where, v):
        key, layer = hf._param_key(where)
        if key.rsplit("/", 1)[-1] not in contracted:
            return None
        t = weights.tensors[key]
        made = one(key, t.hf, layer, t.layout, v.value)
        return None if made is None else v.replace(made)

    return make


# --------------------------------------------------------------------------- tokenizer


# llama.cpp's pre-tokenizer names whose split pattern transformers' GGUF tokenizer applies
# before byte-level BPE (others keep GPT-2's ByteLevel pattern), as transformers 5 maps them.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    "tekken": _TEKKEN_SPLIT,
}
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte (what byte-level BPE vocabularies hold)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    spelled, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in spelled:
            spelled[b] = chr(256 + extra)
            extra += 1
    return spelled


def _sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a piece into two
    pieces, best score first (ties: shorter left part, then shorter right, then the
    pieces' order), as transformers derives them for a GGUF file without merges."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for piece, score in zip(tokens, scores):
        local = [(piece[:k], piece[k:], score) for k in range(1, len(piece))
                 if piece[:k] in vocab and piece[k:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _merge_pairs(f: GGUFFile, merges: list[str], vocab: dict) -> list[tuple[str, str]]:
    """tokenizer.ggml.merges as pairs, each "a b" with a, b and ab in the vocabulary (what
    tokenizers' BPE requires; refused in one line naming the merge otherwise)."""
    pairs = []
    for i, merge in enumerate(merges):
        a, space, b = merge.partition(" ")
        absent = [t for t in (a, b, a + b) if t not in vocab]
        if not space or not a or not b or absent:
            raise UsageError(f"{f.path}: metadata tokenizer.ggml.merges[{i}]={merge!r}: "
                             + (f"names {absent[0]!r}, which tokenizer.ggml.tokens does not hold" if space and a and b
                                else "must be two tokens joined by one space"))
        pairs.append((a, b))
    return pairs


def _bpe(f: GGUFFile, vocab: dict, merges: list, **options):
    from tokenizers import Tokenizer, models
    try:
        return Tokenizer(models.BPE(vocab=vocab, merges=merges, **options))
    except Exception as e:  # noqa: BLE001 (tokenizers raises a bare Exception)
        raise UsageError(f"{f.path}: the tokenizer.ggml.* metadata makes no BPE tokenizer "
                         f"({str(e).splitlines()[0][:200]})") from None


def build_tokenizer(f: GGUFFile):
    """(tokenizers.Tokenizer, {bos, eos, unk, pad ids}) from tokenizer.ggml.* metadata,
    built as transformers 5 builds a GGUF file's tokenizer: 'gpt2' = byte-level BPE with
    the file's merges (and the split pattern its `pre` names), 'llama' = SentencePiece as
    BPE with byte fallback and a Metaspace pre-tokenizer; control tokens added as special
    tokens, user-defined ones as added tokens; BOS prepended when add_bos_token says so
    (SentencePiece files that do not say: yes)."""
    from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
    m = f.meta
    family = arch.for_gguf(m.arch, f.path, required=False)
    defined_ok = lambda t: True  # noqa: E731
    kind = m.get("tokenizer.ggml.model", TEXT)
    tokens = m.get("tokenizer.ggml.tokens", TEXTS)
    types = m.per_token("tokenizer.ggml.token_type", INTS, len(tokens)) or [1] * len(tokens)
    merges = m.get("tokenizer.ggml.merges", TEXTS, None)
    if kind == "gpt2":
        spelled = _byte_alphabet()
        alphabet = set(spelled.values())
        vocab = {t if set(t) <= alphabet else "".join(spelled[b] for b in t.encode("utf-8")): i
                 for i, t in enumerate(tokens)}
        tok = _bpe(f, vocab, _merge_pairs(f, merges or [], vocab), continuing_subword_prefix="",
                   end_of_word_suffix="", fuse_unk=False)
        split = PRE_TOKENIZER_SPLITS.get(m.get("tokenizer.ggml.pre", TEXT, None))
        tok.pre_tokenizer = (pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None else
                             pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                      pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                               use_regex=False)]))
        tok.decoder = decoders.ByteLevel()
        add_bos = m.get("tokenizer.ggml.add_bos_token", BOOL, False)
        control_ok = lambda t: set(t) <= alphabet  # noqa: E731 (a byte-level vocabulary spells every real token so)
    elif kind == "llama" and hasattr(family, "gguf_tokenizer"):  # a family's own SentencePiece pipeline (Gemma)
        tok = family.gguf_tokenizer(tokens, lambda vocab, pairs, **options: _bpe(f, vocab, pairs, **options))
        add_bos = m.get("tokenizer.ggml.add_bos_token", BOOL, True)
        control_ok = lambda t: True  # noqa: E731
        # transformers adds a user-defined token only under its spelling in the vocabulary
        defined_ok = lambda t: tok.token_to_id(t) is not None  # noqa: E731
    elif kind == "llama":
        scores = m.per_token("tokenizer.ggml.scores", NUMBERS, len(tokens)) or [0.0] * len(tokens)
        vocab = {t: i for i, t in enumerate(tokens)}
        pairs = _merge_pairs(f, merges, vocab) if merges else _sentencepiece_merges(tokens, scores)
        tok = _bpe(f, vocab, pairs, fuse_unk=True, byte_fallback=True)
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(content=" ", left=1)])
        add_bos = m.get("tokenizer.ggml.add_bos_token", BOOL, True)
        control_ok = lambda t: True  # noqa: E731
    else:
        raise UsageError(f"{f.path}: tokenizer.ggml.model={kind!r} is not supported; supported: gpt2 (byte-level "
                         "BPE), llama (SentencePiece)")
    ids = {name: m.token_id(f"tokenizer.ggml.{name}_token_id", len(tokens)) for name in ("bos", "eos", "unknown",
                                                                                           "padding")}
    ids = {k: v for k, v in ids.items() if v is not None}
    special = {ids[k] for k in ("bos", "eos", "unknown", "padding") if k in ids}
    tok.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True) for i, t in enumerate(types)
                            if (t == CONTROL and control_ok(tokens[i])) or i in special])
    tok.add_tokens([AddedToken(tokens[i], normalized=False, special=False) for i, t in enumerate(types)
                    if t == USER_DEFINED and defined_ok(tokens[i])])
    add_eos = m.get("tokenizer.ggml.add_eos_token", BOOL, False)
    if (add_bos and "bos" in ids) or (add_eos and "eos" in ids):
        bos = [(tokens[ids["bos"]], ids["bos"])] if add_bos and "bos" in ids else []
        eos = [(tokens[ids["eos"]], ids["eos"])] if add_eos and "eos" in ids else []
        single = " ".join([t for t, _ in bos] + ["$A"] + [t for t, _ in eos])
        pair = " ".join([t for t, _ in bos] + ["$A"] + [t for t, _ in eos] + [f"{t}:1" for t, _ in bos]
                        + ["$B:1"] + [f"{t}:1" for t, _ in eos])
        tok.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                           special_tokens=list(dict.fromkeys(bos + eos)))
    return tok, ids


def tokenizer(path) -> Optional[HFTokenizer]:
    """The tokenizer the file's metadata describes (None without `tokenizer.ggml.model`)."""
    f = open_file(path)
    if f.meta.get("tokenizer.ggml.model", TEXT, None) is None or not f.meta.get("tokenizer.ggml.tokens", TEXTS, None):
        return None
    tok, ids = build_tokenizer(f)
    eos = [ids["eos"]] if "eos" in ids else []
    eot = f.meta.token_id("tokenizer.ggml.eot_token_id", len(f.meta.get("tokenizer.ggml.tokens", TEXTS)))
    stop = tuple(dict.fromkeys(eos + ([eot] if eot is not None else [])))
    return HFTokenizer.from_tokenizers(tok, f.path, bos_id=ids.get("bos"), eos_id=ids.get("eos"),
                                       pad_id=ids.get("padding"), stop_ids=stop,
                                       chat_template=f.meta.get("tokenizer.chat_template", TEXT, None))


def write_tokenizer(path, directory) -> None:
    """The file's tokenizer as a Hugging Face directory's tokenizer.json and
    tokenizer_config.json (`HFTokenizer` and transformers read them to the same ids)."""
    import json
    tok = tokenizer(path)
    if tok is None:
        return
    directory = hf.as_path(directory)
    (directory / "tokenizer.json").write_text(tok._impl.to_str(), encoding="utf-8")
    name = lambda i: None if i is None else tok._impl.id_to_token(i)  # noqa: E731
    config = {"bos_token": name(tok.bos_id), "eos_token": name(tok.eos_id), "pad_token": name(tok.pad_id),
              "chat_template": tok.chat_template, "tokenizer_class": "PreTrainedTokenizerFast"}
    (directory / "tokenizer_config.json").write_text(
        json.dumps({k: v for k, v in config.items() if v is not None}, indent=2, ensure_ascii=False) + "\n",
        encoding="utf-8")
