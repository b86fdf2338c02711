"""`plan`'s report as text: models, memory per chip, collectives, roofline, Table 1."""
from __future__ import annotations

from specjax.analysis.roofline import GiB, PAPER


def _draft_passes(sp: dict) -> str:
    """A loop's draft forwards as the roofline priced them."""
    if sp.get("draft_pass_tokens", 1) > 1:
        passes = sp["draft_passes"]
        return f"{passes} draft pass{'es' if passes > 1 else ''} of {sp['draft_pass_tokens']} tokens"
    return "K draft steps"


def _gib(n: float) -> str:
    if n < 0.01 * GiB:
        return _size(n)
    return f"{n / GiB:.2f} GiB"


def _count(n: int) -> str:
    return next(f"{n / d:.2f}{u}" for d, u in ((1e9, "B"), (1e6, "M"), (1e3, "K"), (1, "")) if n >= d or d == 1)


def _size(n: float) -> str:
    return f"{n / 1024:.1f} KiB" if n < 1024 ** 2 else f"{n / 1024 ** 2:.1f} MiB"


def _collective_lines(summary: dict) -> list[str]:
    if not summary:
        return ["      (none)"]
    lines = []
    for kind, e in summary.items():
        msgs = ", ".join(f"{m['count']} x {m['shape']} ({_size(m['bytes'])}, {m['group']} dev)" for m in e["messages"])
        lines.append(f"      {kind:<18} {e['count']:>4}  {_size(e['bytes']):>10} total: {msgs}")
    return lines


