"""kv-head duplication (Megatron/vLLM): a GQA model with 2 kv heads on a 1x8 mesh stores
each kv head 4 times, one per 'model' device, instead of replicating all of them on
every device. The reference is the same model unsharded on one device (its kv heads
as they are): greedy tokens and logits must equal it, whichever way the weights arrive
(random init, an orbax checkpoint, a Hugging Face directory), and each device must hold
1/8 of the duplicated kv weights and cache. Export and save write the original 2 heads."""
import dataclasses
import json

import jax
import numpy as np
import pytest

import specjax
from specjax import kv_cache, kv_heads, sharding
from specjax.config import ModelConfig, SamplingConfig
from specjax.model import full_forward, init_lm
from specjax.weights import checkpoint, hf

from conftest import mesh_for

CFG = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=8, d_ff=64,
                  max_seq_len=64, ffw="swiglu", pos_encoding="rope", embed_scale=1.0,
                  norm_weight_after_cast=True).validate()
PROMPTS = [[3, 17, 5, 9], [60, 2, 2, 8, 41, 7, 1]]
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=10)


def logits(lm, mesh):
    tokens = np.array([[3, 17, 5, 9, 60, 2, 2, 8]], np.int32)
    with jax.set_mesh(mesh):
        return np.asarray(jax.jit(full_forward)(lm, jax.device_put(tokens, sharding.replicated(mesh))))


@pytest.fixture(scope="module")
def reference():
    mesh = mesh_for("1x1")
    lm = init_lm(CFG, mesh)
    return lm, logits(lm, mesh), specjax.generate(lm, None, PROMPTS, GREEDY).tokens


@pytest.fixture(scope="module")
def sharded():
    return init_lm(CFG, mesh_for("1x8"))


def kv_params(lm) -> list[jax.Array]:
    return [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(lm.params)[0]
            if any(getattr(k, "key", None) in ("wk", "wv") for k in path)]


def test_each_device_holds_one_eighth_of_the_duplicated_kv_weights_and_cache(sharded, reference):
    assert (sharded.cfg.num_kv_heads, sharded.cfg.kv_copies) == (8, 4)
    original = reference[0]
    for dup, orig in zip(kv_params(sharded), kv_params(original)):
        assert dup.shape[-3] == 8 and orig.shape[-3] == 2  # heads-major [G, D, H]
        assert sharding.shard_fraction(dup) == 1 / 8, dup.sharding
        # Copies are consecutive: stored head j is original head j // 4 (query head n, reading
        # stored head n // 1, still reads original head n // 4).
        np.testing.assert_array_equal(np.asarray(dup), np.repeat(np.asarray(orig), 4, axis=-3))
    cache = kv_cache.init_cache(sharded.cfg, 2, 32, mesh_for("1x8"))
    for buffer in (cache.k, cache.v):
        assert buffer.shape[2] == 8
        assert buffer.addressable_shards[0].data.nbytes * 8 == buffer.nbytes


def test_greedy_tokens_and_logits_equal_the_unsharded_model(sharded, reference):
    _, ref_logits, ref_tokens = reference
    np.testing.assert_allclose(logits(sharded, mesh_for("1x8")), ref_logits, rtol=0, atol=2e-5)
    assert specjax.generate(sharded, None, PROMPTS, GREEDY).tokens == ref_tokens


def test_a_checkpoint_holds_the_original_heads_and_restores_duplicated(sharded, reference, tmp_path):
    checkpoint.save_lm(sharded, tmp_path / "ckpt", config_name="gqa")
    meta = checkpoint.Checkpoints(tmp_path / "ckpt", read_only=True).meta(0)
    assert (meta["model"]["num_kv_heads"], meta["model"]["kv_copies"]) == (2, 1)
    restored = checkpoint.load_lm(CFG, mesh_for("1x8"), tmp_path / "ckpt")
    assert restored.cfg.kv_copies == 4
    for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(sharded.params)):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    one = checkpoint.load_lm(CFG, mesh_for("1x1"), tmp_path / "ckpt")  # and unduplicated on one device
    assert one.cfg.kv_copies == 1
    np.testing.assert_array_equal(logits(one, mesh_for("1x1")), reference[1])


def test_export_writes_the_original_heads_and_import_duplicates_them(sharded, reference, tmp_path):
    hf.export(sharded, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["num_key_value_heads"] == 2
    from safetensors import safe_open
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="numpy") as f:
        assert f.get_tensor("model.layers.0.self_attn.k_proj.weight").shape == (2 * 8, 32)
    lm, _ = hf.load(tmp_path / "hf", mesh_for("1x8"))
    assert lm.cfg.kv_copies == 4 and sharding.shard_fraction(kv_params(lm)[0]) == 1 / 8
    np.testing.assert_allclose(logits(lm, mesh_for("1x8")), reference[1], rtol=0, atol=2e-5)
    assert specjax.generate(lm, None, PROMPTS, GREEDY).tokens == reference[2]


def test_a_model_axis_the_kv_heads_do_not_divide_keeps_them_as_they_are():
    assert kv_heads.copies(CFG, 2) == 1 and kv_heads.copies(CFG, 8) == 4
    assert kv_heads.copies(dataclasses.replace(CFG, num_kv_heads=4, num_heads=12), 6) == 1  # 6 % 4: replicated
    assert kv_heads.for_mesh(CFG, mesh_for("2x4")).num_kv_heads == 4  # 'model' axis 4: two copies
