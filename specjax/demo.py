"""What `python -m specjax.sample` runs besides flag parsing: the embedded default.

* `Weights`: where the target and draft weights come from (a checkpoint directory, by
  default the one `python -m specjax.train --config=NAME` writes, or random init), with
  every missing directory reported before JAX starts. The mini pair is small enough to
  train on a laptop, so its missing checkpoints are trained here on first use (progress
  bar; cached afterwards, resumable if interrupted).
* `JsonlWriter`: one JSON line per sample, written and flushed per batch with SIGINT
  and SIGTERM held off, so an interrupted run leaves only complete lines.
* `Report`: samples as they finish (ArS and SpS side by side in --mode=both) and the
  summary: ms/token, tokens per loop, acceptance rate, speedup.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import pathlib
import shutil
import signal
import sys
import textwrap
from typing import Optional, Sequence

from specjax.config import Config, MeshConfig, ModelConfig, SamplingConfig, UsageError, cache_dir, load_config

# Configs small enough that `sample` trains them itself when their checkpoint is missing
# (in this order: the draft is distilled from the target).
AUTO_TRAIN = ("mini_target", "mini_draft")


def _checkpoint():
    from specjax import checkpoint  # imported late: it pulls in orbax
    return checkpoint


def train_command(name: str) -> str:
    return f"python -m specjax.train --config={name or 'DRAFT_CONFIG'}"


@dataclasses.dataclass
class Weights:
    config: Config
    init: str  # 'checkpoint' | 'random'
    target_dir: Optional[pathlib.Path]
    draft_dir: Optional[pathlib.Path]

    @classmethod
    def locate(cls, config: Config, init: str, checkpoint: Optional[str], draft_checkpoint: Optional[str],
               *, need_draft: bool, train_missing: bool) -> "Weights":
        """Find (and for the mini pair, train) the checkpoint directories; no JAX work."""
        target_name = config.target_from or config.name
        draft_name = config.draft_from
        target_dir = _resolve(checkpoint, target_name)
        draft_dir = None
        if need_draft:
            if draft_checkpoint is None and not draft_name and init == "checkpoint":
                raise UsageError(f"config {config.name!r} does not name the config whose checkpoint holds its draft "
                                 "(draft_from is empty): pass --draft_checkpoint=DIR, use --mode=ars, or "
                                 "--init=random")
            draft_dir = _resolve(draft_checkpoint, draft_name) if (draft_checkpoint or draft_name) else None
        if init == "random":
            return cls(config, init, target_dir, draft_dir)
        wanted = [("--checkpoint", checkpoint, target_name, target_dir)]
        if need_draft:
            wanted.append(("--draft_checkpoint", draft_checkpoint, draft_name, draft_dir))
        # The mini pair counts as present only when fully trained: an interrupted first run
        # resumes instead of sampling from a half-trained model.
        to_train = [name for flag, given, name, d in wanted if given is None and name in AUTO_TRAIN
                    and train_missing and _latest_step(d) < load_config(name).train.steps]
        for flag, given, name, d in wanted:
            if _latest_step(d) >= 0 or name in to_train:
                continue
            what = "holds no finished checkpoint" if d.is_dir() else "does not exist"
            if given is not None:
                raise UsageError(f"{flag}={given!r}: no checkpoint there (the directory {what}); create one "
                                 f"with `{train_command(name)} --workdir={given}`, or use --init=random")
            raise UsageError(f"no checkpoint for config {name!r}: {d} {what}; create it with "
                             f"`{train_command(name)}`, pass {flag}=DIR, or use --init=random")
        if to_train:
            train([n for n in AUTO_TRAIN if n in to_train])  # the draft's teacher first
        # A checkpoint of another model fails here, from its metadata, before any JAX work.
        _check_compatible(target_dir, config.target, target_name)
        if need_draft:
            _check_compatible(draft_dir, config.draft, draft_name or f"{config.name}.draft")
        return cls(config, init, target_dir, draft_dir)

    @property
    def no_tokenizer_reason(self) -> str:
        return (f"config {self.config.name!r} has no tokenizer"
                + (f" (none in {self.target_dir})" if self.target_dir else ""))

    def tokenizer(self):
        """The tokenizer saved with the target's checkpoint, if there is one."""
        if self.target_dir is None or not self.target_dir.is_dir():
            return None
        path = _checkpoint().tokenizer_path(self.target_dir)
        if path is None:
            return None
        from specjax.tokenizer import Tokenizer, TokenizerError
        try:
            tok = Tokenizer(path)
        except TokenizerError as e:
            raise UsageError(str(e)) from None
        if tok.vocab_size != self.config.target.vocab_size:
            raise UsageError(f"tokenizer {path} has {tok.vocab_size} tokens but config {self.config.name!r} "
                             f"has target.vocab_size={self.config.target.vocab_size}")
        draft_path = _checkpoint().tokenizer_path(self.draft_dir) if self.draft_dir is not None else None
        if draft_path is not None and draft_path.read_bytes() != path.read_bytes():
            # Same vocabulary size, other pieces: q(x)/p(x) would compare unrelated tokens.
            raise UsageError(f"the target's tokenizer {path} and the draft's {draft_path} differ: speculative "
                             "sampling needs a draft trained with the target's tokenizer")
        return tok

    def load(self, mesh, *, need_draft: bool):
        from specjax.model import init_lm
        if self.init == "random":
            target = init_lm(self.config.target, mesh)
            draft = init_lm(self.config.draft, mesh) if need_draft else None
            return target, draft
        ckpt = _checkpoint()
        c = self.config
        target = ckpt.load_lm(c.target, mesh, self.target_dir, config_name=c.target_from or c.name)
        draft = (ckpt.load_lm(c.draft, mesh, self.draft_dir, config_name=c.draft_from or f"{c.name}.draft")
                 if need_draft else None)
        return target, draft


