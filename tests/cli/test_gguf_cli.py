"""`python -m specjax.sample --gguf_target=FILE [--gguf_draft=FILE | --hf_draft=DIR]` and
`specjax.bench` run as a user runs them, on the committed GGUF fixtures
(tests/fixtures/gguf): transformers' greedy tokens from ArS and SpS alike, a text prompt
through the file's own tokenizer, a 1x8 mesh; and every bad file or flag combination is
one line on stderr with exit code 2, before anything is compiled."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import gguf as gguf_package
import gguf_edit
from clitools import assert_one_line, cli_env, run_many, xla_flags
from gguf_edit import rewrite

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "gguf"
HF_FIXTURES = ROOT / "tests" / "fixtures" / "hf"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return cli_env(tmp_path_factory.mktemp("gguf_cli"))


def run(env, module, *args, timeout=900, **extra):
    return subprocess.run([sys.executable, "-m", f"specjax.{module}", *args], cwd=ROOT, env={**env, **extra},
                          capture_output=True, text=True, timeout=timeout)


def records(path):
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]


def greedy_reference(name):
    ref = np.load(FIXTURES / f"{name}.npz")
    prompt = ref["prompt_ids"][0].tolist()
    return prompt, ref["greedy_ids"][0, len(prompt):].tolist()


def test_gguf_target_with_a_hf_draft_gives_transformers_greedy_tokens_in_both_modes(env, tmp_path):
    """bpe_F32.gguf holds llama_gqa's tokenizer, so the Hugging Face llama_gqa model can
    draft for it; the text prompt goes through the file's tokenizer (BOS 301 first)."""
    prompt, expected = greedy_reference("bpe_F32")
    proc = run(env, "sample", f"--gguf_target={FIXTURES / 'bpe_F32.gguf'}", f"--hf_draft={HF_FIXTURES / 'llama_gqa'}",
               "--mode=both", "--temperature=0", "--max_new_tokens=16", "--prompt=def f(x):",
               f"--output={tmp_path / 'out.jsonl'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = {r["mode"]: r for r in records(tmp_path / "out.jsonl")}
    assert out["ars"]["prompt_tokens"] == prompt and prompt[0] == 301
    assert out["ars"]["tokens"] == out["sps"]["tokens"] == expected
    assert "SpS speedup over ArS" in proc.stdout and "weights ready in " in proc.stdout
    assert "dequantized" not in proc.stderr  # F32: nothing to say


def test_sharded_over_a_1x8_mesh(env, tmp_path):
    prompt, expected = greedy_reference("llama_tp_Q8_0")
    proc = run(env, "sample", f"--gguf_target={FIXTURES / 'llama_tp_Q8_0.gguf'}", "--mode=ars", "--temperature=0",
               "--mesh=1x8", "--max_new_tokens=16", f"--prompt_tokens={','.join(map(str, prompt))}",
               "--noprint_samples", f"--output={tmp_path / 'out.jsonl'}",
               XLA_FLAGS=xla_flags(8))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert records(tmp_path / "out.jsonl")[0]["tokens"] == expected


def test_bench_measures_a_gguf_pair_and_says_once_what_it_dequantizes(env, tmp_path):
    """kquant.gguf (K-quants, Q5_0/Q5_1, Q8_0: every one with a codec, kept exactly) with one
    matrix as IQ4_NL blocks (no exact weight format here: one line on stderr naming it
    alone, once, though two models read it) drafting for itself: p == q, so (nearly) every
    draft token is accepted."""
    rng = np.random.default_rng(0)
    iq4 = rng.integers(0, 256, (256, 8, 18), dtype=np.uint8)  # [rows, blocks of 32, bytes]: float16 d, 16 of codes
    iq4[..., :2] = np.full((256, 8), 0.002, np.float16).view(np.uint8).reshape(256, 8, 2)
    kquant = rewrite(FIXTURES / "kquant.gguf", tmp_path / "kquant_iq4.gguf",
                     blocks={"blk.0.ffn_up.weight": ("IQ4_NL", iq4.reshape(256, -1))})
    proc = run(env, "bench", f"--gguf_target={kquant}", f"--gguf_draft={kquant}", "--lookahead=2", "--num_prompts=2",
               "--prompt_len=4", "--max_new_tokens=8", "--repeats=2", f"--json={tmp_path / 'b.json'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["gguf_target"].endswith("kquant_iq4.gguf") and report["ars"]["ms_per_token"] > 0
    assert [r["lookahead"] for r in report["sps"]] == [2] and report["sps"][0]["acceptance_rate"] > 0.9
    said = [line for line in proc.stderr.splitlines() if "dequantized" in line]
    assert len(said) == 1 and ": IQ4_NL tensors are dequantized to float32" in said[0]


# ------------------------------------------------------------------ bad input


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    base = tmp_path_factory.mktemp("bad_gguf")
    src = FIXTURES / "bpe_Q4_0.gguf"
    data = src.read_bytes()
    (base / "truncated.gguf").write_bytes(data[:-100])
    (base / "header_cut.gguf").write_bytes(data[:300])
    rewrite(src, base / "phi3.gguf", arch="phi3")
    rewrite(src, base / "missing.gguf", drop=("blk.1.ffn_down.weight",))
    rewrite(src, base / "yarn.gguf", fields={"llama.rope.scaling.type": ("yarn", gguf_package.GGUFValueType.STRING)})
    rewrite(src, base / "experts.gguf", fields={"llama.expert_count": (8, gguf_package.GGUFValueType.UINT32)})
    rewrite(FIXTURES / "qwen3_F32.gguf", base / "moe.gguf", arch="qwen3moe")
    rewrite(FIXTURES / "gemma3_F32.gguf", base / "softcap.gguf",
            fields={"gemma3.final_logit_softcapping": (30.0, gguf_package.GGUFValueType.FLOAT32)})
    (base / "notes.txt").write_text("not a model\n")
    gguf_edit.write_big_endian_as_is(src.with_name("bpe_Q4_1.gguf"), base / "big_endian_q4_1.gguf")
    offsets = gguf_edit.tensor_offsets(src)
    gguf_edit.move_tensor(src, base / "misaligned.gguf", "blk.0.ffn_up.weight", offsets["blk.0.ffn_up.weight"] + 4)
    gguf_edit.move_tensor(src, base / "overlap.gguf", "blk.1.attn_q.weight", offsets["blk.0.attn_q.weight"])
    for version in (1, 65535):
        (base / f"version{version}.gguf").write_bytes(data)
        gguf_edit.set_version(base / f"version{version}.gguf", version)
    for name, fields in EDITED.items():
        rewrite(FIXTURES / "bpe_F32.gguf", base / f"{name}.gguf", fields=fields)
    gguf_edit.named_pipe(base / "pipe.gguf")
    return base


V, A = gguf_package.GGUFValueType, gguf_package.GGUFValueType.ARRAY
EDITED = {  # bpe_F32.gguf with metadata replaced
    "add_bos_string": {"tokenizer.ggml.add_bos_token": ("false", V.STRING)},
    "bos_float": {"tokenizer.ggml.bos_token_id": (300.7, V.FLOAT32)},
    "eos_float": {"tokenizer.ggml.eos_token_id": (302.9, V.FLOAT32)},
    "token_type_strings": {"tokenizer.ggml.token_type": (["1"] * 304, A, V.STRING)},
    "pre_int": {"tokenizer.ggml.pre": (5, V.UINT32)},
    "template_int": {"tokenizer.chat_template": (5, V.UINT32)},
    "bos_string": {"tokenizer.ggml.bos_token_id": ("301", V.STRING)},
    "eos_array": {"tokenizer.ggml.eos_token_id": ([302], A, V.UINT32)},
    "tokens_scalar": {"tokenizer.ggml.tokens": ("abc", V.STRING)},
    "tokens_ints": {"tokenizer.ggml.tokens": (list(range(304)), A, V.UINT32)},
    "merges_ints": {"tokenizer.ggml.merges": (list(range(45)), A, V.UINT32)},
    "merges_missing": {"tokenizer.ggml.merges": (["zzzq qqqz"], A, V.STRING)},
    "heads_0": {"llama.attention.head_count": (0, V.UINT32)},
    "heads_3": {"llama.attention.head_count": (3, V.UINT32)},
    "block_count_huge": {"llama.block_count": (10**9, V.UINT32)},
}


BPE = f"--gguf_target={FIXTURES / 'bpe_F32.gguf'}"
BAD_INPUTS = [  # (name, args, fragments of the one error line)
    ("no such file", ["--gguf_target={bad}/absent.gguf", "--mode=ars"], ["absent.gguf: no such file"]),
    ("not a GGUF file", ["--gguf_target={bad}/notes.txt", "--mode=ars"],
     ["notes.txt: not a GGUF file", "b'not '"]),
    ("a directory", [f"--gguf_target={HF_FIXTURES / 'pair_target'}", "--mode=ars"],
     ["pair_target is a directory, not a GGUF file", "--hf_target"]),
    ("experts in a llama file", ["--gguf_target={bad}/experts.gguf", "--mode=ars"],
     ["metadata llama.expert_count=8 (uint32): MoE layers are not supported"]),
    ("a MoE architecture", ["--gguf_target={bad}/moe.gguf", "--mode=ars"],
     ["architecture 'qwen3moe' is not supported: it has MoE layers"]),
    ("a softcap", ["--gguf_target={bad}/softcap.gguf", "--mode=ars"],
     ["metadata gemma3.final_logit_softcapping=30.0 (float32): a final logit softcap is not supported"]),
    ("unsupported architecture", ["--gguf_target={bad}/phi3.gguf", "--mode=ars"],
     ["architecture 'phi3' is not supported; supported: llama, qwen2, qwen3, gemma3"]),
    ("truncated tensors", ["--gguf_target={bad}/truncated.gguf", "--mode=ars"],
     ["truncated.gguf: damaged or truncated GGUF file", "cannot reshape"]),
    ("truncated header", ["--gguf_target={bad}/header_cut.gguf", "--mode=ars"],
     ["header_cut.gguf: damaged or truncated GGUF file"]),
    ("tensor missing", ["--gguf_target={bad}/missing.gguf", "--mode=ars"],
     ["missing.gguf: tensor blk.1.ffn_down.weight is missing"]),
    ("unknown rope scaling", ["--gguf_target={bad}/yarn.gguf", "--mode=ars"],
     ["metadata llama.rope.scaling.type=\"yarn\" (string): is not supported; supported: none"]),
    ("remote path", ["--gguf_target=gs://bucket/model.gguf", "--mode=ars"], ["read from local disk"]),
    ("vocabulary sizes differ", [BPE, f"--gguf_draft={FIXTURES / 'spm_F32.gguf'}"],
     ["draft.vocab_size=384 differs from target.vocab_size=304"]),
    ("gguf and hf target", [BPE, f"--hf_target={HF_FIXTURES / 'pair_target'}", "--mode=ars"],
     ["--hf_target and --gguf_target both name the target's weights"]),
    ("gguf_draft without a target", [f"--gguf_draft={FIXTURES / 'bpe_F32.gguf'}"],
     ["--gguf_draft needs --hf_target or --gguf_target"]),
    ("gguf_target with checkpoint", [BPE, "--checkpoint=/tmp/x", "--mode=ars"],
     ["--gguf_target and --checkpoint both name weights"]),
    ("sps without a draft", [BPE, "--mode=sps"], ["--mode=sps with --drafter=model needs a draft", "--gguf_draft=FILE",
                                             "--drafter=ngram"]),
    ("big-endian Q4_1", ["--gguf_target={bad}/big_endian_q4_1.gguf", "--mode=ars"],
     ["a big-endian GGUF file with Q4_1 tensors", "big-endian files are read for F32, F16, BF16"]),
    ("misaligned tensor", ["--gguf_target={bad}/misaligned.gguf", "--mode=ars"],
     ["misaligned.gguf: damaged GGUF: tensor blk.0.ffn_up.weight", "not a multiple of general.alignment=32"]),
    ("overlapping tensors", ["--gguf_target={bad}/overlap.gguf", "--mode=ars"],
     ["overlap.gguf: damaged GGUF: tensors blk.0.attn_q.weight and blk.1.attn_q.weight overlap"]),
    ("version 1", ["--gguf_target={bad}/version1.gguf", "--mode=ars"],
     ["GGUF version 1 is not supported; supported: 2, 3"]),
    ("version 65535", ["--gguf_target={bad}/version65535.gguf", "--mode=ars"],
     ["GGUF version 65535 is not supported; supported: 2, 3"]),
    ("add_bos_token a string", ["--gguf_target={bad}/add_bos_string.gguf", "--mode=ars"],
     ["metadata tokenizer.ggml.add_bos_token=\"false\" (string): must be a bool"]),
    ("bos id a float", ["--gguf_target={bad}/bos_float.gguf", "--mode=ars"],
     ["metadata tokenizer.ggml.bos_token_id=300.7 (float32): must be an integer"]),
    ("eos id a float", ["--gguf_target={bad}/eos_float.gguf", "--mode=ars"],
     ["metadata tokenizer.ggml.eos_token_id=302.9 (float32): must be an integer"]),
    ("token_type strings", ["--gguf_target={bad}/token_type_strings.gguf", "--mode=ars"],
     ["metadata tokenizer.ggml.token_type=", "(array of string): must be an array of integers"]),
    ("pre an int", ["--gguf_target={bad}/pre_int.gguf", "--mode=ars"],
     ["metadata tokenizer.ggml.pre=5 (uint32): must be a string"]),
    ("chat_template an int", ["--gguf_target={bad}/template_int.gguf", "--mode=ars"],
     ["metadata tokenizer.chat_template=5 (uint32): must be a string"]),
    ("bos id a string", ["--gguf_target={bad}/bos_string.gguf", "--mode=ars"],
     ["metadata tokenizer.ggml.bos_token_id=\"301\" (string): must be an integer"]),
    ("eos id an array", ["--gguf_target={bad}/eos_array.gguf", "--mode=ars"],
     ["metadata tokenizer.ggml.eos_token_id=[302] (array of uint32): must be an integer"]),
    ("tokens a string", ["--gguf_target={bad}/tokens_scalar.gguf", "--mode=ars"],
     ["metadata tokenizer.ggml.tokens=\"abc\" (string): must be an array of strings"]),
    ("tokens integers", ["--gguf_target={bad}/tokens_ints.gguf", "--mode=ars"],
     ["metadata tokenizer.ggml.tokens=[0, 1, 2", "(array of uint32): must be an array of strings"]),
    ("merges integers", ["--gguf_target={bad}/merges_ints.gguf", "--mode=ars"],
     ["metadata tokenizer.ggml.merges=[0, 1, 2", "(array of uint32): must be an array of strings"]),
    ("merge of a token not in the vocabulary", ["--gguf_target={bad}/merges_missing.gguf", "--mode=ars"],
     ["tokenizer.ggml.merges[0]='zzzq qqqz': names 'zzzq', which tokenizer.ggml.tokens does not hold"]),
    ("draft's merge of a token not in the vocabulary", [BPE, "--gguf_draft={bad}/merges_missing.gguf"],
     ["merges_missing.gguf: metadata tokenizer.ggml.merges[0]='zzzq qqqz': names 'zzzq'"]),
    ("head_count 0", ["--gguf_target={bad}/heads_0.gguf", "--mode=ars"],
     ["metadata llama.attention.head_count=0 (uint32): must be at least 1"]),
    ("head_count 3", ["--gguf_target={bad}/heads_3.gguf", "--mode=ars"],
     ["metadata llama.attention.head_count=3 (uint32): must divide embedding_length=32"]),
    ("block_count 1e9", ["--gguf_target={bad}/block_count_huge.gguf", "--mode=ars"],
     ["metadata llama.block_count=1000000000 (uint32): the tensor table holds 2 blocks"]),
    ("a named pipe as the target", ["--gguf_target={bad}/pipe.gguf", "--mode=ars"],
     ["pipe.gguf: is a named pipe, not a GGUF file"]),
    ("a named pipe as the draft", [BPE, "--gguf_draft={bad}/pipe.gguf"],
     ["pipe.gguf: is a named pipe, not a GGUF file"]),
    ("empty gguf_target", ["--gguf_target=", "--mode=ars"], ["'': an empty path, not a GGUF file"]),
    ("hybrid_eagle3 without heads", [BPE, "--drafter=hybrid_eagle3"],
     ["--drafter=eagle3|hybrid_eagle3 draws from eagle3 heads trained on this target", "--draft_checkpoint=DIR"]),
]
CASE_ENV = {"block_count 1e9": {"CLITOOLS_RLIMIT_AS": str(6 << 30)}}  # a regression: MemoryError, not the OOM killer


@pytest.fixture(scope="module")
def bad_runs(env, bad):
    cases = [(["--prompt_tokens=0,5,6", "--max_new_tokens=16", *[a.format(bad=bad) for a in args]],
              CASE_ENV.get(name, {})) for name, args, _ in BAD_INPUTS]
    return dict(zip((c[0] for c in BAD_INPUTS), run_many("specjax.sample", cases, env=env, cwd=ROOT)))


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_one_line_and_exit_2(bad_runs, case):
    name, _, fragments = case
    proc = bad_runs[name]
    assert_one_line(proc, 2, fragments)
    assert proc.stdout.strip() == ""  # nothing ran


def test_a_bad_teacher_file_fails_before_training_writes_anything(env, tmp_path):
    proc = run(env, "train", "--config=tiny", f"--workdir={tmp_path / 'work'}",
               f"--config.train.teacher_gguf={tmp_path / 'absent.gguf'}")
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "absent.gguf: no such file" in lines[0], proc.stderr[-3000:]
    assert not (tmp_path / "work").exists()
