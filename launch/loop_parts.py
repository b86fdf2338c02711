"""Where an SpS loop's time goes: the whole loop body against its parts, each in-situ.

    python launch/loop_parts.py --config=mini --lookahead=4 --prompt_len=128
    python launch/loop_parts.py --drafter=ngram --shape=smollm2_135m --context=distinct,repeating
    python launch/loop_parts.py --config=mini --self_draft=int8 --lookahead=6   # the target's own int8 copy
    python launch/loop_parts.py --config=mini_eagle --drafter=eagle --lookahead=6  # random heads of its setting
    python launch/loop_parts.py --config=mini --drafter=parallel --config.draft.parallel_draft=8 --lookahead=8
    python launch/loop_parts.py --config=mini_eagle3 --drafter=hybrid_eagle3 --lookahead=3 \
        --config.sampling.pass_width=proposed --context=distinct,repeating  # the pass as wide as proposed
    python launch/loop_parts.py --config=mini_eagle3 --drafter=eagle3 --lookahead=1 \
        --config.sampling.draft_tree=dynamic --config.sampling.tree_nodes=3  # a grown tree's loop

Each part runs N times inside one jitted `fori_loop` from the same prefilled state, as
`generate` compiles it (api.compile_lowered), at batch 1:
  speculate       draft K tokens, score K+1 with the target, warp, verify (one SpS loop)
  the loop's whole body
                  `speculative.loop`, the generation loop's body: speculate, then emit the
                  tokens, the stopping rule, the rollbacks and the stats (what the loop adds)
  proposal        the drafter's own K tokens alone (--drafter=model: K draft-model steps;
                  eagle, eagle3: the layer's window pass and K-1 steps; medusa: the heads;
                  hybrid_eagle3: the lookup, and the layer's where it found nothing), then
                  its rollback as after a loop that kept nothing
  ngram lookup    the prompt lookup alone (--drafter=ngram: no draft model)
  target pass     one (K+1)-token target forward alone, and (ngram, or the pass as proposed)
                  a 1-token one: the pass of a loop that proposed nothing
  target + verify the same plus the target's warp and the config's verifier
With `--config.sampling.draft_tree=dynamic` (model, eagle, eagle3, parallel) the proposal
is the tree's growth (`growth.grow`, N nodes), and the target pass and its verification
are over N + 1 nodes with a per-row visibility (a root with N children: the pass's cost
does not depend on the tree's shape) and the tree rule.
--shape=NAME takes the target's shape from launch/shapes.py (random weights).
--context says what the token buffer holds, which decides what a lookup finds:
'random' (random prompt tokens, zeros after them), 'distinct' (every position a
different token: the lookup never finds anything) or 'repeating' (a 16-token pattern:
it finds K tokens every loop); each context is a separate row, interleaved.
Per-iteration time = (time of 65 iterations - time of 5) / 60, so the prefill and the
launch cancel; medians over repeats (a part cheaper than the noise of that difference,
such as a tiny model's 1-token pass, can come out a hair below zero). If `speculate` costs more than the sum of its parts,
the difference is interaction (both models' weights and caches sharing the caches of
the CPU), not work: the parts do all the work the loop does. Random weights (the
costs do not depend on their values). `--kernels=on,matmul+attention` compiles every
part under each kernel setting (`Kernels`: static, so each is its own program) and
interleaves all of them (an A/B in one run). `--config.sampling.pass_width=proposed` times
`speculate` and the loop's body with the scoring pass as wide as the proposal (the context
decides it: 'distinct' gives a lookup nothing to propose), as sample's --pass_width does.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import flags  # noqa: E402

from specjax.app import cli, setup  # noqa: E402
from specjax.app.locate import Sources  # noqa: E402
from specjax import kv_cache  # noqa: E402
from specjax.decode import drafters, growth, program as program_lib, speculative as sps, tree, verify  # noqa: E402
from specjax.decode.warping import Warp, warp  # noqa: E402
from specjax.kernels import Kernels  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import SHAPES  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
    cli.define_config_flag("mini")
    flags.DEFINE_integer("lookahead", 4, "K.")
    flags.DEFINE_integer("prompt_len", 128, "Prompt tokens prefilled before the timed loops.")
    flags.DEFINE_integer("cache", 400, "Cache slots.")
    flags.DEFINE_integer("repeats", 5, "Timed pairs (65 and 5 iterations) per part; medians.")
    flags.DEFINE_list("kernels", ["default"], "Kernel settings to compare, interleaved (as forward_cost.py's: on, "
                      "off, default, or kernels' names joined by +, e.g. matmul+attention).")
    flags.DEFINE_enum("drafter", None, list(DRAFTERS), "The drafter (default: the config's); eagle, eagle3 and medusa "
                      "with random heads of the config's heads setting (--config=mini_eagle: its half-width, "
                      "draft-vocabulary, int8 layer).")
    flags.DEFINE_string("shape", None, "The target's shape, one of launch/shapes.py's (default: the config's).")
    flags.DEFINE_string("self_draft", None, "The draft made of the target's own weights, as sample's --self_draft "
                        "(int8, int4, w4a8, w8a8, layers:N, combined with a comma), instead of the config's draft.")
    flags.DEFINE_list("context", ["random"], "What the token buffer holds: random, distinct or repeating.")
    flags.DEFINE_enum("clock", "wall", ["wall", "cpu"], "wall: elapsed time; cpu: this process's CPU time (all its "
                      "threads: on a host shared with other jobs it is inflated far less).")
    cli.define_quantize_flag()


CONTEXTS = ("random", "distinct", "repeating")
# One chain each; hybrid and retrieval (a datastore) are not timed here.
DRAFTERS = ("model", "ngram", "eagle", "eagle3", "medusa", "parallel", "hybrid_eagle3")


def token_buffer(context: str, size: int, prompt_len: int, vocab: int) -> jax.Array:
    """[1, size] tokens: `context` (see the module docstring) over the whole buffer, so that
    a lookup sees it however far the timed loops advance the length."""
    rng = np.random.default_rng(0)
    if context == "random":
        tokens = np.zeros(size, np.int64)
        tokens[:prompt_len] = rng.integers(0, vocab, prompt_len)
    elif context == "distinct":
        tokens = rng.permutation(vocab)[np.arange(size) % vocab]
    else:
        tokens = rng.integers(0, vocab, 16)[np.arange(size) % 16]
    return jnp.asarray(tokens[None], jnp.int32)


def never(x) -> jax.Array:
    """0, from a value XLA cannot prove constant: keeps a part's output live (no DCE)."""
    return (x == -7).astype(jnp.int32)


