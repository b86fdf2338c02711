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


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes minutes; run with `pytest -m slow`")


@pytest.fixture(scope="session")
def tiny():
    from specjax.config import load_config
    return load_config("tiny")
