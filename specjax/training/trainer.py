"""Training: AdamW with warmup + cosine decay and clipping, data parallel over 'data'
and Megatron tensor parallel over 'model' (the same mesh and table as sampling),
orbax checkpoints with exact resume, and distillation of a draft from a target.

Exact resume needs no data-loader or RNG state: batch `s` is a pure function of
(train.seed, s) (`data.get_batch`) and the model has no dropout, so restoring
(step, params, optimizer state) replays an uninterrupted run bit for bit.

Data: configs with `tokenizer_vocab > 0` train a SentencePiece model on `train.corpus`
(default: the standard library's sources) and tokenise the corpus once into a cached
array. Configs without a tokenizer (`tiny`, vocab 32) train on `synthetic_tokens`: a
fixed random Markov chain over the vocabulary, cheap to make and far from uniform, so
losses fall quickly and the tests have something to learn.

Distillation (Chen et al.'s draft is a small model trained on the target's data;
distilling it from the target raises acceptance): `train.teacher` names a config whose
trained target is loaded frozen (or `train.teacher_hf` a Hugging Face model directory, or
`train.teacher_gguf` a GGUF file, whose tokenizer then tokenises the corpus; `export_hf`
writes the result back as a Hugging Face directory),
and the loss is
    w * T^2 * KL(teacher_T || student_T) + (1 - w) * cross-entropy,
with T = `distill_temperature` (Hinton et al.'s T^2 keeps gradient scales comparable)
and w = `distill_weight`.

Step numbering: "step N" is the state after N updates; 'train' records are written at
multiples of log_every and at the last step, and the record for step N holds the mean of
the losses of the batches since the previous one (with log_every=1: batch N-1, the one
that produced step N); the checkpoint named N resumes with batch N and carries the
metrics of the steps since the last record, so interrupted-and-resumed runs write the
records of an uninterrupted one. metrics.jsonl records: {'kind': 'train', 'step', 'loss', 'ce', 'kl'
(distilling), 'grad_norm', 'lr', 'tokens_per_s'}, {'kind': 'val', 'step', 'val_loss',
'val_kl'}, {'kind': 'event', 'step', 'event': start | resume | stopped | done}.

One run per workdir: `WorkdirLock` refuses a second writer.

Several processes: each builds only its own rows of every batch
(`jax.make_array_from_process_local_data`), only process 0 locks the workdir and writes
metrics and the tokenizer copy, orbax coordinates the checkpoint writes, and JAX's
preemption sync point makes all processes stop at the same step.
"""
from __future__ import annotations

import dataclasses
import fcntl
import json
import math
import os
import pathlib
import signal
import tempfile
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from specjax import distributed, kv_heads, sharding
from specjax.training import data
from specjax.training.losses import make_loss
from specjax.weights import checkpoint
from specjax.config import (Config, ConfigError, TrainConfig, UsageError, cache_dir, is_remote, load_config,
                            user_path)
from specjax.heads import Heads, abstract_heads, heads_loss, init_heads
from specjax.model import LM, abstract_lm, init_lm
from specjax.weights.tokenizer import Tokenizer

METRICS_FILE = "metrics.jsonl"
SYNTHETIC_TOKENS = 1 << 20


# --------------------------------------------------------------------------- data


