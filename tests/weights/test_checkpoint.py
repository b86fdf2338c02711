"""Checkpoints restore onto any mesh, and every bad checkpoint is a clear UsageError
that leaves the good steps alone.

Params are random numpy arrays placed with the model's shardings (no init compile);
the reference for "identical" is that numpy copy, never the code under test.
"""
import dataclasses
import hashlib
import json
import pathlib

import jax
import numpy as np
import pytest

from conftest import mesh_for
from models import numpy_params, random_lm
from specjax import sharding
from specjax.weights import checkpoint
from specjax.config import UsageError
from specjax.model import LM


def tree_digest(directory: pathlib.Path) -> dict:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("restore_on", ["2x4", "1x1"])
def test_saved_on_1x8_restores_on_other_meshes_identically(tiny, tmp_path, restore_on):
    lm = random_lm(tiny.target, mesh_for("1x8"))
    expected = numpy_params(lm.params)
    assert lm.params["layers"][0]["ffw"]["w_in"].value.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    checkpoint.save_lm(lm, tmp_path / "tiny", step=7, config_name="tiny")

    mesh = mesh_for(restore_on)
    restored = checkpoint.load_lm(tiny.target, mesh, tmp_path / "tiny")
    got = numpy_params(restored.params)
    assert got.keys() == expected.keys()
    for k in expected:
        np.testing.assert_array_equal(got[k], expected[k], err_msg=k)
    # ... and each param lands with the sharding the table gives on the new mesh.
    wanted = sharding.param_shardings(restored.params, mesh)
    for path, (array, sh) in zip(expected, zip(jax.tree.leaves(restored.params), jax.tree.leaves(wanted))):
        assert array.sharding.is_equivalent_to(sh, array.ndim), path
    if restore_on == "2x4":  # kv heads split 4 ways on 2x4 (replicated on 1x8)
        assert sharding.shard_fraction(restored.params["layers"][0]["attn"]["wk"].value) == 0.25


def test_restored_lm_computes_like_the_saved_one(tiny, tmp_path):
    """A restored model is a working model: same logits as before saving."""
    from specjax.kv_cache import empty

    lm = random_lm(tiny.target, mesh_for("1x8"), seed=3)
    checkpoint.save_lm(lm, tmp_path / "tiny", config_name="tiny")
    restored = checkpoint.load_lm(tiny.target, mesh_for("1x1"), tmp_path / "tiny")
    tokens = np.arange(12, dtype=np.int32).reshape(2, 6) % tiny.target.vocab_size
    positions = np.broadcast_to(np.arange(6, dtype=np.int32), (2, 6))

    def logits(model):
        with jax.set_mesh(model.params["embed"].value.sharding.mesh):
            return np.asarray(jax.jit(lambda m: m(tokens, positions, empty(m.cfg, 2, 6))[0])(model))

    # The saved model's own params moved to the restore mesh: the same program on the same
    # device, so the restored params must give the same logits bit for bit (on the 1x8
    # mesh the sums run in another order: float32 noise up to ~1e-4 relative at |logit| ~ 20).
    on_one = jax.device_put(lm.params, sharding.param_shardings(restored.params, mesh_for("1x1")))
    np.testing.assert_array_equal(logits(restored), logits(LM(lm.cfg, lm.graphdef, on_one)))


def test_missing_directory_says_how_to_train(tiny, tmp_path):
    with pytest.raises(UsageError, match=r"no checkpoint directory .*python -m specjax.train --config=tiny"):
        checkpoint.load_lm(tiny.target, mesh_for("1x1"), tmp_path / "tiny")


def test_directory_without_finished_step(tiny, tmp_path):
    (tmp_path / "tiny" / "5.orbax-checkpoint-tmp-123").mkdir(parents=True)  # a killed save
    with pytest.raises(UsageError, match=r"holds no finished checkpoint"):
        checkpoint.load_lm(tiny.target, mesh_for("1x1"), tmp_path / "tiny")


def test_unknown_step_lists_the_steps(tiny, tmp_path):
    lm = random_lm(tiny.target, mesh_for("1x1"))
    checkpoint.save_lm(lm, tmp_path / "tiny", step=4, config_name="tiny")
    with pytest.raises(UsageError, match=r"no checkpoint for step 9; it has steps \[4\]"):
        checkpoint.load_lm(tiny.target, mesh_for("1x1"), tmp_path / "tiny", step=9)


