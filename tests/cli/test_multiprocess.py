"""Multi-process runs: two JAX processes on 127.0.0.1 (jax.distributed, gloo CPU
collectives, 4 fake devices each) give exactly the greedy tokens of one process with 8
fake devices, through launch/multiprocess.sh and launch/greedy_tokens.py (the same
`specjax.generate` either way: each process feeds its own rows with
jax.make_array_from_process_local_data, outputs are gathered with process_allgather),
compile the program `plan.compile_program` compiles, and reuse it for other prompt
lengths of the same bucket; `specjax.sample` on two processes where only process 0 can
read an input either works (prompt files: read once, shared) or ends both processes with
the same message (checkpoints), never a hang; `specjax.train` on two processes logs the
per-step losses of one process; a sharded Hugging Face import reads only each process's
own slices (launch/hf_load.py)."""
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from clitools import kernels_only_cache
from conftest import TEST_XLA_FLAGS

REPO = pathlib.Path(__file__).resolve().parents[2]
DRIVER = REPO / "launch" / "greedy_tokens.py"
TIMEOUT = 600


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECJAX_") and k != "XLA_FLAGS"}
    # The suite's compile-time flags (the programs are tiny); both sides of the comparison
    # compile with the same flags.
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=TEST_XLA_FLAGS, **extra)
    return env


SLEEP = 8.0  # seconds the last process waits before compiling: many times one run of these programs


