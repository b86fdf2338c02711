"""train.self_distill_chat: the teacher's samples are its replies inside its chat template
(the tiny Qwen2 fixture of tests/fixtures/hf, whose tokenizer carries Qwen2's template)."""
from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.config import Config, ConfigError, SamplingConfig, TrainConfig, UsageError
from specjax.model import full_forward
from specjax.training import samples
from specjax.training.corpus import Corpus
from specjax.weights import hf
from conftest import mesh_for

QWEN2 = pathlib.Path(__file__).parents[1] / "fixtures" / "hf" / "qwen2"
TEXT = "def merge(a, b):\n    return sorted(a + b)\n\nclass Stack:\n    def push(self, x):\n        self.items.append(x)\n"
SAMPLES, WINDOW, SEQ_LEN = 10, 4, 8  # each reply SEQ_LEN + 1 - WINDOW = 5 tokens (no stop ids)
# Qwen2's template with no system message of the chat's own, written out here.
HEAD = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
TAIL = "<|im_end|>\n<|im_start|>assistant\n"


def distilled(tmp_path, chat: bool, prompts_file: str = ""):
    with jax.set_mesh(mesh_for("1x1")):
        teacher, tok = hf.load(QWEN2, mesh_for("1x1"))
        stream = np.asarray(tok.encode(TEXT) * 4, np.int32)
        corpus = Corpus(train=stream, val=stream[:20], tokenizer_file=None, description="two snippets")
        config = Config(name="chat", target=teacher.cfg, sampling=SamplingConfig(temperature=0),
                        train=TrainConfig(seq_len=SEQ_LEN, self_distill=SAMPLES, self_distill_prompt=WINDOW,
                                          self_distill_chat=chat, val_fraction=0.1, teacher_hf=str(QWEN2),
                                          self_distill_prompts=prompts_file)).validate()
        samples.self_distilled(corpus, teacher, config, tmp_path, stop_ids=(), progress=False, tokenizer=tok)
        windows = samples.prompts(corpus, config)
    with np.load(tmp_path / samples.FILE) as saved:
        return teacher, tok, windows, saved["tokens"], json.loads(bytes(saved["settings"]).decode())


def test_chat_samples_are_the_teachers_greedy_replies_to_chat_prompts(tmp_path):
    """Sample i is window i's text in the user message CHAT_KINDS[i % 5] of Qwen2's template
    (the rendering written out by hand above), then the teacher's greedy reply (checked by
    its own forward over the sample: each reply token the argmax after the tokens before
    it). The control: without the flag, the samples start with the raw windows."""
    teacher, tok, windows, tokens, settings = distilled(tmp_path, chat=True)
    assert settings["chat"] == list(samples.CHAT_KINDS)
    at, begins = 0, []
    for i, window in enumerate(windows):
        begins.append(at)
        message = samples.CHAT_KINDS[i % len(samples.CHAT_KINDS)].format(text=tok.decode(window.tolist()).strip())
        prompt = tok.encode(HEAD + message + TAIL)
        sample = tokens[at:at + len(prompt) + SEQ_LEN + 1 - WINDOW]
        at += len(sample)
        np.testing.assert_array_equal(sample[:len(prompt)], prompt)
        with jax.set_mesh(mesh_for("1x1")):
            greedy = np.asarray(jnp.argmax(full_forward(teacher, jnp.asarray(sample[None, :-1])), axis=-1))[0]
        np.testing.assert_array_equal(sample[len(prompt):], greedy[len(prompt) - 1:])
    assert at == len(tokens) and SAMPLES > len(samples.CHAT_KINDS)  # every kind, in turn

    _, _, windows, raw, settings = distilled(tmp_path / "raw", chat=False)
    assert "chat" not in settings
    np.testing.assert_array_equal(raw[:WINDOW], windows[0])
    assert not np.array_equal(tokens[:WINDOW], windows[0])


def test_chat_without_samples_or_template_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"train.self_distill_chat=True .* set train.self_distill > 0"):
        TrainConfig(self_distill_chat=True, teacher_gguf="m.gguf").validate()
    with pytest.raises(ConfigError, match="must be True or False"):
        TrainConfig(self_distill=200, self_distill_chat="yes", teacher_gguf="m.gguf").validate()
    with pytest.raises(ConfigError, match=r"needs the teacher's chat template.*train.teacher='tiny' has none"):
        TrainConfig(self_distill=200, self_distill_chat=True, teacher="tiny").validate()

    class NoTemplate:
        path, chat_template = "tok.model", None
    with pytest.raises(ConfigError, match="tok.model.*has no chat template; drop train.self_distill_chat"):
        samples.check_chat(NoTemplate())


