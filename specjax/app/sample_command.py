"""The `sample` command's run: every prompt x sample row, in batches, with ArS and/or SpS,
written as JSONL and reported. Every input is checked before a model is built or
compiled; the output file is touched only when the first batch is done."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Optional, Sequence

from specjax import distributed, sharding
from specjax.app import cli, locate, prompts as prompts_lib
from specjax.app.locate import Sources, Weights
from specjax.app.output import JsonlWriter, check_writable
from specjax.app.report import Report
from specjax.config import SEED_LIMIT, Config, MeshConfig, SamplingConfig, UsageError
from specjax.decode import api, drafters
from specjax.decode.retrieval_index import Datastore
from specjax.weights import self_draft

MAX_ROWS = 1_000_000  # prompts x samples: beyond this the row list alone is a memory problem


@dataclasses.dataclass(frozen=True)
class Request:
    """One `sample` run, as the command line describes it."""

    config: Config
    modes: Sequence[str]  # 'ars', 'sps' or both, in that order
    sampling: SamplingConfig
    prompt_flags: dict  # prompts_lib.gather's arguments: texts, prompts_file, token_lists, humaneval_n
    mesh: MeshConfig
    num_samples: int = 1
    batch_size: int = 1
    seed: int = 0
    sources: Sources = Sources()  # checkpoints, Hugging Face directories, GGUF files, a self-draft
    output: Optional[str] = None
    train_missing: bool = True
    print_samples: bool = True
    datastore: Optional[str] = None  # for drafter='retrieval' | 'hybrid'
    quantize: Optional[str] = None  # 'int8': target and draft quantized on load


@dataclasses.dataclass(frozen=True)
class Inputs:
    """Everything read from the host for a run: the same on every process."""

    prompts: list  # prompts_lib.Prompt, tokenised
    sampling: SamplingConfig  # with the tokenizer's eos_id
    batch_size: int
    batches: int
    datastore: Optional[Datastore]  # for drafter='retrieval' | 'hybrid', checked against the tokenizer


def check(req: Request) -> None:
    """The checks that need neither files nor devices (`req.config` has its HF models)."""
    config, sampling = req.config, req.sampling
    target, draft = req.sources.imported()
    if need_draft(req) == "model" and target is not None and draft is None and req.sources.self_draft is None:
        raise UsageError(f"--mode={'both' if len(req.modes) == 2 else 'sps'} with --drafter={sampling.drafter} needs "
                         "a draft: pass --hf_draft=DIR or --gguf_draft=FILE (a model with the target's tokenizer), "
                         "--self_draft=layers:N, use --drafter=ngram (no draft model), or use --mode=ars")
    if need_draft(req) == "model" and config.draft is None:
        raise UsageError(f"--mode={'both' if len(req.modes) == 2 else 'sps'} with --drafter={sampling.drafter} "
                         f"needs a draft model, and config {config.name!r} has none; use --mode=ars, "
                         "--drafter=ngram, or a config with a draft")
    if need_draft(req) == "model" and config.draft is not None:
        drafters.kind(sampling.drafter).check_draft(sampling, config.draft)
    locate.check_datastore_flag(req.datastore, [sampling.drafter])
    self_draft.check_quantize(req.sources.self_draft_spec(), req.quantize)
    if req.sources.init == "random" and (req.sources.checkpoint or req.sources.draft_checkpoint):
        raise UsageError("--checkpoint/--draft_checkpoint have no effect with --init=random: drop one of them")
    context = min(m.max_seq_len for m in models(req).values())
    if sampling.lookahead >= context:
        raise UsageError(f"--lookahead={sampling.lookahead}: must be below the model's context of {context} tokens")
    sampling.check_context(context)


def check_rows(req: Request, raw_prompts) -> None:
    """Row and seed budgets, and the prompts given as token ids (text waits for the tokenizer)."""
    rows = len(raw_prompts) * req.num_samples
    if rows > MAX_ROWS:
        raise UsageError(f"{len(raw_prompts)} prompts x --num_samples={req.num_samples} = {rows} rows; at most "
                         f"{MAX_ROWS} rows per run")
    batches = -(-rows // min(req.batch_size, rows))
    if req.seed + batches > SEED_LIMIT:
        raise UsageError(f"--seed={req.seed}: batch i uses seed + i, and the {batches} batches need seeds below "
                         "2**63")
    token_prompts = prompts_lib.encode([r for r in raw_prompts if r.text is None], None)
    if token_prompts:
        context = min(m.max_seq_len for m in models(req).values())
        prompts_lib.check(token_prompts, req.config.target.vocab_size, context, req.sampling.max_new_tokens)


def need_draft(req: Request) -> str | None:
    """What SpS draws from beside the target: 'model', the kind of heads ('medusa',
    'eagle') or None (a lookup)."""
    kind = drafters.draft_kind(req.sampling.drafter) if "sps" in req.modes else None
    return req.sampling.drafter if kind == "heads" else kind


def models(req: Request) -> dict:
    return {"target": req.config.target, **({"draft": req.config.draft} if need_draft(req) == "model" else {})}


def read_inputs(req: Request, raw_prompts, weights: Weights) -> Inputs:
    """Tokenise the prompts with the checkpoint's tokenizer and check them (process 0)."""
    tokenizer = weights.tokenizer()
    prompts = prompts_lib.encode(raw_prompts, tokenizer, weights.no_tokenizer_reason)
    context = min(m.max_seq_len for m in models(req).values())
    prompts_lib.check(prompts, req.config.target.vocab_size, context, req.sampling.max_new_tokens)
    sampling, stop = req.sampling, weights.stop_ids(tokenizer)
    if sampling.eos_id is None:  # the model's own stop ids; an explicit -1 never stops early
        sampling = dataclasses.replace(sampling, eos_id=(stop[0] if len(stop) == 1 else stop) if stop else -1)
    store = locate.load_datastore(req.datastore if "sps" in req.modes else None, req.config.target.vocab_size,
                                  tokenizer)
    rows = len(prompts) * req.num_samples
    batch_size = min(req.batch_size, rows)  # a bigger batch would only compute padding rows
    return Inputs(prompts, sampling, batch_size, -(-rows // batch_size), store)


def gather_and_check(req: Request):
    raw = prompts_lib.gather(**req.prompt_flags)
    check_rows(req, raw)
    check_writable(req.output, "--output", [req.prompt_flags.get("prompts_file")])
    return raw


def run(req: Request) -> None:
    distributed.maybe_initialize()
    req = dataclasses.replace(req, config=req.sources.configure(req.config, heads=need_draft(req) not in ("model", None)))
    check(req)
    cli.use_compilation_cache()
    # Host inputs are read by process 0 and shared: one answer (or one error) everywhere.
    raw_prompts = distributed.agreed(lambda: gather_and_check(req))
    heads = () if need_draft(req) in ("model", None) else (need_draft(req),)
    weights = req.sources.locate(req.config, need_draft=need_draft(req) == "model", train_missing=req.train_missing,
                                 need_heads=heads)
    inputs = distributed.agreed(lambda: read_inputs(req, raw_prompts, weights))
    mesh = sharding.make_checked_mesh(req.mesh, models(req))  # first device work: all input is valid by now
    target, draft = weights.load(mesh, need_draft=need_draft(req), quantize=req.quantize)
    by_mode = {"sps": inputs.sampling, "ars": dataclasses.replace(inputs.sampling, drafter="model")}  # ArS: target alone
    report = Report(req.modes, inputs.sampling, weights.tokenizer() if distributed.is_main() else None,
                    print_samples=req.print_samples)
    row_ids = [(i, s) for i in range(len(inputs.prompts)) for s in range(req.num_samples)]
    with JsonlWriter(req.output) as writer:
        try:
            for b in range(inputs.batches):
                batch = row_ids[b * inputs.batch_size:(b + 1) * inputs.batch_size]
                # Pad the last batch to the same shape: one compiled program serves every batch.
                padded = list(itertools.islice(itertools.cycle(batch), inputs.batch_size))
                tokens = [inputs.prompts[i].tokens for i, _ in padded]
                results = {mode: api.generate(target, draft if mode == "sps" else None, tokens, by_mode[mode],
                                              seed=req.seed + b, datastore=inputs.datastore if mode == "sps" else None)
                           for mode in req.modes}
                writer.write(report.add_batch(b, req.seed + b, inputs.prompts, batch, results))
        except KeyboardInterrupt:
            report.print_summary(interrupted=f"{report.done_batches} of {inputs.batches} batches",
                                 output=req.output)
            raise
    report.print_summary(output=req.output)
