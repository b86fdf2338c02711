"""A TPU v4 roofline for decoding: HBM bytes and FLOPs per forward, collectives at a
fixed latency plus their bytes on the ICI wire, set against the paper's Table 1.

Each forward costs max(HBM bytes / bandwidth, FLOPs / peak) (`forward_cost`), plus the
collectives that the compiled program runs per step/loop. Nothing overlaps: a lower
bound only where that holds.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from specjax.decode import drafters

GiB = 1024 ** 3
ALPHAS = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator chip for the roofline: HBM size, HBM bandwidth, peak bf16 FLOP/s,
    ICI bandwidth of one ring direction pair. The defaults are TPU v4's; `CHIPS` has the
    other generations, each from its Cloud TPU system-architecture page (cited there).

    collective_latency_s: the fixed cost of one small collective. At batch 1 every
    Megatron all-reduce carries at most (K+1) x d_model values (80-160 KiB), so it is
    latency-bound, not bandwidth-bound. A 16-chip v4-32 slice is a 2x2x4 ICI mesh;
    XLA's multi-dimensional all-reduce walks each dimension twice (reduce-scatter then
    all-gather): 2 x ((2-1) + (2-1) + (4-1)) = 10 dependent neighbour transfers, at
    ~1 us each (link + DMA issue + sync), so ~10 us. This is an assumption, not a
    measurement (kept for every generation); `--collective_latency_us` changes it and the
    report also prints the latency that would make the roofline meet the paper's 14.1
    ms/token. ici_bandwidth: a ring collective over one axis uses one link in each
    direction."""

    name: str = "TPU v4"
    hbm_bytes: int = 32 * GiB
    hbm_bandwidth: float = 1.2e12
    flops: float = 275e12
    ici_bandwidth: float = 2 * 50e9
    collective_latency_s: float = 10e-6


# Per-chip figures as published on each generation's Cloud TPU page (cloud.google.com/tpu/docs/
# v4, /v5e, /v5p, /v6e). The pages write HBM capacity as "GB"; it is the GiB-sized HBM stack
# (32 GiB on v4, as its page says), and XLA's per-chip memory limit is GiB-sized too. ICI: the
# per-chip bidirectional bandwidth over the chip's ports, one port's two directions here.
CHIPS = {
    # v4: 275 bf16 TFLOP/s, 32 GiB HBM2 at 1200 GB/s; ICI links 50 GB/s per direction
    # (Jouppi et al. 2023).
    "v4": Chip(),
    # v5e: 197 bf16 TFLOP/s, 16 GB HBM2 at 819 GB/s, 400 GB/s bidirectional ICI over 4 ports.
    "v5e": Chip("TPU v5e", 16 * GiB, 819e9, 197e12, 2 * 50e9),
    # v5p: 459 bf16 TFLOP/s, 95 GB HBM2e at 2765 GB/s, 4800 Gbps ICI (1200 GB/s over 6 ports).
    "v5p": Chip("TPU v5p", 95 * GiB, 2765e9, 459e12, 2 * 100e9),
    # v6e (Trillium): 918 bf16 TFLOP/s, 32 GB HBM at 1638 GB/s, 800 GB/s bidirectional ICI over 4 ports.
    "v6e": Chip("TPU v6e", 32 * GiB, 1638e9, 918e12, 2 * 100e9),
}
# TPU memory tiles the minor dimension of an array in 128 lanes: a head_dim of 64 as the
# last axis occupies 128, so the 1B draft's KV cache and q/k/v weights take twice their
# logical bytes. (The second-to-last axis is tiled in 8 sublanes of 32-bit words too; that
# is not counted: XLA can lay a degenerate axis, such as one kv head per device, out of the
# tile, and the large axes here are multiples of 16.)
LANES = 128


