"""specjax: speculative sampling (Chen et al. 2023) in JAX/Flax NNX."""

from specjax.api import NonFiniteLogitsError, Result, generate
from specjax.config import Config, ModelConfig, SamplingConfig, UsageError, load_config
from specjax.model import LM, init_lm
from specjax.sharding import make_mesh

__all__ = ["Config", "LM", "ModelConfig", "NonFiniteLogitsError", "Result", "SamplingConfig", "UsageError",
           "generate", "init_lm", "load_config", "make_mesh"]
