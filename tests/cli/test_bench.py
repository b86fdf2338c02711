"""`specjax.bench` end to end on `tiny` (real CLI in a subprocess): JSON and Figure-1 PNG;
the per-token time after the first token from hand-made run results."""
import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
from clitools import xla_flags

from specjax.analysis import timing
from specjax.decode.metrics import Result

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_bench_writes_json_and_png(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "fig1.png"
    env = dict(os.environ, XLA_FLAGS=xla_flags(1), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "specjax.bench", "--config=tiny", "--init=random",
                           "--lookahead=2", "--batch_sizes=1,2", "--num_prompts=2", "--prompt_len=5",
                           "--max_new_tokens=12", "--repeats=2", "--verify=tokenwise,block", "--drafter=model,ngram",
                           f"--json={out}", f"--plot={png}"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [(row["lookahead"], row["drafter"], row["verify"]) for row in report["sps"]] == [
        (2, "model", "tokenwise"), (2, "model", "block"), (2, "ngram", "tokenwise"), (2, "ngram", "block")]
    assert set(report["lookup_ms"]) == {"ngram"}
    for row in report["sps"]:
        assert 0 <= row["acceptance_rate"] <= 1
        assert 1 <= row["tokens_per_loop"] <= row["lookahead"] + 1
        assert row["p50"] <= row["p90"] <= row["p99"]
        # Over the ArS runs made next to this K's, prompt by prompt (not one ArS run at the start).
        assert row["ars_ms_per_token"] > 0 and row["speedup"] == pytest.approx(row["ars_ms_per_token"]
                                                                                / row["ms_per_token"])
    assert report["ars"]["tokens_per_loop"] == 1.0  # one token per ArS step, by definition
    # Timed, not compared (a tiny model's runs are within noise of one step): the prompts'
    # first tokens, each SpS mode's own (its drafter's prefill and one loop) and every row's
    # rate after them are reported.
    assert report["first_token_ms"] > 0 and all(row["first_token_ms"] > 0 for row in report["sps"])
    # (tiny's rates after the first token are within the noise of a first token: either sign)
    assert len(re.findall(r"after the first token -?[0-9.]+ ms/token \(-?[0-9.]+x their -?[0-9.]+\), the first "
                          r"after [0-9.]+ ms, ArS's [0-9.]+\)", proc.stdout)) == 4, proc.stdout
    for row in report["sps"]:  # after each mode's own first token, against the ArS runs next to it
        assert np.isfinite(row["speedup_after_first"])
    assert all(np.isfinite(row["ms_per_token_after_first"]) for row in [report["ars"], *report["sps"]])
    # The batch rows run every variant compared (they ran the config's drafter alone).
    assert [(row["batch"], row["drafter"], row["verify"]) for row in report["batch"]] == [
        (2, "model", "tokenwise"), (2, "model", "block"), (2, "ngram", "tokenwise"), (2, "ngram", "block")]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_batch_rows_run_the_drafter_asked_for_not_the_configs(tmp_path):
    """tiny_medusa's own drafter is medusa; --drafter=ngram ran a whole bench, then its
    batch row asked for Medusa heads and failed."""
    out = tmp_path / "bench.json"
    env = dict(os.environ, XLA_FLAGS=xla_flags(1), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "specjax.bench", "--config=tiny_medusa", "--init=random",
                           "--drafter=ngram", "--lookahead=2", "--batch_sizes=1,2", "--num_prompts=1",
                           "--prompt_len=5", "--max_new_tokens=4", "--repeats=1", f"--json={out}"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [(row["batch"], row["drafter"]) for row in json.loads(out.read_text())["batch"]] == [(2, "ngram")]


def ars_result(seconds: float, new: int) -> Result:
    return Result(tokens=[[0] * new], mode="ars", lookahead=0, loops=np.array([new]), num_new=np.array([new]),
                  accepted=np.array([0]), accepted_at=np.zeros((1, 0)), histogram=np.zeros((1, 1)),
                  seconds=seconds, compile_seconds=0.0)


def test_time_after_the_first_token_leaves_out_each_prompts_first_token():
    """Two prompts whose first tokens take 0.1 s and 0.3 s, each run twice (the results
    cycle through the prompts, as the bench makes them): 11 tokens in 1.1 s and 1.3 s, then
    in 1.2 s and 1.4 s. Over the whole runs 5.0 s / 44 tokens; after each run's first token
    (5.0 - 2 * 0.4) s / 40 tokens = 105 ms."""
    runs = [ars_result(1.1, 11), ars_result(1.3, 11), ars_result(1.2, 11), ars_result(1.4, 11)]
    row = timing.describe(runs, first=[0.1, 0.3])
    assert row["ms_per_token"] == pytest.approx(5000 / 44)
    assert row["ms_per_token_after_first"] == pytest.approx(105.0)
    assert "ms_per_token_after_first" not in timing.describe(runs)
    assert timing.describe([ars_result(0.2, 1)], first=[0.2])["ms_per_token_after_first"] is None


@pytest.mark.slow
def test_bench_compares_draft_heads(tmp_path):
    """Random Medusa heads (a chain and a tree) and a random EAGLE layer (a chain only)."""
    out = tmp_path / "bench.json"
    env = dict(os.environ, XLA_FLAGS=xla_flags(1), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "specjax.bench", "--config=tiny", "--init=random", "--lookahead=2",
                           "--num_prompts=1", "--prompt_len=5", "--max_new_tokens=8", "--repeats=1",
                           "--drafter=medusa,eagle", "--num_drafts=1,2", f"--json={out}"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["sps"]
    assert [(row["drafter"], row["num_drafts"]) for row in rows] == [("medusa", 1), ("medusa", 2), ("eagle", 1)]
    assert all(row["tokens_per_loop"] >= 1 for row in rows)


@pytest.mark.slow
def test_bench_compares_chains_and_dynamic_trees(tmp_path):
    """--draft_tree=chains,dynamic: one line each for the draft model and a random EAGLE
    layer, the dynamic ones scored as a pass over the tree's N + 1 nodes."""
    out = tmp_path / "bench.json"
    env = dict(os.environ, XLA_FLAGS=xla_flags(1), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "specjax.bench", "--config=tiny", "--init=random", "--lookahead=2",
                           "--num_prompts=1", "--prompt_len=5", "--max_new_tokens=8", "--repeats=1",
                           "--drafter=model,eagle", "--draft_tree=chains,dynamic", "--tree_nodes=4", f"--json={out}"],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [(row["drafter"], row["draft_tree"]) for row in report["sps"]] == [
        ("model", "chains"), ("model", "dynamic"), ("eagle", "chains"), ("eagle", "dynamic")]
    assert all(row["tokens_per_loop"] >= 1 for row in report["sps"])
    assert "dynamic 4" in report["target_scoring_ms"] and "dynamic tree of 4" in proc.stdout
    trees = [line for line in proc.stdout.splitlines() if "dynamic tree of 4:" in line]
    assert len(trees) == 2 and all("the target scoring 5 tokens" in line for line in trees), proc.stdout
    chains = [line for line in proc.stdout.splitlines() if line.startswith("K=2") and "dynamic" not in line]
    assert len(chains) == 2 and all("the target scoring 3 tokens" in line for line in chains), proc.stdout


def test_bench_compares_full_passes_with_passes_as_proposed(tmp_path):
    """--pass_width=full,proposed: one line each; on random ids the lookup seldom finds
    anything, so its passes as proposed score about one position a loop, the full ones
    K + 1."""
    out = tmp_path / "bench.json"
    env = dict(os.environ, XLA_FLAGS=xla_flags(1), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "specjax.bench", "--config=tiny", "--init=random", "--lookahead=2",
                           "--num_prompts=1", "--prompt_len=5", "--max_new_tokens=8", "--repeats=1",
                           "--drafter=ngram", "--pass_width=full,proposed", f"--json={out}"],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["sps"]
    assert [row["pass_width"] for row in rows] == ["full", "proposed"]
    assert rows[0]["scored_per_loop"] == 3 and 1 <= rows[1]["scored_per_loop"] < 3, rows
    assert "pass as proposed" in proc.stdout and "positions scored/loop" in proc.stdout


@pytest.mark.parametrize("args, fragment", [
    (["--lookahead=0,2"], "--lookahead='0,2'"),
    (["--num_prompts=0"], "--num_prompts=0: must be a positive integer"),
    (["--repeats=0"], "--repeats=0: must be a positive integer"),
    (["--json=/"], "--json='/': cannot write it, it is a directory"),
    (["--plot=/"], "--plot='/': cannot write it, it is a directory"),
    (["--verify=block,nope"], "--verify='block,nope'"),
    (["--draft_confidence=0,1.5"], "--draft_confidence='0,1.5'"),
    (["--drafter=retrieval"], "--drafter=retrieval needs --datastore=PATH"),
    (["--num_drafts=0,2"], "--num_drafts='0,2'"),
    (["--drafter=ngram", "--num_drafts=2"], "--drafter=ngram: nothing to measure: --num_drafts=2 needs several"),
    (["--drafter=model", "--datastore=/nonexistent.npz"], "--datastore is used only by --drafter=retrieval or hybrid"),
    (["--drafter=model,ngram", "--datastore=/nonexistent.npz"], "(got --drafter=model,ngram)"),
    (["--drafter=retrieval", "--datastore=/nonexistent.npz"], "no such file"),  # sample's checks (locate)
    (["--drafter=ngram", "--ngram=1000"], "ngram=1000: must be an integer in [1, 16]"),
    (["--drafter=ngram", "--ngram=12", "--lookahead=2", "--config.target.max_seq_len=8",
      "--config.draft.max_seq_len=8"], "ngram=12: must be at most the model's context of 8 tokens"),
    (["--lookahead=2,600"], "lookahead=600: must be below the model's context of 512 tokens"),
    (["--num_drafts=32", "--lookahead=2"], "num_drafts=32: must be an integer in [1, 16]"),
    (["--num_drafts=2,16", "--lookahead=2,8"], "num_drafts=16 x lookahead=8 = 128 tree nodes: at most 64"),
    ([f"--hf_target={ROOT / 'tests' / 'fixtures' / 'hf' / 'pair_target'}", "--init=checkpoint"],
     "--drafter=model needs a draft: pass --hf_draft=DIR"),
    (["--self_draft=layers:1,layers:2"], "--self_draft='layers:2': layers:N needs N in 1..1"),
    (["--self_draft=layers:1,,layers:1"], "expected comma-separated self-drafts"),
    (["--self_draft=int4+int8"], "a quantized form given twice"),
    (["--self_draft=int4", "--quantize=int4"], "--self_draft='int4' with --quantize=int4: the target is int4 already"),
    (["--self_draft=layers:1", "--hf_draft=/tmp"], "--self_draft='layers:1' and --hf_draft both name the draft"),
    (["--drafter=medusa", "--lookahead=2,5"], "--lookahead=5 with --drafter=medusa: it proposes at most 4 tokens"),
    (["--drafter=eagle", "--num_drafts=2"], "--drafter=eagle: nothing to measure: --num_drafts=2 needs several "
                                            "chains, which only model, hybrid, medusa, parallel draw"),
    # Every value asked for is measured, or refused (item 5 of the fourth hostile round).
    (["--drafter=model,ngram", "--draft_confidence=0.5"], "--drafter=ngram: nothing to measure"),
    (["--drafter=eagle,medusa", "--num_drafts=2"], "--drafter=eagle: nothing to measure"),
    (["--drafter=ngram", "--self_draft=layers:1,int8"], "--self_draft=layers:1,int8 names a draft model, and "
                                                        "--drafter=ngram uses none"),
    (["--draft_tree=chains,grown"], "--draft_tree='chains,grown'"),
    (["--draft_tree=dynamic", "--tree_nodes=99"], "tree_nodes=99: must be an integer in [1, 64]"),
    (["--drafter=ngram", "--draft_tree=dynamic"], "--drafter=ngram: nothing to measure: --draft_tree=dynamic needs "
                                                  "a drafter that grows trees"),
    (["--drafter=model", "--draft_tree=chains,dynamic", "--num_drafts=2"], "--draft_tree=dynamic: none of"),
    (["--tree_nodes=4"], "--tree_nodes=4 applies to a dynamic draft tree"),
    (["--draft_tree=dynamic", "--verify=tokenwise,block"], "--verify=tokenwise,block picks one chain's acceptance"),
    (["--num_drafts=2", "--verify=tokenwise"], "--num_drafts=2 chains is verified as a tree"),
    (["--pass_width=full,wide"], "--pass_width='full,wide'"),
    (["--pass_width=proposed", "--num_drafts=2"], "--pass_width=proposed: only one chain's pass follows its "
                                                  "proposal, and --num_drafts=2 compares trees only"),
])
def test_bench_rejects_bad_input_before_any_work(args, fragment):
    init = [] if any(a.startswith("--init=") for a in args) else ["--init=random"]
    proc = subprocess.run([sys.executable, "-m", "specjax.bench", "--config=tiny", *init, *args],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert fragment in proc.stderr and "Traceback" not in proc.stderr and proc.stdout == "", proc.stderr
