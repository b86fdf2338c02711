"""Safetensors files, read slice by slice and written tensor by tensor.

The format: 8 bytes (little-endian u64) header length N, N bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then the
raw row-major tensor bytes (offsets count from the end of the header).

Reading is lazy: opening a file reads only its header; `read(name, index)` returns one
slice of one tensor. A local file is memory-mapped, so a slice costs the bytes it holds;
any other path (`gs://...`, through `etils.epath`) is read with ranged reads of the slice's
rows, a bounded chunk at a time, so a host never holds more than its slice plus one chunk.
`bytes_read` counts the bytes read out of the file (local: the slices returned), which is
how the multi-process tests show that each process read only its own shards.

bfloat16 is `ml_dtypes.bfloat16` (numpy has none), so bf16 tensors stay bf16 end to end.
"""
from __future__ import annotations

import dataclasses
import json
import math
import mmap
import os
import struct
from typing import Callable, Mapping, Optional, Sequence

import ml_dtypes
import numpy as np
from etils import epath

from specjax.config import UsageError

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
REMOTE_CHUNK_BYTES = 64 << 20
MAX_HEADER_BYTES = 100 << 20  # the format's own limit


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # absolute position of the first byte in the file

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def is_local(path) -> bool:
    return "://" not in os.fspath(path)


class SafetensorsFile:
    """One safetensors file: the header at construction, slices on demand."""

    def __init__(self, path, *, local: Optional[bool] = None):
        self.path = epath.Path(path)
        self.local = is_local(path) if local is None else local
        self.bytes_read = 0
        self._mmap = None
        try:
            size = self.path.stat().length
            with self.path.open("rb") as f:
                head = f.read(8)
                n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
                if not 0 < n <= min(MAX_HEADER_BYTES, size - 8):
                    raise UsageError(f"{self.path}: not a safetensors file, or truncated (it has {size} bytes; "
                                     f"the header length field reads {n})")
                header = json.loads(f.read(n))
        except FileNotFoundError:
            raise UsageError(f"{self.path}: no such file") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UsageError(f"{self.path}: damaged safetensors header ({e})") from None
        if not isinstance(header, dict):
            raise UsageError(f"{self.path}: damaged safetensors header (not a JSON object)")
        self.metadata = header.pop("__metadata__", None) or {}
        self.tensors: dict[str, TensorInfo] = {}
        end = 0
        for name, entry in header.items():
            try:
                dtype = np.dtype(DTYPES[entry["dtype"]])
                shape = tuple(int(d) for d in entry["shape"])
                begin, stop = (int(x) for x in entry["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise UsageError(f"{self.path}: tensor {name!r} has a bad header entry {entry!r} (dtypes read: "
                                 f"{', '.join(DTYPES)})") from None
            if stop - begin != math.prod(shape) * dtype.itemsize or begin < 0:
                raise UsageError(f"{self.path}: tensor {name!r}: data_offsets {[begin, stop]} do not hold a "
                                 f"{entry['dtype']} tensor of shape {list(shape)}")
            self.tensors[name] = TensorInfo(dtype, shape, 8 + n + begin)
            end = max(end, stop)
        if 8 + n + end > size:
            raise UsageError(f"{self.path}: truncated: the header needs {8 + n + end} bytes, the file has {size}")

    def _view(self, info: TensorInfo) -> np.ndarray:
        if self._mmap is None:
            with open(os.fspath(self.path), "rb") as f:
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        count = math.prod(info.shape)
        return np.frombuffer(self._mmap, info.dtype, count, info.offset).reshape(info.shape)

    def read(self, name: str, index: Optional[tuple] = None) -> np.ndarray:
        """tensor[index] (a tuple of unit-step slices, one per axis; None: all of it)."""
        info = self.tensors[name]
        index = tuple(slice(None) for _ in info.shape) if index is None else tuple(index)
        if self.local:
            out = np.array(self._view(info)[index])
            self.bytes_read += out.nbytes
            self._release(info)
            return out
        return self._read_rows(info, index)

    def _release(self, info: TensorInfo) -> None:
        """Drop the tensor's mapped pages from this process (the OS page cache keeps them):
        otherwise every page a slice touched counts in the process's memory until the
        file is closed, doubling a load's peak RSS."""
        start = info.offset - info.offset % mmap.PAGESIZE
        self._mmap.madvise(mmap.MADV_DONTNEED, start, min(len(self._mmap), info.offset + info.nbytes) - start)

    def _read_rows(self, info: TensorInfo, index: tuple) -> np.ndarray:
        if not info.shape:
            rows, rest = range(1), ()
        else:
            rows, rest = range(*index[0].indices(info.shape[0])), index[1:]
        row_shape = info.shape[1:]
        row_bytes = math.prod(row_shape) * info.dtype.itemsize
        per_chunk = max(1, REMOTE_CHUNK_BYTES // max(1, row_bytes))
        parts = []
        with self.path.open("rb") as f:
            for first in range(rows.start, rows.stop, per_chunk):
                count = min(per_chunk, rows.stop - first)
                f.seek(info.offset + first * row_bytes)
                data = f.read(count * row_bytes)
                if len(data) != count * row_bytes:
                    raise UsageError(f"{self.path}: truncated while reading a tensor's rows")
                self.bytes_read += len(data)
                block = np.frombuffer(data, info.dtype).reshape((count,) + row_shape)
                parts.append(np.array(block[(slice(None),) + rest]))
        if not info.shape:
            return parts[0].reshape(())
        return np.concatenate(parts) if parts else np.zeros((0,) + row_shape, info.dtype)[(slice(None),) + rest]

    def close(self) -> None:
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None


def write(path, tensors: Sequence[tuple[str, np.dtype, tuple[int, ...]]], value: Callable[[str], np.ndarray],
          metadata: Optional[Mapping[str, str]] = None) -> int:
    """Write `tensors` ([(name, dtype, shape)], in file order) to `path`, asking
    `value(name)` for each array only when its turn comes (one tensor in memory at a
    time). Written to a temporary name and renamed, so a reader never sees half a file.
    Returns the bytes written."""
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = dict(metadata)
    for name, dtype, shape in tensors:
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        header[name] = {"dtype": NAMES[np.dtype(dtype)], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the reference writer does
    path = epath.Path(path)
    tmp = path.parent / f".{path.name}.tmp"
    with tmp.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, dtype, shape in tensors:
            array = np.ascontiguousarray(value(name), dtype=dtype)
            if array.shape != tuple(shape):
                raise ValueError(f"{name}: shape {array.shape}, declared {tuple(shape)}")
            f.write(array.tobytes())
    tmp.rename(path)
    return 8 + len(raw) + offset
