"""The lookup drafters against plain-Python references: the on-device n-gram match
(most recent earlier occurrence of the longest suffix, continued periodically), the
datastore's greedy most-frequent continuations and its on-device query; the datastore
file's checks; the sampling settings' validation."""
import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.config import ConfigError, SamplingConfig, UsageError
from specjax.decode import drafters
from specjax.decode.retrieval_index import Datastore, lookup
from conftest import mesh_for


def reference_ngram(context: list[int], n: int, K: int):
    """(proposal, matched suffix length) prompt lookup makes for `context`, by hand;
    (None, 0) without a match."""
    L = len(context)
    for m in range(min(n, L - 1), 0, -1):
        suffix = context[L - m:]
        for t in range(L - 2, m - 2, -1):  # most recent first; occurrence context[t-m+1..t]
            if context[t - m + 1:t + 1] == suffix:
                follow = context[t + 1:]  # up to the end of the context; then the copy repeats
                return [follow[j % len(follow)] for j in range(K)], m
    return None, 0


def test_ngram_match_finds_the_most_recent_occurrence_of_the_longest_suffix():
    rng = np.random.default_rng(0)
    size, n, K = 40, 3, 5
    rows = [rng.integers(0, 4, rng.integers(1, size)).tolist() for _ in range(300)]  # 4 symbols: many matches
    rows += [[1, 2, 3, 1, 2], [7], [5, 5], [1, 2, 3, 4], [9, 8, 9, 8, 9]]
    buf = np.full((len(rows), size), 7, np.int32)  # stale tokens past each row's length must not matter
    for i, r in enumerate(rows):
        buf[i, :len(r)] = r
    x, matched = jax.jit(drafters.ngram_match, static_argnums=(2, 3))(
        jnp.asarray(buf), jnp.array([len(r) for r in rows], jnp.int32), n, K)
    x, matched = np.asarray(x), np.asarray(matched)
    for i, r in enumerate(rows):
        want, m = reference_ngram(r, n, K)
        assert matched[i] == m, r
        if want is not None:
            assert x[i].tolist() == want, r
    assert set(matched.tolist()) == {0, 1, 2, 3}  # every match length was exercised
    assert reference_ngram([1, 2, 3, 1, 2], 3, 4) == ([3, 1, 2, 3], 2)  # periodic copy past the context


def reference_datastore(stream: list[int], n: int, C: int, min_count: int):
    """{context tuple: continuation} by brute force: at every step, among the occurrences
    of the context followed by the chosen tokens so far, the most frequent next token
    (ties: the smallest id; -1 = the corpus ended)."""
    out = {}
    for m in range(1, n + 1):
        occurrences = collections.defaultdict(list)
        for end in range(m - 1, len(stream) - 1):
            occurrences[tuple(stream[end - m + 1:end + 1])].append(end + 1)
        for context, starts in occurrences.items():
            chosen, alive = [], starts
            for s in range(C):
                nxt = [stream[a + s] if a + s < len(stream) else -1 for a in alive]
                counts = collections.Counter(nxt)
                best = max(counts.values())
                token = min(t for t, c in counts.items() if c == best)
                if s == 0 and best < min_count:
                    break
                chosen.append(token)
                alive = [a for a, t in zip(alive, nxt) if t == token]
            else:
                out[context] = chosen
    return out


