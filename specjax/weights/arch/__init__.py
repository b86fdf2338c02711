"""The model families: one module per architecture, the only place that knows it.

Each module maps its family's Hugging Face `config.json` keys (and GGUF metadata) onto
the one `ModelConfig`, whose switches (biases, q/k norms, norms after the sublayers, the
norm offset, GeGLU, sliding windows, the query and embedding scales) the model computes
without knowing any family, and names its tensors both ways. A module defines:

    HF_ARCHITECTURES, MODEL_TYPES   config.json's `architectures[0]` / `model_type` values
    GGUF_ARCHITECTURE               `general.architecture` of its GGUF files (None: none of its own)
    GGUF_PERMUTED_QK                whether llama.cpp's converter permuted q/k rows (Llama's rotary pairs)
    TENSORS                         specjax param key -> `common.Tensor(hf name, gguf name, layout)`
    from_hf(fields) -> dict         ModelConfig fields of a config.json (refusing what the model lacks)
    unlike(cfg) -> list             the fields of a ModelConfig the family cannot express (export)
    to_hf(cfg) -> dict              config.json of an export
    hf_embed_scale(cfg) -> float    what transformers multiplies its input embeddings by
    to_hf_value(cfg, key, x)        (optional) a param's value as transformers holds it

Adding a family: one module here, listed in FAMILIES, and a fixture.
"""
from __future__ import annotations

from types import ModuleType
from typing import Optional

import numpy as np

from specjax.config import ModelConfig, UsageError
from specjax.weights.arch import gemma3, llama, mistral, qwen2, qwen3
from specjax.weights.hf_files import TEXT, TEXTS, Fields, show

FAMILIES: tuple[ModuleType, ...] = (llama, mistral, qwen2, qwen3, gemma3)
# Architectures people hold that carry what the model lacks, refused naming it.
REFUSED = {
    "Gemma3ForConditionalGeneration": "a vision tower (Gemma 3's multimodal model; its text model alone, "
                                      "Gemma3ForCausalLM, is supported)",
    "Gemma2ForCausalLM": "attention and final logit softcaps (Gemma 2)",
    "MixtralForCausalLM": "MoE layers", "Qwen2MoeForCausalLM": "MoE layers", "Qwen3MoeForCausalLM": "MoE layers",
    "Qwen2VLForConditionalGeneration": "a vision tower", "Qwen2_5_VLForConditionalGeneration": "a vision tower",
}


def names() -> str:
    return ", ".join(a for family in FAMILIES for a in family.HF_ARCHITECTURES)


def for_hf(f: Fields) -> tuple[ModuleType, str]:
    """(family module, architecture class) of a parsed config.json. transformers builds the
    class that model_type names; `architectures`, when given, must name the same one."""
    archs = f.get("architectures", TEXTS.or_null(), None) or []
    model_type = f.get("model_type", TEXT.or_null(), None)
    by_type = {t: family for family in FAMILIES for t in family.MODEL_TYPES}
    arch = archs[0] if archs else (by_type[model_type].HF_ARCHITECTURES[0] if model_type in by_type else model_type)
    if arch in REFUSED:
        raise UsageError(f"{f.where}: architecture {arch!r} is not supported: it has {REFUSED[arch]}")
    family = next((m for m in FAMILIES if arch in m.HF_ARCHITECTURES), None)
    if family is None:
        raise UsageError(f"{f.where}: architecture {arch!r} is not supported; supported: {names()}")
    if model_type is not None and model_type not in family.MODEL_TYPES:
        raise UsageError(f"{f.where}: architectures={show(archs)} but model_type={model_type!r}: transformers "
                         f"builds the model model_type names; make them agree")
    return family, arch


# GGUF architectures of that kind.
REFUSED_GGUF = {"qwen2moe": "MoE layers", "qwen3moe": "MoE layers", "gemma2": "attention and final logit softcaps",
                "gemma3n": "per-layer embeddings and altered attention (Gemma 3n)"}


def name(family: ModuleType) -> str:
    """The family's module name ('qwen2'): `HFModel.family`."""
    return family.__name__.rsplit(".", 1)[-1]


def for_gguf(arch: Optional[str], where: str, required: bool = True) -> Optional[ModuleType]:
    """The family whose GGUF files say `general.architecture` `arch` (None, or a UsageError
    where `required`, when none does)."""
    family = next((m for m in FAMILIES if m.GGUF_ARCHITECTURE and m.GGUF_ARCHITECTURE == arch), None)
    if family is None and required and arch in REFUSED_GGUF:
        raise UsageError(f"{where}: architecture {arch!r} is not supported: it has {REFUSED_GGUF[arch]}")
    if family is None and required:
        supported = ", ".join(m.GGUF_ARCHITECTURE for m in FAMILIES if m.GGUF_ARCHITECTURE)
        raise UsageError(f"{where}: architecture {arch!r} is not supported; supported: {supported}")
    return family


def for_export(cfg: ModelConfig) -> ModuleType:
    """The first family that expresses `cfg` exactly, else a UsageError naming what each lacks."""
    lacks = {}
    for family in FAMILIES:
        missing = family.unlike(cfg)
        if not missing:
            return family
        lacks[family.HF_ARCHITECTURES[0]] = missing
    said = "; ".join(f"{arch}: {', '.join(m)}" for arch, m in lacks.items())
    raise UsageError(f"cannot export this model as a Hugging Face directory: no family expresses it ({said})")


def to_hf_value(family: ModuleType, cfg: ModelConfig, key: str, x):
    """Param `key`'s value `x` (numpy) as transformers' `family` holds it. An untied table's
    input scale beyond the family's own folds into it (a tied one's must be the family's:
    `unlike`)."""
    if key == "embed" and not cfg.tie_embeddings:
        fold = cfg.input_embedding_scale / family.hf_embed_scale(cfg)
        if fold != 1.0:
            x = (x.astype(np.float32) * fold).astype(x.dtype)
    convert = getattr(family, "to_hf_value", None)
    return x if convert is None else convert(cfg, key, x)
