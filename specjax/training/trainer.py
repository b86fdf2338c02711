"""Training: AdamW with warmup + cosine decay and clipping, data parallel over 'data'
and Megatron tensor parallel over 'model' (the same mesh and table as sampling),
orbax checkpoints with exact resume, and distillation of a draft from a target.

Exact resume needs no data-loader or RNG state: batch `s` is a pure function of
(train.seed, s) (`data.get_batch`) and the model has no dropout, so restoring
(step, params, optimizer state) replays an uninterrupted run bit for bit.

Data: `corpus` (the token streams and their batches on the mesh); the workdir (its lock,
the metrics log, stop requests): `workdir`; export to Hugging Face: `export`.

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
'val_kl', 'val_kl_last' (a training-time test of 2 or more steps)}, {'kind': 'event', 'step',
'event': start | resume | stopped | done}.

Several processes: each builds only its own rows of every batch
(`jax.make_array_from_process_local_data`), only process 0 locks the workdir and writes
metrics and the tokenizer copy, orbax coordinates the checkpoint writes, and JAX's
preemption sync point makes all processes stop at the same step.
"""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import signal
import time
from contextlib import nullcontext
from typing import Any, Callable, Optional

import jax
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from specjax import kv_heads, sharding
from specjax.training import samples
from specjax.training.corpus import Batches, load_corpus
from specjax.training.losses import make_loss
from specjax.training.workdir import METRICS_FILE, MetricsLog, StopRequest, WorkdirLock
from specjax.weights import checkpoint
from specjax.config import EAGLE_KINDS, Config, ConfigError, TrainConfig, UsageError, load_config, user_path
from specjax.heads import Heads, abstract_heads, draft_vocabulary, heads_loss, init_heads, most_frequent, reads_of
from specjax.model import LM, abstract_lm, init_lm
from specjax.weights.tokenizer import Tokenizer


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
    batch, counted, seen, hyper) -> (params, opt_state, metrics) with params and optimiser
    state donated and kept on their shardings; `counted` marks the batch's tokens the loss
    counts as targets, `seen` holds the target's cached reads of its inputs or is None
    (`Batches.train`); `hyper` holds scalars ('step' feeds the logged learning rate,
    'distill_weight' the loss). eval_step(params, teacher_params, batch, counted, seen) ->
    {'ce', 'kl' (with a teacher), 'kl_last' (a training-time test's last step)}. A `Heads`
    student trains on its frozen target, the teacher."""
    param_sh = sharding.param_shardings(student.params, mesh)
    loss_fn = heads_loss(tc) if isinstance(student, Heads) else make_loss(tc, teacher is not None)
    schedule = learning_rate_schedule(tc)

    def rebuild(params, teacher_params):
        t = None if teacher is None else LM(teacher.cfg, teacher.graphdef, teacher_params)
        return dataclasses.replace(student, params=params), t

    def train_step(params, opt_state, teacher_params, batch, counted, seen, hyper):
        def objective(p):
            s, t = rebuild(p, teacher_params)
            return loss_fn(s, t, batch, hyper["distill_weight"], counted, seen)

        (_, metrics), grads = jax.value_and_grad(objective, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, dict(metrics, grad_norm=optax.global_norm(grads), lr=schedule(hyper["step"]))

    def eval_step(params, teacher_params, batch, counted, seen):
        s, t = rebuild(params, teacher_params)
        metrics = loss_fn(s, t, batch, 0.0, counted, seen)[1]
        return {k: v for k, v in metrics.items() if k in ("ce", "kl", "kl_last")}

    train_jit = jax.jit(train_step, donate_argnums=(0, 1), out_shardings=(param_sh, opt_sh, None))
    return train_jit, jax.jit(eval_step)


# --------------------------------------------------------------------------- the loop


def _describe_heads(hcfg, target) -> str:
    if hcfg.kind not in EAGLE_KINDS:
        return f"{hcfg.num_heads} {hcfg.kind} heads"
    layers = hcfg.layers_for(target.num_layers)
    return (f"one {'EAGLE-3' if hcfg.kind == 'eagle3' else 'EAGLE'} layer of width {hcfg.width or target.d_model}"
            + (f", draft vocabulary of {hcfg.draft_vocab} tokens" if hcfg.draft_vocab else "")
            + (f", reading layers {', '.join(map(str, layers))} of {target.num_layers}" if layers else "")
            + (f", training-time test of {hcfg.test_steps} steps" if hcfg.test_steps > 1 else ""))


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


def _teacher(config: Config, mesh) -> Callable[[], tuple[Optional[LM], Any]]:
    """What loads the teacher: () -> (teacher LM, its tokenizer or None), or (None, None)
    without one. Everything that can refuse it (its config or file, its checkpoint's
    presence, its vocabulary) is checked here, before the workdir is touched."""
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
        checkpoint.newest_step(directory, tc.teacher)  # a missing or empty checkpoint directory is refused now
    else:
        return lambda: (None, None)
    if teacher_cfg.vocab_size != config.target.vocab_size:
        raise ConfigError(f"{name} has vocab_size={teacher_cfg.vocab_size}, the student "
                          f"{config.target.vocab_size}: distillation needs one vocabulary")
    return load

def _init_source(config: Config):
    """(checkpoint directory, step, its model's config) of `train.init_from`, checked to
    be `config.target` but for parallel_draft; None without one. Before any workdir is made."""
    source = config.train.init_from
    if not source:
        return None
    is_path = "/" in source or source.startswith((".", "~"))
    directory = user_path(source) if is_path else checkpoint.default_dir(source)
    with checkpoint.Checkpoints(directory, read_only=True) if directory.is_dir() else nullcontext() as ckpt:
        step = ckpt.latest_step() if ckpt is not None else None
        if step is None:
            raise UsageError(f"train.init_from={source!r}: {directory} holds no finished checkpoint; train it first "
                             f"(`python -m specjax.train --config={source if not is_path else 'CONFIG'}`)")
        saved = ckpt.meta(step)["model"]
    wanted = dataclasses.replace(config.target, parallel_draft=saved.get("parallel_draft", 0))
    diffs = checkpoint.config_differences(saved, wanted)
    if diffs:
        raise UsageError(f"train.init_from={source!r}: its model is not {config.name!r}'s (parallel_draft aside): "
                         f"{'; '.join(diffs)}")
    return directory, step, wanted


def _init_params(params, source, mesh):
    """`params` (a fresh init) with every param the `_init_source` checkpoint holds."""
    directory, step, cfg = source
    with checkpoint.Checkpoints(directory, read_only=True) as ckpt:
        loaded, _ = ckpt.restore(step, abstract_lm(cfg, mesh).params)  # the model's own kv heads, as trained
    out = jax.tree.map(lambda x: x, params)
    for name in loaded:
        out[name] = loaded[name]
    return out


def _differences(saved: dict, settings, prefix: str = "") -> list[str]:
    """'name: saved -> now' for each of the dataclass `settings`' fields that a checkpoint's
    metadata `saved` records otherwise (compared as JSON holds them: a tuple as a list)."""
    now = json.loads(json.dumps(dataclasses.asdict(settings)))
    return [f"{prefix}{k}: {saved[k]!r} -> {now[k]!r}" for k in sorted(now) if k in saved and saved[k] != now[k]]


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

    if tc.self_distill and not (tc.teacher or tc.teacher_hf or tc.teacher_gguf):
        raise ConfigError(f"train.self_distill={tc.self_distill} trains on samples of the teacher, and config "
                          f"{config.name!r} has none: name it with train.teacher, train.teacher_hf or "
                          "train.teacher_gguf, or set train.self_distill=0")

    if config.heads is not None:  # their shapes on the config's target, checked before the workdir is touched
        abstract_heads(config.heads, config.target)
    if config.heads is not None and tc.init_from:
        raise ConfigError(f"train.init_from={tc.init_from!r}: starts a model's params; draft heads start from their "
                          "own init")
    source = _init_source(config)
    if tc.self_distill_prompts:  # the file, before the workdir; its prompts' lengths once the teacher is loaded
        samples.requests(config)

    load_teacher = _teacher(config, mesh)
    with WorkdirLock(workdir), jax.set_mesh(mesh):
        teacher, teacher_tokenizer = load_teacher()
        if tc.self_distill_chat:
            samples.check_chat(teacher_tokenizer)
        # the file's prompts, tokenised once: a prompt too long for the teacher is found before the corpus
        asked = samples.file_prompts(config, teacher, teacher_tokenizer) if tc.self_distill_prompts else None
        if config.heads is not None:  # the heads are shaped by the target they read, the teacher
            config = dataclasses.replace(config, target=kv_heads.original(teacher.cfg))
        corpus = load_corpus(config, teacher_tokenizer, progress and is_main)
        if tc.self_distill:
            stop_ids = config.sampling.stop_ids or tuple(getattr(teacher_tokenizer, "stop_ids", ()))
            corpus = samples.self_distilled(corpus, teacher, config, workdir, stop_ids, progress and is_main,
                                            teacher_tokenizer, asked)
            if config.heads is not None and tc.cache_target and jax.process_count() == 1:
                corpus = samples.with_target_reads(corpus, teacher, reads_of(config.heads, config.target), config,
                                                   progress and is_main)
        batches = Batches(corpus, tc, mesh)
        log = MetricsLog(workdir / METRICS_FILE, enabled=is_main)

        ckpt = checkpoint.Checkpoints(workdir, keep=tc.keep_checkpoints)
        try:
            trainee = abstract_heads(config.heads, config.target, mesh) if config.heads is not None else \
                abstract_lm(config.target, mesh)
            # A draft vocabulary: the corpus's most frequent tokens (the same corpus, the
            # same ids on every run and resume); recorded with each checkpoint.
            vocab = None if config.heads is None or not config.heads.draft_vocab else draft_vocabulary(
                config.heads, config.target, most_frequent(corpus.train, config.heads.draft_vocab,
                                                           config.target.vocab_size), mesh)
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
                # the heads' own training settings too (heads.ttt_steps changes no param's shape)
                changed = _differences(meta.get("train", {}), tc) + (
                    _differences(meta.get("heads") or {}, config.heads, "heads.") if config.heads is not None else [])
                _say(f"resuming from step {start} in {workdir}"
                     + (f" (settings changed since: {'; '.join(changed)})" if changed else ""))
                log.write("event", start, event="resume")
            else:
                params = (init_heads(config.heads, config.target, mesh) if config.heads is not None else
                          init_lm(config.target, mesh, seed=config.target.init_seed, duplicate_kv=False)).params
                if source is not None:
                    params = _init_params(params, source, mesh)
                opt_state = jax.jit(optimizer.init, out_shardings=opt_sh)(params)
                log.write("event", 0, event="start", config=config.name, params=num_params)
            student = dataclasses.replace(trainee, params=params)
            if vocab is not None:
                student = dataclasses.replace(student, vocab=vocab)
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
                 + (f" ({_describe_heads(config.heads, config.target)} on the frozen target)"
                    if config.heads is not None else "") + " on mesh "
                 f"{mesh.shape['data']}x{mesh.shape['model']} (data x model), batch {tc.batch_size} x "
                 f"{tc.seq_len} tokens, steps {start}..{tc.steps}; data: {corpus.description}"
                 + (f"; distilling from {tc.teacher or tc.teacher_hf or tc.teacher_gguf} (w={tc.distill_weight}, "
                    f"T={tc.distill_temperature})"
                    if teacher is not None else "") + f"; compiled in {compile_seconds:.1f}s")

            def validate(step):
                totals: dict[str, float] = {}
                for b, c, seen in val_batches:
                    for k, v in jax.device_get(eval_step(params, teacher_params, b, c, seen)).items():
                        totals[k] = totals.get(k, 0.0) + float(v) / len(val_batches)
                # kl_last: a training-time test's last step on held-out data, what its deepest drafts keep
                values = {"val_loss": totals["ce"], **{f"val_{k}": totals[k] for k in ("kl", "kl_last") if k in totals}}
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
                heads = {} if config.heads is None else checkpoint.heads_meta(config.heads, vocab)
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
                    (batch, counted, seen), hyper = batches.train(step), batches.hyper(step)
                    with jax.transfer_guard("disallow"):
                        params, opt_state, metrics = train_step(params, opt_state, teacher_params, batch, counted,
                                                                seen, hyper)
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
