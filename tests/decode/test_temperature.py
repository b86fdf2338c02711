"""Every temperature gives a distribution, from 1e-40 to inf, under jit as the loops run it.

T > 0 tends to greedy: at T <= 1e-6 the warped distribution is exactly the one-hot of the
top token (where it is unique by a margin that exp(-margin / T) underflows at) and ArS /
SpS emit exactly the temperature-0 tokens. T = inf is uniform over the tokens top-k keeps
(top-p keeps all of them: they tie). Neither model ever yields NaN probabilities, and a
distribution with no mass is flagged by `sample` instead of yielding token 0.
"""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import model
from specjax.config import SamplingConfig
from specjax.decode import program
from specjax.decode.warping import Warp, sample, warp
from conftest import mesh_for

TEMPERATURES = [1e-40, 1e-30, 1e-12, 1e-9, 1e-6, 0.01, 1.0, 1e3, math.inf]
GREEDY_BELOW = 1e-6  # these temperatures must reproduce temperature 0 exactly
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [13], [30, 31]]
jit_warp = jax.jit(warp, static_argnums=1)


def reference(logits, temperature, top_k=0, top_p=1.0):
    """float64, row by row: softmax((l - max) / T) over the top-k logits; T = inf uniform there."""
    out = []
    for row in np.asarray(logits, np.float64):
        keep = row >= np.sort(row)[::-1][top_k - 1] if 0 < top_k < len(row) else np.ones(len(row), bool)
        if math.isinf(temperature):
            p = keep / keep.sum()
        else:
            z = np.where(keep, (row - row[keep].max()) / temperature, -np.inf)
            p = np.exp(z)
            p /= p.sum()
        if top_p < 1:
            order = np.argsort(-p, kind="stable")
            cut = np.searchsorted(np.cumsum(p[order]), top_p * (1 - 1e-12)) + 1
            p = np.where(p >= p[order][cut - 1], p, 0)  # ties at the boundary kept together
            p /= p.sum()
        out.append(p)
    return np.stack(out)


def logits_rows():
    """Ordinary logits, large ones (|l| ~ 1e4, where l / T overflows soonest) and rows whose
    top two differ by one float32 step."""
    normal = 2.0 * np.asarray(jax.random.normal(jax.random.key(0), (16, 50)))
    large = 1e4 * normal[:4]
    close = normal[:4].copy()
    close[np.arange(4), np.argsort(-close, axis=1)[:, 1]] = np.nextafter(close.max(1), -np.inf, dtype=np.float32)
    return np.concatenate([normal, large, close]).astype(np.float32)


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (7, 1.0), (0, 0.8)])
def test_warp_is_a_distribution_at_every_temperature(temperature, top_k, top_p):
    logits = logits_rows()
    probs, bad = jit_warp(jnp.asarray(logits), Warp(temperature, top_k, top_p))
    probs = np.asarray(probs)
    assert not np.asarray(bad).any()
    assert np.isfinite(probs).all() and (probs >= 0).all()
    np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-5)
    np.testing.assert_allclose(probs, reference(logits, temperature, top_k, top_p), atol=1e-5)
    if temperature <= GREEDY_BELOW:
        top2 = np.sort(logits, axis=1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 200 * temperature  # exp(-200) is 0 in float32
        assert clear.sum() >= 16
        np.testing.assert_array_equal(probs[clear], np.eye(50)[logits.argmax(1)][clear])


def test_sample_flags_a_distribution_without_mass():
    """All zeros, NaN, inf: no token may come out silently (the old code returned 0)."""
    rows = jnp.array([[0.0] * 8, [jnp.nan] * 8, [0.5, jnp.nan] + [0.0] * 6, [jnp.inf] + [0.0] * 7,
                      [0.0] * 7 + [1.0], [0.25] * 4 + [0.0] * 4])
    tokens, empty = jax.jit(sample)(jax.random.key(0), rows)
    assert np.asarray(empty).tolist() == [True, True, True, True, False, False]
    assert int(tokens[4]) == 7 and 0 <= int(tokens[5]) < 4


@pytest.fixture(scope="module")
def pair(tiny):
    mesh = mesh_for("1x1")
    return model.init_lm(tiny.target, mesh), model.init_lm(tiny.draft, mesh)


@pytest.mark.parametrize("which", ["target", "draft"])
def test_next_token_probs_at_every_temperature(pair, which):
    lm = pair[0] if which == "target" else pair[1]
    sequences = [[1, 2, 3, 4, 5, 6], [9, 8, 7, 6, 5, 4]]
    greedy = specjax.next_token_probs(lm, sequences, SamplingConfig(temperature=0))
    for temperature in TEMPERATURES:
        probs = specjax.next_token_probs(lm, sequences, SamplingConfig(temperature=temperature))
        assert np.isfinite(probs).all() and (probs >= 0).all(), temperature
        np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-5, err_msg=str(temperature))
        if temperature <= GREEDY_BELOW:
            np.testing.assert_array_equal(probs, greedy, err_msg=str(temperature))
        if math.isinf(temperature):
            np.testing.assert_allclose(probs, 1 / lm.cfg.vocab_size, rtol=1e-6)


@pytest.mark.parametrize("mode", [pytest.param("ars_target", marks=pytest.mark.slow),
                                  pytest.param("ars_draft", marks=pytest.mark.slow), "sps"])
def test_loops_at_every_temperature(pair, mode):
    target, draft = pair
    lm, proposer = {"ars_target": (target, None), "ars_draft": (draft, None), "sps": (target, draft)}[mode]
    base = SamplingConfig(temperature=0, lookahead=3, max_new_tokens=12)
    compiled = len(program._COMPILED)
    greedy = specjax.generate(lm, proposer, PROMPTS, base).tokens
    assert any(t != 0 for row in greedy for t in row)
    for temperature in TEMPERATURES:
        result = specjax.generate(lm, proposer, PROMPTS, dataclasses.replace(base, temperature=temperature), seed=3)
        assert [len(row) for row in result.tokens] == [12] * len(PROMPTS), temperature
        assert all(0 <= t < lm.cfg.vocab_size for row in result.tokens for t in row)
        if temperature <= GREEDY_BELOW:
            assert result.tokens == greedy, temperature
        if mode == "sps" and math.isinf(temperature):
            assert result.acceptance_rate == 1.0  # p == q == uniform: every draft token passes
    # Temperature is traced: one program for greedy, one for every T > 0.
    assert len(program._COMPILED) - compiled <= 2


def test_next_token_probs_refuses_nan_logits(pair):
    target, _ = pair
    broken = jax.tree.map(lambda x: x, target.params)
    broken["unembed"].value = broken["unembed"].value.at[0, 0].set(jnp.nan)
    with pytest.raises(specjax.NonFiniteLogitsError, match="NaN or inf"):
        specjax.next_token_probs(dataclasses.replace(target, params=broken), [[1, 2, 3]])
