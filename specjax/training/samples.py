"""The target's own samples as training data (self-distillation, `train.self_distill`).

A drafter learns to predict the target where it drafts: on the target's own outputs.
When the corpus is not what the target was trained on (a released model and the
standard library's sources), EAGLE-3 and the trainers built on it (SpecForge) regenerate
the data with the target first. Here: `train.self_distill` samples, each a prompt of
`train.self_distill_prompt` tokens cut from the corpus's training stream at a seeded
random offset, continued by the frozen teacher with plain autoregressive sampling
(`specjax.generate`, the config's temperature, top-k and top-p) until the sample holds
seq_len + 1 tokens or the teacher emits a stop token. The samples, laid end to end, are
the new training stream; the last `val_fraction` of them the validation stream.

With `train.self_distill_chat`, a prompt is the window's text inside a user message of
the teacher tokenizer's chat template (one of `CHAT_KINDS` in turn: complete, explain or
tidy it as code, summarize it, or the text alone), and the teacher's reply is
seq_len + 1 - self_distill_prompt tokens at most: a chat model drafted for in its chat
template writes other text than it does continuing raw source, and its drafter has to
learn those replies.

With `train.self_distill_prompts`, the prompts are a file's instead (`file_prompts`):
requests of the kinds the drafter will serve (code to write or edit, text to summarise,
conversation), each a user message with self_distill_chat; the replies get the same
budget of seq_len + 1 - self_distill_prompt tokens.

Made once per workdir and written there (`samples.npz`, with the settings that made
it): a resumed run reads the same tokens, so it stays bit for bit an uninterrupted
run's. A run whose settings differ makes them again.
"""
from __future__ import annotations

import dataclasses
import io
import json
import os
import pathlib

import jax
import numpy as np
from tqdm import tqdm

from specjax.config import Config, ConfigError, is_remote
from specjax.training import data
from specjax.training.corpus import Corpus
from specjax.weights.tokenizer import atomic_write_bytes

FILE = "samples.npz"
BATCH = 64  # prompts per generate call
WIDTH_STEP = 64  # `with_target_reads` pads a chunk of samples to a multiple of this
# The user messages of `train.self_distill_chat`, taken in turn; {text} is a corpus window.
CHAT_KINDS = (
    "Complete this Python code. Reply with code only.\n\n```python\n{text}\n```",
    "What does this code do? Explain it briefly.\n\n```python\n{text}\n```",
    "Rewrite this code so that it is easier to read. Reply with the code only.\n\n```python\n{text}\n```",
    "Summarize this text in two sentences.\n\n{text}",
    "{text}",
)


def settings(config: Config, stop_ids: tuple[int, ...]) -> dict:
    tc, sp = config.train, config.sampling
    return {"samples": tc.self_distill, "prompt": tc.self_distill_prompt, "length": tc.seq_len + 1,
            "seed": tc.seed, "temperature": sp.temperature, "top_k": sp.top_k, "top_p": sp.top_p,
            "stop_ids": list(stop_ids), "teacher": tc.teacher or tc.teacher_hf or tc.teacher_gguf,
            **({"chat": True if tc.self_distill_prompts else list(CHAT_KINDS)} if tc.self_distill_chat else {}),
            **({"prompts": _digest(tc.self_distill_prompts)} if tc.self_distill_prompts else {})}


def _digest(path: str) -> str:
    """The prompts file's content, named by its SHA-256 (where it lies does not matter)."""
    import hashlib

    from specjax.app.prompts import read_text_file
    return hashlib.sha256(read_text_file(path, "train.self_distill_prompts", "a prompts file").encode()).hexdigest()


def prompts(corpus: Corpus, config: Config) -> np.ndarray:
    """[samples, prompt] corpus token windows at offsets drawn from train.seed."""
    tc = config.train
    rng = np.random.default_rng([tc.seed, 0x5E1F])
    starts = rng.integers(0, len(corpus.train) - tc.self_distill_prompt + 1, size=tc.self_distill)
    return np.stack([corpus.train[s:s + tc.self_distill_prompt] for s in starts]).astype(np.int32)


def requests(config: Config) -> list:
    """The text prompts of train.self_distill_prompts' file, or a one-line UsageError naming
    it or its line (checked before the workdir is touched; `file_prompts` tokenises them)."""
    from specjax.app import prompts as prompts_lib
    path = config.train.self_distill_prompts
    raw = [r for r in prompts_lib.read_prompts_file(path, "train.self_distill_prompts") if r.text is not None]
    if not raw:
        raise ConfigError(f"train.self_distill_prompts={path!r}: holds no text prompts (a \"prompt\" per JSONL line, "
                          "or one per line of plain text)")
    return raw


