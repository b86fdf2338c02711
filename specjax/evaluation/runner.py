"""Table 1 in miniature: every item of a task with ArS then SpS (batch 1, the same
prompt and seed, so machine noise hits both alike), scored, with the paired agreement
test, and formatted as a Table-1-style table."""
from __future__ import annotations

import dataclasses
import sys
from typing import Sequence

import numpy as np
from tqdm import tqdm

from specjax.app import cli, prompts as prompts_lib, setup
from specjax.app.locate import Sources
from specjax.config import SEED_LIMIT, UsageError
from specjax.decode.api import generate
from specjax.decode.metrics import Totals
from specjax.evaluation.metrics import execute_humaneval, parses, pass_at_k, rouge, summary_of
from specjax.evaluation.stats import mean_ci, paired_agreement
from specjax.evaluation.tasks import (CHAT_HUMANEVAL, SETTINGS, Item, Setting, completion, humaneval_items,
                                      xsum_items)


def continuation(tokenizer, prompt_ids: Sequence[int], new_ids: Sequence[int]) -> str:
    """The text the new tokens add to the prompt (decoding them alone would lose the
    leading whitespace SentencePiece folds into the first piece); stop tokens dropped."""
    new_ids = [t for t in new_ids if t not in tokenizer.stop_ids]
    head = tokenizer.decode(list(prompt_ids))
    full = tokenizer.decode(list(prompt_ids) + new_ids)
    return full[len(head):] if full.startswith(head) else tokenizer.decode(new_ids)


def parse_ks(text: str, num_samples: int) -> list[int]:
    try:
        ks = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise UsageError(f"--pass_k={text!r}: expected comma-separated positive integers, e.g. 1,10") from None
    if not ks or ks[0] < 1 or ks[-1] > num_samples:
        raise UsageError(f"--pass_k={text!r}: each k must be between 1 and --num_samples={num_samples}")
    return ks


SEED_STRIDE = 1000  # sample j of item i runs with seed + SEED_STRIDE * i + j, in both modes


def check_seeds(seed: int, task: str, num_items: int, num_samples: int) -> None:
    """Refuse a `seed` whose last derived seed would leave [0, 2**63): better now than
    after the models load and the samples before it have run."""
    if num_items == 0:
        return
    span = SEED_STRIDE * (num_items - 1) + num_samples - 1
    if seed + span >= SEED_LIMIT:
        raise UsageError(f"--seed={seed}: must be in [0, {SEED_LIMIT - 1 - span}] for {num_items} {task} items with "
                         f"{num_samples} samples each (sample j of item i uses seed + {SEED_STRIDE} * i + j, "
                         "and seeds are integers in [0, 2**63))")


def run_setting(setting: Setting, items: Sequence[Item], prompts: Sequence[list[int]], num_samples: int,
                target, draft, tokenizer, seed: int, bar, datastore=None) -> tuple[list[dict], dict[str, Totals], bool]:
    """Every sample of every item with ArS then SpS; stops early (cleanly) on Ctrl-C."""
    records, totals = [], {"ars": Totals(), "sps": Totals()}
    try:
        for i, (item, prompt) in enumerate(zip(items, prompts)):
            for j in range(num_samples):
                row = {"id": item.id, "sample": j, "seed": seed + SEED_STRIDE * i + j, "prompt_tokens": list(prompt)}
                for mode, d in (("ars", None), ("sps", draft)):
                    sampling = setting.sampling if mode == "sps" else dataclasses.replace(setting.sampling,
                                                                                          drafter="model")
                    res = generate(target, d, [prompt], sampling, seed=row["seed"],
                                   datastore=datastore if mode == "sps" else None)
                    totals[mode].add(res)
                    row[mode] = {"text": continuation(tokenizer, prompt, res.tokens[0]), **res.row_stats(0)}
                records.append(row)
                bar.update(1)
    except KeyboardInterrupt:
        return records, totals, True
    return records, totals, False


