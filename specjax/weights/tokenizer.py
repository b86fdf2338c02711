"""SentencePiece tokenizer trained on our own corpus (Python source by default).

The models are trained on code, so the tokenizer must be lossless on code: indentation,
blank lines, tabs and trailing spaces all carry meaning. Three settings make
`decode(encode(text)) == text` hold exactly for any Unicode text:
  * `normalization_rule_name="identity"`: no NFKC folding of characters;
  * `remove_extra_whitespaces=False`, `add_dummy_prefix=False`: whitespace is kept as is;
  * `byte_fallback=True`: a character missing from the vocabulary becomes UTF-8 byte
    pieces instead of <unk>.
`allow_whitespace_only_pieces=True` lets a run of spaces (one indentation level) be a
single piece, which matters for token counts on Python.
"""
from __future__ import annotations

import io
import os
import pathlib
import re
import tempfile
from collections.abc import Iterable, Sequence

import numpy as np
import sentencepiece as spm

from specjax.config import UsageError

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3

# Everything that changes the trained model except the corpus and vocab size; callers
# that cache trained models put these in their cache key.
TRAINER_OPTIONS: dict[str, object] = dict(
    byte_fallback=True,
    normalization_rule_name="identity",
    remove_extra_whitespaces=False,
    add_dummy_prefix=False,
    split_by_whitespace=True,
    allow_whitespace_only_pieces=True,
    split_digits=True,
    character_coverage=1.0,
    pad_id=PAD_ID,
    unk_id=UNK_ID,
    bos_id=BOS_ID,
    eos_id=EOS_ID,
)


class TokenizerError(ValueError):
    """A tokenizer file is missing or is not a SentencePiece model."""


def read_document(path: str | os.PathLike) -> str:
    """Reads one corpus file as text.

    Universal newlines turn "\\r\\n" into "\\n" so Windows files do not teach the model a
    second line ending; `errors="replace"` keeps one stray non-UTF-8 byte in a user
    corpus from aborting a run.
    """
    return pathlib.Path(path).read_text(encoding="utf-8", errors="replace")


def _training_sentences(files: Sequence[str | os.PathLike], max_sentences: int,
                        max_sentence_length: int, seed: int) -> list[str]:
    """Lines of all files (newline kept), subsampled with our own seeded RNG.

    We sample here rather than with SentencePiece's `shuffle_input_sentence`, whose RNG
    is seeded from the clock: every host of a multi-host run must train the same model.
    """
    lines = [line for f in files for line in read_document(f).splitlines(keepends=True)
             if len(line.encode("utf-8")) <= max_sentence_length]
    if len(lines) > max_sentences:
        keep = np.random.default_rng(seed).choice(len(lines), max_sentences, replace=False)
        lines = [lines[i] for i in np.sort(keep)]
    return lines


def train_tokenizer(files: Sequence[str | os.PathLike], model_prefix: str | os.PathLike,
                    vocab_size: int, model_type: str = "bpe",
                    max_sentence_length: int = 16384, max_sentences: int = 300_000,
                    seed: int = 0) -> str:
    """Trains a SentencePiece model on local text files; returns the `.model` path.

    Each line is one training sentence; at most `max_sentences` lines are used, which
    bounds training time (~300k lines, ~10 MB of Python, trains in seconds with BPE).
    The model is written atomically to `{model_prefix}.model`, so a killed run never
    leaves a truncated model where a cache would find it.
    """
    if not files:
        raise ValueError("train_tokenizer needs at least one file")
    sentences = _training_sentences(files, max_sentences, max_sentence_length, seed)
    model = io.BytesIO()
    spm.set_random_generator_seed(seed)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences), model_writer=model, vocab_size=vocab_size,
            model_type=model_type, max_sentence_length=max_sentence_length,
            input_sentence_size=0, num_threads=2, minloglevel=2, **TRAINER_OPTIONS)
    except RuntimeError as e:
        raise UsageError(corpus_problem(str(e), files, vocab_size, max_sentence_length)) from None
    path = pathlib.Path(f"{os.fspath(model_prefix)}.model")
    atomic_write_bytes(path, model.getvalue())
    return str(path)


def corpus_problem(error: str, files: Sequence[str | os.PathLike], vocab_size: int,
                   max_sentence_length: int) -> str:
    """SentencePiece's training error, said in terms of what to change in the config."""
    size = sum(os.stat(f).st_size for f in files)
    corpus = f"the tokenizer corpus ({len(files):,} file{'s' * (len(files) != 1)}, {size:,} bytes)"
    not_text = [str(f) for f in files if "\ufffd" in read_document(f) or b"\0" in pathlib.Path(f).read_bytes()]
    binary = "" if not not_text else (
        f"; {not_text[0]} is not UTF-8 text: leave it out of train.corpus" if len(not_text) == 1 else
        f"; {not_text[0]} and {len(not_text) - 1} more files are not UTF-8 text: leave them out of train.corpus")
    vocab = "tokenizer_vocab (and target.vocab_size)"
    if m := re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", error):
        return (f"{corpus} is too small to learn {vocab_size} pieces (at most {m[2]}): use a bigger train.corpus "
                f"or a smaller {vocab}{binary}")
    if m := re.search(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)", error):
        return (f"{corpus} needs at least {int(m[2]):,} pieces (one per distinct character, plus the special "
                f"and byte pieces), more than {vocab_size}: use a {vocab} of at least {m[2]}, or a corpus with "
                f"fewer distinct characters{binary}")
    if "sentences_.empty()" in error:
        return (f"{corpus} has no line of at most {max_sentence_length:,} bytes to learn pieces from: use a "
                f"train.corpus of ordinary text files{binary}")
    return f"SentencePiece could not learn a {vocab_size}-piece vocabulary from {corpus}: {error.strip()}{binary}"


def atomic_write_bytes(path: pathlib.Path, data: bytes) -> None:
    """Writes via a temp file in the same directory and `os.replace` (atomic on POSIX)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide shared caches from other users
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise


class Tokenizer:
    """A trained SentencePiece model: text <-> ids, no BOS/EOS added implicitly.

    Callers add `bos_id`/`eos_id` themselves, so that the data pipeline and the samplers
    agree on exactly one place where document boundaries are marked.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        if not self.path.is_file():
            raise TokenizerError(f"tokenizer model not found: {self.path}")
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(self.path))
        except (RuntimeError, OSError) as e:
            raise TokenizerError(
                f"not a SentencePiece model: {self.path} ({e})") from e

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def bos_id(self) -> int:
        return self._sp.bos_id()

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    @property
    def pad_id(self) -> int:
        return self._sp.pad_id()

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def decode(self, ids: Iterable[int]) -> str:
        # Accepts numpy / jax arrays too: SentencePiece wants plain Python ints.
        return self._sp.decode([int(i) for i in ids])

    def id_to_piece(self, i: int) -> str:
        return self._sp.id_to_piece(int(i))

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"