def test_other_config_names_the_differing_fields(tiny, tmp_path):
    lm = random_lm(tiny.target, mesh_for("1x1"))
    expected = numpy_params(lm.params)
    checkpoint.save_lm(lm, tmp_path / "tiny", step=1, config_name="tiny")
    before = tree_digest(tmp_path / "tiny")
    with pytest.raises(UsageError) as err:
        checkpoint.load_lm(tiny.draft, mesh_for("1x1"), tmp_path / "tiny", config_name="tiny_draft")
    message = str(err.value)
    assert "\n" not in message
    assert "trained with config 'tiny'" in message
    for field in ("d_model=32 (checkpoint) vs 16 (config)", "num_layers=2 (checkpoint) vs 1 (config)",
                  "d_ff=64 (checkpoint) vs 32 (config)"):
        assert field in message
    assert "vocab_size" not in message  # equal fields are not listed
    assert tree_digest(tmp_path / "tiny") == before
    np.testing.assert_array_equal(  # and the checkpoint still loads for its own config
        numpy_params(checkpoint.load_lm(tiny.target, mesh_for("1x1"), tmp_path / "tiny").params)["['embed']"],
        expected["['embed']"])


def test_runtime_fields_do_not_block_loading(tiny, tmp_path):
    lm = random_lm(tiny.target, mesh_for("1x1"))
    expected = numpy_params(lm.params)
    checkpoint.save_lm(lm, tmp_path / "tiny", config_name="tiny")
    cfg = dataclasses.replace(tiny.target, max_seq_len=64, init_seed=9, param_dtype="bfloat16")
    restored = checkpoint.load_lm(cfg, mesh_for("1x1"), tmp_path / "tiny")
    embed = restored.params["embed"].value
    assert embed.dtype == np.dtype("bfloat16")
    np.testing.assert_allclose(np.asarray(embed, np.float32), expected["['embed']"], rtol=1e-2)


def _rewrite_meta(step_dir: pathlib.Path, **model_fields):
    meta_file = step_dir / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta["model"].update(model_fields)
    meta_file.write_text(json.dumps(meta))


def test_wrong_shapes_are_named(tiny, tmp_path):
    """A step whose arrays do not match its recorded config (here: the record is edited
    to claim d_ff=128) fails on the shapes, naming the param and both shapes."""
    lm = random_lm(tiny.target, mesh_for("1x1"))
    checkpoint.save_lm(lm, tmp_path / "tiny", step=3, config_name="tiny")
    _rewrite_meta(tmp_path / "tiny" / "3", d_ff=128)
    cfg = dataclasses.replace(tiny.target, d_ff=128)
    with pytest.raises(UsageError, match=r"wrong shapes: layers/0/ffw/w_in: \(32, 64\) \(checkpoint\) vs "
                                         r"\(32, 128\) \(model\)"):
        checkpoint.load_lm(cfg, mesh_for("1x1"), tmp_path / "tiny")


def test_missing_params_are_named(tiny, tmp_path):
    lm = random_lm(tiny.target, mesh_for("1x1"))
    checkpoint.save_lm(lm, tmp_path / "tiny", step=3, config_name="tiny")
    _rewrite_meta(tmp_path / "tiny" / "3", num_layers=3)
    cfg = dataclasses.replace(tiny.target, num_layers=3)
    with pytest.raises(UsageError, match=r"other params than the model: missing \['layers/2/"):
        checkpoint.load_lm(cfg, mesh_for("1x1"), tmp_path / "tiny")


@pytest.mark.parametrize("damage", ["truncate_arrays", "delete_meta"])
def test_damaged_step_is_reported_and_earlier_step_survives(tiny, tmp_path, damage):
    directory = tmp_path / "tiny"
    good = random_lm(tiny.target, mesh_for("1x8"), seed=1)
    good_values = numpy_params(good.params)
    newer = random_lm(tiny.target, mesh_for("1x8"), seed=2)
    checkpoint.save_lm(good, directory, step=10, config_name="tiny")
    checkpoint.save_lm(newer, directory, step=20, config_name="tiny")
    before = tree_digest(directory / "10")
    if damage == "truncate_arrays":
        data_files = [p for p in (directory / "20" / "params").rglob("*") if p.is_file() and "d" == p.parent.name]
        assert data_files, sorted((directory / "20").rglob("*"))
        for p in data_files:
            p.write_bytes(p.read_bytes()[:7])
    else:
        (directory / "20" / "meta" / "metadata").unlink()

    with pytest.raises(UsageError) as err:
        checkpoint.load_lm(tiny.target, mesh_for("2x4"), directory)
    message = str(err.value)
    assert "\n" not in message
    assert f"checkpoint step 20 in {directory} is damaged or unreadable" in message
    assert "earlier steps [10] are untouched" in message

    assert tree_digest(directory / "10") == before
    restored = numpy_params(checkpoint.load_lm(tiny.target, mesh_for("2x4"), directory, step=10).params)
    for k in good_values:
        np.testing.assert_array_equal(restored[k], good_values[k])


