"""Checkpoints: orbax steps with the params, the optimiser state and a JSON record of
the model config, plus the tokenizer the model was trained with.

Layout of a checkpoint directory (the trainer's workdir, by default
`cache_dir()/checkpoints/CONFIG_NAME`, where `specjax.sample` looks):

    DIR/tokenizer.model      SentencePiece model (configs with tokenizer_vocab > 0)
    DIR/metrics.jsonl        training metrics, one JSON record a line
    DIR/train.lock           flock'ed by the one training run writing here (holds its pid)
    DIR/<step>/params/       nnx.State of the params (orbax StandardSave)
    DIR/<step>/opt_state/    optax state (trainer checkpoints only)
    DIR/<step>/meta/         JSON: config name, ModelConfig, TrainConfig, step, seed, and the
                             metrics of the steps since the last 'train' record

The data position and every random choice of the trainer are pure functions of
(seed, step), so the step in `meta` is all the data-loader/RNG state there is.

Restores go straight onto the caller's mesh: the target is an abstract tree whose
leaves carry `sharding.param_shardings` of that mesh, so a checkpoint written on a 1x8
mesh loads on 2x4 or on one device. Every failure a user can cause (no directory, no
step, another config, wrong shapes, a damaged step) is a `UsageError` with a one-line
message; nothing here deletes or rewrites an existing step. A step of an older format (`FORMAT`)
is read in its own layout and rearranged on the devices (`_in_format`), params and
optimiser state alike.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pathlib
import shutil
import sys
from typing import Any, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging as absl_logging

from specjax import kv_heads, sharding
from specjax.config import HeadsConfig, ModelConfig, UsageError, cache_dir, user_path
from specjax.heads import Heads, abstract_heads, draft_vocabulary
from specjax.model import LM, abstract_lm

# 2: q, k and v heads-major, [..., N, D, H]. 1 (read, never written): [..., D, N, H].
FORMAT = 2
HEADS_MAJOR = ("wq", "wk", "wv")  # the params whose layout format 2 changed
TOKENIZER_FILE = "tokenizer.model"
# Fields that do not change what the saved arrays mean: a checkpoint loads whatever
# they are set to (sampling may keep or compute in bfloat16, or use a longer cache;
# orbax casts the saved arrays to the requested param dtype).
RUNTIME_FIELDS = frozenset({"init_seed", "max_seq_len", "compute_dtype", "param_dtype"})


class _QuietReadOnly(logging.Filter):
    """Orbax warns on every read-only manager (each `load_lm`); reading is what we mean."""

    def filter(self, record):
        return not record.getMessage().startswith("Given directory is read only")


absl_logging.get_absl_logger().addFilter(_QuietReadOnly())


_unfinished_reads: set[str] = set()  # steps whose last read failed or is still running


def _quiet_failed_restore(previous):
    """When one array of a restore fails, orbax closes its event loop while TensorStore
    still finishes the step's other reads: each reports "Event loop is closed", or its
    orbax coroutine dies with the same read error, as an unraisable exception (dozens
    of tracebacks on stderr after our one-line message). While a read has not
    succeeded, those leftovers of it are dropped; anything else still goes to
    `previous`."""
    def leftover(unraisable) -> bool:
        error, source = unraisable.exc_value, unraisable.object
        if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
            return True
        code = getattr(source, "cr_code", None)  # a coroutine
        return code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename

    def hook(unraisable):
        if not (_unfinished_reads and leftover(unraisable)):
            previous(unraisable)
    return hook


sys.unraisablehook = _quiet_failed_restore(sys.unraisablehook)


def default_dir(config_name: str) -> pathlib.Path:
    """Where `python -m specjax.train --config=NAME` writes and `specjax.sample` reads."""
    return cache_dir() / "checkpoints" / config_name


def tokenizer_path(directory) -> pathlib.Path | None:
    path = user_path(directory) / TOKENIZER_FILE
    return path if path.is_file() else None


def save_tokenizer(directory, source) -> pathlib.Path:
    """Copy a SentencePiece model next to the checkpoints (atomically: a reader never
    sees half a file). Returns the copy's path."""
    target = pathlib.Path(directory) / TOKENIZER_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(TOKENIZER_FILE + ".tmp")
    shutil.copyfile(source, tmp)
    tmp.replace(target)
    return target


