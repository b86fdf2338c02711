"""`specjax.evaluate`: the scoring wiring against hand-computable cases, the agreement
test with a negative control, and the real CLI end to end on a tiny text model."""
from __future__ import annotations

import json
import math
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from clitools import TEXT_CONFIG, assert_one_line, cli_env, interruptible, run_many

from specjax.evaluation import metrics, stats, tasks

ROOT = pathlib.Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ HumanEval


def test_truncate_completion_stops_at_the_next_top_level_statement():
    assert tasks.truncate_completion("    return x + 1\n\ndef g():\n    pass") == "    return x + 1\n"
    assert tasks.truncate_completion("    return 1\nprint(f())") == "    return 1"
    assert tasks.truncate_completion("    y = 2\n    return y") == "    y = 2\n    return y"


def test_a_chat_answer_is_read_from_its_first_code_block():
    """--chat: the program run is the prompt, then the answer's code block (which defines
    the function again); prose around it, or a second block, is not run."""
    prompt = "def add(a, b):\n    \"\"\"Add.\"\"\"\n"
    answer = ("Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\nAnd a test:\n```python\n"
              "assert add(1, 2) == 4\n```")
    body = tasks.completion(answer, chat=True)
    assert body == "\ndef add(a, b):\n    return a + b\n"
    namespace = {}
    exec(prompt + body, namespace)  # noqa: S102 -- the test's own two lines
    assert namespace["add"](1, 2) == 3
    assert tasks.completion("no code here", chat=True) == ""
    assert tasks.completion("```\nx = 1", chat=True) == "\nx = 1\n"  # a block cut by the budget
    # An answer that opens with the code and closes a fence it never opened, then an example.
    assert tasks.completion("def add(a, b):\n    return a + b\n```\n\n```python\nprint(add(1, 2))\n```",
                            chat=True) == "\ndef add(a, b):\n    return a + b\n"
    assert tasks.completion("    return a + b\ndef g():", chat=False) == "    return a + b"


def test_pass_at_k_matches_the_binomial_formula():
    # 1 - C(n-c, k) / C(n, k), by hand.
    assert metrics.pass_at_k([True, False], 1) == pytest.approx(0.5)
    assert metrics.pass_at_k([True, False], 2) == pytest.approx(1.0)
    assert metrics.pass_at_k([False, False, False], 2) == 0.0
    assert metrics.pass_at_k([True, False, False, False], 2) == pytest.approx(1 - 3 / 6)


def test_execution_passes_the_canonical_solution_and_fails_wrong_or_hanging_code():
    problems = [it.reference for it in tasks.humaneval_items(2)]
    samples = [
        {"task_id": problems[0]["task_id"], "completion": problems[0]["canonical_solution"]},
        {"task_id": problems[0]["task_id"], "completion": "    return False\n"},  # fails a True case
        {"task_id": problems[1]["task_id"], "completion": problems[1]["canonical_solution"]},
        {"task_id": problems[1]["task_id"], "completion": "    while True:\n        pass\n"},
    ]
    assert metrics.execute_humaneval(problems, samples, timeout=1.0) == [True, False, True, False]


# ------------------------------------------------------------------ ROUGE and the docstring set


def test_rouge2_on_hand_counted_bigrams():
    # Reference bigrams: the-cat cat-sat sat-on on-the the-mat (5); prediction: the-cat cat-sat (2,
    # both in the reference): precision 1, recall 2/5, F1 = 2 * 1 * 0.4 / 1.4.
    assert metrics.rouge2("the cat sat on the mat", "the cat sat") == pytest.approx(2 * 0.4 / 1.4)
    assert metrics.rouge2("the cat sat on the mat", "The cat sat on the mat.") == pytest.approx(1.0)
    assert metrics.rouge2("the cat sat on the mat", "dogs bark loudly") == 0.0
    assert metrics.summary_of("  Return the sum.\ndef g():") == "Return the sum."