def synthetic_tokens(vocab_size: int, num_tokens: int = SYNTHETIC_TOKENS, seed: int = 0) -> np.ndarray:
    """A token stream for configs without a tokenizer: 1024 chains of a first-order
    Markov process whose transition rows are Dirichlet(0.1) draws (a few likely
    successors per token, entropy well below log V), concatenated. Fixed by (vocab, seed),
    so a teacher and its student see the same language."""
    rng = np.random.default_rng([seed, vocab_size])
    transitions = rng.dirichlet(np.full(vocab_size, 0.1), size=vocab_size)
    cumulative = np.cumsum(transitions, axis=1)
    chains, length = 1024, -(-num_tokens // 1024)
    out = np.empty((chains, length), np.int32)
    out[:, 0] = rng.integers(0, vocab_size, chains)
    uniforms = rng.random((length, chains))
    for t in range(1, length):
        rows = cumulative[out[:, t - 1]]
        out[:, t] = np.minimum((rows < uniforms[t][:, None]).sum(axis=1), vocab_size - 1)
    return out.reshape(-1)[:num_tokens]


@dataclasses.dataclass
class Corpus:
    train: np.ndarray
    val: np.ndarray
    tokenizer_file: Optional[pathlib.Path]  # None: synthetic data
    description: str


def load_corpus(config: Config, teacher_tokenizer=None, progress: bool = True) -> Corpus:
    """Token streams for `config` (see the module docstring). With a teacher, the
    teacher's own tokenizer is used: draft and target must share one."""
    tc = config.train
    vocab = config.target.vocab_size
    if not config.tokenizer_vocab:
        tokens = synthetic_tokens(vocab)
        train, val = data.split_train_val(tokens, tc.val_fraction)
        return Corpus(train, val, None, f"synthetic Markov chain, {len(tokens):,} tokens, vocab {vocab}")
    try:
        files = data.resolve_corpus(tc.corpus)
    except ValueError as e:
        raise UsageError(f"train.corpus: {e}") from e
    store = cache_dir() / "data"
    if teacher_tokenizer is not None:
        tokenizer = teacher_tokenizer
    else:
        tokenizer = data.build_or_load_tokenizer(files, store, config.tokenizer_vocab)
    if tokenizer.vocab_size != vocab:
        raise ConfigError(f"tokenizer {tokenizer.path} has {tokenizer.vocab_size} pieces but "
                          f"target.vocab_size={vocab}")
    tokens = data.build_token_cache(files, tokenizer, store, progress)
    train, val = data.split_train_val(tokens, tc.val_fraction)
    # A Hugging Face teacher's tokenizer stays in its directory (an export copies it from there).
    own = isinstance(tokenizer, Tokenizer)
    return Corpus(train, val, pathlib.Path(tokenizer.path) if own else None,
                  f"{tc.corpus}: {len(files):,} files, {len(tokens):,} tokens, tokenizer {tokenizer.path.name}")


def _row_block(batch_sharding, global_shape) -> tuple[int, int]:
    """(block index, number of blocks) of the batch rows this process feeds: the rows
    its devices hold under `batch_sharding` (all rows when 'data' does not split them)."""
    index_map = batch_sharding.addressable_devices_indices_map(global_shape)
    starts = [idx[0].start or 0 for idx in index_map.values()]
    stops = [global_shape[0] if idx[0].stop is None else idx[0].stop for idx in index_map.values()]
    lo, hi = min(starts), max(stops)
    per = hi - lo
    if global_shape[0] % per or lo % per:
        raise ConfigError(f"batch of {global_shape[0]} rows cannot be split evenly over processes "
                          f"(this process holds rows {lo}..{hi})")
    return lo // per, global_shape[0] // per


def check_stream_lengths(train_tokens: int, val_tokens: int, tc: TrainConfig) -> None:
    """Both streams must hold one window of seq_len + 1 tokens; the advice names the
    val_fraction that would fix a short one (smaller for train, larger for validation)."""
    need, total = tc.seq_len + 1, train_tokens + val_tokens
    if train_tokens >= need and val_tokens >= need:
        return
    name, have = ("train", train_tokens) if train_tokens < need else ("validation", val_tokens)
    problem = (f"the {name} stream has {have:,} tokens (train.val_fraction={tc.val_fraction} of {total:,}), "
               f"fewer than train.seq_len + 1 = {need}")
    if total < 2 * need + 2:
        raise UsageError(f"{problem}; the corpus is too small for a train and a validation window of {need} "
                         f"tokens each: use a bigger corpus or train.seq_len at most {max(1, total // 2 - 3)}")
    digits = 1e4  # the advice is rounded towards the safe side
    if name == "train":
        fix = f"lower train.val_fraction to at most {math.floor((total - need - 1) / total * digits) / digits:g}"
    else:
        fix = f"raise train.val_fraction to at least {math.ceil((need + 1) / total * digits) / digits:g}"
    raise UsageError(f"{problem}: {fix}, lower train.seq_len, or use a bigger corpus")


class Batches:
    """Global batches as sharded device arrays, built from this process's rows only."""

    def __init__(self, corpus: Corpus, tc: TrainConfig, mesh):
        self.corpus, self.tc = corpus, tc
        self.shape = (tc.batch_size, tc.seq_len + 1)
        self.sharding = sharding.named(mesh, ("batch", None), self.shape)
        self.replicated = sharding.replicated(mesh)
        self.block, self.blocks = _row_block(self.sharding, self.shape)
        check_stream_lengths(len(corpus.train), len(corpus.val), tc)

    def _device(self, local: np.ndarray) -> jax.Array:
        return jax.make_array_from_process_local_data(self.sharding, local, self.shape)

    def train(self, step: int) -> jax.Array:
        tc = self.tc
        return self._device(data.get_batch(self.corpus.train, step, tc.batch_size, tc.seq_len, tc.seed,
                                           process_index=self.block, process_count=self.blocks))

    def validation(self) -> list[jax.Array]:
        tc = self.tc
        return [self._device(b) for b in data.eval_batches(
            self.corpus.val, tc.batch_size, tc.seq_len, tc.eval_batches,
            process_index=self.block, process_count=self.blocks)]

    def _hyper_host(self, step: int) -> dict[str, np.ndarray]:
        return {"step": np.int32(step), "distill_weight": np.float32(self.tc.distill_weight)}

    def hyper(self, step: int) -> dict[str, jax.Array]:
        """The train step's scalar inputs, replicated."""
        return {k: jax.make_array_from_process_local_data(self.replicated, v, ())
                for k, v in self._hyper_host(step).items()}

    def abstract(self) -> tuple[jax.ShapeDtypeStruct, dict]:
        """(batch, hyper) as the compiled train step sees them."""
        return (jax.ShapeDtypeStruct(self.shape, jnp.int32, sharding=self.sharding),
                {k: jax.ShapeDtypeStruct((), v.dtype, sharding=self.replicated)
                 for k, v in self._hyper_host(0).items()})


# --------------------------------------------------------------------------- optimiser


def learning_rate_schedule(tc: TrainConfig) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(0.0, tc.learning_rate, tc.warmup_steps, tc.steps,
                                              end_value=tc.learning_rate * 0.1)


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """Clip the global norm, then AdamW (Chinchilla's betas); norm scales are not decayed."""
    decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)  # noqa: E731
    return optax.chain(
        optax.clip_by_global_norm(tc.grad_clip),
        optax.adamw(learning_rate_schedule(tc), b1=0.9, b2=0.95, eps=1e-8,
                    weight_decay=tc.weight_decay, mask=decay_mask))


