"""The retrieval drafter's datastore: what most often follows each short context in a corpus.

REST (He et al. 2023, "REST: Retrieval-Based Speculative Decoding") drafts by looking
the current context up in a corpus instead of running a draft model. Here the lookup
happens on device, inside the fused loop, so the corpus is distilled once into a table:

  for every context of m = 1..N tokens seen in the corpus, one continuation of C tokens,
  chosen greedily: the most frequent next token, then the most frequent token after that
  among the occurrences that agree so far, and so on (a walk down the most frequent
  branch of the continuation trie); contexts whose most frequent next token was seen
  fewer than `min_count` times are dropped.

The table is sorted by a 32-bit hash of (m, context); a query hashes the row's last m
tokens for every m, finds the hash with `jnp.searchsorted` and confirms the stored
context token by token, so a hash collision costs a proposal, never a wrong one; the
longest matching m wins. Whatever is proposed is a deterministic function of the
context, so verifying it as a point mass is exact.

A datastore records the vocabulary size and the sha256 of the tokenizer model it was
built with; using it with another tokenizer is refused.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import time
import zipfile

import jax
import jax.numpy as jnp
import numpy as np

from specjax import distributed, sharding
from specjax.config import MAX_NGRAM, UsageError, user_path

FORMAT = 1
FNV_OFFSET, FNV_PRIME, GOLDEN = 2166136261, 16777619, 0x9E3779B9


def context_hash(context, xp=np):
    """32-bit FNV-1a of the m tokens on the last axis, seeded with m (so contexts of
    different lengths do not collide systematically); the same in numpy and jax.numpy."""
    m = context.shape[-1]
    h = xp.full(context.shape[:-1], (FNV_OFFSET + m * GOLDEN) % 2 ** 32, xp.uint32)
    for i in range(m):
        h = (h ^ context[..., i].astype(xp.uint32)) * xp.uint32(FNV_PRIME)
    return h


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Index:
    """The device side of a datastore (E entries): sorted hashes, contexts and continuations."""

    keys: jax.Array  # uint32 [E], ascending
    contexts: jax.Array  # int32 [E, N], right-aligned, -1 before a context shorter than N
    continuations: jax.Array  # int32 [E, C], -1 past the end of the corpus


def lookup(index: Index, tokens: jax.Array, length: jax.Array, ngram: int, lookahead: int):
    """The datastore's proposal for each row's context tokens[:length]: the continuation of
    its longest suffix (at most `ngram` tokens) found in the table. Returns (x [B, K],
    size [B]: tokens proposed, 0 when no suffix is in the table; m [B]: that suffix's
    length)."""
    batch = tokens.shape[0]
    entries, width = index.contexts.shape
    places = length[:, None] - width + jnp.arange(width)[None, :]
    last = jnp.where(places >= 0, jnp.take_along_axis(tokens, jnp.maximum(places, 0), axis=1), -1)
    row = jnp.full((batch,), -1, jnp.int32)
    matched = jnp.zeros((batch,), jnp.int32)
    for m in range(1, min(ngram, width) + 1):  # longer matches override shorter ones
        context = jnp.where(jnp.arange(width)[None, :] >= width - m, last, -1)
        h = context_hash(context[:, width - m:], jnp)
        i = jnp.clip(jnp.searchsorted(index.keys, h), 0, entries - 1).astype(jnp.int32)
        hit = (length >= m) & (index.keys[i] == h) & jnp.all(index.contexts[i] == context, axis=1)
        row = jnp.where(hit, i, row)
        matched = jnp.where(hit, m, matched)
    cont = index.continuations[jnp.maximum(row, 0)]
    if cont.shape[1] < lookahead:
        cont = jnp.pad(cont, ((0, 0), (0, lookahead - cont.shape[1])), constant_values=-1)
    cont = cont[:, :lookahead]
    size = jnp.where(row >= 0, jnp.sum(jnp.cumprod(cont >= 0, axis=1), axis=1), 0).astype(jnp.int32)
    return jnp.maximum(cont, 0), size, matched


def _greedy_continuations(context: np.ndarray, follow: np.ndarray):
    """For each distinct row of `context` [M, m] (occurrences, with the C tokens that
    followed each in `follow` [M, C]): the greedy most-frequent continuation and the count
    of its first token. Returns (contexts [G, m], continuations [G, C], support [G])."""
    m, width = context.shape[1], follow.shape[1]
    order = np.lexsort(tuple(follow[:, j] for j in reversed(range(width))) +
                       tuple(context[:, j] for j in reversed(range(m))))
    context, follow = context[order], follow[order]
    new_group = np.ones(len(context), bool)
    new_group[1:] = np.any(context[1:] != context[:-1], axis=1)
    group = np.cumsum(new_group) - 1
    groups = int(group[-1]) + 1
    chosen = np.full((groups, width), -1, np.int32)
    support = np.zeros(groups, np.int64)
    alive = np.arange(len(context))
    for s in range(width):
        # Rows still alive share their group's chosen prefix; sorted, equal tokens at
        # step s are contiguous runs within a group.
        g, c = group[alive], follow[alive, s]
        start = np.ones(len(alive), bool)
        start[1:] = (g[1:] != g[:-1]) | (c[1:] != c[:-1])
        run = np.cumsum(start) - 1
        run_len = np.bincount(run)
        run_group, run_token = g[start], c[start]
        by = np.lexsort((np.arange(len(run_len)), -run_len, run_group))  # per group: longest run first
        first = np.ones(len(by), bool)
        first[1:] = run_group[by][1:] != run_group[by][:-1]
        best = by[first]
        chosen[run_group[best], s] = run_token[best]
        if s == 0:
            support[run_group[best]] = run_len[best]
        keep = np.zeros(len(run_len), bool)
        keep[best] = True
        alive = alive[keep[run]]
    return context[new_group], chosen, support


@dataclasses.dataclass(frozen=True)
class Datastore:
    """A built datastore on the host: the table and what it was built from (`meta`)."""

    keys: np.ndarray
    contexts: np.ndarray
    continuations: np.ndarray
    meta: dict

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.contexts.nbytes + self.continuations.nbytes

    @property
    def ngram(self) -> int:
        return self.contexts.shape[1]

    @classmethod
    def build(cls, tokens, *, vocab_size: int, ngram: int = 3, continuation: int = 8, min_count: int = 2,
              tokenizer_sha256: str | None = None, corpus: str = "") -> "Datastore":
        """The table of a token stream (documents separated by EOS, as training reads it)."""
        start = time.perf_counter()
        for name, value in (("ngram", ngram), ("continuation", continuation), ("min_count", min_count)):
            if not isinstance(value, int) or value < 1:
                raise UsageError(f"datastore {name}={value!r}: must be a positive integer")
        if ngram > MAX_NGRAM:
            raise UsageError(f"datastore ngram={ngram}: at most {MAX_NGRAM}")
        tokens = np.asarray(tokens).astype(np.int32)
        if tokens.ndim != 1 or len(tokens) <= ngram:
            raise UsageError(f"datastore corpus: needs a 1-D stream of more than ngram={ngram} tokens, "
                             f"got shape {tokens.shape}")
        if tokens.min() < 0 or tokens.max() >= vocab_size:
            raise UsageError(f"datastore corpus: token ids must be in 0..{vocab_size - 1}")
        padded = np.concatenate([tokens, np.full(continuation, -1, np.int32)])
        contexts, continuations, supports = [], [], []
        for m in range(1, ngram + 1):
            ends = np.arange(m - 1, len(tokens) - 1)
            context = np.stack([tokens[ends - m + 1 + i] for i in range(m)], axis=1)
            follow = np.stack([padded[ends + 1 + j] for j in range(continuation)], axis=1)
            ctx, cont, support = _greedy_continuations(context, follow)
            kept = support >= min_count
            aligned = np.full((int(kept.sum()), ngram), -1, np.int32)
            aligned[:, ngram - m:] = ctx[kept]
            contexts.append(aligned)
            continuations.append(cont[kept])
            supports.append(support[kept])
        contexts, continuations = np.concatenate(contexts), np.concatenate(continuations)
        support = np.concatenate(supports)
        lengths = (contexts >= 0).sum(axis=1)
        keys = np.zeros(len(contexts), np.uint32)
        for m in range(1, ngram + 1):
            rows = lengths == m
            keys[rows] = context_hash(contexts[rows, ngram - m:])
        # One entry per hash: a colliding context keeps the better supported one (and the
        # other's queries find a context that does not match: no proposal).
        order = np.lexsort((-support, keys))
        first = np.ones(len(order), bool)
        first[1:] = keys[order][1:] != keys[order][:-1]
        order = order[first]
        if len(order) == 0:
            raise UsageError(f"datastore corpus: no context occurs min_count={min_count} times")
        meta = {"format": FORMAT, "vocab_size": int(vocab_size), "tokenizer_sha256": tokenizer_sha256,
                "ngram": ngram, "continuation": continuation, "min_count": min_count, "corpus": corpus,
                "corpus_tokens": int(len(tokens)), "entries": int(len(order)),
                "build_seconds": time.perf_counter() - start}
        store = cls(keys[order], contexts[order], continuations[order], meta)
        return dataclasses.replace(store, meta={**meta, "bytes": store.nbytes})

    def save(self, path) -> None:
        buf = io.BytesIO()
        np.savez(buf, keys=self.keys, contexts=self.contexts, continuations=self.continuations,
                 meta=np.frombuffer(json.dumps(self.meta).encode(), np.uint8))
        path = user_path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")  # a reader never sees half a datastore
        tmp.write_bytes(buf.getvalue())
        tmp.replace(path)

    @classmethod
    def load(cls, path) -> "Datastore":
        """A saved datastore; anything else (another file, a damaged or hand-made one whose
        arrays or metadata the lookup cannot use) is a UsageError naming the path."""
        path = user_path(path)
        name = f"--datastore={str(path)!r}"
        if not path.is_file():
            raise UsageError(f"{name}: no such file; build one with `python -m specjax.datastore --out=PATH`")
        try:
            with np.load(io.BytesIO(path.read_bytes()), allow_pickle=False) as f:
                arrays = {k: f[k] for k in ("keys", "contexts", "continuations", "meta")}
            meta = json.loads(arrays.pop("meta").tobytes().decode())
        except (OSError, EOFError, KeyError, ValueError, UnicodeDecodeError, zipfile.BadZipFile) as e:
            raise UsageError(f"{name}: not a specjax datastore ({type(e).__name__}: "
                             f"{' '.join(str(e).split())[:200]})") from None
        if not isinstance(meta, dict):
            raise UsageError(f"{name}: not a specjax datastore (its meta is a JSON {type(meta).__name__}, not an "
                             "object)")
        if meta.get("format") != FORMAT:
            raise UsageError(f"{name}: format {meta.get('format')!r}, this version reads {FORMAT}; rebuild it with "
                             "`python -m specjax.datastore`")
        problem = _problem(arrays, meta)
        if problem:
            raise UsageError(f"{name}: a damaged datastore: {problem}; rebuild it with `python -m specjax.datastore`")
        return cls(arrays["keys"], arrays["contexts"], arrays["continuations"], meta)

    def check(self, vocab_size: int, name: str = "datastore") -> None:
        """Refuse a datastore built for another vocabulary: its ids would be out of range."""
        if self.meta["vocab_size"] != vocab_size:
            raise UsageError(f"{name}: built for a vocabulary of {self.meta['vocab_size']} tokens, the model "
                             f"has {vocab_size}")

    def check_tokenizer(self, tokenizer_sha256: str | None, name: str = "datastore") -> None:
        """Refuse a datastore built with another tokenizer (None: token ids without one):
        its ids would mean other pieces, and every proposal would be noise."""
        built = self.meta.get("tokenizer_sha256")
        if built != tokenizer_sha256:
            said = lambda sha: f"tokenizer sha256 {sha[:12]}..." if sha else "no tokenizer"
            raise UsageError(f"{name}: built with {said(built)}, this model has {said(tokenizer_sha256)}; rebuild "
                             "it with `python -m specjax.datastore`")

    def on_mesh(self, mesh: jax.sharding.Mesh) -> Index:
        """The table on the mesh, replicated: the loop looks it up with no host round trip."""
        place = lambda a: distributed.put(a, sharding.replicated(mesh))
        return Index(place(self.keys), place(self.contexts), place(self.continuations))


def _problem(arrays: dict, meta: dict) -> str:
    """What makes a loaded table unusable by `lookup` ('' when nothing does)."""
    for key in ("vocab_size", "ngram", "continuation"):
        value = meta.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"meta {key}={value!r} (must be a positive integer)"
    sha = meta.get("tokenizer_sha256")
    if sha is not None and not isinstance(sha, str):
        return f"meta tokenizer_sha256={sha!r} (must be a string or null)"
    keys, contexts, continuations = arrays["keys"], arrays["contexts"], arrays["continuations"]
    entries = keys.shape[0] if keys.ndim == 1 else -1
    for what, a, dtype, shape in (("keys", keys, np.uint32, (entries,)),
                                  ("contexts", contexts, np.int32, (entries, meta["ngram"])),
                                  ("continuations", continuations, np.int32, (entries, meta["continuation"]))):
        if a.dtype != dtype or a.shape != shape:
            return (f"{what} is {a.dtype} {list(a.shape)}, expected {np.dtype(dtype)} "
                    f"[{', '.join(map(str, shape)) if entries >= 0 else 'entries'}]")
    if entries == 0:
        return "it holds no entries"
    if np.any(keys[1:] <= keys[:-1]):
        return "keys are not strictly ascending (the lookup searches them)"
    vocab = meta["vocab_size"]
    for what, a in (("contexts", contexts), ("continuations", continuations)):
        if a.min() < -1 or a.max() >= vocab:
            return f"{what} hold token ids outside 0..{vocab - 1} (-1 marks an empty slot)"
    return ""


def file_sha256(path) -> str:
    return hashlib.sha256(user_path(path).read_bytes()).hexdigest()