def test_rouge1_and_rougeL_on_hand_counted_words():
    # "the cat sat" against "the cat sat on the mat": 3 of 3 predicted unigrams match
    # (precision 1, recall 3/6), and the longest common subsequence is the same 3 words.
    scores = metrics.rouge("the cat sat on the mat", "the cat sat")
    assert scores["rouge1"] == pytest.approx(2 * 0.5 / 1.5) and scores["rougeL"] == pytest.approx(2 * 0.5 / 1.5)
    # Word order: "sat cat the" has the same unigrams (ROUGE-1 = 1), but its longest common
    # subsequence with "the cat sat" is one word, so ROUGE-L = 1/3.
    scores = metrics.rouge("the cat sat", "sat cat the")
    assert scores["rouge1"] == pytest.approx(1.0) and scores["rougeL"] == pytest.approx(1 / 3)


def test_parses_checks_syntax_without_running():
    prompt = "def f(x):\n"
    assert metrics.parses(prompt, "    return x + 1\n")
    assert not metrics.parses(prompt, "    return (x +\n")
    assert not metrics.parses(prompt, "")  # a def needs a body
    assert not metrics.parses(prompt, "    return " + "(" * 100_000)  # absurd nesting: False, no crash
    # Valid syntax that would fail if it ran: parsing must not execute it.
    assert metrics.parses(prompt, "    raise SystemExit(3)\nf(1)\n")


def test_docstring_pairs_cut_the_docstring_out_of_the_document(tmp_path):
    src = tmp_path / "m.py"
    src.write_text('class C:\n    @staticmethod\n    def add(a, b):\n        """Return the sum of a and b. More\n'
                   '        text here.\n\n        Details.\n        """\n        s = a + b\n        return s\n\n'
                   'def short():\n    """Too short."""\n    return 1\n')
    [pair] = tasks.docstring_pairs([src])
    assert pair["summary"] == "Return the sum of a and b."
    assert pair["document"] == "@staticmethod\ndef add(a, b):\n    s = a + b\n    return s"
    assert pair["id"] == "m.py:3:add"


def test_builtin_summarisation_set_is_deterministic_and_xsum_shaped():
    a, b = tasks.builtin_xsum(), tasks.builtin_xsum()
    assert a == b and len(a) >= 20
    items = tasks.xsum_items(None, 5)
    assert len(items) == 5
    # 1-shot: the example with its summary, then the document with an open summary line.
    assert items[0].prompt.count("# Summary:") == 2 and items[0].prompt.endswith("# Summary: ")
    assert a[0]["summary"] in items[0].prompt and items[0].reference == a[1]["summary"]


# ------------------------------------------------------------------ intervals and the agreement test


def test_mean_ci_by_hand():
    ci = stats.mean_ci([0, 1, 0, 1])
    # sd (ddof=1) of 0,1,0,1 is sqrt(1/3); half-width = 1.96 * sd / sqrt(4).
    assert ci["mean"] == 0.5 and ci["ci95"] == pytest.approx(1.959964 * math.sqrt(1 / 3) / 2, rel=1e-5)


def test_agreement_accepts_same_distribution_and_rejects_a_shift():
    """alpha = 0.05, 200 paired items. Same-distribution scores (what exact SpS gives) must
    agree; the negative control shifts one mode's scores by 0.1 (a biased sampler's effect),
    about 7 standard errors at this n (sd of the differences ~0.14), so the test has power
    near 1 and must report a difference."""
    rng = np.random.default_rng(0)
    a, b = rng.uniform(0, 0.5, 200), rng.uniform(0, 0.5, 200)
    same = stats.paired_agreement(a, b)
    assert same["agree"] and same["p_value"] > stats.ALPHA
    shifted = stats.paired_agreement(a, b + 0.1)
    assert not shifted["agree"] and shifted["p_value"] < 1e-6
    identical = stats.paired_agreement([0.2, 0.4, 0.1], [0.2, 0.4, 0.1])  # greedy: the same outputs
    assert identical["agree"] and identical["difference"] == 0


