"""The export-directory rule: an export goes into a directory that does not exist or is
empty, appears there whole or not at all, and never mixes with or deletes what a
directory already holds (a single-file export beside an older sharded one used to load
the OLD weights, since the loader prefers the index). Both layouts; a kill -9 in the
middle of an export; re-exporting after it."""
from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from specjax import model
from specjax.config import UsageError, load_config
from specjax.weights import hf
from conftest import mesh_for

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHARDED = 20_000  # max_shard_bytes that splits tiny's swiglu target into several files


@pytest.fixture(scope="module")
def models():
    cfg = dataclasses.replace(load_config("tiny").target, ffw="swiglu", embed_scale=1.0)
    mesh = mesh_for("1x1")
    return model.init_lm(cfg, mesh, seed=1), model.init_lm(cfg, mesh, seed=2)


def params(lm) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(lm.params)]


def same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(params(a), params(b)))


def snapshot(directory) -> dict:
    return {p.name: p.read_bytes() for p in sorted(pathlib.Path(directory).iterdir())}


@pytest.mark.parametrize("first,second", [(SHARDED, None), (None, SHARDED), (None, None), (SHARDED, SHARDED)],
                         ids=["sharded-then-single", "single-then-sharded", "single-twice", "sharded-twice"])
def test_an_export_never_lands_in_a_directory_that_holds_one(models, tmp_path, first, second):
    old, new = models
    out = tmp_path / "export"
    hf.export(old, out, **({"max_shard_bytes": first} if first else {}))
    before = snapshot(out)
    with pytest.raises(UsageError, match="not empty.*remove it first, or give a new or empty directory"):
        hf.export(new, out, **({"max_shard_bytes": second} if second else {}))
    assert snapshot(out) == before  # nothing written, nothing deleted
    again, _ = hf.load(out, mesh_for("1x1"))
    assert same(again, old)
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # no staging left behind


def test_an_existing_empty_directory_receives_the_export(models, tmp_path):
    _, new = models
    (tmp_path / "empty").mkdir()
    hf.export(new, tmp_path / "empty", max_shard_bytes=SHARDED)
    again, _ = hf.load(tmp_path / "empty", mesh_for("1x1"))
    assert same(again, new) and [p.name for p in tmp_path.iterdir()] == ["empty"]


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_quantized_model_is_refused_before_anything_is_written(models, tmp_path, kind):
    """Hugging Face Llama safetensors hold float weights: a quantized model is refused in
    one line, naming what to export instead, and the directory is not made."""
    with pytest.raises(UsageError, match="quantized .* weights .* export the float model"):
        hf.export(models[0].quantized(kind), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where,fragment", [("file", "is a file"), ("under a file", "is a file, not a directory"),
                                            ("empty", "empty path")])
def test_an_export_path_that_cannot_be_a_directory_is_refused_before_any_work(tmp_path, where, fragment):
    (tmp_path / "f").write_text("x")
    path = {"file": tmp_path / "f", "under a file": tmp_path / "f" / "out", "empty": ""}[where]
    with pytest.raises(UsageError, match=fragment):
        hf.check_export_dir(path, "--export_hf")


KILL_AFTER_FIRST_SHARD = """
import dataclasses, os, signal, sys
from specjax import model, sharding
from specjax.config import MeshConfig, load_config
from specjax.weights import hf, safetensors_io
import jax
cfg = dataclasses.replace(load_config("tiny").target, ffw="swiglu", embed_scale=1.0)
lm = model.init_lm(cfg, sharding.make_mesh(MeshConfig(1, 1), jax.devices()[:1]), seed=1)
write = safetensors_io.write
def write_then_die(*args, **kwargs):
    written = write(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)  # kill -9, half way through the shards
safetensors_io.write = write_then_die
hf.export(lm, sys.argv[1], max_shard_bytes=int(sys.argv[2]))
"""


@pytest.mark.parametrize("existing", [False, True], ids=["new directory", "empty directory"])
def test_kill_9_mid_export_leaves_no_half_model_and_the_next_export_succeeds(models, tmp_path, existing):
    out = tmp_path / "export"
    if existing:
        out.mkdir()
    proc = subprocess.run([sys.executable, "-c", KILL_AFTER_FIRST_SHARD, str(out), str(SHARDED)], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert (not out.exists()) or list(out.iterdir()) == []  # nothing under the export's name
    left = [p.name for p in tmp_path.iterdir() if p.name != "export"]
    assert len(left) == 1 and left[0].startswith(".export.export-") and left[0].endswith(".partial"), left
    _, new = models
    hf.export(new, out, max_shard_bytes=SHARDED)  # the same export again
    again, _ = hf.load(out, mesh_for("1x1"))
    assert same(again, new)
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # the killed export's leftovers are gone