def score_setting(task: str, items: Sequence[Item], records: list[dict], ks: list[int], execute: bool,
                  timeout: float, chat: bool = False) -> dict:
    """Per-item scores per mode (only items whose samples all finished)."""
    by_item = {}
    for r in records:
        by_item.setdefault(r["id"], []).append(r)
    done = [it for it in items if it.id in by_item]
    per_item = {"ars": [], "sps": []}
    metric = None
    # Secondary metrics: same paired test. Not the paper's, but not all-zero for a small
    # model, so the agreement test has something to detect (benchmarks/table1.md).
    if task == "xsum":
        metric = "ROUGE-2"
        secondary = {"ROUGE-1": {"ars": [], "sps": []}, "ROUGE-L": {"ars": [], "sps": []}}
        for it in done:
            for mode in per_item:
                scores = [rouge(it.reference, summary_of(r[mode]["text"])) for r in by_item[it.id]]
                for r, sc in zip(by_item[it.id], scores):
                    r[mode].update(sc)
                per_item[mode].append(float(np.mean([sc["rouge2"] for sc in scores])))
                for name, key in (("ROUGE-1", "rouge1"), ("ROUGE-L", "rougeL")):
                    secondary[name][mode].append(float(np.mean([sc[key] for sc in scores])))
    else:
        secondary = {"parses": {"ars": [], "sps": []}}
        for it in done:
            for mode in per_item:
                oks = [parses(it.prompt, completion(r[mode]["text"], chat)) for r in by_item[it.id]]
                for r, ok in zip(by_item[it.id], oks):
                    r[mode]["parses"] = ok
                secondary["parses"][mode].append(float(np.mean(oks)))
    if task == "humaneval" and execute:
        metric = f"pass@{ks[-1]}"
        for mode in per_item:
            samples = [{"task_id": r["id"], "completion": completion(r[mode]["text"], chat)} for r in records]
            passed = execute_humaneval([it.reference for it in done], samples, timeout)
            for r, s, ok in zip(records, samples, passed):
                r[mode].update(completion=s["completion"], passed=ok)
            for it in done:
                oks = [r[mode]["passed"] for r in by_item[it.id]]
                per_item[mode].append({k: pass_at_k(oks, k) for k in ks if k <= len(oks)})
    out = {"metric": metric, "items": [it.id for it in done]}
    if done:
        out["secondary"] = {name: {"score": {mode: mean_ci(v) for mode, v in by_mode.items()},
                                   "agreement": paired_agreement(by_mode["ars"], by_mode["sps"])}
                            for name, by_mode in secondary.items()}
    if metric is None:
        return out
    if task == "humaneval":
        out["pass_at_k"] = {mode: {f"pass@{k}": mean_ci([s[k] for s in v]) for k in ks} for mode, v in per_item.items()}
        per_item = {mode: [s[ks[-1]] for s in v] for mode, v in per_item.items()}
    out["per_item"] = per_item
    out["score"] = {mode: mean_ci(v) for mode, v in per_item.items()}
    out["agreement"] = paired_agreement(per_item["ars"], per_item["sps"])
    return out


def format_table(result: dict) -> str:
    head = ("task", "sampling", "mode", "score (95% CI)", "ms/token", "speedup", "acceptance")
    rows = [head]
    for s in result["settings"]:
        ars_ms = s["modes"]["ars"]["ms_per_token"]
        for mode in ("ars", "sps"):
            m = s["modes"][mode]
            score = s.get("score", {}).get(mode)
            rows.append((result["task"] if mode == "ars" else "", s["name"] if mode == "ars" else "",
                         mode.replace("ars", "ArS").replace("sps", "SpS"),
                         f"{s['metric']} {score['mean']:.3f} ±{score['ci95']:.3f}" if score else "not scored",
                         f"{m['ms_per_token']:.2f}", f"{ars_ms / m['ms_per_token']:.2f}x" if m["tokens"] else "-",
                         f"{m['acceptance_rate']:.3f}" if m["acceptance_rate"] is not None else "-"))
    widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    for s in result["settings"]:
        checks = [(s["metric"], s.get("score"), s.get("agreement"))]
        checks += [(name, v["score"], v["agreement"]) for name, v in s.get("secondary", {}).items()]
        for name, score, a in checks:
            if a:
                lines.append(f"{s['name']} {name}: ArS {score['ars']['mean']:.3f} vs SpS {score['sps']['mean']:.3f}, "
                             f"difference {a['difference']:+.3f} ±{a['ci95']:.3f} (paired over {len(s['items'])} "
                             f"items), p = {a['p_value']:.3f}: "
                             + ("agree" if a["agree"] else f"DIFFER at alpha={a['alpha']}"))
    if result["task"] == "humaneval" and not result["executed"]:
        lines.append("scores need --execute (runs model-written code; see `--help`)")
    return "\n".join(lines)


SPS_FIELDS = ("verify", "drafter", "ngram", "draft_confidence", "num_drafts")


