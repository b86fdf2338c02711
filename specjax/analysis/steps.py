"""The generation loop's parts compiled as programs of their own, and what each costs.

A compiled program that holds a `while` has no cost of its own (XLA:TPU's
`optimal_seconds` is -1 and its counts cover each loop body once), so `plan` compiles
the parts of THE loop a `Program` runs, from the same functions, settings and
shardings: `ars.step` (one ArS step, the loop's body), `speculative.loop` (one whole SpS
loop), the target's scoring pass over the loop's nodes (the one forward, `warp`,
`kv_cache.commit`, as `speculative.speculate` calls them) and the drafter's `propose`
(its K steps). Their inputs are the loop's state as `start` makes it, abstract; their
layouts, in and out, are the compiler's choice (`Layout.AUTO`) and what a step updates is
donated to it, as inside the loop, where XLA lays out what the loop carries once for every
iteration and updates it in place.

Each step's `Traffic` (`hlo.HloProgram.traffic`: bytes read from HBM, matmul FLOPs,
loops times their trip counts) is set against its ideal bytes: the weights that its
forwards multiply by, once per forward, plus the caches they attend (`ideal`). The
definitions are in docs/pods.md.
"""
from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
from jax.experimental.layout import Format, Layout

from specjax import kv_cache, sharding
from specjax.analysis.hlo import HloProgram, summarize
from specjax.analysis.roofline import Chip, collective_load, shard_bytes
from specjax.decode import ars, speculative, tree
from specjax.decode.program import Program, compile_lowered, seed_key
from specjax.decode.warping import warp
from specjax.kv_cache import KVCache


def placed(tree_, mesh) -> object:
    """Shardings for an abstract loop state as the program pins them: caches by
    `kv_cache`'s axes (the position table by heads), every other array split over
    'data' on its leading (batch) axis where that divides, else replicated."""
    def one(x):
        if isinstance(x, KVCache):
            where = lambda a, axes: None if a is None else jax.ShapeDtypeStruct(  # noqa: E731
                a.shape, a.dtype, sharding=sharding.named(mesh, axes, a.shape))
            return KVCache(where(x.k, kv_cache.CACHE_AXES), where(x.v, kv_cache.CACHE_AXES),
                           where(x.lengths, ("batch",)), where(x.position_table, kv_cache.TABLE_AXES))
        names = ("batch",) + (None,) * (len(x.shape) - 1) if x.shape else ()
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding.named(mesh, names, x.shape))
    return jax.tree.map(one, tree_, is_leaf=lambda x: isinstance(x, KVCache))


def _auto(tree_):
    """The compiler picks every input's layout (as it does for what a loop carries)."""
    return jax.tree.map(lambda x: Format(Layout.AUTO, x.sharding), tree_)


def _cache_bytes(tree_) -> int:
    caches = [x for x in jax.tree.leaves(tree_, is_leaf=lambda x: isinstance(x, KVCache)) if isinstance(x, KVCache)]
    return sum(shard_bytes([c.k, c.v] + ([c.position_table] if c.position_table is not None else [])) for c in caches)


def weight_bytes(lm) -> int:
    """Per-chip bytes of the weights one forward of `lm` multiplies by: every param shard
    but an untied embedding table (the lookup reads B x T of its rows) and
    Transformer-XL's W_r (read when the position table is built, at prefill; a step
    reads the table, counted with the cache)."""
    skip = ("['wr']",) + (() if lm.cfg.tie_embeddings else ("['embed']",))
    return sum(shard_bytes([leaf]) for path, leaf in jax.tree_util.tree_leaves_with_path(lm.params)
               if not any(s in jax.tree_util.keystr(path) for s in skip))


def named_bytes(params, name: str) -> int:
    """Per-chip bytes of the params whose path holds `name` (e.g. "['embed']")."""
    return sum(shard_bytes([leaf]) for path, leaf in jax.tree_util.tree_leaves_with_path(params)
               if name in jax.tree_util.keystr(path))


def unembedding_bytes(lm) -> int:
    """Per-chip bytes of the table that turns `lm`'s features into logits."""
    return named_bytes(lm.params, "['embed']" if lm.cfg.tie_embeddings else "['unembed']")


def drafting_bytes(drafter, state, lookahead: int) -> int:
    """Ideal bytes of one `propose`: the draft model's forwards over its cache rows as the
    drafter declares them (`draft_passes`: K steps, or the parallel drafter's one pass), or
    K passes of draft heads that score against the target's unembedding; an EAGLE-3 layer's
    w_fuse once, read by its window pass alone (later passes feed back its own features)."""
    if type(drafter).needs_draft_model:
        passes, _ = type(drafter).draft_passes(lookahead)
        return passes * (weight_bytes(drafter.lm) + _cache_bytes(state))
    params = drafter.heads.params
    window = named_bytes(params, "['w_fuse']")
    return window + lookahead * (shard_bytes(params) - window + unembedding_bytes(drafter.target) + _cache_bytes(state))


