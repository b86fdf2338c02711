"""A training run's workdir: its one writer (`WorkdirLock`), the metrics log, and the
stop requests (SIGTERM, Ctrl-C) that end a run with a checkpoint.

One run per workdir: `WorkdirLock` refuses a second writer. With several processes only
process 0 locks the workdir and writes metrics; JAX's preemption sync point makes all
processes stop at the same step.
"""
from __future__ import annotations

import fcntl
import json
import os
import pathlib
import signal
import tempfile
import time
from typing import Optional

import jax
import numpy as np
from tqdm import tqdm

from specjax.config import UsageError, is_remote, user_path

METRICS_FILE = "metrics.jsonl"


# --------------------------------------------------------------------------- metrics


class MetricsLog:
    """Append-only JSONL; one record a line with 'kind' ('train', 'val', 'event') and
    'step'. A resumed run appends records for steps that an interrupted run may already
    have logged: `read_metrics` keeps the last record per (kind, step)."""

    def __init__(self, path: pathlib.Path, enabled: bool = True):
        self.path, self.enabled = path, enabled

    def write(self, kind: str, step: int, **values) -> None:
        if not self.enabled:
            return
        record = {"kind": kind, "step": int(step), "time": round(time.time(), 3)}
        record.update({k: (float(v) if isinstance(v, (np.floating, np.ndarray, jax.Array)) else v)
                       for k, v in values.items()})
        line = json.dumps(record) + "\n"
        if is_remote(self.path):  # cloud objects cannot be appended to: rewrite (metrics files are small)
            self.path.write_text((self.path.read_text() if self.path.exists() else "") + line)
            return
        with open(self.path, "a") as f:
            f.write(line)


def read_metrics(workdir, kind: str = "train") -> dict[int, dict]:
    """{step: last record of `kind` for that step} from a workdir's metrics.jsonl."""
    out: dict[int, dict] = {}
    path = user_path(workdir) / METRICS_FILE
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by kill -9
            continue
        if record.get("kind") == kind:
            out[record["step"]] = record
    return dict(sorted(out.items()))


# --------------------------------------------------------------------------- stop requests


class StopRequest:
    """SIGTERM (preemption) or Ctrl-C asks the loop to checkpoint and stop after the
    current step; a second Ctrl-C aborts at once. With several processes, JAX's
    preemption sync point makes every process stop at the same step."""

    def __init__(self):
        self.signum: Optional[int] = None
        self._previous = {}

    def __enter__(self):
        if jax.process_count() == 1:
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        tqdm.write(f"received {signal.Signals(signum).name}: saving a checkpoint after this step, then stopping"
                   + (" (Ctrl-C again aborts)" if signum == signal.SIGINT else ""))

    def __call__(self, step: int) -> bool:
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            if multihost_utils.reached_preemption_sync_point(step):
                self.signum = signal.SIGTERM
        return self.signum is not None

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


# --------------------------------------------------------------------------- the workdir

LOCK_FILE = "train.lock"


class WorkdirLock:
    """The one writer of a workdir: an exclusive `flock` on WORKDIR/train.lock, held for
    the whole run. A second `train` on the same directory would interleave its
    checkpoints and metrics with the first's (and orbax's start-up clean-up would delete
    the first run's half-written step), so it is refused. The kernel drops the lock when
    its process dies, so a kill -9 never leaves it stuck; the file itself (holding the
    last holder's pid) stays and means nothing.

    Several processes of one run: process 0 alone creates, checks and locks the workdir
    (a shared filesystem would make the run's own processes lock each other out), and
    every process learns whether that worked, so all of them stop together."""

    def __init__(self, workdir: pathlib.Path):
        self.workdir = workdir
        self.fd: Optional[int] = None
        self.created = False  # this run made the directory (so a refused run takes it away again)

    def __enter__(self) -> "WorkdirLock":
        error = None
        if jax.process_index() == 0:
            try:
                self._acquire()
            except UsageError as e:
                error = e
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            failed = multihost_utils.broadcast_one_to_all(np.int32(error is not None))
            if failed and error is None:
                raise UsageError(f"process 0 could not take the workdir {self.workdir} (its message says why)")
        if error is not None:
            raise error
        return self

    def _acquire(self) -> None:
        workdir = self.workdir
        if is_remote(workdir):  # no flock on gs://: one writer there is the user's to ensure
            workdir.mkdir(parents=True, exist_ok=True)
            return
        if workdir.exists() and not workdir.is_dir():
            raise UsageError(f"workdir {workdir} is a file, not a directory: pass a directory (it is created if "
                             f"missing)")
        try:
            self.created = not workdir.exists()
            workdir.mkdir(parents=True, exist_ok=True)
            fd = os.open(workdir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise UsageError(f"cannot write to workdir {workdir} ({e.strerror}): pass a writable workdir") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            raise UsageError(f"another training run{f' (pid {holder})' if holder.isdigit() else ''} is writing "
                             f"to workdir {workdir}: wait for it to finish, stop it, or pass another workdir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        try:
            check_writable(workdir)
        except UsageError:
            self.__exit__()
            raise

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the flock
            self.fd = None
            # A run refused after it took a directory it made (a check that needs the loaded
            # teacher) leaves no workdir behind: nothing but the lock file is in it yet.
            if exc and exc[0] is not None and self.created and [p.name for p in self.workdir.iterdir()] == [LOCK_FILE]:
                (self.workdir / LOCK_FILE).unlink(missing_ok=True)
                self.workdir.rmdir()


def check_writable(workdir: pathlib.Path) -> None:
    """Everything a run may change must be writable before it starts: the metrics file
    (appended to) and every directory below the workdir (old steps are deleted past
    keep_checkpoints, half-written ones cleaned up). A probe file is created and removed
    rather than trusting permission bits, which root ignores and a read-only mount or
    an immutable flag overrides."""
    metrics = workdir / METRICS_FILE
    try:
        if metrics.exists():
            open(metrics, "a").close()
    except OSError as e:
        raise UsageError(f"cannot append to {metrics} ({e.strerror}): make it writable or pass another "
                         f"workdir") from None
    for here, dirs, _ in os.walk(workdir):
        for name in dirs:
            path = pathlib.Path(here, name)
            try:
                with tempfile.TemporaryFile(dir=path):
                    pass
            except OSError as e:
                raise UsageError(f"{path} is read-only ({e.strerror}): training in workdir {workdir} may delete "
                                 f"or update it (steps older than the newest keep_checkpoints are deleted); make it "
                                 f"writable, or pass another workdir") from None
