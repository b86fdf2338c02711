"""Paper scale on paper, and Chinchilla's relative positions inside the loops.

* `python -m specjax.plan --config=chinchilla_70b` (the real CLI, in a subprocess: it
  needs 16 fake devices) compiles the real SpS and ArS programs for the 70B target and
  the 4B draft on a 1x16 mesh; the tests read its --json: both fit a 32 GiB TPU v4 chip
  at batch 1 with 2048-token caches, the loop has Megatron's all-reduces and nothing
  model-sized besides, the parameter counts are the paper's.
* The HLO collective counter is checked on a hand-written module (nested loops x trip
  counts, the generation loop kept apart from the prefill).
* Relative positions (Transformer-XL, as in Chinchilla): the model equals an independent
  numpy transcription of Dai et al. 2019 eq. 4; K+1 scoring passes with rejected tails
  rolled back equal the full forward at every position of a ragged batch; greedy SpS
  equals greedy ArS token for token.
"""
import dataclasses
import functools
import json
import math
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import kv_cache, model
from specjax.analysis import hlo, roofline
from specjax.config import HeadsConfig, load_config
from conftest import mesh_for
from models import numpy_params, random_lm

REPO = pathlib.Path(__file__).resolve().parents[2]
GiB = 1024 ** 3
K = 4  # chinchilla_70b's lookahead (the paper's Table 1 setting)
TARGET_LAYERS, DRAFT_LAYERS = 80, 8
# All-reduces per SpS loop beyond Megatron's 2 per layer per forward: exactly K+1
# vocab-parallel embedding lookups (one per forward: the scoring pass and K draft steps).
# Warping, sampling and the NaN/inf checks work on gathered logits and add none.
M = 4  # draft chains of the tree loop plan also compiles
ATOL = 1e-4  # float32 logits of magnitude ~1-10; observed max |diff| ~1e-6 (see the tests)


# --------------------------------------------------------------------------- plan, 70B + 4B


