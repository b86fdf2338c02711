"""specjax: speculative sampling (Chen et al. 2023) in JAX/Flax NNX."""

from specjax.api import LoopTrace, NonFiniteLogitsError, Result, explain_loop, generate, next_token_probs
from specjax.config import Config, ModelConfig, SamplingConfig, UsageError, load_config
from specjax.model import LM, init_lm
from specjax.sharding import make_mesh

__all__ = ["Config", "LM", "LoopTrace", "ModelConfig", "NonFiniteLogitsError", "Result", "SamplingConfig",
           "UsageError", "explain_loop", "generate", "init_lm", "load_config", "make_mesh", "next_token_probs"]
