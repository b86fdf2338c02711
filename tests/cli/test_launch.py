"""launch/tpu_pod.sh in dry-run mode (nobody here has a pod): the commands it would run
install a Python that jax accepts on every worker, with jax[tpu], specjax and gcsfs in one
resolve under setup.py's jax pin, pass a checkpoint path every worker sees, free the TPU
before each run, and start the same sample command on all of them; each TPU generation
gets its own accelerator type and runtime image."""
import ast
import importlib.metadata
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tempfile

import pytest

from clitools import xla_flags

REPO = pathlib.Path(__file__).resolve().parents[2]


def dry_run(**env) -> dict[str, list[list[str]]]:
    """{step: [argv of each gcloud command]} as DRY_RUN=1 prints them; the run leaves
    nothing in the temporary directory."""
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(["bash", str(REPO / "launch" / "tpu_pod.sh")], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,  # one stream: step headers stay in order
                              env={**os.environ, "DRY_RUN": "1", "PROJECT": "demo", "TMPDIR": tmp, **env},
                              timeout=120)
        assert proc.returncode == 0, proc.stdout
        assert not os.listdir(tmp), os.listdir(tmp)
    steps, step = {}, None
    for line in proc.stdout.splitlines():
        if line.startswith("== "):
            step = line[3:]
            steps[step] = []
        elif line.startswith("gcloud "):
            steps[step].append(shlex.split(line))
    return steps


