"""launch/smollm2_eagle3_requests.py's EAGLE-3 layer for SmolLM2-135M-Instruct, its 1,536
prompts drawn from launch/chat_requests_prose.jsonl instead: the same requests but for two
kinds written more as users write them, summaries of English paragraphs (SmolLM2's own,
launch/paragraphs.jsonl, on everyday, nature, history and science subjects) in place of
most of the reference text's, and edits that rename a function and a variable in one
request (launch/chat_requests.py's docstring says how the files were made). Same layer,
samples, steps and budget (at most an hour on 2 CPU cores): only the prompts differ.

    python -m specjax.train --config=launch/smollm2_eagle3_prose.py --workdir=DIR
    python -m specjax.bench --config=launch/smollm2_eagle3_prose.py --gguf_target=FILE --drafter=eagle3 \\
        --draft_checkpoint=DIR --lookahead=1,2,3 --prompts_file=launch/real_prompts.jsonl --chat --quantize=w4a8

What it reaches: benchmarks/real_model.md."""
import dataclasses
import pathlib

from specjax.config import load_config

REQUESTS = pathlib.Path(__file__).with_name("chat_requests_prose.jsonl")


def get_config():
    base = load_config(str(pathlib.Path(__file__).with_name("smollm2_eagle3_requests.py")))
    return dataclasses.replace(base, name="smollm2_eagle3_prose", train=dataclasses.replace(
        base.train, self_distill_prompts=str(REQUESTS)))
