"""launch/smollm2_eagle3_chat.py's layer with the loss on SmolLM2's replies only
(`train.self_distill_replies`): the same chat samples (1,536), steps (1,400) and budget (at
most an hour on 2 CPU cores), but a sample's prompt (the chat template, the request and the
32-token corpus window: a little over half its tokens) is no target. EAGLE trains on the
assistant's turns alone the same way.

    python -m specjax.train --config=launch/smollm2_eagle3_replies.py --workdir=DIR
    python -m specjax.bench --config=launch/smollm2_eagle3_replies.py --gguf_target=FILE --drafter=eagle3 \\
        --draft_checkpoint=DIR --lookahead=1,2 --prompts_file=PROMPTS.jsonl --quantize=w4a8

What it reached at 1,024 samples and 600 steps (benchmarks/real_model.md): fewer drafts kept than the chat layer on every
held-out prompt (K=1 acceptance 0.14-0.28 against 0.17-0.40): the prompts' code is what the
replies work on, and the layer learns from it too."""
import dataclasses
import pathlib

from specjax.config import load_config


def get_config():
    base = load_config(str(pathlib.Path(__file__).with_name("smollm2_eagle3_chat.py")))
    return dataclasses.replace(base, name="smollm2_eagle3_replies",
                               train=dataclasses.replace(base.train, self_distill_replies=True))