def star(batch: int, nodes: int, K: int, x: jax.Array, p: jax.Array) -> tree.Tree:
    """A grown tree's layout for the timed target parts: N children of the root, parents
    per row (so the pass takes its per-row visibility, as a grown tree's)."""
    per_row = jnp.zeros((batch, nodes), jnp.int32)
    return tree.Tree(x, p, per_row, per_row + 1, jnp.ones((batch, nodes), bool), per_row, per_row, K)


def parts(K: int, w: Warp, rule: str, drafter: str, pass_width: str = "full", nodes: int = 0):
    settings = sps.Settings(K, w, rule, pass_width=pass_width, tree_nodes=nodes)

    def speculate(t, d, s):
        key, r = sps.speculate(t, d, s, settings)
        length = s.length + 3 + never(r.num_accepted) + never(r.next_token)
        # The drafter's own rollback (a draft cache to length - its window; nothing for a lookup).
        state = d.update(r.drafter_state, drafters.Verdict(length, r.num_accepted, r.next_token, r.chain, r.features))
        return dataclasses.replace(s, key=key, target_cache=r.target_cache.with_lengths(s.length + 2),
                                   drafter_state=state, length=length)

    def grown(t, d, s):
        # The tree's growth (the drafter's root call and one per further round), then the
        # drafter's rollback as after a loop that kept none.
        key, sub = jax.random.split(s.key)
        nodes_, state, bad = growth.grow(d, s.drafter_state, s.tokens, s.length, sub, K, nodes, w,
                                         t.cfg.vocab_size)
        length = s.length + 3 + never(nodes_.x[:, -1]) + never(nodes_.p[:, -1, 0]) + bad
        return dataclasses.replace(s, key=key, drafter_state=rolled_back(t, d, state, length), length=length)

    def rolled_back(t, d, state, length):
        batch = length.shape[0]
        width = t.cfg.d_model * (len(d.features) if isinstance(d.features, tuple) else 1)  # EAGLE-3: its layers'
        features = jnp.zeros((batch, K + 1, width), t.cfg.compute_dtype) if d.features else None
        zero = jnp.zeros((batch,), jnp.int32)
        return d.update(state, drafters.Verdict(length, zero, zero, zero, features))

    def draft_tokens(t, d, s):
        # The drafter's own propose (a draft model's K steps, an EAGLE layer's window pass
        # and K-1 steps, Medusa's heads), then its rollback as after a loop that kept none.
        key, sub = jax.random.split(s.key)
        prop, state, bad = d.propose(s.drafter_state, s.tokens, s.length, sub, K, 1, w)
        length = s.length + 3 + never(prop.x[:, 0, -1]) + never(prop.p[:, 0, -1, 0]) + bad
        return dataclasses.replace(s, key=key, drafter_state=rolled_back(t, d, state, length), length=length)

    def lookup(t, d, s):
        prop, hit = d.lookup(s.tokens, s.length, K)
        return dataclasses.replace(s, length=s.length + 3 + never(prop.x[:, -1]) + never(prop.length) + never(hit))

    def target(t, d, s, width: int, accept: bool):
        batch = s.tokens.shape[0]
        if nodes and width > 1:  # a grown tree's pass: per-row visibility, positions by depth
            layout = star(batch, nodes, K, s.tokens[:, 1:width], None)
            pos = s.length[:, None] - 1 + tree.depths(layout)
            logits, fresh = t(s.tokens[:, :width], pos, s.target_cache, tree.visibility(layout))
            cache = kv_cache.commit(s.target_cache, fresh, s.length - 1, jnp.zeros((batch, K + 1), jnp.int32))
        else:
            pos = s.length[:, None] - 1 + jnp.arange(width)[None]
            logits, cache = t.extend(s.tokens[:, :width], pos, s.target_cache)
        out = never(logits[:, 0, 0])
        if accept:
            q, bad = warp(logits, w)
            if nodes:
                proposal = star(batch, nodes, K, s.tokens[:, 1:width], q[:, :nodes])
            else:
                proposal = tree.of_chains(drafters.Proposal(s.tokens[:, None, 1:K + 1], q[:, None, :K],
                                                            jnp.full((batch, 1), K), jnp.zeros((batch, 1), jnp.int32)),
                                          K)
            # as speculate lays it and chooses its rule
            n, _, token, empty = verify.select(rule, 1, bool(nodes), w.greedy)(s.key, proposal, q)
            out = never(n) + never(token) + jnp.any(bad, axis=1) + empty
        return dataclasses.replace(s, target_cache=cache.with_lengths(s.length + 2), length=s.length + 3 + out)

    def whole(t, d, s):
        # The generation loop's own body (speculative.loop: speculate, then emit, stop, roll back,
        # update the drafter and count the stats), its length and the target's held to
        # `speculate`'s +3 a loop.
        state = sps.loop(t, d, s, settings, jnp.int32(2 ** 30), -1)
        return dataclasses.replace(state, target_cache=state.target_cache.with_lengths(s.length + 2),
                                   length=s.length + 3 + never(state.length))

    out = {"speculate (one SpS loop)": speculate, "the loop's whole body (speculative.loop)": whole}
    if nodes:
        out[f"{drafter} tree growth ({nodes} nodes)"] = grown
    elif drafters.draft_kind(drafter) is not None:
        out[f"{drafter} proposal (K tokens)"] = draft_tokens
    else:
        out[f"{drafter} lookup"] = lookup
    if drafters.draft_kind(drafter) is None or pass_width == "proposed" or nodes:
        out["target pass (1 token)"] = lambda t, d, s: target(t, d, s, 1, False)
    width = nodes + 1 if nodes else K + 1
    out[f"target pass ({width} tokens{', a tree' if nodes else ''})"] = lambda t, d, s: target(t, d, s, width, False)
    checked = verify.chosen(rule, 1, bool(nodes), w.greedy)
    out[f"target + warp + {checked} verify"] = lambda t, d, s: target(t, d, s, width, True)
    return out


