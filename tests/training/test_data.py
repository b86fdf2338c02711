"""Tokenizer and data pipeline: lossless on code, cached once, deterministic batches;
corpora SentencePiece cannot learn from and streams too short for a window are refused
with advice that works."""
import os
import pathlib
import re
import sysconfig

import numpy as np
import pytest
import sentencepiece as spm

from specjax.config import TrainConfig, UsageError
from specjax.training import data
from specjax.training.corpus import Batches, Corpus
from specjax.weights.tokenizer import Tokenizer, TokenizerError, train_tokenizer
from conftest import mesh_for

STDLIB = pathlib.Path(sysconfig.get_paths()["stdlib"])
TRAIN_FILES = [STDLIB / name for name in
               ("textwrap.py", "string.py", "shlex.py", "fnmatch.py", "json/decoder.py")]
HELD_OUT_FILES = [STDLIB / name for name in ("argparse.py", "inspect.py", "tabnanny.py")]
VOCAB = 512


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    prefix = tmp_path_factory.mktemp("tok") / "spm"
    return Tokenizer(train_tokenizer(TRAIN_FILES, prefix, VOCAB))


@pytest.mark.parametrize("path", HELD_OUT_FILES, ids=lambda p: p.name)
def test_round_trip_on_unseen_stdlib_source_is_exact(tokenizer, path):
    text = path.read_text(encoding="utf-8")
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_round_trip_whitespace_unicode_and_special_piece_names(tokenizer):
    text = ("\t\tx = 1  \r\n\n\n    \x0c# ünïcødé ✓ 🐍 漢字\n"
            "  <s></s><pad><unk>   \n\n\n        return  \n")
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    # Literal "<s>" in text must not turn into control ids, and nothing is added.
    assert not {tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id} & set(ids)
    assert tokenizer.encode("") == []


def test_vocab_size_and_special_ids(tokenizer):
    assert tokenizer.vocab_size == VOCAB
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == (0, 2, 3)
    ids = tokenizer.encode(HELD_OUT_FILES[0].read_text())
    assert 0 <= min(ids) and max(ids) < VOCAB


def test_indentation_uses_whitespace_only_pieces(tokenizer):
    pieces = [tokenizer.id_to_piece(i) for i in tokenizer.encode("        return x\n")]
    assert pieces[0] and set(pieces[0]) == {"\u2581"}  # sentencepiece's space marker


def test_tokenizer_bad_paths(tmp_path):
    missing = tmp_path / "nope.model"
    with pytest.raises(TokenizerError, match="nope.model"):
        Tokenizer(missing)
    garbage = tmp_path / "garbage.model"
    garbage.write_text("not a model")
    with pytest.raises(ValueError, match="garbage.model"):
        Tokenizer(garbage)


def test_tokenizer_training_is_deterministic(tmp_path, tokenizer):
    again = train_tokenizer(TRAIN_FILES, tmp_path / "again", VOCAB)
    assert pathlib.Path(again).read_bytes() == tokenizer.path.read_bytes()


def test_build_or_load_tokenizer_trains_once(tmp_path, monkeypatch):
    first = data.build_or_load_tokenizer(TRAIN_FILES[:2], tmp_path, VOCAB)

    def fail(*args, **kwargs):
        raise AssertionError("retrained a cached tokenizer")

    monkeypatch.setattr(data, "train_tokenizer", fail)
    second = data.build_or_load_tokenizer(TRAIN_FILES[:2], tmp_path, VOCAB)
    assert second.path == first.path
    with pytest.raises(AssertionError, match="retrained"):
        data.build_or_load_tokenizer(TRAIN_FILES[:2], tmp_path, VOCAB + 64)


def test_default_corpus_is_stdlib_without_site_packages():
    files = data.default_corpus_files()
    assert len(files) > 500
    assert files == sorted(files)
    assert pathlib.Path(os.__file__) in files
    assert all(f.suffix == ".py" for f in files)
    assert not any({"site-packages", "test", "tests"} & set(f.parts) for f in files)
    assert data.resolve_corpus(None) == files == data.resolve_corpus("stdlib")


