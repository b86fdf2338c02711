"""Foundation: cached decode == full forward, sharded == unsharded, Megatron collectives,
params really sharded, every config instantiates abstractly at its intended size, and
bad configs fail with messages that name the value."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import kv_cache, model, sharding
from specjax.config import ConfigError, MeshConfig, SamplingConfig, load_config
from specjax.kernels import NONE
from conftest import mesh_for
from models import loop_cache_copies

ATOL = 2e-5  # float32: observed max |diff| ~1e-6 on these logits (magnitude ~1-10)


def full_forward(lm, tokens):
    """Reference: one pass over whole sequences with a fresh cache, no incremental state."""
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    logits, _ = lm(tokens, positions, kv_cache.init_cache(lm.cfg, B, T))
    return np.asarray(logits)


# Every switch of the model families at once (weights/arch/): a sliding window shorter
# than the sequence on every other layer, with its own rotary base.
SWITCHES = dict(qkv_bias=True, qk_norm=True, post_norms=True, norm_offset=1.0, ffw="geglu", attention_pattern="LG",
                sliding_window=4, local_rope_theta=100.0, query_scale=0.3, embed_scale=3.0)


@pytest.mark.parametrize("pos_encoding,scan_layers", [
    ("rope", False), ("relative", True), ("switches", False), ("switches", True),
    pytest.param("rope", True, marks=pytest.mark.slow), pytest.param("relative", False, marks=pytest.mark.slow)])
def test_cached_decode_equals_full_forward_ragged(tiny, pos_encoding, scan_layers):
    """Prefill and one-token steps (the attention kernel, on one CPU device) against one
    pass over the whole sequence (XLA's attention: 20 queries)."""
    changes = SWITCHES if pos_encoding == "switches" else dict(pos_encoding=pos_encoding)
    cfg = dataclasses.replace(tiny.target, scan_layers=scan_layers, **changes)
    lm = model.init_lm(cfg, mesh_for("1x1"))
    B, T = 3, 20
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, cfg.vocab_size)
    ref = full_forward(lm, tokens)
    prompt_lens = np.array([3, 9, 14])
    # Prefill ragged prompts (right-padded with junk that must be masked), then decode one
    # token per step at each row's own position.
    width = prompt_lens.max()
    padded = np.where(np.arange(width)[None] < prompt_lens[:, None], np.asarray(tokens[:, :width]), 7)
    positions = np.broadcast_to(np.arange(width), (B, width))
    step = jax.jit(lambda lm, t, p, c: lm.extend(t, p, c))
    logits, cache = step(lm, jnp.asarray(padded), jnp.asarray(positions), kv_cache.init_cache(cfg, B, T + 4))
    for b in range(B):
        np.testing.assert_allclose(np.asarray(logits)[b, :prompt_lens[b]], ref[b, :prompt_lens[b]], atol=ATOL)
    cache = cache.with_lengths(jnp.asarray(prompt_lens))
    pos = prompt_lens.copy()
    while pos.min() < T:
        p = np.minimum(pos, T - 1)
        logits, cache = step(lm, tokens[np.arange(B), p][:, None], jnp.asarray(p)[:, None], cache)
        for b in range(B):
            if pos[b] < T:
                np.testing.assert_allclose(np.asarray(logits)[b, 0], ref[b, pos[b]], atol=ATOL)
        pos += 1


def test_scoring_k_plus_1_equals_single_steps(tiny):
    lm = model.init_lm(tiny.target, mesh_for("1x1"))
    B, P, K = 2, 6, 4
    tokens = jax.random.randint(jax.random.key(2), (B, P + K + 1), 0, 32)
    step = jax.jit(lambda lm, t, p, c: lm.extend(t, p, c))
    pos = jnp.broadcast_to(jnp.arange(P + K + 1), tokens.shape)
    _, cache = step(lm, tokens[:, :P], pos[:, :P], kv_cache.init_cache(lm.cfg, B, 16))
    scored, _ = step(lm, tokens[:, P:], pos[:, P:], cache)
    singles = []
    for t in range(P, P + K + 1):
        logits, cache = step(lm, tokens[:, t:t + 1], pos[:, t:t + 1], cache)
        singles.append(np.asarray(logits[:, 0]))
    np.testing.assert_allclose(np.asarray(scored), np.stack(singles, 1), atol=ATOL)


