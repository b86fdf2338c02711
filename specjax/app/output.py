"""Output files: checked before any work, touched only once there is something to write,
and never lost.

* `check_writable(path)`: fails at start-up (UsageError, exit 2) when a path cannot be
  written, without creating or truncating anything.
* `JsonlWriter`: one JSON line per sample, the file opened (truncated) only when the
  first batch is done, each batch written and flushed with SIGINT and SIGTERM held off,
  so an interrupted run leaves only complete lines.
* `save`: a report (text or bytes) written at the end of a run; if that write fails (a
  full disk), it goes to a temporary file instead and the error names it, so the run's
  result is kept.
Only process 0 writes (the other processes of a pod run compute the same thing).
"""
from __future__ import annotations

import json
import os
import pathlib
import signal
import tempfile
from typing import Optional, Sequence

import jax

from specjax.app.cli import RunError
from specjax.config import UsageError, is_remote, user_path


def _path(path: str):
    """pathlib for local paths (epath calls a device file such as /dev/full a regular
    file, and an atomic replace would then swap the device for a file), epath for gs://."""
    return user_path(path) if is_remote(path) else pathlib.Path(path).expanduser()


def check_writable(path: Optional[str], flag: str = "--output", not_same_as: Sequence[Optional[str]] = ()) -> None:
    """Raise UsageError unless `path` could be written (created with its directories, or
    overwritten); `not_same_as` names input files it must not replace. Creates nothing."""
    if path is None:
        return
    if not str(path).strip():
        raise UsageError(f"{flag}={path!r}: empty file name")
    p = _path(path)
    if p.is_dir():
        raise UsageError(f"{flag}={path!r}: cannot write it, it is a directory; give a file name")
    if is_remote(path):
        return  # no permission bits to read on gs://: a write failure at the end is kept (see `save`)
    for other in not_same_as:
        if other and not is_remote(other) and p.exists() and _path(other).exists() and os.path.samefile(
                p, _path(other)):
            raise UsageError(f"{flag}={path!r}: is the input file {other!r}; writing it would destroy the input")
    # Tried, not inferred from permission bits: root passes every os.access check, and a
    # read-only filesystem shows none in them.
    if p.exists():
        try:
            with open(p, "ab"):  # append mode: opening changes nothing in the file
                pass
        except OSError as e:
            raise UsageError(f"{flag}={path!r}: the file exists and cannot be written ({e.strerror})") from None
        return
    parent = p.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"{flag}={path!r}: {parent} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=".specjax-write-check-")
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise UsageError(f"{flag}={path!r}: cannot create it in {parent} ({e.strerror})") from None


def _held(write) -> None:
    """Run `write` with SIGINT/SIGTERM held, so a Ctrl-C lands before or after it."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        write()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


class JsonlWriter:
    """Whole batches of JSON lines. `path` (checked by `check_writable` at start-up) is
    opened at the first `write`, so a run that fails before its first batch leaves an
    existing file as it was."""

    def __init__(self, path: Optional[str]):
        self.path = _path(path) if path is not None else None
        self.file = None
        self.lines = 0
        self.enabled = path is not None and jax.process_index() == 0

    def write(self, records: Sequence[dict]) -> None:
        if not self.enabled:
            return
        data = "".join(json.dumps(r) + "\n" for r in records)

        def write():
            if self.file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self.file = self.path.open("w", encoding="utf-8")
            self.file.write(data)
            self.file.flush()

        try:
            _held(write)
        except OSError as e:
            raise RunError(f"--output={str(self.path)!r}: writing failed after {self.lines} lines "
                           f"({e.strerror or e}); the samples are printed above") from None
        self.lines += len(records)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.file is not None:
            try:
                self.file.close()
            except OSError:
                pass


def print_or_save(path: Optional[str], text: str) -> None:
    """`text` and a newline to `path` (as `save` writes it), or printed without a path;
    on process 0 only."""
    if jax.process_index() != 0:
        return
    if path:
        save(path, text + "\n")
    else:
        print(text)


def save(path: str, data: str | bytes, flag: str = "--output") -> None:
    """Write `data` to `path` (atomically where `path` is a regular file), on process 0.
    On failure the data is saved to a temporary file and RunError names it."""
    if jax.process_index() != 0:
        return
    p = _path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        if is_remote(path) or p.exists() and not p.is_file():  # gs://, /dev/stdout: no temporary next to them
            _held(lambda: p.write_bytes(raw))
            return
        tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")  # a reader never sees half a report
        try:
            tmp.write_bytes(raw)
            tmp.replace(p)
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as e:
        fd, fallback = tempfile.mkstemp(prefix="specjax-", suffix="-" + p.name)
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        raise RunError(f"{flag}={path!r}: cannot write it ({e.strerror or e}); the results are saved in "
                       f"{fallback} instead") from None