def test_trainer_refuses_a_workdir_of_another_config(tiny, tmp_path):
    """Training into a directory that holds another model's checkpoint stops before
    writing anything (no new step, no deletion)."""
    from specjax.training import trainer
    from specjax.training.workdir import LOCK_FILE

    lm = random_lm(tiny.draft, mesh_for("1x1"))
    checkpoint.save_lm(lm, tmp_path / "w", step=5, config_name="tiny_draft")
    before = tree_digest(tmp_path / "w")
    config = dataclasses.replace(tiny, train=dataclasses.replace(tiny.train, steps=10, warmup_steps=2))
    with pytest.raises(UsageError, match=r"trained with config 'tiny_draft', whose model differs from tiny's: "
                                         r"d_ff=32 \(checkpoint\) vs 64 \(config\)"):
        trainer.train(config, tmp_path / "w", progress=False, devices=jax.devices()[:1])
    after = tree_digest(tmp_path / "w")
    assert after.pop(LOCK_FILE)  # the run's lock (its pid), nothing of the checkpoints
    assert after == before


def test_tokenizer_file_travels_with_the_checkpoints(tmp_path):
    assert checkpoint.tokenizer_path(tmp_path) is None
    source = tmp_path / "src.model"
    source.write_bytes(b"sentencepiece bytes")
    copied = checkpoint.save_tokenizer(tmp_path / "ckpt", source)
    assert copied == tmp_path / "ckpt" / "tokenizer.model"
    assert checkpoint.tokenizer_path(tmp_path / "ckpt") == copied
    assert copied.read_bytes() == b"sentencepiece bytes"


def test_default_dir_follows_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    assert checkpoint.default_dir("mini_target") == tmp_path / "checkpoints" / "mini_target"


def test_a_file_is_not_a_checkpoint_directory(tiny, tmp_path):
    from specjax.app.locate import Weights

    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(UsageError, match=r"weights.bin is a file, not a checkpoint directory"):
        checkpoint.load_lm(tiny.target, mesh_for("1x1"), tmp_path / "weights.bin")
    with pytest.raises(UsageError, match=r"--checkpoint='.*weights.bin' is a file, not a checkpoint directory"):
        Weights.locate(tiny, "checkpoint", str(tmp_path / "weights.bin"), None, need_draft=False, train_missing=False)


@pytest.mark.parametrize("restore_on", ["1x8", "1x1"])
def test_a_format_1_step_restores_heads_major(tiny, tmp_path, monkeypatch, restore_on):
    """A step written before q, k and v were heads-major (format 1: [..., D, N, H]; every
    drafter trained before) restores into today's [..., N, D, H], its optimiser state too,
    on one device and with duplicated kv heads (1x8: tiny's 4 kv heads twice)."""
    lm = random_lm(tiny.target, mesh_for("1x1"), seed=5)
    expected = numpy_params(lm.params)
    old_layout = lambda path, x: (x.swapaxes(-3, -2) if any(f"['{n}']" in jax.tree_util.keystr(path)  # noqa: E731
                                                            for n in ("wq", "wk", "wv")) else x)
    old = jax.tree_util.tree_map_with_path(old_layout, lm.params)
    assert old["layers"][0]["attn"]["wq"].value.shape[-3:] == (tiny.target.d_model, tiny.target.num_heads,
                                                              tiny.target.head_dim)
    monkeypatch.setattr(checkpoint, "FORMAT", 1)
    with checkpoint.Checkpoints(tmp_path / "old", async_save=False) as ckpt:
        ckpt.save(0, old, checkpoint.model_meta(tiny.target, "tiny"), opt_state={"mu": old})
        ckpt.wait()
    monkeypatch.undo()
    assert checkpoint.Checkpoints(tmp_path / "old", read_only=True).format(0) == 1

    mesh = mesh_for(restore_on)
    restored = checkpoint.load_lm(tiny.target, mesh, tmp_path / "old")
    assert restored.cfg.kv_copies == (2 if restore_on == "1x8" else 1)
    got = numpy_params(checkpoint.kv_heads.undo(restored).params)
    for k in expected:
        np.testing.assert_array_equal(got[k], expected[k], err_msg=k)
    abstract = checkpoint.abstract_params(tiny.target, mesh_for("1x1"))[1]
    with checkpoint.Checkpoints(tmp_path / "old", read_only=True) as ckpt:
        params, opt_state = ckpt.restore(0, abstract, {"mu": abstract})
    for tree in (params, opt_state["mu"]):
        got = numpy_params(tree)
        for k in expected:
            np.testing.assert_array_equal(got[k], expected[k], err_msg=k)


@pytest.mark.parametrize("fmt", [3, "2", None])
def test_a_step_of_an_unknown_format_is_refused_in_one_line(tiny, tmp_path, monkeypatch, fmt):
    lm = random_lm(tiny.target, mesh_for("1x1"))
    monkeypatch.setattr(checkpoint, "FORMAT", fmt)
    checkpoint.save_lm(lm, tmp_path / "new", config_name="tiny")
    monkeypatch.undo()
    with pytest.raises(UsageError, match=rf"has format {fmt!r}; this specjax reads formats 1 to 2"):
        checkpoint.load_lm(tiny.target, mesh_for("1x1"), tmp_path / "new")
