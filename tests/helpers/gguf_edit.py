"""Hand-edited copies of the committed GGUF fixtures (tests/fixtures/gguf), made at test
time: metadata of another value or type, tensors dropped or stored in another type,
damaged tensor tables, another byte order. The edits use the `gguf` package (the format's
own writer, reader and byte-order converter) or plain struct writes, never specjax."""
from __future__ import annotations

import builtins
import pathlib
import shutil
import struct
from typing import Any, Optional

import numpy as np

import gguf

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "gguf"
T, V = gguf.GGMLQuantizationType, gguf.GGUFValueType
DROP = object()  # a metadata edit that removes the key


def fixture(name: str) -> pathlib.Path:
    return FIXTURES / f"{name}.gguf"


def rewrite(src, dst, *, drop=(), fields: Optional[dict] = None, arch: Optional[str] = None,
            types: Optional[dict] = None, version: Optional[int] = None,
            blocks: Optional[dict] = None) -> pathlib.Path:
    """A copy of GGUF file `src` written again with the gguf package's writer: tensors in
    `drop` left out, metadata `fields` ({key: (value, type) or (value, ARRAY, item type)
    or DROP}) added, replaced or removed, tensors of `types` ({name: GGML type name})
    re-stored in that type (quantized by the package from the file's values), tensors in
    `blocks` ({name: (GGML type name, raw blocks [rows, bytes])}) written as those blocks
    (a type the package cannot quantize)."""
    reader = gguf.GGUFReader(src)
    arch = arch or reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    fields = fields or {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in fields:
            continue
        sub = field.types[-1] if field.types[0] == V.ARRAY else None
        w.add_key_value(key, field.contents(), field.types[0], sub)
    for key, edit in fields.items():
        if edit is not DROP:
            w.add_key_value(key, edit[0], edit[1], edit[2] if len(edit) > 2 else None)
    for t in reader.tensors:
        if t.name in drop:
            continue
        data = np.array(t.data)
        if blocks and t.name in blocks:
            w.add_tensor(t.name, blocks[t.name][1], raw_dtype=T[blocks[t.name][0]])
        elif types and t.name in types:
            values = gguf.quants.dequantize(data, t.tensor_type).astype(np.float32)
            new = T[types[t.name]]
            if new == T.F32:
                w.add_tensor(t.name, values)
            else:
                w.add_tensor(t.name, gguf.quants.quantize(values, new), raw_dtype=new)
        elif t.tensor_type in (T.F32, T.F16):
            w.add_tensor(t.name, data)
        else:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if version is not None:
        set_version(dst, version)
    return pathlib.Path(dst)


def set_version(path, version: int) -> None:
    """Overwrite the header's version (the uint32 after the magic, little-endian)."""
    with open(path, "r+b") as f:
        f.seek(4)
        f.write(struct.pack("<I", version))


def tensor_offsets(path) -> dict[str, int]:
    """{tensor: its offset from the start of the data section} as the table says."""
    return {t.name: int(t.field.parts[-1][0]) for t in gguf.GGUFReader(path).tensors}


def move_tensor(src, dst, name: str, offset: int) -> pathlib.Path:
    """A copy of `src` whose table places tensor `name` at data offset `offset` (the
    bytes stay where they were)."""
    shutil.copyfile(src, dst)
    reader = gguf.GGUFReader(dst, "r+")
    (t,) = [t for t in reader.tensors if t.name == name]
    t.field.parts[-1][0] = offset
    reader.data.flush()
    del reader
    return pathlib.Path(dst)


def big_endian(src, dst) -> pathlib.Path:
    """`src` converted to big-endian by the gguf package's own tool
    (gguf/scripts/gguf_convert_endian.py, which llama.cpp ships for s390x hosts): header,
    metadata, float tensors and the float16 fields of Q8_0 / Q4_0 (/ Q4_K / Q6_K) blocks."""
    import argparse
    import logging

    from gguf.scripts import gguf_convert_endian
    shutil.copyfile(src, dst)
    reader = gguf.GGUFReader(dst, "r+")
    asked = builtins.input
    level = logging.getLogger("gguf-convert-endian").level
    builtins.input = lambda prompt="": "YES"
    logging.getLogger("gguf-convert-endian").setLevel(logging.ERROR)
    try:
        gguf_convert_endian.convert_byteorder(reader, argparse.Namespace(order="big", dry_run=False))
    finally:
        builtins.input = asked
        logging.getLogger("gguf-convert-endian").setLevel(level)
    reader.data.flush()
    del reader
    return pathlib.Path(dst)


def write_big_endian_as_is(src, dst) -> pathlib.Path:
    """`src` rewritten by the package's writer with endianess=BIG and each tensor's bytes
    as stored (the writer swaps float tensors, not the fields inside quantized blocks)."""
    reader = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents(), endianess=gguf.GGUFEndian.BIG)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        w.add_key_value(key, field.contents(), field.types[0], field.types[-1] if field.types[0] == V.ARRAY else None)
    for t in reader.tensors:
        data = np.array(t.data)
        if t.tensor_type in (T.F32, T.F16):
            w.add_tensor(t.name, data)
        else:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return pathlib.Path(dst)


def value(path, key: str) -> Any:
    field = gguf.GGUFReader(path).fields.get(key)
    return None if field is None else field.contents()


def named_pipe(path) -> pathlib.Path:
    """A named pipe at `path`, with a writer that, for 2 minutes, feeds a GGUF-looking header to
    whoever opens it for reading (so a reader that should not have opened it gets data
    instead of waiting forever, and a test of it fails instead of hanging)."""
    import os
    import threading
    import time
    os.mkfifo(path)

    def writer():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:  # succeeds only while someone has the pipe open for reading
                fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                time.sleep(0.02)
                continue
            try:
                os.write(fd, b"GGUF" + b"\0" * 60)
            except OSError:
                pass
            os.close(fd)

    threading.Thread(target=writer, daemon=True).start()
    return pathlib.Path(path)


def with_layers(src, dst, layers: int) -> pathlib.Path:
    """A copy of `src` with `layers` layers: its blocks repeated in turn (blk.i is a copy of
    blk.(i mod the file's count)), block_count set to match."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key == f"{arch}.block_count":
            continue
        w.add_key_value(key, field.contents(), field.types[0], field.types[-1] if field.types[0] == V.ARRAY else None)
    w.add_key_value(f"{arch}.block_count", layers, V.UINT32)
    tensors = {t.name: t for t in reader.tensors}
    have = reader.fields[f"{arch}.block_count"].contents()

    def add(name, t):
        data = np.array(t.data)
        if t.tensor_type in (T.F32, T.F16):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=t.tensor_type)
    for name, t in tensors.items():
        if not name.startswith("blk."):
            add(name, t)
    for i in range(layers):
        for name, t in tensors.items():
            if name.startswith(f"blk.{i % have}."):
                add(f"blk.{i}." + name.split(".", 2)[2], t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return pathlib.Path(dst)