def file_prompts(config: Config, teacher, tokenizer) -> list[list[int]]:
    """train.self_distill_prompts' prompts for the train.self_distill samples, tokenised:
    sample i is the file's prompt i of a shuffle drawn from train.seed (a new shuffle for
    each pass over the file), as one user message in `tokenizer`'s chat template with
    train.self_distill_chat, else as text starting a document. A prompt with no room for
    its reply in the teacher's context is a one-line UsageError naming the file's line (the
    trainer asks as soon as the teacher is loaded; the file itself, `requests`, earlier)."""
    from specjax.app import prompts as prompts_lib
    from specjax.decode.program import check_prompts
    tc = config.train
    raw = requests(config)
    if tokenizer is None:
        raise ConfigError(f"train.self_distill_prompts={tc.self_distill_prompts!r} holds text, and the teacher has no "
                          "tokenizer: drop train.self_distill_prompts (the samples then continue corpus windows)")
    rng = np.random.default_rng([tc.seed, 0x5E1F, 1])
    passes = -(-tc.self_distill // len(raw))
    order = np.concatenate([rng.permutation(len(raw)) for _ in range(passes)])[:tc.self_distill]
    chosen = [raw[i] for i in order]
    encoded = prompts_lib.encode(chosen, tokenizer, chat=tc.self_distill_chat)
    check_prompts([p.tokens for p in encoded], teacher.cfg.vocab_size, teacher.cfg.max_seq_len,
                  tc.seq_len + 1 - tc.self_distill_prompt, [p.source for p in encoded],
                  budget="a reply of train.seq_len + 1 - train.self_distill_prompt")
    return [p.tokens for p in encoded]


def check_chat(tokenizer) -> None:
    """The teacher's tokenizer can render `train.self_distill_chat`'s prompts, or a one-line
    ConfigError (checked as soon as the teacher is loaded, before the corpus)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"train.self_distill_chat=True: the teacher's tokenizer ({getattr(tokenizer, 'path', '?')}) "
                          "has no chat template; drop train.self_distill_chat")


def chat_prompts(windows: np.ndarray, tokenizer) -> list[list[int]]:
    """Window i's text as the user message CHAT_KINDS[i % len(CHAT_KINDS)] in `tokenizer`'s
    chat template, ready for the assistant's reply, tokenised."""
    out = []
    for i, window in enumerate(windows):
        text = CHAT_KINDS[i % len(CHAT_KINDS)].format(text=tokenizer.decode(window.tolist()).strip())
        out.append(tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": text}])))
    return out


def self_distilled(corpus: Corpus, teacher, config: Config, workdir, stop_ids=(), progress: bool = True,
                   tokenizer=None, asked: list[list[int]] | None = None) -> Corpus:
    """`corpus` with its streams replaced by the teacher's samples (the module docstring);
    `tokenizer`, the teacher's, renders the chat prompts of `train.self_distill_chat`;
    `asked`: `file_prompts`' result where the caller has it (else made here)."""
    tc = config.train
    want = settings(config, tuple(stop_ids))
    path = workdir / FILE
    if path.exists():
        with np.load(io.BytesIO(path.read_bytes())) as saved:
            same = json.loads(bytes(saved["settings"]).decode()) == want
            marked = "generated" in saved  # files made before the marks hold none
            if same and marked:
                return _as_corpus(corpus, saved["tokens"], saved["generated"], config, "read back")
        if jax.process_index() == 0:
            why = "before its samples marked the teacher's own tokens" if same else "with other settings"
            tqdm.write(f"{path} was made {why}: sampling the teacher again")
    from specjax.decode.api import generate
    if tc.self_distill_prompts:
        starts = asked if asked is not None else file_prompts(config, teacher, tokenizer)
    else:
        starts = prompts(corpus, config)
        starts = chat_prompts(starts, tokenizer) if tc.self_distill_chat else starts.tolist()
    sampling = dataclasses.replace(config.sampling, drafter="model", num_drafts=1,
                                   max_new_tokens=tc.seq_len + 1 - tc.self_distill_prompt,
                                   eos_id=tuple(stop_ids) if stop_ids else -1).validate()
    pieces, generated = [], []
    bar = tqdm(total=len(starts), disable=not (progress and jax.process_index() == 0), unit="sample",
               desc="sampling the teacher")
    for first in range(0, len(starts), BATCH):
        batch = starts[first:first + BATCH]
        result = generate(teacher, None, batch, sampling, seed=tc.seed + first)
        pieces += [np.asarray(p + list(t), np.int32) for p, t in zip(batch, result.tokens)]
        generated += [np.repeat(np.uint8([0, 1]), [len(p), len(t)]) for p, t in zip(batch, result.tokens)]
        bar.update(len(batch))
    bar.close()
    tokens, generated = np.concatenate(pieces), np.concatenate(generated)
    if jax.process_index() == 0:
        out = io.BytesIO()
        np.savez(out, tokens=tokens, generated=generated, settings=np.frombuffer(json.dumps(want).encode(), np.uint8))
        if is_remote(path):
            path.write_bytes(out.getvalue())
        else:
            atomic_write_bytes(pathlib.Path(os.fspath(path)), out.getvalue())
    return _as_corpus(corpus, tokens, generated, config, "sampled")


def _as_corpus(corpus: Corpus, tokens: np.ndarray, generated: np.ndarray, config: Config, how: str) -> Corpus:
    """The samples as the corpus's streams, with where each begins (a sample is its prompt's
    tokens, marked 0 in `generated`, then the teacher's, marked 1); with
    `train.self_distill_replies`, also which of their tokens count as targets."""
    tc = config.train
    train, val = data.split_train_val(tokens, tc.val_fraction)
    counted = data.split_train_val(generated, tc.val_fraction) if tc.self_distill_replies else (None, None)
    share = f", the loss on its {int(generated.sum()):,} own" if tc.self_distill_replies else ""
    begins = np.flatnonzero((generated == 0) & (np.concatenate([[1], generated[:-1]]) == 1))
    return dataclasses.replace(corpus, train=train, val=val, train_counted=counted[0], val_counted=counted[1],
                               samples=begins,
                               description=f"{tc.self_distill:,} samples of the teacher ({len(tokens):,} tokens"
                               f"{share}, {how}) " + (f"answering the requests of {tc.self_distill_prompts}"
                                                      if tc.self_distill_prompts else
                                                      f"continuing prompts from {corpus.description}"))


def available_memory() -> int | None:
    """Bytes of memory the machine can still give (Linux's MemAvailable); None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def with_target_reads(corpus: Corpus, teacher, reads, config: Config, progress: bool = True,
                      memory: int | None = None) -> Corpus:
    """`corpus` (the teacher's samples) with what draft heads read of the frozen teacher's
    forward (`heads.target_reads`: their features, its final hidden states) at every token,
    aligned with the token streams and kept in host memory: each sample's forward runs once,
    from its first token as decoding runs it, instead of on every window of every step
    that holds it (training a layer makes ~6 passes over its samples). One process only (each
    would need every sample's reads). Where they would take more than `memory` bytes
    (default: half of what the machine has free), `corpus` as it is, and a line that says so:
    the step runs the forward."""
    from specjax.heads import target_reads
    from specjax.model import LM
    tokens = np.concatenate([corpus.train, corpus.val])
    begins = corpus.samples
    ends = np.append(begins[1:], len(tokens))
    width, rows = int((ends - begins).max()), config.train.batch_size
    kept = 1 if reads is True else 2  # the features are the final states where the heads read those
    forward = jax.jit(lambda params, x: target_reads(reads, LM(teacher.cfg, teacher.graphdef, params), x)[:kept])
    shapes = jax.eval_shape(forward, teacher.params, jax.ShapeDtypeStruct((rows, width), np.int32))
    need = sum(len(tokens) * s.shape[-1] * np.dtype(s.dtype).itemsize for s in shapes)
    if memory is None:
        free = available_memory()
        memory = None if free is None else free // 2
    if memory is not None and need > memory:
        tqdm.write(f"the target's features for {len(tokens):,} tokens would take {need / 2**30:.2f} GiB, more than "
                   f"half of the memory free ({memory / 2**30:.2f} GiB): each step runs the target's forward instead "
                   "(train.cache_target=False skips this check)")
        return corpus
    out = [np.empty((len(tokens), s.shape[-1]), s.dtype) for s in shapes]
    bar = tqdm(total=len(begins), disable=not progress, unit="sample", desc="the target's features")
    # Samples of like length run together, each chunk padded to its longest rounded up to
    # WIDTH_STEP (one compile per width): a file's prompts differ in length by 10x.
    order = np.argsort(ends - begins, kind="stable")
    for first in range(0, len(order), rows):
        chosen = order[first:first + rows]
        longest = int((ends[chosen] - begins[chosen]).max())
        chunk = np.zeros((rows, min(width, -(-longest // WIDTH_STEP) * WIDTH_STEP)), np.int32)
        for i, j in enumerate(chosen):  # a short sample's tail: padding its causal rows never see
            chunk[i, :ends[j] - begins[j]] = tokens[begins[j]:ends[j]]
        got = jax.device_get(forward(teacher.params, chunk))
        for i, j in enumerate(chosen):
            for whole, a in zip(out, got):
                whole[begins[j]:ends[j]] = a[i, :ends[j] - begins[j]]
        bar.update(len(chosen))
    bar.close()
    n = len(corpus.train)
    size = sum(a.nbytes for a in out) / 2**30
    train, val = [a[:n] for a in out], [a[n:] for a in out]
    # (features, final): one array where the heads read the final states
    return dataclasses.replace(corpus, train_seen=(train[0], train[-1]), val_seen=(val[0], val[-1]),
                               description=f"{corpus.description}; the target's features cached ({size:.2f} GiB)")