def test_replies_only_counts_the_teachers_own_tokens(tmp_path):
    """train.self_distill_replies: the samples file marks each token the teacher generated
    (1) or was given (0: the rendered chat prompt, its length from the template written
    out above), and the corpus counts exactly the marked ones, train and validation split
    like the tokens, and knows where each sample begins (the marks say). Without the flag
    the corpus counts every token (None). A file made before the marks is sampled again,
    with the flag or without (where the samples begin is in the marks)."""
    _, tok, windows, tokens, _ = distilled(tmp_path, chat=True)
    with np.load(tmp_path / samples.FILE) as saved:
        generated = saved["generated"]
    at, begins = 0, []
    for i, window in enumerate(windows):
        begins.append(at)
        message = samples.CHAT_KINDS[i % len(samples.CHAT_KINDS)].format(text=tok.decode(window.tolist()).strip())
        given = len(tok.encode(HEAD + message + TAIL))
        np.testing.assert_array_equal(generated[at:at + given], 0)
        np.testing.assert_array_equal(generated[at + given:at + given + SEQ_LEN + 1 - WINDOW], 1)
        at += given + SEQ_LEN + 1 - WINDOW
    assert at == len(tokens) == len(generated)

    marked = replies_corpus(tmp_path, replies=True)
    val = max(1, round(len(tokens) * 0.1))
    np.testing.assert_array_equal(marked.train_counted, generated[:-val])
    np.testing.assert_array_equal(marked.val_counted, generated[-val:])
    np.testing.assert_array_equal(marked.train, tokens[:-val])
    np.testing.assert_array_equal(marked.samples, begins)
    plain = replies_corpus(tmp_path, replies=False)
    assert plain.train_counted is None and plain.val_counted is None

    # A file from before the marks: sampled again.
    np.savez(tmp_path / samples.FILE, tokens=np.full_like(tokens, 7),
             settings=np.frombuffer(json.dumps(samples.settings(config_of(replies=False), ())).encode(), np.uint8))
    resampled = replies_corpus(tmp_path, replies=False)
    np.testing.assert_array_equal(resampled.train, tokens[:-val])
    np.testing.assert_array_equal(resampled.samples, begins)
    again = replies_corpus(tmp_path, replies=True)
    np.testing.assert_array_equal(again.train, tokens[:-val])
    np.testing.assert_array_equal(again.train_counted, generated[:-val])


def config_of(replies: bool, teacher_cfg=None) -> Config:
    if teacher_cfg is None:
        teacher_cfg = hf.read_config(QWEN2).model
    return Config(name="chat", target=teacher_cfg, sampling=SamplingConfig(temperature=0),
                  train=TrainConfig(seq_len=SEQ_LEN, self_distill=SAMPLES, self_distill_prompt=WINDOW,
                                    self_distill_chat=True, self_distill_replies=replies, val_fraction=0.1,
                                    teacher_hf=str(QWEN2))).validate()


def replies_corpus(workdir, replies: bool) -> Corpus:
    with jax.set_mesh(mesh_for("1x1")):
        teacher, tok = hf.load(QWEN2, mesh_for("1x1"))
        stream = np.asarray(tok.encode(TEXT) * 4, np.int32)
        corpus = Corpus(train=stream, val=stream[:20], tokenizer_file=None, description="two snippets")
        return samples.self_distilled(corpus, teacher, config_of(replies, teacher.cfg), workdir, stop_ids=(),
                                      progress=False, tokenizer=tok)


def test_replies_only_without_samples_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"train.self_distill_replies=True .* set train.self_distill > 0"):
        TrainConfig(self_distill_replies=True, teacher_gguf="m.gguf").validate()
    with pytest.raises(ConfigError, match="must be True or False"):
        TrainConfig(self_distill=200, self_distill_replies="yes", teacher_gguf="m.gguf").validate()


REQUESTS = ["Sort a list in Python.", "Summarize: the cat sat on the mat.", "What is a stack?"]


def requests_file(path, requests=REQUESTS):
    path.write_text("".join(json.dumps({"name": "x", "prompt": r}) + "\n" for r in requests), encoding="utf-8")
    return str(path)