def test_datastore_holds_the_greedy_most_frequent_continuations_and_finds_them_on_device():
    rng = np.random.default_rng(1)
    stream = rng.integers(0, 6, 3000).tolist()
    n, C, K = 3, 4, 6
    store = Datastore.build(np.array(stream), vocab_size=6, ngram=n, continuation=C, min_count=2)
    want = reference_datastore(stream, n, C, 2)
    got = {tuple(int(t) for t in ctx if t >= 0): cont.tolist() for ctx, cont in zip(store.contexts,
                                                                                       store.continuations)}
    assert got == want
    # Queries: every row's longest suffix (<= n) in the table, continuation cut at K.
    rows = [rng.integers(0, 7, rng.integers(1, 12)).tolist() for _ in range(200)]  # id 6 is never in the corpus
    buf = np.zeros((len(rows), 16), np.int32)
    for i, r in enumerate(rows):
        buf[i, :len(r)] = r
    index = store.on_mesh(mesh_for("1x1"))
    x, size, matched = jax.jit(lookup, static_argnums=(3, 4))(
        index, jnp.asarray(buf), jnp.array([len(r) for r in rows]), n, K)
    x, size, matched = np.asarray(x), np.asarray(size), np.asarray(matched)
    for i, r in enumerate(rows):
        m = next((m for m in range(min(n, len(r)), 0, -1) if tuple(r[-m:]) in want), 0)
        hit = want[tuple(r[-m:])] if m else None
        proposal = [] if hit is None else hit[:next((j for j, t in enumerate(hit) if t < 0), len(hit))][:K]
        assert x[i, :size[i]].tolist() == proposal and matched[i] == m, r
    assert (size > 0).mean() > 0.5 and (size == 0).any()


def test_datastore_file_round_trip_and_refusals(tmp_path):
    store = Datastore.build(np.arange(50) % 7, vocab_size=8, ngram=2, continuation=3, min_count=1,
                            tokenizer_sha256="ab" * 32)
    path = tmp_path / "ds.npz"
    store.save(path)
    again = Datastore.load(path)
    assert again.meta == store.meta and (again.keys == store.keys).all()
    again.check(8)
    again.check_tokenizer("ab" * 32)
    with pytest.raises(UsageError, match="built with tokenizer sha256 abab.*this model has tokenizer sha256 cdcd"):
        again.check_tokenizer("cd" * 32)
    with pytest.raises(UsageError, match="this model has no tokenizer"):
        again.check_tokenizer(None)
    with pytest.raises(UsageError, match="vocabulary of 8 tokens, the model has 9"):
        again.check(9)
    with pytest.raises(UsageError, match="no such file"):
        Datastore.load(tmp_path / "missing.npz")
    (tmp_path / "junk.npz").write_text("not a datastore")
    with pytest.raises(UsageError, match="not a specjax datastore"):
        Datastore.load(tmp_path / "junk.npz")
    store.save(tmp_path / "new" / "dir" / "ds.npz")  # the directory is made
    assert Datastore.load(tmp_path / "new" / "dir" / "ds.npz").meta == store.meta
    with pytest.raises(UsageError, match="datastore ngram=17: at most 16"):
        Datastore.build(np.arange(50) % 7, vocab_size=8, ngram=17)


def test_tree_size_is_bounded_by_num_drafts_times_lookahead():
    SamplingConfig(num_drafts=16, lookahead=4).validate()
    SamplingConfig(num_drafts=1, lookahead=200).validate()  # a chain is no tree
    with pytest.raises(ConfigError, match=r"num_drafts=8 x lookahead=9 = 72 tree nodes: at most 64"):
        SamplingConfig(num_drafts=8, lookahead=9).validate()


@pytest.mark.parametrize("field,value,message", [
    ("verify", "greedy", "verify='greedy': allowed values are block, tokenwise"),
    ("drafter", "tree", "drafter='tree': allowed values are model, ngram, retrieval, hybrid"),
    ("ngram", 0, r"ngram=0: must be an integer in \[1, 16\]"),
    ("ngram", 17, r"ngram=17: must be an integer in \[1, 16\]"),
    ("num_drafts", 17, r"num_drafts=17: must be an integer in \[1, 16\]"),
    ("draft_confidence", 1.0, r"draft_confidence=1.0: must be in \[0, 1\)"),
    ("draft_confidence", -0.1, r"draft_confidence=-0.1: must be in \[0, 1\)"),
    ("draft_confidence", float("nan"), r"draft_confidence=nan: must be in \[0, 1\)")])
def test_bad_sampling_settings_name_the_field(field, value, message):
    with pytest.raises(ConfigError, match=message):
        SamplingConfig(**{field: value}).validate()