def step_functions(prog: Program) -> dict:
    """{step name: (function, abstract args, ideal bytes, the args it updates)} for the loop
    `prog` runs. What a step updates is donated to it, as the loop carries its state: its
    output aliases its input (undonated, a step copied the whole cache to return it)."""
    mesh, statics = prog.mesh, prog.settings
    size, eos_id = statics["size"], statics["eos_id"]
    with jax.set_mesh(mesh):
        if prog.mode == "ars":
            target, prompts, lens, warp_values, seed, max_new = prog.args
            warping = statics["warping"]
            state = placed(jax.eval_shape(lambda t, p, n, s: ars.start(t, p, n, seed_key(s), size),
                                          target, prompts, lens, seed), mesh)
            step = functools.partial(_ars_step, warping=warping, eos_id=eos_id)
            ideal = weight_bytes(target) + _cache_bytes(state.cache)
            return {"step": (step, (target, state, warp_values, max_new), ideal, (1,))}
        target, drafter, prompts, lens, warp_values, seed, max_new = prog.args
        settings = statics["settings"]
        K, M = settings.lookahead, settings.num_drafts
        state = placed(jax.eval_shape(
            lambda t, d, p, n, s: speculative.start(t, d, p, n, seed_key(s), settings, size),
            target, drafter, prompts, lens, seed), mesh)
        batch = prompts.shape[0]
        nodes = 1 + M * K
        rows = lambda shape, dtype: jax.ShapeDtypeStruct(  # noqa: E731
            shape, dtype, sharding=sharding.named(mesh, ("batch",) + (None,) * (len(shape) - 1), shape))
        score_args = (target, rows((batch, nodes), jnp.int32), rows((batch, nodes), jnp.int32), state.target_cache,
                      warp_values, None if M == 1 else rows((batch, K + 1), jnp.int32))
        score = functools.partial(_score, settings=settings, features=drafter.features)
        key = jax.eval_shape(lambda s: seed_key(s), seed)
        key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=sharding.replicated(mesh))
        propose = functools.partial(_propose, settings=settings)
        target_ideal = weight_bytes(target) + _cache_bytes(state.target_cache)
        draft_ideal = drafting_bytes(drafter, state.drafter_state, K)
        loop = functools.partial(_loop, settings=settings, eos_id=eos_id)
        return {"loop": (loop, (target, drafter, state, warp_values, max_new), target_ideal + draft_ideal, (2,)),
                "score": (score, score_args, target_ideal, (3,)),
                "propose": (propose, (drafter, state.drafter_state, state.tokens, state.length, key, warp_values),
                            draft_ideal, (1,))}


def _ars_step(target, state, warp_values, max_new, *, warping, eos_id):
    return ars.step(target, state, warping.bind(warp_values), max_new[0], eos_id)


def _loop(target, drafter, state, warp_values, max_new, *, settings, eos_id):
    return speculative.loop(target, drafter, state, settings.bind(warp_values), max_new[0], eos_id)


def _score(target, tokens, positions, cache, warp_values, path, *, settings, features):
    """The target's scoring pass as `speculative.speculate` runs it: one forward over the
    pending token and every chain's nodes (tree visibility), q, and the kept path written
    into the cache."""
    logits, fresh = target(tokens, positions, cache, tree.ancestors(tree.chain_parents(settings.num_drafts, settings.lookahead)[0]),
                           features=features)
    q, bad = warp(logits, settings.bind(warp_values).warping)
    return q, bad, kv_cache.commit(cache, fresh, positions[:, 0], path)


def _propose(drafter, state, tokens, length, key, warp_values, *, settings):
    return drafter.propose(state, tokens, length, key, settings.lookahead, settings.num_drafts,
                           settings.bind(warp_values).warping)


def cost(prog: Program, chip: Chip) -> dict:
    """Compile each of `prog`'s steps (`step_functions`) and cost it on `chip`:
    {name: {'bytes_accessed' (HBM bytes read), 'ideal_bytes', 'bytes_ratio', 'flops',
    'collectives', 'estimated_seconds', 'xla': the compiler's own cost_analysis figures,
    'compile_seconds'}}. estimated_seconds = max(bytes / HBM bandwidth, FLOPs / peak)
    + each collective's fixed latency + its bytes on the ICI wire."""
    out = {}
    for name, (fn, args, ideal, donated) in step_functions(prog).items():
        start = time.perf_counter()
        with jax.set_mesh(prog.mesh):
            lowered = jax.jit(fn, in_shardings=_auto(args), out_shardings=Format(Layout.AUTO),
                              donate_argnums=donated).lower(*args)
        compiled = compile_lowered(lowered, prog.platform)
        seconds = time.perf_counter() - start
        program = HloProgram(compiled.as_text())
        traffic = program.traffic()
        collectives = summarize(program.tally(program.entry))
        count, wire = collective_load(collectives, chip)
        xla = compiled.cost_analysis() or {}
        xla = xla[0] if isinstance(xla, (list, tuple)) else xla
        out[name] = {
            "bytes_accessed": traffic.hbm_read, "ideal_bytes": ideal,
            "bytes_ratio": traffic.hbm_read / ideal if ideal else None, "flops": traffic.flops,
            "collectives": collectives, "collective_count": count,
            "estimated_seconds": max(traffic.hbm_read / chip.hbm_bandwidth, traffic.flops / chip.flops)
            + count * chip.collective_latency_s + wire,
            "xla": {k: float(xla[k]) for k in ("bytes accessed", "flops", "optimal_seconds") if k in xla},
            "temporaries": compiled.memory_analysis().temp_size_in_bytes,
            "compile_seconds": seconds}
    return out
