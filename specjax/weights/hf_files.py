"""The JSON files of a Hugging Face model directory (config.json, generation_config.json,
tokenizer_config.json, model.safetensors.index.json), read with types.

Every value specjax uses from them goes through one accessor, `Fields.get(key, kind)`,
which returns the value only when it has the kind the key takes (transformers 5 checks
its config fields the same way: a bool is not an int, an int is not a float's
truncation, a list of ids holds ids); anything else is a `UsageError` of one line that
names the file, the key and the value. So `"tie_word_embeddings": "false"` is refused,
never read as true, and `"max_position_embeddings": 40.9` never becomes 40.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
from typing import Any, Callable, Optional

from specjax.config import UsageError

_MISSING = object()


@dataclasses.dataclass(frozen=True)
class Kind:
    """What a key takes: `words` says it in the error message, `accepts` decides."""

    words: str
    accepts: Callable[[Any], bool]

    def or_null(self) -> "Kind":
        return Kind(f"{self.words} or null", lambda v: v is None or self.accepts(v))

    def __or__(self, other: "Kind") -> "Kind":
        return Kind(f"{self.words} or {other.words}", lambda v: self.accepts(v) or other.accepts(v))


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


INT = Kind("an integer", _is_int)
NUMBER = Kind("a finite number", _is_number)
BOOL = Kind("true or false", lambda v: isinstance(v, bool))
TEXT = Kind("a string", lambda v: isinstance(v, str))
OBJECT = Kind("a JSON object", lambda v: isinstance(v, dict))
INTS = Kind("a list of integers", lambda v: isinstance(v, list) and all(_is_int(i) for i in v))
TEXTS = Kind("a list of strings", lambda v: isinstance(v, list) and all(isinstance(i, str) for i in v))
TOKEN_IDS = (INT | INTS).or_null()  # eos_token_id: one id, several (Llama 3), or none
# tokenizer_config.json's chat_template: one Jinja template, or several named ones.
TEMPLATES = Kind("a list of {\"name\", \"template\"} objects",
                 lambda v: isinstance(v, list) and all(isinstance(t, dict) for t in v))


def show(value) -> str:
    """A value as it stands in the file (JSON), cut to one short line."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class Fields:
    """One JSON object of a file, read key by key with a kind. `where` names the file in
    messages; `prefix` the enclosing keys of a nested object ('rope_parameters.')."""

    def __init__(self, raw: dict, where: str, prefix: str = ""):
        self.raw, self.where, self.prefix = raw, where, prefix

    def __contains__(self, key: str) -> bool:
        return key in self.raw

    def refuse(self, key: str, value, rule: str) -> UsageError:
        return UsageError(f"{self.where}: {self.prefix}{key}={show(value)}: {rule}")

    def get(self, key: str, kind: Kind, default=_MISSING):
        """raw[key] if it has `kind`; `default` when the key is absent (no default: the
        key is required)."""
        if key not in self.raw:
            if default is _MISSING:
                raise UsageError(f"{self.where}: no {self.prefix}{key} (it must be {kind.words})")
            return default
        value = self.raw[key]
        if not kind.accepts(value):
            raise self.refuse(key, value, f"must be {kind.words}")
        return float(value) if kind is NUMBER else value

    def section(self, key: str) -> "Fields":
        """The JSON object at `key` (absent or null: an empty one)."""
        return Fields(self.get(key, OBJECT.or_null(), None) or {}, self.where, f"{self.prefix}{key}.")

    def token_ids(self, key: str, vocab_size: Optional[int] = None, *, single: bool = False,
                  negative_is_none: bool = False) -> Optional[tuple[int, ...]]:
        """An id or (unless `single`) a list of ids, each in the vocabulary; None when
        the key is absent or null (or, with `negative_is_none`, a single negative id: the
        `pad_token_id: -1` of Llama-1-era conversions, which transformers loads as "no pad")."""
        value = self.get(key, INT.or_null() if single else TOKEN_IDS, None)
        if value is None or (negative_is_none and single and value < 0):
            return None
        ids = tuple(value) if isinstance(value, list) else (value,)
        if any(i < 0 or (vocab_size is not None and i >= vocab_size) for i in ids):
            raise self.refuse(key, value, f"token ids must be in 0..{vocab_size - 1}" if vocab_size is not None
                              else "token ids must be >= 0")
        return ids


def special_file(mode: int) -> Optional[str]:
    """What a path of this st_mode is when it is neither a regular file nor a directory
    ('a named pipe', ...), else None."""
    for test, words in ((stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"),
                        (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return words
    return None if stat.S_ISREG(mode) or stat.S_ISDIR(mode) else "not a regular file"


def check_regular(path) -> None:
    """Refuse a local `path` that is there but is neither a regular file nor a directory:
    reading a named pipe waits for a writer, a device never ends."""
    text = os.fspath(path)
    if "://" in text:
        return
    try:
        mode = os.stat(text).st_mode
    except OSError:
        return  # absent or unreadable: the caller's own read says so
    what = special_file(mode)
    if what is not None:
        raise UsageError(f"{text}: is {what}, not a file")


def read_json(path, what: str = "", *, required: bool = True) -> Optional[Fields]:
    """The JSON object in `path` as `Fields`; None when it is absent and not `required`.
    A file that is not there, not a file, not UTF-8 JSON or not an object is a UsageError."""
    check_regular(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if not required:
            return None
        raise UsageError(f"{path.parent}: no {path.name}: not a Hugging Face model directory"
                         + (f" ({what})" if what else "")) from None
    except IsADirectoryError:
        raise UsageError(f"{path}: is a directory, not a JSON file") from None
    except NotADirectoryError:
        raise UsageError(f"{path.parent}: is a file, not a Hugging Face model directory") from None
    except PermissionError:
        raise UsageError(f"{path}: not readable (permission denied)") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"{path}: not valid JSON ({e})") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise UsageError(f"{path}: expected a JSON object, found {type(value).__name__} {show(value)}")
    return Fields(value, str(path))


def generation_ids(directory, vocab_size: Optional[int] = None, fallback: Optional[Fields] = None):
    """(bos id or None, eos ids or None) from generation_config.json, each key falling
    back to `fallback` (config.json) when the file lacks it, as transformers builds a
    generation config from the model config."""
    generation = read_json(directory / "generation_config.json", required=False)

    def read(key, single):
        fields = generation if generation is not None and key in generation else fallback
        return None if fields is None else fields.token_ids(key, vocab_size, single=single)

    bos = read("bos_token_id", True)
    return (bos[0] if bos else None), read("eos_token_id", False)