def evaluate(config, task: str, *, limit=None, num_samples: int, ks: Sequence[int], execute: bool,
             timeout: float, xsum_file=None, lookahead=None, max_new_tokens=None, seed: int = 0,
             sources: Sources = Sources(), train_missing: bool = True, progress: bool = True,
             quantize: str | None = None, datastore: str | None = None, chat: bool = False) -> dict:
    """Every item of `task` with ArS then SpS, scored; returns the result record that
    `format_table` prints (and `--output` writes). Ctrl-C stops after the current sample
    and still scores what finished (result['interrupted']). The weights come from
    `sources` (checkpoints, Hugging Face directories, GGUF files, a self-draft), quantized
    with `quantize`, as in `sample` (the one run setup, `app.setup`); `chat` puts each
    prompt through the model's chat template as a user message."""
    lookahead = lookahead or config.sampling.lookahead
    # The task fixes the paper's decoding (temperature, top-p, budget); how SpS drafts and
    # verifies is the config's.
    decoding = {k: getattr(config.sampling, k) for k in SPS_FIELDS}
    settings = [dataclasses.replace(s, sampling=dataclasses.replace(
        s.sampling, lookahead=lookahead, max_new_tokens=max_new_tokens or s.sampling.max_new_tokens,
        **decoding).validate())
        for s in SETTINGS[task]]
    budget = max(s.sampling.max_new_tokens for s in settings)
    run = setup.prepare(setup.Request(config, settings[0].sampling, (config.sampling.drafter,), sources=sources,
                                      quantize=quantize, datastore=datastore, train_missing=train_missing,
                                      sps="evaluate (ArS against SpS)"))
    if budget >= run.context:
        raise UsageError(f"--max_new_tokens={budget}: must be below the models' context of {run.context} tokens, "
                         "which also holds the prompt")
    for s in settings:
        s.sampling.check_context(run.context)
    items = humaneval_items(limit) if task == "humaneval" else xsum_items(xsum_file, limit)
    check_seeds(seed, task, len(items), num_samples)

    cli.use_compilation_cache()
    run.locate()
    tokenizer = run.tokenizer
    if tokenizer is None:
        raise UsageError(f"evaluate works on text and {run.no_tokenizer_reason}")
    # As `sample` encodes a text prompt: the tokenizer's own rule for what starts one (its
    # BOS where it adds one; the mini models' EOS document separator), or the chat template.
    asked = [CHAT_HUMANEVAL.format(prompt=it.prompt) if chat and task == "humaneval" else it.prompt for it in items]
    encoded = [p.tokens for p in prompts_lib.encode([prompts_lib.raw_text(it.id, text) for it, text in zip(items, asked)],
                                                    tokenizer, run.no_tokenizer_reason, chat=chat)]
    room = run.context - budget
    kept = [(it, p) for it, p in zip(items, encoded) if len(p) <= room]
    skipped = [it.id for it, p in zip(items, encoded) if len(p) > room]
    if not kept:
        raise UsageError(f"every prompt is longer than the {room} tokens the context ({run.context}) leaves after "
                         f"{budget} new tokens; lower --max_new_tokens")
    items, encoded = [k[0] for k in kept], [k[1] for k in kept]
    eos = run.sampling.eos_id
    settings = [dataclasses.replace(s, sampling=dataclasses.replace(s.sampling, eos_id=eos)) for s in settings]

    run.load()
    target, draft = run.target, run.draft_for(config.sampling.drafter)
    result = {"config": config.name, **{k: v for k, v in sources.named().items() if "checkpoint" not in k},
              "task": task, "quantize": quantize, "chat": chat,
              "num_samples": num_samples, "lookahead": lookahead,
              "executed": execute, "skipped_too_long": skipped, "settings": [], "interrupted": False}
    with tqdm(total=len(settings) * len(items) * num_samples, desc=f"{task} ArS+SpS", unit="sample",
              disable=not progress, file=sys.stderr) as bar:
        for setting in settings:
            records, totals, interrupted = run_setting(setting, items, encoded, num_samples, target, draft,
                                                       tokenizer, seed, bar, run.datastore)
            complete = [r for r in records if sum(x["id"] == r["id"] for x in records) == num_samples]
            scored = score_setting(task, items, complete, ks, execute, timeout, chat)
            result["settings"].append({"name": setting.name, "sampling": dataclasses.asdict(setting.sampling),
                                       "modes": {m: t.as_dict() for m, t in totals.items()},
                                       **scored, "samples": complete})
            if interrupted:
                result["interrupted"] = True
                break
    return result
