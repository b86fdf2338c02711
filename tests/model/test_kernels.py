"""The CPU kernels (specjax/kernels): the few-row matmul over packed weights equal to a
float64 numpy product over shapes (panels cut short by N, every row count), inside jit
and loops, with gradients, and a row's result independent of how many rows come with it;
the packed model equal to the unpacked one, through prefill and decode (the kernel, in
tiles of rows for a prompt); the attention over [cache; the pass's own keys] equal to a float64
reference over ragged cache lengths, causal and tree visibilities, GQA and edge cases;
the fallback where they are off or cannot be built; the model's logits with them equal
those without; the static setting (`Kernels`) chosen per traced program, never by the
environment at trace time; and multi-device meshes never use them."""
import dataclasses
import pathlib
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import kernels, kv_cache, model
from specjax.decode import warping
from specjax.config import ModelConfig, load_config
from specjax.kernels import NONE, Kernels, dispatch, formats, library
from conftest import mesh_for

needs_kernel = pytest.mark.skipif(not kernels.available(), reason="kernel not built here (no C++ compiler?)")
CUSTOM_CALL = library.MATMUL_TARGET  # as named in lowered and compiled text
ON = Kernels()


def operands(T, K, N, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (T, K)), jax.random.normal(kw, (K, N)) * K ** -0.5


def matmul(x, w):
    """The kernel on w [K, N], packed."""
    p = kernels.pack(w, 1)
    return jax.jit(dispatch.fewrow_matmul, static_argnums=2)(x, p.panels, p.n)


def reference(x, w):
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64)


def close(a, b):
    np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("K,N", [(1, 1), (3, 17), (33, 47), (100, 1000), (32, 64), (7, 130), (128, 512),
                                 (512, 512), (512, 2048), (2048, 512), (512, 4096)])
def test_matches_dot_for_every_row_count(K, N):
    x, w = operands(13, K, N, seed=K + N)
    x8 = x[:kernels.MAX_ROWS]
    rows = [np.asarray(matmul(x8[:T], w)) for T in range(1, kernels.MAX_ROWS + 1)]
    for T, y in enumerate(rows, 1):
        close(y, reference(x8[:T], w))
        # A row's value does not depend on the rows beside it (greedy ArS and SpS agree).
        np.testing.assert_array_equal(y, rows[-1][:T])
    # Any number of rows (a prefill's): tiles of up to MAX_ROWS, each row as alone.
    long = np.asarray(matmul(x, w))
    close(long, reference(x, w))
    np.testing.assert_array_equal(long[:kernels.MAX_ROWS], rows[-1])


def test_pack_layout():
    w = jnp.arange(3 * 2 * 70, dtype=jnp.float32).reshape(3, 2, 70)  # two stacked [2, 70] matrices
    p = kernels.pack(w, 1, lead=1)
    assert p.panels.shape == (3, 2, 2, kernels.PANEL) and p.out == (70,) and p.n == 70 and p.plain is w
    np.testing.assert_array_equal(p.panels[1, 1, 0, :6], np.asarray(w[1, 0, 64:70]))
    np.testing.assert_array_equal(p.panels[1, 1, 0, 6:], 0)  # zeros past N
    np.testing.assert_array_equal(p.panels[2, 0, 1], np.asarray(w[2, 1, :64]))
    q = kernels.pack(jnp.ones((4, 5, 6, 7)), 2)  # contracted [4, 5], out [6, 7]
    assert q.panels.shape == (1, 20, kernels.PANEL) and q.out == (6, 7)


@needs_kernel
def test_inside_while_loop_and_scan():
    x0, w = operands(5, 256, 256)

    p = kernels.pack(w, 1)

    def step(x):
        return jnp.tanh(dispatch.fewrow_matmul(x, p.panels, p.n))

    def step_ref(x):
        return jnp.tanh(jnp.dot(x, w, precision="highest"))

    def while_(f):
        return jax.jit(lambda x: jax.lax.while_loop(lambda c: c[0] < 6, lambda c: (c[0] + 1, f(c[1])), (0, x))[1])

    def scan(f):
        return jax.jit(lambda x: jax.lax.scan(lambda c, _: (f(c), c.sum()), x, None, length=6))

    close(while_(step)(x0), np.asarray(while_(step_ref)(x0)))
    (last, sums), (last_ref, sums_ref) = scan(step)(x0), scan(step_ref)(x0)
    close(last, np.asarray(last_ref))
    np.testing.assert_allclose(np.asarray(sums), np.asarray(sums_ref), rtol=1e-4)


