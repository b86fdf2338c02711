"""One run setup for every command: `prepare(Request) -> Run`.

A command turns its flags into a `Request` (the config, the sampling, the SpS drafters
it runs, where the weights come from, the quantization, the datastore, the mesh) and
calls `prepare`, which checks everything the flags and config files say before any file
is read: what each drafter DECLARES it needs (`decode.drafters.base.Drafter`: a draft
model, heads of a kind, a datastore, an adaptive length, its cap on K) against the weight
flags given, K against the models' context, the quantization against the self-draft.
The `Run` it returns then, in this order, finds the weights (`Run.locate`: the files, the
mini pair trained on first use, the tokenizer, the stop ids, the datastore; host work
only) and puts the models on the mesh (`Run.load`). sample, bench, evaluate, plan,
datastore and the launch scripts all go through it, so a flag means the same thing, and
is refused for the same reason, in every command; none asks which drafter it runs.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Optional, Sequence

import jax

from specjax import distributed, sharding
from specjax.app import locate
from specjax.app.locate import Sources, Weights
from specjax.config import Config, HeadsConfig, MeshConfig, ModelConfig, SamplingConfig, UsageError
from specjax.decode import drafters
from specjax.weights import self_draft as self_draft_lib


@dataclasses.dataclass(frozen=True)
class Request:
    """One run, as a command line describes it."""

    config: Config  # with the command line's overrides
    sampling: Optional[SamplingConfig] = None  # the run's (None: the config's); bench: the one its sweeps vary
    drafters: Sequence[str] = ()  # the SpS drafters the run uses (bench: every one compared); (): ArS only
    lookahead: Optional[int] = None  # the largest K the run uses (bench's sweep); None: sampling.lookahead
    sources: Sources = Sources()  # checkpoints, Hugging Face directories, GGUF files, a self-draft
    self_drafts: Optional[Sequence[str]] = None  # bench compares several; None: sources.self_draft
    quantize: Optional[str] = None  # a `config.QUANTIZATIONS` name: the models quantized on load
    datastore: Optional[str] = None  # for the drafters that use one
    mesh: Optional[MeshConfig] = None  # None: the config's
    train_missing: bool = False  # train the mini pair when its default checkpoints are missing
    sps: str = ""  # how the command names its speculative side in messages (e.g. "--mode=both"), if it does


@dataclasses.dataclass
class Run:
    """A checked run (`prepare`), then its weights found (`locate`), then its models on
    the mesh (`load`)."""

    request: Request
    config: Config  # the models the flags name (imported ones read from their own files; a self-draft's)
    sampling: SamplingConfig  # checked against the models' context; after `locate`, with their stop ids
    draft_model: bool  # some drafter of the run draws from a draft model
    heads: tuple[str, ...]  # the kinds of draft heads the run's drafters draw from
    specs: tuple  # the self-drafts (`weights.self_draft.Spec`), if any
    context: int  # tokens every model of the run can hold: prompt + new tokens fit in it
    weights: Optional[Weights] = None
    stop_ids: tuple[int, ...] = ()
    datastore: object = None
    load_seconds: Optional[float] = None  # `load`'s: read or initialised, placed, quantized
    mesh: object = None
    target: object = None
    # What the drafters draw from: 'model' (the draft model), each self-draft's text, each
    # heads kind; `draft_for` picks a drafter's.
    drafts: dict = dataclasses.field(default_factory=dict)
    _tokenizer: object = dataclasses.field(default=None, repr=False)

    @property
    def models(self) -> dict[str, ModelConfig]:
        """The models a run puts on the mesh: the target, and the draft model where one is used."""
        return {"target": self.config.target, **({"draft": self.config.draft} if self.draft_model else {})}

    @property
    def tokenizer(self):
        """The target's tokenizer (None: it has none), read on first use."""
        if self._tokenizer is None and self.weights is not None:
            self._tokenizer = self.weights.tokenizer() or False
        return self._tokenizer or None

    @property
    def no_tokenizer_reason(self) -> str:
        return self.weights.no_tokenizer_reason

    def heads_config(self, kind: str) -> HeadsConfig:
        """The draft heads of `kind` the run uses: their checkpoint's (metadata only) or,
        without one, the random ones `--init=random` makes."""
        directory = self.weights.heads_dirs.get(kind) if self.weights is not None else None
        if directory is not None:
            from specjax.weights import checkpoint
            return checkpoint.heads_config(directory)
        return self.config.heads_for(kind)

    def check_caps(self, lookahead: int, heads: bool = True) -> None:
        """K against each drafter's declared cap (Medusa: its number of heads; a parallel
        draft: its parallel_draft); without `heads`, the draft-model drafters' only."""
        for name in self.request.drafters:
            cls = drafters.kind(name)
            if cls.heads_kind and not heads:
                continue
            cap = cls.max_lookahead(self.heads_config(cls.heads_kind) if cls.heads_kind else self.config.draft)
            if cap is not None and lookahead > cap:
                raise UsageError(f"--lookahead={lookahead} with --drafter={name}: it proposes at most {cap} tokens a "
                                 f"loop with these weights" + (f" (num_heads={cap})" if cls.heads_kind == "medusa"
                                                                else ""))

    def locate(self) -> "Run":
        """Find the weights (training the mini pair where missing and asked to), then read
        on process 0 and share: the stop ids (into `sampling.eos_id` where the run left it
        to the model) and the datastore. Host work only."""
        req = self.request
        self.weights = req.sources.locate(self.config, need_draft=self.draft_model, train_missing=req.train_missing,
                                          need_heads=self.heads)
        self.check_caps(req.lookahead or self.sampling.lookahead)

        def host():
            tokenizer = self.tokenizer
            stop = self.weights.stop_ids(tokenizer)
            uses = any(drafters.kind(n).uses_datastore for n in req.drafters)
            store = locate.load_datastore(req.datastore if uses else None, self.config.target.vocab_size, tokenizer)
            return tuple(stop), store

        self.stop_ids, self.datastore = distributed.agreed(host)
        if self.sampling.eos_id is None:  # the model's own stop ids; an explicit -1 never stops early
            stop = self.stop_ids
            self.sampling = dataclasses.replace(self.sampling, eos_id=(stop[0] if len(stop) == 1 else stop)
                                                if stop else -1)
        return self

    def load(self) -> "Run":
        """The mesh (the first device work: every input is valid by now) and the models on
        it: the target, and what each drafter draws from."""
        if self.weights is None:
            self.locate()
        req = self.request
        start = time.perf_counter()
        self.mesh = sharding.make_checked_mesh(req.mesh or self.config.mesh, self.models)
        target, draft = self.weights.load(self.mesh, need_draft=self.draft_model, quantize=req.quantize)
        self.target, self.drafts = target, {}
        if self.draft_model:
            if self.specs:  # every self-draft made of the one target's arrays
                self.drafts.update({spec.text: self_draft_lib.self_draft(target, spec) for spec in self.specs})
            else:
                self.drafts["model"] = draft
        for kind in self.heads:
            self.drafts[kind] = self.weights.heads(target, self.mesh, kind)
        jax.block_until_ready((target.params, self.drafts))  # quantizing runs asynchronously: count it here
        self.load_seconds = time.perf_counter() - start
        return self

    def draft_for(self, drafter: str, self_draft: Optional[str] = None):
        """What `drafter` draws from in this run (None: nothing, a lookup, or a run without
        SpS): its heads, the self-draft `self_draft` (default the first), or the draft model."""
        cls = drafters.kind(drafter)
        if cls.heads_kind:
            return self.drafts.get(cls.heads_kind)
        if not cls.needs_draft_model:
            return None
        return self.drafts.get(self_draft or (self.specs[0].text if self.specs else "model"))