def setup_arguments() -> dict:
    """The keyword arguments of setup.py's setup() call (read, not run)."""
    tree = ast.parse((REPO / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    return {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")}


def remote_command(argv: list[str]) -> str:
    return next(a for a in argv if a.startswith("--command="))[len("--command="):]


def test_install_brings_a_python_jax_supports_to_every_worker():
    steps = dry_run()
    scp, ssh = steps["install"]
    assert "--worker=all" in scp and "--worker=all" in ssh
    install = remote_command(ssh)
    assert "uv venv --python 3.11 .venv" in install  # the TPU image's python3 is 3.10
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


def test_install_resolves_jax_tpu_the_package_and_gcsfs_together_under_the_packages_pin():
    """One `uv pip install` holds the package (with its 'gcs' extra: gs:// reads need
    gcsfs) and jax[tpu] with setup.py's own jax requirement, so libtpu, jax and the
    package's other pins come from one resolution (two installs let the second upgrade
    jax past the libtpu the first chose)."""
    setup = setup_arguments()
    [pin] = [r for r in setup["install_requires"] if re.match(r"jax\b", r)]
    spec = pin[len("jax"):].replace(" ", "")
    assert spec.startswith(">=") and "<" in spec, pin  # a range with an upper bound: a pin, not a floor
    assert any("gcsfs" in r or "epath-gcs" in r for r in setup["extras_require"]["gcs"]), setup["extras_require"]
    install = remote_command(dry_run()["install"][1])
    installs = [c.strip() for c in install.split(";") if "pip install" in c]
    assert len(installs) == 1, installs
    words = shlex.split(installs[0])
    assert ".[gcs]" in words and f"jax[tpu]{spec}" in words, words
    pinned = remote_command(dry_run(JAX_VERSION="0.10.1")["install"][1])
    assert "jax[tpu]==0.10.1" in shlex.split(pinned.split("uv pip install")[1].split(";")[0])


def test_every_run_frees_the_tpu_before_starting_python():
    """A run interrupted with Ctrl-C leaves a process holding the TPU, or libtpu's lock
    file: the run step ends the holders of /dev/accel* (v4) and /dev/vfio/* (v5e and
    later) and removes /tmp/libtpu_lockfile on every worker, before python starts."""
    [ssh] = dry_run()["run"]
    run = remote_command(ssh)
    python = run.index(".venv/bin/python")
    for piece in ("lsof -t -w /dev/accel* /dev/vfio/[0-9]*", "xargs sudo kill -9", "rm -f /tmp/libtpu_lockfile"):
        assert piece in run[:python], piece


def test_each_generation_gets_its_accelerator_and_runtime_and_a_shared_compilation_cache():
    for generation, accelerator, runtime, zone in (("v4", "v4-32", "tpu-ubuntu2204-base", "us-central2-b"),
                                                   ("v5e", "v5litepod-16", "v2-alpha-tpuv5-lite", "us-west4-a"),
                                                   ("v5p", "v5p-32", "v2-alpha-tpuv5", "us-east5-a"),
                                                   ("v6e", "v6e-16", "v2-alpha-tpuv6e", "us-east5-a")):
        [create] = dry_run(GENERATION=generation)["create"]
        assert f"--accelerator-type={accelerator}" in create and f"--version={runtime}" in create, create
        assert f"--zone={zone}" in create, create  # a zone that has the generation
    bad = subprocess.run(["bash", str(REPO / "launch" / "tpu_pod.sh")], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "DRY_RUN": "1", "GENERATION": "v3"}, timeout=60)
    assert bad.returncode == 2 and "GENERATION=v3: allowed are v4, v5e, v5p, v6e" in bad.stderr
    # Weights in a bucket: the compilation cache goes there too, one directory every worker reads.
    [ssh] = dry_run(CONFIG="llama3_70b_1b", HF_TARGET="gs://bkt/70b", HF_DRAFT="gs://bkt/1b")["run"]
    assert "JAX_COMPILATION_CACHE_DIR=gs://bkt/specjax_xla_cache" in shlex.split(remote_command(ssh))


def test_the_compilation_cache_goes_where_every_worker_reads_it(monkeypatch, tmp_path):
    """cli.use_compilation_cache: $JAX_COMPILATION_CACHE_DIR wins (tpu_pod.sh sets one in
    the weights' bucket); a local workdir keeps the per-machine cache; a cloud workdir puts
    it beside the run (WORKDIR/xla_cache), and without the GCS package that is one line
    naming what to install, not an ImportError from fsspec."""
    import importlib.util

    import jax
    from specjax.app import cli
    from specjax.config import UsageError, cache_dir
    before = jax.config.jax_compilation_cache_dir
    try:
        monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
        monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
        cli.use_compilation_cache(tmp_path / "workdir")
        assert jax.config.jax_compilation_cache_dir == str(cache_dir() / "xla")
        jax.config.update("jax_compilation_cache_dir", "/elsewhere")
        monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "given"))
        cli.use_compilation_cache("gs://bkt/run")  # the variable wins: nothing changed here
        assert jax.config.jax_compilation_cache_dir == "/elsewhere"
        monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
        if importlib.util.find_spec("gcsfs") is None:
            with pytest.raises(UsageError, match="gs://bkt/run.*gcsfs"):
                cli.use_compilation_cache("gs://bkt/run")
        else:
            cli.use_compilation_cache("gs://bkt/run/")
            assert jax.config.jax_compilation_cache_dir == "gs://bkt/run/xla_cache"
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


@pytest.mark.parametrize("drafter, parts", [("model", ["speculate", "model proposal", "target pass (5 tokens)"]),
                                            ("ngram", ["speculate", "ngram lookup", "target pass (1 token)"]),
                                            ("model --self_draft=int8", ["speculate", "model proposal",
                                                                         "target pass (5 tokens)"]),
                                            ("eagle", ["speculate", "eagle proposal", "target pass (5 tokens)"]),
                                            ("eagle3", ["speculate", "eagle3 proposal", "target pass (5 tokens)"]),
                                            ("hybrid_eagle3 --config.sampling.pass_width=proposed "
                                             "--context=distinct,repeating",
                                             ["speculate", "hybrid_eagle3 proposal", "target pass (1 token)",
                                              "target pass (5 tokens)"]),
                                            pytest.param("eagle3 --config.sampling.draft_tree=dynamic "
                                                         "--config.sampling.tree_nodes=3",
                                                         ["speculate", "eagle3 tree growth (3 nodes)",
                                                          "target pass (1 token)", "target pass (4 tokens, a tree)",
                                                          "target + warp + tree verify"],
                                                         marks=pytest.mark.slow)])  # the default set's time
