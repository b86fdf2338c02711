"""Where the target and draft weights come from, found before any device work.

A checkpoint directory (by default the one `python -m specjax.train --config=NAME`
writes), a Hugging Face model directory (--hf_target / --hf_draft), a GGUF file
(--gguf_target / --gguf_draft; either kind for either model), or random init;
every missing directory is reported before JAX starts. The mini pair is small enough to
train on a laptop, so its missing checkpoints are trained here on first use (progress
bar; cached afterwards, resumable if interrupted).
"""
from __future__ import annotations

import dataclasses
import pathlib
import sys
from typing import Optional, Sequence

import jax

from specjax import distributed
from specjax.config import EAGLE_KINDS, Config, ModelConfig, UsageError, load_config, user_path
from specjax.model import init_lm
from specjax.training import trainer
from specjax.weights import checkpoint as ckpt_lib
from specjax.weights.tokenizer import Tokenizer, TokenizerError


# Configs small enough that `sample` trains them itself when their checkpoint is missing
# (in this order: the draft is distilled from the target).
AUTO_TRAIN = ("mini_target", "mini_draft")


def train_command(name: str) -> str:
    return f"python -m specjax.train --config={name or 'DRAFT_CONFIG'}"


RUNTIME_FIELDS = ("param_dtype", "compute_dtype", "scan_layers")


@dataclasses.dataclass(frozen=True)
class Imported:
    """A model's weights in a format another library writes: a Hugging Face directory
    ('hf', `specjax.weights.hf`) or a GGUF file ('gguf', `specjax.weights.gguf`). Both
    readers offer read_config, check_weights, tokenizer and load."""

    kind: str
    path: str

    @property
    def reader(self):
        from specjax.weights import gguf, hf
        return {"hf": hf, "gguf": gguf}[self.kind]

    def flag(self, role: str) -> str:
        return f"--{self.kind}_{role}"

    def runtime(self, base: ModelConfig) -> dict:
        return {f: getattr(base, f) for f in RUNTIME_FIELDS}


def imported(hf_target: Optional[str] = None, hf_draft: Optional[str] = None, gguf_target: Optional[str] = None,
             gguf_draft: Optional[str] = None) -> tuple[Optional[Imported], Optional[Imported]]:
    """(target, draft) named by the --hf_* / --gguf_* flags (either may be None); a draft
    without a target, or two sources for one model, fail here."""
    def one(role, hf_value, gguf_value):
        if hf_value is not None and gguf_value is not None:
            raise UsageError(f"--hf_{role} and --gguf_{role} both name the {role}'s weights: pass one of them")
        return Imported("hf", hf_value) if hf_value is not None else \
            Imported("gguf", gguf_value) if gguf_value is not None else None
    target, draft = one("target", hf_target, gguf_target), one("draft", hf_draft, gguf_draft)
    if target is None and draft is not None:
        raise UsageError(f"{draft.flag('draft')} needs --hf_target or --gguf_target: the target's weights come from "
                         f"a Hugging Face directory or a GGUF file too (pass --hf_target=DIR or --gguf_target=FILE)")
    return target, draft


def with_hf_models(config: Config, hf_target: Optional[str], hf_draft: Optional[str], *, init: str,
                   checkpoint: Optional[str], draft_checkpoint: Optional[str], gguf_target: Optional[str] = None,
                   gguf_draft: Optional[str] = None) -> Config:
    """`config` with its target (and draft) replaced by the models of the Hugging Face
    directories or GGUF files, read from their config.json / metadata alone; the config
    still gives the dtypes, scan_layers, mesh and sampling. Conflicting weight flags fail
    here."""
    target, draft = imported(hf_target, hf_draft, gguf_target, gguf_draft)
    if target is None:
        return config
    for flag, value in (("--checkpoint", checkpoint), ("--draft_checkpoint", draft_checkpoint)):
        if value is not None:
            raise UsageError(f"{target.flag('target')} and {flag} both name weights: pass Hugging Face directories "
                             "or GGUF files (--hf_target/--hf_draft, --gguf_target/--gguf_draft) or specjax "
                             "checkpoints, not both")
    if init == "random":
        raise UsageError(f"--init=random ignores {target.flag('target')}: drop one of them")

    def model(source, base):
        return source.reader.read_config(source.path, **source.runtime(base)).model

    return dataclasses.replace(config, target=model(target, config.target),
                               draft=model(draft, config.draft or config.target) if draft is not None else None,
                               tokenizer_vocab=0, target_from="", draft_from="").validate()


