"""Random models for tests: numpy-drawn params placed with their shardings (no init
program to compile), and their values back as numpy."""
from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np

from specjax import model, sharding
from specjax.analysis.hlo import HloProgram
from conftest import mesh_for

# A ragged batch: rows of 3, 9, 1 and 5 prompt tokens.
RAGGED = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12], [13], [14, 15, 16, 17, 18]]


def tiny_pairs(tiny) -> dict:
    """{mesh name: (target, draft)}: tiny's two models freshly initialised on 1 device and
    on a 1x8 mesh (the same weights on both)."""
    return {name: (model.init_lm(tiny.target, mesh_for(name)), model.init_lm(tiny.draft, mesh_for(name)))
            for name in ("1x1", "1x8")}


def with_masks(lm: model.LM, k: int = 4, seed: int = 5) -> model.LM:
    """`lm` with a mask-token embedding of its own (random) for up to k tokens a pass: a
    parallel draft model (`--drafter=parallel`)."""
    cfg = dataclasses.replace(lm.cfg, parallel_draft=k)
    fresh = model.init_lm(cfg, jax.tree.leaves(lm.params)[0].sharding.mesh, seed=seed)
    params = jax.tree.map(lambda x: x, fresh.params)
    for name in lm.params:
        params[name] = lm.params[name]
    return dataclasses.replace(fresh, params=params)


def random_lm(cfg, mesh, seed: int = 0, noise: float = 0.0, noise_seed: int = 1) -> model.LM:
    """Every param random, at about an init's scale. Unlike a fresh init, the norm scales
    and Transformer-XL's u, v are random too, so a mistake in their terms cannot hide
    behind ones and zeros. `noise` perturbs every param by that fraction of its scale (a
    draft that agrees with the target only mostly)."""
    abstract = model.abstract_lm(cfg)
    rng, noise_rng = np.random.default_rng(seed), np.random.default_rng(noise_seed)

    def one(path, named_sharding, variable):
        name = [p.key for p in path if isinstance(p, jax.tree_util.DictKey)][-1]
        shape, dtype = variable.get_value().shape, variable.get_value().dtype
        offset, std = {"scale": (1.0, 0.2), "u": (0.0, 0.5), "v": (0.0, 0.5), "embed": (0.0, 1.0)}.get(
            name, (0.0, cfg.d_model ** -0.5))
        # q, k, v [..., N, D, H] drawn as [..., D, N, H] and transposed (as `model` draws them):
        # a seed gives the models it gave before they were heads-major.
        heads_major = name in ("wq", "wk", "wv")
        drawn = (*shape[:-3], shape[-2], shape[-3], shape[-1]) if heads_major else shape
        value = offset + std * (rng.standard_normal(drawn) + noise * noise_rng.standard_normal(drawn))
        value = value.swapaxes(-3, -2) if heads_major else value
        return variable.replace(jax.device_put(value.astype(dtype), named_sharding))

    params = jax.tree_util.tree_map_with_path(one, sharding.param_shardings(abstract.params, mesh), abstract.params)
    return model.LM(cfg, abstract.graphdef, params)


def numpy_params(params, dtype=None) -> dict:
    """{"['layers'][0]['attn']['wq']": array, ...} of an nnx State of params."""
    return {jax.tree_util.keystr(p).replace(".value", ""): np.asarray(x, dtype)
            for p, x in jax.tree_util.tree_leaves_with_path(params)}


HOST_OPS = ("outfeed", "infeed", "send(", "recv(", "host_callback", "xla_python_cpu_callback")


def cache_copies(program) -> list[str]:
    """The copies of a whole KV cache (a rank-5 array with the cache's `size` slots on axis
    3: the target's or the draft's, per device) that run inside the generation loop of a
    built `program.Program`: a cache must be carried and written in place."""
    return loop_cache_copies(program.compile().as_text(), program.size)


def loop_cache_copies(text: str, size: int) -> list[str]:
    """`cache_copies` in compiled HLO `text` whose one data-dependent while loop carries
    caches of `size` slots."""
    hlo = HloProgram(text)
    _, line = hlo.generation_loop()
    found, seen, todo = [], set(), hlo._callees(line)
    while todo:
        comp = todo.pop()
        if comp in seen:
            continue
        seen.add(comp)
        for instr, shape, op, text in hlo.instructions(comp):
            dims = re.match(r"\w+\[([\d,]*)\]", shape)
            if op in ("copy", "copy-start") and dims and len(dims.group(1).split(",")) == 5 \
                    and int(dims.group(1).split(",")[3]) == size:
                found.append(f"{instr} {shape}")
            todo += hlo._callees(text)
    assert len(seen) > 1, "the generation loop calls no computation: nothing was searched"
    return found


def fused_loop_collectives(program) -> dict:
    """The collectives per loop of a built `program.Program`, compiled, after checking that
    its HLO holds no host round trip and exactly one data-dependent while loop."""
    text = program.compile().as_text()
    for host_op in HOST_OPS:
        assert host_op not in text, host_op
    hlo = HloProgram(text)
    hlo.generation_loop()  # raises unless ENTRY holds exactly one data-dependent while loop
    return hlo.loop_and_outside()[0]


@jax.jit
def _full_forward(lm, tokens):
    return model.full_forward(lm, tokens)


def logits_of(lm, ids):
    """Logits [B, T, V] of a whole sequence (no cache) as numpy, `ids` placed on the model's mesh."""
    mesh = jax.tree.leaves(lm.params)[0].sharding.mesh
    tokens = jax.device_put(jnp.asarray(ids, jnp.int32), sharding.named(mesh, ("batch", None), ids.shape))
    with jax.set_mesh(mesh):
        return np.asarray(_full_forward(lm, tokens))


def assert_tokenizer_cases(tok, cases: list[dict]) -> None:
    """`tok` encodes and decodes each committed transformers reference case (31 strings:
    with and without special tokens, skipping them or not) exactly as transformers did."""
    assert len(cases) == 31
    for case in cases:
        text = case["text"]
        assert tok.encode_prompt(text) == case["ids"], text
        assert tok.encode(text) == case["ids_no_special"], text
        assert tok.decode(case["ids"]) == case["decode"], text
        assert tok.decode(case["ids"], skip_special_tokens=True) == case["decode_skip_special"], text
        assert tok.decode(case["ids_no_special"]) == case["decode_no_special"], text