def opt_state_shardings(optimizer, params, mesh):
    """The optimiser state laid out like the params it tracks (Adam's mu and nu follow
    their param's sharding); counters replicated."""
    param_sh = sharding.param_shardings(params, mesh)
    abstract = jax.eval_shape(optimizer.init, params)
    return optax.tree_map_params(optimizer, lambda _, sh: sh, abstract, param_sh,
                                 transform_non_params=lambda _: sharding.replicated(mesh),
                                 is_leaf=lambda x: isinstance(x, nnx.Variable))


# --------------------------------------------------------------------------- compiled steps


def make_steps(student: LM | Heads, teacher: Optional[LM], optimizer, tc: TrainConfig, mesh, opt_sh):
    """(train_step, eval_step), jitted. train_step(params, opt_state, teacher_params,
    batch, hyper) -> (params, opt_state, metrics) with params and optimiser state donated
    and kept on their shardings; `hyper` holds scalars ('step' feeds the logged learning
    rate, 'distill_weight' the loss). eval_step(params, teacher_params, batch) -> {'ce',
    'kl' (with a teacher)}. A `Heads` student trains on its frozen target, the teacher."""
    param_sh = sharding.param_shardings(student.params, mesh)
    loss_fn = heads_loss(tc) if isinstance(student, Heads) else make_loss(tc, teacher is not None)
    schedule = learning_rate_schedule(tc)

    def rebuild(params, teacher_params):
        t = None if teacher is None else LM(teacher.cfg, teacher.graphdef, teacher_params)
        return dataclasses.replace(student, params=params), t

    def train_step(params, opt_state, teacher_params, batch, hyper):
        def objective(p):
            s, t = rebuild(p, teacher_params)
            return loss_fn(s, t, batch, hyper["distill_weight"])

        (_, metrics), grads = jax.value_and_grad(objective, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, dict(metrics, grad_norm=optax.global_norm(grads), lr=schedule(hyper["step"]))

    def eval_step(params, teacher_params, batch):
        s, t = rebuild(params, teacher_params)
        metrics = loss_fn(s, t, batch, 0.0)[1]
        return {k: v for k, v in metrics.items() if k in ("ce", "kl")}

    train_jit = jax.jit(train_step, donate_argnums=(0, 1), out_shardings=(param_sh, opt_sh, None))
    return train_jit, jax.jit(eval_step)


# --------------------------------------------------------------------------- metrics


class MetricsLog:
    """Append-only JSONL; one record a line with 'kind' ('train', 'val', 'event') and
    'step'. A resumed run appends records for steps that an interrupted run may already
    have logged: `read_metrics` keeps the last record per (kind, step)."""

    def __init__(self, path: pathlib.Path, enabled: bool = True):
        self.path, self.enabled = path, enabled

    def write(self, kind: str, step: int, **values) -> None:
        if not self.enabled:
            return
        record = {"kind": kind, "step": int(step), "time": round(time.time(), 3)}
        record.update({k: (float(v) if isinstance(v, (np.floating, np.ndarray, jax.Array)) else v)
                       for k, v in values.items()})
        line = json.dumps(record) + "\n"
        if is_remote(self.path):  # cloud objects cannot be appended to: rewrite (metrics files are small)
            self.path.write_text((self.path.read_text() if self.path.exists() else "") + line)
            return
        with open(self.path, "a") as f:
            f.write(line)


def read_metrics(workdir, kind: str = "train") -> dict[int, dict]:
    """{step: last record of `kind` for that step} from a workdir's metrics.jsonl."""
    out: dict[int, dict] = {}
    path = user_path(workdir) / METRICS_FILE
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by kill -9
            continue
        if record.get("kind") == kind:
            out[record["step"]] = record
    return dict(sorted(out.items()))


# --------------------------------------------------------------------------- stop requests


class StopRequest:
    """SIGTERM (preemption) or Ctrl-C asks the loop to checkpoint and stop after the
    current step; a second Ctrl-C aborts at once. With several processes, JAX's
    preemption sync point makes every process stop at the same step."""

    def __init__(self):
        self.signum: Optional[int] = None
        self._previous = {}

    def __enter__(self):
        if jax.process_count() == 1:
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        tqdm.write(f"received {signal.Signals(signum).name}: saving a checkpoint after this step, then stopping"
                   + (" (Ctrl-C again aborts)" if signum == signal.SIGINT else ""))

    def __call__(self, step: int) -> bool:
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            if multihost_utils.reached_preemption_sync_point(step):
                self.signum = signal.SIGTERM
        return self.signum is not None

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


# --------------------------------------------------------------------------- the workdir

LOCK_FILE = "train.lock"


class WorkdirLock:
    """The one writer of a workdir: an exclusive `flock` on WORKDIR/train.lock, held for
    the whole run. A second `train` on the same directory would interleave its
    checkpoints and metrics with the first's (and orbax's start-up clean-up would delete
    the first run's half-written step), so it is refused. The kernel drops the lock when
    its process dies, so a kill -9 never leaves it stuck; the file itself (holding the
    last holder's pid) stays and means nothing.

    Several processes of one run: process 0 alone creates, checks and locks the workdir
    (a shared filesystem would make the run's own processes lock each other out), and
    every process learns whether that worked, so all of them stop together."""

    def __init__(self, workdir: pathlib.Path):
        self.workdir = workdir
        self.fd: Optional[int] = None

    def __enter__(self) -> "WorkdirLock":
        error = None
        if jax.process_index() == 0:
            try:
                self._acquire()
            except UsageError as e:
                error = e
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            failed = multihost_utils.broadcast_one_to_all(np.int32(error is not None))
            if failed and error is None:
                raise UsageError(f"process 0 could not take the workdir {self.workdir} (its message says why)")
        if error is not None:
            raise error
        return self

    def _acquire(self) -> None:
        workdir = self.workdir
        if is_remote(workdir):  # no flock on gs://: one writer there is the user's to ensure
            workdir.mkdir(parents=True, exist_ok=True)
            return
        if workdir.exists() and not workdir.is_dir():
            raise UsageError(f"workdir {workdir} is a file, not a directory: pass a directory (it is created if "
                             f"missing)")
        try:
            workdir.mkdir(parents=True, exist_ok=True)
            fd = os.open(workdir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise UsageError(f"cannot write to workdir {workdir} ({e.strerror}): pass a writable workdir") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            raise UsageError(f"another training run{f' (pid {holder})' if holder.isdigit() else ''} is writing "
                             f"to workdir {workdir}: wait for it to finish, stop it, or pass another workdir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        try:
            _check_writable(workdir)
        except UsageError:
            self.__exit__()
            raise

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the flock
            self.fd = None


def _check_writable(workdir: pathlib.Path) -> None:
    """Everything a run may change must be writable before it starts: the metrics file
    (appended to) and every directory below the workdir (old steps are deleted past
    keep_checkpoints, half-written ones cleaned up). A probe file is created and removed
    rather than trusting permission bits, which root ignores and a read-only mount or
    an immutable flag overrides."""
    metrics = workdir / METRICS_FILE
    try:
        if metrics.exists():
            open(metrics, "a").close()
    except OSError as e:
        raise UsageError(f"cannot append to {metrics} ({e.strerror}): make it writable or pass another "
                         f"workdir") from None
    for here, dirs, _ in os.walk(workdir):
        for name in dirs:
            path = pathlib.Path(here, name)
            try:
                with tempfile.TemporaryFile(dir=path):
                    pass
            except OSError as e:
                raise UsageError(f"{path} is read-only ({e.strerror}): training in workdir {workdir} may delete "
                                 f"or update it (steps older than the newest keep_checkpoints are deleted); make it "
                                 f"writable, or pass another workdir") from None


# --------------------------------------------------------------------------- the loop


class TrainingDiverged(FloatingPointError):
    """The loss or the gradient norm became NaN or inf; no checkpoint of that state is written."""


@dataclasses.dataclass
class TrainResult:
    workdir: pathlib.Path
    step: int  # updates done (the newest checkpoint's step)
    start_step: int  # where this run began (0, or the step it resumed from)
    stopped_by: Optional[str]  # 'SIGTERM' / 'SIGINT' when a signal ended the run early
    train_loss: Optional[float]
    val_loss: Optional[float]
    tokens_per_second: Optional[float]  # mean over this run's steps, compile excluded
    compile_seconds: float


def _say(message: str) -> None:
    if jax.process_index() == 0:
        tqdm.write(message)


def _teacher(config: Config, mesh) -> tuple[Optional[LM], Any]:
    """(teacher LM, its tokenizer or None), or (None, None) without a teacher."""
    tc = config.train
    if tc.teacher_hf or tc.teacher_gguf:
        from specjax.weights import gguf, hf
        reader, path, key = (hf, tc.teacher_hf, "teacher_hf") if tc.teacher_hf else (gguf, tc.teacher_gguf,
                                                                                     "teacher_gguf")
        teacher_cfg = reader.read_config(path, param_dtype=config.target.param_dtype,
                                         compute_dtype=config.target.compute_dtype).model
        name, load = f"train.{key}={path!r}", lambda: reader.load(
            path, mesh, param_dtype=teacher_cfg.param_dtype, compute_dtype=teacher_cfg.compute_dtype)
    elif tc.teacher:
        teacher_cfg = load_config(tc.teacher).target
        directory = user_path(tc.teacher_checkpoint) if tc.teacher_checkpoint \
            else checkpoint.default_dir(tc.teacher)

        def load():
            tok = checkpoint.tokenizer_path(directory)
            return (checkpoint.load_lm(teacher_cfg, mesh, directory, config_name=tc.teacher),
                    Tokenizer(tok) if tok is not None else None)
        name = f"train.teacher={tc.teacher!r}"
    else:
        return None, None
    if teacher_cfg.vocab_size != config.target.vocab_size:
        raise ConfigError(f"{name} has vocab_size={teacher_cfg.vocab_size}, the student "
                          f"{config.target.vocab_size}: distillation needs one vocabulary")
    return load()


def export_hf(config: Config, workdir, directory, devices=None) -> pathlib.Path:
    """Write the newest checkpoint in `workdir` as a Hugging Face Llama directory, with
    the teacher's tokenizer and generation ids when it was distilled from a Hugging Face
    directory or a GGUF file (whose tokenizer is written as tokenizer.json)."""
    from specjax.weights import gguf, hf
    workdir = user_path(workdir) if workdir else checkpoint.default_dir(config.name)
    mesh = sharding.make_mesh(config.mesh, devices)
    if config.heads is not None:
        raise UsageError(f"config {config.name!r} trains draft heads, not a model: there is nothing to export as a "
                         "Hugging Face directory (the heads load with --drafter=medusa)")
    hf.exportable(config.target)
    lm = checkpoint.load_lm(config.target, mesh, workdir, config_name=config.name)
    tc = config.train
    info = hf.read_config(tc.teacher_hf) if tc.teacher_hf else gguf.read_config(tc.teacher_gguf) \
        if tc.teacher_gguf else None
    with jax.set_mesh(mesh):
        out = hf.export(lm, directory, tokenizer_dir=tc.teacher_hf or None, bos_id=info.bos_id if info else None,
                        eos_ids=info.eos_ids if info else ())
    if tc.teacher_gguf and distributed.is_main():
        gguf.write_tokenizer(tc.teacher_gguf, out)
    return out


def _train_differences(saved: dict, tc: TrainConfig) -> list[str]:
    now = dataclasses.asdict(tc)
    return [f"{k}: {saved[k]!r} -> {now[k]!r}" for k in sorted(now) if k in saved and saved[k] != now[k]]


def train(config: Config, workdir=None, progress: bool = True, devices=None) -> TrainResult:
    """Train `config.target` for `config.train.steps` updates, resuming from the newest
    checkpoint in `workdir` (default `checkpoint.default_dir(config.name)`)."""
    config = config.validate()
    tc = config.train
    workdir = user_path(workdir) if workdir else checkpoint.default_dir(config.name)
    is_main = jax.process_index() == 0
    mesh = sharding.make_mesh(config.mesh, devices)
    sharding.check_divisible(config.target, mesh, "target")
    optimizer = make_optimizer(tc)

    if config.heads is not None and not (tc.teacher or tc.teacher_hf or tc.teacher_gguf):
        raise ConfigError(f"config {config.name!r} has draft heads, which train on a frozen target: name it with "
                          "train.teacher (a config), train.teacher_hf (a Hugging Face directory) or train.teacher_gguf")

    with WorkdirLock(workdir), jax.set_mesh(mesh):
        teacher, teacher_tokenizer = _teacher(config, mesh)
        if config.heads is not None:  # the heads are shaped by the target they read, the teacher
            config = dataclasses.replace(config, target=kv_heads.original(teacher.cfg))
        corpus = load_corpus(config, teacher_tokenizer, progress and is_main)
        batches = Batches(corpus, tc, mesh)
        log = MetricsLog(workdir / METRICS_FILE, enabled=is_main)

        ckpt = checkpoint.Checkpoints(workdir, keep=tc.keep_checkpoints)
        try:
            trainee = abstract_heads(config.heads, config.target, mesh) if config.heads is not None else \
                abstract_lm(config.target, mesh)
            abstract_params = trainee.params
            num_params = trainee.num_params
            opt_sh = opt_state_shardings(optimizer, abstract_params, mesh)
            start = ckpt.latest_step() or 0
            window = []  # per-step metrics since the last 'train' record
            if start:
                meta = ckpt.check_compatible(start, config.target, config.name, abstract_params)
                window = list(meta.get("log_window", []))
                abstract_opt = sharding.with_shardings(jax.eval_shape(optimizer.init, abstract_params), opt_sh)
                params, opt_state = ckpt.restore(start, abstract_params, abstract_opt)
                changed = _train_differences(meta.get("train", {}), tc)
                _say(f"resuming from step {start} in {workdir}"
                     + (f" (train settings changed since: {'; '.join(changed)})" if changed else ""))
                log.write("event", start, event="resume")
            else:
                params = (init_heads(config.heads, config.target, mesh) if config.heads is not None else
                          init_lm(config.target, mesh, seed=config.target.init_seed, duplicate_kv=False)).params
                opt_state = jax.jit(optimizer.init, out_shardings=opt_sh)(params)
                log.write("event", 0, event="start", config=config.name, params=num_params)
            student = dataclasses.replace(trainee, params=params)
            if corpus.tokenizer_file is not None and is_main:
                checkpoint.save_tokenizer(workdir, corpus.tokenizer_file)
            if start >= tc.steps:
                _say(f"{workdir} already holds step {start} (train.steps={tc.steps}): nothing to train; "
                     f"raise --config.train.steps to continue")
                return TrainResult(workdir, start, start, None, None, None, None, 0.0)

            teacher_params = teacher.params if teacher is not None else None
            train_step, eval_step = make_steps(student, teacher, optimizer, tc, mesh, opt_sh)
            t0 = time.perf_counter()
            train_step = train_step.lower(params, opt_state, teacher_params, *batches.abstract()).compile()
            compile_seconds = time.perf_counter() - t0
            val_batches = batches.validation()
            _say(f"training {config.name}: {num_params:,} params"
                 + (f" ({config.heads.num_heads} {config.heads.kind} heads on the frozen target)"
                    if config.heads is not None else "") + " on mesh "
                 f"{mesh.shape['data']}x{mesh.shape['model']} (data x model), batch {tc.batch_size} x "
                 f"{tc.seq_len} tokens, steps {start}..{tc.steps}; data: {corpus.description}"
                 + (f"; distilling from {tc.teacher or tc.teacher_hf or tc.teacher_gguf} (w={tc.distill_weight}, "
                    f"T={tc.distill_temperature})"
                    if teacher is not None else "") + f"; compiled in {compile_seconds:.1f}s")

            def validate(step):
                totals: dict[str, float] = {}
                for b in val_batches:
                    for k, v in jax.device_get(eval_step(params, teacher_params, b)).items():
                        totals[k] = totals.get(k, 0.0) + float(v) / len(val_batches)
                values = {"val_loss": totals["ce"], **({"val_kl": totals["kl"]} if "kl" in totals else {})}
                log.write("val", step, **values)
                return values

            def fetch(pending, step):
                """The steps' metrics on the host, refused if the run has diverged."""
                fetched = [{k: float(v) for k, v in m.items()} for m in jax.device_get(pending)]
                bad = next((i for i, m in enumerate(fetched) if not all(map(math.isfinite, m.values()))), None)
                if bad is not None:
                    raise TrainingDiverged(
                        f"training diverged at step {step - len(fetched) + 1 + bad}: loss {fetched[bad]['loss']}, "
                        f"gradient norm {fetched[bad]['grad_norm']} "
                        f"(train.learning_rate={tc.learning_rate}, train.grad_clip={tc.grad_clip}); lower the "
                        f"learning rate; nothing after step {ckpt.latest_step() or 0} was saved")
                return fetched

            def meta(step, window):
                # The metrics of the steps since the last 'train' record travel with the
                # checkpoint, so a run resumed from it writes the next record over the
                # same steps as an uninterrupted run.
                # A copy: orbax writes the JSON in the background while the loop appends to `pending`.
                heads = {} if config.heads is None else {"heads": dataclasses.asdict(config.heads)}
                return checkpoint.model_meta(config.target, config.name, **heads, train=dataclasses.asdict(tc),
                                             tokens_seen=step * tc.batch_size * tc.seq_len,
                                             log_window=[dict(m) for m in window])

            step, pending, train_loss, val_loss = start, window, None, None
            tokens_per_step = tc.batch_size * tc.seq_len
            busy = 0.0  # seconds of training steps in this run (compile, validation, saves excluded)
            window_start, excluded, window_steps = time.perf_counter(), 0.0, 0
            bar = tqdm(total=tc.steps, initial=start, disable=not (progress and is_main),
                       dynamic_ncols=True, unit="step")
            with StopRequest() as stop:
                while step < tc.steps and not stop(step):
                    batch, hyper = batches.train(step), batches.hyper(step)
                    with jax.transfer_guard("disallow"):
                        params, opt_state, metrics = train_step(params, opt_state, teacher_params, batch, hyper)
                    step += 1
                    if pending:
                        # At most two steps in flight: the host prepares batch s+1 while
                        # the device runs step s, and a stop request is served within a
                        # step instead of after every step the host could queue.
                        jax.block_until_ready(pending[-1])
                    pending.append(metrics)
                    window_steps += 1
                    last = step == tc.steps
                    # Records at multiples of log_every (and the last step) only, each the
                    # mean over the same steps in every run: a stop or a resume in between
                    # carries the open window in the checkpoint instead of cutting it short.
                    if step % tc.log_every == 0 or last:
                        fetched = fetch(pending, step)
                        elapsed = time.perf_counter() - window_start - excluded
                        busy += elapsed
                        rate = window_steps * tokens_per_step / elapsed
                        means = {k: float(np.mean([m[k] for m in fetched])) for k in fetched[0]}
                        means["lr"] = fetched[-1]["lr"]
                        train_loss = means["loss"]
                        log.write("train", step, tokens_per_s=rate, **means)
                        bar.set_postfix(loss=f"{train_loss:.4f}", tok_s=f"{rate:,.0f}", refresh=False)
                        pending, window_start, excluded, window_steps = [], time.perf_counter(), 0.0, 0
                    bar.update(1)
                    evaluate = step % tc.eval_every == 0 or last
                    save = step % tc.save_every == 0 or last or stop.signum is not None
                    if evaluate or save:
                        jax.block_until_ready(params)  # the steps so far count as training time
                        t = time.perf_counter()
                        if evaluate:
                            values = validate(step)
                            val_loss = values["val_loss"]
                            _say(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in values.items()))
                        if save:
                            pending = fetch(pending, step)
                            ckpt.save(step, params, meta(step, pending), opt_state)
                        excluded += time.perf_counter() - t
            bar.close()
            stopped_by = None
            if stop.signum is not None and step < tc.steps:
                stopped_by = signal.Signals(stop.signum).name
                ckpt.save(step, params, meta(step, fetch(pending, step)), opt_state)
                log.write("event", step, event="stopped", signal=stopped_by)
                _say(f"{stopped_by}: checkpoint for step {step} in {workdir}")
            ckpt.wait()
            if step == tc.steps and stopped_by is None:
                log.write("event", step, event="done")
        finally:
            ckpt.close()
    done_steps = step - start
    return TrainResult(workdir, step, start, stopped_by, train_loss, val_loss,
                       done_steps * tokens_per_step / busy if busy and done_steps else None, compile_seconds)