def test_resolve_corpus_directory_file_and_glob(tmp_path):
    for rel in ("a.py", "sub/b.txt", "c.md", "d.bin", ".hidden/e.py", "sub/deep/f.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    expected = [tmp_path / "a.py", tmp_path / "c.md", tmp_path / "sub/b.txt",
                tmp_path / "sub/deep/f.py"]
    assert data.resolve_corpus(str(tmp_path)) == expected
    assert data.resolve_corpus(str(tmp_path / "*.py")) == [tmp_path / "a.py"]
    assert data.resolve_corpus(str(tmp_path / "**/*.py")) == [tmp_path / "a.py",
                                                             tmp_path / "sub/deep/f.py"]
    assert data.resolve_corpus(str(tmp_path / "c.md")) == [tmp_path / "c.md"]


def test_resolve_corpus_error_names_the_spec(tmp_path):
    spec = str(tmp_path / "no_such_*.py")
    with pytest.raises(ValueError, match="no_such_"):
        data.resolve_corpus(spec)


def _reference_stream(files, model_path):
    """Independent encoding with sentencepiece itself: doc EOS doc EOS ..."""
    sp = spm.SentencePieceProcessor(model_file=str(model_path))
    out = []
    for f in files:
        out += sp.encode(pathlib.Path(f).read_text(encoding="utf-8")) + [sp.eos_id()]
    return np.array(out)


def test_token_cache_matches_direct_encoding_and_is_reused(tmp_path, tokenizer):
    files = TRAIN_FILES[:3]
    tokens = data.build_token_cache(files, tokenizer, tmp_path)
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16
    np.testing.assert_array_equal(tokens, _reference_stream(files, tokenizer.path))
    [cache] = tmp_path.glob("tokens-*.npy")
    mtime = cache.stat().st_mtime_ns

    class NoEncode(Tokenizer):
        def encode(self, text):
            raise AssertionError("retokenised although the cache exists")

    again = data.build_token_cache(files, NoEncode(tokenizer.path), tmp_path)
    np.testing.assert_array_equal(again, tokens)
    assert cache.stat().st_mtime_ns == mtime
    assert sorted(p.name for p in tmp_path.iterdir()) == [cache.name]


def test_token_cache_key_changes_with_files(tmp_path, tokenizer):
    doc = tmp_path / "doc.py"
    doc.write_text("a = 1\n")
    first = data.build_token_cache([doc], tokenizer, tmp_path / "cache")
    doc.write_text("b = 22\n")
    os.utime(doc, ns=(1, 1))  # a different mtime even on coarse-clock filesystems
    second = data.build_token_cache([doc], tokenizer, tmp_path / "cache")
    assert tokenizer.decode(second[:-1]) == "b = 22\n"
    assert tokenizer.decode(first[:-1]) == "a = 1\n"
    assert len(list((tmp_path / "cache").glob("tokens-*.npy"))) == 2


def test_interrupted_tokenisation_leaves_no_cache(tmp_path, tokenizer):
    calls = []

    class Dies(Tokenizer):
        def encode(self, text):
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt
            return super().encode(text)

    with pytest.raises(KeyboardInterrupt):
        data.build_token_cache(TRAIN_FILES[:3], Dies(tokenizer.path), tmp_path)
    assert list(tmp_path.iterdir()) == []
    tokens = data.build_token_cache(TRAIN_FILES[:3], tokenizer, tmp_path)
    np.testing.assert_array_equal(tokens, _reference_stream(TRAIN_FILES[:3],
                                                            tokenizer.path))


def test_split_train_val_is_the_tail():
    tokens = np.arange(1000, dtype=np.uint16)
    train, val = data.split_train_val(tokens, 0.01)
    np.testing.assert_array_equal(train, np.arange(990))
    np.testing.assert_array_equal(val, np.arange(990, 1000))
    assert np.shares_memory(train, tokens) and np.shares_memory(val, tokens)
    with pytest.raises(ValueError):
        data.split_train_val(tokens, 0.0)


