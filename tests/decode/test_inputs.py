"""The Python API's inputs: seeds over the whole documented range, prompts in the forms
users pass them, and models that cannot be paired, each refused with a UsageError that
names the value (never an error from inside tracing)."""
import dataclasses

import jax
import numpy as np
import pytest

import specjax
from specjax.config import SamplingConfig, UsageError
from specjax.model import init_lm
from conftest import mesh_for

SAMPLING = SamplingConfig(temperature=1.0, lookahead=2, max_new_tokens=12)


@pytest.fixture(scope="module")
def pair(tiny):
    mesh = mesh_for("1x1")
    return init_lm(tiny.target, mesh), init_lm(tiny.draft, mesh)


def tokens(target, draft, seed, prompts=((1, 2, 3), (4, 5))):
    return specjax.generate(target, draft, [list(p) for p in prompts], SAMPLING, seed=seed).tokens


def test_every_63_bit_seed_has_its_own_stream(pair):
    """Seeds used to be truncated to 32 bits: 2**32 sampled exactly what 0 did."""
    target, draft = pair
    streams = {seed: tokens(target, draft, seed) for seed in (0, 1, 2 ** 32 - 1, 2 ** 32, 2 ** 33 + 1, 2 ** 63 - 1)}
    seen = [str(t) for t in streams.values()]
    assert len(set(seen)) == len(seen), streams
    assert tokens(target, draft, 2 ** 32) == streams[2 ** 32]  # and each is reproducible
    assert tokens(target, None, np.int64(7)) == tokens(target, None, 7)  # numpy integers are integers


@pytest.mark.parametrize("seed", [-1, 2 ** 63, 1.5, "3", True])
def test_seeds_outside_the_range_are_refused(pair, seed):
    target, _ = pair
    with pytest.raises(UsageError, match=r"seed=.*\[0, 2\*\*63\)"):
        specjax.generate(target, None, [[1, 2]], SAMPLING, seed=seed)


def test_prompts_as_arrays_and_tuples_are_the_same_prompts(pair):
    target, draft = pair
    as_lists = tokens(target, draft, 3, prompts=[[1, 2, 3], [4, 5, 6]])
    assert tokens(target, draft, 3, prompts=np.array([[1, 2, 3], [4, 5, 6]])) == as_lists  # 2-D int array
    assert tokens(target, draft, 3, prompts=[np.array([1, 2, 3]), (4, 5, 6)]) == as_lists


@pytest.mark.parametrize("prompts, message", [
    ([[1.0, 2.0]], r"prompt 0: token id 1\.0 is not an integer"),
    ([[1, True]], r"prompt 0: token id True is not an integer"),
    ((p for p in [[1, 2]]), r"prompts: expected a list of token-id lists, got generator"),
    ("123", r"prompts: expected a list of token-id lists, got str"),
    ([["1", "2"]], r"token id '1' is not an integer"),
    (np.zeros((2, 2, 2), np.int32), r"must be 2-D"),
    ([np.array([1.5, 2.0])], r"1-D array of integer token ids"),
    ([[1, 99]], r"token id 99 is outside the vocabulary: allowed ids are 0\.\.31"),
])
def test_malformed_prompts_are_refused_naming_the_value(pair, prompts, message):
    target, _ = pair
    with pytest.raises(UsageError, match=message):
        specjax.generate(target, None, prompts, SAMPLING)


def test_a_draft_with_another_vocabulary_is_refused_before_tracing(tiny):
    mesh = mesh_for("1x1")
    target = init_lm(tiny.target, mesh)
    draft = init_lm(dataclasses.replace(tiny.draft, vocab_size=48), mesh)
    with pytest.raises(UsageError, match="draft's vocabulary has 48 tokens and the target's 32"):
        specjax.generate(target, draft, [[1, 2]], SAMPLING)


def test_explain_loop_needs_a_draft(pair):
    target, _ = pair
    with pytest.raises(UsageError, match="needs a draft model"):
        specjax.explain_loop(target, None, [1, 2, 3], SAMPLING)


def test_a_model_that_is_not_an_lm_is_named(pair):
    _, draft = pair
    with pytest.raises(UsageError, match="target: expected a specjax LM"):
        specjax.generate(jax.numpy.zeros(3), draft, [[1]], SAMPLING)


def test_prompt_buckets_pad_by_at_most_a_third():
    from specjax.decode.program import bucket
    assert {n: bucket(n) for n in (1, 16, 17, 24, 25, 100, 150, 162, 192, 193, 257, 1000)} == {
        1: 16, 16: 16, 17: 24, 24: 24, 25: 32, 100: 128, 150: 192, 162: 192, 192: 192, 193: 256, 257: 384,
        1000: 1024}
    widths = {bucket(n) for n in range(1, 4097)}
    assert widths == {m << k for k in range(3, 11) for m in (2, 3)} | {4096}
    assert all(bucket(n) >= n and (n <= 16 or 3 * (bucket(n) - n) < bucket(n)) for n in range(1, 4097))