def self_draft_spec(text: Optional[str], *, hf_draft: Optional[str] = None, gguf_draft: Optional[str] = None,
                    draft_checkpoint: Optional[str] = None):
    """--self_draft's Spec (None when not given), checked before any other weight flag: a
    flag that names other draft weights next to it fails here."""
    if text is None:
        return None
    from specjax.weights import self_draft
    for flag, value in (("--hf_draft", hf_draft), ("--gguf_draft", gguf_draft),
                        ("--draft_checkpoint", draft_checkpoint)):
        if value is not None:
            raise UsageError(f"--self_draft={text!r} and {flag} both name the draft: pick one of them")
    return self_draft.parse(text)


def with_self_draft(config: Config, spec) -> Config:
    """`config` whose draft is the self-draft `spec` (a `weights.self_draft.Spec`, made from
    the target at load time; None: `config` itself). `config.target` is final (after
    `with_hf_models`): N is checked against its layers."""
    if spec is None:
        return config
    from specjax.weights import self_draft
    return dataclasses.replace(config, draft=self_draft.draft_config(config.target, spec), draft_from="").validate()


@dataclasses.dataclass(frozen=True)
class Sources:
    """Where a run's weights come from, as one group of flags names them (`cli.define_weight_flags`,
    the same in sample, bench and evaluate): specjax checkpoints, Hugging Face directories,
    GGUF files, a self-draft made of the target, or random init. `configure` and `locate`
    are the one run setup every command goes through."""

    init: str = "checkpoint"  # 'checkpoint' | 'random'
    checkpoint: Optional[str] = None
    draft_checkpoint: Optional[str] = None
    hf_target: Optional[str] = None
    hf_draft: Optional[str] = None
    gguf_target: Optional[str] = None
    gguf_draft: Optional[str] = None
    self_draft: Optional[str] = None  # 'layers:N'

    def imported(self) -> tuple[Optional[Imported], Optional[Imported]]:
        return imported(self.hf_target, self.hf_draft, self.gguf_target, self.gguf_draft)

    def self_draft_spec(self):
        """--self_draft's Spec, or None; a flag naming other draft weights next to it fails."""
        return self_draft_spec(self.self_draft, hf_draft=self.hf_draft, gguf_draft=self.gguf_draft,
                               draft_checkpoint=self.draft_checkpoint)

    def configure(self, config: Config, heads: bool = False) -> Config:
        """`config` with the imported models (read from their own config files) and the
        self-draft in place of its draft; conflicting flags fail here, before any weights
        are looked for. Every process reads the imported files itself (each loads its own
        slices), so every process checks them, and all stop if one cannot. With `heads`
        (the drafter draws from draft heads), --draft_checkpoint names the heads, which
        go with an imported target too."""
        spec = self.self_draft_spec()
        config = distributed.everywhere(lambda: with_hf_models(
            config, self.hf_target, self.hf_draft, init=self.init, checkpoint=self.checkpoint,
            draft_checkpoint=None if heads else self.draft_checkpoint, gguf_target=self.gguf_target,
            gguf_draft=self.gguf_draft))
        return with_self_draft(config, spec)

    def locate(self, config: Config, *, need_draft: bool, train_missing: bool,
               need_heads: Sequence[str] = ()) -> "Weights":
        """The weights of `config` (from `configure`), found (the mini pair trained if
        missing and `train_missing`); with `need_heads` (kinds: 'medusa', 'eagle'), the
        draft heads' of each too; no JAX work."""
        if need_heads and not need_draft:
            for flag, value in (("--self_draft", self.self_draft), ("--hf_draft", self.hf_draft),
                                ("--gguf_draft", self.gguf_draft)):
                if value is not None:
                    raise UsageError(f"{flag} names a draft model, and --drafter={need_heads[0]} draws from draft "
                                     "heads (--draft_checkpoint=DIR): drop one of them")
        return Weights.locate(config, self.init, self.checkpoint, self.draft_checkpoint, need_draft=need_draft,
                              train_missing=train_missing, hf_target=self.hf_target, hf_draft=self.hf_draft,
                              gguf_target=self.gguf_target, gguf_draft=self.gguf_draft,
                              self_draft=self.self_draft_spec(), need_heads=need_heads)

    def named(self) -> dict:
        """The flags given (for a run's report)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None and k != "init"}


@dataclasses.dataclass
class Weights:
    config: Config
    init: str  # 'checkpoint' | 'random' | 'imported'
    target_dir: Optional[pathlib.Path]  # a GGUF file for kind 'gguf'
    draft_dir: Optional[pathlib.Path]
    sources: tuple = ()  # 'imported': (target Imported, draft Imported or None)
    self_draft: object = None  # a weights.self_draft.Spec: the draft is made from the target at load time
    # Each kind of draft heads' checkpoint (drafters 'medusa', 'eagle'); None: random heads.
    heads_dirs: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def locate(cls, config: Config, init: str, checkpoint: Optional[str], draft_checkpoint: Optional[str],
               *, need_draft: bool, train_missing: bool, hf_target: Optional[str] = None,
               hf_draft: Optional[str] = None, gguf_target: Optional[str] = None,
               gguf_draft: Optional[str] = None, self_draft=None, need_heads: Sequence[str] = ()) -> "Weights":
        """Find (and for the mini pair, train) the checkpoint directories; no JAX work.
        With `hf_target` or `gguf_target`, `config` comes from `with_hf_models`; with a
        `self_draft` Spec, from `with_self_draft` (no draft weights are looked for).
        `need_heads`: also the checkpoint of each of these kinds of draft heads ('medusa',
        'eagle'): --draft_checkpoint (for one kind without a draft model), else the config
        of that kind that `config.heads_from` names, else this config's when its heads are of it."""
        found = cls._locate(config, init, checkpoint, None if need_heads and not need_draft else draft_checkpoint,
                            need_draft=need_draft, train_missing=train_missing, hf_target=hf_target,
                            hf_draft=hf_draft, gguf_target=gguf_target, gguf_draft=gguf_draft, self_draft=self_draft)
        given = draft_checkpoint if len(need_heads) == 1 and not need_draft else None
        imported_target = hf_target is not None or gguf_target is not None
        return dataclasses.replace(found, heads_dirs={kind: _heads_dir(config, init, given, kind, imported_target)
                                                      for kind in need_heads})

    @classmethod
    def _locate(cls, config: Config, init: str, checkpoint: Optional[str], draft_checkpoint: Optional[str],
                *, need_draft: bool, train_missing: bool, hf_target: Optional[str] = None,
                hf_draft: Optional[str] = None, gguf_target: Optional[str] = None,
                gguf_draft: Optional[str] = None, self_draft=None) -> "Weights":
        if self_draft is not None:
            found = cls._locate(config, init, checkpoint, None, need_draft=False, train_missing=train_missing,
                                hf_target=hf_target, gguf_target=gguf_target)
            return dataclasses.replace(found, self_draft=self_draft)
        target, draft = imported(hf_target, hf_draft, gguf_target, gguf_draft)
        if target is not None:
            draft = draft if need_draft else None

            def check():  # every process reads its own slices: every process must see the files
                target.reader.check_weights(target.path, config.target)
                if draft is not None:
                    draft.reader.check_weights(draft.path, config.draft)

            distributed.everywhere(check)
            return cls(config, "imported", user_path(target.path), user_path(draft.path) if draft else None,
                       (target, draft))
        if config.hf_weights and init == "checkpoint":
            raise UsageError(f"config {config.name!r} takes its weights from Hugging Face directories or GGUF files: "
                             "pass --hf_target=DIR (and --hf_draft=DIR for SpS) or --gguf_target=FILE (and "
                             "--gguf_draft=FILE), or use --init=random")
        target_name = config.target_from or config.name
        draft_name = config.draft_from
        target_dir = _resolve(checkpoint, target_name)
        if init == "checkpoint" and checkpoint is None and draft_checkpoint is None and not (
                train_missing and target_name in AUTO_TRAIN):
            distributed.everywhere(lambda: _no_weights(config, target_name, target_dir, need_draft))
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
        # Training on one process of many would leave the others waiting: only single-process runs train.
        train_missing = train_missing and jax.process_count() == 1
        to_train = [name for flag, given, name, d in wanted if given is None and name in AUTO_TRAIN
                    and train_missing and _latest_step(d) < load_config(name).train.steps]
        # Every process must see the directories before any opens them with orbax, whose
        # managers synchronise all processes: a directory on worker 0 only would otherwise
        # leave the others waiting.
        distributed.everywhere(lambda: _check_visible(wanted, to_train))
        for flag, given, name, d in wanted:
            if _latest_step(d) < 0 and name not in to_train:
                _missing(flag, given, name, d, "holds no finished checkpoint" if d.is_dir() else "does not exist")
        if to_train:
            train([n for n in AUTO_TRAIN if n in to_train])  # the draft's teacher first
        # A checkpoint of another model fails here, from its metadata, before any JAX work.
        _check_compatible(target_dir, config.target, target_name)
        if need_draft:
            _check_compatible(draft_dir, config.draft, draft_name or f"{config.name}.draft")
        return cls(config, init, target_dir, draft_dir)

    @property
    def no_tokenizer_reason(self) -> str:
        if self.init == "imported":
            return (f"{self.target_dir} has no tokenizer (neither tokenizer.json nor tokenizer.model)"
                    if self.sources[0].kind == "hf" else f"{self.target_dir} has no tokenizer (no tokenizer.ggml "
                                                         "metadata)")
        return (f"config {self.config.name!r} has no tokenizer"
                + (f" (none in {self.target_dir})" if self.target_dir else ""))

    def tokenizer(self):
        """The tokenizer saved with the target's checkpoint, in its Hugging Face directory
        or GGUF file, if there is one; a draft's tokenizer must be the same."""
        if self.init == "imported":
            from specjax.weights import hf
            target, draft = self.sources
            tok = target.reader.tokenizer(target.path)
            if draft is not None:
                hf.same_vocabulary(tok, draft.reader.tokenizer(draft.path))
            if tok is not None and tok.vocab_size > self.config.target.vocab_size:
                raise UsageError(f"tokenizer {tok.path} has {tok.vocab_size} tokens, more than the model's "
                                 f"vocab_size={self.config.target.vocab_size}")
            return tok
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

    def stop_ids(self, tokenizer) -> tuple[int, ...]:
        """The ids that end a sample: the tokenizer's, or a Hugging Face directory's
        generation_config.json when it has no tokenizer."""
        if tokenizer is not None:
            return tuple(tokenizer.stop_ids)
        if self.init == "imported":
            return self.sources[0].reader.read_config(self.sources[0].path).eos_ids
        return ()

    def heads(self, target, mesh, kind: str):
        """The draft heads of `kind` ('medusa', 'eagle') for `target`: from their checkpoint,
        or random ones (`config.heads` where of that kind, else the defaults) with --init=random."""
        directory = self.heads_dirs.get(kind)
        if directory is not None:
            heads = ckpt_lib.load_heads(target.cfg, mesh, directory)
            if heads.cfg.kind != kind:
                raise UsageError(f"{directory} holds {heads.cfg.kind} heads, and --drafter={kind} needs {kind} heads")
            own = self.config.heads
            if own is not None and own.kind == kind and own.quantize != heads.cfg.quantize:
                # The precision the heads decode in is the run's choice (training is float).
                heads = dataclasses.replace(heads, cfg=dataclasses.replace(heads.cfg, quantize=own.quantize))
            return heads
        from specjax.heads import init_heads
        return init_heads(self.config.heads_for(kind), target.cfg, mesh, random=True)

    def load(self, mesh, *, need_draft: bool | str, quantize: Optional[str] = None):
        """(target, draft or None) on `mesh`; with `quantize` ('int8', 'int4'), each quantized
        on load (`LM.quantized`; a GGUF file's Q8_0/Q4_0/Q4_1 tensors taken as stored):
        the run samples the quantized models. A self-draft is made of the (quantized)
        target's own arrays; with need_draft a kind of heads ('medusa', 'eagle', 'eagle3') the draft
        is those heads."""
        if need_draft in ("medusa", *EAGLE_KINDS):
            target, _ = self.load(mesh, need_draft=False, quantize=quantize)
            return target, self.heads(target, mesh, need_draft)
        if self.self_draft is not None:
            from specjax.weights.self_draft import self_draft
            target, _ = dataclasses.replace(self, self_draft=None)._load(mesh, False, quantize)
            target = target.quantized(quantize) if quantize is not None else target
            return target, self_draft(target, self.self_draft) if need_draft else None
        target, draft = self._load(mesh, need_draft, quantize)
        if quantize is not None:
            target, draft = target.quantized(quantize), (draft.quantized(quantize) if draft is not None else None)
        return target, draft

    def _load(self, mesh, need_draft: bool, quantize: Optional[str] = None):
        if self.init == "imported":
            def one(source, cfg):
                # With `quantize`, a file's quantized weights (GGUF Q8_0/Q4_0/Q4_1) are taken
                # as stored, not re-quantized from their float values.
                stores = quantize is not None and hasattr(source.reader, "stored_maker")
                lm, _ = source.reader.load(source.path, mesh, **source.runtime(cfg),
                                           **({"quantize": quantize} if stores else {}))
                return lm
            target, draft = self.sources
            return one(target, self.config.target), (one(draft, self.config.draft) if need_draft else None)
        if self.init == "random":
            target = init_lm(self.config.target, mesh)
            draft = init_lm(self.config.draft, mesh) if need_draft else None
            return target, draft
        c = self.config
        target = ckpt_lib.load_lm(c.target, mesh, self.target_dir, config_name=c.target_from or c.name)
        draft = (ckpt_lib.load_lm(c.draft, mesh, self.draft_dir, config_name=c.draft_from or f"{c.name}.draft")
                 if need_draft else None)
        return target, draft