@pytest.fixture(scope="module")
def chinchilla(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "chinchilla_70b.json"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    proc = subprocess.run([sys.executable, "-m", "specjax.plan", "--config=chinchilla_70b", f"--num_drafts={M}",
                           f"--json={out}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    print(proc.stdout)
    return json.loads(out.read_text()), proc.stdout


def test_plan_runs_the_paper_setup(chinchilla):
    report, text = chinchilla
    setup = report["setup"]
    assert (setup["data"], setup["model"], setup["batch"], setup["cache_len"], setup["lookahead"]) == (1, 16, 1, 2048, K)
    assert "while-loop-invariant-code-motion" in setup["xla_flags"]
    assert report["programs"]["sps"]["program"] == "sps_program"
    assert report["programs"]["ars_target"]["program"] == "ars_program"
    for needle in ("fits TPU v4", "per SpS loop", "ms/token", "paper Table 1"):
        assert needle in text


def test_paper_models_have_the_paper_sizes(chinchilla):
    models = chinchilla[0]["models"]
    assert 64e9 <= models["target"]["params"] <= 71e9
    assert 3.5e9 <= models["draft"]["params"] <= 4.5e9
    assert models["target"]["pos_encoding"] == models["draft"]["pos_encoding"] == "relative"


def test_70b_and_4b_fit_one_32gib_chip_at_batch_1(chinchilla):
    report = chinchilla[0]
    weights = sum(m["weight_bytes_per_device"] for m in report["models"].values())
    # Every parameter is split 16 ways: bf16 70.3B + 4.3B params / 16 = 8.7 GiB per chip.
    assert weights == pytest.approx(2 * (report["models"]["target"]["params"] + report["models"]["draft"]["params"])
                                    / 16, rel=0.01)
    sps = report["programs"]["sps"]["memory"]
    assert sps["arguments"] == pytest.approx(weights, rel=0.01)  # the params are the arguments
    assert sps["total"] <= 32 * GiB and report["programs"]["sps"]["fits"]
    assert report["programs"]["ars_target"]["memory"]["total"] <= 32 * GiB
    # Temporaries: both KV caches (0.33 GiB/chip) and activations, not a second f32 copy
    # of the stacked weights (what XLA:CPU's loop-invariant code motion would hoist).
    assert sps["temporaries"] < 2 * GiB
    # Nothing model-sized was allocated: the smallest model, the 4B draft, is 8 GiB in bf16.
    # The compiler's own peak is what remains, and it grows with the host's threads (about
    # 1 GiB on 2 cores, 3.9 GiB on a CI host), so the bound sits between the two.
    assert report["peak_rss_bytes"] < 6 * GiB


def _all_reduces(summary):
    return {m["shape"]: m for m in summary.get("all-reduce", {}).get("messages", [])}, \
        summary.get("all-reduce", {}).get("count", 0)


def test_sps_loop_has_exactly_megatron_and_embedding_all_reduces(chinchilla):
    loop = chinchilla[0]["programs"]["sps"]["collectives_per_loop"]
    by_shape, total = _all_reduces(loop)
    megatron = 2 * (TARGET_LAYERS + K * DRAFT_LAYERS)
    # Target: one pass over K+1 tokens: 2 per layer + the embedding lookup.
    assert by_shape[f"f32[1,{K + 1},8192]"]["count"] == 2 * TARGET_LAYERS + 1
    # Draft: K steps (the first feeds 2 tokens, then K-1 scan steps of 1): 2 per layer + 1 each.
    draft = by_shape["f32[1,2,6144]"]["count"] + by_shape["f32[1,1,6144]"]["count"]
    assert by_shape["f32[1,2,6144]"]["count"] == 2 * DRAFT_LAYERS + 1
    assert draft == K * (2 * DRAFT_LAYERS + 1)
    assert total == megatron + (K + 1)
    # No weight is ever gathered: the largest all-gather is the target's K+1 vocab rows (16
    # shards of 2000, each padded to 2048 lanes).
    gathers = loop.get("all-gather", {}).get("messages", [])
    assert max((m["bytes"] for m in gathers), default=0) <= (K + 1) * 16 * 2048 * 4
    assert not {"reduce-scatter", "all-to-all", "collective-permute"} & set(loop)


def test_tree_loop_adds_bytes_not_collectives_and_its_scoring_is_nearly_free(chinchilla):
    """The tree of M chains: the same all-reduces per loop as the chain loop (the target's
    pass is wider, the draft's K steps run over M rows), and on the roofline its 1 + M*K
    token pass costs within 2% of the K+1-token pass (weights and cache dominate)."""
    report, text = chinchilla
    chain, tree = (report["programs"][k]["collectives_per_loop"] for k in ("sps", "sps_tree"))
    _, chain_total = _all_reduces(chain)
    by_shape, tree_total = _all_reduces(tree)
    assert tree_total == chain_total + 0
    assert by_shape[f"f32[1,{1 + M * K},8192]"]["count"] == 2 * TARGET_LAYERS + 1  # ONE tree pass
    assert by_shape[f"f32[{M},{K + 1},6144]"]["count"] == 2 * DRAFT_LAYERS + 1  # the re-feeding first draft step
    roof = report["roofline"]["sps_tree"]
    assert roof["score_tokens"] == 1 + M * K and roof["extra_score_flops"] > 0
    assert roof["score_ms"] < 1.02 * roof["chain_score_ms"]
    assert "Tree loop, 4 drafts" in text


def test_ars_step_has_one_forward_of_all_reduces_and_prefill_is_counted_apart(chinchilla):
    programs = chinchilla[0]["programs"]
    by_shape, total = _all_reduces(programs["ars_target"]["collectives_per_step"])
    assert by_shape["f32[1,1,8192]"]["count"] == 2 * TARGET_LAYERS + 1
    assert total == 2 * TARGET_LAYERS + 1
    prefill, _ = _all_reduces(programs["sps"]["outside_loop"])
    assert prefill["f32[1,128,8192]"]["count"] >= 2 * TARGET_LAYERS  # 128-token prompt, not in the loop


def test_roofline_is_memory_bound_and_spans_the_paper(chinchilla):
    rf = chinchilla[0]["roofline"]
    weights_ms = 1e3 * chinchilla[0]["models"]["target"]["weight_bytes_per_device"] / 1.2e12
    assert weights_ms < rf["ars"]["ms_per_token"] < 14.1  # the paper's 14.1 ms is above the lower bound
    by_alpha = {round(r["alpha"], 2): r for r in rf["sps"]["by_alpha"]}
    assert by_alpha[1.0]["tokens_per_loop"] == K + 1
    assert by_alpha[0.5]["ms_per_token"] > by_alpha[0.9]["ms_per_token"]
    alphas = [row["implied_alpha"] for row in rf["table1"]]
    assert 0.6 < alphas[0] < alphas[1] < alphas[2] < 0.95  # XSum nucleus < XSum greedy < HumanEval
    fitted = chinchilla[0]["roofline_fitted"]
    assert fitted["ars"]["ms_per_token"] == pytest.approx(14.1, rel=1e-6)


def test_roofline_reads_the_position_table_instead_of_w_r(chinchilla):
    """Per step, the Transformer-XL term reads each layer's head shard of the precomputed
    table (80 layers x 64/16 heads x 2048 slots x 128 x 2 bytes = 160 MiB per chip) and no
    W_r (80 x 8192 x 4 x 128 x 2 = 640 MiB, read only at prefill): a step reads less than
    the weights and KV cache, not 2.5 GiB of [S, D] sinusoid tables more."""
    report = chinchilla[0]
    target, draft = report["models"]["target"], report["models"]["draft"]
    rel = report["roofline"]["ars"]["relative"]
    assert rel["table_bytes"] == target["position_table_bytes_per_device"] == 80 * 4 * 2048 * 128 * 2
    assert rel["w_r_bytes"] == 80 * 8192 * 4 * 128 * 2
    assert rel["score_bytes"] == 80 * 2 * 4 * 2048 * 4  # [1, 4, 1, 2048] f32 per layer, written and read
    assert report["roofline"]["draft"]["relative"]["table_bytes"] == draft["position_table_bytes_per_device"] \
        == 8 * 3 * 2048 * 128 * 2
    step = report["roofline"]["ars"]["hbm_bytes"]
    assert step == target["weight_bytes_per_device"] + target["cache_bytes_per_device"] - 640 * 2 ** 20 \
        + 160 * 2 ** 20 + 5 * 2 ** 20


def test_expected_tokens_per_loop_and_its_inverse():
    assert roofline.tokens_per_loop(0.0, 4) == 1.0
    assert roofline.tokens_per_loop(1.0, 4) == 5.0
    assert roofline.tokens_per_loop(0.5, 2) == pytest.approx(1.75)
    for alpha in (0.1, 0.5, 0.71, 0.9):
        assert roofline.implied_alpha(roofline.tokens_per_loop(alpha, 4), 4) == pytest.approx(alpha, abs=1e-9)


# --------------------------------------------------------------------------- HLO counting

HLO = """\
HloModule toy

%add (x: f32[], y: f32[]) -> f32[] {
  ROOT %s = f32[] add(f32[] %x, f32[] %y)
}

%layer (p: (s32[], f32[1,5,64])) -> (s32[], f32[1,5,64]) {
  %ar = f32[1,5,64]{2,1,0} all-reduce(f32[1,5,64]{2,1,0} %a), channel_id=1, replica_groups=mesh['axis_0'=1,'axis_1'=8] {'axis_1'}, use_global_device_ids=true, to_apply=%add
  %ar2 = bf16[1,5,64]{2,1,0} all-reduce-start(bf16[1,5,64]{2,1,0} %b), channel_id=2, replica_groups=[1,8]<=[8], to_apply=%add
  %ard = bf16[1,5,64]{2,1,0} all-reduce-done(bf16[1,5,64]{2,1,0} %ar2)
}

%layer_cond (p: (s32[], f32[1,5,64])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

%gen_body (p: (s32[], f32[1,5,64])) -> (s32[], f32[1,5,64]) {
  %scan = (s32[], f32[1,5,64]) while((s32[], f32[1,5,64]) %t), condition=%layer_cond, body=%layer, backend_config={"known_trip_count":{"n":"3"}}
  %f = f32[1,8]{1,0} fusion(%x), kind=kLoop, calls=%fused
  %ag = f32[1,64]{1,0} all-gather(f32[1,8]{1,0} %f), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={1}
}

%fused (x: f32[1,8]) -> f32[1,8] {
  ROOT %n = f32[1,8]{1,0} negate(f32[1,8]{1,0} %x)
}

%gen_cond (p: (s32[], f32[1,5,64])) -> pred[] {
  %done = pred[1]{0} all-reduce(pred[1]{0} %d), channel_id=4, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, to_apply=%add
}

ENTRY %main (a: f32[1,5,64]) -> f32[1,5,64] {
  %prefill = (s32[], f32[1,5,64]) while((s32[], f32[1,5,64]) %t0), condition=%layer_cond, body=%layer, backend_config={"known_trip_count":{"n":"3"}}
  %gen = (s32[], f32[1,5,64]) while((s32[], f32[1,5,64]) %t1), condition=%gen_cond, body=%gen_body
  ROOT %r = f32[1,5,64]{2,1,0} get-tuple-element(%gen), index=1
}
"""


# The same program with the generation loop one call deeper (XLA:CPU wraps small loops in calls).
HLO_CALLED = HLO.replace(
    "  %gen = (s32[], f32[1,5,64]) while((s32[], f32[1,5,64]) %t1), condition=%gen_cond, body=%gen_body\n",
    "  %gen = (s32[], f32[1,5,64]) call((s32[], f32[1,5,64]) %t1), to_apply=%wrapper\n").replace(
    "ENTRY %main", "%wrapper (t1: (s32[], f32[1,5,64])) -> (s32[], f32[1,5,64]) {\n"
    "  ROOT %loop = (s32[], f32[1,5,64]) while((s32[], f32[1,5,64]) %t1), condition=%gen_cond, body=%gen_body\n"
    "}\n\nENTRY %main")


@pytest.mark.parametrize("text", [HLO, HLO_CALLED], ids=["loop_in_entry", "loop_in_a_call"])
def test_hlo_counter_multiplies_nested_trip_counts_and_separates_the_generation_loop(text):
    assert text.count(" while(") == 3 and (text is HLO) != ("to_apply=%wrapper" in text)
    per_loop, outside = hlo.HloProgram(text).loop_and_outside()
    loop = hlo.summarize(per_loop)
    # Body: a 3-trip layer scan with 2 all-reduces (one async) + the loop condition's 1.
    assert loop["all-reduce"]["count"] == 3 * 2 + 1
    shapes = {m["shape"]: (m["count"], m["bytes"], m["group"]) for m in loop["all-reduce"]["messages"]}
    assert shapes == {"f32[1,5,64]": (3, 5 * 64 * 4, 8), "bf16[1,5,64]": (3, 5 * 64 * 2, 8), "pred[1]": (1, 1, 2)}
    assert loop["all-gather"]["messages"] == [{"shape": "f32[1,64]", "bytes": 256, "group": 8, "count": 1}]
    # Outside: only the prefill's layer scan.
    assert hlo.summarize(outside) == {"all-reduce": {"count": 6, "bytes": 3 * (1280 + 640), "messages": [
        {"shape": "bf16[1,5,64]", "bytes": 640, "group": 8, "count": 3},
        {"shape": "f32[1,5,64]", "bytes": 1280, "group": 8, "count": 3}]}}


@pytest.mark.parametrize("groups,size", [
    ("mesh['axis_0'=1,'axis_1'=8] {'axis_1'}", 8),
    ("mesh['axis_0'=1,'axis_2'=4,'axis_3'=2], device_ids=([2,4]T(1,0)) {'axis_2'}", 4),  # a 2x4 mesh
    ("mesh['axis_0'=2,'axis_1'=4] {'axis_0','axis_1'}", 8),
    ("[2,4]<=[8]", 4), ("{{0,1},{2,3}}", 2)])
def test_group_size_of_each_replica_group_spelling(groups, size):
    assert hlo._group_size(f"%ar = f32[4] all-reduce(f32[4] %a), replica_groups={groups}, to_apply=%add") == size


def test_plan_rejects_a_mesh_the_draft_does_not_divide():
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    proc = subprocess.run([sys.executable, "-m", "specjax.plan", "--config=chinchilla_70b", "--mesh=1x32"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "draft.num_heads=48" in proc.stderr and "32" in proc.stderr and "Traceback" not in proc.stderr


def test_plan_on_one_cpu_device_compiles_the_packed_program(tmp_path):
    """On one CPU device `generate` packs the projections for the few-row kernel; plan
    compiles that program from abstract params (nothing allocated)."""
    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, "-m", "specjax.plan", "--config=tiny", "--mesh=1x1", f"--json={out}"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and json.loads(out.read_text())


def test_plan_prices_the_parallel_drafters_one_pass_not_k_steps(tmp_path):
    """--drafter=parallel at K=8 proposes from ONE pass of 2K tokens: the roofline's loop
    reads the draft's weights and cache once (K draft steps would read them 8 times), and
    the costed proposal's ideal bytes (`steps.drafting_bytes`, what its bytes_ratio divides
    by) count one forward where the model drafter's count K."""
    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, "-m", "specjax.plan", "--config=tiny", "--mesh=1x1", "--drafter=parallel",
                           "--config.draft.parallel_draft=8", "--lookahead=8", f"--json={out}"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    sps, draft = report["roofline"]["sps"], report["models"]["draft"]
    once = draft["weight_bytes_per_device"] + draft["cache_bytes_per_device"]
    assert once <= sps["hbm_bytes"] - sps["score_hbm_bytes"] < 1.5 * once
    assert (sps["draft_passes"], sps["draft_pass_tokens"]) == (1, 16)
    assert "1 draft pass of 16 tokens" in proc.stdout

    from specjax.analysis import steps
    from specjax.decode.drafters import ModelDrafter, ParallelDrafter
    from specjax.model import abstract_lm
    mesh = mesh_for("1x1")
    lm = abstract_lm(load_config("tiny").draft, mesh)
    cache = kv_cache.cache_shapes(lm.cfg, 1, 64)
    parallel, chain = (steps.drafting_bytes(d, cache, 8) for d in (ParallelDrafter(lm, 9), ModelDrafter(lm)))
    assert parallel == steps.weight_bytes(lm) + roofline.shard_bytes([cache.k, cache.v]) and chain == 8 * parallel


def test_the_costed_eagle3_proposal_counts_its_fusion_weight_once():
    """An EAGLE-3 layer reads its w_fuse [len * D, D] in the window pass alone (later passes
    feed back its own features, unfused): the costed proposal's ideal bytes exceed an EAGLE
    layer's by w_fuse once, not K times (which put chinchilla_70b's eagle3 proposal at a
    bytes_ratio of 0.548 on v4, 0.875 with w_fuse once)."""
    from specjax.analysis import compile as compile_lib, steps
    from specjax.heads import abstract_heads
    from specjax.model import abstract_lm
    cfg, mesh = load_config("tiny"), mesh_for("1x8")
    target = abstract_lm(cfg.target, mesh)
    ideal, fuse = {}, 0
    for kind in ("eagle", "eagle3"):
        heads = abstract_heads(HeadsConfig(kind=kind), cfg.target, mesh)
        prog = compile_lib.planned(target, heads, dataclasses.replace(cfg.sampling, drafter=kind), 1, 16, 256)
        ideal[kind] = steps.step_functions(prog)["propose"][2]
        fuse += sum(math.prod(x.shape) * x.dtype.itemsize for path, x in jax.tree_util.tree_leaves_with_path(heads.params)
                    if "w_fuse" in jax.tree_util.keystr(path))
    assert cfg.sampling.lookahead > 1 and fuse > 0
    assert ideal["eagle3"] - ideal["eagle"] == fuse


def test_plan_duplicates_kv_heads_on_a_wider_model_axis_and_sizes_another_chip(tmp_path):
    """tiny's target has 4 kv heads; on a 1x8 mesh the loaders store each twice so that
    every device holds the one kv head its query heads use. plan must compile that: per
    device the same kv weight and cache bytes, and the same collectives, as a model built
    with 8 kv heads, and 1/8 of the cache. `--chip=v5e` sizes it against v5e's 16 GiB."""
    runs = {}
    for kv in (4, 8):
        out = tmp_path / f"kv{kv}.json"
        runs[kv] = (out, subprocess.Popen(
            [sys.executable, "-m", "specjax.plan", "--config=tiny", "--mesh=1x8", "--chip=v5e",
             f"--config.target.num_kv_heads={kv}", f"--json={out}"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    reports = {}
    for kv, (out, proc) in runs.items():
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-3000:]
        assert "TPU v5e" in stdout, stdout
        reports[kv] = json.loads(out.read_text())
    dup, full = reports[4], reports[8]
    t_dup, t_full = dup["models"]["target"], full["models"]["target"]
    assert (t_dup["kv_heads"], t_dup["kv_copies"], t_full["kv_copies"]) == (8, 2, 1)
    assert t_dup["weight_bytes_per_device"] == t_full["weight_bytes_per_device"]
    assert t_dup["cache_bytes_per_device"] == t_full["cache_bytes_per_device"]
    cfg = load_config("tiny").target  # [L, B, kv heads, S, H] keys and values, float32, cache_len 512
    whole = 2 * cfg.num_layers * 8 * 512 * cfg.head_dim * 4
    assert 0 <= t_dup["cache_bytes_per_device"] - whole // 8 <= 64  # plus the rows' lengths
    for name in dup["programs"]:
        counts = lambda r: {k: v for k, v in r["programs"][name].items() if k.startswith("collectives")}  # noqa: E731
        assert counts(dup) == counts(full), name
    assert dup["capacity"]["fits"] and dup["setup"]["devices"] == 8


@pytest.mark.parametrize("drafter", ["model", pytest.param("eagle", marks=pytest.mark.slow),
                                     pytest.param("eagle3", marks=pytest.mark.slow)])
def test_plan_compiles_the_dynamic_tree_loops_with_the_chain_loops_collectives(tmp_path, drafter):
    """tiny on 1x8, K=4, --draft_tree=dynamic --tree_nodes=8: the loops that grow a tree by
    the draft model (and with --drafter=eagle or eagle3 by an EAGLE or EAGLE-3 layer)
    compile, and each has its chain loop's collectives per loop: one target pass over the 9 nodes, and K draft
    passes (the root's window, then one per round over the round's nodes)."""
    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, "-m", "specjax.plan", "--config=tiny", "--mesh=1x8", f"--drafter={drafter}",
                           "--draft_tree=dynamic", "--tree_nodes=8", f"--json={out}"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    programs = json.loads(out.read_text())["programs"]
    pairs = [("sps", "sps_dynamic")] + ([(f"sps_{drafter}", f"sps_{drafter}_dynamic")] if drafter != "model" else [])
    for chain, grown in pairs:
        counts = lambda name: {kind: c["count"] for kind, c in programs[name]["collectives_per_loop"].items()}  # noqa: E731
        assert counts(grown) == counts(chain), grown
        assert grown in proc.stdout
    by_shape, _ = _all_reduces(programs["sps_dynamic"]["collectives_per_loop"])
    assert by_shape["f32[1,9,32]"]["count"] == 2 * load_config("tiny").target.num_layers + 1  # ONE pass over 1 + 8 nodes


@pytest.mark.parametrize("args, fragment", [
    (["--chip=v3"], "--chip"),
    (["--collective_latency_us=nan"], "--collective_latency_us=nan: must be a finite number"),
    (["--collective_latency_us=-1"], "--collective_latency_us=-1.0: must be a finite number in [0.0,"),
    (["--json=/"], "--json='/': cannot write it, it is a directory"),
    (["--mesh=1x"], "--mesh='1x': expected DATAxMODEL"),
    (["--batch=0"], "--batch=0: must be a positive integer"),
    (["--num_drafts=0"], "num_drafts=0: must be"),
    (["--drafter=medusa:3"], "--drafter"),  # the sampling group's names, as in sample (count: --config.heads)
    (["--drafter=ngram"], "--drafter=ngram: plan compiles draft models and draft heads (model, medusa, eagle, eagle3, "
                          "parallel)"),
    (["--drafter=medusa", "--config.heads.num_heads=0"], "num_heads=0"),
    (["--drafter=eagle", "--num_drafts=2"], "num_drafts=2 with drafter='eagle'"),
    # What sample and bench refuse, plan refuses too (it planned K=4 and reported 6).
    (["--drafter=medusa", "--lookahead=6", "--config.heads.num_heads=4"],
     "--lookahead=6 with --drafter=medusa: it proposes at most 4 tokens a loop"),
    (["--drafter=medusa", "--draft_confidence=0.5"], "draft_confidence=0.5 with drafter='medusa'"),
    (["--draft_tree=dynamic", "--tree_nodes=0"], "tree_nodes=0: must be an integer in [1, 64]"),
    (["--drafter=medusa", "--draft_tree=dynamic"], "draft_tree='dynamic' with drafter='medusa'"),
    (["--config=mini_target", "--draft_tree=dynamic"], "--draft_tree=dynamic: --config=mini_target has no draft"),
    (["--lookahead=0"], "lookahead=0"),
])
def test_plan_rejects_bad_flags_before_compiling(args, fragment):
    proc = subprocess.run([sys.executable, "-m", "specjax.plan", "--config=tiny", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert fragment in proc.stderr and "Traceback" not in proc.stderr and proc.stdout == "", proc.stderr


# --------------------------------------------------------------------------- relative positions


def _transformer_xl_reference(p, cfg, tokens):
    """Dai et al. 2019, eq. 4, for one pre-norm block, written out in float64 numpy:
    A_ij = q_i.k_j + q_i.W_r R_{i-j} + u.k_j + v.W_r R_{i-j} (j <= i), R = [sin, cos]."""
    T, D, N, K_, H = len(tokens), cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def norm(x, scale):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.norm_eps) * scale

    def gelu(x):  # jax.nn.gelu's default tanh form
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))

    layer = "['layers'][0]"
    x = p["['embed']"][tokens]
    h = norm(x, p[layer + "['attn_norm']['scale']"])
    q = np.einsum("td,ndh->tnh", h, p[layer + "['attn']['wq']"])
    k = np.repeat(np.einsum("td,kdh->tkh", h, p[layer + "['attn']['wk']"]), N // K_, axis=1)
    v = np.repeat(np.einsum("td,kdh->tkh", h, p[layer + "['attn']['wv']"]), N // K_, axis=1)
    inv = 1.0 / 10000 ** (np.arange(D // 2) / (D // 2))
    out = np.zeros((T, N, H))
    for i in range(T):
        dist = i - np.arange(i + 1)
        R = np.concatenate([np.sin(dist[:, None] * inv), np.cos(dist[:, None] * inv)], -1)  # [j, D]
        r = np.einsum("jd,dnh->jnh", R, p[layer + "['attn']['wr']"])
        u, w = p[layer + "['attn']['u']"], p[layer + "['attn']['v']"]
        score = (np.einsum("nh,jnh->nj", q[i], k[:i + 1]) + np.einsum("nh,jnh->nj", q[i], r)
                 + np.einsum("nh,jnh->nj", u, k[:i + 1]) + np.einsum("nh,jnh->nj", w, r)) / np.sqrt(H)
        weights = np.exp(score - score.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        out[i] = np.einsum("nj,jnh->nh", weights, v[:i + 1])
    x = x + np.einsum("tnh,nhd->td", out, p[layer + "['attn']['wo']"])
    ffw = gelu(norm(x, p[layer + "['ffw_norm']['scale']"]) @ p[layer + "['ffw']['w_in']"]) @ p[layer + "['ffw']['w_out']"]
    x = x + ffw
    return norm(x, p["['final_norm']['scale']"]) @ p["['unembed']"]


def test_relative_attention_is_transformer_xl_eq4(tiny):
    cfg = dataclasses.replace(tiny.target, pos_encoding="relative", num_layers=1)
    lm = random_lm(cfg, mesh_for("1x1"), seed=0)
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, 12)
    logits, _ = jax.jit(lambda lm, t, p, c: lm(t, p, c))(lm, jnp.asarray(tokens)[None], jnp.arange(12)[None],
                                                         kv_cache.init_cache(cfg, 1, 16))
    ref = _transformer_xl_reference(numpy_params(lm.params, np.float64), cfg, tokens)
    np.testing.assert_allclose(np.asarray(logits[0]), ref, atol=ATOL, rtol=1e-4)
    # The position terms matter: dropping them (W_r := 0) changes the logits.
    no_pos = numpy_params(lm.params, np.float64)
    no_pos["['layers'][0]['attn']['wr']"] = 0 * no_pos["['layers'][0]['attn']['wr']"]
    assert np.abs(_transformer_xl_reference(no_pos, cfg, tokens) - ref).max() > 100 * ATOL


def test_relative_k_plus_1_scoring_with_rollback_equals_full_forward(tiny):
    """The SpS cache pattern on a 1x8 mesh with scanned layers: each pass writes K+1 tokens
    at each row's own positions, of which only 1 + accepted are genuine; the rejected tail
    is junk, rolled back by setting `lengths`, and overwritten by the next pass."""
    cfg = dataclasses.replace(tiny.target, pos_encoding="relative", scan_layers=True)
    lm = random_lm(cfg, mesh_for("1x8"), seed=3)
    B, T = 4, 24
    tokens = np.random.default_rng(4).integers(0, cfg.vocab_size, (B, T))
    step = jax.jit(lambda lm, t, p, c: lm.extend(t, p, c))
    with jax.set_mesh(mesh_for("1x8")):
        ref, _ = step(lm, jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(T), (B, T)), kv_cache.init_cache(cfg, B, T))
        ref = np.asarray(ref)
        prompt_lens = np.array([1, 5, 9, 14])
        width, size = prompt_lens.max(), T + K + 1
        padded = np.where(np.arange(width)[None] < prompt_lens[:, None], tokens[:, :width], 7)
        logits, cache = step(lm, jnp.asarray(padded), jnp.broadcast_to(jnp.arange(width), (B, width)),
                             kv_cache.init_cache(cfg, B, size))
        worst = 0.0
        for b in range(B):
            worst = max(worst, np.abs(np.asarray(logits)[b, :prompt_lens[b]] - ref[b, :prompt_lens[b]]).max())
        cache = cache.with_lengths(jnp.asarray(prompt_lens))
        pos, rng, checked = prompt_lens.copy(), np.random.default_rng(0), 0
        while pos.min() < T:
            genuine = 1 + rng.integers(0, K + 1, B)  # 1 + accepted drafts; the rest were rejected
            cols = pos[:, None] + np.arange(K + 1)[None]
            fed = np.where(np.arange(K + 1)[None] < genuine[:, None], tokens[np.arange(B)[:, None], np.minimum(cols, T - 1)],
                           rng.integers(0, cfg.vocab_size, (B, K + 1)))
            logits, cache = step(lm, jnp.asarray(fed), jnp.asarray(cols), cache)
            logits = np.asarray(logits)
            for b in range(B):
                for j in range(genuine[b]):
                    if cols[b, j] < T:
                        worst = max(worst, np.abs(logits[b, j] - ref[b, cols[b, j]]).max())
                        checked += 1
            pos = pos + genuine
            cache = cache.with_lengths(jnp.asarray(pos))  # roll back the rejected tail
    print(f"K+1 scoring with rollback: {checked} positions, max |diff| {worst:.2e}")
    assert checked == (T - prompt_lens).sum()  # every position after the prompts was scored once
    assert worst < ATOL


def _position_term_by_gather(qr, wr, positions, size):
    """The position term as specjax first computed it, kept as the reference: project
    (q_i + v) W_r^T to [B, T, N, D], score every distance 0..S-1 against the [S, D]
    sinusoid table, then pick distance i - j element by element ([B, N, T, S] indices)."""
    qw = jnp.einsum("BTNH,DNH->BTND", qr, wr)
    by_dist = jnp.einsum("BTND,RD->BNTR", qw, model.sinusoid(jnp.arange(size), wr.shape[0]))
    dist = jnp.clip(positions[:, :, None] - jnp.arange(size)[None, None, :], 0, size - 1)
    return jnp.take_along_axis(by_dist, jnp.broadcast_to(dist[:, None], by_dist.shape), axis=-1)


@pytest.mark.parametrize("size,d_model", [(29, 48), (70, 16)], ids=["S<D", "S>D"])
def test_precomputed_table_and_shift_equal_the_gather_formulation(size, d_model):
    """Ragged rows scoring K+1 positions each at their own offsets, a first draft step
    (two tokens, the same position twice at the start), and a row at the last slot: the
    table + shift gives every visible (j <= i) score of the gather formulation."""
    N, H = 4, 8
    rng = np.random.default_rng(7)
    qr = jnp.asarray(rng.standard_normal((5, K + 1, N, H)), jnp.float32)
    wr = jnp.asarray(rng.standard_normal((d_model, N, H)) * d_model ** -0.5, jnp.float32)
    starts = np.array([0, 3, 11, size - 9, size - K - 1])
    positions = starts[:, None] + np.arange(K + 1)[None]
    positions[0, :2] = 0  # the first draft step of a one-token prompt feeds position 0 twice
    table = model.position_table(wr, size, jnp.float32)  # [N, S, H]
    by_reversed = jnp.einsum("BTNH,NSH->BNTS", qr, table)
    got = np.asarray(jax.jit(model.relative_shift)(by_reversed, jnp.asarray(positions)))
    ref = np.asarray(_position_term_by_gather(qr, wr, jnp.asarray(positions), size))
    visible = np.broadcast_to(np.arange(size)[None, None, None, :] <= positions[:, None, :, None], ref.shape)
    assert got.shape == ref.shape == (5, N, K + 1, size)
    np.testing.assert_allclose(np.where(visible, got, 0), np.where(visible, ref, 0), atol=1e-4, rtol=1e-4)
    assert np.abs(ref[visible]).max() > 0.5  # the compared scores are not all near zero


def _eqns(jaxpr):
    """Every equation of a jaxpr, nested jaxprs (jit, scan, while, cond) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


def test_position_table_is_computed_once_per_program_not_per_step():
    """In the SpS program of a relative-position pair, the loop neither builds a sinusoid
    (sin/cos: the table is made at prefill and carried in the cache) nor gathers with an
    index tensor that has a cache-sized axis (the old [B, N, T, S] element-wise pick)."""
    cfg = load_config("tiny", ["target.pos_encoding=relative", "draft.pos_encoding=relative"])
    mesh = mesh_for("1x8")
    target, draft = random_lm(cfg.target, mesh, seed=1), random_lm(cfg.draft, mesh, seed=2)
    prog = specjax.decode.program.build(target, draft, [[1, 2, 3], [4, 5, 6, 7, 8]],
                                        dataclasses.replace(cfg.sampling, max_new_tokens=32))
    with jax.set_mesh(prog.mesh):
        closed = jax.make_jaxpr(functools.partial(prog.fn, **prog.settings))(*prog.args)
    loops = [e for e in _eqns(closed.jaxpr) if e.primitive.name == "while"]
    loop = max(loops, key=lambda e: len(list(_eqns(e.params["body_jaxpr"].jaxpr))))  # the generation loop
    body = list(_eqns(loop.params["body_jaxpr"].jaxpr))
    everywhere = [e.primitive.name for e in _eqns(closed.jaxpr)]
    assert "sin" in everywhere and "cos" in everywhere  # the tables are built (at prefill)
    assert not {"sin", "cos"} & {e.primitive.name for e in body}
    gathers = [e for e in body if e.primitive.name == "gather"]
    assert gathers  # the token buffer reads and the shift's slices
    for e in gathers:
        assert prog.size not in e.invars[1].aval.shape, (e.invars[0].aval.shape, e.invars[1].aval.shape)


@pytest.fixture(scope="module")
def relative_tiny():
    cfg = load_config("tiny", ["target.pos_encoding=relative", "sampling.temperature=0",
                               "sampling.max_new_tokens=20"])
    mesh = mesh_for("1x8")
    target = random_lm(cfg.target, mesh, seed=5)
    prompts = [[3, 1, 4], [1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7], [2], [7, 1, 8, 2, 8, 1, 8]]
    ars = specjax.generate(target, None, prompts, cfg.sampling)
    return cfg, mesh, target, prompts, ars


@pytest.mark.parametrize("draft_kind", ["perturbed_target", "target_itself"])
def test_greedy_sps_equals_greedy_ars_with_relative_positions(relative_tiny, draft_kind):
    """Drafts with the target's shapes (one SpS compile serves both): a perturbed copy
    accepts some drafts and rejects others mid-loop; the target itself accepts all K
    every loop, so bonus tokens are emitted and the draft cache must hold x_K (fed again
    in the next loop's first step)."""
    cfg, mesh, target, prompts, ars = relative_tiny
    draft = random_lm(cfg.target, mesh, seed=5, noise=0.1) if draft_kind == "perturbed_target" else target
    sps = specjax.generate(target, draft, prompts, cfg.sampling)
    print(f"{draft_kind}: acceptance {sps.acceptance_rate:.2f}, tokens/loop {sps.tokens_per_loop:.2f}, "
          f"accepted per loop {sps.histogram.sum(0).tolist()}")
    assert [len(t) for t in ars.tokens] == [20] * len(prompts)
    assert len({tuple(t) for t in ars.tokens}) == len(prompts)
    assert sps.tokens == ars.tokens
    if draft_kind == "perturbed_target":
        assert 0.2 < sps.acceptance_rate < 0.95
        assert sps.histogram.sum(0)[1:K].sum() > 0  # loops that stopped after some, not all, drafts
    else:
        assert sps.acceptance_rate > 0.95
        assert sps.loops.max() <= math.ceil(20 / (K + 1)) + 1


def test_tpu_padding_and_the_chips_a_config_needs_on_a_smaller_chip():
    """plan's memory on TPU: a head_dim of 64 as the last axis takes 128 lanes; and the
    fewest chips of v5e's 16 GiB for a program needing 20 GiB per chip on 16: per-chip
    bytes scale as 1/model, so the 'model' axis must reach 20, and the first size that
    splits the Llama pair (64 and 32 heads, 8 kv heads, d_ff 28672 and 8192, vocab 128256)
    from there is 32."""
    import ml_dtypes
    from specjax.analysis import compile as compile_lib
    from specjax.analysis.roofline import CHIPS, padded_bytes
    from specjax.config import load_config
    assert padded_bytes((16, 8, 2048, 64), ml_dtypes.bfloat16) == 2 * 16 * 8 * 2048 * 64 * 2
    assert padded_bytes((8192, 4, 128), ml_dtypes.bfloat16) == 8192 * 4 * 128 * 2
    cfg = load_config("llama3_70b_1b")
    models = {"target": cfg.target, "draft": cfg.draft}
    axes = [m for m in range(1, 65) if all(c.num_heads % m == 0 and c.d_ff % m == 0 and c.vocab_size % m == 0
                                           and (c.num_kv_heads % m == 0 or m % c.num_kv_heads == 0)
                                           for c in models.values())]
    assert axes == [1, 2, 4, 8, 16, 32]
    report = {"programs": {"sps": {"program": "sps_program", "memory": {"total_padded": 20 * GiB}}}}
    v5e = CHIPS["v5e"]
    assert v5e.hbm_bytes == 16 * GiB
    cap = compile_lib.capacity(report, models, 1, 16, v5e)
    assert (cap["fits"], cap["model_axis_needed"], cap["chips_needed"]) == (False, 32, 32)
    cap = compile_lib.capacity(report, models, 1, 16, CHIPS["v4"])  # 20 GiB fit a 32 GiB chip: 16 is plenty,
    assert (cap["fits"], cap["chips_needed"]) == (True, 16)           # 8 chips would need 40


def test_plan_of_quantized_models_counts_their_bytes(tmp_path):
    """`plan --quantize=int8|int4` compiles the programs of the models as `--quantize`
    loads them: int4's codes (one per byte where XLA runs) plus a scale and minimum per 32
    are about a third of float32's bytes; the parameter count is the float model's. (One
    device: on a mesh the small scales are replicated. int8's bytes: test_quantized.)"""
    runs = {}
    for q in ("none", "int4"):
        out = tmp_path / f"{q}.json"
        runs[q] = (out, subprocess.Popen(
            [sys.executable, "-m", "specjax.plan", "--config=tiny", "--mesh=1x1", f"--quantize={q}", f"--json={out}"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    reports = {}
    for q, (out, proc) in runs.items():
        _, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-3000:]
        reports[q] = json.loads(out.read_text())
    weights = {q: r["models"]["target"]["weight_bytes_per_device"] for q, r in reports.items()}
    assert 0.25 < weights["int4"] / weights["none"] < 0.45, weights
    assert {r["models"]["target"]["params"] for r in reports.values()} == {load_config("tiny").target.num_params}
    assert reports["int4"]["setup"]["quantize"] == "int4"


@pytest.mark.parametrize("heads, program, extra", [
    pytest.param("medusa --config.heads.num_heads=3 --lookahead=3", "sps_medusa", 1, marks=pytest.mark.slow),
    ("eagle", "sps_eagle", 4 * 2), ("eagle3", "sps_eagle3", 4 * 2)])
def test_plan_compiles_the_loop_with_draft_heads_and_counts_their_all_reduces(tmp_path, heads, program, extra):
    """tiny on 1x8, K=4 (Medusa: its 3 heads, K=3): Medusa's heads add one all-reduce to the target's pass (2 per layer
    + the embedding); the EAGLE layer's K passes add its block's 2 each (the token it
    reads is embedded from a whole copy of the table on every device); the EAGLE-3 layer's
    too (the target's layers it fuses are whole rows, as the final hidden state is)."""
    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, "-m", "specjax.plan", "--config=tiny", "--mesh=1x8",
                           *f"--drafter={heads}".split(), f"--json={out}"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    _, total = _all_reduces(report["programs"][program]["collectives_per_loop"])
    assert total == 2 * load_config("tiny").target.num_layers + 1 + extra
    assert report["heads"]["kind"] == heads.split()[0] and program in proc.stdout
    assert report["heads"]["num_heads"] == (3 if "num_heads=3" in heads else HeadsConfig().num_heads)
