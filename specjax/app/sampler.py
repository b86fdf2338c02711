"""The `sample` command's run: every prompt x sample row, in batches, with ArS and/or SpS,
written as JSONL and reported. Every input is checked before a model is built or
compiled; the output file is touched only when the first batch is done."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Optional, Sequence

from specjax import distributed, sharding
from specjax.app import cli, prompts as prompts_lib
from specjax.app.locate import Weights
from specjax.app.output import JsonlWriter
from specjax.app.report import Report
from specjax.config import Config, MeshConfig, SamplingConfig, UsageError
from specjax.decode import api, drafters
from specjax.decode.datastore import Datastore, file_sha256
from specjax.decode.program import SEED_LIMIT

MAX_ROWS = 1_000_000  # prompts x samples: beyond this the row list alone is a memory problem


@dataclasses.dataclass(frozen=True)
class Request:
    """One `sample` run, as the command line describes it."""

    config: Config
    modes: Sequence[str]  # 'ars', 'sps' or both, in that order
    sampling: SamplingConfig
    raw_prompts: Sequence  # prompts_lib.gather(...): not yet tokenised
    mesh: MeshConfig
    num_samples: int = 1
    batch_size: int = 1
    seed: int = 0
    init: str = "checkpoint"
    checkpoint: Optional[str] = None
    draft_checkpoint: Optional[str] = None
    output: Optional[str] = None
    prompts_file: Optional[str] = None
    train_missing: bool = True
    print_samples: bool = True
    datastore: Optional[str] = None  # for drafter='retrieval' | 'hybrid'


def run(req: Request) -> None:
    config, modes, sampling = req.config, list(req.modes), req.sampling
    need_draft = "sps" in modes and drafters.uses_model(sampling.drafter)
    if need_draft and config.draft is None:
        raise UsageError(f"--mode={'both' if len(modes) == 2 else 'sps'} with --drafter={sampling.drafter} needs a "
                         f"draft model, and config {config.name!r} has none; use --mode=ars, --drafter=ngram, or a "
                         "config with a draft")
    if sampling.drafter == "retrieval" and req.datastore is None:
        raise UsageError("--drafter=retrieval needs --datastore=PATH (build one with `python -m specjax.datastore`)")
    if req.datastore is not None and sampling.drafter not in ("retrieval", "hybrid"):
        raise UsageError(f"--datastore is used only by --drafter=retrieval or hybrid (got "
                         f"--drafter={sampling.drafter})")
    store = Datastore.load(req.datastore) if req.datastore is not None and "sps" in modes else None
    if store is not None:
        store.check(config.target.vocab_size, name=f"--datastore={req.datastore}")
    if req.init == "random" and (req.checkpoint or req.draft_checkpoint):
        raise UsageError("--checkpoint/--draft_checkpoint have no effect with --init=random: drop one of them")
    models = {"target": config.target, **({"draft": config.draft} if need_draft else {})}
    context = min(m.max_seq_len for m in models.values())
    if sampling.lookahead >= context:
        raise UsageError(f"--lookahead={sampling.lookahead}: must be below the model's context of {context} tokens")
    token_prompts = prompts_lib.encode([r for r in req.raw_prompts if r.text is None], None)
    if token_prompts:  # checked now; text prompts once the tokenizer is found
        prompts_lib.check(token_prompts, config.target.vocab_size, context, sampling.max_new_tokens)
    rows = len(req.raw_prompts) * req.num_samples
    if rows > MAX_ROWS:
        raise UsageError(f"{len(req.raw_prompts)} prompts x --num_samples={req.num_samples} = {rows} rows; at most "
                         f"{MAX_ROWS} rows per run")
    batch_size = min(req.batch_size, rows)  # a bigger batch would only compute padding rows
    batches = -(-rows // batch_size)
    if req.seed + batches > SEED_LIMIT:
        raise UsageError(f"--seed={req.seed}: batch i uses seed + i, and the {batches} batches need seeds below "
                         f"2**63")

    distributed.maybe_initialize()
    cli.use_compilation_cache()
    with JsonlWriter(req.output, not_same_as=[req.prompts_file]) as writer:
        weights = Weights.locate(config, req.init, req.checkpoint, req.draft_checkpoint, need_draft=need_draft,
                                 train_missing=req.train_missing)
        tokenizer = weights.tokenizer()
        if store is not None:
            store.check_tokenizer(file_sha256(tokenizer.path) if tokenizer else None, f"--datastore={req.datastore}")
        prompts = prompts_lib.encode(req.raw_prompts, tokenizer, weights.no_tokenizer_reason)
        prompts_lib.check(prompts, config.target.vocab_size, context, sampling.max_new_tokens)
        if tokenizer is not None and sampling.eos_id == -1:
            sampling = dataclasses.replace(sampling, eos_id=tokenizer.eos_id)

        mesh = sharding.make_checked_mesh(req.mesh, models)  # first device work: all input is valid by now
        target, draft = weights.load(mesh, need_draft=need_draft)
        row_ids = [(i, s) for i in range(len(prompts)) for s in range(req.num_samples)]
        by_mode = {"sps": sampling, "ars": dataclasses.replace(sampling, drafter="model")}  # ArS: the target alone
        report = Report(modes, sampling, tokenizer, print_samples=req.print_samples)
        try:
            for b in range(batches):
                batch = row_ids[b * batch_size:(b + 1) * batch_size]
                # Pad the last batch to the same shape: one compiled program serves every batch.
                padded = list(itertools.islice(itertools.cycle(batch), batch_size))
                tokens = [prompts[i].tokens for i, _ in padded]
                results = {mode: api.generate(target, draft if mode == "sps" else None, tokens, by_mode[mode],
                                              seed=req.seed + b, datastore=store if mode == "sps" else None)
                           for mode in modes}
                writer.write(report.add_batch(b, req.seed + b, prompts, batch, results))
        except KeyboardInterrupt:
            report.print_summary(interrupted=f"{report.done_batches} of {batches} batches", output=req.output)
            raise
    report.print_summary(output=req.output)
