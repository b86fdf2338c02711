"""Tokenizers: SentencePiece trained on our own corpus (Python source by default), and
the tokenizers of Hugging Face model directories (`HFTokenizer`, at the end), which give
the ids transformers gives. Both offer encode, encode_prompt, decode, bos_id, eos_id,
stop_ids, vocab_size and vocabulary.

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

import dataclasses
import io
import os
import pathlib
import re
import tempfile
from collections.abc import Iterable, Sequence
from typing import Optional

import numpy as np
import sentencepiece as spm

from specjax.config import user_path

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
        self.path = user_path(path)
        if not self.path.is_file():
            raise TokenizerError(f"tokenizer model not found: {self.path}")
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=self.path.read_bytes())  # gs:// too
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

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (self.eos_id,)

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt as the models trained on this tokenizer saw every document start: the
        corpus separates documents with EOS, so a prompt starts with EOS."""
        return [self.eos_id] + self.encode(text)

    def decode(self, ids: Iterable[int]) -> str:
        # Accepts numpy / jax arrays too: SentencePiece wants plain Python ints.
        return self._sp.decode([int(i) for i in ids])

    def vocabulary(self) -> dict[str, int]:
        return {self._sp.id_to_piece(i): i for i in range(self.vocab_size)}

    def id_to_piece(self, i: int) -> str:
        return self._sp.id_to_piece(int(i))

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


# --------------------------------------------------------------------------- Hugging Face


def _token_content(fields, key: str) -> Optional[str]:
    """tokenizer_config.json writes special tokens as strings or as AddedToken dicts
    ({"content": ...}); null or absent: none."""
    from specjax.weights.hf_files import OBJECT, TEXT
    value = fields.get(key, (TEXT | OBJECT).or_null(), None)
    if isinstance(value, dict):
        return fields.section(key).get("content", TEXT)
    return value


class HFTokenizer:
    """The tokenizer of a Hugging Face model directory, giving the ids and text that
    transformers gives: `tokenizer.json` through the `tokenizers` library (what
    transformers' fast tokenizers run), else `tokenizer.model` through SentencePiece,
    reproducing transformers 5's conversion of it (see `_SentencePieceAsTransformers`).
    `from_tokenizers` wraps one built elsewhere (a GGUF file's, from its metadata).

    encode(text): ids without special tokens; encode_prompt(text): with them, as the model
    expects a prompt to start (BOS from tokenizer.json's post-processor, or
    tokenizer_config.json's add_bos_token); decode(ids) keeps special tokens, as
    transformers' decode does by default. `stop_ids` are generation_config.json's
    eos_token_id (one id or several), falling back to the tokenizer's EOS.
    `chat_template` is the model's Jinja chat template, or None."""

    pad_id: Optional[int] = None
    chat_template: Optional[str] = None

    @classmethod
    def from_tokenizers(cls, impl, path, *, bos_id: Optional[int], eos_id: Optional[int], stop_ids,
                        pad_id: Optional[int] = None, chat_template: Optional[str] = None) -> "HFTokenizer":
        """A `tokenizers.Tokenizer` with its special ids, read from `path`."""
        tok = cls.__new__(cls)
        tok.directory, tok.path, tok._impl = None, pathlib.Path(path), impl
        tok.bos_id, tok.eos_id, tok.pad_id = bos_id, eos_id, pad_id
        tok.stop_ids = tuple(int(i) for i in stop_ids)
        tok.chat_template = chat_template
        return tok

    def __init__(self, directory):
        from etils import epath
        from specjax.weights import hf_files
        directory = epath.Path(directory)
        self.directory = directory
        config = hf_files.read_json(directory / "tokenizer_config.json", required=False) or hf_files.Fields(
            {}, str(directory / "tokenizer_config.json"))
        generation_bos, generation_eos = hf_files.generation_ids(directory)
        generation = hf_files.read_json(directory / "generation_config.json", required=False)
        generation_pad = generation.token_ids("pad_token_id", single=True, negative_is_none=True) if generation is not None else None
        if (directory / "tokenizer.json").exists():
            import tokenizers
            self.path = directory / "tokenizer.json"
            hf_files.check_regular(self.path)
            try:
                self._impl = tokenizers.Tokenizer.from_str(self.path.read_text(encoding="utf-8"))
            except Exception as e:  # noqa: BLE001 (any parse failure is a bad file)
                raise TokenizerError(f"{self.path}: not a tokenizers file ({str(e).splitlines()[0][:200]})") from None
        elif (directory / "tokenizer.model").exists():
            self.path = directory / "tokenizer.model"
            self._impl = _SentencePieceAsTransformers(self.path, config)
        else:
            raise TokenizerError(f"{directory} has neither tokenizer.json nor tokenizer.model")
        self.bos_id = self._special_id(_token_content(config, "bos_token"), generation_bos)
        self.eos_id = self._special_id(_token_content(config, "eos_token"), None)
        stop = generation_eos or (() if self.eos_id is None else (self.eos_id,))
        self.stop_ids = tuple(stop)
        if self.eos_id is None and self.stop_ids:
            self.eos_id = self.stop_ids[0]
        self.pad_id = self._special_id(_token_content(config, "pad_token"), generation_pad and generation_pad[0])
        template = config.get("chat_template", (hf_files.TEXT | hf_files.TEMPLATES).or_null(), None)
        self.chat_template = template if isinstance(template, str) else None  # several named ones: none used
        if (directory / "chat_template.jinja").exists():  # transformers 5 saves it beside tokenizer_config.json
            self.chat_template = (directory / "chat_template.jinja").read_text(encoding="utf-8")

    def _special_id(self, content: Optional[str], fallback) -> Optional[int]:
        found = self._impl.token_to_id(content) if content else None
        return found if found is not None else fallback

    @property
    def vocab_size(self) -> int:
        return self._impl.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._impl.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        return self._impl.encode(text, add_special_tokens=True).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._impl.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def vocabulary(self) -> dict[str, int]:
        """{token: id}, special tokens included: two tokenizers with the same vocabulary
        give the same ids the same meaning."""
        return self._impl.get_vocab(with_added_tokens=True)

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True, **variables) -> str:
        """`messages` ([{"role", "content"}, ...]) as the model's chat template renders them
        (`render_chat`), its special tokens given as transformers gives them (bos_token,
        eos_token, ...). Encode the text with `encode`: the template writes the BOS itself."""
        if not self.chat_template:
            raise UsageError(f"{self.path}: the tokenizer has no chat template")
        name = lambda i: None if i is None else self._impl.id_to_token(i)  # noqa: E731
        specials = {"bos_token": name(self.bos_id), "eos_token": name(self.eos_id), "pad_token": name(self.pad_id)}
        return render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                           **{k: v for k, v in specials.items() if v is not None}, **variables)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