STREAM = np.arange(50_000, dtype=np.uint32)  # token value == its position


def _assert_windows_of(batch, stream, seq_len):
    """Every row is a contiguous slice of the stream (checked via value == position)."""
    assert batch.shape[1] == seq_len + 1 and batch.dtype == np.int32
    starts = batch[:, 0]
    np.testing.assert_array_equal(batch, starts[:, None] + np.arange(seq_len + 1))
    assert starts.min() >= 0 and starts.max() + seq_len < len(stream)


def test_get_batch_is_a_pure_function_of_seed_and_step():
    b = data.get_batch(STREAM, step=7, batch_size=8, seq_len=32, seed=1)
    assert b.shape == (8, 33)
    _assert_windows_of(b, STREAM, 32)
    np.testing.assert_array_equal(b, data.get_batch(STREAM, 7, 8, 32, 1))
    assert not np.array_equal(b, data.get_batch(STREAM, 8, 8, 32, 1))
    assert not np.array_equal(b, data.get_batch(STREAM, 7, 8, 32, 2))


def test_get_batch_on_real_tokens_is_in_vocab(tmp_path, tokenizer):
    tokens = data.build_token_cache(TRAIN_FILES, tokenizer, tmp_path)
    b = data.get_batch(tokens, 3, 4, 64, 0)
    assert b.dtype == np.int32 and b.shape == (4, 65)
    assert b.min() >= 0 and b.max() < tokenizer.vocab_size


def test_get_batch_can_reach_the_last_token():
    stream = np.arange(10, dtype=np.uint16)
    rows = np.concatenate([data.get_batch(stream, s, 4, 8, 0) for s in range(50)])
    assert set(rows[:, 0]) == {0, 1}  # both possible windows of 9 tokens in 10


