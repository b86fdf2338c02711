"""Training on `tiny` (vocab 32, synthetic Markov data, see `corpus.synthetic_tokens`):
the loss falls, a run killed with SIGKILL or stopped with SIGTERM and restarted with the
same command continues exactly like an uninterrupted one (parameters and every
metrics.jsonl record, resuming at steps that are not multiples of log_every), a second
run on the same workdir is refused, every bad input is one line and exit 2, and
distillation gets the draft closer to the teacher than LM training on one budget.

Runs go through the real entry point (`python -m specjax.train`) in subprocesses on a
2x4 mesh of fake CPU devices (data and tensor parallel at once); they share one
SPECJAX_CACHE, so later runs reuse the first run's compiled programs.
"""
import collections
import dataclasses
import json
import math
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from specjax.training import corpus, data
from specjax.training.workdir import read_metrics
from specjax.weights import checkpoint
from specjax.config import load_config
import clitools
from clitools import TEXT_CONFIG, kernels_only_cache, read_only, run_many

STEPS = 60
LOG_EVERY = 3  # checkpoints every 10 steps: resumes land between two records
OVERRIDES = [f"--config.train.steps={STEPS}", "--config.train.seq_len=32", "--config.train.batch_size=8",
             "--config.train.warmup_steps=5", f"--config.train.log_every={LOG_EVERY}",
             "--config.train.save_every=10", "--config.train.eval_every=30", "--config.train.eval_batches=2",
             "--config.mesh.data=2", "--config.mesh.model=4"]
TIMEOUT = 240


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = kernels_only_cache(tmp_path_factory.mktemp("specjax_cache"))
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        flags += " --xla_force_host_platform_device_count=8"
    return dict(os.environ, SPECJAX_CACHE=str(cache), XLA_FLAGS=flags.strip(), PYTHONUNBUFFERED="1")


def command(workdir, *extra):
    return [sys.executable, "-m", "specjax.train", "--config=tiny", f"--workdir={workdir}", "--noprogress",
            *OVERRIDES, *extra]