def config_differences(saved: Mapping[str, Any], cfg: ModelConfig) -> list[str]:
    """'field=saved (checkpoint) vs now (config)' for every field that matters. A field
    the checkpoint does not record (it was added to ModelConfig later) counts as its
    default, which keeps the meaning older checkpoints were trained with."""
    now = dataclasses.asdict(cfg)
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    saved = {**{k: v for k, v in defaults.items() if k in now}, **saved}
    out = []
    for name in sorted(set(saved) | set(now)):
        if name in RUNTIME_FIELDS:
            continue
        if saved.get(name, "<absent>") != now.get(name, "<absent>"):
            out.append(f"{name}={saved.get(name, '<absent>')!r} (checkpoint) vs {now.get(name, '<absent>')!r} (config)")
    return out


def _keyed(tree) -> dict[str, Any]:
    """{path: leaf} with Variable wrappers and orbax's '.value' nodes ignored, so the
    saved tree and an nnx.State name their params the same way."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
        if keys and keys[-1] == "value":
            keys = keys[:-1]
        out["/".join(keys)] = leaf
    return out


def _in_format(tree, fmt: int, back: bool = False):
    """`tree` (abstract params or optimiser state) as a step of format `fmt` stores it:
    format 1's q/k/v [..., D, N, H] in place of [..., N, D, H], each sharded as its own axes
    are. `back`: restored arrays of that format rearranged into `tree`'s (given as the
    abstract target, which `back` reads the shardings of)."""
    if fmt >= 2:
        return tree

    def one(path, leaf):
        keys = kv_heads._keys(path)
        if not keys or keys[-1] not in HEADS_MAJOR or len(leaf.shape) < 3:
            return leaf
        where = leaf.sharding
        spec = tuple(where.spec) + (None,) * (len(leaf.shape) - len(where.spec))
        spec = (*spec[:-3], spec[-2], spec[-3], spec[-1])
        where = jax.sharding.NamedSharding(where.mesh, jax.sharding.PartitionSpec(*spec))
        shape = (*leaf.shape[:-3], leaf.shape[-2], leaf.shape[-3], leaf.shape[-1])
        return jax.ShapeDtypeStruct(shape, leaf.dtype, sharding=where)
    return jax.tree_util.tree_map_with_path(one, tree)


def _from_format(restored, target, fmt: int):
    """Restored arrays of format `fmt` (`_in_format(target, fmt)`'s layout) in `target`'s."""
    if fmt >= 2 or restored is None:
        return restored

    def one(r, t):
        if tuple(r.shape) == tuple(t.shape):
            return r
        return jax.jit(lambda a: a.swapaxes(-3, -2), out_shardings=t.sharding)(r)
    return jax.tree.map(one, restored, target)


class Checkpoints:
    """The orbax CheckpointManager of one directory, with our items and checks.

    `keep` is how many of the newest steps survive a save (None: all). `read_only`
    managers (used by `load_lm`) never create, clean up or delete anything."""

    def __init__(self, directory, keep: int | None = None, read_only: bool = False,
                 async_save: bool = True):
        self.directory = user_path(directory)  # gs:// too: orbax reads and writes it natively
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=not read_only, read_only=read_only,
            save_interval_steps=0 if read_only else 1,
            # Half-written steps of a killed run (orbax's *.orbax-checkpoint-tmp dirs);
            # finished steps are never touched.
            cleanup_tmp_directories=not read_only,
            enable_async_checkpointing=async_save and not read_only)
        self.manager = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={"params": ocp.StandardCheckpointHandler(),
                           "opt_state": ocp.StandardCheckpointHandler(),
                           "meta": ocp.JsonCheckpointHandler()})

    # ----------------------------------------------------------------- reading

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    @contextlib.contextmanager
    def _reading(self, step: int):
        """Any failure inside is a damaged step (a UsageError); see `_quiet_failed_restore`."""
        key = f"{self.directory}/{step}"
        _unfinished_reads.add(key)
        try:
            yield
        except Exception as e:  # noqa: BLE001 (any read failure means a damaged step)
            raise self._damaged(step, e) from e
        _unfinished_reads.discard(key)

    def _damaged(self, step: int, error: BaseException) -> UsageError:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        earlier = [s for s in self.steps() if s < step]
        hint = (f"; earlier steps {earlier} are untouched: load one with step=N, or move "
                f"{self.directory / str(step)} away to resume from step {earlier[-1]}"
                if earlier else "")
        return UsageError(f"checkpoint step {step} in {self.directory} is damaged or unreadable "
                          f"({type(error).__name__}: {first}){hint}")

    def meta(self, step: int) -> dict:
        with self._reading(step):
            meta = dict(self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])
        if not isinstance(meta.get("model"), dict):
            raise self._damaged(step, ValueError("meta has no 'model' record"))
        return meta

    def has_item(self, step: int, item: str) -> bool:
        return (self.directory / str(step) / item).is_dir()

    def check_compatible(self, step: int, cfg: ModelConfig, config_name: str = "",
                         abstract_params=None) -> dict:
        """Raise UsageError unless step `step` holds params for `cfg`; returns its meta."""
        meta = self.meta(step)
        diffs = config_differences(meta["model"], cfg)
        if diffs:
            saved_name = meta.get("config_name") or "?"
            raise UsageError(
                f"checkpoint step {step} in {self.directory} was trained with config {saved_name!r}, whose "
                f"model differs from {config_name or 'the requested config'}'s: {'; '.join(diffs)}")
        if abstract_params is not None:
            self._check_shapes(step, abstract_params, self._format_of(meta, step))
        return meta

    def format(self, step: int) -> int:
        """The layout step `step` was written in (`FORMAT`; 1 before the format was recorded)."""
        return self._format_of(self.meta(step), step)

    def _format_of(self, meta: dict, step: int) -> int:
        fmt = meta.get("format", 1)
        if not isinstance(fmt, int) or isinstance(fmt, bool) or not 1 <= fmt <= FORMAT:
            raise UsageError(f"checkpoint step {step} in {self.directory} has format {fmt!r}; this specjax "
                             f"reads formats 1 to {FORMAT} (a newer specjax wrote it?)")
        return fmt

    def _check_shapes(self, step: int, abstract_params, fmt: int) -> None:
        with self._reading(step):
            saved = self.manager.item_metadata(step)["params"]
        if saved is None:
            raise self._damaged(step, ValueError("no params item"))
        saved, wanted = _keyed(saved), _keyed(_in_format(abstract_params, fmt))
        missing, extra = sorted(set(wanted) - set(saved)), sorted(set(saved) - set(wanted))
        if missing or extra:
            raise UsageError(f"checkpoint step {step} in {self.directory} has other params than the model: "
                             f"missing {missing[:5]}, unexpected {extra[:5]}")
        bad = [f"{k}: {tuple(saved[k].shape)} (checkpoint) vs {tuple(wanted[k].shape)} (model)"
               for k in wanted if tuple(saved[k].shape) != tuple(wanted[k].shape)]
        if bad:
            raise UsageError(f"checkpoint step {step} in {self.directory} has wrong shapes: {'; '.join(bad[:5])}"
                             + (f" and {len(bad) - 5} more" if len(bad) > 5 else ""))

    def restore(self, step: int, abstract_params, abstract_opt_state=None):
        """(params, opt_state or None), placed as the abstract leaves' shardings say (a step of
        an older format rearranged into today's layout)."""
        fmt = self.format(step)
        items = {"params": ocp.args.StandardRestore(_in_format(abstract_params, fmt))}
        if abstract_opt_state is not None:
            if not self.has_item(step, "opt_state"):
                raise UsageError(f"checkpoint step {step} in {self.directory} holds params only (no "
                                 f"optimizer state), so training cannot resume from it")
            items["opt_state"] = ocp.args.StandardRestore(_in_format(abstract_opt_state, fmt))
        with self._reading(step):
            restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        opt_state = restored.get("opt_state") if abstract_opt_state is not None else None
        return (_from_format(restored["params"], abstract_params, fmt),
                _from_format(opt_state, abstract_opt_state, fmt))

    # ----------------------------------------------------------------- writing

    def save(self, step: int, params, meta: Mapping[str, Any], opt_state=None) -> bool:
        """Start writing step `step` (asynchronously: device buffers are copied before
        this returns, so the caller may donate them). A step that already exists is left
        alone. Orbax writes into a temporary directory and renames it when complete, so
        a process killed mid-save leaves every finished step as it was."""
        if step in self.manager.all_steps():
            return False
        items = {"params": ocp.args.StandardSave(params),
                 "meta": ocp.args.JsonSave({"format": FORMAT, "step": step, **meta})}
        if opt_state is not None:
            items["opt_state"] = ocp.args.StandardSave(opt_state)
        return self.manager.save(step, args=ocp.args.Composite(**items), force=True)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def abstract_params(cfg: ModelConfig, mesh: jax.sharding.Mesh):
    """(graphdef, params as ShapeDtypeStructs carrying `mesh`'s shardings): the restore
    target. Nothing is allocated."""
    abstract = abstract_lm(cfg, mesh)
    return abstract.graphdef, abstract.params


def model_meta(cfg: ModelConfig, config_name: str, **extra) -> dict:
    return {"config_name": config_name, "model": dataclasses.asdict(cfg), **extra}


def save_lm(lm: LM, directory, step: int = 0, config_name: str = "") -> None:
    """Write `lm`'s params as step `step` (no optimizer state) and wait for it; a model
    loaded with duplicated kv heads is written with its original ones."""
    lm = kv_heads.undo(lm)
    with Checkpoints(directory, async_save=False) as ckpt:
        ckpt.save(step, lm.params, model_meta(lm.cfg, config_name))
        ckpt.wait()


def newest_step(directory, name: str) -> int:
    """The newest finished step in `directory`, or a UsageError saying how to make one
    (`name`: the config that trains it)."""
    ckpt, step = _newest_step(user_path(directory), name)
    ckpt.close()
    return step


def _newest_step(directory, name: str, step: int | None = None) -> tuple[Checkpoints, int]:
    """(the directory's checkpoints, opened read-only; `step` or its newest one), or a
    UsageError saying how to make one."""
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"{directory} is a file, not a checkpoint directory (the directory that "
                         f"`python -m specjax.train --config={name} --workdir=DIR` writes)")
    if not directory.is_dir():
        raise UsageError(f"no checkpoint directory {directory}: train one with "
                         f"`python -m specjax.train --config={name}` (or set $SPECJAX_CACHE / "
                         f"pass the directory that holds it)")
    ckpt = Checkpoints(directory, read_only=True)
    steps = ckpt.steps()
    if not steps:
        ckpt.close()
        raise UsageError(f"{directory} holds no finished checkpoint: train one with "
                         f"`python -m specjax.train --config={name} --workdir={directory}`")
    if step is not None and step not in steps:
        ckpt.close()
        raise UsageError(f"{directory} has no checkpoint for step {step}; it has steps {steps}")
    return ckpt, steps[-1] if step is None else step