def _heads_dir(config: Config, init: str, given: Optional[str], kind: str,
               imported: bool = False) -> Optional[pathlib.Path]:
    """The checkpoint directory of the `kind` heads, checked to exist; None for random
    heads. `imported`: the target comes from a Hugging Face directory or a GGUF file, so
    the heads `heads_from` names (trained on the config's own target) are not its; a
    config with heads of its own names them (one that trains them on that file)."""
    if init == "random":
        return None
    names = [n for n in config.heads_from.split(",") if n.strip()] if not imported else []
    name = next((n.strip() for n in names if _heads_kind(n.strip()) == kind), "")
    if not name and config.heads is not None and config.heads.kind == kind:
        name = config.name
    if given is None and not name:
        from specjax.decode.drafters import REGISTRY
        users = "|".join(n for n, cls in REGISTRY.items() if cls.heads_kind == kind)  # eagle3|hybrid_eagle3
        if imported:
            raise UsageError(f"--drafter={users} draws from {kind} heads trained on this target: pass "
                             f"--draft_checkpoint=DIR, what `python -m specjax.train --config=YOUR_HEADS_CONFIG "
                             f"--workdir=DIR` writes for a config with heads of kind {kind!r} whose "
                             f"train.teacher_hf / train.teacher_gguf is this model (docs/training.md)")
        raise UsageError(f"--drafter={users} draws from {kind} heads, and config {config.name!r} names none (no "
                         f"`heads` of that kind): pass --draft_checkpoint=DIR (what `python -m specjax.train "
                         f"--config=CONFIG_WITH_HEADS --workdir=DIR` writes; e.g. mini_{kind}), or use --init=random")
    directory = _resolve(given, name)
    what = "holds no finished checkpoint" if directory.is_dir() else "does not exist"
    if distributed.everywhere(lambda: _latest_step(directory)) < 0:
        _missing("--draft_checkpoint", given, name or "CONFIG_WITH_HEADS", directory, what)
    return directory