# ------------------------------------------------------------------ the CLI


@pytest.fixture(scope="module")
def text_pair(tmp_path_factory):
    """A tiny target and draft (random weights) saved with one shared tokenizer."""
    from specjax import sharding
    from specjax.weights import checkpoint
    from specjax.config import MeshConfig, load_config
    from specjax.model import init_lm
    from specjax.weights.tokenizer import train_tokenizer

    base = tmp_path_factory.mktemp("evaluate")
    mesh = sharding.make_mesh(MeshConfig(1, 1), jax.devices()[:1])
    (base / "tiny_text.py").write_text(TEXT_CONFIG)
    cfg = load_config(str(base / "tiny_text.py"))
    stdlib = pathlib.Path(os.__file__).parent
    tok = train_tokenizer([stdlib / "textwrap.py", stdlib / "shlex.py"], base / "tok", 512)
    for name, model in (("target", cfg.target), ("draft", cfg.draft)):
        checkpoint.save_lm(init_lm(model, mesh), base / name, config_name=f"tiny_text.{name}"
                           if name == "draft" else "tiny_text")
        checkpoint.save_tokenizer(base / name, tok)
    env = cli_env(base)
    args = [f"--config={base / 'tiny_text.py'}", f"--checkpoint={base / 'target'}",
            f"--draft_checkpoint={base / 'draft'}", "--noprogress"]
    return base, env, args


