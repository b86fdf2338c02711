"""launch/smollm2_eagle3_chat.py's EAGLE-3 layer for SmolLM2-135M-Instruct, trained on
SmolLM2's greedy replies to requests of the kinds it will draft for instead of corpus
windows in five fixed instructions: the 1,536 prompts are drawn from
launch/chat_requests.jsonl (`train.self_distill_prompts`; written by
launch/chat_requests.py: standard-library functions to complete or edit, Python's
reference text to summarise, everyday questions; none of the held-out prompts of
launch/real_prompts.jsonl), each a user message in SmolLM2's chat template, answered up
to 97 tokens or its <|im_end|>. Same layer, budget (at most an hour on 2 CPU cores) and
steps as smollm2_eagle3_chat:

    python -m specjax.train --config=launch/smollm2_eagle3_requests.py --workdir=DIR
    python -m specjax.bench --config=launch/smollm2_eagle3_requests.py --gguf_target=FILE --drafter=eagle3 \\
        --draft_checkpoint=DIR --lookahead=1,2,3 --prompts_file=launch/real_prompts.jsonl --chat --quantize=w4a8

What it reaches: benchmarks/real_model.md."""
import dataclasses
import pathlib

from specjax.config import load_config

REQUESTS = pathlib.Path(__file__).with_name("chat_requests.jsonl")


def get_config():
    base = load_config(str(pathlib.Path(__file__).with_name("smollm2_eagle3_chat.py")))
    return dataclasses.replace(base, name="smollm2_eagle3_requests", train=dataclasses.replace(
        base.train, self_distill_prompts=str(REQUESTS)))
