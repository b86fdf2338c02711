"""Typed, frozen configs; `configs/NAME.py` files build them with `get_config()`.

A run is described by one `Config`: the target model, an optional draft model, the
mesh, the sampling settings and the training settings. Every field is validated at
start-up and every error names the field and the value (`ConfigError`), so a bad
command line never reaches JAX.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
import typing
from typing import Any, Optional

CONFIG_DIR = pathlib.Path(__file__).resolve().parent / "configs"


class UsageError(ValueError):
    """Bad user input (flags, configs, prompts, checkpoints); entry points exit 2."""


class ConfigError(UsageError):
    """A config field has a bad value; the message names the field."""


def _positive(obj, *names):
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{type(obj).__name__}.{name}={value!r}: must be a positive integer")


def _choice(obj, name, allowed):
    value = getattr(obj, name)
    if value not in allowed:
        raise ConfigError(f"{type(obj).__name__}.{name}={value!r}: allowed values are {sorted(allowed)}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer. Letters used across the repo: D=d_model, N=num_heads,
    K=num_kv_heads, H=head_dim, F=d_ff, V=vocab_size, L=num_layers."""

    vocab_size: int = 64
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4
    head_dim: int = 16
    d_ff: int = 256
    max_seq_len: int = 512
    ffw: str = "gelu"  # 'gelu' | 'swiglu'
    pos_encoding: str = "rope"  # 'rope' | 'relative' (Transformer-XL, Chinchilla)
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    scan_layers: bool = False  # unrolled layers decode faster on CPU; scan keeps 80-layer compiles small
    norm_eps: float = 1e-6
    init_seed: int = 0

    def validate(self) -> "ModelConfig":
        _positive(self, "vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "d_ff", "max_seq_len")
        _choice(self, "ffw", {"gelu", "swiglu"})
        _choice(self, "pos_encoding", {"rope", "relative"})
        _choice(self, "param_dtype", {"float32", "bfloat16", "float16"})
        _choice(self, "compute_dtype", {"float32", "bfloat16", "float16"})
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"ModelConfig.num_heads={self.num_heads} is not a multiple of "
                              f"num_kv_heads={self.num_kv_heads}")
        if self.pos_encoding == "rope" and self.head_dim % 2:
            raise ConfigError(f"ModelConfig.head_dim={self.head_dim}: rotary positions need an even head_dim")
        return self

    @property
    def num_params(self) -> int:
        D, N, K, H, F, V, L = (self.d_model, self.num_heads, self.num_kv_heads, self.head_dim,
                               self.d_ff, self.vocab_size, self.num_layers)
        attn = D * N * H * 2 + D * K * H * 2
        ffw = D * F * (3 if self.ffw == "swiglu" else 2)
        rel = (D * N * H + 2 * N * H) if self.pos_encoding == "relative" else 0
        embed = V * D * (1 if self.tie_embeddings else 2)
        return L * (attn + ffw + rel + 2 * D) + embed + D


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh axes ('data', 'model'); model=-1 takes every device left after 'data'."""

    data: int = 1
    model: int = -1

    def validate(self) -> "MeshConfig":
        _positive(self, "data")
        if self.model != -1:
            _positive(self, "model")
        return self


VERIFY_RULES = ("block", "tokenwise")
DRAFTERS = ("model", "ngram", "retrieval", "hybrid")


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Applied identically to draft and target logits: temperature, then top-k, then top-p."""

    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    lookahead: int = 4  # K, draft tokens per loop (with draft_confidence: the most per loop)
    max_new_tokens: int = 128
    eos_id: int = -1  # -1 = never stop early
    verify: str = "block"  # 'block' (Sun et al. 2025: jointly, never worse) | 'tokenwise' (the paper's rule)
    drafter: str = "model"  # 'model' | 'ngram' (prompt lookup) | 'retrieval' (a datastore) | 'hybrid'
    ngram: int = 3  # longest context suffix the lookup drafters match (shorter ones down to 1 as fallback)
    draft_confidence: float = 0.0  # > 0: a row stops drafting after a draft distribution whose top p is below it

    def validate(self) -> "SamplingConfig":
        if not self.temperature >= 0:
            raise ConfigError(f"temperature={self.temperature}: must be >= 0 (0 means greedy)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top_k={self.top_k}: must be an integer >= 0 (0 turns top-k off)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p}: must be in (0, 1] (1 turns nucleus sampling off)")
        if not isinstance(self.lookahead, int) or self.lookahead < 1:
            raise ConfigError(f"lookahead={self.lookahead}: must be an integer >= 1")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens}: must be an integer >= 1")
        for name, allowed in (("verify", VERIFY_RULES), ("drafter", DRAFTERS)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name}={getattr(self, name)!r}: allowed values are {', '.join(allowed)}")
        if not isinstance(self.ngram, int) or isinstance(self.ngram, bool) or self.ngram < 1:
            raise ConfigError(f"ngram={self.ngram!r}: must be an integer >= 1 (the longest context suffix "
                              "the lookup drafters match)")
        if not 0 <= self.draft_confidence < 1:
            raise ConfigError(f"draft_confidence={self.draft_confidence}: must be in [0, 1) (0 turns the "
                              "adaptive draft length off)")
        return self


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    batch_size: int = 16
    seq_len: int = 256
    steps: int = 1000
    learning_rate: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    save_every: int = 100
    keep_checkpoints: int = 3
    eval_every: int = 100
    eval_batches: int = 4
    log_every: int = 10
    seed: int = 0
    corpus: str = "stdlib"  # 'stdlib', a directory, or a glob of text files
    val_fraction: float = 0.01
    # Distillation (draft from a trained target): teacher names a config; empty = plain LM loss.
    teacher: str = ""
    teacher_checkpoint: str = ""  # empty = the teacher config's default checkpoint dir
    distill_temperature: float = 1.0
    distill_weight: float = 1.0  # loss = w * KL(teacher || student) + (1 - w) * LM loss

    def validate(self) -> "TrainConfig":
        _positive(self, "batch_size", "seq_len", "steps", "save_every", "keep_checkpoints",
                  "eval_every", "eval_batches", "log_every")
        if not self.learning_rate > 0:
            raise ConfigError(f"TrainConfig.learning_rate={self.learning_rate}: must be > 0")
        if not 0 <= self.distill_weight <= 1:
            raise ConfigError(f"TrainConfig.distill_weight={self.distill_weight}: must be in [0, 1]")
        if not self.distill_temperature > 0:
            raise ConfigError(f"TrainConfig.distill_temperature={self.distill_temperature}: must be > 0")
        return self


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything one run needs. `target` is the model that is trained or sampled;
    `draft` (optional) is the small model that proposes tokens for it."""

    name: str = "unnamed"
    target: ModelConfig = ModelConfig()
    draft: Optional[ModelConfig] = None
    mesh: MeshConfig = MeshConfig()
    sampling: SamplingConfig = SamplingConfig()
    train: TrainConfig = TrainConfig()
    tokenizer_vocab: int = 0  # >0: a SentencePiece tokenizer of this size is trained on the corpus
    # Configs whose checkpoints hold the target / draft weights ('' = this config / none).
    target_from: str = ""
    draft_from: str = ""

    def validate(self) -> "Config":
        self.target.validate()
        if self.draft is not None:
            self.draft.validate()
            if self.draft.vocab_size != self.target.vocab_size:
                raise ConfigError(f"draft.vocab_size={self.draft.vocab_size} differs from "
                                  f"target.vocab_size={self.target.vocab_size}: they must share a tokenizer")
        self.mesh.validate()
        self.sampling.validate()
        self.train.validate()
        if self.tokenizer_vocab and self.tokenizer_vocab != self.target.vocab_size:
            raise ConfigError(f"tokenizer_vocab={self.tokenizer_vocab} differs from "
                              f"target.vocab_size={self.target.vocab_size}")
        return self


# --------------------------------------------------------------------------- loading


def available_configs() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.py") if not p.stem.startswith("_"))


def load_config(name_or_path: str, overrides: typing.Sequence[str] = ()) -> Config:
    """`name` resolves `configs/NAME.py`; a path to a `.py` file works too.
    Overrides are 'field.sub=value' strings (from `--config.field.sub=value`)."""
    path = pathlib.Path(name_or_path)
    if not (path.suffix == ".py" and path.exists()):
        path = CONFIG_DIR / f"{name_or_path}.py"
    if not path.exists():
        raise ConfigError(f"unknown config {name_or_path!r}: not a file, and not one of "
                          f"{', '.join(available_configs())}")
    spec = importlib.util.spec_from_file_location(f"specjax_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"config file {path} has no get_config() function")
    config = module.get_config()
    if not isinstance(config, Config):
        raise ConfigError(f"{path}: get_config() returned {type(config).__name__}, expected specjax Config")
    for item in overrides:
        config = apply_override(config, item)
    return config.validate()


def _coerce(text: str, annotation: Any, where: str) -> Any:
    if isinstance(annotation, str):
        annotation = eval(annotation, {**globals(), **typing.__dict__})  # noqa: S307 (our own annotations)
    origin = typing.get_origin(annotation)
    if origin is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if text.lower() in ("none", "null"):
            return None
        annotation = args[0]
    try:
        if annotation is bool:
            if text.lower() in ("true", "1", "yes"):
                return True
            if text.lower() in ("false", "0", "no"):
                return False
            raise ValueError
        if annotation is int:
            return int(text)
        if annotation is float:
            return float(text)
        if annotation is str:
            return text
    except ValueError:
        pass
    else:
        if dataclasses.is_dataclass(annotation):
            raise ConfigError(f"--config.{where}: is a group of fields; set one of "
                              f"{[f.name for f in dataclasses.fields(annotation)]}")
    raise ConfigError(f"--config.{where}={text!r}: not a valid {getattr(annotation, '__name__', annotation)}")


def apply_override(config: Config, item: str) -> Config:
    """Return `config` with one 'a.b.c=value' override applied (typed, validated later)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected FIELD=VALUE, e.g. --config.sampling.lookahead=3")
    key, text = item.split("=", 1)
    parts = key.split(".")

    def set_in(obj, parts, where):
        fields = {f.name: f for f in dataclasses.fields(obj)}
        if parts[0] not in fields:
            raise ConfigError(f"unknown config field {where + parts[0]!r}; "
                              f"{type(obj).__name__} has {sorted(fields)}")
        field = fields[parts[0]]
        if len(parts) == 1:
            return dataclasses.replace(obj, **{parts[0]: _coerce(text, field.type, where + parts[0])})
        child = getattr(obj, parts[0])
        if child is None or not dataclasses.is_dataclass(child):
            raise ConfigError(f"config field {where + parts[0]!r} is {child!r} and has no sub-field {parts[1]!r}")
        return dataclasses.replace(obj, **{parts[0]: set_in(child, parts[1:], where + parts[0] + ".")})

    return set_in(config, parts, "")


def cache_dir() -> pathlib.Path:
    """Where trained checkpoints, tokenizers and token caches live ($SPECJAX_CACHE overrides)."""
    return pathlib.Path(os.environ.get("SPECJAX_CACHE", pathlib.Path.home() / ".cache" / "specjax"))
