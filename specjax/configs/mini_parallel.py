"""The CPU demo's parallel draft (PARD: An et al. 2025, arXiv 2504.18583): mini_draft's
model with a mask-token embedding (`parallel_draft=8`), adapted from mini_draft's trained
params (PARD's low-cost adaptation of an autoregressive draft) to propose up to 8 tokens
from one forward, distilled from mini_target (`--drafter=parallel`).

    python -m specjax.train --config=mini_parallel      # after mini_target and mini_draft
    python -m specjax.sample --config=mini --drafter=parallel --config.draft.parallel_draft=8 \\
        --draft_checkpoint=$SPECJAX_CACHE/checkpoints/mini_parallel
"""
import dataclasses

from specjax.config import Config, TrainConfig, load_config

MODEL = dataclasses.replace(load_config("mini_draft").target, parallel_draft=8)


def get_config() -> Config:
    return Config(name="mini_parallel", target=MODEL, tokenizer_vocab=4096,
                  # Its training pass holds about twice mini_draft's rows (a mask per token,
                  # `losses.parallel_layout`); its time on 2 CPU cores is in benchmarks/heads.md.
                  train=TrainConfig(batch_size=16, seq_len=256, steps=100, learning_rate=1e-3, warmup_steps=10,
                                    save_every=25, eval_every=50, teacher="mini_target", distill_weight=0.7,
                                    init_from="mini_draft"))