def _resolve(given: Optional[str], name: str) -> Optional[pathlib.Path]:
    if given is not None:
        return pathlib.Path(given).expanduser()
    return _checkpoint().default_dir(name) if name else None


def _latest_step(directory: Optional[pathlib.Path]) -> int:
    """The newest finished checkpoint step in `directory`; -1 when there is none."""
    if directory is None or not directory.is_dir():
        return -1
    with _checkpoint().Checkpoints(directory, read_only=True) as ckpt:
        latest = ckpt.latest_step()
    return -1 if latest is None else latest


def _check_compatible(directory: pathlib.Path, cfg: ModelConfig, name: str) -> None:
    with _checkpoint().Checkpoints(directory, read_only=True) as ckpt:
        ckpt.check_compatible(ckpt.latest_step(), cfg, name)


def train(names: Sequence[str]) -> None:
    """Train the named configs into their default checkpoint directories (progress bars)."""
    from specjax import trainer
    for name in names:
        config = load_config(name)
        print(f"specjax: no checkpoint for {name!r} yet; training it now ({config.train.steps} steps, "
              f"{config.target.num_params / 1e6:.1f}M params). This happens once; an interrupted run "
              f"resumes. The same by hand: {train_command(name)}", file=sys.stderr, flush=True)
        result = trainer.train(config, _checkpoint().default_dir(name), progress=True)
        if result.stopped_by:
            print(f"specjax: training {name!r} stopped at step {result.step} of {config.train.steps} "
                  f"({result.stopped_by}); run the same command again to resume", file=sys.stderr)
            sys.exit(130 if result.stopped_by == "SIGINT" else 143)


def _distributed():
    try:
        from specjax import distributed
    except ModuleNotFoundError as e:
        if e.name != "specjax.distributed":
            raise
        return None
    return distributed


def maybe_initialize_distributed() -> None:
    """Join a multi-process run (TPU pod, local processes) when the environment asks for
    one; must precede anything that touches a device (orbax included)."""
    distributed = _distributed()
    if distributed is not None:
        distributed.maybe_initialize()


