"""Hugging Face checkpoints: import a model directory as a sharded `LM`, and export an
`LM` as a directory that transformers loads unchanged.

A directory holds `config.json`, `model.safetensors` (or shards listed in
`model.safetensors.index.json`), a tokenizer (`tokenizer.json` and/or `tokenizer.model`,
see `tokenizer.HFTokenizer`) and `generation_config.json`. Which architectures are read,
how their config.json keys become a `ModelConfig` and where each param lives is the
families' (`weights/arch/`: Llama, Mistral, Qwen2/2.5, Qwen3, Gemma 3); this module reads
and writes the files for all of them.

The layouts. transformers' nn.Linear stores W as [out, in] (y = x W^T); specjax keeps
[in, out] with heads as their own axes: a family's `Tensor.layout` says which of 'same',
'transpose', 'heads_out' ([N*H, D] -> [N, D, H]), 'heads_in' ([D, N*H] -> [N, H, D]) or
'heads' (a bias [N*H] -> [N, H]) turns the HF tensor into the param (`from_hf`, `to_hf`).

Loading: every parameter is created directly as a sharded `jax.Array`, in the HF
tensor's layout but partitioned so that each device gets exactly the elements of its own
shard of the specjax param (`hf_spec`), and one jitted transpose per param rearranges the
shards in place on the devices (no collective). Each process reads from the safetensors
files only the boxes its own devices hold, each byte range once (`read_once`: JAX's
`make_array_from_callback` would call back once per device, and de-duplicates only fully
replicated arrays), and a column split (down_proj, o_proj: a device holds some columns of
every row) as strided ranges of those columns, not whole rows. So no host ever builds a
whole parameter, let alone the model. With fewer kv heads than the 'model' mesh axis the
k/v projections are duplicated (`kv_heads`): each device reads the one file head its copy
comes from. Weights keep their stored dtype unless the caller asks for another (bf16
stays bf16). Paths are local or any `etils.epath` path (gs://, with gcsfs installed).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pathlib
import re
import shutil
from typing import Any, Optional

import jax
import numpy as np
from etils import epath
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from specjax import distributed, kv_heads, sharding
from specjax.config import ConfigError, ModelConfig, UsageError, check_remote_support
from specjax.model import LM, abstract_lm
from specjax.weights import arch, hf_files, safetensors_io
from specjax.weights.arch.common import LLAMA, Tensor
from specjax.weights.hf_files import TEXT, Fields
from specjax.weights.tokenizer import HFTokenizer, TokenizerError, load_hf_tokenizer

DTYPES = ("float32", "bfloat16", "float16")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")
MAX_SHARD_BYTES = 5 << 30
_LAYER = re.compile(r"model\.layers\.([0-9]+)\.")
# Saved by some older transformers versions though computed from the config: not a weight.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def as_path(directory) -> epath.Path:
    """A local path ('~' expanded) or any etils.epath path (gs://)."""
    text = os.fspath(directory)
    check_remote_support(text)
    return epath.Path(text if "://" in text else os.path.expanduser(text))


def model_dir(directory) -> epath.Path:
    """`directory` as a path, refused (one line) unless it is a directory."""
    if not os.fspath(directory).strip():
        raise UsageError(f"{os.fspath(directory)!r}: an empty path, not a Hugging Face model directory")
    path = as_path(directory)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{path}: is a file, not a Hugging Face model directory (give the directory that holds "
                         "config.json)")
    return path


# --------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class HFModel:
    """What a directory's config files say: the model, and the ids generation uses."""

    directory: str
    model: ModelConfig
    architecture: str
    dtype: str  # the dtype the weights are stored in
    bos_id: Optional[int]
    eos_ids: tuple[int, ...]  # generation_config.json's eos_token_id (any of them ends a row)
    family: str = "llama"  # its module in weights/arch/

    @property
    def tensors(self) -> dict[str, Tensor]:
        return getattr(arch, self.family).TENSORS


def _stored_dtype(f: Fields) -> str:
    """The weights' dtype: `dtype` (transformers 5) or `torch_dtype` (4.x)."""
    return f.get("dtype", TEXT.or_null(), None) or f.get("torch_dtype", TEXT.or_null(), None) or "float32"


def model_config(raw: dict, where: str = "config.json", *, param_dtype: Optional[str] = None,
                 compute_dtype: Optional[str] = None, scan_layers: bool = False) -> tuple[ModelConfig, str]:
    """(ModelConfig, architecture) of a parsed config.json, as its family reads it
    (`arch.for_hf`); refuses what specjax's model cannot compute exactly, naming the key.
    dtypes default to the stored one."""
    f = raw if isinstance(raw, Fields) else Fields(raw, where)
    family, architecture = arch.for_hf(f)
    fields = family.from_hf(f)
    stored = _stored_dtype(f)
    if stored not in DTYPES:
        raise UsageError(f"{f.where}: dtype {stored!r} is not supported; supported: {', '.join(DTYPES)}")
    fields.update(param_dtype=param_dtype or stored, compute_dtype=compute_dtype or param_dtype or stored,
                  scan_layers=scan_layers)
    try:
        return ModelConfig(**fields).validate(), architecture
    except ConfigError as e:
        raise UsageError(f"{f.where}: {e}") from None


def read_config(directory, *, param_dtype: Optional[str] = None, compute_dtype: Optional[str] = None,
                scan_layers: bool = False) -> HFModel:
    """The directory's model and generation ids, from its JSON files alone (no weights read)."""
    directory = model_dir(directory)
    f = hf_files.read_json(directory / "config.json", "config.json describes the model")
    cfg, architecture = model_config(f, param_dtype=param_dtype, compute_dtype=compute_dtype, scan_layers=scan_layers)
    bos, eos = hf_files.generation_ids(directory, cfg.vocab_size, fallback=f)
    return HFModel(str(directory), cfg, architecture, _stored_dtype(f), bos, eos or (), arch.name(arch.for_hf(f)[0]))


def tokenizer(directory) -> Optional[HFTokenizer]:
    """The directory's tokenizer (None without tokenizer files); bad files are UsageErrors."""
    try:
        return load_hf_tokenizer(model_dir(directory))
    except TokenizerError as e:
        raise UsageError(str(e)) from None


def same_vocabulary(t: Optional[HFTokenizer], d: Optional[HFTokenizer]) -> None:
    """Raise UsageError unless the target's and the draft's tokenizers (from a directory
    or a GGUF file; None: no tokenizer) map every token to the same id (equal sizes are
    not enough: the ratio q(x)/p(x) must compare the same token)."""
    if t is None or d is None:
        return
    tv, dv = t.vocabulary(), d.vocabulary()
    if tv != dv:
        differ = sorted(k for k in set(tv) | set(dv) if tv.get(k) != dv.get(k))
        raise UsageError(f"the target's tokenizer ({t.path}, {len(tv)} tokens) and the draft's ({d.path}, "
                         f"{len(dv)} tokens) differ on {len(differ)} tokens (e.g. {differ[:3]}): speculative "
                         "sampling needs a draft with the target's vocabulary")


# --------------------------------------------------------------------------- weights


def to_hf(layout: str, x: np.ndarray) -> np.ndarray:
    """A specjax param (one layer) in the HF tensor's layout."""
    if layout == "same":
        return x
    if layout == "transpose":
        return x.T
    if layout == "heads_out":  # [N, D, H] -> [N*H, D]
        return x.swapaxes(-1, -2).reshape(-1, x.shape[-2])
    if layout == "heads":
        return x.reshape(-1)
    return x.reshape(-1, x.shape[-1]).T


def hf_shape(layout: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF tensor's shape for a param of `shape` (one layer)."""
    return tuple(to_hf(layout, np.empty(shape, np.bool_)).shape)


def hf_spec(layout: str, spec: tuple) -> tuple:
    """The partition of the HF tensor that puts on each device the elements of its shard
    of the specjax param (head_dim is never split, so splitting heads of [N*H, ...]
    splits whole heads)."""
    if layout == "same":
        return spec
    if layout == "transpose":
        return spec[::-1]
    if layout == "heads_out":  # [N, D, H] <- [N*H, D]
        return (spec[0], spec[1])
    if layout == "heads":  # [N, H] <- [N*H]
        return (spec[0],)
    return (spec[2], spec[0])  # heads_in: [N, H, D] <- [D, N*H]


def from_hf(layout: str, x, shape: tuple[int, ...]):
    """The specjax param of `shape` from the HF tensor `x` (numpy or jax, one layer or a
    leading layer axis): 'heads_out' splits the rows N*H into (N, H) and swaps H with the
    inputs; every other layout but 'same' is the transpose of the last two axes, then a
    reshape that splits N*H into (N, H); a bias ('heads') is the reshape alone."""
    if layout == "heads":
        return x.reshape(shape)
    if layout == "heads_out":  # [..., N*H, D] -> [..., N, D, H]
        return x.reshape(*shape[:-3], shape[-3], shape[-1], shape[-2]).swapaxes(-1, -2)
    return x if layout == "same" else x.swapaxes(-1, -2).reshape(shape)


@functools.lru_cache(maxsize=None)
def _on_device(layout: str, shape: tuple[int, ...], dtype, out: jax.sharding.Sharding):
    # Transposing on the devices, shard by shard, is 4x faster than numpy on the host and
    # needs no collective: each device's HF slice holds exactly its own shard's elements.
    return jax.jit(lambda x: from_hf(layout, x, shape).astype(dtype), out_shardings=out)


def _param_key(path) -> tuple[str, Optional[int]]:
    """('attn/wq', layer index or None) of a param's tree path."""
    keys = [getattr(k, "key", getattr(k, "idx", k)) for k in path]
    if keys and keys[-1] == "value":
        keys = keys[:-1]
    if keys[0] == "layers":
        if isinstance(keys[1], int):
            return "/".join(map(str, keys[2:])), keys[1]
        return "/".join(map(str, keys[1:])), None
    return "/".join(map(str, keys)), None


def expected_tensors(cfg: ModelConfig, tensors: dict[str, Tensor] = LLAMA) -> dict[str, tuple[int, ...]]:
    """{HF tensor name: shape} of the model `cfg` describes (every param it has), named by
    a family's `tensors`, globals first, then layer by layer."""
    one = abstract_lm(dataclasses.replace(cfg, scan_layers=False)).params
    out: dict[str, tuple[int, ...]] = {}
    for path, v in jax.tree_util.tree_flatten_with_path(one, is_leaf=_is_variable)[0]:
        key, layer = _param_key(path)
        t = tensors[key]
        out[t.hf.format(i=layer)] = hf_shape(t.layout, tuple(v.value.shape))
    order = lambda n: (n.startswith("model.layers."), int(n.split(".")[2]) if n.startswith("model.layers.") else 0)  # noqa: E731
    return dict(sorted(out.items(), key=lambda kv: order(kv[0])))


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def read_index(path) -> dict[str, str]:
    """model.safetensors.index.json's weight_map: {tensor name: file name in the directory}."""
    f = hf_files.read_json(path)
    weight_map = f.section("weight_map")
    if not weight_map.raw:
        raise UsageError(f"{path}: has no weight_map (tensor name -> safetensors file)")
    for name in weight_map.raw:
        fname = weight_map.get(name, TEXT)
        if "/" in fname or "\\" in fname or fname in ("", ".", ".."):
            raise weight_map.refuse(name, fname, "must be the name of a file in the model directory")
    return dict(weight_map.raw)


class WeightFiles:
    """The safetensors files of a directory and which tensor lives in which file."""

    def __init__(self, directory, *, local: Optional[bool] = None):
        directory = model_dir(directory)
        index = directory / "model.safetensors.index.json"
        if index.exists():
            weight_map = read_index(index)
            names = sorted(set(weight_map.values()))
        elif (directory / "model.safetensors").exists():
            names, weight_map = ["model.safetensors"], None
        else:
            other = [p.name for p in directory.glob("*.bin")] if directory.exists() else []
            raise UsageError(f"{directory}: no weights: neither model.safetensors nor model.safetensors.index.json"
                             + (f" (found {', '.join(sorted(other))}: only safetensors are read; transformers' "
                                "save_pretrained(safe_serialization=True) writes them)" if other else ""))
        for n in names:
            if (directory / n).is_dir():
                raise UsageError(f"{directory / n}: is a directory, not a safetensors file")
        self.files = {n: safetensors_io.SafetensorsFile(directory / n, local=local) for n in names}
        self.where: dict[str, safetensors_io.SafetensorsFile] = {}
        for file in self.files.values():
            for name in file.tensors:
                self.where[name] = file
        if weight_map is not None:
            for name, fname in weight_map.items():
                if name not in self.files[fname].tensors:
                    raise UsageError(f"{index} places {name!r} in {fname}, which does not hold it")

    @property
    def bytes_read(self) -> int:
        return sum(f.bytes_read for f in self.files.values())

    def info(self, name: str) -> safetensors_io.TensorInfo:
        return self.where[name].tensors[name]

    def read(self, name: str, index=None) -> np.ndarray:
        return self.where[name].read(name, index)

    def check(self, cfg: ModelConfig, directory, tensors: dict[str, Tensor] = LLAMA) -> None:
        """Every tensor the model needs (named by its family's `tensors`) is there with its
        shape and a float dtype, and nothing is left over that the model would silently
        drop (biases it lacks, extra heads)."""
        # Before anything counts layers: a wrong count must not make a billion tensor names.
        layers = {int(m[1]) for n in self.where if (m := _LAYER.match(n))}
        if cfg.num_layers != len(layers) or (layers and max(layers) != cfg.num_layers - 1):
            raise UsageError(f"{as_path(directory) / 'config.json'}: num_hidden_layers={cfg.num_layers}: the "
                             f"safetensors files hold {len(layers)} layers"
                             + (f" (model.layers.{min(layers)} .. model.layers.{max(layers)})" if layers else ""))
        wanted = expected_tensors(cfg, tensors)
        missing = [n for n in wanted if n not in self.where]
        if missing:
            raise UsageError(f"{directory}: tensor {missing[0]} is missing from the safetensors files"
                             + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                             + f"; the config describes a {cfg.num_layers}-layer model")
        for name, shape in wanted.items():
            info = self.info(name)
            if info.shape != shape:
                raise UsageError(f"{directory}: tensor {name} has shape {list(info.shape)}, the config needs "
                                 f"{list(shape)}")
            if info.dtype.kind != "f" and info.dtype != safetensors_io.DTYPES["BF16"]:
                raise UsageError(f"{directory}: tensor {name} is {info.dtype}, expected a float dtype")
        extra = [n for n in self.where if n not in wanted and not n.endswith(IGNORED_SUFFIXES)
                 and not (n == "lm_head.weight" and cfg.tie_embeddings)]
        if extra:
            raise UsageError(f"{directory}: unexpected tensors {extra[:3]}"
                             + (f" and {len(extra) - 3} more" if len(extra) > 3 else "")
                             + ": the model has no such weights")

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def check_weights(directory, cfg: ModelConfig, tensors: dict[str, Tensor] = LLAMA) -> None:
    """`WeightFiles.check` from the files' headers alone: bad weights fail before device work."""
    files = WeightFiles(directory)
    try:
        files.check(cfg, directory, tensors)
    finally:
        files.close()


def _unit(index, shape) -> tuple[slice, ...]:
    """An index as one unit-step slice per axis, bounds resolved."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))


def read_once(shape: tuple[int, ...], sharding_: jax.sharding.Sharding, read, source=None) -> jax.Array:
    """The global array of `shape` and `sharding_` whose shards on this process's devices
    come from `read(box)` (a host array of one box of the source), every source byte read
    once per process: `jax.make_array_from_callback` would call back once per device
    (several devices of a host hold the same shard under a 'data' axis, or the same kv
    head after duplication). `source(index)` maps a device's index to (the source box to
    read, a function from that box to the device's shard), default (index, None). When
    the distinct boxes tile their bounding box (a host's devices hold adjacent shards,
    the usual device order), that one box is read (a column split then costs one strided
    read for the host, not one per device)."""
    wanted = {}  # device -> ((start, stop) per axis of its source box, post)
    for device, index in sharding_.addressable_devices_indices_map(shape).items():
        box, post = source(_unit(index or (), shape)) if source is not None else (_unit(index or (), shape), None)
        wanted[device] = (tuple((s.start, s.stop) for s in box), post)
    boxes = {box for box, _ in wanted.values()}  # (slices are unhashable before Python 3.12)
    ndim = len(next(iter(boxes)))
    lo = [min(b[i][0] for b in boxes) for i in range(ndim)]
    hi = [max(b[i][1] for b in boxes) for i in range(ndim)]
    volume = sum(math.prod(stop - start for start, stop in b) for b in boxes)
    if len(boxes) > 1 and volume == math.prod(h - l for l, h in zip(lo, hi)):
        whole = read(tuple(slice(l, h) for l, h in zip(lo, hi)))
        host = {b: whole[tuple(slice(a - l, z - l) for (a, z), l in zip(b, lo))] for b in boxes}
    else:
        host = {b: read(tuple(slice(a, z) for a, z in b)) for b in boxes}
    shards = []
    for device, (box, post) in wanted.items():
        x = host[box] if post is None else post(host[box])
        shards.append(jax.device_put(np.ascontiguousarray(x), device))
    return jax.make_array_from_single_device_arrays(shape, sharding_, shards)


def kv_source(c: int, head_dim: int, stacked: bool):
    """`read_once`'s `source` for a k/v projection or bias whose heads are duplicated c
    times: the rows (heads: the first axis after a `stacked` layer axis) of [cG*H, ...]
    read from the file's [G*H, ...], each head repeated as the duplication repeats it."""
    axis = int(stacked)

    def source(index):
        rows, expand = kv_heads.head_rows(index[axis], c, head_dim)
        post = (lambda x: np.stack([expand(y) for y in x])) if stacked else expand
        return index[:axis] + (rows,) + index[axis + 1:], post
    return source


def load_params(cfg: ModelConfig, mesh: jax.sharding.Mesh, files: WeightFiles, keep=None,
                tensors: dict[str, Tensor] = LLAMA) -> LM:
    """The LM whose params are the files' tensors. Each is created sharded on `mesh` in
    the HF layout from the boxes this process's devices hold, each byte range read once
    per process (`read_once`), then rearranged on the devices. With duplicated kv heads
    (`cfg.kv_copies` > 1, `kv_heads.for_mesh`) the k/v projections are read as the file's
    heads each device's copies come from. `keep(path, variable)`, if given, is asked first
    for each param (its variable holds the abstract array: shape and sharding): a variable
    it returns is taken instead, and that tensor is not read as floats (a GGUF file's
    quantized blocks kept as stored). `tensors`: the family's names of the params."""
    abstract = abstract_lm(cfg, mesh)
    flat = dataclasses.replace(cfg, scan_layers=False)
    hf_shapes = expected_tensors(flat, tensors)
    c, H = cfg.kv_copies, cfg.head_dim

    def make(path, v):
        kept = keep(path, v) if keep is not None else None
        if kept is not None:
            return kept
        key, layer = _param_key(path)
        name, layout = tensors[key].hf, tensors[key].layout
        shape, sharding_ = tuple(v.value.shape), v.value.sharding
        spec = tuple(sharding_.spec) + (None,) * (len(shape) - len(sharding_.spec))
        stacked = cfg.scan_layers and name.startswith("model.layers.")
        if stacked:
            layers = cfg.num_layers
            hf_shape, spec_hf = (layers,) + hf_shapes[name.format(i=0)], (spec[0],) + hf_spec(layout, spec[1:])
        else:
            hf_shape, spec_hf = hf_shapes[name.format(i=layer)], hf_spec(layout, spec)
        source = kv_source(c, H, stacked) if kv_heads.is_kv(key) and c > 1 else None

        def read(box):
            if not stacked:
                return files.read(name.format(i=layer), box)
            return np.stack([files.read(name.format(i=i), box[1:]) for i in range(box[0].start, box[0].stop)])

        raw = read_once(hf_shape, NamedSharding(mesh, P(*spec_hf)), read, source)
        return v.replace(_on_device(layout, shape, jax.numpy.dtype(cfg.param_dtype), sharding_)(raw))

    params = jax.tree_util.tree_map_with_path(make, abstract.params, is_leaf=_is_variable)
    return LM(cfg, abstract.graphdef, params)


def load(directory, mesh: jax.sharding.Mesh, *, param_dtype: Optional[str] = None,
         compute_dtype: Optional[str] = None, scan_layers: bool = False,
         local: Optional[bool] = None) -> tuple[LM, Optional[HFTokenizer]]:
    """(LM, tokenizer or None) of a Hugging Face model directory, the params sharded on
    `mesh` as `sharding.RULES` says. Every problem a directory can have (missing or damaged
    files, another architecture, a missing or misshapen tensor) is a one-line UsageError,
    raised before any device work."""
    lm, tok, _ = load_with_stats(directory, mesh, param_dtype=param_dtype, compute_dtype=compute_dtype,
                                 scan_layers=scan_layers, local=local)
    return lm, tok


def load_with_stats(directory, mesh, *, param_dtype=None, compute_dtype=None, scan_layers=False,
                    local=None) -> tuple[LM, Optional[HFTokenizer], dict[str, Any]]:
    """`load`, plus {'bytes_read': bytes this process read from the weight files,
    'file_bytes': the tensors' total size}."""
    info = read_config(directory, param_dtype=param_dtype, compute_dtype=compute_dtype, scan_layers=scan_layers)
    tok = tokenizer(directory)
    files = WeightFiles(directory, local=local)
    try:
        files.check(info.model, directory, info.tensors)
        cfg = kv_heads.for_mesh(info.model, mesh)
        sharding.check_divisible(cfg, mesh)
        lm = load_params(cfg, mesh, files, tensors=info.tensors)
        jax.block_until_ready(lm.params)
        stats = {"bytes_read": files.bytes_read,
                 "file_bytes": sum(files.info(n).nbytes for n in expected_tensors(info.model, info.tensors))}
    finally:
        files.close()
    return lm, tok, stats


# --------------------------------------------------------------------------- export


def exportable(cfg: ModelConfig):
    """The family (`weights/arch/`) whose transformers class expresses the model exactly;
    UsageError naming what each family lacks where none does."""
    if cfg.pos_encoding != "rope":
        raise UsageError(f"cannot export a model with pos_encoding={cfg.pos_encoding!r} as a Hugging Face directory: "
                         "the families have rotary positions only, no Transformer-XL relative position terms")
    if cfg.parallel_draft:
        raise UsageError(f"cannot export a parallel draft model (parallel_draft={cfg.parallel_draft}) as a Hugging Face "
                         "directory: its mask token's input embedding is a row past the vocabulary, which no family's "
                         "config expresses")
    return arch.for_export(cfg)


def hf_config(cfg: ModelConfig, bos_id: Optional[int] = None, eos_ids=()) -> dict:
    """config.json for `cfg`, as its family writes it (rope settings in the layout
    transformers 4.x and 5.x both read: top-level rope_theta and rope_scaling)."""
    eos = list(eos_ids)
    return {**exportable(cfg).to_hf(cfg), "bos_token_id": bos_id,
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None), "torch_dtype": cfg.param_dtype}


def check_export_dir(directory, flag: str = "export directory") -> epath.Path:
    """Refuse (UsageError, before any work) unless `directory` can receive a new export:
    it does not exist (and could be created) or is an empty directory.

    Why refuse a non-empty one rather than write over it: an export beside an older one
    mixes them (the loader prefers model.safetensors.index.json, so a single-file export
    next to an older sharded one silently loads the old weights), and replacing the whole
    directory would delete whatever else it holds (a typo'd --export_hf=~/models, the
    teacher's own directory). So a directory that holds anything is the user's to remove."""
    path = as_path(directory)
    text = os.fspath(directory)
    if not text.strip():
        raise UsageError(f"{flag}={text!r}: empty path")
    if path.exists():
        if not path.is_dir():
            raise UsageError(f"{flag}={text!r}: is a file; an export is a directory (give a new or empty one)")
        held = sorted(p.name for p in path.iterdir())
        if held:
            raise UsageError(f"{flag}={text!r}: the directory is not empty (it holds {', '.join(held[:4])}"
                             + (f" and {len(held) - 4} more" if len(held) > 4 else "") + "); an export writes a new "
                             "model directory and never mixes with or deletes what is there: remove it first, or "
                             "give a new or empty directory")
        if "://" not in text and not os.access(path, os.W_OK | os.X_OK):
            raise UsageError(f"{flag}={text!r}: the directory is not writable")
        return path
    if "://" in text:
        return path
    parent = pathlib.Path(os.fspath(path)).parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"{flag}={text!r}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag}={text!r}: cannot create it, the directory {parent} is not writable")
    return path


