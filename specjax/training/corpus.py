"""The run's corpus and its batches on the mesh.

Configs with `tokenizer_vocab > 0` train a SentencePiece model on `train.corpus`
(default: the standard library's sources) and tokenise the corpus once into a cached
array (`data`). Configs without a tokenizer (`tiny`, vocab 32) train on
`synthetic_tokens`: a fixed random Markov chain over the vocabulary, cheap to make and far
from uniform, so losses fall quickly and the tests have something to learn. With a
teacher, its own tokenizer tokenises the corpus.

Batch `s` is a pure function of (train.seed, s) (`data.get_batch`), and each process
builds only its own rows of it (`jax.make_array_from_process_local_data`).
"""
from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from specjax import sharding
from specjax.config import Config, ConfigError, TrainConfig, UsageError, cache_dir
from specjax.training import data
from specjax.weights.tokenizer import Tokenizer

SYNTHETIC_TOKENS = 1 << 20


def synthetic_tokens(vocab_size: int, num_tokens: int = SYNTHETIC_TOKENS, seed: int = 0) -> np.ndarray:
    """A token stream for configs without a tokenizer: 1024 chains of a first-order
    Markov process whose transition rows are Dirichlet(0.1) draws (a few likely
    successors per token, entropy well below log V), concatenated. Fixed by (vocab, seed),
    so a teacher and its student see the same language."""
    rng = np.random.default_rng([seed, vocab_size])
    transitions = rng.dirichlet(np.full(vocab_size, 0.1), size=vocab_size)
    cumulative = np.cumsum(transitions, axis=1)
    chains, length = 1024, -(-num_tokens // 1024)
    out = np.empty((chains, length), np.int32)
    out[:, 0] = rng.integers(0, vocab_size, chains)
    uniforms = rng.random((length, chains))
    for t in range(1, length):
        rows = cumulative[out[:, t - 1]]
        out[:, t] = np.minimum((rows < uniforms[t][:, None]).sum(axis=1), vocab_size - 1)
    return out.reshape(-1)[:num_tokens]


@dataclasses.dataclass
class Corpus:
    train: np.ndarray
    val: np.ndarray
    tokenizer_file: Optional[pathlib.Path]  # None: synthetic data
    description: str
    # 1 where the loss counts the token as a target, 0 where it does not (a prompt's, with
    # `train.self_distill_replies`), aligned with train / val; None: every token counts.
    train_counted: Optional[np.ndarray] = None
    val_counted: Optional[np.ndarray] = None
    # Where each sample of the teacher begins in train + val, end to end (a self-distilled
    # corpus, `training.samples`); None: a corpus of documents.
    samples: Optional[np.ndarray] = None
    # What draft heads read of the frozen target's forward at each token, aligned with
    # train / val: (features [n, F], final hidden states [n, D]) (`samples.with_target_reads`);
    # None: each step runs the target's forward on its windows.
    train_seen: Optional[tuple] = None
    val_seen: Optional[tuple] = None


def load_corpus(config: Config, teacher_tokenizer=None, progress: bool = True) -> Corpus:
    """Token streams for `config` (see the module docstring). With a teacher, the
    teacher's own tokenizer is used: draft and target must share one."""
    tc = config.train
    vocab = config.target.vocab_size
    if not config.tokenizer_vocab:
        tokens = synthetic_tokens(vocab)
        train, val = data.split_train_val(tokens, tc.val_fraction)
        return Corpus(train, val, None, f"synthetic Markov chain, {len(tokens):,} tokens, vocab {vocab}")
    try:
        files = data.resolve_corpus(tc.corpus)
    except ValueError as e:
        raise UsageError(f"train.corpus: {e}") from e
    store = cache_dir() / "data"
    if teacher_tokenizer is not None:
        tokenizer = teacher_tokenizer
    else:
        tokenizer = data.build_or_load_tokenizer(files, store, config.tokenizer_vocab)
    if tokenizer.vocab_size != vocab:
        raise ConfigError(f"tokenizer {tokenizer.path} has {tokenizer.vocab_size} pieces but "
                          f"target.vocab_size={vocab}")
    tokens = data.build_token_cache(files, tokenizer, store, progress)
    train, val = data.split_train_val(tokens, tc.val_fraction)
    # A Hugging Face teacher's tokenizer stays in its directory (an export copies it from there).
    own = isinstance(tokenizer, Tokenizer)
    return Corpus(train, val, pathlib.Path(tokenizer.path) if own else None,
                  f"{tc.corpus}: {len(files):,} files, {len(tokens):,} tokens, tokenizer {tokenizer.path.name}")


def _row_block(batch_sharding, global_shape) -> tuple[int, int]:
    """(block index, number of blocks) of the batch rows this process feeds: the rows
    its devices hold under `batch_sharding` (all rows when 'data' does not split them)."""
    index_map = batch_sharding.addressable_devices_indices_map(global_shape)
    starts = [idx[0].start or 0 for idx in index_map.values()]
    stops = [global_shape[0] if idx[0].stop is None else idx[0].stop for idx in index_map.values()]
    lo, hi = min(starts), max(stops)
    per = hi - lo
    if global_shape[0] % per or lo % per:
        raise ConfigError(f"batch of {global_shape[0]} rows cannot be split evenly over processes "
                          f"(this process holds rows {lo}..{hi})")
    return lo // per, global_shape[0] // per


def check_stream_lengths(train_tokens: int, val_tokens: int, tc: TrainConfig) -> None:
    """Both streams must hold one window of seq_len + 1 tokens; the advice names the
    val_fraction that would fix a short one (smaller for train, larger for validation)."""
    need, total = tc.seq_len + 1, train_tokens + val_tokens
    if train_tokens >= need and val_tokens >= need:
        return
    name, have = ("train", train_tokens) if train_tokens < need else ("validation", val_tokens)
    problem = (f"the {name} stream has {have:,} tokens (train.val_fraction={tc.val_fraction} of {total:,}), "
               f"fewer than train.seq_len + 1 = {need}")
    if total < 2 * need + 2:
        raise UsageError(f"{problem}; the corpus is too small for a train and a validation window of {need} "
                         f"tokens each: use a bigger corpus or train.seq_len at most {max(1, total // 2 - 3)}")
    digits = 1e4  # the advice is rounded towards the safe side
    if name == "train":
        fix = f"lower train.val_fraction to at most {math.floor((total - need - 1) / total * digits) / digits:g}"
    else:
        fix = f"raise train.val_fraction to at least {math.ceil((need + 1) / total * digits) / digits:g}"
    raise UsageError(f"{problem}: {fix}, lower train.seq_len, or use a bigger corpus")


class Batches:
    """Global batches as sharded device arrays, built from this process's rows only."""

    def __init__(self, corpus: Corpus, tc: TrainConfig, mesh):
        self.corpus, self.tc = corpus, tc
        self.shape = (tc.batch_size, tc.seq_len + 1)
        self.sharding = sharding.named(mesh, ("batch", None), self.shape)
        self.replicated = sharding.replicated(mesh)
        self.block, self.blocks = _row_block(self.sharding, self.shape)
        check_stream_lengths(len(corpus.train), len(corpus.val), tc)
        # The cached target's reads of a window's inputs: [B, seq_len, F] each.
        self.seen_shapes = None if corpus.train_seen is None else tuple(
            ((tc.batch_size, tc.seq_len, a.shape[-1]), a.dtype) for a in corpus.train_seen)
        self.seen_sharding = None if corpus.train_seen is None else \
            sharding.named(mesh, ("batch", None, None), self.seen_shapes[0][0])

    def _device(self, local: np.ndarray, where=None, shape=None) -> jax.Array:
        return jax.make_array_from_process_local_data(where or self.sharding, local, shape or self.shape)

    def train(self, step: int) -> tuple[jax.Array, jax.Array, Optional[tuple]]:
        """(tokens, counted, seen): batch `step`'s windows; window for window, which of their
        tokens the loss counts as targets (all, unless the corpus says otherwise); and the
        target's cached reads of their inputs (`Corpus.train_seen`; None without)."""
        tc, c = self.tc, self.corpus
        starts = data.batch_starts(len(c.train), step, tc.batch_size, tc.seq_len, tc.seed,
                                   process_index=self.block, process_count=self.blocks)
        return self._windows(starts, c.train, c.train_counted, c.train_seen)

    def validation(self) -> list[tuple[jax.Array, jax.Array, Optional[tuple]]]:
        tc, c = self.tc, self.corpus
        return [self._windows(s, c.val, c.val_counted, c.val_seen)
                for s in data.eval_starts(len(c.val), tc.batch_size, tc.seq_len, tc.eval_batches,
                                          process_index=self.block, process_count=self.blocks)]

    def _windows(self, starts, tokens, counted, seen):
        width = self.tc.seq_len + 1
        tokens = data.windows(tokens, starts, width).astype(np.int32)
        counted = np.ones_like(tokens) if counted is None else data.windows(counted, starts, width).astype(np.int32)
        if seen is not None:
            made = {}  # one transfer where the features are the final states
            for a, (shape, _) in zip(seen, self.seen_shapes):
                if id(a) not in made:
                    made[id(a)] = self._device(data.windows(a, starts, width - 1), self.seen_sharding, shape)
            seen = tuple(made[id(a)] for a in seen)
        return self._device(tokens), self._device(counted), seen

    def _hyper_host(self, step: int) -> dict[str, np.ndarray]:
        return {"step": np.int32(step), "distill_weight": np.float32(self.tc.distill_weight)}

    def hyper(self, step: int) -> dict[str, jax.Array]:
        """The train step's scalar inputs, replicated."""
        return {k: jax.make_array_from_process_local_data(self.replicated, v, ())
                for k, v in self._hyper_host(step).items()}

    def abstract(self) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct, Optional[tuple], dict]:
        """(batch, counted, seen, hyper) as the compiled train step sees them."""
        window = jax.ShapeDtypeStruct(self.shape, jnp.int32, sharding=self.sharding)
        seen = None if self.seen_shapes is None else tuple(
            jax.ShapeDtypeStruct(shape, dtype, sharding=self.seen_sharding) for shape, dtype in self.seen_shapes)
        return (window, window, seen,
                {k: jax.ShapeDtypeStruct((), v.dtype, sharding=self.replicated)
                 for k, v in self._hyper_host(0).items()})
