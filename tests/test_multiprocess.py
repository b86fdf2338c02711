"""Multi-process sampling: two JAX processes on 127.0.0.1 (jax.distributed, gloo CPU
collectives, 4 fake devices each) give exactly the greedy tokens of one process with 8
fake devices (DESIGN invariant 7), through launch/multiprocess.sh and launch/greedy_tokens.py
(one process: `specjax.generate`; two: `distributed.generate`, which feeds each process's
own rows with jax.make_array_from_process_local_data and gathers with process_allgather)."""
import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
DRIVER = REPO / "launch" / "greedy_tokens.py"
TIMEOUT = 600


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECJAX_") and k != "XLA_FLAGS"}
    # LLVM optimisation level 0 halves the compile time of the tiny programs; both sides
    # of the comparison compile with the same flags.
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_backend_optimization_level=0", **extra)
    return env


def test_two_processes_give_the_tokens_of_one(tmp_path):
    common = ["--config=tiny", "--mode=sps", "--batch=4", "--max_new_tokens=12"]
    # Mesh 2x4 across two processes: 'data' splits the batch between the processes (each
    # feeds only its own rows), 'model' shards every layer within a process.
    multi = subprocess.Popen(
        ["bash", str(REPO / "launch" / "multiprocess.sh"), str(DRIVER), *common, "--mesh=2x4",
         f"--output={tmp_path / 'multi.json'}"],
        cwd=REPO, env=_env(NUM_PROCESSES="2", LOCAL_DEVICES="4", LOG_DIR=str(tmp_path / "logs"),
                           PYTHON=sys.executable),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    single = subprocess.run([sys.executable, str(DRIVER), *common, "--mesh=1x8", "--local_devices=8",
                             f"--output={tmp_path / 'single.json'}"],
                            cwd=REPO, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    multi_out, _ = multi.communicate(timeout=TIMEOUT)
    assert single.returncode == 0, single.stderr[-3000:]
    assert multi.returncode == 0, multi_out[-3000:]
    one = json.loads((tmp_path / "single.json").read_text())
    two = json.loads((tmp_path / "multi.json").read_text())
    assert (one["processes"], one["devices"]) == (1, 8)
    assert (two["processes"], two["devices"]) == (2, 8)
    assert two["prompts"] == one["prompts"] and len({len(p) for p in one["prompts"]}) > 1  # ragged rows
    assert [len(t) for t in one["sps"]] == [12] * 4
    assert two["sps"] == one["sps"]
