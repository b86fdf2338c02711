"""What the CLI tests share: the environment of a CLI run, the tiny text config, an
interruptible command line, and many short runs forked from one process."""
from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]


def assert_one_line(proc, code: int, fragments, program: str | None = None) -> str:
    """A refused run: exit `code`, exactly one line on stderr and no traceback, the line
    holding every fragment (and starting `PROGRAM.py: error: ` where `program` is given);
    returns the line."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == code, (proc.returncode, proc.stderr[-3000:])
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    if program is not None:
        assert lines[0].startswith((f"{program}.py: error: ", "__main__.py: error: ")), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def xla_flags(devices: int = 1) -> str:
    """XLA_FLAGS of a CLI run on `devices` CPU devices: the suite's compile-time flags
    (conftest.TEST_XLA_FLAGS; the programs are tiny, compiling dominates these runs); the
    runs they compare with compile with the same flags."""
    from conftest import TEST_XLA_FLAGS
    return f"--xla_force_host_platform_device_count={devices} {TEST_XLA_FLAGS}"


def cli_env(base: pathlib.Path, devices: int = 1) -> dict:
    """The environment of a CLI run: `devices` CPU devices (1 compiles fastest), a
    compilation cache in `base` shared by the runs of one file (the same programs are
    compiled once), a specjax cache with no checkpoint (no default checkpoint exists) but
    the CPU kernels (`kernels_only_cache`), this checkout first on the path, and a pinned
    terminal width (xdist workers have none)."""
    return {**os.environ, "XLA_FLAGS": xla_flags(devices), "JAX_PLATFORMS": "cpu",
            "JAX_COMPILATION_CACHE_DIR": str(base / "jax_cache"), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
            "SPECJAX_CACHE": str(kernels_only_cache(base / "empty_cache")), "PYTHONPATH": str(ROOT), "COLUMNS": "160"}


def kernels_only_cache(path: pathlib.Path) -> pathlib.Path:
    """`path` made a specjax cache that holds nothing but this machine's compiled CPU
    kernels, copied from the test process's own cache (built there once): a run given a
    fresh cache would compile them again, some 15 s of g++ per run. No checkpoints, no
    datasets. Without a compiler, just the empty directory (the runs fall back as the
    library does)."""
    from specjax.kernels import library
    path.mkdir(parents=True, exist_ok=True)
    try:
        built = library.build()
    except Exception:  # noqa: BLE001 -- no kernels here either: nothing to copy
        return path
    (path / "kernels" / built.parent.name).mkdir(parents=True, exist_ok=True)
    shutil.copy2(built, path / "kernels" / built.parent.name / built.name)
    return path

# tiny with a 512-token vocabulary, for runs that need a tokenizer (saved next to it).
TEXT_CONFIG = '''
import dataclasses
from specjax.config import load_config


def get_config():
    """tiny with a 512-token vocabulary and a tokenizer."""
    tiny = load_config("tiny")
    return dataclasses.replace(tiny, name="tiny_text", tokenizer_vocab=512,
                               target=dataclasses.replace(tiny.target, vocab_size=512),
                               draft=dataclasses.replace(tiny.draft, vocab_size=512))
'''


def interruptible(module: str, *args: str) -> list[str]:
    """`python -m module args`, with Python's Ctrl-C handler installed even if this test
    process inherited SIGINT as ignored (a job started with `&` from a non-interactive
    shell): Python then leaves it ignored in its children too, and a Ctrl-C test would
    wait for a signal that never lands."""
    code = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")
    return [sys.executable, "-c", code, *args]


# One Python process imports the entry point and its libraries once, then forks a child per
# command line; each child runs the module as `python -m` would (runpy, as __main__, with its
# argv and environment) and exits with the program's own exit code. The children are real
# processes running the real CLI; what is shared is only the ~4 s of CPU that importing
# Python, JAX and specjax costs per process, which the bad-input tables paid some 200 times.
# The parent never initialises a JAX backend, so each child starts its own from its own
# environment (XLA_FLAGS included).
_FORK_SERVER = r'''
import importlib, json, os, runpy, sys, tempfile, traceback
module, parallel = sys.argv[1], int(sys.argv[2])
importlib.import_module(module)
for name in ("specjax.app.locate", "specjax.decode.api", "specjax.model", "orbax.checkpoint"):
    try:
        importlib.import_module(name)
    except ImportError:
        pass
cases = json.load(sys.stdin)
results, running, scratch = [None] * len(cases), {}, tempfile.mkdtemp()


def read(path):
    with open(path, errors="replace") as f:
        return f.read()


def finish():
    pid, status = os.wait()
    i, out, err = running.pop(pid)
    results[i] = {"returncode": os.waitstatus_to_exitcode(status), "stdout": read(out), "stderr": read(err)}


for i, (args, env) in enumerate(cases):
    if len(running) >= parallel:
        finish()
    out, err = os.path.join(scratch, f"{i}.out"), os.path.join(scratch, f"{i}.err")
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(out, os.O_WRONLY | os.O_CREAT), 1)
        os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT), 2)
        os.environ.update(env)
        if "CLITOOLS_RLIMIT_AS" in env:  # a case that must not enumerate: a regression is a MemoryError
            import resource
            resource.setrlimit(resource.RLIMIT_AS, (int(env["CLITOOLS_RLIMIT_AS"]),) * 2)
        sys.argv = ["-m", *args]
        del sys.modules[module]  # imported above; runpy runs it afresh as __main__ (and warns if it is still there)
        code = 0
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    running[pid] = (i, out, err)
while running:
    finish()
json.dump(results, sys.stdout)
'''


def run_many(module: str, cases: list, *, env: dict, cwd=None, parallel: int = 2, timeout: float = 600) -> list:
    """`python -m module *args` for each (args, extra_env) in `cases`, as CompletedProcesses
    in the same order (see _FORK_SERVER). `CLITOOLS_RLIMIT_AS` in a case's extra_env caps
    that child's address space (bytes)."""
    import json
    import subprocess
    proc = subprocess.run([sys.executable, "-c", _FORK_SERVER, module, str(parallel)], cwd=cwd, env=env,
                          input=json.dumps([[list(a), dict(e)] for a, e in cases]), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [subprocess.CompletedProcess([sys.executable, "-m", module, *a], r["returncode"], r["stdout"], r["stderr"])
            for (a, _), r in zip(cases, json.loads(proc.stdout))]


@contextlib.contextmanager
def read_only(path):
    """`path` and everything below it unwritable for the runs this test starts: permission
    bits, or for root (whom they do not stop) the immutable flag; skipped where neither works."""
    def writable():
        try:
            with tempfile.TemporaryFile(dir=path):
                return True
        except OSError:
            return False

    subprocess.run(["chmod", "-R", "a-w", str(path)], check=True)
    undo = ["chmod", "-R", "u+w", str(path)]
    if writable():
        subprocess.run(undo, check=True)
        if subprocess.run(["chattr", "-R", "+i", str(path)], capture_output=True).returncode or writable():
            import pytest
            pytest.skip("cannot make a directory read-only here (root without chattr)")
        undo = ["chattr", "-R", "-i", str(path)]
    try:
        yield
    finally:
        subprocess.run(undo, check=True)


def python_limited(code: str, *, memory_bytes: int = 4 << 30, timeout: float = 300):
    """`python -c code` from the repository root with its address space capped at
    `memory_bytes` (set by the child before it runs `code`): a test of a size bound runs
    the code that must not enumerate there, so that a regression is a MemoryError in a
    child, not the host's OOM killer."""
    import subprocess
    capped = f"import resource\nresource.setrlimit(resource.RLIMIT_AS, ({memory_bytes}, {memory_bytes}))\n{code}"
    return subprocess.run([sys.executable, "-c", capped], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=timeout)