def use_compilation_cache() -> None:
    """Keep compiled loops across runs (the demo's second run starts in seconds) in
    cache_dir(), unless $JAX_COMPILATION_CACHE_DIR already names a place."""
    import os
    import jax
    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))  # shared with specjax.train


def generate(target, draft, prompts, sampling: SamplingConfig, *, seed: int):
    """`specjax.generate`, or its multi-process twin when several processes share the mesh."""
    import jax
    if jax.process_count() > 1:
        return _distributed().generate(target, draft, prompts, sampling, seed=seed)
    from specjax import api
    return api.generate(target, draft, prompts, sampling, seed=seed)


def make_mesh(mesh_cfg: MeshConfig, models: dict[str, ModelConfig]):
    """The device mesh, after checking that every model splits over its 'model' axis."""
    from specjax import sharding
    mesh = sharding.make_mesh(mesh_cfg)
    for what, cfg in models.items():
        sharding.check_divisible(cfg, mesh, what)
    return mesh


class JsonlWriter:
    """Whole batches of lines, each written and flushed while SIGINT/SIGTERM wait, so a
    Ctrl-C lands between batches and never inside a line. Only process 0 writes."""

    def __init__(self, path: Optional[str]):
        self.path = path
        self.file = None
        self.lines = 0
        if path is not None:
            import jax
            if jax.process_index() == 0:
                try:
                    pathlib.Path(path).expanduser().parent.mkdir(parents=True, exist_ok=True)
                    self.file = open(pathlib.Path(path).expanduser(), "w", encoding="utf-8")
                except OSError as e:
                    raise UsageError(f"--output={path!r}: cannot write it ({e.strerror or e})") from None

    def write(self, records: Sequence[dict]) -> None:
        if self.file is None:
            return
        data = "".join(json.dumps(r) + "\n" for r in records)
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            self.file.write(data)
            self.file.flush()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        self.lines += len(records)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.file is not None:
            self.file.close()


@dataclasses.dataclass
class _Totals:
    samples: int = 0
    tokens: int = 0
    loops: int = 0
    accepted: int = 0
    proposed: int = 0
    seconds: float = 0.0
    steps: int = 0  # per batch, the longest row's new tokens: what the batch's time paid for
    compile_seconds: float = 0.0

    @property
    def ms_per_token(self) -> float:
        return 1000.0 * self.seconds / self.steps if self.steps else math.nan


LABEL = {"ars": "ArS", "sps": "SpS"}


