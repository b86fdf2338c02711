"""8 fake CPU devices for every test, set before JAX initialises (meshes 1x8 and 2x4)."""
import collections
import json
import os
import pathlib

# Compiling, not running, is what most tests spend their time on (the programs are tiny).
# LLVM optimisation level 0 compiles them in about two thirds of the time; XLA:CPU's older
# elemental emitters instead of its MLIR fusion emitters (whose pipeline runs at every
# level) halve what is left, on one core instead of two, and the code runs as fast at
# these sizes (benchmarks/kernels.md, "Suite time"). The Theorem-1 runs, 50,000 rows
# each, compile their programs at the default level (`theorem1.optimised`); the CLI runs
# set the same flags (`clitools.cli_env`).
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8 " + TEST_XLA_FLAGS).strip()
# No untimed warm-up run before each compiled program's first batch (see
# specjax.decode.program.WARM_UP): no test reads a first batch's timing except those that
# test the warm-up, which turn it back on. The CLI runs of the tests inherit it.
os.environ.setdefault("SPECJAX_WARMUP", "0")
# The suite runs on CPU devices. Where libtpu is installed (the `tpu` extra, as in CI) and
# no platform is named, JAX tries a TPU backend first, and on a host without TPUs libtpu
# prints a page of start-up complaints to stderr (the CLI runs inherit this; those that
# compile for a TPU slice load libtpu themselves: `analysis.tpu`).
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import sys  # noqa: E402

# The tests live in folders that mirror the package (model/, decode/, weights/, training/,
# cli/); what they share is in helpers/ and is imported by module name (`from theorem1 import ...`).
sys.path.insert(0, str(pathlib.Path(__file__).parent / "helpers"))

import jax  # noqa: E402
import pytest  # noqa: E402

from specjax.config import MeshConfig  # noqa: E402
from specjax.sharding import make_mesh  # noqa: E402

MESHES = {"1x1": MeshConfig(1, 1), "1x8": MeshConfig(1, 8), "2x4": MeshConfig(2, 4)}


def mesh_for(name: str):
    cfg = MESHES[name]
    return make_mesh(cfg, jax.devices()[: cfg.data * cfg.model])


# Longest files first. `--dist loadfile` hands whole files to the two workers in collection
# order; alphabetical order put the longest ones last, leaving one worker idle for minutes
# at the end. (`--dist worksteal` balances by itself but splits files, so the module-scoped
# compiled programs and large batches of the statistical tests get built on both workers;
# on 2 cores it ran slower.) The order comes from FILE_SECONDS, the seconds each file took
# in the default suite ("default") and in the slow set ("slow"), which a passing run of the
# whole of either rewrites for its set when they have drifted (`drifted`) if
# SPECJAX_RECORD_FILE_SECONDS=1 is set (commit it then), so it follows the suite instead of
# a hand-kept list; a plain run leaves the tracked file alone. Files it does not know yet
# run first.
FILE_SECONDS = pathlib.Path(__file__).with_name("file_seconds.json")
_seconds: dict[str, float] = collections.defaultdict(float)
SETS = {"not slow": "default", "slow": "slow"}  # -m expression -> the set's key in FILE_SECONDS


def pytest_collection_modifyitems(config, items):
    sets = recorded()  # a set not recorded yet goes by the default suite's table
    known = sets.get(SETS.get(config.getoption("markexpr"), "default")) or sets.get("default", {})
    # Stable sort: a file's own order is kept.
    items.sort(key=lambda item: -known.get(item.path.name, float("inf")))


def recorded() -> dict:
    return json.loads(FILE_SECONDS.read_text()) if FILE_SECONDS.exists() else {}


def pytest_runtest_logreport(report):
    _seconds[pathlib.Path(report.fspath).name] += report.duration


def pytest_sessionfinish(session, exitstatus):
    """Record the per-file seconds after a passing run of the whole default suite or slow
    set, in the main process (under xdist the workers' reports reach it too), when asked to."""
    config = session.config
    if os.environ.get("SPECJAX_RECORD_FILE_SECONDS") != "1":
        return
    which = SETS.get(config.getoption("markexpr"))
    whole = (which and not config.getoption("keyword")
             and [pathlib.Path(a).resolve() for a in config.args] == [pathlib.Path(__file__).parent])
    if exitstatus == 0 and whole and not hasattr(config, "workerinput") and _seconds:
        sets = recorded()
        if drifted(sets.get(which, {}), _seconds):
            sets[which] = dict(sorted(((name, round(t)) for name, t in _seconds.items()), key=lambda kv: -kv[1]))
            FILE_SECONDS.write_text(json.dumps(sets, indent=1) + "\n")


def drifted(known: dict, measured: dict) -> bool:
    """Worth rewriting: files came or went, or one took a third more or less time (and 10 s)
    than recorded. Run-to-run noise reorders files of similar length; that alone is no
    reason to touch a committed file."""
    if set(known) != set(measured):
        return True
    return any(abs(measured[f] - known[f]) > max(10.0, known[f] / 3) for f in known)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes minutes; run with `pytest -m slow`")


@pytest.fixture(scope="session")
def tiny():
    from specjax.config import load_config
    return load_config("tiny")


@pytest.fixture
def patch(monkeypatch):
    """patch([(module, name, value), ...]): swap functions the loop calls while it is traced
    (`theorem1.swapper`); undone, with compiled programs dropped, after the test."""
    from theorem1 import swapper, undo
    swap = swapper(monkeypatch)
    yield swap
    undo(monkeypatch)
