"""Where the target and draft weights come from, found before any device work.

A checkpoint directory (by default the one `python -m specjax.train --config=NAME`
writes) or random init; every missing directory is reported before JAX starts. The mini
pair is small enough to train on a laptop, so its missing checkpoints are trained here on
first use (progress bar; cached afterwards, resumable if interrupted).
"""
from __future__ import annotations

import dataclasses
import pathlib
import sys
from typing import Optional, Sequence

from specjax.config import Config, ModelConfig, UsageError, load_config
from specjax.model import init_lm
from specjax.training import trainer
from specjax.weights import checkpoint as ckpt_lib
from specjax.weights.tokenizer import Tokenizer, TokenizerError


# Configs small enough that `sample` trains them itself when their checkpoint is missing
# (in this order: the draft is distilled from the target).
AUTO_TRAIN = ("mini_target", "mini_draft")


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
            if d.exists() and not d.is_dir():
                raise UsageError(f"{flag}={str(d)!r} is a file, not a checkpoint directory: pass the directory "
                                 f"that `{train_command(name)} --workdir=DIR` writes, or use --init=random")
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
        path = ckpt_lib.tokenizer_path(self.target_dir)
        if path is None:
            return None
        try:
            tok = Tokenizer(path)
        except TokenizerError as e:
            raise UsageError(str(e)) from None
        if tok.vocab_size != self.config.target.vocab_size:
            raise UsageError(f"tokenizer {path} has {tok.vocab_size} tokens but config {self.config.name!r} "
                             f"has target.vocab_size={self.config.target.vocab_size}")
        draft_path = ckpt_lib.tokenizer_path(self.draft_dir) if self.draft_dir is not None else None
        if draft_path is not None and draft_path.read_bytes() != path.read_bytes():
            # Same vocabulary size, other pieces: q(x)/p(x) would compare unrelated tokens.
            raise UsageError(f"the target's tokenizer {path} and the draft's {draft_path} differ: speculative "
                             "sampling needs a draft trained with the target's tokenizer")
        return tok

    def load(self, mesh, *, need_draft: bool):
        if self.init == "random":
            target = init_lm(self.config.target, mesh)
            draft = init_lm(self.config.draft, mesh) if need_draft else None
            return target, draft
        c = self.config
        target = ckpt_lib.load_lm(c.target, mesh, self.target_dir, config_name=c.target_from or c.name)
        draft = (ckpt_lib.load_lm(c.draft, mesh, self.draft_dir, config_name=c.draft_from or f"{c.name}.draft")
                 if need_draft else None)
        return target, draft


def _resolve(given: Optional[str], name: str) -> Optional[pathlib.Path]:
    if given is not None:
        return pathlib.Path(given).expanduser()
    return ckpt_lib.default_dir(name) if name else None


def _latest_step(directory: Optional[pathlib.Path]) -> int:
    """The newest finished checkpoint step in `directory`; -1 when there is none."""
    if directory is None or not directory.is_dir():
        return -1
    with ckpt_lib.Checkpoints(directory, read_only=True) as ckpt:
        latest = ckpt.latest_step()
    return -1 if latest is None else latest


def _check_compatible(directory: pathlib.Path, cfg: ModelConfig, name: str) -> None:
    with ckpt_lib.Checkpoints(directory, read_only=True) as ckpt:
        ckpt.check_compatible(ckpt.latest_step(), cfg, name)


def train(names: Sequence[str]) -> None:
    """Train the named configs into their default checkpoint directories (progress bars)."""
    for name in names:
        config = load_config(name)
        print(f"specjax: no checkpoint for {name!r} yet; training it now ({config.train.steps} steps, "
              f"{config.target.num_params / 1e6:.1f}M params). This happens once; an interrupted run "
              f"resumes. The same by hand: {train_command(name)}", file=sys.stderr, flush=True)
        result = trainer.train(config, ckpt_lib.default_dir(name), progress=True)
        if result.stopped_by:
            print(f"specjax: training {name!r} stopped at step {result.step} of {config.train.steps} "
                  f"({result.stopped_by}); run the same command again to resume", file=sys.stderr)
            sys.exit(130 if result.stopped_by == "SIGINT" else 143)