@pytest.mark.parametrize("changes", [{}, SWITCHES], ids=["plain", "switches"])
def test_scan_and_unrolled_layers_are_the_same_model(tiny, changes):
    """Under scan a layer's window and rotary base are picked by its traced index."""
    tokens = jax.random.randint(jax.random.key(3), (2, 10), 0, 32)
    cfg = dataclasses.replace(tiny.target, **changes)
    a = full_forward(model.init_lm(cfg, mesh_for("1x1")), tokens)
    b = full_forward(model.init_lm(dataclasses.replace(cfg, scan_layers=True), mesh_for("1x1")), tokens)
    np.testing.assert_allclose(a, b, atol=ATOL)


# 1x8 is in the slow set (~60 s): the default run keeps 2x4 (both axes sharded), and
# 1x8 tokens are still checked by test_loop's greedy SpS == ArS and same-seed-across-meshes tests.
@pytest.mark.parametrize("mesh_name", [pytest.param("1x8", marks=pytest.mark.slow), "2x4"])
def test_sharded_logits_and_greedy_tokens_match_one_device(tiny, mesh_name):
    tokens = jax.random.randint(jax.random.key(4), (4, 12), 0, 32)
    one = model.init_lm(tiny.target, mesh_for("1x1"))
    many = model.init_lm(tiny.target, mesh_for(mesh_name))
    np.testing.assert_allclose(full_forward(one, tokens), full_forward(many, tokens), atol=ATOL)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10], [11, 12]]
    greedy = SamplingConfig(temperature=0, max_new_tokens=64)
    a = specjax.generate(one, None, prompts, greedy)
    b = specjax.generate(many, None, prompts, greedy)
    assert all(len(t) == 64 for t in a.tokens)
    assert a.tokens == b.tokens


def count_collectives(hlo_text: str, op: str) -> int:
    return len(re.findall(rf"\b{op}(?:-start)?\(", hlo_text))


def test_decode_step_has_two_all_reduces_per_layer_and_params_are_sharded(tiny):
    cfg = dataclasses.replace(tiny.target, num_layers=3)  # 3 layers: the count must scale with L
    mesh = mesh_for("1x8")
    lm = model.init_lm(cfg, mesh)
    big = {"embed": lm.params["embed"].value, "unembed": lm.params["unembed"].value,
           "wq": lm.params["layers"][0]["attn"]["wq"].value,
           "w_in": lm.params["layers"][0]["ffw"]["w_in"].value,
           "w_out": lm.params["layers"][0]["ffw"]["w_out"].value}
    for name, value in big.items():
        assert sharding.shard_fraction(value) == pytest.approx(1 / 8), name
    cache = kv_cache.init_cache(lm.cfg, 1, 32, mesh)  # the loaded model's config (kv heads duplicated)
    with jax.set_mesh(mesh):
        compiled = jax.jit(lambda lm, t, p, c: lm(t, p, c)).lower(
            lm, jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32), cache).compile()
    text = compiled.as_text()
    # 2 per layer (attention out, ffw out) + 1 for the vocab-parallel embedding lookup;
    # logits stay vocab-sharded (no all-gather in a bare forward).
    assert count_collectives(text, "all-reduce") == 2 * cfg.num_layers + 1
    assert count_collectives(text, "all-gather") == 0


@pytest.mark.parametrize("mesh_name,T", [("2x4", 1), ("2x4", 5), ("1x1", 5)])
def test_a_forward_multiplies_by_q_k_v_as_stored(tiny, mesh_name, T):
    """q, k, v are heads-major [N, D, H]; XLA (no CPU kernel here) multiplies by each head's
    [D, H] as stored. An einsum over them made XLA:CPU copy each weight into [D, N, H] order
    in every forward (a transpose of a weight-sized array)."""
    cfg = dataclasses.replace(tiny.target, d_model=48, head_dim=16, num_kv_heads=8)
    mesh = mesh_for(mesh_name)
    lm = model.init_lm(cfg, mesh).with_kernels(NONE)
    cache = kv_cache.init_cache(lm.cfg, 1, 32, mesh)
    with jax.set_mesh(mesh):
        text = jax.jit(lambda lm, t, p, c: lm(t, p, c)).lower(
            lm, jnp.zeros((1, T), jnp.int32), jnp.zeros((1, T), jnp.int32), cache).compile().as_text()
    heads = cfg.num_heads // mesh.shape["model"]
    weight = sorted((heads, cfg.d_model, cfg.head_dim))
    moved = [line.strip()[:120] for line in text.splitlines()
             if re.search(r"= f32\[([\d,]+)\]\S* (transpose|copy)\(", line)
             and sorted(int(d) for d in re.search(r"f32\[([\d,]+)\]", line).group(1).split(",") if d != "1")
             == [d for d in weight if d != 1]]
    assert not moved, moved