def heads_meta(hcfg: HeadsConfig, vocab) -> dict:
    """What a heads checkpoint records beside the target's shape: their config and, where
    they have one, the draft vocabulary's ids (`load_heads` reads both)."""
    return {"heads": dataclasses.asdict(hcfg),
            **({} if vocab is None else {"draft_vocab": [int(i) for i in np.asarray(jax.device_get(vocab))]})}


def save_heads(heads: Heads, directory, step: int = 0, config_name: str = "") -> None:
    """Write draft heads as step `step` (no optimizer state), as training writes them:
    `load_heads` and `--draft_checkpoint` read them back."""
    with Checkpoints(directory, async_save=False) as ckpt:
        ckpt.save(step, heads.params, model_meta(kv_heads.original(heads.model), config_name,
                                                 **heads_meta(heads.cfg, heads.vocab)))
        ckpt.wait()


def _heads_config(ckpt: Checkpoints, step: int, directory) -> tuple[HeadsConfig, dict]:
    meta = ckpt.meta(step)
    if not isinstance(meta.get("heads"), dict):
        raise UsageError(f"{directory} holds a model, not draft heads: pass the directory that "
                         "`python -m specjax.train --config=CONFIG_WITH_HEADS` writes for this target")
    try:
        return HeadsConfig(**meta["heads"]).validate(), meta
    except (TypeError, UsageError) as e:
        raise ckpt._damaged(step, e) from None