def render_chat(template: str, messages: Sequence[dict], add_generation_prompt: bool = True, **variables) -> str:
    """A chat through its Jinja template, rendered as transformers' apply_chat_template
    renders it: a sandboxed environment (the template comes with the weights: untrusted)
    with trim_blocks and lstrip_blocks, `raise_exception`, a `tojson` that leaves non-ASCII
    text alone; a template error is a UsageError of one line."""
    import json

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                                **variables)
    except jinja2.exceptions.TemplateError as e:
        raise UsageError(f"the chat template refused the messages: {e}") from None


def load_hf_tokenizer(directory) -> Optional[HFTokenizer]:
    """The directory's tokenizer, or None when it has no tokenizer file."""
    from etils import epath
    directory = epath.Path(directory)
    if not ((directory / "tokenizer.json").exists() or (directory / "tokenizer.model").exists()):
        return None
    return HFTokenizer(directory)


@dataclasses.dataclass
class _Encoding:
    ids: list[int]


class _SentencePieceAsTransformers:
    """transformers 5 has no SentencePiece-run Llama tokenizer: it converts tokenizer.model
    to a `tokenizers` BPE with a Metaspace pre-tokenizer (prepend_scheme='first') and the
    decoder Replace('\u2581', ' ') + ByteFallback + Fuse + Strip(one leading space). Raw
    SentencePiece differs on leading spaces and on special-token strings in the text; this
    reproduces the conversion with SentencePiece itself: the text is split at special-token
    strings (matched as those tokens), each piece is encoded with the dummy prefix off,
    and one space is prepended to a piece at the start of the text unless it already
    starts with a space or '\u2581'."""

    def __init__(self, path, config):
        from specjax.weights.hf_files import BOOL
        from sentencepiece import sentencepiece_model_pb2
        from specjax.weights import hf_files
        hf_files.check_regular(path)
        try:
            proto = sentencepiece_model_pb2.ModelProto.FromString(path.read_bytes())
            proto.normalizer_spec.add_dummy_prefix = False
            self._sp = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
        except Exception as e:  # noqa: BLE001 (protobuf's DecodeError, SentencePiece's RuntimeError: a bad file)
            raise TokenizerError(f"{path}: not a SentencePiece model ({type(e).__name__}: "
                                 f"{' '.join(str(e).split())[:200]})") from None
        n = self._sp.get_piece_size()
        if n == 0:
            raise TokenizerError(f"{path}: not a SentencePiece model (it holds no pieces)")
        self._special = {i for i in range(n) if self._sp.is_control(i) or self._sp.is_unknown(i)}
        self._specials = sorted((self._sp.id_to_piece(i) for i in self._special), key=len, reverse=True)
        self._add_bos = config.get("add_bos_token", BOOL.or_null(), None) is not False
        self._add_eos = config.get("add_eos_token", BOOL.or_null(), None) is True

    def token_to_id(self, token: str) -> Optional[int]:
        i = self._sp.piece_to_id(token)
        return i if self._sp.id_to_piece(i) == token else None

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return self._sp.get_piece_size()

    def get_vocab(self, with_added_tokens: bool = True) -> dict[str, int]:
        return {self._sp.id_to_piece(i): i for i in range(self._sp.get_piece_size())}

    def encode(self, text: str, add_special_tokens: bool = True) -> _Encoding:
        ids, pos = [], 0
        while True:
            hits = [(text.find(t, pos), -len(t), t) for t in self._specials if text.find(t, pos) >= 0]
            start, _, special = min(hits) if hits else (len(text), 0, None)
            piece = text[pos:start]
            if piece:
                if pos == 0 and not piece.startswith((" ", "\u2581")):
                    piece = " " + piece
                ids += self._sp.encode(piece)
            if special is None:
                break
            ids.append(self._sp.piece_to_id(special))
            pos = start + len(special)
        if add_special_tokens:
            ids = [self._sp.bos_id()] * bool(self._add_bos) + ids + [self._sp.eos_id()] * bool(self._add_eos)
        return _Encoding(ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        out, pending = [], bytearray()

        def flush():
            if pending:
                try:
                    out.append(pending.decode("utf-8"))
                except UnicodeDecodeError:  # tokenizers' ByteFallback: one U+FFFD per byte
                    out.append("\ufffd" * len(pending))
                pending.clear()

        for i in ids:
            if skip_special_tokens and i in self._special:
                continue
            piece = self._sp.id_to_piece(i)
            if self._sp.is_byte(i):
                pending.append(int(piece[3:5], 16))
                continue
            flush()
            out.append(piece.replace("\u2581", " "))
        flush()
        text = "".join(out)
        return text[1:] if text.startswith(" ") else text