def _heads_kind(name: str) -> str | None:
    """The kind of the heads config `name` trains (None: it has none)."""
    heads = load_config(name).heads
    return heads.kind if heads is not None else None


def _no_weights(config: Config, name: str, directory, need_draft: bool) -> None:
    """No weight flags and no default checkpoint: one message with both ways forward."""
    if directory.is_dir():
        return
    draft = " --draft_checkpoint=DIR" if need_draft else ""
    raise UsageError(
        f"config {config.name!r} has no weights on this machine: no checkpoint for config {name!r} ({directory} "
        f"does not exist). Time it with random weights: `python -m specjax.sample --config={config.name} "
        f"--init=random --prompt_tokens=1,2,3`; or give it real weights: --checkpoint=DIR{draft} (what "
        f"`{train_command(name)} --workdir=DIR` writes), or --hf_target=DIR{' --hf_draft=DIR' if need_draft else ''} "
        "(Hugging Face Llama-family directories; see the llama3_70b_1b config)")


def _check_visible(wanted, to_train) -> None:
    for flag, given, name, d in wanted:
        if not d.is_dir() and name not in to_train:
            _missing(flag, given, name, d, "does not exist")


def _missing(flag: str, given: Optional[str], name: str, directory, what: str) -> None:
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"{flag}={str(directory)!r} is a file, not a checkpoint directory: pass the directory "
                         f"that `{train_command(name)} --workdir=DIR` writes, or use --init=random")
    if given is not None:
        raise UsageError(f"{flag}={given!r}: no checkpoint there (the directory {what}); create one "
                         f"with `{train_command(name)} --workdir={given}`, or use --init=random")
    raise UsageError(f"no checkpoint for config {name!r}: {directory} {what}; create it with "
                     f"`{train_command(name)}`, pass {flag}=DIR, or use --init=random")


