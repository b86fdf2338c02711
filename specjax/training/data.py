"""Training data: corpus files -> one cached token stream -> deterministic batches.

The corpus is tokenised once into a flat stream (documents separated by EOS) and cached
as a `.npy` file that is memory-mapped on later runs. Batches are a pure function of
(seed, step): resuming at step s replays exactly the batches an uninterrupted run would
have seen, with no data-loader state to checkpoint, and every host of a multi-host run
computes the same global batch and keeps only its own rows.
"""
from __future__ import annotations

import glob
import hashlib
import io
import json
import os
import pathlib
import sysconfig
from collections.abc import Sequence

import numpy as np
from tqdm import tqdm

from specjax.weights.tokenizer import (TRAINER_OPTIONS, Tokenizer, atomic_write_bytes,
                               read_document, train_tokenizer)

# Extensions picked up when the corpus spec is a directory.
TEXT_SUFFIXES = (".py", ".txt", ".md")
# Stdlib directories holding test suites: full of deliberately odd code (bad encodings,
# syntax errors, huge generated literals) that we do not want the models to imitate.
_STDLIB_TEST_DIRS = frozenset({"test", "tests", "idle_test"})
_SITE_DIRS = frozenset({"site-packages", "dist-packages"})
# Bump when the cache file layout changes, so old caches are not misread.
_CACHE_VERSION = 1


def default_corpus_files() -> list[pathlib.Path]:
    """The standard library's own `.py` sources: always present, no download needed.

    Excludes installed third-party packages (site-packages) and the test suites.
    """
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = []
    for here, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SITE_DIRS | _STDLIB_TEST_DIRS]  # never walked into
        files += [pathlib.Path(here, n) for n in names if n.endswith(".py")]
    return sorted(f for f in files if f.is_file())


def resolve_corpus(spec: str | None) -> list[pathlib.Path]:
    """Turns a corpus spec from a config or flag into a sorted list of files.

    `None` or "stdlib": `default_corpus_files()`. A directory: every file under it with
    a suffix in `TEXT_SUFFIXES`, skipping hidden directories (.git, .venv). A file: that
    file. Anything else is a glob pattern (`**` recurses).
    """
    if spec is None or spec == "stdlib":
        files = default_corpus_files()
    else:
        path = pathlib.Path(spec).expanduser()
        if path.is_dir():
            files = [p for p in path.rglob("*")
                     if p.suffix in TEXT_SUFFIXES and p.is_file()
                     and not any(part.startswith(".")
                                 for part in p.relative_to(path).parts[:-1])]
        elif path.is_file():
            files = [path]
        else:
            files = [pathlib.Path(p) for p in glob.glob(os.path.expanduser(spec),
                                                         recursive=True)]
            files = [p for p in files if p.is_file()]
    if not files:
        raise ValueError(f"corpus spec {spec!r} matched no files (expected 'stdlib', a "
                         f"directory with {'/'.join(TEXT_SUFFIXES)} files, a file or a glob)")
    return sorted(files)


def _files_fingerprint(files: Sequence[str | os.PathLike]) -> str:
    """sha256 of (absolute path, size, mtime_ns) of every file, in order.

    Cheap (no reads) and changes whenever a file is edited, added, removed or reordered.
    """
    entries = []
    for f in files:
        st = os.stat(f)
        entries.append([str(pathlib.Path(f).resolve()), st.st_size, st.st_mtime_ns])
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()


def _file_sha256(path: str | os.PathLike) -> str:
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def token_cache_key(files: Sequence[str | os.PathLike], tokenizer: Tokenizer) -> str:
    """Key of the token cache: corpus fingerprint + tokenizer model bytes + layout."""
    payload = json.dumps([_CACHE_VERSION, _files_fingerprint(files),
                          _file_sha256(tokenizer.path)])
    return hashlib.sha256(payload.encode()).hexdigest()[:20]


def build_token_cache(files: Sequence[str | os.PathLike], tokenizer: Tokenizer,
                      cache_dir: str | os.PathLike, progress: bool = True) -> np.ndarray:
    """Tokenises `files` once into `doc0 EOS doc1 EOS ...`; returns it memory-mapped.

    The cache lives at `cache_dir/tokens-<key>.npy` (see `token_cache_key`); a later call
    with the same files and tokenizer maps that file without touching the tokenizer. It
    is written atomically, so concurrent or interrupted runs never see a partial file.
    """
    cache = pathlib.Path(cache_dir) / f"tokens-{token_cache_key(files, tokenizer)}.npy"
    if not cache.exists():
        dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
        pieces = []
        sizes = [os.stat(f).st_size for f in files]
        with tqdm(total=sum(sizes), unit="B", unit_scale=True, desc="tokenising", disable=not progress) as bar:
            for f, size in zip(files, sizes):
                pieces.append(np.asarray(tokenizer.encode(read_document(f)), dtype))
                pieces.append(np.asarray([tokenizer.eos_id], dtype))
                bar.update(size)
        buf = io.BytesIO()
        np.save(buf, np.concatenate(pieces))
        atomic_write_bytes(cache, buf.getvalue())
    return np.load(cache, mmap_mode="r")


