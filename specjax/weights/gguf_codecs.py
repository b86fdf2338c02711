"""GGML's block types as codecs: one `CODECS` entry per type says how its blocks map onto an
exact weight format (`kernels.Grouped`: w = (code - offset) * scale + low per group of inputs),
so a file's quantized tensors are read as stored, never through a float copy.

Every entry is a `Codec`: the codes' width, the inputs per scale (`group`), the offset of
symmetric blocks (or minimums), the groups per float16 scale (`per`: 1, or the K-quants'
super-block of 256 inputs, whose groups carry integer factors), how many leading bytes of a
block hold all its scales (a scale-only read), which float16 fields a big-endian file swaps,
and `unpack`, [rows, blocks, bytes] -> the arrays. Adding a type is one entry and its
`unpack` here; the reader (`gguf.py`), the weight format and the CPU kernel take it from
there, for any (bits, group) the kernel reads (`kernels.dispatch.GROUPED_FORMATS`; another
one runs through XLA's dots).

The values are the `gguf` package's own dequantization exactly (tests/weights/test_gguf_codecs.py):
every product of a code and a scale is exact in float32 (a float16 scale's 11-bit
significand times an integer factor of at most 7 bits times a code of at most 8), so one
rounding at most, where the minimum is added, as ggml computes it.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import numpy as np

QK = 256  # values per K-quant super-block


def _half(b: np.ndarray) -> np.ndarray:
    """[..., 2] little-endian bytes -> float16 values as float32 [...]."""
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes of packed 4-bit codes -> [..., 32]: ggml puts value j in the low nibble
    of byte j and value j + 16 in its high nibble."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits(b: np.ndarray) -> np.ndarray:
    """[..., m] bytes -> [..., 8m] bits, bit i of byte j at 8j + i (ggml's qh words, little-endian)."""
    return np.unpackbits(b, axis=-1, bitorder="little")


def _k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and minimums -> ([..., 8], [..., 8])."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


# Each unpack: blocks [rows, n, bytes] -> (codes [rows, n, values] uint8, scale [rows, n * s],
# low or None, scale factors [rows, n * g] int8 or None, low factors or None).


def _q8_0(b):  # float16 d, 32 int8 codes: d * q, kept as q + 128 with offset 128
    return (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8), _half(b[..., :2]), None, None, None


def _q4_0(b):  # d, 16 bytes of codes offset by 8
    return _nibbles(b[..., 2:]), _half(b[..., :2]), None, None, None


def _q4_1(b):  # d, m, 16 bytes of codes: d * q + m
    return _nibbles(b[..., 4:]), _half(b[..., :2]), _half(b[..., 2:4]), None, None


def _q5_0(b):  # d, 32 high bits, 16 bytes of low nibbles: d * (q - 16)
    return _nibbles(b[..., 6:]) | (_bits(b[..., 2:6]) << 4), _half(b[..., :2]), None, None, None


def _q5_1(b):  # d, m, 32 high bits, nibbles
    return _nibbles(b[..., 8:]) | (_bits(b[..., 4:8]) << 4), _half(b[..., :2]), _half(b[..., 2:4]), None, None


def _q4_k(b):  # d, dmin, 12 bytes of 6-bit scales/mins, 4 x 32 bytes: group 2i low nibbles, 2i+1 high
    sc, mn = _k_scale_min(b[..., 4:16])
    qs = b[..., 16:144].reshape(*b.shape[:-1], 4, 32)
    codes = np.stack([qs & 0x0F, qs >> 4], axis=-2).reshape(*b.shape[:-1], QK)
    return codes, _half(b[..., 0:2]), -_half(b[..., 2:4]), _flat(sc), _flat(mn)


def _q5_k(b):  # as Q4_K, then 32 bytes of high bits (bit j of byte i: value 32j + i), then the nibbles
    sc, mn = _k_scale_min(b[..., 4:16])
    qs = b[..., 48:176].reshape(*b.shape[:-1], 4, 32)
    low = np.stack([qs & 0x0F, qs >> 4], axis=-2).reshape(*b.shape[:-1], 8, 32)
    high = np.swapaxes(np.unpackbits(b[..., 16:48, None], axis=-1, bitorder="little"), -1, -2)  # [.., 8, 32]
    return ((low | (high << 4)).reshape(*b.shape[:-1], QK), _half(b[..., 0:2]), -_half(b[..., 2:4]), _flat(sc),
            _flat(mn))


def _q6_k(b):  # 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, d: d * sc * (q - 32)
    ql = b[..., :128].reshape(*b.shape[:-1], 2, 64)
    low = np.stack([ql & 0x0F, ql >> 4], axis=-2).reshape(*b.shape[:-1], 8, 32)
    qh = b[..., 128:192].reshape(*b.shape[:-1], 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    high = (qh & 3).reshape(*b.shape[:-1], 8, 32)
    codes = (low | (high << 4)).reshape(*b.shape[:-1], QK)
    return codes, _half(b[..., 208:210]), None, _flat(b[..., 192:208].view(np.int8)), None


def _q3_k(b):  # 32 bytes of high bits, 64 of 2-bit lows, 12 of 6-bit scales, d: d * (sc - 32) * (q - 4)
    ql = b[..., 32:96].reshape(*b.shape[:-1], 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    high = np.swapaxes(np.unpackbits(b[..., :32, None], axis=-1, bitorder="little"), -1, -2)  # [.., 8, 32]
    codes = ((ql & 3).reshape(*b.shape[:-1], 8, 32) | (high << 2)).reshape(*b.shape[:-1], QK)
    s = b[..., 96:108]
    low4 = np.concatenate([s[..., 0:8] & 0x0F, s[..., 0:8] >> 4], axis=-1)  # scales 0..15's low 4 bits
    high2 = (s[..., 8:12, None] >> np.array([0, 2, 4, 6], np.uint8)).swapaxes(-1, -2).reshape(*s.shape[:-1], 16) & 3
    sc = ((low4 | (high2 << 4)).astype(np.int16) - 32).astype(np.int8)
    return codes, _half(b[..., 108:110]), None, _flat(sc), None


def _q2_k(b):  # 16 bytes of 4-bit scale | 4-bit min, 64 of 2-bit codes, d, dmin: d * sc * q - dmin * m
    qs = b[..., 16:80].reshape(*b.shape[:-1], 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    codes = (qs & 3).reshape(*b.shape[:-1], QK)
    s = b[..., :16]
    return (codes, _half(b[..., 80:82]), -_half(b[..., 82:84]), _flat((s & 0x0F).astype(np.int8)),
            _flat((s >> 4).astype(np.int8)))


def _flat(a: np.ndarray) -> np.ndarray:
    """[rows, n, g] -> [rows, n * g]."""
    return np.ascontiguousarray(a).reshape(*a.shape[:-2], -1)


@dataclasses.dataclass(frozen=True)
class Codec:
    """How a GGML type's blocks are kept (the module doc)."""

    size: int  # bytes per block
    bits: int  # the codes' width as kept (Q2_K's and Q3_K's widened to 4)
    group: int  # inputs per scale
    offset: int  # subtracted from the codes of symmetric blocks (0 with minimums)
    minimums: bool
    unpack: Callable
    per: int = 1  # groups per float16 scale: 1, or the groups of a K-quant super-block (then integer factors)
    head: Optional[int] = None  # leading bytes holding every scale of a block (None: they are spread over it)
    # The float16 fields of a block that a big-endian file stores big-endian (what the gguf
    # package's byte-order converter, gguf_convert_endian.py, swaps); None: it does not
    # convert the type, so no big-endian file says how such blocks are stored (refused).
    big_endian: Optional[tuple[int, ...]] = None

    @property
    def block(self) -> int:
        """Values per block."""
        return self.group * self.per

    @property
    def form(self) -> tuple:
        """What one `Grouped` holds: tensors of types with the same form stack into one."""
        return self.bits, self.group, self.offset, self.minimums, self.per


CODECS = {  # type: its bytes per block, the form its blocks keep, the unpacking
    "Q8_0": Codec(34, bits=8, group=32, offset=128, minimums=False, unpack=_q8_0, head=2, big_endian=(0,)),
    "Q4_0": Codec(18, bits=4, group=32, offset=8, minimums=False, unpack=_q4_0, head=2, big_endian=(0,)),
    "Q4_1": Codec(20, bits=4, group=32, offset=0, minimums=True, unpack=_q4_1, head=4),
    "Q5_0": Codec(22, bits=5, group=32, offset=16, minimums=False, unpack=_q5_0, head=2),
    "Q5_1": Codec(24, bits=5, group=32, offset=0, minimums=True, unpack=_q5_1, head=4),
    "Q2_K": Codec(84, bits=4, group=16, offset=0, minimums=True, unpack=_q2_k, per=16),
    "Q3_K": Codec(110, bits=4, group=16, offset=4, minimums=False, unpack=_q3_k, per=16),
    "Q4_K": Codec(144, bits=4, group=32, offset=0, minimums=True, unpack=_q4_k, per=8, head=16, big_endian=(0, 2)),
    "Q5_K": Codec(176, bits=5, group=32, offset=0, minimums=True, unpack=_q5_k, per=8, head=16),
    "Q6_K": Codec(210, bits=6, group=16, offset=32, minimums=False, unpack=_q6_k, per=16, big_endian=(208,)),
}


@dataclasses.dataclass(frozen=True)
class Blocks:
    """A tensor's blocks as a codec unpacks them, in the file's layout: rows are outputs,
    codes [rows, cols] run along the input dimension, scale and low [rows, S] (float16
    values) per group or per super-block, factors [rows, G] int8 (two levels) or None."""

    type_name: str
    codes: np.ndarray
    scale: np.ndarray
    low: Optional[np.ndarray]
    scale_factor: Optional[np.ndarray]
    low_factor: Optional[np.ndarray]

    FIELDS = ("codes", "scale", "low", "scale_factor", "low_factor")

    @property
    def codec(self) -> Codec:
        return CODECS[self.type_name]

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape

    def group_scales(self) -> tuple[np.ndarray, Optional[np.ndarray]]:
        """(scale, low) float32 [rows, G]: float16 values times integer factors, exact."""
        def one(top, factor):
            if top is None or factor is None:
                return top
            return np.repeat(top, factor.shape[-1] // top.shape[-1], axis=-1) * factor.astype(np.float32)
        return one(self.scale, self.scale_factor), one(self.low, self.low_factor)

    def dequantize(self) -> np.ndarray:
        """float32 values, computed as ggml does: (code - offset) times the group's scale
        (exact), plus the minimum (one rounding)."""
        c = self.codec
        rows, cols = self.codes.shape
        scale, low = self.group_scales()
        grouped = self.codes.reshape(rows, -1, c.group).astype(np.float32) - np.float32(c.offset)
        out = grouped * scale[..., None]
        if low is not None:
            out = out + low[..., None]
        return out.reshape(rows, cols)

    def rows(self, index) -> "Blocks":
        take = lambda a: None if a is None else a[index]  # noqa: E731
        return Blocks(self.type_name, *(take(getattr(self, f)) for f in self.FIELDS))


def unpack(type_name: str, raw: np.ndarray) -> Blocks:
    """The Blocks of [rows, bytes] (or [rows, n, bytes]) uint8 blocks of a type in `CODECS`."""
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, CODECS[type_name].size)
    codes, scale, low, sf, lf = CODECS[type_name].unpack(blocks)
    factor = lambda a: None if a is None else a.reshape(rows, -1).astype(np.int8)  # noqa: E731
    return Blocks(type_name, np.ascontiguousarray(codes).reshape(rows, -1).astype(np.uint8),
                  scale.reshape(rows, -1), None if low is None else low.reshape(rows, -1), factor(sf), factor(lf))
