"""launch/tpu_pod.sh in dry-run mode (nobody here has a pod): the commands it would run
install a Python that jax accepts on every worker, pass a checkpoint path every worker
sees, and start the same sample command on all of them."""
import importlib.metadata
import os
import pathlib
import shlex
import subprocess

REPO = pathlib.Path(__file__).resolve().parent.parent


def dry_run(**env) -> dict[str, list[list[str]]]:
    """{step: [argv of each gcloud command]} as DRY_RUN=1 prints them."""
    proc = subprocess.run(["bash", str(REPO / "launch" / "tpu_pod.sh")], cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True,  # one stream: step headers stay in order
                          env={**os.environ, "DRY_RUN": "1", "PROJECT": "demo", **env}, timeout=120)
    assert proc.returncode == 0, proc.stdout
    steps, step = {}, None
    for line in proc.stdout.splitlines():
        if line.startswith("== "):
            step = line[3:]
            steps[step] = []
        elif line.startswith("gcloud "):
            steps[step].append(shlex.split(line))
    return steps


def remote_command(argv: list[str]) -> str:
    return next(a for a in argv if a.startswith("--command="))[len("--command="):]


def test_install_brings_a_python_jax_supports_to_every_worker():
    steps = dry_run()
    scp, ssh = steps["install"]
    assert "--worker=all" in scp and "--worker=all" in ssh
    install = remote_command(ssh)
    assert "uv venv --python 3.11 .venv" in install  # the TPU image's python3 is 3.10
    assert "jax[tpu]==" in install and "uv pip install --python .venv/bin/python ." in install
    python = importlib.metadata.metadata("specjax")["Requires-Python"]
    assert python == ">=3.11", python  # what jax 0.10 needs, so pip refuses older Pythons up front


def test_run_passes_one_shared_checkpoint_path_to_every_worker():
    steps = dry_run(CHECKPOINT="gs://bucket/chinchilla", DRAFT_CHECKPOINT="gs://bucket/draft")
    [ssh] = steps["run"]
    assert "--worker=all" in ssh
    run = shlex.split(remote_command(ssh))
    assert "SPECJAX_DISTRIBUTED=auto" in run and run[run.index("-m") + 1] == "specjax.sample"
    assert "--checkpoint=gs://bucket/chinchilla" in run and "--draft_checkpoint=gs://bucket/draft" in run
    assert "--init=random" not in run
    [random_run] = dry_run()["run"]
    assert "--init=random" in shlex.split(remote_command(random_run))