@pytest.mark.parametrize("process_count", [2, 4])
def test_process_shards_concatenate_to_the_global_batch(process_count):
    whole = data.get_batch(STREAM, 5, 8, 16, 0)
    parts = [data.get_batch(STREAM, 5, 8, 16, 0, process_index=i,
                            process_count=process_count) for i in range(process_count)]
    assert all(p.shape == (8 // process_count, 17) for p in parts)
    np.testing.assert_array_equal(np.concatenate(parts), whole)


def test_process_sharding_rejects_uneven_batches():
    with pytest.raises(ValueError, match="divisible"):
        data.get_batch(STREAM, 0, 6, 16, 0, process_index=0, process_count=4)


def test_eval_batches_are_fixed_and_cover_the_stream():
    batches = data.eval_batches(STREAM, batch_size=4, seq_len=16, num_batches=3)
    assert len(batches) == 3 and all(b.shape == (4, 17) for b in batches)
    for b in batches:
        _assert_windows_of(b, STREAM, 16)
    stacked = np.concatenate(batches)
    assert stacked[0, 0] == 0 and stacked[-1, -1] == len(STREAM) - 1
    assert len(set(stacked[:, 0])) == 12
    again = data.eval_batches(STREAM, 4, 16, 3)
    np.testing.assert_array_equal(np.concatenate(again), stacked)
    halves = [data.eval_batches(STREAM, 4, 16, 3, process_index=i, process_count=2)
              for i in range(2)]
    np.testing.assert_array_equal(
        np.concatenate([np.concatenate([h[k] for h in halves]) for k in range(3)]),
        stacked)


@pytest.mark.parametrize("total,val_fraction", [(5_000, 0.01), (5_000, 0.99), (100_000, 0.001), (1_000, 0.9)])
def test_short_stream_advice_goes_the_right_way_and_works(total, val_fraction):
    """The old message advised a larger val_fraction even when the train stream was short."""
    def batches(val_fraction):
        tc = TrainConfig(seq_len=256, batch_size=2, val_fraction=val_fraction)
        train, val = data.split_train_val(np.zeros(total, np.int32), val_fraction)
        return Batches(Corpus(train, val, None, "zeros"), tc, mesh_for("1x1")), len(train), len(val)

    with pytest.raises(UsageError) as err:
        batches(val_fraction)
    message = str(err.value)
    train = len(data.split_train_val(np.zeros(total), val_fraction)[0])
    short, tokens = ("train", train) if train < 257 else ("validation", total - train)
    assert f"the {short} stream has {tokens:,} tokens" in message
    direction, value = re.search(r"(lower|raise) train.val_fraction to (?:at most|at least) ([0-9.]+)", message).groups()
    assert direction == ("lower" if short == "train" else "raise")
    batches(float(value))  # the advised value works


def test_stream_too_small_for_any_split_says_so():
    tc = TrainConfig(seq_len=256, batch_size=2, val_fraction=0.5)
    corpus = Corpus(np.zeros(200, np.int32), np.zeros(200, np.int32), None, "zeros")
    with pytest.raises(UsageError, match=r"too small for a train and a validation window of 257.*seq_len at most 197"):
        Batches(corpus, tc, mesh_for("1x1"))


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpora")
    (d / "binary.dat").write_bytes(np.random.default_rng(0).bytes(100_000))
    (d / "tiny.py").write_text("def f():\n    return 1\n")
    (d / "chars.txt").write_text("\n".join("".join(chr(0x4E00 + 40 * i + j) for j in range(40)) for i in range(50)))
    (d / "one_line.txt").write_text("x" * 20_000)
    return d


@pytest.mark.parametrize("name,fragments", [
    ("binary.dat", ["needs at least", "pieces", "of at least", "binary.dat is not UTF-8 text: leave it out of train.corpus"]),
    ("tiny.py", ["is too small to learn 512 pieces (at most", "bigger train.corpus", "smaller tokenizer_vocab"]),
    ("chars.txt", ["needs at least 2,", "one per distinct character", "tokenizer_vocab (and target.vocab_size) of at least"]),
    ("one_line.txt", ["no line of at most 16,384 bytes"]),
])
def test_corpora_sentencepiece_cannot_use_say_what_to_change(corpora, tmp_path, name, fragments):
    with pytest.raises(UsageError) as err:
        train_tokenizer([corpora / name], tmp_path / "tok", 512)
    message = str(err.value)
    assert "INTERNAL" not in message and "trainer_interface" not in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    if "of at least" in message:  # and the vocabulary size it names is enough
        enough = int(re.search(r"of at least (\d+)", message).group(1))
        train_tokenizer([corpora / name], tmp_path / "tok", enough)


def test_counted_windows_are_the_tokens_windows():
    """Batches hand the train step, window for window, which tokens count as targets: the
    same windows of the corpus's counted stream as of its tokens (here counted = token
    parity, so a misaligned window shows), for training steps and for validation; a
    corpus without one counts every token."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 1000, 4000).astype(np.int32)
    train, val = data.split_train_val(tokens, 0.1)
    tc = TrainConfig(seq_len=16, batch_size=4, eval_batches=3)
    marked = Batches(Corpus(train, val, None, "parity", train_counted=train % 2, val_counted=val % 2), tc,
                     mesh_for("1x1"))
    for step in (0, 1, 7):
        batch, counted, _ = marked.train(step)
        assert np.array_equal(np.asarray(counted), np.asarray(batch) % 2)
    pairs = marked.validation()
    assert len(pairs) == 3 and all(np.array_equal(np.asarray(c), np.asarray(b) % 2) for b, c, _ in pairs)
    batch, counted, _ = Batches(Corpus(train, val, None, "plain"), tc, mesh_for("1x1")).train(0)
    assert np.asarray(counted).min() == 1 and np.array_equal(np.asarray(batch), np.asarray(marked.train(0)[0]))
