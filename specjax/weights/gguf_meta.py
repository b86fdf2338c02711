"""A GGUF file's metadata, read with types.

Every key specjax reads from a GGUF file goes through one accessor,
`Metadata.get(key, kind)`, which returns the value only when the file stores it with a
GGUF type that the key takes (llama.cpp's loader checks a key's type the same way), and
refuses anything else with one line naming the file, the key, the value and its type.
So `tokenizer.ggml.add_bos_token` stored as the string "false" is refused, never read as
true, and a token id stored as float32 300.7 never becomes 300.

Kinds are judged on the stored type, not on the Python value: a float32 2.0 is not a
layer count. Integers of any width are integers (writers differ: uint32, int32, uint64);
a number may be stored as a float or an integer type; a key that llama.cpp allows per
layer (`Kind.per_layer`) may be an array of integers, taken when its values agree.

A model family declares the keys it reads by their names with `{arch}` in place of the
architecture (`{arch}.block_count`): `get` fills it in from `general.architecture`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from specjax.config import UsageError
from specjax.weights.hf_files import show

_MISSING = object()

# GGUFValueType values (gguf.constants), spelled out so this module needs no import of the
# package to judge a type.
_NAMES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32", 7: "bool",
          8: "string", 9: "array", 10: "uint64", 11: "int64", 12: "float64"}
INTEGER_TYPES = frozenset({0, 1, 2, 3, 4, 5, 10, 11})
FLOAT32 = 6
FLOAT_TYPES = frozenset({FLOAT32, 12})
BOOL_TYPE, STRING_TYPE, ARRAY_TYPE = 7, 8, 9


def type_words(types: Sequence[int]) -> str:
    """A field's stored type as words: 'float32', 'array of string', 'empty array'."""
    types = [int(t) for t in types]
    if types and types[0] == ARRAY_TYPE:
        return f"array of {_NAMES.get(types[-1], types[-1])}" if len(types) > 1 else "empty array"
    return _NAMES.get(types[0], str(types[0])) if types else "no type"


@dataclasses.dataclass(frozen=True)
class Kind:
    """What a key takes: `words` says it in the error message; `scalar` / `items` are the
    stored types allowed for a single value / for an array's items (None: not allowed);
    `check` a rule on the value itself (a finite number)."""

    words: str
    scalar: Optional[frozenset] = None
    items: Optional[frozenset] = None
    check: Optional[Callable[[Any], bool]] = None
    per_layer: bool = False  # an array of one value per layer is that value

    def accepts(self, types: Sequence[int], value) -> bool:
        types = [int(t) for t in types]
        if not types:
            return False
        if types[0] == ARRAY_TYPE:
            allowed = (self.scalar if self.per_layer else self.items)
            if allowed is None or (len(types) > 1 and types[-1] not in allowed) or len(types) > 2:
                return False
            if self.per_layer and (not value or any(v != value[0] for v in value)):
                return False
            values = value if not self.per_layer else value[:1]
        else:
            if self.scalar is None or types[0] not in self.scalar:
                return False
            values = [value]
        return self.check is None or all(self.check(v) for v in values)

    def layered(self) -> "Kind":
        """The same kind, or an array of one such value per layer (all equal)."""
        return dataclasses.replace(self, words=f"{self.words} (or one per layer, all equal)", per_layer=True)


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


INT = Kind("an integer", scalar=INTEGER_TYPES)
NUMBER = Kind("a finite number", scalar=INTEGER_TYPES | FLOAT_TYPES, check=_finite)
BOOL = Kind("a bool", scalar=frozenset({BOOL_TYPE}))
TEXT = Kind("a string", scalar=frozenset({STRING_TYPE}))
TEXTS = Kind("an array of strings", items=frozenset({STRING_TYPE}))
INTS = Kind("an array of integers", items=INTEGER_TYPES)
NUMBERS = Kind("an array of finite numbers", items=INTEGER_TYPES | FLOAT_TYPES, check=_finite)


class Metadata:
    """The key-value section of one GGUF file (the `gguf` reader's fields), read key by key
    with a kind. `where` names the file in messages."""

    def __init__(self, fields: Mapping[str, Any], where: str):
        self.fields, self.where = fields, where
        self._contents: dict[str, Any] = {}  # a 49k-token vocabulary takes a while to decode: once

    def _value(self, key: str):
        if key not in self._contents:
            self._contents[key] = self.fields[key].contents()
        return self._contents[key]

    @property
    def arch(self) -> str:
        return self.get("general.architecture", TEXT)

    def name(self, key: str) -> str:
        """`key` with `{arch}` filled in."""
        return key.replace("{arch}", self.arch) if "{arch}" in key else key

    def __contains__(self, key: str) -> bool:
        return self.name(key) in self.fields

    def refuse(self, key: str, value, rule: str) -> UsageError:
        """The one-line refusal of `key`'s value."""
        key = self.name(key)
        field = self.fields.get(key)
        stored = f" ({type_words(field.types)})" if field is not None else ""
        if field is not None and [int(t) for t in field.types] == [FLOAT32] and isinstance(value, float):
            return UsageError(f"{self.where}: metadata {key}={str(np.float32(value))}{stored}: {rule}")  # as written
        return UsageError(f"{self.where}: metadata {key}={show(value)}{stored}: {rule}")

    def get(self, key: str, kind: Kind, default=_MISSING):
        """The value of `key` if it is stored with a type of `kind` (a per-layer array as
        its one value); `default` when the key is absent (no default: it is required)."""
        key = self.name(key)
        field = self.fields.get(key)
        if field is None:
            if default is _MISSING:
                raise UsageError(f"{self.where}: metadata {key} is missing (it must be {kind.words})")
            return default
        value = self._value(key)
        if not kind.accepts(field.types, value):
            raise self.refuse(key, value, f"must be {kind.words}")
        if kind.per_layer and isinstance(value, list):
            value = value[0]
        return float(value) if kind is NUMBER else value

    def token_id(self, key: str, vocab_size: int) -> Optional[int]:
        """An id in 0..vocab_size - 1, or None when the key is absent."""
        value = self.get(key, INT, None)
        if value is not None and not 0 <= value < vocab_size:
            raise self.refuse(key, value, f"must be a token id in 0..{vocab_size - 1}")
        return value

    def per_token(self, key: str, kind: Kind, count: int) -> Optional[list]:
        """An array of one value per token (`count` of them), or None when absent."""
        value = self.get(key, kind, None)
        if value is not None and len(value) != count:
            raise self.refuse(key, value, f"must hold one value per token ({count}), not {len(value)}")
        return value
