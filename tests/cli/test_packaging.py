"""The package as users get it: entry points that can be imported side by side, and a
non-editable install that runs from anywhere with the configs inside it."""
import concurrent.futures
import importlib
import os
import pathlib
import subprocess
import sys

import pytest
from absl import flags

REPO = pathlib.Path(__file__).resolve().parents[2]
MAINS = ["specjax.sample", "specjax.train", "specjax.evaluate", "specjax.bench", "specjax.plan"]


def test_entry_points_import_side_by_side_and_define_flags_only_when_run():
    for module in MAINS:
        importlib.import_module(module)
    ours = [m for m in flags.FLAGS.flags_by_module_dict() if "specjax" in m]
    assert ours == [] and "config" not in flags.FLAGS  # importing defines nothing: two mains never clash
    def helpfull(module):  # run as a program, each defines its own flags
        return subprocess.run([sys.executable, "-m", module, "--helpfull"], cwd=REPO, capture_output=True,
                              text=True, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(len(MAINS)) as pool:
        for module, proc in zip(MAINS, pool.map(helpfull, MAINS)):
            assert "--config" in proc.stdout and "Traceback" not in proc.stderr, (module, proc.stderr[-2000:])


@pytest.mark.slow  # a fresh virtual environment downloads jax and friends (~1-2 min)
def test_a_non_editable_install_samples_from_another_directory(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    pip = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(REPO)], capture_output=True, text=True,
                         timeout=1200)
    assert pip.returncode == 0, pip.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    proc = subprocess.run([str(venv / "bin" / "python"), "-c",
                           "import specjax, runpy, sys; print(specjax.__file__, file=sys.stderr); "
                           "sys.argv = ['sample.py', '--config=tiny', '--init=random', '--prompt_tokens=1,2,3']; "
                           "runpy.run_module('specjax.sample', run_name='__main__')"],
                          cwd=elsewhere, env={**env, "SPECJAX_CACHE": str(tmp_path / "cache")},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert str(venv) in proc.stderr.splitlines()[0]  # the installed copy, not this checkout
    assert "SpS speedup over ArS" in proc.stdout