def format_report(r: dict) -> str:
    s, rf = r["setup"], r["roofline"]
    chip = rf["chip"]
    tpu = s.get("compiler") == "tpu"
    where = (f"a {s['data']}x{s['model']} mesh of a {chip['name']} slice, compiled by XLA:TPU (libtpu, compile-only)"
             if tpu else f"a {s['data']}x{s['model']} mesh of fake CPU devices")
    out = [f"specjax plan: {r['config']} on {where}; batch {s['batch']}, "
           f"prompt {s['prompt_len']} tokens, cache {s['cache_len']}, K={s['lookahead']}",
           f"XLA_FLAGS: {s['xla_flags']}", "",
           f"{'model':<8} {'params':>10} {'dtype':>9} {'layers':>6} {'positions':>9} {'weights/dev':>12} "
           f"{'kv cache/dev':>12} {'pos. table/dev':>14}  random init program (compile, HLO instructions)"]
    for name, m in r["models"].items():
        out.append(f"{name:<8} {_count(m['params']):>10} {m['param_dtype']:>9} {m['layers']:>6} "
                   f"{m['pos_encoding']:>9} {_gib(m['weight_bytes_per_device']):>12} "
                   f"{_gib(m['cache_bytes_per_device']):>12} {_gib(m['position_table_bytes_per_device']):>14}  "
                   + (f"{m['init']['compile_seconds']:.1f}s, {m['init']['hlo_instructions']}" if m["init"] else
                      "(XLA:CPU only)"))
    if "heads" in r:
        h = r["heads"]
        what = {"medusa": f"{h['num_heads']} Medusa heads", "eagle3": "one EAGLE-3 layer"}.get(h["kind"],
                                                                                              "one EAGLE layer")
        out.append(f"{h['kind']:<8} {_count(h['params']):>10}  {what} (random; sps_{h['kind']} drafts with them), "
                   f"{_gib(h['weight_bytes_per_device'])} per device")
    for name, m in r["models"].items():
        if m.get("kv_copies", 1) > 1:
            out.append(f"  {name}: its {m['kv_heads'] // m['kv_copies']} kv heads are stored {m['kv_copies']}x "
                       f"({m['kv_heads']}: one per 'model' device, Megatron/vLLM kv-head duplication), so kv "
                       f"weights and cache split {s['model']} ways instead of being replicated")
        pad = (m.get("weight_bytes_per_device_padded", 0) - m["weight_bytes_per_device"],
               m.get("cache_bytes_per_device_padded", 0) - m["cache_bytes_per_device"])
        if pad[0] > 0.001 * m["weight_bytes_per_device"] or pad[1] > 0.001 * max(1, m["cache_bytes_per_device"]):
            out.append(f"  {name} on TPU (minor dims padded to 128 lanes): weights "
                       f"{_gib(m['weight_bytes_per_device_padded'])}, kv cache "
                       f"{_gib(m['cache_bytes_per_device_padded'])} per device")
    out += ["", f"{'program':<11} {'compile':>8} {'arguments':>11} {'outputs':>9} {'temporaries':>12} "
                f"{'total/dev':>11} {'+TPU pad':>10}  fits {chip['name']} ({_gib(chip['hbm_bytes'])})"
                + ("  [XLA:TPU's own bytes per chip]" if tpu else "")]
    for name, p in r["programs"].items():
        mem = p["memory"]
        total = mem.get("total_padded", mem["total"])
        out.append(f"{name:<11} {p['compile_seconds']:>7.1f}s {_gib(mem['arguments']):>11} "
                   f"{_size(mem['outputs']):>9} {_gib(mem['temporaries']):>12} {_gib(mem['total']):>11} "
                   f"{_gib(mem.get('tpu_padding', 0)):>10}  "
                   f"{'yes' if p['fits'] else 'NO'} ({_gib(chip['hbm_bytes'] - total)} free)")
    peaks = [(name, p["memory"]) for name, p in r["programs"].items() if p["memory"].get("peak_temporaries")]
    if peaks:
        out.append("  at its peak each program holds, beside its arguments (XLA:TPU's peak_memory), against what it "
                   "needs (its caches and position tables, and the prefill's keys and values):")
        for name, mem in peaks:
            ratio = f"{mem['peak_temporaries'] / mem['need']:.2f}x" if mem["need"] else "-"
            out.append(f"    {name:<11} {_gib(mem['peak_temporaries']):>10} live vs {_gib(mem['need'])} needed ({ratio})")
    cap = r.get("capacity")
    if cap:
        chips = s["data"] * s["model"]
        need = (f"the fewest chips whose 'model' axis splits every model and fits: {cap['chips_needed']} "
                f"(1x{cap['model_axis_needed']}, taking bytes per chip as 1/model; check with "
                f"--mesh=1x{cap['model_axis_needed']})" if cap["chips_needed"] else
                "no 'model' axis up to 1024 fits")
        out.append(f"  on {chip['name']} chips of {_gib(chip['hbm_bytes'])}: {cap['program']} needs "
                   f"{_gib(cap['per_chip_bytes'])} per chip on {chips} chips "
                   f"({'fits' if cap['fits'] else 'does NOT fit'}); {need}")
    out += ["", "collectives (counted in compiled HLO; nested loops x trip count; all-reduce bytes = the "
                "reduced buffer, all-gather bytes = the gathered result; XLA:CPU promotes bf16 all-reduces to f32)"]
    for name, p in r["programs"].items():
        per = "per SpS loop" if name.startswith("sps") else "per step"
        out.append(f"  {name} {per}:")
        out += _collective_lines(p.get("collectives_per_loop") or p.get("collectives_per_step"))
        out.append(f"  {name} outside the loop (prefill, set-up):")
        out += _collective_lines(p["outside_loop"])
    if tpu:
        out += _steps_lines(r)
    out += ["", f"{'hand-written ' if tpu else ''}roofline on {chip['name']}: {chip['hbm_bandwidth'] / 1e12:.1f} TB/s HBM, "
                f"{chip['flops'] / 1e12:.0f} TFLOP/s; collectives {chip['collective_latency_s'] * 1e6:.0f} us each "
                f"+ bytes at {chip['ici_bandwidth'] / 1e9:.0f} GB/s ICI"]
    fit = r.get("roofline_fitted")
    if fit:
        out[-1] += (f"; 'fit': {fit['chip']['collective_latency_s'] * 1e6:.1f} us per collective, the latency "
                    f"that makes ArS match the paper's {PAPER['target_ms_per_token']} ms/token")
    out.append(f"  {'step':<22} {'HBM/chip':>10} {'GFLOP/chip':>10} {'compute':>8} {'coll.':>5} {'coll. ms':>8} "
               f"{'ms/token':>8} {'fit' if fit else '':>6}  paper")
    # The paper's timings are of Chinchilla 70B and its 4B draft; other models get none.
    paper_scale = r.get("paper_scale", True)
    rows = [("ArS target step", "ars", PAPER["target_ms_per_token"] if paper_scale else "-"),
            ("draft step (alone)", "draft", PAPER["draft_ms_per_token"] if paper_scale else "-")]
    for label, key, paper in rows:
        if key in rf:
            x = rf[key]
            fitted = f"{fit[key]['ms_per_token']:>6.2f}" if fit else f"{'':>6}"
            out.append(f"  {label:<22} {_gib(x['hbm_bytes']):>10} {x['flops'] / 1e9:>10.1f} {x['compute_ms']:>6.2f}ms "
                       f"{x['collectives']:>5} {x['collective_ms']:>8.2f} {x['ms_per_token']:>8.2f} {fitted}  {paper}")
    if "sps" in rf:
        sp = rf["sps"]
        fitted = f"{fit['sps']['loop_ms']:>6.2f}" if fit else f"{'':>6}"
        out.append(f"  {'SpS loop (K=' + str(s['lookahead']) + ')':<22} {_gib(sp['hbm_bytes']):>10} "
                   f"{sp['flops'] / 1e9:>10.1f} {sp['score_ms'] + sp['draft_ms']:>6.2f}ms {sp['collectives']:>5} "
                   f"{sp['collective_ms']:>8.2f} {sp['loop_ms']:>8.2f} {fitted}  (per loop: score K+1 "
                   f"{sp['score_ms']:.2f} ms + {_draft_passes(sp)} {sp['draft_ms']:.2f} ms + collectives)")
        out += ["", "  SpS ms/token = loop / E[tokens per loop], E = (1 - alpha^(K+1)) / (1 - alpha)",
                f"    {'alpha':>6} {'tokens/loop':>12} {'ms/token':>9} {'speedup':>8}"
                + (f" {'fit ms':>7} {'speedup':>8}" if fit else "")]
        for i, row in enumerate(sp["by_alpha"]):
            f = fit["sps"]["by_alpha"][i] if fit else None
            out.append(f"    {row['alpha']:>6.2f} {row['tokens_per_loop']:>12.2f} {row['ms_per_token']:>9.2f} "
                       f"{row['speedup']:>7.2f}x" + (f" {f['ms_per_token']:>7.2f} {f['speedup']:>7.2f}x" if f else ""))
    if "sps_tree" in rf:
        t = rf["sps_tree"]
        out += ["", f"  Tree loop, {t['num_drafts']} drafts (scores {t['score_tokens']} tokens in one pass where the "
                f"chain scores {t['chain_score_tokens']}):",
                f"    scoring pass: +{_size(t['extra_score_hbm_bytes'])} HBM/chip, "
                f"+{t['extra_score_flops'] / 1e9:.1f} GFLOP/chip: {t['score_ms']:.2f} ms vs {t['chain_score_ms']:.2f} ms",
                f"    loop: {t['loop_ms']:.2f} ms (draft {t['draft_ms']:.2f} ms over {t['num_drafts']} rows, "
                f"{t['collectives']} collectives {t['collective_ms']:.2f} ms) vs the chain's {t['chain_loop_ms']:.2f} ms:"
                f" the tree pays off above {t['break_even_ratio']:.3f}x the chain's tokens per loop"]
    relative = [(label, rel) for label, rel in (("target step", rf["ars"]["relative"]),
                                                ("draft step", rf.get("draft", {}).get("relative")),
                                                ("K+1 scoring", rf.get("sps", {}).get("score_relative")))
                if rel and rel["table_bytes"]]
    if relative:
        out += ["", "  Transformer-XL position term, bytes per chip (in HBM/chip above): position table + scores by "
                "distance read, W_r not read (the table is built at prefill)"]
        out += [f"    {label:<12} table {_size(rel['table_bytes'])} + scores {_size(rel['score_bytes'])} "
                f"- W_r {_size(rel['w_r_bytes'])}" for label, rel in relative]
    if "table1" in rf:
        out += ["", "  paper Table 1 (K=4, 16 TPU v4): alpha implied by the paper's own timings (4 x 1.8 ms draft + "
                    "one 14.1 ms scoring pass per loop), and this roofline at that alpha",
                f"    {'setting':<24} {'paper ms':>8} {'speedup':>8} {'alpha':>6} {'ms/token':>9} {'speedup':>8}"
                + (f" {'fit ms':>7} {'speedup':>8}" if fit else "")]
        for i, row in enumerate(rf["table1"]):
            f = fit["table1"][i] if fit else None
            out.append(f"    {row['setting']:<24} {row['paper_sps_ms']:>8.2f} {row['paper_speedup']:>7.2f}x "
                       f"{row['implied_alpha']:>6.2f} {row['sps_ms']:>9.2f} {row['speedup']:>7.2f}x"
                       + (f" {f['sps_ms']:>7.2f} {f['speedup']:>7.2f}x" if f else ""))
    if fit:
        lat, a = fit["chip"]["collective_latency_s"] * 1e6, rf["ars"]
        worst = max(abs(row["sps_ms"] / row["paper_sps_ms"] - 1) for row in fit.get("table1", [])) if "table1" in fit else 0
        out += ["", f"  Reading: at peak HBM bandwidth the target step is {a['compute_ms']:.1f} ms of weight and cache "
                    f"reads; the paper's {PAPER['target_ms_per_token']} ms leaves {lat:.0f} us for each of its "
                    f"{a['collectives']} collectives: {100 * (1 - a['compute_ms'] / PAPER['target_ms_per_token']):.0f}% of "
                    f"a batch-1 step is fixed per-collective cost.",
                f"  The same fitted latency gives the draft {fit['draft']['ms_per_token']:.2f} ms/token (paper "
                f"{PAPER['draft_ms_per_token']}) and Table 1's SpS ms/token within {100 * worst:.0f}%; the draft's "
                f"remaining gap is per-step cost outside the layers (sampling over the vocabulary, dispatch), which "
                f"weighs more on 8 layers than on 80."] if "draft" in fit else []
    out.append(f"\npeak RSS of this process: {r['peak_rss_bytes'] / 1024 ** 2:.0f} MiB (nothing model-sized allocated)")
    return "\n".join(out)