def _resolve(given: Optional[str], name: str) -> Optional[pathlib.Path]:
    if given is not None:
        return user_path(given)
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


# What one first-use training phase takes, as docs/training.md measured it on 2 CPU cores.
PHASE_MINUTES = "30-60"


def train(names: Sequence[str]) -> None:
    """Train the named configs into their default checkpoint directories (progress bars),
    each phase labelled i/n with the whole run's estimate."""
    for i, name in enumerate(names, 1):
        config = load_config(name)
        total = f"; {len(names)} phases, about {PHASE_MINUTES} minutes each on 2 CPU cores" if i == 1 else ""
        print(f"specjax: [{i}/{len(names)}] no checkpoint for {name!r} yet; training it now ({config.train.steps} "
              f"steps, {config.target.num_params / 1e6:.1f}M params{total}). This happens once; an interrupted run "
              f"resumes. The same by hand: {train_command(name)}", file=sys.stderr, flush=True)
        result = trainer.train(config, ckpt_lib.default_dir(name), progress=True)
        if result.stopped_by:
            from specjax.app.cli import Stopped
            raise Stopped(f"specjax: training {name!r} stopped at step {result.step} of {config.train.steps} "
                          f"({result.stopped_by}); run the same command again to resume", result.stopped_by)


# --------------------------------------------------------------------------- the datastore