@pytest.fixture(scope="module")
def greedy_runs(tmp_path_factory):
    """launch/greedy_tokens.py on two processes (the second starting each mode SLEEP
    seconds late) and on one; their JSON outputs."""
    tmp_path = tmp_path_factory.mktemp("greedy")
    common = ["--config=tiny", "--mode=both", "--batch=4", "--max_new_tokens=12"]
    # Mesh 2x4 across two processes: 'data' splits the batch between the processes (each
    # feeds only its own rows), 'model' shards every layer within a process.
    multi = subprocess.Popen(
        ["bash", str(REPO / "launch" / "multiprocess.sh"), str(DRIVER), *common, "--mesh=2x4",
         f"--sleep_before_compile={SLEEP}", f"--output={tmp_path / 'multi.json'}"],
        cwd=REPO, env=_env(NUM_PROCESSES="2", LOCAL_DEVICES="4", LOG_DIR=str(tmp_path / "logs"),
                           PYTHON=sys.executable),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    single = subprocess.run([sys.executable, str(DRIVER), *common, "--mesh=1x8", "--local_devices=8",
                             f"--output={tmp_path / 'single.json'}"],
                            cwd=REPO, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    multi_out, _ = multi.communicate(timeout=TIMEOUT)
    assert single.returncode == 0, single.stderr[-3000:]
    assert multi.returncode == 0, multi_out[-3000:]
    return json.loads((tmp_path / "single.json").read_text()), json.loads((tmp_path / "multi.json").read_text())


def test_two_processes_give_the_tokens_of_one(greedy_runs):
    one, two = greedy_runs
    assert (one["processes"], one["devices"]) == (1, 8)
    assert (two["processes"], two["devices"]) == (2, 8)
    assert two["prompts"] == one["prompts"] and len({len(p) for p in one["prompts"]}) > 1  # ragged rows
    assert [len(t) for t in one["sps"]] == [12] * 4
    assert two["sps"] == one["sps"] and two["ars"] == one["ars"] == one["sps"]  # greedy SpS == ArS
    for out in (one, two):
        for mode in ("sps", "ars"):  # plan compiles exactly the program generate runs, on 1 process and 2
            assert out[f"{mode}_fingerprint"] == out[f"{mode}_plan_fingerprint"], (out["processes"], mode)
        assert out["compiled_programs"] == 2  # one per mode: other lengths in the bucket reused it


def test_the_timed_run_starts_when_every_process_has_compiled(greedy_runs):
    """Process 1 sleeps SLEEP seconds before its first generate of each mode (which
    compiles), as a pod host that recompiles while worker 0 loads from its cache. Process
    0's reported run time of that generate must stay that of the second one (the same
    compiled program, nobody late): the timed region starts after a barrier and a warm-up.
    The statistic is the share of the sleep that shows up in the timed run: without the
    barrier it is over 1 (the sleep plus process 1's compile: measured 1.5 with a 4 s
    sleep), with it 0 give or take the noise of a run (measured within +-0.2 on a loaded
    2-core machine, where a run took 1-4 s)."""
    _, two = greedy_runs
    for mode in ("sps", "ars"):
        first, second = two[f"{mode}_seconds"]
        assert (first - second) / SLEEP < 0.5, (mode, first, second)
        # The wait shows up where it belongs: process 0's compile seconds are the late
        # process's (they run until every process holds the program).
        assert two[f"{mode}_compile_seconds"] > 0.8 * SLEEP, (mode, two[f"{mode}_compile_seconds"])


def _start(tmp_path, cwds, *args, port):
    """`python -m specjax.sample ARGS` as process i of len(cwds), each in its own working directory."""
    procs, cache = [], kernels_only_cache(tmp_path / "cache")
    for i, cwd in enumerate(cwds):
        env = _env(SPECJAX_COORDINATOR=f"127.0.0.1:{port}", SPECJAX_NUM_PROCESSES=str(len(cwds)),
                   SPECJAX_PROCESS_ID=str(i), PYTHONPATH=str(REPO), SPECJAX_CACHE=str(cache))
        env["XLA_FLAGS"] += " --xla_force_host_platform_device_count=2"
        procs.append(subprocess.Popen([sys.executable, "-m", "specjax.sample", *args], cwd=cwd, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        return [(p.wait(timeout=300), *p.communicate()) for p in procs]
    finally:
        for p in procs:
            p.kill()


@pytest.mark.slow  # the default set's time budget
def test_an_input_only_process_0_can_read_is_shared_or_refused_on_every_process(tmp_path):
    """Relative paths, and each process in its own directory: only process 0's holds the
    prompts file and the checkpoint. The prompts are read once and shared, so the run
    works; the checkpoint must be visible to every process (orbax restores it on each),
    so both processes stop with one message naming the process that cannot see it."""
    import random
    cwds = [tmp_path / "p0", tmp_path / "p1"]
    for d in cwds:
        d.mkdir()
    (cwds[0] / "prompts.jsonl").write_text('{"prompt_tokens": [1, 2, 3]}\n{"prompt_tokens": [4, 5]}\n')
    common = ["--config=tiny", "--mesh=1x4", "--mode=sps", "--max_new_tokens=4", "--noprint_samples"]
    runs = _start(tmp_path, cwds, *common, "--init=random", "--prompts_file=prompts.jsonl", "--batch_size=2",
                  port=random.randint(20000, 40000))
    for rc, out, err in runs:
        assert rc == 0, err[-3000:]
    # Process 0 reports, the other stays quiet (gloo, the CPU collectives, prints its
    # connections to both, sometimes split across lines: look for ours only).
    assert "SpS: 2 samples" in runs[0][1] and "summary" in runs[0][1]
    assert "summary" not in runs[1][1] and "SpS" not in runs[1][1], runs[1][1]

    from specjax.model import init_lm
    from specjax.weights import checkpoint
    from specjax.config import load_config
    from conftest import mesh_for
    checkpoint.save_lm(init_lm(load_config("tiny").target, mesh_for("1x1")), cwds[0] / "ckpt", config_name="tiny")
    runs = _start(tmp_path, cwds, *common, "--mode=ars", "--checkpoint=ckpt", "--prompt_tokens=1,2",
                  port=random.randint(20000, 40000))
    for i, (rc, out, err) in enumerate(runs):
        # gloo (the CPU collectives) announces its connections on stderr; a TPU pod has no such lines.
        lines = [line for line in err.splitlines() if line.strip() and not line.startswith("[Gloo]")]
        assert rc == 2 and len(lines) == 1 and "Traceback" not in err, (i, err[-3000:])
        assert "--checkpoint='ckpt': no checkpoint there (the directory does not exist)" in lines[0], lines[0]
        assert ("on process 1: " in lines[0]) == (i == 0), lines[0]


@pytest.mark.parametrize("source", ["hf", "gguf", "gguf_q8_0"])
def test_two_processes_load_a_sharded_import_reading_only_their_own_slices(source, tmp_path):
    """launch/hf_load.py loads llama_tp (4 safetensors shards, or the float32 GGUF file
    made from them) onto a 1x8 mesh whose 'model' axis spans both processes (4 devices
    each); the safetensors twice: reading the files locally, and through the ranged
    requests a gs:// path gets (with no gap merging, which fixture-sized tensors would
    trigger everywhere). The bytes each process reads, counted at the file reads, must be
    its own shards: the whole of each replicated tensor (norms) and half of every other
    one: vocab-split embeddings, head-split q and o_proj (o_proj split by column: strided
    ranges, not whole rows), mlp-split gate/up/down (down by column), and k/v, whose 4 kv
    heads are duplicated to 8 (one per device: each process reads the 2 file heads its
    copies come from, not all 4). Through the ranged path the code before read each
    column split's whole rows once per device (4 devices: 8x the share). Bound 1.2x; these
    reads are exact. The logits equal transformers'. 'gguf_q8_0': the Q8_0 file made from
    the same tensors, loaded with --quantize=int8 (its blocks taken as stored: codes,
    scales and minimums of each box from one read of its blocks); the same share of that
    file's bytes (before, every process read every quantized tensor whole after the float
    load had read its share: about 1.5x), and its logits transformers' (which dequantized
    the file)."""
    from safetensors import safe_open
    fixture = REPO / "tests" / "fixtures" / "hf" / "llama_tp"
    gguf_dir = REPO / "tests" / "fixtures" / "gguf"
    ref = np.load(gguf_dir / "llama_tp_Q8_0.npz" if source == "gguf_q8_0" else fixture / "reference.npz")
    ids = ",".join(map(str, ref["input_ids"][0]))
    weights = {"hf": [f"--hf={fixture}", "--reads=auto,remote", "--remote_gap_bytes=0"],
               "gguf": [f"--gguf={gguf_dir / 'llama_tp_F32.gguf'}"],
               "gguf_q8_0": [f"--gguf={gguf_dir / 'llama_tp_Q8_0.gguf'}", "--quantize=int8"]}[source]
    proc = subprocess.run(
        ["bash", str(REPO / "launch" / "multiprocess.sh"), str(REPO / "launch" / "hf_load.py"), *weights,
         "--mesh=1x8",
         f"--logits_of={ids}", f"--output={tmp_path / 'load.json'}"],
        cwd=REPO, env=_env(NUM_PROCESSES="2", LOCAL_DEVICES="4", LOG_DIR=str(tmp_path / "logs"),
                           PYTHON=sys.executable),
        capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    out = json.loads((tmp_path / "load.json").read_text())
    total = replicated = 0
    if source == "gguf_q8_0":
        import gguf as gguf_package  # the format's own reader, for the file's tensor sizes
        for t in gguf_package.GGUFReader(str(gguf_dir / "llama_tp_Q8_0.gguf")).tensors:
            if t.name == "rope_freqs.weight":  # llama.cpp's own table, not a model weight
                continue
            total += int(t.n_bytes)
            replicated += int(t.n_bytes) if t.name.endswith("norm.weight") else 0
    for f in fixture.glob("*.safetensors") if source != "gguf_q8_0" else ():
        with safe_open(str(f), framework="numpy") as st:
            for name in st.keys():
                nbytes = st.get_tensor(name).nbytes
                total += nbytes
                if name.endswith("norm.weight"):
                    replicated += nbytes
    share = replicated + (total - replicated) // 2
    assert (out["processes"], out["devices"], out["file_bytes"]) == (2, 8, total)
    for key in ("bytes_read", "bytes_read_remote") if source == "hf" else ("bytes_read",):
        assert len(out[key]) == 2 and all(share <= b <= 1.2 * share for b in out[key]), (key, out[key], share)
    np.testing.assert_allclose(np.array(out["logits"])[0], ref["logits"][0], rtol=0, atol=2e-5)


@pytest.mark.slow  # ~45 s; the default run keeps the 2-process sampling test above
def test_two_processes_train_like_one(tmp_path):
    """`specjax.train` on two processes (mesh 2x4: each feeds its own half of every batch,
    process 0 writes metrics.jsonl, orbax writes the checkpoint from both) logs the
    per-step losses of one process with 8 devices. Fails if the processes fed the same
    rows twice, or skipped rows: each half-batch has its own loss."""
    from specjax.training.workdir import read_metrics
    steps = 6
    common = ["-m", "specjax.train", "--config=tiny", "--noprogress", f"--config.train.steps={steps}",
              "--config.train.seq_len=32", "--config.train.batch_size=8", "--config.train.warmup_steps=2",
              "--config.train.log_every=1", f"--config.train.save_every={steps}",
              "--config.train.eval_every=1000", "--config.train.eval_batches=1",
              "--config.mesh.data=2", "--config.mesh.model=4"]
    cache = dict(SPECJAX_CACHE=str(kernels_only_cache(tmp_path / "cache")))
    multi = subprocess.Popen(
        ["bash", str(REPO / "launch" / "multiprocess.sh"), *common, f"--workdir={tmp_path / 'multi'}"],
        cwd=REPO, env=_env(NUM_PROCESSES="2", LOCAL_DEVICES="4", LOG_DIR=str(tmp_path / "logs"),
                           PYTHON=sys.executable, **cache),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    single_env = _env(**cache)
    single_env["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
    try:
        single = subprocess.run([sys.executable, *common, f"--workdir={tmp_path / 'single'}"],
                                cwd=REPO, env=single_env, capture_output=True, text=True, timeout=TIMEOUT)
        multi_out, _ = multi.communicate(timeout=TIMEOUT)
    finally:
        if multi.poll() is None:
            multi.kill()  # multiprocess.sh's EXIT trap ends its python processes
    assert single.returncode == 0, single.stderr[-3000:]
    assert multi.returncode == 0, multi_out[-3000:]
    one = read_metrics(tmp_path / "single")
    two = read_metrics(tmp_path / "multi")
    assert sorted(one) == sorted(two) == list(range(1, steps + 1))
    losses_one = np.array([one[s]["loss"] for s in one])
    losses_two = np.array([two[s]["loss"] for s in two])
    assert len(set(losses_one.tolist())) == steps  # the loss moves: not a trivially equal constant
    # Not bit-identical: the cross-process (gloo) reductions add in another order, and a
    # few steps differ in the last bit (measured: |rel diff| <= 1e-7).
    np.testing.assert_allclose(losses_two, losses_one, rtol=1e-5, atol=0)
    # The end-of-run validation (the evaluation batches are split between processes too).
    val_one, val_two = (read_metrics(tmp_path / w, "val") for w in ("single", "multi"))
    assert list(val_one) == list(val_two) == [steps]
    np.testing.assert_allclose(val_two[steps]["val_loss"], val_one[steps]["val_loss"], rtol=1e-5, atol=0)
    # Both runs left the final checkpoint.
    assert (tmp_path / "multi" / str(steps)).exists() and (tmp_path / "single" / str(steps)).exists()
