"""Where an SpS loop's time goes: the whole loop body against its parts, each in-situ.

    python launch/loop_parts.py --config=mini --lookahead=4 --prompt_len=128

Each part runs N times inside one jitted `fori_loop` from the same prefilled state, as
`generate` compiles it (api.compile_lowered), at batch 1:
  speculate       draft K tokens, score K+1 with the target, warp, verify (one SpS loop)
  model_proposal  the K draft steps alone
  target pass     one (K+1)-token target forward alone
  target + verify the same plus the target's warp and the config's verifier
Per-iteration time = (time of 65 iterations - time of 5) / 60, so the prefill and the
launch cancel; medians over repeats. If `speculate` costs more than the sum of its parts,
the difference is interaction (both models' weights and caches sharing the caches of
the CPU), not work: the parts do all the work the loop does. Random weights (the
costs do not depend on their values). `--kernels=on,matmul+attention` compiles every
part under each kernel setting (`Kernels`: static, so each is its own program) and
interleaves all of them (an A/B in one run).
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

from specjax import sharding  # noqa: E402
from specjax.app import cli  # noqa: E402
from specjax.app.locate import Weights  # noqa: E402
from specjax.decode import drafters, program as program_lib, speculative as sps, verify  # noqa: E402
from specjax.decode.sampling import Warp, warp  # noqa: E402
from specjax.kernels import Kernels  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
    cli.define_config_flag("mini")
    flags.DEFINE_integer("lookahead", 4, "K.")
    flags.DEFINE_integer("prompt_len", 128, "Prompt tokens prefilled before the timed loops.")
    flags.DEFINE_integer("cache", 400, "Cache slots.")
    flags.DEFINE_integer("repeats", 5, "Timed pairs (65 and 5 iterations) per part; medians.")
    flags.DEFINE_list("kernels", ["default"], "Kernel settings to compare, interleaved (as forward_cost.py's: on, "
                      "off, default, or kernels' names joined by +, e.g. matmul+attention).")


def never(x) -> jax.Array:
    """0, from a value XLA cannot prove constant: keeps a part's output live (no DCE)."""
    return (x == -7).astype(jnp.int32)


def parts(K: int, w: Warp, rule: str):
    settings = sps.Settings(K, w, rule)

    def speculate(t, d, s):
        key, r = sps.speculate(t, d, s, settings)
        return dataclasses.replace(s, key=key, target_cache=r.target_cache.with_lengths(s.length + 2),
                                   drafter_state=r.drafter_state.with_lengths(s.length + 1),
                                   length=s.length + 3 + never(r.num_accepted) + never(r.next_token))

    def draft_tokens(t, d, s):
        key, sub = jax.random.split(s.key)
        prop, cache, bad = drafters.model_proposal(d.lm, s.drafter_state, s.tokens, s.length, sub, K, w)
        return dataclasses.replace(s, key=key, drafter_state=cache.with_lengths(s.length + 1),
                                   length=s.length + 3 + never(prop.x[:, -1]) + never(prop.p[:, -1, 0]) + bad)

    def target(t, d, s, accept: bool):
        pos = s.length[:, None] - 1 + jnp.arange(K + 1)[None]
        logits, cache = t.extend(s.tokens[:, :K + 1], pos, s.target_cache)
        out = never(logits[:, 0, 0])
        if accept:
            q, bad = warp(logits, w)
            batch = q.shape[0]
            chain = drafters.Proposal(s.tokens[:, None, 1:K + 1], q[:, None, :K], jnp.full((batch, 1), K),
                                      jnp.zeros((batch, 1), jnp.int32))
            n, _, token, empty = verify.select(rule, 1)(s.key, chain, q)
            out = never(n) + never(token) + jnp.any(bad, axis=1) + empty
        return dataclasses.replace(s, target_cache=cache.with_lengths(s.length + 2), length=s.length + 3 + out)

    return {"speculate (one SpS loop)": speculate, "model_proposal (K steps)": draft_tokens,
            f"target pass ({K + 1} tokens)": lambda t, d, s: target(t, d, s, False),
            f"target + warp + {rule} verify": lambda t, d, s: target(t, d, s, True)}


def main(argv):
    config = cli.config()
    if config.draft is None:
        raise cli.UsageError(f"--config={config.name}: has no draft model")
    K = FLAGS.lookahead
    if K < 1 or FLAGS.prompt_len < K + 2 or FLAGS.cache < FLAGS.prompt_len + 3 * 65 + K + 2:
        raise cli.UsageError(f"need --lookahead >= 1, --prompt_len >= K+2 and --cache >= prompt_len + 3*65 + K + 2 "
                             f"(got {K}, {FLAGS.prompt_len}, {FLAGS.cache})")
    settings = {}
    for setting in FLAGS.kernels:  # checked before any weights load
        try:
            settings[setting] = Kernels.parse(setting)
        except ValueError as e:
            raise cli.UsageError(f"--kernels: {e}")
    weights = Weights.locate(config, "random", None, None, need_draft=True, train_missing=False)
    mesh = sharding.make_checked_mesh(config.mesh, {"target": config.target, "draft": config.draft})
    models = weights.load(mesh, need_draft=True)
    w = program_lib.warping_of(config.sampling)
    prompts = jnp.asarray(np.random.default_rng(0).integers(0, config.target.vocab_size, (1, FLAGS.prompt_len)),
                          jnp.int32)
    lens = jnp.array([FLAGS.prompt_len], jnp.int32)
    print(f"{config.name}: K={K}, prompt {FLAGS.prompt_len}, cache {FLAGS.cache}, {w}")
    runs, subjects = {}, {}
    for setting, kernels in settings.items():
        target, draft = (lm.with_kernels(kernels).packed() for lm in models)  # as decoding runs them
        subjects[setting] = (target, drafters.ModelDrafter(draft))
        warping = w._replace(kernels=kernels)
        for name, body in parts(K, warping, config.sampling.verify).items():
            def program(t, d, p, n, body=body, warping=warping):
                state = sps.start(t, d, p, lens, jax.random.key(0), sps.Settings(K, warping), FLAGS.cache)
                return jax.lax.fori_loop(0, n, lambda i, st: body(t, d, st), state).length

            with jax.set_mesh(mesh):
                runs[name, setting] = {n: program_lib.compile_lowered(
                    jax.jit(program, static_argnums=3).lower(*subjects[setting], prompts, n)) for n in (5, 65)}
    times = {key: [] for key in runs}
    with jax.set_mesh(mesh):
        for _ in range(FLAGS.repeats):
            for (name, setting), run in runs.items():  # interleaved: machine noise hits every part alike
                args = (*subjects[setting], prompts)
                start = time.perf_counter()
                run[65](*args).block_until_ready()
                middle = time.perf_counter()
                run[5](*args).block_until_ready()
                times[name, setting].append(((middle - start) - (time.perf_counter() - middle)) / 60 * 1e3)
    for (name, setting), t in times.items():
        label = f" [{setting}]" if len(FLAGS.kernels) > 1 else ""
        print(f"  {name + label:48s} {np.median(t):7.2f} ms per iteration")


if __name__ == "__main__":
    define_flags()
    cli.run(main)
