"""8 fake CPU devices for every test, set before JAX initialises (meshes 1x8 and 2x4)."""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import pytest  # noqa: E402

from specjax.config import MeshConfig  # noqa: E402
from specjax.sharding import make_mesh  # noqa: E402

MESHES = {"1x1": MeshConfig(1, 1), "1x8": MeshConfig(1, 8), "2x4": MeshConfig(2, 4)}


def mesh_for(name: str):
    cfg = MESHES[name]
    return make_mesh(cfg, jax.devices()[: cfg.data * cfg.model])


# Longest files first. `--dist loadfile` hands whole files to the two workers in collection
# order, and alphabetical order put the two longest (test_speculative, test_train) last,
# leaving one worker idle for minutes at the end.
# `--dist worksteal` would balance by itself but splits files, so module-scoped fixtures
# (the compiled programs and large batches the statistical tests share) get built on both
# workers; on 2 cores it ran slower than loadfile with this order.
LONGEST_FIRST = ["test_speculative.py", "test_drafters.py", "test_sample_cli.py", "test_train.py", "test_tree.py",
                 "test_hf.py", "test_temperature.py", "test_loop.py", "test_tree_theorem1.py", "test_model.py",
                 "test_hf_cli.py", "test_evaluate.py", "test_colab.py"]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order is kept


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes minutes; run with `pytest -m slow`")


@pytest.fixture(scope="session")
def tiny():
    from specjax.config import load_config
    return load_config("tiny")