def check_datastore_flag(path: Optional[str], drafter_names: Sequence[str]) -> None:
    """--datastore given where a drafter of the run (sample: one; bench: those compared)
    needs it, and only where one uses it: before any file is read."""
    from specjax.decode import drafters
    needs = [name for name in drafter_names if drafters.kind(name).needs_datastore]
    if needs and path is None:
        raise UsageError(f"--drafter={needs[0]} needs --datastore=PATH (build one with `python -m specjax.datastore`)")
    if path is not None and not any(drafters.kind(name).uses_datastore for name in drafter_names):
        raise UsageError(f"--datastore is used only by --drafter={' or '.join(drafters.using('uses_datastore'))} "
                         f"(got --drafter={','.join(drafter_names)})")


def load_datastore(path: Optional[str], vocab_size: int, tokenizer: Optional[Tokenizer]):
    """The `Datastore` at `path` (None: none), checked against the target's vocabulary and
    the tokenizer the prompts are encoded with."""
    if path is None:
        return None
    from specjax.decode.retrieval_index import Datastore, file_sha256
    store = Datastore.load(path)
    store.check(vocab_size, name=f"--datastore={path}")
    store.check_tokenizer(file_sha256(tokenizer.path) if tokenizer else None, f"--datastore={path}")
    return store