def run_evaluate(env, *args, timeout=600):
    return subprocess.run([sys.executable, "-m", "specjax.evaluate", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_xsum_end_to_end_writes_the_table_and_json(text_pair):
    base, env, args = text_pair
    out = base / "xsum.json"
    docs = base / "docs.jsonl"  # short documents: a small prompt bucket keeps the compiles cheap
    docs.write_text("".join(json.dumps({"document": d, "summary": s}) + "\n" for d, s in [
        ("def add(a, b):\n    return a + b", "Add two numbers."),
        ("def neg(x):\n    return -x", "Negate a number."),
        ("def first(xs):\n    return xs[0]", "The first item.")]))
    # --verify is an alias of config.sampling.verify, as in sample and bench.
    proc = run_evaluate(env, *args, "--task=xsum", f"--xsum_file={docs}", "--limit=1", "--max_new_tokens=12",
                        "--verify=block", f"--output={out}")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert [s["name"] for s in result["settings"]] == ["nucleus p=0.8", "greedy"]
    assert [s["sampling"]["verify"] for s in result["settings"]] == ["block", "block"]
    for s in result["settings"]:
        assert s["metric"] == "ROUGE-2" and [r["id"] for r in s["samples"]] == ["docs.jsonl:2"]
        assert all(1 <= s["modes"][m]["tokens"] <= 12 for m in ("ars", "sps"))  # 12, or fewer after an EOS
        assert 0 <= s["modes"]["sps"]["acceptance_rate"] <= 1 and s["modes"]["ars"]["acceptance_rate"] is None
        assert all(0 <= r[m]["rouge2"] <= 1 for r in s["samples"] for m in ("ars", "sps"))
        assert set(s["secondary"]) == {"ROUGE-1", "ROUGE-L"}
        assert all(0 <= r[m]["rougeL"] <= 1 for r in s["samples"] for m in ("ars", "sps"))
    greedy = result["settings"][1]
    # Greedy SpS is ArS exactly: same text, so the same score and a zero difference.
    assert all(r["ars"]["text"] == r["sps"]["text"] for r in greedy["samples"])
    assert greedy["agreement"]["difference"] == 0 and greedy["agreement"]["agree"]
    assert all(v["agreement"]["difference"] == 0 for v in greedy["secondary"].values())
    assert "ROUGE-2" in proc.stdout and "SpS" in proc.stdout and "speedup" in proc.stdout


def test_weights_from_a_hugging_face_directory_with_a_self_draft(text_pair):
    """`evaluate` takes the weight flags `sample` takes: a Hugging Face target (the
    committed fixture, with its own tokenizer) and its one-layer self-draft; greedy SpS
    text == ArS text. Without any draft the run is refused, naming the flags that give one."""
    base, env, _ = text_pair
    hf = ROOT / "tests" / "fixtures" / "hf" / "llama_gqa"
    docs = base / "hf_docs.jsonl"
    docs.write_text("".join(json.dumps({"document": d, "summary": t}) + "\n" for d, t in [("x = 1", "One."),
                                                                                      ("y = 2", "Two.")]))
    out = base / "hf.json"
    good, no_draft = run_many("specjax.evaluate", [
        ([f"--hf_target={hf}", "--self_draft=layers:1", "--task=xsum", f"--xsum_file={docs}", "--max_new_tokens=4",
          "--noprogress", f"--output={out}"], {}),
        ([f"--hf_target={hf}", "--task=xsum", "--noprogress"], {})], env=env, cwd=ROOT)
    assert good.returncode == 0, good.stderr
    result = json.loads(out.read_text())
    assert result["hf_target"] == str(hf) and result["self_draft"] == "layers:1"
    greedy = result["settings"][1]
    assert greedy["name"] == "greedy" and all(r["ars"]["text"] == r["sps"]["text"] for r in greedy["samples"])
    assert_one_line(no_draft, 2, ["needs a draft", "--hf_draft=DIR", "--self_draft=layers:N"])
    # A prompt starts as the tokenizer starts one (as sample encodes it): this one's BOS
    # (config.json's bos_token_id), where evaluate put an EOS before every prompt.
    bos, eos = (json.loads((hf / "config.json").read_text())[k] for k in ("bos_token_id", "eos_token_id"))
    assert {r["prompt_tokens"][0] for r in greedy["samples"]} == {bos} != {eos}


def test_a_tokenizer_without_eos_runs_to_the_budget(text_pair):
    """A Hugging Face directory that names no EOS anywhere: evaluate stops on nothing but
    the budget (it crashed on `None + list`)."""
    base, env, _ = text_pair
    src, hf = ROOT / "tests" / "fixtures" / "hf" / "llama_gqa", base / "no_eos"
    hf.mkdir()
    for f in src.iterdir():
        data = f.read_bytes()
        if f.name in ("config.json", "generation_config.json", "tokenizer_config.json"):
            data = json.dumps({k: v for k, v in json.loads(data).items()
                               if k not in ("eos_token_id", "eos_token")}).encode()
        (hf / f.name).write_bytes(data)
    docs = base / "no_eos_docs.jsonl"
    docs.write_text("".join(json.dumps({"document": d, "summary": t}) + "\n" for d, t in [("x = 1", "One."),
                                                                                      ("y = 2", "Two.")]))
    out = base / "no_eos.json"
    [proc] = run_many("specjax.evaluate", [([f"--hf_target={hf}", "--self_draft=layers:1", "--task=xsum",
                                             f"--xsum_file={docs}", "--max_new_tokens=4", "--noprogress",
                                             f"--output={out}"], {})], env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert all(r[m]["num_new"] == 4 for s in json.loads(out.read_text())["settings"] for r in s["samples"]
               for m in ("ars", "sps"))


def test_ars_is_autoregressive_whatever_the_drafter(text_pair):
    """With a lookup drafter (ngram) the ArS side ran n-gram SpS too: a draft=None run of
    a drafter that needs no draft is speculative. ArS makes one token per loop."""
    base, env, args = text_pair
    docs = base / "ngram_docs.jsonl"
    docs.write_text("".join(json.dumps({"document": "x = 1\nx = 1\nx = 1", "summary": t}) + "\n"
                            for t in ("Ones.", "Still ones.")))
    out = base / "ngram.json"
    target_only = [a for a in args if not a.startswith("--draft_checkpoint=")]  # a lookup draws from no draft
    [proc] = run_many("specjax.evaluate", [([*target_only, "--drafter=ngram", "--task=xsum", f"--xsum_file={docs}",
                                             "--max_new_tokens=8", f"--output={out}"], {})], env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for setting in json.loads(out.read_text())["settings"]:
        assert setting["modes"]["ars"]["tokens"] == setting["modes"]["ars"]["loops"] > 0
        assert all(r["ars"]["loops"] == r["ars"]["num_new"] and "proposed" not in r["ars"] for r in setting["samples"])
        assert all("proposed" in r["sps"] for r in setting["samples"])


def test_humaneval_end_to_end_with_execution(text_pair):
    base, env, args = text_pair
    out = base / "humaneval.json"
    proc = run_evaluate(env, *args, "--task=humaneval", "--limit=2", "--num_samples=2", "--pass_k=1,2",
                        "--max_new_tokens=8", "--execute", "--timeout=2", f"--output={out}")
    assert proc.returncode == 0, proc.stderr
    [setting] = json.loads(out.read_text())["settings"]
    assert setting["metric"] == "pass@2" and setting["items"] == ["HumanEval/0", "HumanEval/1"]
    assert len(setting["samples"]) == 4
    # Random-weight completions fail the tests, and were executed (each carries its verdict).
    assert all(r[m]["passed"] is False for r in setting["samples"] for m in ("ars", "sps"))
    assert setting["pass_at_k"]["sps"]["pass@1"]["mean"] == 0.0
    # The parse rate is scored from the same completions, with or without --execute.
    prompts = {it.id: it.prompt for it in tasks.humaneval_items(2)}
    assert all(r[m]["parses"] == metrics.parses(prompts[r["id"]], r[m]["completion"])
               for r in setting["samples"] for m in ("ars", "sps"))
    assert set(setting["secondary"]) == {"parses"}


def test_ctrl_c_scores_the_finished_samples_and_exits_130(text_pair):
    """SIGINT mid-run: the table and JSON cover the samples that finished, exit code 130."""
    base, env, args = text_pair
    out = base / "interrupted.json"
    docs = base / "many.jsonl"  # enough short items that the run is still going when interrupted
    docs.write_text("".join(json.dumps({"document": f"def f{i}(x):\n    return x + {i}", "summary": f"Add {i}."})
                            + "\n" for i in range(400)))
    proc = subprocess.Popen(interruptible("specjax.evaluate", *[a for a in args if a != "--noprogress"],
                                          "--task=xsum", f"--xsum_file={docs}", "--max_new_tokens=12",
                                          f"--output={out}"),
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen = b""
    deadline = time.monotonic() + 300
    while not re.search(rb"\s[1-9]\d*/\d+ \[", seen):  # the progress bar counted a finished sample
        assert proc.poll() is None and time.monotonic() < deadline, seen.decode(errors="replace")
        seen += os.read(proc.stderr.fileno(), 4096)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, (seen + stderr).decode(errors="replace")
    result = json.loads(out.read_text())
    assert result["interrupted"]
    finished = sum(len(s["samples"]) for s in result["settings"])
    assert 1 <= finished < 2 * 399, finished  # some, not all, items of the two settings
    assert all(len(s["items"]) == len(s["samples"]) for s in result["settings"])  # scored = finished
    assert b"interrupted" in stderr and b"ROUGE-2" in stdout


def test_a_seed_whose_derived_seeds_pass_2_63_is_refused_before_any_weights(tmp_path):
    """Sample j of item i runs with seed + 1000 * i + j: a --seed that is valid itself but
    pushes the last sample's seed to 2**63 is refused up front, naming the largest --seed
    these items and samples allow, before a checkpoint is looked at or an output written."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "SPECJAX_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    largest_allowed = 2 ** 63 - 1 - (1000 * 2 + 3)  # 3 items, 4 samples each
    missing = tmp_path / "no_such_checkpoint"
    out = tmp_path / "out" / "result.json"
    common = ["--config=tiny", f"--checkpoint={missing}", f"--draft_checkpoint={missing}", "--notrain_missing",
              "--task=humaneval", "--limit=3", "--num_samples=4", "--max_new_tokens=8", "--noprogress",
              f"--output={out}"]
    proc = run_evaluate(env, *common, f"--seed={largest_allowed + 1}", timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert f"--seed={largest_allowed + 1}" in proc.stderr and f"[0, {largest_allowed}]" in proc.stderr, proc.stderr
    assert not out.parent.exists() and not (tmp_path / "cache").exists()
    # The largest allowed seed gets past the check: the run then stops at the missing checkpoint.
    proc = run_evaluate(env, *common, f"--seed={largest_allowed}", timeout=120)
    assert proc.returncode == 2 and "--seed" not in proc.stderr and str(missing) in proc.stderr, proc.stderr


BAD = [
    (["--task=humaneval", "--pass_k=3", "--num_samples=2"], ["--pass_k='3'", "between 1 and --num_samples=2"]),
    (["--task=xsum", "--execute"], ["--execute only applies to --task=humaneval"]),
    (["--task=xsum", "--xsum_file=/nonexistent/x.jsonl"], ["--xsum_file='/nonexistent/x.jsonl'", "cannot read"]),
    (["--task=xsum", "--limit=0"], ["--limit=0", "positive integer"]),
    (["--task=summarise"], ["summarise", "humaneval", "xsum"]),
    (["--task=xsum", "--max_new_tokens=600"], ["--max_new_tokens=600", "context of 512"]),
    (["--task=xsum", "--output=/"], ["--output='/'", "it is a directory"]),
    (["--task=humaneval", "--timeout=nan"], ["--timeout=nan", "finite"]),
    (["--task=xsum", "--num_samples=1001"], ["--num_samples=1001", "at most 1000"]),  # else seeds would overlap
    (["--task=xsum", "--config.sampling.ngram=1000"], ["ngram=1000", "[1, 16]"]),
    (["--task=xsum", "--config.sampling.drafter=ngram", "--config.sampling.ngram=12", "--max_new_tokens=4",
      "--config.target.max_seq_len=8", "--config.draft.max_seq_len=8"], ["ngram=12", "context of 8 tokens"]),
    (["--task=xsum", "--config.sampling.drafter=retrieval"], ["--drafter=retrieval needs --datastore=PATH"]),
    (["--task=xsum", "--config.sampling.num_drafts=32"], ["num_drafts=32", "[1, 16]"]),
    (["--task=xsum", "--num_drafts=32"], ["num_drafts=32", "[1, 16]"]),  # the flag is the field's alias
    (["--task=xsum", "--drafter=retrieval"], ["--drafter=retrieval needs --datastore=PATH"]),
    (["--task=xsum", "--drafter=ngram", "--draft_confidence=0.5"], ["draft_confidence=0.5 with drafter='ngram'"]),
    (["--task=xsum", "--quantize=int3"], ["--quantize=int3"]),
    (["--task=xsum", "--verify=tree"], ["--verify", "block", "tokenwise"]),
]


@pytest.fixture(scope="module")
def bad_runs(text_pair):
    """All bad-input runs, forked from one process that imported specjax once."""
    _, env, args = text_pair
    def lookup(case):  # a lookup drafter draws from no draft: the pair's draft checkpoint is not passed
        return any(a.endswith(("drafter=ngram", "drafter=retrieval")) for a in case[0])
    return run_many("specjax.evaluate", [([*(a for a in args if not (lookup(case) and a.startswith("--draft_ch"))),
                                           *case[0]], {}) for case in BAD], env=env, cwd=ROOT)


@pytest.mark.parametrize("case", range(len(BAD)), ids=[" ".join(b[0]) for b in BAD])
def test_bad_input_is_one_line_and_exit_2(bad_runs, case):
    assert_one_line(bad_runs[case], 2, BAD[case][1])