@needs_kernel
def test_gradient_goes_through_the_dot_rule():
    x, w = operands(3, 40, 24)
    loss = lambda f: jax.grad(lambda x, w: jnp.sum(jnp.sin(f(x, w))), argnums=(0, 1))
    packed = lambda x, w: kernels.project("TK,KN->TN", x, kernels.pack(w, 1), ON)
    with jax.set_mesh(mesh_for("1x1")):
        assert CUSTOM_CALL in jax.jit(packed).lower(x, w).as_text()
        for g, g_ref in zip(loss(packed)(x, w), loss(jnp.dot)(x, w)):
            close(g, np.asarray(g_ref))


def test_project_dispatch_decided_from_static_facts(monkeypatch):
    x, w = jnp.ones((1, 5, 64)), kernels.pack(jnp.ones((64, 4, 16)), 1)

    def hlo(spec="BTD,DNH->BTNH", x=x, w=w, setting=ON, **kw):
        return jax.jit(lambda x, w: kernels.project(spec, x, w, setting, **kw)).lower(x, w).as_text()

    with jax.set_mesh(mesh_for("1x1")):
        assert (CUSTOM_CALL in hlo()) == kernels.available()
        assert CUSTOM_CALL not in hlo(w=jnp.ones((64, 4, 16)))  # a plain array: jnp.einsum
        assert (CUSTOM_CALL in hlo(x=jnp.ones((3, 3, 64)))) == kernels.available()  # 9 rows: tiles of the kernel
        assert CUSTOM_CALL not in hlo(x=x.astype(jnp.bfloat16), w=w.astype(jnp.bfloat16))
        assert CUSTOM_CALL not in hlo(preferred_element_type=jnp.bfloat16)
        assert CUSTOM_CALL not in hlo(setting=NONE)
        assert CUSTOM_CALL not in hlo(setting=Kernels.parse("attention,nucleus"))
        # The environment is read once, at start-up: changing it later changes no program.
        monkeypatch.setenv("SPECJAX_KERNELS", "0")
        assert (CUSTOM_CALL in hlo()) == kernels.available()
    assert CUSTOM_CALL not in hlo()  # no mesh and 8 devices


def test_kernel_setting_is_part_of_the_program_key():
    """One jitted function, one model under two settings: two traces, two programs (the
    setting is the LM's static data), never one program reused for both."""
    lm = model.init_lm(load_config("tiny").target, mesh_for("1x1")).packed()
    traces = []

    @jax.jit
    def step(lm, tokens, cache):
        traces.append(lm.kernels)
        return lm(tokens, cache.lengths[:, None], cache)[0]

    cache = kv_cache.init_cache(lm.cfg, 1, 16)
    tokens = jnp.zeros((1, 1), jnp.int32)
    with jax.set_mesh(mesh_for("1x1")):
        texts = [step.lower(subject, tokens, cache).as_text() for subject in (lm, lm.with_kernels(NONE), lm)]
    assert traces == [ON, NONE]  # the third call found the first program
    assert (CUSTOM_CALL in texts[0]) == kernels.available() and CUSTOM_CALL not in texts[1]


@pytest.mark.parametrize("text,want", [("on", ON), ("1", ON), ("off", NONE), ("0", NONE),
                                       ("matmul+attention", Kernels(True, True, False)),
                                       ("nucleus", Kernels(False, False, True))])
def test_kernel_settings_parse(text, want):
    assert Kernels.parse(text) == want
    assert Kernels.parse(str(want)) == want


@pytest.mark.parametrize("bad", ["matmul,fast", "yes", ""])
def test_bad_kernel_setting_names_the_value(bad):
    with pytest.raises(ValueError, match="kernel setting"):
        Kernels.parse(bad)


@pytest.mark.parametrize("forced", ["setting", "no compiler"])
def test_fallback_gives_the_same_values(monkeypatch, tmp_path, forced):
    x, w = operands(5, 96, 80)
    w = kernels.pack(w, 1)
    spec = "TK,KN->TN"
    setting = ON
    with jax.set_mesh(mesh_for("1x1")):
        used = jax.jit(lambda x, w: kernels.project(spec, x, w, ON))
        expect_kernel = kernels.available()
        assert (CUSTOM_CALL in used.lower(x, w).as_text()) == expect_kernel
        value = used(x, w)
        if forced == "setting":
            setting = NONE
        else:  # a fresh machine without a compiler: building fails, nothing raises
            monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
            monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
            kernels.available.cache_clear()
        try:
            fallback = jax.jit(lambda x, w: kernels.project(spec, x, w, setting))
            assert not dispatch.use_matmul(x, w.dtype, setting)
            assert CUSTOM_CALL not in fallback.lower(x, w).as_text()
            close(fallback(x, w), np.asarray(value))
            close(value, reference(x, w.plain))
        finally:
            kernels.available.cache_clear()
    if forced == "no compiler":
        assert not list(tmp_path.rglob("*.so"))