def _staging(directory: pathlib.Path) -> pathlib.Path:
    """A fresh sibling of `directory` to write an export into, first removing the ones
    that exports killed before their end left behind (their process is gone)."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{directory.name}.export-"
    for old in directory.parent.iterdir():
        pid = old.name[len(prefix):-len(".partial")]
        if old.name.startswith(prefix) and old.name.endswith(".partial") and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    staging = directory.parent / f"{prefix}{os.getpid()}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    return staging


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def export(lm: LM, directory, *, tokenizer_dir=None, bos_id: Optional[int] = None, eos_ids=(),
           max_shard_bytes: int = MAX_SHARD_BYTES) -> epath.Path:
    """Write `lm` as a Hugging Face directory of the family that expresses it (`exportable`:
    Llama, Qwen2, Qwen3, Gemma 3, ...; config.json, generation_config.json,
    safetensors in the params' dtype, and the tokenizer files of `tokenizer_dir` if
    given). Every process must call it (params are gathered tensor by tensor); process 0
    writes. An untied model's input-embedding scale is folded into the table.

    `directory` must not exist or be empty (`check_export_dir`). A local export is
    written into a hidden sibling and renamed into place at the end, so the directory
    appears whole or not at all (a killed export leaves no half-model under its name;
    the next export clears what it left). gs:// has no rename: there the files are
    written in place."""
    from specjax.kernels import is_quantized
    if is_quantized(lm.params):
        raise UsageError("cannot export a model with quantized (int8/int4) weights as Hugging Face safetensors: "
                         "export the float model it was quantized from")
    lm = kv_heads.undo(lm)  # a model loaded with duplicated kv heads is written with its own
    cfg = lm.cfg
    family = exportable(cfg)
    distributed.agreed(lambda: check_export_dir(directory) and None)  # process 0 writes: its answer counts
    target = as_path(directory)
    remote = "://" in os.fspath(directory)
    dtype = np.dtype(jax.numpy.dtype(cfg.param_dtype))
    source = {}  # HF name -> (param array, layer of a stacked param or None, layout, specjax key)
    for path, v in jax.tree_util.tree_flatten_with_path(lm.params, is_leaf=_is_variable)[0]:
        key, layer = _param_key(path)
        name, layout = family.TENSORS[key].hf, family.TENSORS[key].layout
        if cfg.scan_layers and name.startswith("model.layers."):
            source.update({name.format(i=i): (v.value, i, layout, key) for i in range(cfg.num_layers)})
        else:
            source[name.format(i=layer)] = (v.value, None, layout, key)
    tensors = [(name, dtype, shape) for name, shape in expected_tensors(cfg, family.TENSORS).items()]

    def value(name):
        array, stacked, layout, key = source[name]
        x = np.asarray(distributed.fetch(array[stacked] if stacked is not None else array))
        return to_hf(layout, np.asarray(arch.to_hf_value(family, cfg, key, x), dtype))

    shards, size = [[]], 0
    for t in tensors:
        nbytes = math.prod(t[2]) * dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nbytes
    main = distributed.is_main()
    if main:
        if remote:
            out = target
            out.mkdir(parents=True, exist_ok=True)
        else:
            out = epath.Path(_staging(pathlib.Path(os.fspath(target))))
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    for fname, shard in zip(names, shards):
        if main:
            safetensors_io.write(out / fname, shard, value, metadata={"format": "pt"})
        else:
            for t in shard:
                value(t[0])  # the gathers are collective: every process takes part
    if not main:
        return target
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(math.prod(t[2]) * dtype.itemsize for t in tensors)},
                 "weight_map": {t[0]: fname for fname, shard in zip(names, shards) for t in shard}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(hf_config(cfg, bos_id, eos_ids), indent=2) + "\n")
    generation = {"bos_token_id": bos_id, "eos_token_id": (list(eos_ids) if len(eos_ids) != 1 else eos_ids[0])
                  if eos_ids else None}
    (out / "generation_config.json").write_text(
        json.dumps({k: v for k, v in generation.items() if v is not None}, indent=2) + "\n")
    if tokenizer_dir is not None:
        for fname in TOKENIZER_FILES:
            src = as_path(tokenizer_dir) / fname
            if src.exists():
                src.copy(out / fname, overwrite=True)
    if not remote:
        try:
            # rename(2) onto a missing or EMPTY directory replaces it in one step.
            os.rename(os.fspath(out), os.fspath(target))
        except OSError as e:
            raise UsageError(f"{target}: cannot move the finished export into place ({e.strerror or e}; something "
                             f"was written there meanwhile?); the export is kept in {out}") from None
    return target
