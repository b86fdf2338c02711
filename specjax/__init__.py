"""specjax: speculative sampling (Chen et al. 2023) in JAX/Flax NNX.

The public API; everything else is importable from its own module:
  specjax.decode     the loops (ArS, SpS) and `generate`
  specjax.weights    checkpoints, tokenizers, Hugging Face import/export (weights.hf), GGUF import
                     (weights.gguf)
  specjax.training   data, losses, the trainer
  specjax.analysis   HLO collectives, roofline, `plan`'s compile, timing
  specjax.evaluation Table-1 tasks, metrics, the paired test
  specjax.app        what the command-line entry points share
"""
from specjax.platform import leave_out_absent_tpu

leave_out_absent_tpu()  # before any module below makes JAX pick its platforms

from specjax.config import Config, ModelConfig, SamplingConfig, UsageError, load_config
from specjax.decode.api import LoopTrace, NonFiniteLogitsError, explain_loop, generate, next_token_probs
from specjax.decode.metrics import Result, Totals
from specjax.model import LM, init_lm
from specjax.sharding import make_mesh

__all__ = ["Config", "LM", "LoopTrace", "ModelConfig", "NonFiniteLogitsError", "Result", "SamplingConfig",
           "Totals", "UsageError", "explain_loop", "generate", "init_lm", "load_config", "load_gguf", "load_hf", "load_lm",
           "make_mesh", "next_token_probs", "self_draft"]


def load_lm(*args, **kwargs):
    """`specjax.weights.checkpoint.load_lm` (imported on first use: it pulls in orbax)."""
    from specjax.weights.checkpoint import load_lm as load
    return load(*args, **kwargs)


def load_hf(*args, **kwargs):
    """`specjax.weights.hf.load(directory, mesh)`: a Hugging Face Llama-family directory as
    (LM sharded on the mesh, tokenizer or None)."""
    from specjax.weights.hf import load
    return load(*args, **kwargs)


def load_gguf(*args, **kwargs):
    """`specjax.weights.gguf.load(path, mesh)`: a GGUF file of a `llama` model as (LM
    sharded on the mesh, tokenizer or None)."""
    from specjax.weights.gguf import load
    return load(*args, **kwargs)


def self_draft(target, spec: str):
    """`specjax.weights.self_draft.self_draft(target, "layers:N")`: a draft LM made of the
    target's own arrays (its first N layers, embedding, final norm and unembedding)."""
    from specjax.weights.self_draft import self_draft as make
    return make(target, spec)