def uses(names: Sequence[str]) -> tuple[bool, tuple[str, ...]]:
    """(whether any of the drafters `names` draws from a draft model, the heads kinds they draw from)."""
    classes = [drafters.kind(n) for n in names]
    return any(c.needs_draft_model for c in classes), tuple(sorted({c.heads_kind for c in classes if c.heads_kind}))


def _described(names: Sequence[str], sps: str) -> str:
    if not names:
        return "--mode=ars (the target alone)"
    return (f"{sps} with " if sps else "") + f"--drafter={','.join(names)}"


def check_draft_flags(req: Request, draft_model: bool, heads: tuple[str, ...]) -> None:
    """A flag that names draft weights is given only where a drafter of the run uses them
    (a draft model's for drafters that draw from one, heads' for heads drafters); given
    elsewhere it would be accepted and ignored."""
    s = req.sources
    model_users = " or ".join(drafters.using("needs_draft_model"))
    what = _described(req.drafters, req.sps)
    self_drafts = req.self_drafts if req.self_drafts is not None else ([s.self_draft] if s.self_draft else [])
    if not draft_model:
        for flag, value in (("--hf_draft", s.hf_draft), ("--gguf_draft", s.gguf_draft),
                            ("--self_draft", ",".join(self_drafts) or None)):
            if value is not None:
                raise UsageError(f"{flag}={value} names a draft model, and {what} uses none (drafters that draw from a "
                                 f"draft model: {model_users}): drop {flag}"
                                 + (", or use --mode=sps|both" if not req.drafters else ""))
        if s.draft_checkpoint is not None and not heads:
            raise UsageError(f"--draft_checkpoint={s.draft_checkpoint} names draft weights, and {what} uses none: "
                             f"drop it")
    if s.draft_checkpoint is not None and draft_model and heads:
        raise UsageError(f"--draft_checkpoint={s.draft_checkpoint} is ambiguous: {what} draws from a draft model "
                         f"and from {' and '.join(heads)} heads; compare them in separate runs")
    if heads and not draft_model:
        for flag, value in (("--self_draft", s.self_draft), ("--hf_draft", s.hf_draft),
                            ("--gguf_draft", s.gguf_draft)):
            if value is not None:
                raise UsageError(f"{flag} names a draft model, and --drafter={heads[0]} draws from draft heads "
                                 "(--draft_checkpoint=DIR): drop one of them")