INTENDED = {  # config -> (target range, draft range), in params
    "tiny": ((1e4, 5e4), (1e3, 1e4)),
    "mini_target": ((20e6, 40e6), None),
    "mini_draft": ((1e6, 3e6), None),
    "mini": ((20e6, 40e6), (1e6, 3e6)),
    "chinchilla_70b": ((64e9, 71e9), (3.5e9, 4.5e9)),
    "draft_4b": ((3.5e9, 4.5e9), None),
    "llama3_70b_1b": ((70.4e9, 70.7e9), (1.2e9, 1.3e9)),  # Meta's counts: 70.55B and 1.24B
}


@pytest.mark.parametrize("name", sorted(INTENDED))
def test_every_config_instantiates_abstractly_at_its_intended_size(name):
    config = load_config(name)
    for model_cfg, bounds in ((config.target, INTENDED[name][0]), (config.draft, INTENDED[name][1])):
        if model_cfg is None:
            assert bounds is None
            continue
        lm = model.abstract_lm(model_cfg)  # ShapeDtypeStructs only: nothing allocated
        counted = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(lm.params))
        print(f"{name}: {counted / 1e6:,.1f}M params")
        assert bounds[0] <= counted <= bounds[1]
        assert counted == pytest.approx(model_cfg.num_params, rel=0.05)  # the closed form agrees


@pytest.mark.parametrize("name", ["chinchilla_70b", "draft_4b", "llama3_70b_1b"])
def test_paper_configs_divide_sixteen_chips(name):
    config = load_config(name)
    mesh = jax.sharding.AbstractMesh((1, 16), ("data", "model"))
    for model_cfg in (config.target, config.draft):
        if model_cfg is not None:
            sharding.check_divisible(model_cfg, mesh)


BAD = [
    (lambda: load_config("no_such_config"), "no_such_config"),
    (lambda: load_config("tiny", ["target.num_layerz=3"]), "num_layerz"),
    (lambda: load_config("tiny", ["target.num_layers=-2"]), "num_layers=-2"),
    (lambda: load_config("tiny", ["target.d_model=abc"]), "'abc'"),
    (lambda: load_config("tiny", ["sampling.top_p=1.5"]), "top_p=1.5"),
    (lambda: load_config("tiny", ["target.num_heads=6"]), "num_heads=6"),
    (lambda: sharding.check_divisible(dataclasses.replace(load_config("tiny").target, num_heads=12,
                                                          num_kv_heads=4), mesh_for("1x8")), "num_heads=12"),
    (lambda: sharding.make_mesh(MeshConfig(2, 8)), "16 devices"),
]


@pytest.mark.parametrize("make,needle", BAD, ids=[b[1] for b in BAD])
def test_bad_configs_name_the_value(make, needle):
    with pytest.raises(ConfigError) as err:
        make()
    assert needle in str(err.value)


def test_random_init_program_does_not_grow_with_the_layer_count(tiny):
    """One Block's init under vmap over per-layer keys: 16 scanned layers compile to the
    program that 2 do (only the stacked shapes differ); 16 unrolled Block inits made
    about 8x as many instructions, and 80 of them a long TPU compile."""
    from specjax.analysis.compile import compile_init

    def instructions(layers):
        cfg = dataclasses.replace(tiny.target, num_layers=layers, scan_layers=True)
        return compile_init(cfg, mesh_for("1x8"))["hlo_instructions"]

    two, sixteen = instructions(2), instructions(16)
    print(f"random init, compiled HLO instructions: 2 layers {two}, 16 layers {sixteen}")
    assert sixteen <= 1.05 * two


