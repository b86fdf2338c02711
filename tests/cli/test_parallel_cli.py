"""`--drafter=parallel` from the command line: greedy SpS emits greedy ArS's tokens with a
random parallel draft (`--config.draft.parallel_draft=K` gives tiny's draft its mask
embedding), as chains and as a dynamic tree of 8 nodes; bench prices its proposal as one
pass; and every bad value of the new settings is one line and exit 2 before any weights
are looked for (sample, bench, train)."""
from __future__ import annotations

import json
import pathlib

import pytest
from clitools import assert_one_line, cli_env, run_many

ROOT = pathlib.Path(__file__).resolve().parents[2]
PARALLEL = ["--config=tiny", "--init=random", "--drafter=parallel", "--config.draft.parallel_draft=4"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return cli_env(tmp_path_factory.mktemp("parallel_cli"))


@pytest.mark.parametrize("tree", [pytest.param(["--num_drafts=2"], marks=pytest.mark.slow),  # the default set's time
                                  ["--draft_tree=dynamic", "--tree_nodes=8"]], ids=["two_chains", "dynamic_tree_of_8"])
def test_greedy_sps_equals_greedy_ars(env, tmp_path, tree):
    out = tmp_path / "out.jsonl"
    proc, = run_many("specjax.sample", [(PARALLEL + tree + [
        "--mode=both", "--temperature=0", "--lookahead=4", "--prompt_tokens=1,2,3",
        "--prompt_tokens=4,5,6,7,8", "--max_new_tokens=24", "--noprint_samples", f"--output={out}"], {})],
        env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    tokens = {mode: [r["tokens"] for r in rows if r["mode"] == mode] for mode in ("ars", "sps")}
    assert len(tokens["sps"]) == 2 and tokens["sps"] == tokens["ars"]
    assert all(len(t) == 24 for t in tokens["sps"])
    assert "parallel drafter" in proc.stdout + proc.stderr
    assert tree[0] != "--draft_tree=dynamic" or "a dynamic tree of 8 nodes verified as a tree" in proc.stdout


BAD = [
    ("sample", "a draft without mask tokens", ["--config=tiny", "--init=random", "--drafter=parallel"],
     ["drafter='parallel' needs a parallel draft model", "parallel_draft=0", "--config.draft.parallel_draft=K"]),
    ("sample", "a draft without mask tokens, before weights are looked for",
     ["--config=tiny", "--drafter=parallel", "--checkpoint={tmp}/none", "--draft_checkpoint={tmp}/none"],
     ["drafter='parallel' needs a parallel draft model", "parallel_draft=0"]),
    ("sample", "K above the draft's", PARALLEL[:3] + ["--config.draft.parallel_draft=2", "--lookahead=3"],
     ["--lookahead=3 with --drafter=parallel", "at most 2 tokens a loop"]),
    ("sample", "parallel_draft negative", PARALLEL[:3] + ["--config.draft.parallel_draft=-1"],
     ["ModelConfig.parallel_draft=-1", "integer >= 0"]),
    ("sample", "parallel_draft not an integer", PARALLEL[:3] + ["--config.draft.parallel_draft=many"],
     ["--config.draft.parallel_draft='many'", "not a valid int"]),
    ("bench", "a K of the sweep above the draft's", PARALLEL[:2] + ["--drafter=model,parallel", "--lookahead=2,6",
                                                                    "--config.draft.parallel_draft=4"],
     ["--lookahead=6 with --drafter=parallel", "at most 4 tokens a loop"]),
    ("bench", "a K above the draft's, before weights are looked for",
     ["--config=tiny", "--drafter=parallel", "--lookahead=3", "--config.draft.parallel_draft=2",
      "--checkpoint={tmp}/none", "--draft_checkpoint={tmp}/none"], ["--lookahead=3 with --drafter=parallel"]),
    ("train", "parallel_draft negative", ["--config=tiny", "--config.target.parallel_draft=-2", "--workdir={tmp}/w"],
     ["ModelConfig.parallel_draft=-2", "integer >= 0"]),
    ("train", "a parallel draft exported to Hugging Face", ["--config=tiny", "--config.target.parallel_draft=4",
                                                           "--config.target.ffw=swiglu", "--export_hf={tmp}/hf",
                                                           "--workdir={tmp}/w"],
     ["cannot export a parallel draft model (parallel_draft=4)"]),
    ("train", "init_from without a checkpoint", ["--config=tiny", "--config.target.parallel_draft=4",
                                                 "--config.train.init_from={tmp}/none", "--workdir={tmp}/w"],
     ["train.init_from=", "holds no finished checkpoint"]),
]


@pytest.fixture(scope="module")
def bad_runs(env, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad")
    runs = {}
    for module in ("sample", "bench", "train"):
        cases = [(name, [a.format(tmp=tmp) for a in args]) for m, name, args, _ in BAD if m == module]
        procs = run_many(f"specjax.{module}", [(args + (["--prompt_tokens=1,2,3"] if module == "sample" else []), {})
                                               for _, args in cases], env=env, cwd=ROOT)
        runs.update({(module, name): proc for (name, _), proc in zip(cases, procs)})
    return tmp, runs


@pytest.mark.parametrize("case", BAD, ids=[f"{c[0]}: {c[1]}" for c in BAD])
def test_bad_input_is_one_line_and_exit_2(bad_runs, case):
    module, name, _, fragments = case
    tmp, runs = bad_runs
    proc = runs[(module, name)]
    assert_one_line(proc, 2, fragments, module)
    assert not (tmp / "w").exists()  # nothing written before the input was checked


def test_bench_prices_the_proposal_as_one_pass_of_2k_tokens(env, tmp_path):
    """bench's loop parts: the parallel drafter's proposal is one draft pass of 2K tokens
    (the K+1 re-fed ones and K-1 masks), not K one-token steps as the model drafter's."""
    out = tmp_path / "bench.json"
    args = ["--lookahead=3", "--num_prompts=1", "--prompt_len=5", "--max_new_tokens=8", "--repeats=1", f"--json={out}"]
    proc, = run_many("specjax.bench", [(PARALLEL + args, {})], env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout + proc.stderr
    assert "1 draft pass of 6 tokens" in text and "3 draft steps" not in text, text[-2000:]
    row, = json.loads(out.read_text())["sps"]
    assert row["model_ms_per_loop"] > row["scoring_ms"]  # the draft pass is priced