def run_to_end(env, workdir, *extra):
    proc = subprocess.run(command(workdir, *extra), env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def start(env, workdir, *extra):
    """A run in the background; its output goes to workdir.log (never a full pipe)."""
    log = open(f"{workdir}.log", "w")
    proc = subprocess.Popen(command(workdir, *extra), env=env, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    proc.log = f"{workdir}.log"
    return proc


def output(proc) -> str:
    with open(proc.log) as f:
        return f.read()[-3000:]


def wait_for(proc, condition, what):
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"run exited ({proc.returncode}) before {what}:\n{output(proc)}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def last_train_step(workdir) -> int:
    return max(read_metrics(workdir), default=0)


def events(workdir) -> list[dict]:
    return list(read_metrics(workdir, "event").values())


def assert_same_metrics(workdir, reference):
    """Every 'train' and 'val' record (the last one per step, as `read_metrics` reads a
    resumed run's file) equals the uninterrupted run's: same steps, same values. The same
    compiled program on the same data gives bit-identical losses; tolerance 1e-6 relative.
    Timing fields differ by nature and are not compared."""
    for kind, fields in (("train", ("loss", "ce", "grad_norm", "lr")), ("val", ("val_loss",))):
        got, ref = read_metrics(workdir, kind), read_metrics(reference, kind)
        assert list(got) == list(ref), (kind, list(got), list(ref))
        for field in fields:
            np.testing.assert_allclose([got[s][field] for s in got], [ref[s][field] for s in ref], rtol=1e-6,
                                       err_msg=f"{kind} {field} at steps {list(got)}")


def final_params(workdir):
    cfg = load_config("tiny").target
    mesh = jax.make_mesh((1, 1), ("data", "model"), devices=jax.devices()[:1],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    lm = checkpoint.load_lm(cfg, mesh, workdir, step=STEPS)
    return [np.asarray(x) for x in jax.tree.leaves(lm.params)]


@pytest.fixture(scope="module")
def reference(env, tmp_path_factory):
    """One uninterrupted run: the baseline for resume, and the teacher for distillation."""
    workdir = tmp_path_factory.mktemp("reference")
    run_to_end(env, workdir)
    return workdir


def test_loss_falls_within_a_few_dozen_steps(reference):
    """Start: ~ln 32 = 3.47 nats (uniform). The chain's entropy rate is 1.63 nats; 60
    steps must take the training loss down by at least 1 nat and the validation loss
    below 2.4 nats."""
    losses = {s: r["loss"] for s, r in read_metrics(reference).items()}
    assert sorted(losses) == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    first = losses[LOG_EVERY]  # the mean of steps 1..3
    last = np.mean([losses[STEPS - LOG_EVERY], losses[STEPS]])
    assert first > 3.3, first
    assert last < first - 1.0, (first, last)
    val = read_metrics(reference, "val")
    assert sorted(val) == [30, 60]
    assert val[60]["val_loss"] < 2.4 < math.log(32), val
    with checkpoint.Checkpoints(reference, read_only=True) as ckpt:
        assert ckpt.steps() == [40, 50, 60]  # keep_checkpoints=3
    assert [e["event"] for e in events(reference)] == ["start", "done"]


def test_kill_9_then_same_command_resumes_exactly(env, reference, tmp_path):
    workdir = tmp_path / "run"
    proc = start(env, workdir)
    wait_for(proc, lambda: (workdir / "10").is_dir() and last_train_step(workdir) >= 12, "checkpoint 10")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = last_train_step(workdir)
    assert killed_at < STEPS, "the run finished before it was killed: the test proved nothing"
    assert "done" not in [e["event"] for e in events(workdir)]

    run_to_end(env, workdir)
    resumed_from = [e["step"] for e in events(workdir) if e["event"] == "resume"]
    assert len(resumed_from) == 1 and 10 <= resumed_from[0] <= killed_at, (resumed_from, killed_at)
    # Between two records: the first record after the resume must still average all of
    # its log_every steps, some of them run before the kill.
    assert resumed_from[0] % LOG_EVERY, resumed_from
    assert_same_metrics(workdir, reference)
    for a, b in zip(final_params(workdir), final_params(reference)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_sigterm_leaves_a_checkpoint_and_the_same_command_resumes_exactly(env, reference, tmp_path):
    workdir = tmp_path / "run"
    proc = start(env, workdir, "--config.train.save_every=1000")  # no periodic checkpoint
    wait_for(proc, lambda: last_train_step(workdir) >= 6, "step 6")
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=TIMEOUT)
    assert proc.returncode == 143, output(proc)

    stopped = [e for e in events(workdir) if e["event"] == "stopped"]
    assert len(stopped) == 1 and stopped[0]["signal"] == "SIGTERM"
    reached = stopped[0]["step"]
    assert 6 <= reached < STEPS
    print("stopped at step", reached)
    # No record for the stop itself: the steps since the last record travel in the checkpoint.
    assert last_train_step(workdir) == reached - reached % LOG_EVERY
    with checkpoint.Checkpoints(workdir, read_only=True) as ckpt:
        assert ckpt.steps() == [reached]
        assert ckpt.meta(reached)["step"] == reached and ckpt.has_item(reached, "opt_state")

    run_to_end(env, workdir, "--config.train.save_every=1000")
    assert [e["step"] for e in events(workdir) if e["event"] == "resume"] == [reached]
    assert_same_metrics(workdir, reference)
    for a, b in zip(final_params(workdir), final_params(reference)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_a_second_run_on_the_same_workdir_is_refused_and_kill_9_frees_it(env, tmp_path):
    workdir = tmp_path / "run"
    first = start(env, workdir, "--config.train.steps=100000")
    try:
        wait_for(first, lambda: (workdir / "10").is_dir(), "checkpoint 10")
        second = subprocess.run(command(workdir), env=env, capture_output=True, text=True, timeout=TIMEOUT)
        lines = second.stderr.strip().splitlines()
        assert second.returncode == 2 and len(lines) == 1, second.stderr[-3000:]
        assert f"another training run (pid {first.pid}) is writing to workdir {workdir}" in lines[0]
        assert first.poll() is None  # the first run goes on
    finally:
        first.kill()
        first.wait()
    # kill -9 leaves no stale lock: the next run gets the workdir (and finds step >= 10,
    # more than these 6 steps: nothing to train).
    third = subprocess.run(command(workdir, "--config.train.steps=6"), env=env, capture_output=True, text=True,
                           timeout=TIMEOUT)
    assert third.returncode == 0, third.stderr[-3000:]
    assert "nothing to train" in third.stdout + third.stderr


def damage(workdir, kind):
    params = workdir / "60" / "params"
    if kind == "truncated":
        # Every data file: orbax may also have merged the process's tree into params/d.
        data = [f for f in params.rglob("*") if f.is_file() and f.parent.name == "d"]
        assert data, sorted(params.rglob("*"))
        for f in data:
            f.write_bytes(f.read_bytes()[:7])
    else:  # garbage manifests
        for f in params.rglob("manifest.ocdbt"):
            f.write_bytes(b"not a manifest\n")


SWIGLU = "--config.target.ffw=swiglu"  # exportable as Llama
HF = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "hf"


# (id, extra arguments, fragments of the one-line message); {files} is the `bad_files`
# directory. All exit 2 except the diverging run (the config was valid: exit 1).
DIVERGES = "learning rate 1e30"
BAD_TRAIN = [
    (DIVERGES, ["--config.train.learning_rate=1e30"], ["training diverged at step", "lower the learning rate"]),
    ("config raises on import", ["--config={files}/raises.py"], ["raises.py failed to load",
                                                                 "ZeroDivisionError: division by zero"]),
    ("config syntax error", ["--config={files}/syntax.py"], ["syntax.py failed to load", "SyntaxError", "line 1"]),
    ("config is a directory", ["--config={files}/folder.py"], ["folder.py", "is a directory"]),
    ("config without get_config", ["--config={files}/empty.py"], ["empty.py has no get_config()"]),
    ("grad_clip negative", ["--config.train.grad_clip=-1"], ["grad_clip=-1.0", "> 0"]),
    ("val_fraction 1", ["--config.train.val_fraction=1"], ["val_fraction=1.0", "(0, 1)"]),
    ("corpus without tokenizer", ["--config.train.corpus={files}"], ["train.corpus=", "has no tokenizer"]),
    ("workdir is a file", ["--workdir={files}/empty.py"], ["empty.py is a file, not a directory"]),
    ("workdir below a file", ["--workdir={files}/empty.py/run"], ["cannot write to workdir", "Not a directory"]),
    ("binary corpus", ["--config={files}/tiny_text.py", "--config.train.corpus={files}/binary.dat"],
     ["binary.dat is not UTF-8 text", "leave it out of train.corpus"]),
    ("validation stream too short", ["--config={files}/tiny_text.py", "--config.train.corpus={files}/text.txt",
                                     "--config.train.seq_len=512"],
     ["the validation stream has", "raise train.val_fraction to at least"]),
    ("damaged checkpoint (manifests)", ["--workdir={files}/manifest_1"], ["checkpoint step 60", "is damaged"]),
    ("damaged checkpoint (manifests, again)", ["--workdir={files}/manifest_2"], ["checkpoint step 60", "is damaged"]),
    ("damaged checkpoint (truncated)", ["--workdir={files}/truncated"], ["checkpoint step 60", "is damaged"]),
    ("export into a directory holding an export", [SWIGLU, "--export_hf={files}/old_export"],
     ["--export_hf=", "old_export", "not empty", "config.json, generation_config.json, model.safetensors",
      "remove it first"]),
    ("export to a file", [SWIGLU, "--export_hf={files}/empty.py"], ["--export_hf=", "is a file"]),
    ("export under a file", [SWIGLU, "--export_hf={files}/empty.py/hf"], ["empty.py is a file, not a directory"]),
    ("export over the teacher", [SWIGLU, f"--config.train.teacher_hf={HF / 'pair_target'}",
                                 f"--export_hf={HF / 'pair_target'}"], ["is the teacher's directory"]),
    ("teacher_hf is a file", [SWIGLU, f"--config.train.teacher_hf={HF / 'pair_target' / 'config.json'}"],
     ["config.json: is a file, not a Hugging Face model directory"]),
    # Refused before anything trains, for the right reason (tiny_medusa's own target is a
    # gelu one, which the Hugging Face check named instead).
    ("export of draft heads", ["--config=tiny_medusa", "--export_hf={files}/heads_export"],
     ["trains medusa draft heads on a frozen target, not a model", "nothing to export"]),
    # A refused teacher leaves no workdir (its train.lock was left behind).
    ("teacher of another vocabulary", [SWIGLU, "--config.target.vocab_size=64", "--config.draft.vocab_size=64",
                                       f"--config.train.teacher_hf={HF / 'pair_target'}",
                                       "--workdir={files}/teacher_run"], ["vocab_size=32, the student 64",
                                                                          "distillation needs one vocabulary"]),
    ("teacher checkpoint missing", ["--config.train.teacher=tiny", "--config.train.teacher_checkpoint={files}/nothing",
                                    "--workdir={files}/teacher_run"], ["no checkpoint directory", "nothing"]),
    ("eagle width", ["--config=tiny_eagle", "--config.heads.width=12", "--workdir={files}/eagle_run"],
     ["heads.width=12", "a multiple of the target's head_dim=8"]),
    ("eagle draft vocabulary", ["--config=tiny_eagle", "--config.heads.draft_vocab=33", "--workdir={files}/eagle_run"],
     ["heads.draft_vocab=33", "the target has only 32 tokens"]),
    ("eagle3 layers beyond the target", ["--config=tiny_eagle3", "--config.heads.feature_layers=3",
                                         "--workdir={files}/eagle_run"], ["heads.feature_layers=(3,)", "2 layers"]),
    ("eagle3 ttt_steps", ["--config=tiny_eagle3", "--config.heads.ttt_steps=17", "--workdir={files}/eagle_run"],
     ["heads.ttt_steps=17", "[0, 16]"]),
    ("self_distill without a teacher", ["--config.train.self_distill=200"],
     ["train.self_distill=200", "config 'tiny' has none", "train.teacher"]),
    ("eagle3 self_distill leaves no validation", ["--config=tiny_eagle3", "--config.train.self_distill=10",
                                                  "--workdir={files}/eagle_run"],
     ["train.self_distill=10 samples x train.val_fraction=0.01", "at least 100"]),
    ("eagle3 self_distill prompt beyond seq_len", ["--config=tiny_eagle3", "--config.train.self_distill=200",
                                                   "--config.train.self_distill_prompt=33",
                                                   "--workdir={files}/eagle_run"],
     ["train.self_distill_prompt=33", "at most train.seq_len=32"]),
    ("eagle3 self_distill negative", ["--config=tiny_eagle3", "--config.train.self_distill=-1",
                                      "--workdir={files}/eagle_run"], ["train.self_distill=-1", "integer in [0, "]),
    ("eagle3 self_distill_chat without a template", ["--config=tiny_eagle3", "--config.train.self_distill=200",
                                                     "--config.train.self_distill_chat=True",
                                                     "--workdir={files}/eagle_run"],
     ["train.self_distill_chat=True", "needs the teacher's chat template", "train.teacher='tiny'"]),
    ("eagle3 self_distill_prompts unreadable", ["--config=tiny_eagle3", "--config.train.self_distill=200",
                                               "--config.train.teacher=", f"--config.train.teacher_hf={HF / 'qwen2'}",
                                               "--config.train.self_distill_prompts={files}/nothing.jsonl",
                                               "--workdir={files}/eagle_run"],
     ["train.self_distill_prompts=", "nothing.jsonl", "cannot read it"]),
    ("eagle3 self_distill_prompts not JSON", ["--config=tiny_eagle3", "--config.train.self_distill=200",
                                              "--config.train.teacher=", f"--config.train.teacher_hf={HF / 'qwen2'}",
                                              "--config.train.self_distill_prompts={files}/bad_prompts.jsonl",
                                              "--workdir={files}/eagle_run"],
     ["bad_prompts.jsonl:2: not valid JSON"]),
    ("eagle3 self_distill_prompts without a tokenizer", ["--config=tiny_eagle3", "--config.train.self_distill=200",
                                                        "--config.train.self_distill_prompts={files}/nothing.jsonl",
                                                        "--workdir={files}/eagle_run"],
     ["train.self_distill_prompts=", "the teacher's tokenizer encodes", "train.teacher='tiny' has none"]),
    # Refused once the teacher's tokenizer has counted the prompt's tokens, inside the workdir
    # the run made: it is taken away again (its train.lock was left behind).
    ("teacher's prompt longer than its context", ["--config=tiny_eagle3", "--config.target.vocab_size=304",
                                                  "--config.train.self_distill=200", "--config.train.teacher=",
                                                  f"--config.train.teacher_hf={HF / 'qwen2'}",
                                                  "--config.train.self_distill_prompts={files}/long_prompts.jsonl",
                                                  "--workdir={files}/teacher_run"],
     ["long_prompts.jsonl:1 has", "tokens", "train.self_distill_prompt"]),
    ("eagle3 self_distill_replies without samples", ["--config=tiny_eagle3", "--config.train.self_distill_replies=True",
                                                     "--workdir={files}/eagle_run"],
     ["train.self_distill_replies=True", "set train.self_distill > 0"]),
]


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory, reference):
    d = tmp_path_factory.mktemp("bad")
    (d / "raises.py").write_text("x = 1 / 0\n")
    (d / "syntax.py").write_text("def get_config(:\n    pass\n")
    (d / "folder.py").mkdir()
    (d / "empty.py").write_text("")
    (d / "tiny_text.py").write_text(TEXT_CONFIG)
    (d / "bad_prompts.jsonl").write_text('{"prompt": "Sort a list."}\n{"prompt": \n')
    (d / "long_prompts.jsonl").write_text(json.dumps({"prompt": "Say it again: " + "word " * 2000}) + "\n")
    (d / "binary.dat").write_bytes(np.random.default_rng(0).bytes(50_000))
    # A few thousand tokens of real text: enough for a 512-piece tokenizer, too few for a 1%
    # validation stream of seq_len + 1 = 513 tokens.
    (d / "text.txt").write_text(pathlib.Path(pathlib.__file__).read_text())
    (d / "old_export").mkdir()  # what an earlier export left (file names only matter)
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        (d / "old_export" / name).write_text("{}")
    for name, kind in (("manifest_1", "manifest"), ("manifest_2", "manifest"), ("truncated", "truncated")):
        shutil.copytree(reference, d / name)
        damage(d / name, kind)
    return d


@pytest.fixture(scope="module")
def bad_runs(env, bad_files, tmp_path_factory):
    """All bad-input runs, forked from one process that imported specjax once."""
    def args_of(case):
        _, extra, _ = case
        args = [a.format(files=bad_files) for a in extra]
        workdir = next((a.split("=", 1)[1] for a in args if a.startswith("--workdir=")), None)
        args = [a for a in args if not a.startswith("--workdir=")]
        return command(workdir or tmp_path_factory.mktemp("w"), *args)[3:], {}  # after `python -m specjax.train`
    cases = [args_of(c) for c in BAD_TRAIN]
    return dict(zip((c[0] for c in BAD_TRAIN), run_many("specjax.train", cases, env=env)))


def assert_one_line(proc, code, fragments):
    return clitools.assert_one_line(proc, code, fragments, "train")


@pytest.mark.parametrize("case", BAD_TRAIN, ids=[c[0] for c in BAD_TRAIN])
def test_bad_input_is_one_line_and_exit_2(bad_runs, bad_files, case):
    name, _, fragments = case
    assert_one_line(bad_runs[name], 1 if name == DIVERGES else 2, fragments)
    if "export" in name or "teacher" in name:
        assert "step" not in bad_runs[name].stdout  # refused before training
    if name.startswith("eagle"):
        assert not (bad_files / "eagle_run").exists()  # refused before the workdir is made
    if name.startswith("teacher"):
        assert not (bad_files / "teacher_run").exists()


def test_read_only_workdir_and_read_only_checkpoint_are_one_line_and_exit_2(env, reference, tmp_path):
    workdir = tmp_path / "ro"
    shutil.copytree(reference, workdir)
    with read_only(workdir):
        proc = subprocess.run(command(workdir, "--config.train.steps=70"), env=env, capture_output=True, text=True,
                              timeout=TIMEOUT)
    assert_one_line(proc, 2, ["cannot write to workdir", str(workdir)])
    with read_only(workdir / "40"):  # deleted once step 70 is saved (keep_checkpoints=3)
        proc = subprocess.run(command(workdir, "--config.train.steps=70"), env=env, capture_output=True, text=True,
                              timeout=TIMEOUT)
    assert_one_line(proc, 2, [f"{workdir / '40'}", "is read-only", "make it writable"])
    with checkpoint.Checkpoints(workdir, read_only=True) as ckpt:
        assert ckpt.steps() == [40, 50, 60]  # nothing was trained or deleted


DRAFT = ["--config.target.d_model=16", "--config.target.num_layers=1", "--config.target.head_dim=4",
         "--config.target.num_kv_heads=8", "--config.target.d_ff=32", "--config.target.init_seed=1"]


def test_distillation_reaches_the_teacher_faster_than_lm_training(env, reference, tmp_path):
    """Same student (tiny's draft model), data, steps and learning rate; one run learns
    from the teacher's distribution (distill_weight=1), the other from the tokens only
    (distill_weight=0; the KL is still measured). After 30 steps distillation must have
    at most 70% of the LM-trained student's validation KL(teacher || student)
    (observed: 0.21 vs 0.39 nats)."""
    student = DRAFT + ["--config.train.steps=30", "--config.train.learning_rate=0.03",
                       "--config.train.teacher=tiny", f"--config.train.teacher_checkpoint={reference}"]
    config = load_config("tiny", [a[len("--config."):] for a in OVERRIDES + student])
    assert config.target == load_config("tiny").draft and config.train.steps == 30
    kl = {}
    for weight in (1.0, 0.0):
        workdir = tmp_path / f"w{weight}"
        run_to_end(env, workdir, *student, f"--config.train.distill_weight={weight}")
        assert [e["event"] for e in events(workdir)] == ["start", "done"]
        kl[weight] = read_metrics(workdir, "val")[30]["val_kl"]
    assert kl[1.0] < 0.7 * kl[0.0], kl


HEADS_STEPS = 30
HEADS = ["--config.train.learning_rate=0.01", f"--config.train.steps={HEADS_STEPS}"]


# EAGLE-3 trains on 128 greedy samples of the teacher (self-distillation; greedy, so that
# `test_self_distillation_trains_on_the_teachers_samples` can check them with a forward),
# each 16 corpus tokens continued to seq_len + 1 = 33 tokens, 2% of them for validation.
SELF_DISTILL = ["--config.train.self_distill=128", "--config.train.self_distill_prompt=16",
                "--config.train.val_fraction=0.02", "--config.sampling.temperature=0"]


def heads_command(reference, workdir, kind="medusa"):
    overrides = [o for o in OVERRIDES if not o.startswith("--config.train.steps=")]
    # The EAGLE layers at half the target's width, with a draft vocabulary of half its tokens.
    eagle = ["--config.heads.width=16", "--config.heads.draft_vocab=16"] if kind != "medusa" else []
    return [sys.executable, "-m", "specjax.train", f"--config=tiny_{kind}", f"--workdir={workdir}", "--noprogress",
            *overrides, *HEADS, *eagle, *(SELF_DISTILL if kind == "eagle3" else []),
            f"--config.train.teacher_checkpoint={reference}"]


@pytest.fixture(scope="module", params=["medusa", "eagle", "eagle3"])
def heads_reference(request, env, reference, tmp_path_factory):
    workdir = tmp_path_factory.mktemp(request.param)
    proc = subprocess.run(heads_command(reference, workdir, request.param), env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return request.param, workdir


def test_heads_learn_the_frozen_targets_later_tokens(heads_reference, reference):
    """Medusa heads start as zero blocks, i.e. each guesses token t+1+m with the target's
    own distribution for t+1: far from the target's distribution at t+1+m on a Markov
    chain with few likely successors. The KL cannot reach 0 (head m does not see the m
    tokens in between, which the target's distribution at t+1+m depends on); 30 steps
    must take it down by a quarter (observed: 1.84 -> 1.12 nats). The EAGLE layer (random
    at first) sees the token in between: its KL must fall to a quarter (observed: 2.10 -> 0.30);
    the EAGLE-3 layer's too, on the teacher's samples (observed: 2.30 -> 0.19), and its KL at
    the training-time test's last step (from its third feature of its own) with it
    (observed: 3.75 -> 0.19)."""
    kind, heads_reference = heads_reference
    records = read_metrics(heads_reference)
    first, last = records[LOG_EVERY]["kl"], records[HEADS_STEPS]["kl"]
    assert last < (0.75 if kind == "medusa" else 0.25) * first, (first, last)
    assert [e["event"] for e in events(heads_reference)] == ["start", "done"]
    with checkpoint.Checkpoints(heads_reference, read_only=True) as ckpt:
        meta = ckpt.meta(HEADS_STEPS)
    assert meta["heads"]["kind"] == kind
    assert meta["model"] == dataclasses.asdict(load_config("tiny").target)
    if kind == "eagle":  # the draft vocabulary: the training split's 16 most frequent tokens, most frequent first
        train, _ = data.split_train_val(corpus.synthetic_tokens(32), load_config("tiny").train.val_fraction)
        ranked = sorted(collections.Counter(train.tolist()).items(), key=lambda kv: (-kv[1], kv[0]))
        assert meta["draft_vocab"] == [token for token, _ in ranked[:16]]
        assert meta["heads"]["width"] == 16
    if kind == "eagle3":
        assert records[HEADS_STEPS]["kl_last"] < 0.25 * records[LOG_EVERY]["kl_last"]
        # held out too (`val_kl_last` beside `val_kl`): the deepest step's KL is what its later drafts keep
        val = read_metrics(heads_reference, "val")[HEADS_STEPS]
        assert 0 < val["val_kl"] < 0.5 and 0 < val["val_kl_last"] < 0.5, val  # observed 0.19, 0.20
        assert (meta["heads"]["ttt_steps"], meta["heads"]["feature_layers"]) == (3, [])


@pytest.mark.parametrize("heads_reference", ["eagle3"], indirect=True)  # the test's depth is an EAGLE layer's
def test_resuming_heads_names_the_settings_that_changed(heads_reference, reference, env, tmp_path):
    """A heads run resumed with other settings says which: the train settings and the heads'
    own (heads.ttt_steps changes no param's shape, so nothing else would tell), as saved ->
    now; a resume with none changed names none."""
    kind, workdir = heads_reference
    copy = tmp_path / "resumed"
    shutil.copytree(workdir, copy)
    (copy / "train.lock").unlink(missing_ok=True)
    command = [a for a in heads_command(reference, copy, kind) if not a.startswith("--config.train.steps=")]
    same = subprocess.run(command + [f"--config.train.steps={HEADS_STEPS}"], env=env, capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert same.returncode == 0 and "changed since" not in same.stdout + same.stderr, same.stdout + same.stderr
    proc = subprocess.run(command + [f"--config.train.steps={HEADS_STEPS + 1}", "--config.heads.ttt_steps=2"],
                          env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    assert f"settings changed since: steps: {HEADS_STEPS} -> {HEADS_STEPS + 1}; heads.ttt_steps: 3 -> 2)" in said, said


def test_self_distillation_trains_on_the_teachers_samples(heads_reference, reference):
    """train.self_distill: the training stream (samples.npz in the workdir) is 128 samples
    of 33 tokens, each 16 consecutive tokens of the corpus's training split followed by the
    teacher's greedy continuation (checked by the teacher's own forward over the sample:
    each continuation token is the argmax after the tokens before it)."""
    kind, workdir = heads_reference
    if kind != "eagle3":
        pytest.skip("the EAGLE-3 run trains on the teacher's samples")
    with np.load(workdir / "samples.npz") as saved:
        rows = saved["tokens"].reshape(128, 33)
    train, _ = data.split_train_val(corpus.synthetic_tokens(32), 0.02)
    for prompt in rows[:, :16]:
        starts = np.flatnonzero(train[:len(train) - 15] == prompt[0])
        assert any(np.array_equal(train[s:s + 16], prompt) for s in starts), prompt
    mesh = jax.make_mesh((1, 1), ("data", "model"), devices=jax.devices()[:1],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    teacher = checkpoint.load_lm(load_config("tiny").target, mesh, reference)
    from specjax.model import full_forward
    greedy = np.asarray(jax.numpy.argmax(full_forward(teacher, jax.numpy.asarray(rows[:, :-1])), axis=-1))
    np.testing.assert_array_equal(greedy[:, 15:], rows[:, 16:])
    assert len({tuple(r) for r in rows[:, 16:]}) > 1  # different prompts, different continuations


@pytest.mark.slow  # the trainer's resume path is the model's, tested by default above
def test_heads_resume_exactly_after_kill_9(env, reference, heads_reference, tmp_path):
    kind, heads_reference = heads_reference
    if kind == "eagle":
        pytest.skip("the trainer path is Medusa's; EAGLE-3's adds the training-time test and the teacher's samples")
    workdir = tmp_path / "heads"
    log = open(f"{workdir}.log", "w")
    proc = subprocess.Popen(heads_command(reference, workdir, kind), env=env, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    proc.log = f"{workdir}.log"
    wait_for(proc, lambda: (workdir / "10").is_dir() and last_train_step(workdir) >= 12, "checkpoint 10")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert last_train_step(workdir) < HEADS_STEPS, "the run finished before it was killed: the test proved nothing"
    proc = subprocess.run(heads_command(reference, workdir, kind), env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [e["event"] for e in events(workdir)] == ["start", "resume", "done"]
    for kind, field in (("train", "kl"), ("train", "loss"), ("val", "val_loss")):
        got, ref = read_metrics(workdir, kind), read_metrics(heads_reference, kind)
        assert list(got) == list(ref)
        np.testing.assert_allclose([got[s][field] for s in got], [ref[s][field] for s in ref], rtol=1e-6)
    mesh = jax.make_mesh((1, 1), ("data", "model"), devices=jax.devices()[:1],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    target = load_config("tiny").target
    for a, b in zip(*(jax.tree.leaves(checkpoint.load_heads(target, mesh, w).params) for w in (workdir, heads_reference))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_sample_with_trained_heads_greedy_equals_ars(env, reference, heads_reference, tmp_path):
    """The trained heads load by --draft_checkpoint; greedy SpS emits ArS's tokens."""
    out = tmp_path / "out.jsonl"
    kind, heads_reference = heads_reference
    proc = subprocess.run([sys.executable, "-m", "specjax.sample", f"--config=tiny_{kind}", f"--checkpoint={reference}",
                           f"--draft_checkpoint={heads_reference}", "--prompt_tokens=3,17,5", "--mode=both",
                           "--temperature=0", "--max_new_tokens=24", f"--output={out}",
                           # the run's own precision for the layer over the checkpoint's (float)
                           *(["--config.heads.quantize=int8"] if kind != "medusa" else [])],
                          env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    by_mode = {r["mode"]: r for r in rows}
    assert by_mode["sps"]["tokens"] == by_mode["ars"]["tokens"]
    assert f"{kind} drafter" in proc.stdout + proc.stderr