def test_a_prompts_files_requests_prompt_the_samples(tmp_path):
    """train.self_distill_prompts: sample i is one of the file's requests as the user message
    of Qwen2's template (written out by hand above), every request once in each pass over the
    file (10 samples: 3 passes and one more), then the teacher's greedy reply. The control:
    without the file the samples' user messages are corpus windows."""
    teacher, tok, _, tokens, settings = distilled(tmp_path, chat=True, prompts_file=requests_file(tmp_path / "r.jsonl"))
    assert settings["chat"] is True and len(settings["prompts"]) == 64
    rendered = {r: tok.encode(HEAD + r + TAIL) for r in REQUESTS}
    at, asked = 0, []
    while at < len(tokens):
        request = next(r for r, p in rendered.items() if np.array_equal(tokens[at:at + len(p)], p))
        prompt = rendered[request]
        sample = tokens[at:at + len(prompt) + SEQ_LEN + 1 - WINDOW]
        with jax.set_mesh(mesh_for("1x1")):
            greedy = np.asarray(jnp.argmax(full_forward(teacher, jnp.asarray(sample[None, :-1])), axis=-1))[0]
        np.testing.assert_array_equal(sample[len(prompt):], greedy[len(prompt) - 1:])
        asked.append(request)
        at += len(sample)
    assert len(asked) == SAMPLES
    for first in range(0, SAMPLES - len(REQUESTS) + 1, len(REQUESTS)):
        assert sorted(asked[first:first + len(REQUESTS)]) == sorted(REQUESTS)

    _, _, _, windows_made, _ = distilled(tmp_path / "windows", chat=True)
    assert not any(np.array_equal(windows_made[:len(p)], p) for p in rendered.values())


def test_samples_are_made_again_when_the_files_requests_change(tmp_path, capsys):
    """The file's content, not its path, names the samples: the same requests elsewhere read
    the samples back; other requests sample the teacher again."""
    first = distilled(tmp_path, chat=True, prompts_file=requests_file(tmp_path / "a.jsonl"))[3]
    moved = distilled(tmp_path, chat=True, prompts_file=requests_file(tmp_path / "b.jsonl"))[3]
    assert "sampling the teacher again" not in capsys.readouterr().out
    np.testing.assert_array_equal(first, moved)
    other = distilled(tmp_path, chat=True, prompts_file=requests_file(tmp_path / "c.jsonl", REQUESTS[:2]))[3]
    assert "with other settings: sampling the teacher again" in capsys.readouterr().out
    assert not np.array_equal(first, other)


def test_a_bad_prompts_file_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"train.self_distill_prompts='r.jsonl' prompts the teacher's samples: set "
                       r"train.self_distill > 0"):
        TrainConfig(self_distill_prompts="r.jsonl").validate()
    with pytest.raises(ConfigError, match=r"TrainConfig.self_distill_prompts=3: must be a string"):
        TrainConfig(self_distill=20, self_distill_prompts=3).validate()
    with jax.set_mesh(mesh_for("1x1")):
        teacher, tok = hf.load(QWEN2, mesh_for("1x1"))

    def check(path, **train):
        config = Config(name="chat", target=teacher.cfg, sampling=SamplingConfig(temperature=0),
                        train=TrainConfig(seq_len=SEQ_LEN, self_distill=SAMPLES, self_distill_prompt=WINDOW,
                                          self_distill_chat=True, val_fraction=0.1, teacher_hf=str(QWEN2),
                                          self_distill_prompts=str(path), **train)).validate()
        return samples.file_prompts(config, teacher, tok)

    assert len(check(requests_file(tmp_path / "ok.jsonl"))) == SAMPLES
    with pytest.raises(UsageError, match=r"train.self_distill_prompts='.*missing.jsonl': cannot read it"):
        check(tmp_path / "missing.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(UsageError, match=r"bad.jsonl:2: not valid JSON"):
        check(tmp_path / "bad.jsonl")
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(ConfigError, match=r"empty.txt': holds no text prompts"):
        check(tmp_path / "empty.txt")
    long = requests_file(tmp_path / "long.jsonl", ["word " * teacher.cfg.max_seq_len])
    with pytest.raises(UsageError, match=r"long.jsonl:1 has \d+ tokens; with a reply of train.seq_len \+ 1 - "
                       r"train.self_distill_prompt=5 that is"):
        check(long)
    with pytest.raises(ConfigError, match=r"holds text, and the teacher has no tokenizer"):
        samples.file_prompts(Config(name="c", target=teacher.cfg, train=TrainConfig(
            self_distill=SAMPLES, val_fraction=0.1, self_distill_prompts=requests_file(tmp_path / "ok.jsonl"))),
            teacher, None)