def heads_config(directory, config_name: str | None = None) -> HeadsConfig:
    """The `HeadsConfig` of the newest draft heads in `directory`, from their metadata
    alone (what a run checks, e.g. Medusa's cap on K, before anything is loaded)."""
    directory = user_path(directory)
    ckpt, step = _newest_step(directory, config_name or directory.name)
    with ckpt:
        return _heads_config(ckpt, step, directory)[0]


def load_heads(target_cfg: ModelConfig, mesh: jax.sharding.Mesh, directory, config_name: str | None = None) -> Heads:
    """Draft heads (`specjax.heads`) of the newest step in `directory`, restored onto
    `mesh`, as their checkpoint describes them; it must have been trained on a target of
    `target_cfg`'s shape."""
    directory = user_path(directory)
    name = config_name or directory.name
    ckpt, step = _newest_step(directory, name)
    with ckpt:
        heads_cfg, meta = _heads_config(ckpt, step, directory)
        abstract = abstract_heads(heads_cfg, kv_heads.original(target_cfg), mesh)
        ckpt.check_compatible(step, kv_heads.original(target_cfg), name, abstract.params)
        if heads_cfg.draft_vocab and not isinstance(meta.get("draft_vocab"), list):
            raise ckpt._damaged(step, ValueError("heads.draft_vocab is set but no draft_vocab ids are recorded"))
        vocab = draft_vocabulary(heads_cfg, kv_heads.original(target_cfg), meta.get("draft_vocab"), mesh)
        params, _ = ckpt.restore(step, abstract.params)
    return dataclasses.replace(abstract, params=params, vocab=vocab)


def load_lm(model_cfg: ModelConfig, mesh: jax.sharding.Mesh, directory, step: int | None = None,
            config_name: str | None = None) -> LM:
    """The params of `step` (default: the newest) restored directly onto `mesh`; with
    fewer kv heads than the 'model' axis they are duplicated (`kv_heads`), each device
    reading only the head it holds.

    `config_name` (default: the directory's name) only words the messages."""
    directory = user_path(directory)
    name = config_name or directory.name
    saved_cfg = kv_heads.original(model_cfg)  # checkpoints hold the model's own kv heads
    model_cfg = kv_heads.for_mesh(model_cfg, mesh)
    sharding.check_divisible(model_cfg, mesh)
    ckpt, step = _newest_step(directory, name, step)
    with ckpt:
        graphdef, abstract = abstract_params(model_cfg, mesh)
        saved = kv_heads.source_params(abstract, model_cfg.kv_copies)
        ckpt.check_compatible(step, saved_cfg, name, saved)
        params, _ = ckpt.restore(step, saved)
    return LM(model_cfg, graphdef, kv_heads.adopt_params(params, abstract))