def test_rope_table_lookup_equals_evaluating_sin_and_cos(tiny, monkeypatch):
    """The precomputed rotary tables against sin and cos evaluated on device (the path a
    long-context model takes), at every position, and through a whole forward."""
    cfg = tiny.target
    positions = jnp.arange(cfg.max_seq_len, dtype=jnp.int32).reshape(4, -1)
    lm = model.init_lm(cfg, mesh_for("1x1"))
    tokens = jax.random.randint(jax.random.key(1), (2, 40), 0, cfg.vocab_size)
    looked_up = model.rope_angles(cfg, positions), jax.jit(lambda lm, t: model.full_forward(lm, t))(lm, tokens)
    assert model.rope_tables(cfg) is not None
    monkeypatch.setattr(model, "ROPE_TABLE_LIMIT", 0)
    model.rope_tables.cache_clear()
    try:
        assert model.rope_tables(cfg) is None
        fresh = jax.jit(lambda lm, t: model.full_forward(lm, t))  # a fresh trace, under the new limit
        evaluated = model.rope_angles(cfg, positions), fresh(lm, tokens)
    finally:
        model.rope_tables.cache_clear()
    for a, b in zip(looked_up[0], evaluated[0]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=3e-6)
    np.testing.assert_allclose(np.asarray(looked_up[1]), np.asarray(evaluated[1]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mesh_name", ["1x1", "2x4"])
@pytest.mark.parametrize("path", [False, True])
@pytest.mark.parametrize("B", [2, 4, 12])  # on 2x4: one row a device (written alone), 2 or 6 (a loop)
def test_commit_writes_each_rows_slots_and_drops_what_passes_the_end(mesh_name, path, B):
    """`kv_cache.commit` at ragged starts: a row wholly past the cache's end, one well
    inside, one whose block passes the end (those entries are dropped, the slots before
    keep what they held) and one at the end; against a slot-by-slot loop in numpy. With `nodes` (a
    tree's kept path) the pass's chosen entries land in order. On a 2x4 mesh (rows over
    'data', kv heads over 'model') every device writes its own rows: no collective."""
    L, G, S, H, U = 2, 4, 9, 8, 5
    rng = np.random.default_rng(7)
    k, v = (rng.normal(size=(L, B, G, S, H)).astype(np.float32) for _ in range(2))
    new_k, new_v = (rng.normal(size=(L, B, U, G, H)).astype(np.float32) for _ in range(2))
    start = np.resize(np.array([5, 7, 12, 1], np.int32), B)  # the four, repeated (the last row writes)
    nodes = np.resize(np.array([[0, 3, 4], [0, 1, 2], [0, 2, 3], [0, 1, 4]], np.int32), (B, 3)) if path else None
    mesh = mesh_for(mesh_name)
    with jax.set_mesh(mesh):
        def write(k, v, fresh_k, fresh_v, start, nodes):
            cache = kv_cache.KVCache(k, v, jnp.zeros((B,), jnp.int32))
            return kv_cache.commit(cache, kv_cache.Fresh(fresh_k, fresh_v), start, nodes)
        placed = [jax.device_put(a, sharding.named(mesh, kv_cache.CACHE_AXES, a.shape)) for a in (k, v)]
        fn = jax.jit(write)
        args = (*placed, jnp.asarray(new_k), jnp.asarray(new_v), jnp.asarray(start),
                None if nodes is None else jnp.asarray(nodes))
        out = fn(*args)
        text = fn.lower(*args).compile().as_text()
    picked = [np.arange(U)] * B if nodes is None else list(nodes)
    for got, old, new in ((out.k, k, new_k), (out.v, v, new_v)):
        want = old.copy()
        for b in range(B):
            for j, node in enumerate(picked[b]):
                if start[b] + j < S:
                    want[:, b, :, start[b] + j] = new[:, b, node]
        np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(out.lengths), start + len(picked[0]))
    assert not re.findall(r"\b(all-gather|all-reduce|all-to-all|collective-permute)(-start)?\(", text)


def test_a_loop_that_commits_rows_and_reads_the_cache_writes_it_in_place():
    """Four rows committed in a generation loop whose next step attends to the cache (as a
    draft's refeed and first forward do): the loop holds no copy of the cache. Written one
    row after another, XLA:CPU fused a row's read of its old slots with the write before it
    and copied the cache to keep both alive (seven copies a loop here)."""
    L, B, G, S, H, T = 1, 4, 1, 53, 4, 5

    def step(carry):
        i, cache, acc = carry
        fresh = kv_cache.Fresh(jnp.full((L, B, T, G, H), i, jnp.float32), jnp.full((L, B, T, G, H), -i, jnp.float32))
        cache = kv_cache.commit(cache, fresh, (i + jnp.arange(B) * 7) % (S - 2))
        scores = jax.nn.softmax(jnp.einsum("bh,lbgsh->bgs", acc, cache.k))
        return i + 1, cache, acc + jnp.einsum("bgs,lbgsh->bh", scores, cache.v)

    def run(cache, acc, n):
        return jax.lax.while_loop(lambda c: c[0] < n, step, (jnp.int32(0), cache, acc))

    cache = kv_cache.KVCache(jnp.zeros((L, B, G, S, H)), jnp.zeros((L, B, G, S, H)), jnp.zeros((B,), jnp.int32))
    text = jax.jit(run).lower(cache, jnp.ones((B, H)), jnp.int32(7)).compile().as_text()
    assert not loop_cache_copies(text, S)
