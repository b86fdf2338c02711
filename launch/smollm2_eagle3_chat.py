"""launch/smollm2_eagle3.py's EAGLE-3 layer for SmolLM2-135M-Instruct, trained on SmolLM2's
replies inside its own chat template (`train.self_distill_chat`): each of the 1,536 prompts
is a 32-token window of the standard library's sources as the text of a user message
(complete, explain or tidy it as code, summarize it, or the text alone:
`training.samples.CHAT_KINDS`), answered greedily by SmolLM2 up to 97 tokens or its
<|im_end|>. The layer drafts for chat prompts; one trained on raw source continuations
(smollm2_eagle3) kept 0.05-0.13 of its drafts on them. Same layer and budget (at most an
hour on 2 CPU cores): the loss scores the layer on its draft vocabulary
(`heads.scored_vocabulary`) and reads SmolLM2's forward from a cache made once per sample
(`train.cache_target`), which made a step 4x cheaper than the 600 steps the hour held at
first; the hour now holds 1,536 samples and 1,400 steps (about 6 passes over them, as
the 900 steps over 1,024 samples before):

    python -m specjax.train --config=launch/smollm2_eagle3_chat.py --workdir=DIR
    python -m specjax.bench --config=launch/smollm2_eagle3_chat.py --gguf_target=FILE --drafter=eagle3 \\
        --draft_checkpoint=DIR --lookahead=2,3 --prompts_file=PROMPTS.jsonl --quantize=w4a8

What it reaches: benchmarks/real_model.md."""
import dataclasses
import pathlib

from specjax.config import load_config


def get_config():
    base = load_config(str(pathlib.Path(__file__).with_name("smollm2_eagle3.py")))
    return dataclasses.replace(base, name="smollm2_eagle3_chat", train=dataclasses.replace(
        base.train, self_distill_chat=True, self_distill_prompt=32, self_distill=1536, steps=1400))
