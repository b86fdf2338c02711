"""A trained checkpoint as a Hugging Face Llama directory."""
from __future__ import annotations

import pathlib

import jax

from specjax import distributed, sharding
from specjax.config import Config, UsageError, user_path
from specjax.weights import checkpoint


def check_exportable(config: Config) -> None:
    """What `export_hf` would refuse, checked before a run trains anything."""
    from specjax.weights import hf
    if config.heads is not None:
        raise UsageError(f"config {config.name!r} trains {config.heads.kind} draft heads on a frozen target, not a "
                         "model: there is nothing to export as a Hugging Face directory (sample and bench read the "
                         "heads from their checkpoint, --draft_checkpoint=WORKDIR)")
    hf.exportable(config.target)


def export_hf(config: Config, workdir, directory, devices=None) -> pathlib.Path:
    """Write the newest checkpoint in `workdir` as a Hugging Face Llama directory, with
    the teacher's tokenizer and generation ids when it was distilled from a Hugging Face
    directory or a GGUF file (whose tokenizer is written as tokenizer.json)."""
    from specjax.weights import gguf, hf
    workdir = user_path(workdir) if workdir else checkpoint.default_dir(config.name)
    mesh = sharding.make_mesh(config.mesh, devices)
    check_exportable(config)
    lm = checkpoint.load_lm(config.target, mesh, workdir, config_name=config.name)
    tc = config.train
    info = hf.read_config(tc.teacher_hf) if tc.teacher_hf else gguf.read_config(tc.teacher_gguf) \
        if tc.teacher_gguf else None
    with jax.set_mesh(mesh):
        out = hf.export(lm, directory, tokenizer_dir=tc.teacher_hf or None, bos_id=info.bos_id if info else None,
                        eos_ids=info.eos_ids if info else ())
    if tc.teacher_gguf and distributed.is_main():
        gguf.write_tokenizer(tc.teacher_gguf, out)
    return out