def _steps_lines(r: dict) -> list[str]:
    """The costed steps (`steps.cost`) and the ms/token they give (`compiled_estimate`)."""
    chip = r["roofline"]["chip"]
    out = ["", f"costed steps, each compiled by XLA:TPU as a program of its own (bytes read from HBM per chip, "
               f"loops x trip counts; ideal: the weights each forward multiplies by + the caches it attends; "
               f"estimate: max(bytes / {chip['hbm_bandwidth'] / 1e12:.2f} TB/s, FLOPs / "
               f"{chip['flops'] / 1e12:.0f} TFLOP/s) + {chip['collective_latency_s'] * 1e6:.0f} us per collective "
               f"+ ICI bytes)",
           f"  {'program.step':<20} {'compile':>8} {'HBM read':>10} {'ideal':>10} {'ratio':>6} {'GFLOP':>8} "
           f"{'coll.':>5} {'est. ms':>8} {'XLA bytes':>10} {'XLA ms':>7}"]
    for name, p in r["programs"].items():
        for step, c in p.get("steps", {}).items():
            xla_ms = c["xla"].get("optimal_seconds", -1)
            out.append(f"  {name + '.' + step:<20} {c['compile_seconds']:>7.1f}s {_gib(c['bytes_accessed']):>10} "
                       f"{_gib(c['ideal_bytes']):>10} {c['bytes_ratio']:>6.3f} {c['flops'] / 1e9:>8.2f} "
                       f"{c['collective_count']:>5} {1e3 * c['estimated_seconds']:>8.3f} "
                       f"{_gib(c['xla'].get('bytes accessed', 0)):>10} "
                       + (f"{1e3 * xla_ms:>7.3f}" if xla_ms >= 0 else f"{'loop':>7}"))
    est = r.get("estimate", {})
    paper = r.get("paper_scale", True)
    if est:
        out += ["", "  ms/token from the costed steps (XLA:TPU's bytes and FLOPs; the hand-written roofline below "
                    "for comparison)"]
        for name, label, ref in (("ars", "ArS target step", PAPER["target_ms_per_token"]),
                                 ("draft", "draft step (alone)", PAPER["draft_ms_per_token"])):
            if name in est:
                out.append(f"    {label:<20} {est[name]['ms_per_token']:>7.2f} ms/token"
                           + (f"   (hand-written roofline {r['roofline'][name]['ms_per_token']:.2f}, paper {ref})"
                              if name in r["roofline"] and paper else ""))
        for name, e in est.items():
            if not name.startswith("sps"):
                continue
            head = f"    {name} loop {e['loop_ms']:.2f} ms (score {e['score_ms']:.2f}, propose {e['propose_ms']:.2f})"
            if "by_alpha" not in e:
                out.append(head + (f": pays off above {e['break_even_ratio']:.3f}x the chain's tokens per loop"
                                   if "break_even_ratio" in e else ""))
                continue
            out.append(head + ": ms/token at alpha " + ", ".join(
                f"{row['alpha']:.1f}: {row['ms_per_token']:.2f}" for row in e["by_alpha"]))
            for row in e.get("table1", []):
                out.append(f"      {row['setting']:<24} alpha {row['implied_alpha']:.2f}: {row['sps_ms']:.2f} ms/token "
                           f"(paper {row['paper_sps_ms']:.2f})")
    return out