def main(argv):
    config = cli.config()
    drafter = FLAGS.drafter or config.sampling.drafter
    if drafter not in DRAFTERS:
        raise cli.UsageError(f"drafter {drafter!r}: loop_parts measures the {', '.join(DRAFTERS)} drafters")
    if FLAGS.shape is not None:
        if FLAGS.shape not in SHAPES:
            raise cli.UsageError(f"--shape={FLAGS.shape}: not one of {', '.join(SHAPES)}")
        config = dataclasses.replace(config, target=SHAPES[FLAGS.shape], tokenizer_vocab=0)
    K = FLAGS.lookahead
    # The one run setup, random weights (heads of the config's setting): what the drafter
    # declares it draws from, the self-draft and the quantization checked as every command's.
    run = setup.prepare(setup.Request(config, dataclasses.replace(config.sampling, drafter=drafter), (drafter,),
                                      lookahead=K, sources=Sources(init="random", self_draft=FLAGS.self_draft),
                                      quantize=cli.quantize()))
    config, need_draft = run.config, run.draft_model
    if need_draft and config.draft.vocab_size != config.target.vocab_size:
        raise cli.UsageError(f"--shape={FLAGS.shape}: vocab {config.target.vocab_size} is not the draft's "
                             f"{config.draft.vocab_size} (use --drafter=ngram)")
    if K < 1 or FLAGS.prompt_len < K + 2 or FLAGS.cache < FLAGS.prompt_len + 3 * 65 + K + 2:
        raise cli.UsageError(f"need --lookahead >= 1, --prompt_len >= K+2 and --cache >= prompt_len + 3*65 + K + 2 "
                             f"(got {K}, {FLAGS.prompt_len}, {FLAGS.cache})")
    bad = [c for c in FLAGS.context if c not in CONTEXTS]
    if bad or not FLAGS.context:
        raise cli.UsageError(f"--context={','.join(FLAGS.context)}: each must be one of {', '.join(CONTEXTS)}")
    chosen = {}
    for setting in FLAGS.kernels:  # checked before any weights load
        try:
            chosen[setting] = Kernels.parse(setting)
        except ValueError as e:
            raise cli.UsageError(f"--kernels: {e}")
    run.load()
    mesh, target, draft = run.mesh, run.target, run.draft_for(drafter)
    w = program_lib.warping_of(config.sampling)
    values = jnp.asarray(w.values())
    nodes = config.sampling.tree_nodes if config.sampling.draft_tree == "dynamic" else 0
    buffers = {c: token_buffer(c, FLAGS.cache, FLAGS.prompt_len, config.target.vocab_size) for c in FLAGS.context}
    lens = jnp.array([FLAGS.prompt_len], jnp.int32)
    print(f"{config.name}{f' with the target shape {FLAGS.shape}' if FLAGS.shape else ''}"
          f"{f', {FLAGS.quantize} weights' if cli.quantize() else ''}"
          f"{f', self-draft {FLAGS.self_draft}' if FLAGS.self_draft else ''}: drafter {drafter}, "
          f"K={K}, prompt {FLAGS.prompt_len}, cache {FLAGS.cache}, {w}"
          f"{', the pass as proposed' if config.sampling.pass_width == 'proposed' else ''}"
          f"{f', a dynamic tree of {nodes} nodes' if nodes else ''}")
    runs, subjects = {}, {}
    sampling = dataclasses.replace(config.sampling, drafter=drafter, lookahead=K)
    for setting, kernels in chosen.items():
        # As decoding runs them: the setting is the models' and the warp's static data (each
        # setting its own programs), the weights packed where the matmul kernel runs.
        subject = target.with_kernels(kernels).packed()
        d = drafters.make(sampling, subject, draft.with_kernels(kernels) if need_draft else draft, None, mesh)
        subjects[setting] = (subject, d)
        # As the real loop: the warp's temperature and top-p traced (Warp.static / bind).
        warping = w._replace(kernels=kernels).static()
        width = config.sampling.pass_width
        for name in parts(K, warping, config.sampling.verify, drafter, width, nodes):
            def program(t, d, buffer, n, values, name=name, warping=warping):
                bound = warping.bind(values)
                body = parts(K, bound, config.sampling.verify, drafter, width, nodes)[name]
                state = sps.start(t, d, buffer[:, :FLAGS.prompt_len], lens, jax.random.key(0), sps.Settings(K, bound),
                                  FLAGS.cache)
                state = dataclasses.replace(state, tokens=buffer)
                return jax.lax.fori_loop(0, n, lambda i, st: body(t, d, st), state).length

            with jax.set_mesh(mesh):
                example = next(iter(buffers.values()))
                runs[name, setting] = program_lib.compile_lowered(  # the trip count an argument: one compile
                    jax.jit(program).lower(*subjects[setting], example, jnp.int32(5), values))
    keys = [(name, setting, c) for (name, setting) in runs for c in FLAGS.context]
    now = time.perf_counter if FLAGS.clock == "wall" else time.process_time
    times = {key: [] for key in keys}
    with jax.set_mesh(mesh):
        for _ in range(FLAGS.repeats):
            for name, setting, c in keys:  # interleaved: machine noise hits every part alike
                run, args = runs[name, setting], (*subjects[setting], buffers[c])
                start = now()
                run(*args, jnp.int32(65), values).block_until_ready()
                middle = now()
                run(*args, jnp.int32(5), values).block_until_ready()
                times[name, setting, c].append(((middle - start) - (now() - middle)) / 60 * 1e3)
    for (name, setting, c), t in times.items():
        label = (f" [{setting}]" if len(FLAGS.kernels) > 1 else "") + (f" [{c}]" if len(FLAGS.context) > 1 else "")
        print(f"  {name + label:60s} {np.median(t):7.2f} {FLAGS.clock} ms per iteration "
              f"(spread {np.min(t):.2f}-{np.max(t):.2f})")

if __name__ == "__main__":
    define_flags()
    cli.run(main)
