"""The package as users get it: entry points that can be imported side by side, and a
non-editable install that runs from anywhere with the configs inside it."""
import concurrent.futures
import importlib
import importlib.util
import json
import os
import pathlib
import re
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


SWEEP = "Comma-separated values to compare, each: "
DUMP = """
import json, sys
from absl import flags
from specjax.app.cli import SAMPLING_FLAGS
module = __import__(sys.argv[1], fromlist=["define_flags"])
module.define_flags()
print(json.dumps({n: [flags.FLAGS[n].flag_type(), flags.FLAGS[n].help] for n in SAMPLING_FLAGS if n in flags.FLAGS}))
"""


def test_sampling_flags_have_one_name_type_and_meaning_in_every_command():
    """--lookahead, --drafter, ... are defined once (`cli.define_sampling_flags`): where two
    commands (sample, bench, evaluate, plan) take one, it has the same type and help; bench's sweeps are comma lists whose
    items mean what the single value means elsewhere."""
    commands = ["specjax.sample", "specjax.bench", "specjax.evaluate", "specjax.plan"]

    def dump(module):
        proc = subprocess.run([sys.executable, "-c", DUMP, module], cwd=REPO, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout)

    with concurrent.futures.ThreadPoolExecutor(len(commands)) as pool:
        defined = dict(zip(commands, pool.map(dump, commands)))
    # The help without absl's "<choices>: " prefix and the default's note.
    core = lambda text: re.sub(r"^<[^>]*>: |( \(default: [^)]*\))?\.$", "", text)  # noqa: E731
    assert {"lookahead", "drafter", "verify", "num_drafts", "draft_confidence", "max_new_tokens"} <= set(
        defined["specjax.bench"]) & set(defined["specjax.evaluate"])
    assert {"lookahead", "drafter", "num_drafts", "temperature"} <= set(defined["specjax.plan"])
    for name, (kind, text) in defined["specjax.sample"].items():  # sample takes every one, single-valued
        for module, flags_ in defined.items():
            if name not in flags_:
                continue
            other_kind, other = flags_[name]
            if other.startswith(SWEEP):
                assert other_kind == "string", (module, name)
                other = other[len(SWEEP):]
                other = other[0].upper() + other[1:]
            else:
                assert other_kind == kind, (module, name, other_kind, kind)
            assert core(other) == core(text), (module, name, other, text)


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


def test_the_tpu_extra_on_a_machine_without_a_tpu_writes_nothing_to_stderr():
    """With libtpu installed (the `tpu` extra, for plan --compiler=tpu) and no TPU chip,
    JAX's TPU runtime wrote a screen of errors to stderr on every run before falling back
    to the CPU; `specjax.platform` leaves the TPU out. A JAX_PLATFORMS the user set is
    theirs: with 'tpu,cpu' JAX still tries (and here fails on) the TPU."""
    from specjax import platform
    if importlib.util.find_spec("libtpu") is None or platform.has_tpu_chip():
        pytest.skip("needs libtpu installed (pip install '.[tpu]') on a machine without a TPU chip")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    code = "import specjax, jax; print(jax.devices()[0].platform)"
    for first in (code, "import jax, specjax; print(jax.devices()[0].platform)"):  # a script that imports jax first
        proc = subprocess.run([sys.executable, "-c", first], capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0 and proc.stdout.strip() == "cpu" and proc.stderr == "", proc.stderr[-2000:]
    chosen = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={**env, "JAX_PLATFORMS": "tpu,cpu"})
    assert chosen.returncode != 0 and "tpu" in chosen.stderr.lower()
