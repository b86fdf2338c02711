"""Safetensors files, read slice by slice and written tensor by tensor.

The format: 8 bytes (little-endian u64) header length N, N bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then the
raw row-major tensor bytes (offsets count from the end of the header).

Reading is lazy: opening a file reads only its header; `read(name, index)` returns one
box of one tensor (a unit-step slice per axis), read as the byte ranges it occupies: one
range when the box is contiguous, one per row (strided) when it is a column split such as
down_proj's or o_proj's share of a device, never whole rows to slice afterwards. A local
file is read with `os.pread` straight into the result; any other path (`gs://...`,
through `etils.epath`) in ranged reads, several at once, where ranges closer than
REMOTE_GAP_BYTES are fetched as one (a request costs more than that many bytes) and no
request exceeds REMOTE_CHUNK_BYTES. `bytes_read` counts the bytes read out of the file,
which is how the multi-process tests show that each process read only its own shards.

bfloat16 is `ml_dtypes.bfloat16` (numpy has none), so bf16 tensors stay bf16 end to end.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import os
import struct
from typing import Callable, Mapping, Optional, Sequence

import ml_dtypes
import numpy as np
from etils import epath

from specjax.config import UsageError
from specjax.weights.hf_files import check_regular

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
REMOTE_CHUNK_BYTES = 64 << 20
# A remote range request costs ~tens of ms, several run at once: reading a gap below this is
# cheaper than one more request (at ~200 MB/s per stream, 16 in flight).
REMOTE_GAP_BYTES = 256 << 10
REMOTE_THREADS = 16
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
        self._fd = None
        check_regular(path)
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

    def read(self, name: str, index: Optional[tuple] = None) -> np.ndarray:
        """tensor[index] (a tuple of unit-step slices, one per axis; None: all of it)."""
        info = self.tensors[name]
        index = tuple(slice(None) for _ in info.shape) if index is None else tuple(index)
        box = tuple(range(*s.indices(n)) for s, n in zip(index, info.shape))
        out = np.empty(tuple(len(r) for r in box), info.dtype)
        if out.size == 0:
            return out
        ranges = byte_ranges(info, box)
        if self.local:
            self._read_local(ranges, out)
        else:
            self._read_remote(ranges, out)
        return out

    def _read_local(self, ranges: list[tuple[int, int]], out: np.ndarray) -> None:
        if self._fd is None:
            self._fd = os.open(os.fspath(self.path), os.O_RDONLY)
        view, done = memoryview(out.reshape(-1).view(np.uint8)), 0
        for start, size in ranges:
            got = os.preadv(self._fd, [view[done:done + size]], start)
            if got != size:
                raise UsageError(f"{self.path}: truncated while reading a tensor")
            self.bytes_read += size
            done += size

    def _read_remote(self, ranges: list[tuple[int, int]], out: np.ndarray) -> None:
        """Ranges merged into requests across small gaps, REMOTE_THREADS requests at once."""
        requests, places = [], []  # (start, size) of each request; (request, offset in it, size, offset in out)
        done = 0
        for start, size in ranges:
            if requests:
                first, length = requests[-1]
                gap = start - (first + length)
                if 0 <= gap <= REMOTE_GAP_BYTES and length + gap + size <= REMOTE_CHUNK_BYTES:
                    requests[-1] = (first, length + gap + size)
                    places.append((len(requests) - 1, start - first, size, done))
                    done += size
                    continue
            requests.append((start, size))
            places.append((len(requests) - 1, 0, size, done))
            done += size

        def fetch(request):
            start, size = request
            with self.path.open("rb") as f:
                f.seek(start)
                data = f.read(size)
            if len(data) != size:
                raise UsageError(f"{self.path}: truncated while reading a tensor")
            return data

        with concurrent.futures.ThreadPoolExecutor(min(REMOTE_THREADS, len(requests))) as pool:
            data = list(pool.map(fetch, requests))
        self.bytes_read += sum(size for _, size in requests)
        flat = out.reshape(-1).view(np.uint8)
        for request, offset, size, at in places:
            flat[at:at + size] = np.frombuffer(data[request], np.uint8, size, offset)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def byte_ranges(info: TensorInfo, box: Sequence[range]) -> list[tuple[int, int]]:
    """(file offset, size) of the contiguous runs of tensor[box], in row-major order: the
    trailing axes the box covers whole join the run of the last axis it cuts."""
    shape = info.shape
    if not shape:
        return [(info.offset, info.dtype.itemsize)]
    k = len(shape) - 1  # runs span axis k (partly) and every axis after it (whole)
    while k > 0 and len(box[k]) == shape[k]:
        k -= 1
    inner = math.prod(shape[k + 1:])
    run = len(box[k]) * inner * info.dtype.itemsize
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    outer = np.zeros(1, np.int64)
    for i in range(k):  # element offsets of every run's first element, row-major
        outer = (outer[:, None] + np.asarray(box[i], np.int64)[None, :] * strides[i]).reshape(-1)
    starts = info.offset + (outer + box[k].start * strides[k]) * info.dtype.itemsize
    return [(int(a), run) for a in starts]


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