def prepare(req: Request) -> Run:
    """Check the request (every check that needs no file but the config files) and return
    its Run; see the module docstring."""
    sampling = (req.sampling or req.config.sampling).validate()
    draft_model, heads = uses(req.drafters)
    s = req.sources
    check_draft_flags(req, draft_model, heads)
    texts = req.self_drafts if req.self_drafts is not None else ([s.self_draft] if s.self_draft else [])
    each = [dataclasses.replace(s, self_draft=text) for text in texts] or [s]
    specs = tuple(e.self_draft_spec() for e in each if e.self_draft is not None)  # names the draft twice?
    if s.init == "random" and (s.checkpoint or s.draft_checkpoint):
        raise UsageError("--checkpoint/--draft_checkpoint have no effect with --init=random: drop one of them")
    for spec in specs:
        self_draft_lib.check_quantize(spec, req.quantize)
    # The models' own config files (Hugging Face, GGUF) and the first self-draft's; the
    # others differ only in their self-draft, each checked against the target's layers.
    config = each[0].configure(req.config, heads=bool(heads) and not draft_model)
    for spec in specs[1:]:
        spec.check(config.target.num_layers)
    if draft_model:
        target, draft = s.imported()
        if target is not None and draft is None and not specs:
            raise UsageError(f"{_described(req.drafters, req.sps)} needs a draft: pass --hf_draft=DIR or "
                             "--gguf_draft=FILE (a model with the target's tokenizer), --self_draft=layers:N, use "
                             "--drafter=ngram (no draft model), or use --mode=ars")
        if config.draft is None:
            raise UsageError(f"{_described(req.drafters, req.sps)} needs a draft model, and config {config.name!r} "
                             "has none: use --self_draft=layers:N, --drafter=ngram, --mode=ars, or a config with a "
                             "draft")
    locate.check_datastore_flag(req.datastore, list(req.drafters))
    run = Run(req, config, sampling, draft_model, heads, specs, 0)
    run.context = min(m.max_seq_len for m in run.models.values())
    lookahead = req.lookahead or sampling.lookahead
    if req.drafters and lookahead >= run.context:
        raise UsageError(f"--lookahead={lookahead}: must be below the model's context of {run.context} tokens")
    dataclasses.replace(sampling, lookahead=lookahead).check_context(run.context)
    # A draft model's cap is its config's (its checkpoint must match it); random heads' is
    # known now too, a checkpoint's heads' once located.
    run.check_caps(lookahead, heads=s.init == "random")
    return run
