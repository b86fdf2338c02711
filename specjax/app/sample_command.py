"""The `sample` command's run: every prompt x sample row, in batches, with ArS and/or SpS,
written as JSONL and reported. Every input is checked before a model is built or
compiled; the output file is touched only when the first batch is done."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Optional, Sequence

from specjax import distributed
from specjax.app import cli, prompts as prompts_lib, setup
from specjax.app.locate import Sources
from specjax.app.output import JsonlWriter, check_writable
from specjax.app.report import Report
from specjax.config import SEED_LIMIT, Config, MeshConfig, SamplingConfig, UsageError
from specjax.decode import api

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
    quantize: Optional[str] = None  # a config.QUANTIZATIONS name: target and draft quantized on load
    chat: bool = False  # text prompts through the model's chat template


@dataclasses.dataclass(frozen=True)
class Inputs:
    """The prompts, read from the host for a run: the same on every process."""

    prompts: list  # prompts_lib.Prompt, tokenised
    batch_size: int
    batches: int


def setup_request(req: Request) -> setup.Request:
    """The run setup's request: SpS draws with the sampling's drafter."""
    return setup.Request(req.config, req.sampling, (req.sampling.drafter,) if "sps" in req.modes else (),
                         sources=req.sources, quantize=req.quantize, datastore=req.datastore, mesh=req.mesh,
                         train_missing=req.train_missing,
                         sps=f"--mode={'both' if len(req.modes) == 2 else 'sps'}")


def check_rows(req: Request, raw_prompts, context: int) -> None:
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
        prompts_lib.check(token_prompts, req.config.target.vocab_size, context, req.sampling.max_new_tokens)


def read_inputs(req: Request, raw_prompts, run: setup.Run) -> Inputs:
    """Tokenise the prompts with the target's tokenizer and check them (process 0)."""
    prompts = prompts_lib.encode(raw_prompts, run.tokenizer, run.no_tokenizer_reason, chat=req.chat)
    prompts_lib.check(prompts, run.config.target.vocab_size, run.context, req.sampling.max_new_tokens)
    rows = len(prompts) * req.num_samples
    batch_size = min(req.batch_size, rows)  # a bigger batch would only compute padding rows
    return Inputs(prompts, batch_size, -(-rows // batch_size))


def gather_and_check(req: Request, context: int):
    raw = prompts_lib.gather(**req.prompt_flags)
    check_rows(req, raw, context)
    check_writable(req.output, "--output", [req.prompt_flags.get("prompts_file")])
    return raw


def run(req: Request) -> None:
    distributed.maybe_initialize()
    prepared = setup.prepare(setup_request(req))
    cli.use_compilation_cache()
    # Host inputs are read by process 0 and shared: one answer (or one error) everywhere.
    raw_prompts = distributed.agreed(lambda: gather_and_check(req, prepared.context))
    prepared.locate()
    inputs = distributed.agreed(lambda: read_inputs(req, raw_prompts, prepared))
    prepared.load()
    target, draft, sampling = prepared.target, prepared.draft_for(req.sampling.drafter), prepared.sampling
    by_mode = {"sps": sampling, "ars": dataclasses.replace(sampling, drafter="model")}  # ArS: target alone
    report = Report(req.modes, sampling, prepared.tokenizer if distributed.is_main() else None,
                    print_samples=req.print_samples, load_seconds=prepared.load_seconds)
    row_ids = [(i, s) for i in range(len(inputs.prompts)) for s in range(req.num_samples)]
    with JsonlWriter(req.output) as writer:
        try:
            for b in range(inputs.batches):
                batch = row_ids[b * inputs.batch_size:(b + 1) * inputs.batch_size]
                # Pad the last batch to the same shape: one compiled program serves every batch.
                padded = list(itertools.islice(itertools.cycle(batch), inputs.batch_size))
                tokens = [inputs.prompts[i].tokens for i, _ in padded]
                results = {mode: api.generate(target, draft if mode == "sps" else None, tokens, by_mode[mode],
                                              seed=req.seed + b, datastore=prepared.datastore if mode == "sps" else None)
                           for mode in req.modes}
                writer.write(report.add_batch(b, req.seed + b, inputs.prompts, batch, results))
        except KeyboardInterrupt:
            report.print_summary(interrupted=f"{report.done_batches} of {inputs.batches} batches",
                                 output=req.output)
            raise
    report.print_summary(output=req.output)