def test_loop_parts_times_each_part_of_a_loop(drafter, parts):
    """launch/loop_parts.py on tiny, as the loop runs (the drafter made by `drafters.make`,
    temperature and top-p traced; the draft the config's, the target's own int8 copy, or
    random EAGLE or EAGLE-3 heads; EAGLE-3's stand-in features as wide as its fused layers;
    the lookup-else-layer hybrid with the pass as wide as proposed, on a context where the
    lookup finds nothing and one where it finds K; EAGLE-3 growing a dynamic tree, its pass
    over the tree's nodes and the tree rule): every part compiles, runs and is printed with
    its time."""
    proc = subprocess.run([sys.executable, "launch/loop_parts.py", "--config=tiny", *f"--drafter={drafter}".split(),
                           "--repeats=1", "--cache=256", "--prompt_len=8"], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "XLA_FLAGS": xla_flags(1)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for part in parts + ["the loop's whole body (speculative.loop)"]:
        # A part cheaper than the timer's noise (tiny's 1-token pass) can come out just below 0.
        assert re.search(re.escape(part) + r".* -?[0-9.]+ wall ms per iteration", proc.stdout), proc.stdout
    if "pass_width=proposed" in drafter:
        assert "drafter hybrid_eagle3, K=4" in proc.stdout and ", the pass as proposed" in proc.stdout, proc.stdout
        assert all(re.search(re.escape(part) + rf"[^\n]* \[{c}\] .* wall ms", proc.stdout)
                   for part in parts for c in ("distinct", "repeating")), proc.stdout
    if "dynamic" in drafter:
        assert "drafter eagle3, K=4" in proc.stdout and ", a dynamic tree of 3 nodes" in proc.stdout, proc.stdout
    if "--self_draft" in drafter:  # the draft is the target's own int8 copy, and needs a draft-model drafter
        assert "tiny, self-draft int8: drafter model" in proc.stdout, proc.stdout
        bad = subprocess.run([sys.executable, "launch/loop_parts.py", "--config=tiny", "--drafter=ngram",
                              "--self_draft=int8"], cwd=REPO, capture_output=True, text=True, timeout=600)
        assert bad.returncode == 2 and "--self_draft=int8 names a draft model, and --drafter=ngram uses none" in bad.stderr


def test_forward_cost_reports_the_temporaries_and_weight_bytes_of_each_format():
    """launch/forward_cost.py on tiny with the float, int8 and int4 models: a time per T,
    each kind's weight bytes (int8 a quarter of float32's plus a scale per column, int4
    more than int8 off the kernel: a byte per code plus a scale and minimum per group),
    and a row of compiled temporaries per program (what shows a float copy of a quantized
    weight, had XLA made one)."""
    proc = subprocess.run([sys.executable, "launch/forward_cost.py", "--config=tiny", "--tokens=1,2", "--cache=64",
                           "--quantize=none,int8,int4", "--kernels=off", "--steps=2", "--repeats=1",
                           "--bandwidth_mb=0"], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "XLA_FLAGS": xla_flags(1)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    sizes = {k: float(v) for k, v in re.findall(r"^weights (\w+): ([0-9.]+) MB$", proc.stdout, re.M)}
    assert set(sizes) == {"none", "int8", "int4"}, proc.stdout
    assert 0 < sizes["int8"] < sizes["int4"] < sizes["none"], sizes
    table = proc.stdout.split("compiled temporaries per program")[1].splitlines()[1:]
    rows = [line.split() for line in table if line.strip()]
    assert [r[1] for r in rows] == ["off", "off/int8", "off/int4"], proc.stdout
    assert all(len(r) == 4 and all(float(v) >= 0 for v in r[2:]) for r in rows), proc.stdout



def test_parallel_ceiling_bound_is_the_best_blind_proposal_not_the_marginal():
    """launch/parallel_ceiling.py's bound on what a drafter blind to x_1 can get accepted at
    position 2, on cases solved by hand: rows (the target's q_2 after each x_1) weighted 0.7
    and 0.3. Disjoint point masses: the best proposal is the heavier row's token, 0.7. Rows
    (1, 0) and (0.5, 0.5): the marginal (0.85, 0.15) is accepted with 0.7 * 0.85 + 0.3 * 0.65
    = 0.79, the point mass on the first token with 0.7 + 0.3 * 0.5 = 0.85, the maximum (each
    unit of m on token 0 gains 1 up to 0.5, then 0.7; on token 1, 0.3)."""
    sys.path.insert(0, str(REPO / "launch"))
    try:
        from parallel_ceiling import dual_bound
    finally:
        sys.path.remove(str(REPO / "launch"))
    import numpy as np
    w = np.array([0.7, 0.3])
    assert dual_bound(w, np.array([[1.0, 0.0], [0.0, 1.0]])) == pytest.approx(0.7, abs=1e-9)
    assert dual_bound(w, np.array([[1.0, 0.0], [0.5, 0.5]])) == pytest.approx(0.85, abs=1e-9)
    assert dual_bound(w, np.array([[0.2, 0.8], [0.2, 0.8]])) == pytest.approx(1.0, abs=1e-9)  # one row: m = q


@pytest.mark.slow  # the default set's time budget
def test_parallel_ceiling_reports_positions_two_and_three():
    """The script end to end on tiny (random weights, no tokenizer: random prompts), depth 3
    with 6 candidates (36 rows a context: a full forward of 32 and one padded):
    each position's bound and the marginal's acceptance in [0, 1], the bound at least the
    marginal's, and the estimate per K; bad flags get one line and exit 2."""
    proc = subprocess.run([sys.executable, "launch/parallel_ceiling.py", "--config=tiny", "--init=random",
                           "--num_prompts=2", "--max_new_tokens=8", "--contexts=3", "--candidates=6", "--depth=3"],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "XLA_FLAGS": xla_flags(1)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = re.findall(r"position (\d), blind to x_<\d: at most ([0-9.]+) .*the marginal's ([0-9.]+)", proc.stdout)
    assert [f[0] for f in found] == ["2", "3"], proc.stdout
    for _, best, marginal in found:
        assert 0 <= float(marginal) <= float(best) + 1e-6 <= 1 + 1e-6, proc.stdout
    assert re.search(r"K=2 [0-9.]+, .*K=8 [0-9.]+", proc.stdout), proc.stdout
    with tempfile.TemporaryDirectory() as tmp:  # the contexts from a prompts file's continuations
        path = pathlib.Path(tmp) / "p.jsonl"
        path.write_text('{"prompt_tokens": [1, 2, 3]}\n{"prompt_tokens": [4, 5]}\n')
        proc = subprocess.run([sys.executable, "launch/parallel_ceiling.py", "--config=tiny", "--init=random",
                               f"--prompts_file={path}", "--max_new_tokens=8", "--contexts=2", "--candidates=3"],
                              cwd=REPO, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "XLA_FLAGS": xla_flags(1)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tiny: 2 contexts" in proc.stdout and "position 2, blind to x_<2: at most" in proc.stdout, proc.stdout
    bad = subprocess.run([sys.executable, "launch/parallel_ceiling.py", "--config=tiny", "--init=random", "--depth=4"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "--depth=4: must be 2 or 3" in bad.stderr, bad.stderr[-2000:]
    wide = subprocess.run([sys.executable, "launch/parallel_ceiling.py", "--config=tiny", "--init=random", "--depth=3",
                           "--candidates=65"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert wide.returncode == 2 and "--candidates=65 with --depth=3: at most 64" in wide.stderr, wide.stderr[-2000:]


@pytest.mark.parametrize("name", ["chat_requests.jsonl", "chat_requests_prose.jsonl"])
def test_the_chat_requests_hold_none_of_the_held_out_prompts(name):
    """launch/chat_requests.jsonl and its prose set (the requests SmolLM2's layers train on)
    are prompts files of the four held-out kinds, and share no run of 8 words with what a
    held-out prompt (launch/real_prompts.jsonl) asks about: its code, its paragraph, its
    question (the instructions, such as "Complete this Python function.", are shared on
    purpose); the control: the held-out file shares them with itself."""
    from specjax.app.prompts import read_prompts_file

    def shingles(text):
        words = text.split()
        return {tuple(words[i:i + 8]) for i in range(len(words) - 7)}

    held_out = [json.loads(line) for line in (REPO / "launch" / "real_prompts.jsonl").read_text().splitlines()]
    requests = [json.loads(line) for line in (REPO / "launch" / name).read_text().splitlines()]
    assert len(read_prompts_file(str(REPO / "launch" / name))) == len(requests) >= 1536
    assert {r["name"] for r in requests} == {h["name"] for h in held_out}
    held = set().union(*(shingles(h["prompt"].split("\n\n", 1)[-1]) for h in held_out))
    assert all(shingles(h["prompt"]) & held for h in held_out)
    assert not [r["prompt"][:60] for r in requests if shingles(r["prompt"]) & held]


@pytest.mark.slow  # 25 s, the default set's time: the held-out test above checks both files by default
def test_the_prose_requests_are_the_requests_but_english_summaries_and_double_renames():
    """launch/chat_requests.py remakes both committed request files from the committed
    paragraphs (the old one unchanged by the prose set's options), and the prose set differs
    where it says: most summaries are of SmolLM2's English paragraphs, some edits rename a
    function and a variable at once; the everyday questions are the same."""
    sys.path.insert(0, str(REPO / "launch"))
    try:
        import chat_requests
    finally:
        sys.path.remove(str(REPO / "launch"))
    read = lambda name: [json.loads(line) for line in (REPO / "launch" / name).read_text().splitlines()]  # noqa: E731
    old, prose = read("chat_requests.jsonl"), read("chat_requests_prose.jsonl")
    assert chat_requests.requests() == old
    assert chat_requests.requests(str(REPO / "launch" / "paragraphs.jsonl")) == prose
    kinds = lambda rs, kind: [r for r in rs if r["name"] == kind]  # noqa: E731
    english = [r for r in kinds(prose, "summary") if r["source"].startswith("paragraph: ")]
    assert len(english) > len(kinds(prose, "summary")) / 2 and not any(
        r["source"].startswith("paragraph: ") for r in old)
    both_names = r"Rename the function `\w+` to `\w+` and the variable"
    both = lambda rs: [r for r in kinds(rs, "code_edit") if re.match(both_names, r["prompt"])]  # noqa: E731
    assert len(both(prose)) > 20 and not both(old)
    assert kinds(prose, "chat") == kinds(old, "chat")


@pytest.mark.parametrize("steps, message", [("specjx", "STEPS has 'specjx': each must be one of: build convert "
                                                       "quantize specjax bench lookup"),
                                            ("specjax bnch", "STEPS has 'bnch'"),
                                            ("", "STEPS is empty: name one or more of: build convert")])
def test_real_model_refuses_steps_it_does_not_have_before_doing_anything(steps, message, tmp_path):
    """launch/real_model.sh with a misspelled or empty STEPS: one line naming it and the
    steps there are, exit 2, nothing built or written (an empty STEPS once ran every step,
    the llama.cpp build included; a misspelled one ran nothing and said so nowhere)."""
    out = tmp_path / "out"
    proc = subprocess.run(["bash", "launch/real_model.sh"], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "STEPS": steps, "OUT": str(out), "SPECJAX_CACHE": str(tmp_path)})
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())