class Report:
    """Collects per-batch results into JSONL records, prints samples and the summary."""

    def __init__(self, modes: Sequence[str], sampling: SamplingConfig, tokenizer, print_samples: bool = True,
                 out=sys.stdout):
        self.modes, self.sampling, self.tokenizer = list(modes), sampling, tokenizer
        self.print_samples, self.out = print_samples, out
        self.totals = {m: _Totals() for m in self.modes}
        self.done_batches = 0
        import jax
        self.is_main = jax.process_index() == 0  # the other processes of a pod run stay quiet

    def text(self, tokens: Sequence[int]) -> str:
        if self.tokenizer is None:
            return " ".join(map(str, tokens))
        return self.tokenizer.decode([t for t in tokens if t != self.tokenizer.eos_id])

    def add_batch(self, batch_index: int, seed: int, prompts, rows, results: dict) -> list[dict]:
        records = []
        for mode, result in results.items():
            t = self.totals[mode]
            t.seconds += result.seconds
            t.compile_seconds += result.compile_seconds
            t.steps += int(result.num_new.max(initial=0))
            for j, (i, s) in enumerate(rows):  # rows past len(rows) pad the batch: not reported
                stats = result.row_stats(j)
                t.samples += 1
                t.tokens += stats["num_new"]
                t.loops += stats["loops"]
                t.accepted += stats.get("accepted", 0)
                t.proposed += stats.get("proposed", 0)
                record = {"mode": mode, "prompt_index": i, "sample_index": s, "source": prompts[i].source,
                          "prompt": prompts[i].text, "prompt_tokens": prompts[i].tokens,
                          "tokens": result.tokens[j]}
                if self.tokenizer is not None:
                    record["text"] = self.text(result.tokens[j])
                record.update(batch=batch_index, seed=seed, batch_ms_per_token=result.ms_per_token, stats=stats)
                records.append(record)
        self.done_batches += 1
        if self.print_samples and self.is_main:
            self._print_batch(prompts, rows, results)
        return records

    def _header(self, mode: str, result) -> str:
        head = f"{LABEL[mode]}{f' K={result.lookahead}' if mode == 'sps' else ''}: {result.ms_per_token:.2f} ms/token"
        if mode == "sps":
            head += f", acceptance {result.acceptance_rate:.2f}"
        return head

    def _print_batch(self, prompts, rows, results: dict) -> None:
        width = shutil.get_terminal_size((160, 24)).columns
        for j, (i, s) in enumerate(rows):
            p = prompts[i]
            print(f"\n=== {p.source}" + (f" sample {s}" if s else "") + " ===", file=self.out)
            print(p.text if p.text is not None else f"prompt tokens: {' '.join(map(str, p.tokens))}", file=self.out)
            if len(results) == 1:
                (mode, result), = results.items()
                print(f"--- {self._header(mode, result)}", file=self.out)
                print(self.text(result.tokens[j]), file=self.out, flush=True)
                continue
            print(side_by_side([(self._header(m, r), self.text(r.tokens[j])) for m, r in results.items()],
                               width), file=self.out, flush=True)

    def summary_lines(self) -> list[str]:
        lines = []
        for mode, t in self.totals.items():
            line = (f"{LABEL[mode]}: {t.samples} samples, {t.tokens} tokens, {t.ms_per_token:.2f} ms/token, "
                    f"{t.tokens / max(1, t.loops):.2f} tokens/loop")
            if mode == "sps":
                rate = t.accepted / t.proposed if t.proposed else math.nan
                line += f", acceptance rate {rate:.3f} (K={self.sampling.lookahead})"
            line += f"; {t.seconds:.2f} s sampling, {t.compile_seconds:.1f} s compiling"
            lines.append(line)
        if {"ars", "sps"} <= set(self.totals) and self.totals["sps"].steps:
            speedup = self.totals["ars"].ms_per_token / self.totals["sps"].ms_per_token
            lines.append(f"SpS speedup over ArS: {speedup:.2f}x (ms/token)")
        return lines

    def print_summary(self, interrupted: str = "", output: Optional[str] = None) -> None:
        if not self.is_main:
            return
        s = self.sampling
        print(f"\nsummary (temperature={s.temperature}, top_k={s.top_k}, top_p={s.top_p}, "
              f"max_new_tokens={s.max_new_tokens})" + (f", interrupted after {interrupted}" if interrupted else ""),
              file=self.out)
        for line in self.summary_lines():
            print(line, file=self.out)
        if output:
            print(f"samples written to {output}", file=self.out)
        self.out.flush()


def side_by_side(columns: Sequence[tuple[str, str]], width: int) -> str:
    """Columns of (header, text) next to each other, long lines wrapped, indentation kept."""
    col = max(30, (width - 3 * (len(columns) - 1)) // len(columns))

    def cell_lines(header: str, text: str) -> list[str]:
        out = [header[:col], "-" * min(col, len(header))]
        for line in text.expandtabs(4).split("\n"):
            out += textwrap.wrap(line, col, drop_whitespace=False, replace_whitespace=False) or [""]
        return out

    cells = [cell_lines(h, t) for h, t in columns]
    rows = itertools.zip_longest(*cells, fillvalue="")
    return "\n".join(" | ".join(c.ljust(col) for c in row).rstrip() for row in rows)