def padded_bytes(shape, dtype) -> int:
    """Bytes of an array in TPU HBM, its last axis rounded up to 128 lanes."""
    itemsize = np.dtype(dtype).itemsize
    shape = tuple(shape)
    if not shape:
        return itemsize
    return math.prod(shape[:-1]) * (-(-shape[-1] // LANES) * LANES) * itemsize


PAPER = {
    # Chen et al. 2023, section 4 and Table 1 (batch 1, K=4, 16 TPU v4 chips).
    "target_ms_per_token": 14.1,
    "draft_ms_per_token": 1.8,
    "lookahead": 4,
    "table1": [
        # (setting, ArS ms/token, SpS ms/token, speedup as printed in the paper; 14.1 / 7.52 is
        # 1.875, so the printed 1.92x was presumably computed before rounding the ms)
        ("XSum nucleus p=0.8", 14.1, 7.52, 1.92),
        ("XSum greedy", 14.1, 7.00, 2.01),
        ("HumanEval T=0.8 p=0.95", 14.1, 5.73, 2.46),
    ],
}


def collective_load(summary: dict, chip: Chip) -> tuple[int, float]:
    """(number of collectives, seconds their bytes spend on the ICI wire) for ring
    algorithms: an all-reduce moves 2(n-1)/n of its buffer, the others (n-1)/n."""
    count, wire = 0, 0.0
    for kind, entry in summary.items():
        for msg in entry["messages"]:
            n = msg["group"]
            factor = 2 * (n - 1) / n if kind == "all-reduce" else (n - 1) / n
            count += msg["count"]
            wire += msg["count"] * factor * msg["bytes"] / chip.ici_bandwidth
    return count, wire


def shard_bytes(tree, padded: bool = False) -> int:
    """Bytes one device holds of a pytree of sharded ShapeDtypeStructs / arrays (the max
    over devices is the same for the even shardings used here); padded: as TPU HBM lays
    them out (`padded_bytes`)."""
    import jax
    total = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) else leaf.shape
        total += padded_bytes(shard, leaf.dtype) if padded else math.prod(shard) * np.dtype(leaf.dtype).itemsize
    return total


def relative_cost(cfg, model_shards: int, batch: float, tokens: int, cache_len: int) -> dict:
    """What the Transformer-XL position term adds per device to one forward after the
    prefill (`model.position_table`, `model.relative_shift`). Bytes read: every layer's
    shard of the position table ([N/m, S, H] in the compute dtype) and its scores by
    distance ([B, N/m, T, S] float32, written by the dot and read by the shift). W_r is
    read only when the table is built, so a step skips those weight bytes and their 2
    FLOPs per weight per token ('w_r_bytes', 'w_r_flops': to subtract); the dot against
    the table costs 2 x N/m x H x S FLOPs per token and layer. Zeros without relative
    positions."""
    if cfg.pos_encoding != "relative":
        return {"table_bytes": 0, "score_bytes": 0, "w_r_bytes": 0, "flops": 0, "w_r_flops": 0}
    heads, H, D, L, S = cfg.num_heads / model_shards, cfg.head_dim, cfg.d_model, cfg.num_layers, cache_len
    return {"table_bytes": L * heads * S * H * np.dtype(cfg.compute_dtype).itemsize,
            "score_bytes": L * 2 * batch * heads * tokens * S * 4,
            "w_r_bytes": L * D * heads * H * np.dtype(cfg.param_dtype).itemsize,
            "flops": L * 2 * batch * tokens * heads * H * S, "w_r_flops": L * 2 * batch * tokens * D * heads * H}


def forward_cost(cfg, weight_bytes: int, cache_bytes: int, model_shards: int, batch_shards: int,
                 batch: int, tokens: int, cache_len: int) -> dict:
    """HBM bytes and FLOPs per device of one forward over `tokens` new tokens per row.

    Bytes: every weight shard once, plus the whole KV cache shard (the attention reads
    all `cache_len` slots and masks; it does not skip the empty ones), plus the
    Transformer-XL position term (`relative_cost`: its table and scores, less W_r).
    FLOPs: 2 per weight per token (the embedding lookup is a one-hot matmul here, so it
    counts), q.k and p.v over all cache slots, and the position term."""
    B, T, S = batch / batch_shards, tokens, cache_len
    N, H, L = cfg.num_heads, cfg.head_dim, cfg.num_layers
    weights = 2 * B * T * cfg.num_params / model_shards
    attention = L * 4 * B * T * S * N * H / model_shards
    rel = relative_cost(cfg, model_shards, B, T, S)
    relative_bytes = rel["table_bytes"] + rel["score_bytes"] - rel["w_r_bytes"]
    return {"hbm_bytes": weight_bytes + cache_bytes + relative_bytes,
            "flops": weights + attention + rel["flops"] - rel["w_r_flops"], "relative": rel}


def tokens_per_loop(alpha: float, lookahead: int) -> float:
    """Expected tokens per SpS loop when each draft token is accepted with prob alpha
    (independently): 1 + alpha + ... + alpha^K = (1 - alpha^(K+1)) / (1 - alpha)."""
    return float(lookahead + 1) if alpha >= 1 else (1 - alpha ** (lookahead + 1)) / (1 - alpha)


def implied_alpha(tokens: float, lookahead: int) -> float:
    """Inverse of `tokens_per_loop` (bisection; it is increasing in alpha)."""
    if tokens >= lookahead + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tokens_per_loop(mid, lookahead) < tokens else (lo, mid)
    return (lo + hi) / 2


def roofline(report: dict, cfg, chip: Chip) -> dict:
    """ms/token on TPU v4: a target ArS step, a draft step alone, the SpS loop and
    SpS ms/token as a function of the acceptance rate, and the paper's Table 1 rows.

    Each forward costs max(HBM bytes / bandwidth, FLOPs / peak) (`forward_cost`), plus
    the collectives that the compiled program runs per step/loop (count x latency +
    bytes on the wire). Nothing overlaps: a lower bound only where that holds."""
    programs, setup = report["programs"], report["setup"]
    batch, batch_shards = setup["batch"], (setup["data"] if setup["batch"] % setup["data"] == 0 else 1)

    def forward_s(which: str, lm_cfg, tokens: int, rows: int = 1) -> tuple[dict, float]:
        """One forward of `tokens` per row over `rows` x batch rows (several drafts: one
        draft-cache row per chain)."""
        m = report["models"][which]
        cost = forward_cost(lm_cfg, m["weight_bytes_per_device"], rows * m["cache_bytes_per_device"], setup["model"],
                            batch_shards, rows * batch, tokens, setup["cache_len"])
        return cost, max(cost["hbm_bytes"] / chip.hbm_bandwidth, cost["flops"] / chip.flops)

    def step(which, lm_cfg, program) -> dict:
        cost, compute = forward_s(which, lm_cfg, 1)
        count, wire = collective_load(programs[program]["collectives_per_step"], chip)
        coll = count * chip.collective_latency_s + wire
        return {"hbm_bytes": cost["hbm_bytes"], "flops": cost["flops"], "relative": cost["relative"],
                "compute_ms": 1e3 * compute, "collectives": count, "collective_ms": 1e3 * coll,
                "ms_per_token": 1e3 * (compute + coll)}

    out = {"chip": dataclasses.asdict(chip), "ars": step("target", cfg.target, "ars_target")}
    if "sps" not in programs:
        return out
    K = setup["lookahead"]
    out["draft"] = step("draft", cfg.draft, "ars_draft")
    drafter = drafters.kind(cfg.sampling.drafter)
    num_passes, rows = drafter.draft_passes(K) if drafter.needs_draft_model else (K, 1)

    def proposal(chains: int) -> tuple[list, float]:
        """A loop's draft forwards as the drafter declares them ([(cost, times)], seconds):
        one pass of several tokens whose distributions every chain draws from (the
        parallel drafter), or K steps, the first re-feeding the last two tokens (K+1 for
        each of M chains)."""
        if rows > 1:
            cost, s = forward_s("draft", cfg.draft, rows)
            return [(cost, num_passes)], num_passes * s
        first_cost, first = forward_s("draft", cfg.draft, 2 if chains == 1 else K + 1, chains)
        rest_cost, rest = forward_s("draft", cfg.draft, 1, chains)
        return [(first_cost, 1), (rest_cost, num_passes - 1)], first + (num_passes - 1) * rest

    score_cost, score = forward_s("target", cfg.target, K + 1)
    draft_passes, draft = proposal(1)
    count, wire = collective_load(programs["sps"]["collectives_per_loop"], chip)
    coll = count * chip.collective_latency_s + wire
    loop = score + draft + coll
    ars_ms = out["ars"]["ms_per_token"]
    passes = [(score_cost, 1)] + draft_passes
    out["sps"] = {"hbm_bytes": sum(c["hbm_bytes"] * n for c, n in passes),
                  "flops": sum(c["flops"] * n for c, n in passes),
                  "score_hbm_bytes": score_cost["hbm_bytes"], "score_flops": score_cost["flops"],
                  "score_relative": score_cost["relative"], "draft_passes": num_passes, "draft_pass_tokens": rows,
                  "score_ms": 1e3 * score, "draft_ms": 1e3 * draft, "collectives": count,
                  "collective_ms": 1e3 * coll, "loop_ms": 1e3 * loop,
                  "by_alpha": [{"alpha": a, "tokens_per_loop": tokens_per_loop(a, K),
                                "ms_per_token": 1e3 * loop / tokens_per_loop(a, K),
                                "speedup": ars_ms / (1e3 * loop / tokens_per_loop(a, K))} for a in ALPHAS]}
    if "sps_tree" in programs:
        # The tree pass scores 1 + M*K tokens against the same weights and cache: more
        # FLOPs and activation bytes, the same weight and cache bytes; a draft model runs
        # its K steps over M rows (M x its cache read), a parallel draft its one pass.
        # Tokens per loop are measured, not modelled: `break_even_ratio` (tree loop / chain
        # loop time) is how many times the chain loop's tokens per loop the tree must
        # reach to match its ms/token.
        M = setup["num_drafts"]
        tree_cost, tree_score = forward_s("target", cfg.target, 1 + M * K)
        _, tree_draft = proposal(M)
        count, wire = collective_load(programs["sps_tree"]["collectives_per_loop"], chip)
        tree_coll = count * chip.collective_latency_s + wire
        tree_loop = tree_score + tree_draft + tree_coll
        out["sps_tree"] = {"num_drafts": M, "score_tokens": 1 + M * K, "chain_score_tokens": K + 1,
                           "score_hbm_bytes": tree_cost["hbm_bytes"], "score_flops": tree_cost["flops"],
                           "extra_score_hbm_bytes": tree_cost["hbm_bytes"] - score_cost["hbm_bytes"],
                           "extra_score_flops": tree_cost["flops"] - score_cost["flops"],
                           "score_ms": 1e3 * tree_score, "chain_score_ms": 1e3 * score,
                           "draft_ms": 1e3 * tree_draft, "collectives": count,
                           "collective_ms": 1e3 * tree_coll, "loop_ms": 1e3 * tree_loop,
                           "chain_loop_ms": 1e3 * loop, "break_even_ratio": tree_loop / loop}
    if K == PAPER["lookahead"] and is_paper_scale(cfg):
        out["table1"] = []
        for row in paper_table1():
            ms = 1e3 * loop / tokens_per_loop(row["implied_alpha"], K)
            out["table1"].append(dict(row, sps_ms=ms, speedup=ars_ms / ms))
    return out


def is_paper_scale(cfg) -> bool:
    """The paper's timings only say something about a Chinchilla-70B-shaped target."""
    t = cfg.target
    return (t.num_layers, t.d_model, t.num_heads, t.d_ff) == (80, 8192, 64, 32768)


def paper_table1() -> list[dict]:
    """Each Table 1 row with the acceptance rate it implies under the paper's own
    timings: a loop is K draft steps of 1.8 ms plus one scoring pass, taken to cost one
    14.1 ms target step (scoring K+1 tokens is memory-bound like one token; if it costs
    more, the implied rates are a little higher)."""
    K = PAPER["lookahead"]
    loop = K * PAPER["draft_ms_per_token"] + PAPER["target_ms_per_token"]
    return [{"setting": name, "paper_ars_ms": ars, "paper_sps_ms": sps, "paper_speedup": speedup,
             "implied_tokens_per_loop": loop / sps, "implied_alpha": implied_alpha(loop / sps, K)}
            for name, ars, sps, speedup in PAPER["table1"]]


def fitted_latency(report: dict, cfg, chip: Chip) -> float | None:
    """The per-collective latency at which the ArS roofline equals the paper's 14.1 ms/token."""
    ars = roofline(report, cfg, dataclasses.replace(chip, collective_latency_s=0.0))["ars"]
    gap = PAPER["target_ms_per_token"] - ars["ms_per_token"]
    return 1e-3 * gap / ars["collectives"] if gap > 0 and ars["collectives"] else None


def compiled_estimate(report: dict, cfg) -> dict:
    """ms/token from the costed steps that XLA:TPU compiled (`steps.cost`): an ArS step,
    the draft's step alone, and each SpS loop over its expected tokens per loop at the
    acceptance rates of `ALPHAS` and of the paper's Table 1 rows (K=4, paper scale)."""
    programs, K = report["programs"], report["setup"]["lookahead"]
    programs = dict(sorted(programs.items(), key=lambda kv: kv[0] != "sps"))  # the chain first: trees compare with it
    seconds = lambda program, step: programs[program]["steps"][step]["estimated_seconds"]  # noqa: E731
    out = {}
    for name, program in (("ars", "ars_target"), ("draft", "ars_draft")):
        if "steps" in programs.get(program, {}):
            out[name] = {"ms_per_token": 1e3 * seconds(program, "step")}
    for name, program in programs.items():
        if not name.startswith("sps") or "steps" not in program:
            continue
        loop = seconds(name, "loop")
        lookahead, chains = (program["statics"]["settings"][k] for k in ("lookahead", "num_drafts"))
        entry = {"loop_ms": 1e3 * loop, "score_ms": 1e3 * seconds(name, "score"),
                 "propose_ms": 1e3 * seconds(name, "propose")}
        if chains > 1:  # a tree's tokens per loop are measured, not modelled: what it must reach
            if "sps" in out:
                entry["break_even_ratio"] = entry["loop_ms"] / out["sps"]["loop_ms"]
            out[name] = entry
            continue
        entry["by_alpha"] = [{"alpha": a, "tokens_per_loop": tokens_per_loop(a, lookahead),
                              "ms_per_token": 1e3 * loop / tokens_per_loop(a, lookahead)} for a in ALPHAS]
        if "ars" in out:
            for row in entry["by_alpha"]:
                row["speedup"] = out["ars"]["ms_per_token"] / row["ms_per_token"]
        if lookahead == PAPER["lookahead"] == K and is_paper_scale(cfg) and name == "sps":
            entry["table1"] = [dict(row, sps_ms=1e3 * loop / tokens_per_loop(row["implied_alpha"], K))
                               for row in paper_table1()]
        out[name] = entry
    return out
