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
from clitools import assert_one_line, cli_env, run_many, xla_flags

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
    assert "SpS speedup over ArS" in proc.stdout
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
                     retype={"blk.0.ffn_up.weight": (gguf_package.GGMLQuantizationType.IQ4_NL, iq4.reshape(256, -1))})
    proc = run(env, "bench", f"--gguf_target={kquant}", f"--gguf_draft={kquant}", "--lookahead=2", "--num_prompts=2",
               "--prompt_len=4", "--max_new_tokens=8", "--repeats=2", f"--json={tmp_path / 'b.json'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["gguf_target"].endswith("kquant_iq4.gguf") and report["ars"]["ms_per_token"] > 0
    assert [r["lookahead"] for r in report["sps"]] == [2] and report["sps"][0]["acceptance_rate"] > 0.9
    said = [line for line in proc.stderr.splitlines() if "dequantized" in line]
    assert len(said) == 1 and ": IQ4_NL tensors are dequantized to float32" in said[0]


# ------------------------------------------------------------------ bad input


def rewrite(src, dst, *, drop=(), fields=None, arch=None, retype=None):
    """A copy of GGUF file `src` written again with the gguf package's writer: tensors in
    `drop` left out, metadata `fields` ({key: (value, type)}) added or replaced, tensors in
    `retype` ({name: (GGML type, raw blocks [rows, bytes])}) written as those."""
    reader = gguf_package.GGUFReader(src)
    arch = arch or reader.fields["general.architecture"].contents()
    w = gguf_package.GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf_package.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), field.types[0], sub)
    for key, (value, vtype) in (fields or {}).items():
        w.add_key_value(key, value, vtype)
    for t in reader.tensors:
        if t.name in drop:
            continue
        if t.name in (retype or {}):
            w.add_tensor(t.name, retype[t.name][1], raw_dtype=retype[t.name][0])
            continue
        data = np.array(t.data)
        if t.tensor_type in (gguf_package.GGMLQuantizationType.F32, gguf_package.GGMLQuantizationType.F16):
            w.add_tensor(t.name, data)
        else:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    base = tmp_path_factory.mktemp("bad_gguf")
    src = FIXTURES / "bpe_Q4_0.gguf"
    data = src.read_bytes()
    (base / "truncated.gguf").write_bytes(data[:-100])
    (base / "header_cut.gguf").write_bytes(data[:300])
    rewrite(src, base / "qwen2.gguf", arch="qwen2")
    rewrite(src, base / "missing.gguf", drop=("blk.1.ffn_down.weight",))
    rewrite(src, base / "yarn.gguf", fields={"llama.rope.scaling.type": ("yarn", gguf_package.GGUFValueType.STRING)})
    (base / "notes.txt").write_text("not a model\n")
    return base


BPE = f"--gguf_target={FIXTURES / 'bpe_F32.gguf'}"
BAD_INPUTS = [  # (name, args, fragments of the one error line)
    ("no such file", ["--gguf_target={bad}/absent.gguf", "--mode=ars"], ["absent.gguf: no such file"]),
    ("not a GGUF file", ["--gguf_target={bad}/notes.txt", "--mode=ars"],
     ["notes.txt: not a GGUF file", "b'not '"]),
    ("a directory", [f"--gguf_target={HF_FIXTURES / 'pair_target'}", "--mode=ars"],
     ["pair_target is a directory, not a GGUF file", "--hf_target"]),
    ("unsupported architecture", ["--gguf_target={bad}/qwen2.gguf", "--mode=ars"],
     ["architecture 'qwen2' is not supported; supported: llama"]),
    ("truncated tensors", ["--gguf_target={bad}/truncated.gguf", "--mode=ars"],
     ["truncated.gguf: damaged or truncated GGUF file", "cannot reshape"]),
    ("truncated header", ["--gguf_target={bad}/header_cut.gguf", "--mode=ars"],
     ["header_cut.gguf: damaged or truncated GGUF file"]),
    ("tensor missing", ["--gguf_target={bad}/missing.gguf", "--mode=ars"],
     ["missing.gguf: tensor blk.1.ffn_down.weight is missing"]),
    ("unknown rope scaling", ["--gguf_target={bad}/yarn.gguf", "--mode=ars"],
     ["llama.rope.scaling.type='yarn' is not supported"]),
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
]


@pytest.fixture(scope="module")
def bad_runs(env, bad):
    cases = [(["--prompt_tokens=0,5,6", "--max_new_tokens=16", *[a.format(bad=bad) for a in args]], {})
             for _, args, _ in BAD_INPUTS]
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