@needs_kernel
@pytest.mark.slow  # the default set's time budget
def test_two_builds_at_once_leave_one_library(tmp_path):
    results, errors = [], []

    def build():
        try:
            results.append(kernels.build(tmp_path))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    assert [p.name for p in pathlib.Path(results[0]).parent.iterdir()] == ["libspecjax_kernels.so"]


def attention_reference(q, k, v, k_all, v_all, layer, limit, visible, positions=None, window=0):
    """The attention over [cache below limit; own keys where visible], written out in jnp
    (MHA/GQA, rotary: no position terms), with a sliding window of `window` positions
    where > 0: q [B,T,N,H] -> [B,T,N,H]. Own keys k [B,U,G,H] at positions [B,U] (the
    queries are the last T), visible [T,U] or [B,T,U]."""
    B, T, N, H = q.shape
    G, S, U = k_all.shape[2], k_all.shape[3], k.shape[1]
    qc = q.reshape(B, T, G, N // G, H)
    cached = jnp.einsum("BTGRH,BGSH->BGRTS", qc, k_all[layer])
    own = jnp.einsum("BTGRH,BUGH->BGRTU", qc, k)
    seen_cache = jnp.broadcast_to((jnp.arange(S)[None] < limit[:, None])[:, None], (B, T, S))
    visible = jnp.asarray(visible)
    seen_own = jnp.broadcast_to(visible if visible.ndim == 3 else visible[None], (B, T, U))
    if window:
        at = positions[:, U - T:]
        seen_cache = seen_cache & (at[:, :, None] - jnp.arange(S)[None, None] < window)
        seen_own = seen_own & (at[:, :, None] - positions[:, None, :] < window)
    cached = jnp.where(seen_cache[:, None, None], cached, model.MASKED)
    own = jnp.where(seen_own[:, None, None], own, model.MASKED)
    weights = jax.nn.softmax(jnp.concatenate([cached, own], -1) * H ** -0.5, axis=-1)
    out = (jnp.einsum("BGRTS,BGSH->BTGRH", weights[..., :S], v_all[layer])
           + jnp.einsum("BGRTU,BUGH->BTGRH", weights[..., S:], v))
    return out.reshape(B, T, N, H)


def attention_float64(q, k, v, k_all, v_all, layer, limit, visible, positions=None, window=0):
    """The same in float64 numpy, one query at a time: the keys a query sees (within the
    window: cache slot s is position s), softmax, the weighted values (a query that sees
    none averages every cache slot and own key). visible: [T, U] or, per row, [B, T, U]."""
    q, k, v, k_all, v_all = (np.asarray(a, np.float64) for a in (q, k, v, k_all, v_all))
    B, T, N, H = q.shape
    G, U = k_all.shape[2], k.shape[1]
    out = np.zeros(q.shape)
    visible = np.broadcast_to(visible, (B,) + np.shape(visible)[-2:])
    for b, t, n in np.ndindex(B, T, N):
        g = n // (N // G)
        own = np.flatnonzero(visible[b, t])
        first = 0
        if window:
            p = np.asarray(positions)[b]
            at = p[U - T + t]  # the query: the pass's keys come last
            own = own[at - p[own] < window]
            first = max(0, at - window + 1)
        keys = np.concatenate([k_all[layer, b, g, first:limit[b]], k[b, own, g]])
        values = np.concatenate([v_all[layer, b, g, first:limit[b]], v[b, own, g]])
        if len(keys) == 0:
            out[b, t, n] = np.concatenate([v_all[layer, b, g], v[b, :, g]]).mean(0)
            continue
        score = keys @ q[b, t, n] * H ** -0.5
        w = np.exp(score - score.max())
        out[b, t, n] = w @ values / w.sum()
    return out


def ancestors(T):
    """A tree's visibility: node 0, then two branches (as two chains' `tree.ancestors`)."""
    from specjax.decode import tree
    M = 2 if T >= 3 else 1
    a = np.eye(T, dtype=bool)
    a[:1 + M * ((T - 1) // M), :1 + M * ((T - 1) // M)] = tree.ancestors(tree.chain_parents(M, (T - 1) // M)[0])
    return a


@needs_kernel
@pytest.mark.parametrize("B,T,N,G,H,S", [(1, 1, 8, 8, 64, 512), (1, 5, 8, 8, 64, 64), (2, 4, 8, 4, 8, 40),
                                         (8, 1, 8, 8, 16, 33), (1, 8, 4, 1, 20, 17), (2, 3, 6, 2, 3, 5),
                                         (16, 3, 4, 1, 8, 9),  # a batch of many short rows
                                         (1, 12, 8, 8, 16, 64), (2, 16, 4, 2, 8, 40)])  # up to ATTENTION_ROWS
@pytest.mark.parametrize("mask", ["causal", "tree", "one query sees nothing"])
def test_cached_attention_matches_the_reference(B, T, N, G, H, S, mask):
    L = 3
    keys = jax.random.split(jax.random.key(B * 100 + T), 6)
    q = jax.random.normal(keys[0], (B, T, N, H))
    k_all, v_all = (jax.random.normal(k, (L, B, G, S, H)) for k in keys[1:3])
    k, v = (jax.random.normal(k, (B, T, G, H)) for k in keys[3:5])
    # Ragged rows: mid-cache, the whole cache, an empty cache, and more.
    limit = jnp.asarray(np.resize([S // 3, S, 0, 1, 5, S - 2, 2, 3], B).clip(0, S), jnp.int32)
    visible = {"causal": np.tril(np.ones((T, T), bool)), "tree": ancestors(T),
               "one query sees nothing": np.tril(np.ones((T, T), bool))}[mask]
    if mask == "one query sees nothing":  # with an empty cache (row 0): uniform weights, as the jnp softmax gives
        limit = limit.at[0].set(0)
        visible = visible.copy()
        visible[T - 1] = False
    positions = limit[:, None] + jnp.arange(T)[None]
    fn = jax.jit(lambda q, k, v, ka, va, layer, n: dispatch.attention(q, k, v, ka, va, layer, n, visible,
                                                                      H ** -0.5, None, positions))
    for layer in range(L):
        args = (q, k, v, k_all, v_all, layer, limit)
        got = np.asarray(fn(*args))
        close(got, attention_float64(*args, visible))
        # Op by op: jitted, XLA:CPU's fused softmax gives NaN for a row whose every logit is
        # masked (which the model never asks for: a query always sees its own key).
        close(got, np.asarray(attention_reference(*args, visible)))


@needs_kernel
@pytest.mark.parametrize("B,T,N,G,H,S", [(1, 5, 8, 8, 64, 64), (2, 4, 8, 4, 8, 40), (16, 3, 4, 1, 8, 9)])
@pytest.mark.parametrize("window", [1, 3, 9])
@pytest.mark.parametrize("mask", ["causal", "tree", "one query sees nothing"])
def test_cached_attention_honours_a_sliding_window(B, T, N, G, H, S, window, mask):
    """A sliding layer's keys: the cache slots and own keys fewer than `window` positions
    before the query (a tree's nodes at their depths); window 1 leaves a query only its own
    key, so a query that does not see itself sees nothing: uniform weights, as the jnp
    softmax gives."""
    keys = jax.random.split(jax.random.key(B * 10 + T + window), 6)
    q = jax.random.normal(keys[0], (B, T, N, H))
    k_all, v_all = (jax.random.normal(k, (2, B, G, S, H)) for k in keys[1:3])
    k, v = (jax.random.normal(k, (B, T, G, H)) for k in keys[3:5])
    limit = jnp.asarray(np.resize([S // 3, S - T, 0, 1, 5, 2, 3], B).clip(0, S), jnp.int32)
    visible = ancestors(T) if mask == "tree" else np.tril(np.ones((T, T), bool))
    positions = limit[:, None] + jnp.asarray(visible.sum(1) - 1)[None]  # a node's depth below the cache
    if mask == "one query sees nothing":
        visible = visible.copy()
        visible[T - 1, T - 1] = False
    args = (q, k, v, k_all, v_all, 1, limit, visible, positions, window)
    fn = jax.jit(lambda q, k, v, ka, va, n, p, w: dispatch.attention(q, k, v, ka, va, 1, n, visible, H ** -0.5,
                                                                     None, p, w))
    got = np.asarray(fn(q, k, v, k_all, v_all, limit, positions, window))  # the window traced, as under scan
    close(got, attention_float64(*args))
    close(got, np.asarray(attention_reference(*args)))


@needs_kernel
@pytest.mark.parametrize("window", [0, 2])
@pytest.mark.parametrize("B,T,U,N,G,H,S", [(1, 2, 9, 4, 2, 16, 20), (3, 4, 12, 8, 4, 8, 40), (2, 8, 8, 4, 1, 20, 17)])
def test_cached_attention_sees_earlier_keys_through_each_rows_own_tree(B, T, U, N, G, H, S, window):
    """A dynamic draft tree's pass: U own keys (earlier rounds' nodes, then the pass's T)
    and a different visibility per row ([B, T, U]: each row grew its own tree), with and
    without a sliding window over the keys' positions (nodes at their depths)."""
    keys = jax.random.split(jax.random.key(U), 6)
    q = jax.random.normal(keys[0], (B, T, N, H))
    k_all, v_all = (jax.random.normal(k, (2, B, G, S, H)) for k in keys[1:3])
    k, v = (jax.random.normal(k, (B, U, G, H)) for k in keys[3:5])
    limit = jnp.asarray(np.resize([S // 2, 3, S - 3], B), jnp.int32)
    rng = np.random.default_rng(U)
    visible = rng.random((B, T, U)) < 0.5
    visible[:, np.arange(T), U - T + np.arange(T)] = True  # each query sees its own key
    positions = limit[:, None] + jnp.asarray(rng.integers(0, 3, (B, U)))
    args = (q, k, v, k_all, v_all, 1, limit, visible, positions, window)
    fn = jax.jit(lambda q, k, v, ka, va, n, p: dispatch.attention(q, k, v, ka, va, 1, n, visible, H ** -0.5, None, p,
                                                                  window))
    got = np.asarray(fn(q, k, v, k_all, v_all, limit, positions))
    close(got, attention_float64(*args))
    close(got, np.asarray(attention_reference(*args)))


def test_attention_dispatch_counts_queries_per_row_not_rows():
    """The attention kernel's work is per (row, kv head), so a large batch of short rows
    (a batched decode step, a Theorem-1 batch) takes it; many queries per row (a long
    prefill) take XLA's dots."""
    setting = Kernels.parse("attention")

    def uses(B, T, devices="1x1"):
        q, k_all = jnp.ones((B, T, 4, 8)), jnp.ones((2, B, 2, 16, 8))
        with jax.set_mesh(mesh_for(devices)):
            return dispatch.use_attention(q, k_all, setting)

    assert uses(1, 1) == uses(64, 1) == uses(64, dispatch.ATTENTION_ROWS) == kernels.available()
    assert not uses(1, dispatch.ATTENTION_ROWS + 1)
    assert not uses(64, 1, "1x8")
    assert not dispatch.use_attention(jnp.ones((64, 1, 4, 8)), jnp.ones((2, 64, 2, 16, 8)), NONE)


@needs_kernel
def test_cached_attention_gradient_uses_the_reference():
    B, T, N, G, H, S = 1, 3, 4, 2, 8, 12
    keys = jax.random.split(jax.random.key(3), 5)
    q = jax.random.normal(keys[0], (B, T, N, H))
    k_all, v_all = (jax.random.normal(k, (2, B, G, S, H)) for k in keys[1:3])
    k, v = (jax.random.normal(a, (B, T, G, H)) for a in keys[3:])
    limit, visible = jnp.array([4]), np.tril(np.ones((T, T), bool))
    ref = lambda q, k, v, ka, va: attention_reference(q, k, v, ka, va, 1, limit, visible)
    loss = lambda f: jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2, 3, 4))
    fast = lambda q, k, v, ka, va: dispatch.attention(q, k, v, ka, va, 1, limit, visible, H ** -0.5, ref,
                                                      limit[:, None] + jnp.arange(T)[None])
    for g, g_ref in zip(loss(fast)(q, k, v, k_all, v_all), loss(ref)(q, k, v, k_all, v_all)):
        close(g, np.asarray(g_ref))


SCANNED = dict(scan_layers=True, ffw="swiglu", tie_embeddings=True)  # stacked layers, a gate, a tied table


@needs_kernel
@pytest.mark.parametrize("config,B,T,changes", [("tiny", 1, 1, {}), ("tiny", 2, 4, {}), ("tiny", 1, 3, SCANNED),
                                                ("mini_target", 1, 5, {}), ("mini_target", 1, 1, {})])
def test_model_logits_with_and_without_kernel(config, B, T, changes):
    """The packed model (prefill of 7 or 14 rows, then T new tokens per row) against the
    unpacked model with the kernels off: XLA's dots on the original weights."""
    cfg = dataclasses.replace(load_config(config).target, **changes)
    mesh = mesh_for("1x1")
    lm = model.init_lm(cfg, mesh)
    packed = lm.packed()
    assert packed is not lm and packed.packed() is packed is lm.packed()  # made once
    shapes = {type(x).__name__ for x in jax.tree.leaves(packed.params, is_leaf=lambda x: isinstance(x, kernels.Packed))}
    assert shapes == {"Packed", "ArrayImpl"}
    prompt = 7
    tokens = jax.random.randint(jax.random.key(0), (B, prompt + T), 0, cfg.vocab_size)
    forward = lambda lm, t, p, c: lm.extend(t, p, c)
    results = {}
    for setting, subject in (("1", packed), ("0", lm.with_kernels(NONE))):
        with jax.set_mesh(mesh):
            cache = kv_cache.init_cache(lm.cfg, B, 32)
            prefill_logits, cache = jax.jit(forward)(subject, tokens[:, :prompt],
                                                     jnp.broadcast_to(jnp.arange(prompt), (B, prompt)), cache)
            args = (subject, tokens[:, prompt:], jnp.broadcast_to(prompt + jnp.arange(T), (B, T)), cache)
            step = jax.jit(lambda lm, t, p, c: lm(t, p, c)[0])
            assert (CUSTOM_CALL in step.lower(*args).as_text()) == (setting == "1")
            results[setting] = (prefill_logits, step(*args))
    for fast, plain in zip(results["1"], results["0"]):
        np.testing.assert_allclose(np.asarray(fast), np.asarray(plain), rtol=1e-5, atol=2e-5)


def kernel_outputs(text: str) -> list[tuple[int, int]]:
    """(rows, columns) of every few-row matmul in a lowered program's text."""
    pattern = rf"custom_call @{CUSTOM_CALL}\(.*-> tensor<(\d+)x(\d+)xf32>"
    return [(int(m[1]), int(m[2])) for m in re.finditer(pattern, text)]


# SmolLM2-135M's shape (its config.json), 2 of its 30 layers: a tied [49152, 576] table,
# whose transpose XLA:CPU multiplied by at 2-7 rows at a fraction of the read rate.
SMOLLM2 = ModelConfig(vocab_size=49152, d_model=576, num_layers=2, num_heads=9, num_kv_heads=3, head_dim=64,
                      d_ff=1536, ffw="swiglu", tie_embeddings=True, embed_scale=1.0, norm_weight_after_cast=True,
                      rope_theta=100000.0, max_seq_len=64)


@needs_kernel
def test_tied_unembedding_runs_the_kernel_at_every_few_row_count():
    """The packed forward of a tied model computes its logits with the kernel at T = 2, 5
    and 7 (a custom call whose result is [T, V]), and they equal the unpacked model's
    (XLA's dot against the table's transpose, kernels off). The packed copy keeps the
    model's own table for the lookup (no second copy of it)."""
    cfg = SMOLLM2
    mesh = mesh_for("1x1")
    lm = model.init_lm(cfg, mesh)
    packed = lm.packed()
    prompt = 6
    tokens = jax.random.randint(jax.random.key(1), (1, prompt + 7), 0, cfg.vocab_size)
    forward = jax.jit(lambda lm, t, p, c: lm.extend(t, p, c))
    for T in (2, 5, 7):
        logits = {}
        for setting, subject in (("1", packed), ("0", lm.with_kernels(NONE))):
            with jax.set_mesh(mesh):
                _, cache = forward(subject, tokens[:, :prompt], jnp.arange(prompt)[None],
                                   kv_cache.init_cache(lm.cfg, 1, 16))
                args = (subject, tokens[:, prompt:prompt + T], prompt + jnp.arange(T)[None], cache)
                step = jax.jit(lambda lm, t, p, c: lm(t, p, c)[0])
                unembedding = (T, cfg.vocab_size) in kernel_outputs(step.lower(*args).as_text())
                assert unembedding == (setting == "1"), (T, setting)
                logits[setting] = np.asarray(step(*args))
        # The table's unit-variance rows make logits in the hundreds: float32 rounding of a
        # 576-term sum is relative to that scale.
        np.testing.assert_allclose(logits["1"], logits["0"], rtol=1e-5, atol=1e-6 * np.abs(logits["0"]).max())
    assert packed.params["embed"].value.plain is lm.params["embed"].value  # the lookup reads the table as stored


def test_packing_only_where_the_kernel_runs(monkeypatch, tiny):
    lm = model.init_lm(tiny.target, mesh_for("1x8"))
    assert lm.packed() is lm  # eight devices: XLA's partitioned dots
    one = model.init_lm(tiny.target, mesh_for("1x1")).with_kernels(Kernels.parse("attention"))
    assert one.packed() is one
    bf16 = model.init_lm(dataclasses.replace(tiny.target, param_dtype="bfloat16"), mesh_for("1x1"))
    assert bf16.packed() is bf16
    one = one.with_kernels(ON)
    assert (one.packed() is not one) == kernels.available()
    # The copy must fit in half the free memory; one already made is kept, and shared by
    # the same model under another setting.
    monkeypatch.setattr(formats, "memory_available", lambda: 1024)  # bytes: less than the tiny weights
    assert (one.packed() is not one) == kernels.available()
    assert one.with_kernels(NONE).packed().params is one.with_kernels(NONE).params  # the kernel off: plain
    again = one.with_kernels(Kernels.parse("matmul"))
    assert (again.packed().params is one.packed().params) == kernels.available()
    fresh = model.init_lm(tiny.target, mesh_for("1x1"))
    assert fresh.packed() is fresh


@pytest.mark.parametrize("mesh_name", ["1x8", "2x4"])
def test_multi_device_mesh_compiles_no_custom_call(tiny, mesh_name):
    cfg = tiny.target
    mesh = mesh_for(mesh_name)
    lm = model.init_lm(cfg, mesh)
    B = mesh.shape["data"]  # rows: B * T <= MAX_ROWS, where the kernel would apply on one device
    tokens = jnp.zeros((B, 1), jnp.int32)
    cache = kv_cache.init_cache(lm.cfg, B, 16)
    with jax.set_mesh(mesh):
        text = jax.jit(lambda lm, t, c: lm(t, c.lengths[:, None], c)[0]).lower(lm, tokens, cache).compile().as_text()
    assert "custom-call" not in text and "all-reduce" in text


def nucleus_reference(p, top_p):
    """The top-p rule by sorting, in float64 (independent of the bisection): keep every
    p >= the first sorted value whose cumulative mass reaches top_p (all of them when none
    does), renormalised. Also returns the margin by which the cut is unambiguous."""
    p = np.asarray(p, np.float64)
    s = np.sort(p)[::-1]
    c = np.cumsum(s)
    if c[-1] < top_p:
        return p / p.sum(), top_p - c[-1]
    t = s[np.argmax(c >= top_p)]
    kept = np.where(p >= t, p, 0.0)
    return kept / kept.sum(), min(kept.sum() - top_p, top_p - p[p > t].sum())


@needs_kernel
def test_nucleus_kernel_matches_the_sorted_rule_and_the_jnp_bisection():
    rows = []
    rng = np.random.default_rng(0)
    for V in (1, 7, 17, 40, 4096):
        for scale in (0.1, 1.0, 3.0, 10.0):
            rows.append(rng.normal(size=(3, V)) * scale)
    probs = [np.exp(r - r.max(axis=-1, keepdims=True)) for r in rows]
    probs = [p / p.sum(axis=-1, keepdims=True) for p in probs]
    ties = np.zeros((1, 40))
    ties[0, :10] = 0.1  # ten equal tokens at the boundary: all kept together
    zeros = np.zeros((1, 40))
    zeros[0, [3, 30]] = [0.75, 0.25]
    probs += [ties, zeros]
    kernel = jax.jit(dispatch.nucleus, static_argnums=1)
    checked = 0
    for top_p in (0.05, 0.5, 0.9, 0.95, 0.999):
        for p in probs:
            p32 = jnp.asarray(p, jnp.float32)
            with jax.set_mesh(mesh_for("1x1")):
                assert dispatch.use_nucleus(p32, ON)
                got = np.asarray(kernel(p32, top_p))
                bisection = np.asarray(jax.jit(lambda p: warping.nucleus(p, top_p, NONE))(p32))
            for row, jnp_row, p_row in zip(got, bisection, np.asarray(p32)):
                want, margin = nucleus_reference(p_row, top_p)
                if margin < 1e-5:  # within float32 rounding of top_p: either cut is right
                    continue
                checked += 1
                np.testing.assert_array_equal(row > 0, want > 0)
                np.testing.assert_allclose(row, want, rtol=2e-6, atol=1e-7)
                np.testing.assert_allclose(row, jnp_row, rtol=2e-6, atol=1e-7)
    assert checked > 250  # of 310 rows: nearly all are far from a boundary


def test_nucleus_search_keeps_what_the_sorted_rule_keeps_row_by_row():
    """The jnp search (XLA's, wherever the CPU kernel does not run), one distribution at a
    time over rows of 128 lanes: it keeps exactly what the sorted rule keeps, ties and
    zeros included, each of a batch of rows at its own top_p (rows of every length, so the
    padding to 128 lanes is crossed); and the search XLA:TPU runs, 4 bits a pass, finds
    the same threshold as XLA:CPU's bisection, one bit a pass."""
    rng = np.random.default_rng(2)
    rows = []
    for V in (1, 7, 127, 129, 4096):
        for scale in (0.1, 3.0, 10.0):
            r = rng.normal(size=V) * scale
            rows.append(np.exp(r - r.max()) / np.exp(r - r.max()).sum())
    ties = np.zeros(40)
    ties[:10] = 0.1
    zeros = np.zeros(40)
    zeros[[3, 30]] = [0.75, 0.25]
    top = jnp.asarray([[0.05, 0.5, 0.9], [0.95, 0.999, 0.3]], jnp.float32)
    nucleus = jax.jit(lambda p, t: warping.nucleus(p, t, NONE))
    search = jax.jit(warping._bits_search, static_argnums=2)
    checked = 0
    for p in rows + [ties, zeros]:
        batch = jnp.asarray(np.stack([p] * 6).reshape(2, 3, -1), jnp.float32)
        got = np.asarray(nucleus(batch, top[..., None]))
        tiles = jnp.pad(jax.lax.bitcast_convert_type(batch[0, 0], jnp.uint32), (0, -len(p) % 128)).reshape(-1, 128)
        for top_p in np.asarray(top).ravel():
            assert search(tiles, top_p, 1) == search(tiles, top_p, 4)
        for b, r in np.ndindex(2, 3):
            want, margin = nucleus_reference(np.asarray(batch)[b, r], float(top[b, r]))
            if margin >= 1e-5:
                checked += 1
                np.testing.assert_array_equal(got[b, r] > 0, want > 0)
                np.testing.assert_allclose(got[b, r], want, rtol=2e-6, atol=1e-7)
    assert checked > 80


@needs_kernel
def test_nucleus_takes_top_p_traced_and_one_per_row():
    """top_p is an operand (a loop compiled once serves every top_p): a traced array of one
    value per row, in the kernel and in the jnp bisection, each row cut at its own top_p."""
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(2, 3, 300)) * 2.0
    p32 = jnp.asarray(np.exp(logits) / np.exp(logits).sum(-1, keepdims=True), jnp.float32)
    kernel = jax.jit(lambda p, t: dispatch.nucleus(p, t))
    bisection = jax.jit(lambda p, t: warping.nucleus(p, t, NONE))
    for top in ([[0.05, 0.5, 0.95], [0.3, 0.999, 0.7]], [[0.9] * 3] * 2):
        top = jnp.asarray(top, jnp.float32)
        with jax.set_mesh(mesh_for("1x1")):
            got, jnp_got = np.asarray(kernel(p32, top)), np.asarray(bisection(p32, top[..., None]))
        for b, r in np.ndindex(2, 3):
            want, margin = nucleus_reference(np.asarray(p32)[b, r], float(top[b, r]))
            assert margin > 1e-5
            np.testing.assert_allclose(got[b, r], want, rtol=2e-6, atol=1e-7)
            np.testing.assert_allclose(jnp_got[b, r], want, rtol=2e-6, atol=1e-7)
    assert kernel._cache_size() == 1 and bisection._cache_size() == 1


def test_nucleus_dispatch():
    p = jnp.full((2, 3, 64), 1 / 64)
    hlo = lambda setting=ON: jax.jit(lambda p: warping.warp(p, warping.Warp(1.0, 0, 0.9, setting))[0]).lower(
        p).as_text()
    with jax.set_mesh(mesh_for("1x1")):
        assert (library.NUCLEUS_TARGET in hlo()) == kernels.available()
        assert library.NUCLEUS_TARGET not in hlo(Kernels.parse("matmul,attention"))
    with jax.set_mesh(mesh_for("1x8")):
        assert library.NUCLEUS_TARGET not in hlo()