def build_or_load_tokenizer(files: Sequence[str | os.PathLike],
                            cache_dir: str | os.PathLike, vocab_size: int) -> Tokenizer:
    """Trains a tokenizer on `files` the first time; loads the cached model after that.

    Keyed on the corpus fingerprint, the vocab size and the trainer options, so changing
    any of them trains a new model instead of silently reusing a stale one.
    """
    payload = json.dumps([_files_fingerprint(files), vocab_size, TRAINER_OPTIONS],
                         sort_keys=True, default=str)
    key = hashlib.sha256(payload.encode()).hexdigest()[:20]
    prefix = pathlib.Path(cache_dir) / f"tokenizer-{vocab_size}-{key}"
    model = pathlib.Path(f"{prefix}.model")
    if not model.exists():
        train_tokenizer(files, prefix, vocab_size)
    return Tokenizer(model)


def split_train_val(tokens: np.ndarray, val_fraction: float = 0.01
                    ) -> tuple[np.ndarray, np.ndarray]:
    """The last `val_fraction` of the stream is validation; both are views, no copy.

    A contiguous tail (rather than random windows) keeps train and validation windows
    from overlapping.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n_val = max(1, int(round(len(tokens) * val_fraction)))
    return tokens[:len(tokens) - n_val], tokens[len(tokens) - n_val:]


def _local_rows(batch_size: int, process_index: int, process_count: int) -> slice:
    """This process's contiguous block of rows of the global batch.

    Contiguous blocks in process order are what `jax.make_array_from_process_local_data`
    expects for a batch sharded over a 'data' axis laid out process by process, and
    concatenating them in process order gives back the global batch.
    """
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} not in [0, {process_count})")
    if batch_size % process_count:
        raise ValueError(f"global batch_size {batch_size} is not divisible by "
                         f"process_count {process_count}")
    per = batch_size // process_count
    return slice(process_index * per, (process_index + 1) * per)


def windows(stream: np.ndarray, starts: np.ndarray, width: int) -> np.ndarray:
    """stream[s:s + width] for each start s, stacked: [len(starts), width, ...]."""
    return np.stack([stream[s:s + width] for s in starts])


def batch_starts(length: int, step: int, batch_size: int, seq_len: int, seed: int,
                 process_index: int = 0, process_count: int = 1) -> np.ndarray:
    """Where global batch `step`'s windows of `seq_len + 1` tokens begin in a stream of
    `length` tokens, this process's rows: a pure function of (seed, step)."""
    if length < seq_len + 1:
        raise ValueError(f"token stream has {length} tokens, fewer than "
                         f"seq_len + 1 = {seq_len + 1}")
    rows = _local_rows(batch_size, process_index, process_count)
    rng = np.random.default_rng([seed, step])
    return rng.integers(0, length - seq_len, size=batch_size)[rows]


def get_batch(tokens: np.ndarray, step: int, batch_size: int, seq_len: int, seed: int,
              process_index: int = 0, process_count: int = 1) -> np.ndarray:
    """Global batch `step` = `batch_size` random windows of `seq_len + 1` tokens.

    Returns int32 `[batch_size // process_count, seq_len + 1]`, this process's rows:
    inputs are `[:, :-1]`, targets `[:, 1:]`. A pure function of (seed, step).
    """
    starts = batch_starts(len(tokens), step, batch_size, seq_len, seed, process_index, process_count)
    return windows(tokens, starts, seq_len + 1).astype(np.int32)


def eval_starts(length: int, batch_size: int, seq_len: int, num_batches: int,
                process_index: int = 0, process_count: int = 1) -> list[np.ndarray]:
    """Where `eval_batches`' windows begin, batch by batch (this process's rows)."""
    if length < seq_len + 1:
        raise ValueError(f"token stream has {length} tokens, fewer than "
                         f"seq_len + 1 = {seq_len + 1}")
    rows = _local_rows(batch_size, process_index, process_count)
    starts = np.linspace(0, length - seq_len - 1, batch_size * num_batches)
    starts = starts.astype(np.int64).reshape(num_batches, batch_size)
    return [s[rows] for s in starts]


def eval_batches(tokens: np.ndarray, batch_size: int, seq_len: int, num_batches: int,
                 process_index: int = 0, process_count: int = 1) -> list[np.ndarray]:
    """`num_batches` fixed validation batches: windows at evenly spaced offsets.

    Evenly spaced windows cover the whole validation stream (not just its start) and are
    the same on every call, so validation losses are comparable across steps and runs.
    Windows only overlap when the stream is shorter than all windows laid end to end.
    """
    return [windows(tokens, s, seq_len + 1).astype(np.int32)
            for s in eval_starts(len(tokens), batch_size, seq_len, num_batches, process_index, process_count)]
