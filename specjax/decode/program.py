"""The one generation path: (models, prompts, sampling, seed) -> a `Program`.

A `Program` is the frozen description of what runs on device: the jitted loop (prefill
plus ONE `lax.while_loop`), its static settings, its arguments already placed on the
mesh, the bucketed prompt width and the cache size. `generate`, `explain_loop`, `bench`,
`evaluate`, `plan` and multi-process runs all build theirs with `build`, so the program
`plan` compiles is the one `generate` runs, on one process or many: every process passes
the same global prompts and feeds only the rows its own devices hold
(`distributed.put`); results are gathered on every process (`distributed.fetch`).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import operator
import os
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Format, Layout

from specjax import distributed, sharding
from specjax.config import SEED_LIMIT, SamplingConfig, UsageError
from specjax.decode import drafters
from specjax.decode.ars import autoregressive_generate
from specjax.decode.warping import Warp
from specjax.decode.retrieval_index import Datastore
from specjax.decode.speculative import Settings, speculative_generate
from specjax.heads import Heads
from specjax.kernels import DEFAULT as DEFAULT_KERNELS, Kernels
from specjax.model import LM

PAD_TO = 16  # the narrowest prompt bucket


def bucket(longest: int, pad_to: int = PAD_TO) -> int:
    """Prompt width for a batch whose longest prompt has `longest` tokens: the next of the
    widths 2^k and 1.5 * 2^k (at least `pad_to`), so prompts of similar length share one
    compiled program and a prompt is padded by at most a third. (Powers of two alone pad
    by up to a half; the prefill is compute-bound on CPU, so padding costs its share of
    each sequence's time.)"""
    power = 1 << (longest - 1).bit_length()
    return max(pad_to, power // 4 * 3 if power // 4 * 3 >= longest else power)


def cache_size(width: int, max_new: int, lookahead: int) -> int:
    """Token-buffer and KV-cache slots: the prompt bucket, the new tokens, and room for a
    last loop's K+1 scored positions past the budget."""
    return width + max_new + lookahead + 1


def seed_key(seed: jax.Array) -> jax.Array:
    """A PRNG key from a seed split into uint32 (low, high) words. Seeds below 2**32 give
    `jax.random.key(seed)` itself; larger ones fold the high word in, so every seed in
    [0, 2**63) has its own stream without 64-bit mode."""
    low = jax.random.key(seed[0])
    data = jnp.where(seed[1] == 0, jax.random.key_data(low), jax.random.key_data(jax.random.fold_in(low, seed[1])))
    return jax.random.wrap_key_data(data)


SPS_STATICS = ("settings", "eos_id", "size")

# The token budget (max_new_tokens) is a traced argument ([1] int32), the last of every program's, so
# that `Program.run` can warm a compiled program up with a budget of one token (a prefill
# and one loop) instead of a whole generation. (The budget still sets the cache size, a
# static: a larger budget is another program.)


@functools.partial(jax.jit, static_argnames=SPS_STATICS)
def sps_program(target, drafter, prompts, prompt_lens, warp_values, seed, max_new, *, settings, eos_id, size):
    """`drafter` (a pytree: a draft model's params, a datastore's index) carries its own
    static settings; `settings` are the loop's, their warping `Warp.static()`, whose
    temperature and top-p come traced in `warp_values` (`Warp.values()`)."""
    return speculative_generate(target, drafter, prompts, prompt_lens, seed_key(seed),
                                settings=settings.bind(warp_values), max_new=max_new[0], eos_id=eos_id, size=size)


@functools.partial(jax.jit, static_argnames=("warping", "eos_id", "size"))
def ars_program(target, prompts, prompt_lens, warp_values, seed, max_new, *, warping, eos_id, size):
    return autoregressive_generate(target, prompts, prompt_lens, seed_key(seed), warping=warping.bind(warp_values),
                                   max_new=max_new[0], eos_id=eos_id, size=size)


# --------------------------------------------------------------------------- input checks


def check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise UsageError(f"seed={seed!r}: must be an integer in [0, 2**63)")
    if not 0 <= int(seed) < SEED_LIMIT:
        raise UsageError(f"seed={int(seed)}: must be in [0, 2**63)")
    return int(seed)


def as_token_lists(prompts, names: Sequence[str] | None = None) -> list[list[int]]:
    """Prompts as lists of Python ints: a sequence of sequences of integers (lists,
    tuples, 1-D integer arrays, or a 2-D integer array of equal-length rows). Floats,
    bools and strings are refused rather than truncated or coerced."""
    if isinstance(prompts, np.ndarray):
        if prompts.ndim != 2:
            raise UsageError(f"prompts: an array of prompts must be 2-D [rows, tokens], got shape {prompts.shape}")
        prompts = list(prompts)
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) and not isinstance(prompts, np.ndarray):
        raise UsageError(f"prompts: expected a list of token-id lists, got {type(prompts).__name__}")
    out = []
    for i, prompt in enumerate(prompts):
        # The common case, lists of Python ints, checked at C speed (a batch may hold
        # 100,000 rows); anything else takes the checks below.
        if type(prompt) is list and all(type(t) is int for t in prompt):
            out.append(prompt.copy())
            continue
        name = names[i] if names else f"prompt {i}"
        if isinstance(prompt, np.ndarray):
            if prompt.ndim != 1 or not (np.issubdtype(prompt.dtype, np.integer) or prompt.size == 0):
                raise UsageError(f"{name}: expected a 1-D array of integer token ids, got {prompt.dtype} "
                                 f"shape {prompt.shape}")
            prompt = prompt.tolist()
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
            raise UsageError(f"{name}: expected a list of integer token ids, got {type(prompt).__name__}")
        bad = next((t for t in prompt if isinstance(t, bool) or not isinstance(t, (int, np.integer))), None)
        if bad is not None:
            raise UsageError(f"{name}: token id {bad!r} is not an integer")
        out.append([int(t) for t in prompt])
    return out


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int, context: int, max_new_tokens: int,
                  names: Sequence[str] | None = None, budget: str = "max_new_tokens") -> None:
    """Fail on the first bad prompt, naming it (`names[i]`, e.g. "--prompt #1" or
    "p.jsonl:3"; default "prompt i") and the allowed values; `budget` is what the
    caller calls max_new_tokens (the command line says "--max_new_tokens")."""
    if not prompts:
        raise UsageError("no prompts given")
    if max_new_tokens >= context:
        raise UsageError(f"{budget}={max_new_tokens}: must be below the model's context of {context} "
                         "tokens (max_seq_len), which also holds the prompt")
    for i, prompt in enumerate(prompts):
        name = names[i] if names else f"prompt {i}"
        if len(prompt) == 0:
            raise UsageError(f"{name} is empty: every prompt needs at least one token")
        if min(prompt) < 0 or max(prompt) >= vocab_size:
            bad = next(t for t in prompt if not 0 <= t < vocab_size)
            raise UsageError(f"{name}: token id {bad} is outside the vocabulary: allowed ids are 0..{vocab_size - 1}")
        if len(prompt) + max_new_tokens > context:
            raise UsageError(f"{name} has {len(prompt)} tokens; with {budget}={max_new_tokens} that is "
                             f"{len(prompt) + max_new_tokens} positions, more than the model's context of "
                             f"{context} (at most {context - max_new_tokens} prompt tokens)")


def context_of(target: LM, draft: LM | None) -> int:
    return min(lm.cfg.max_seq_len for lm in (target, draft) if lm is not None)


# --------------------------------------------------------------------------- the program


# XLA:CPU (jaxlib 0.10) hands multi-row dots to YNNPACK fusions by default; for the
# few-row matmuls of decoding they are slower than XLA's own dot emitter
# (benchmarks/figure1.md). Every program compiled here for a CPU turns them off; other
# backends get no options.
CPU_COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


def compile_lowered(lowered, platform: str | None = None):
    """Compile with CPU_COMPILER_OPTIONS for CPU devices (without them where this jaxlib
    does not know the option). `platform`: the devices' (default: the default backend's;
    `plan` compiles for TPU devices from a CPU-only process)."""
    if (platform or jax.default_backend()) == "cpu":
        try:
            return lowered.compile(compiler_options=CPU_COMPILER_OPTIONS)
        except jax.errors.JaxRuntimeError as e:
            if "No such compile option" not in str(e):
                raise
    return lowered.compile()


_COMPILED: dict = {}
_JITTED: dict = {}
_WARMED: set = set()  # compiled programs that have run once in this process
# The untimed warm-up of `Program.run` costs a prefill and one loop per compiled program,
# for a steady-state ms/token. SPECJAX_WARMUP=0 (read once, here) skips it where the first
# batch's timing does not matter (one-shot batches, the test suite); its ms/token then
# includes first-run costs. Anything else, or unset: warm up.
WARM_UP = os.environ.get("SPECJAX_WARMUP", "1").strip() != "0"


@dataclasses.dataclass(frozen=True)
class Program:
    """Everything one generation run is on device. `args` are placed on `mesh` (the run
    needs no host<->device transfer); `statics` are the jit's static settings."""

    fn: Callable
    args: tuple
    statics: tuple  # sorted (name, value) pairs
    mesh: jax.sharding.Mesh
    batch: int
    width: int  # bucketed prompt width
    size: int  # cache / token-buffer slots
    mode: str  # 'sps' | 'ars'
    prompt_lens: tuple[int, ...]  # tokens per prompt, on the host
    sampling: SamplingConfig  # what the program samples with (its drafter, verifier, K, M)

    @property
    def settings(self) -> dict[str, Any]:
        return dict(self.statics)

    @property
    def lookahead(self) -> int:
        return self.sampling.lookahead if self.mode == "sps" else 1

    @property
    def platform(self) -> str:
        """The devices' platform ('cpu', 'tpu', ...): what the program is compiled for."""
        return self.mesh.devices.flat[0].platform

    def formats(self) -> tuple:
        """How the program takes each argument: as placed, but the drafter's own arrays of
        two or more axes (a draft model's weights, draft heads) in the layout XLA chooses
        (`Layout.AUTO`). Only the SpS program reads them, so no other program can want them
        laid out otherwise; the target's weights serve ArS and SpS programs alike and keep
        the layout they are placed in, also where a drafter holds them (EAGLE's embedding
        and unembedding: the same arrays as the target's). Held to the runtime's default
        layout, XLA:TPU copied v5p's head_dim-64 q, k and v weights ([.., 2048, 64]) inside
        the program, 32 MiB of temporaries for Llama-3.2-1B, where left to choose it picks
        that same layout and reads them as stored (docs/pods.md). On XLA:CPU the choice is
        the default layout."""
        where = [jax.tree.map(lambda x: x.sharding, a) for a in self.args]
        if self.mode == "sps":
            shared = {id(x) for x in jax.tree.leaves(self.args[0])}
            where[1] = jax.tree.map(lambda x: Format(Layout.AUTO, x.sharding)
                                    if len(x.shape) >= 2 and id(x) not in shared else x.sharding, self.args[1])
        return tuple(where)

    def lower(self):
        formats = self.formats()
        leaves, treedef = jax.tree.flatten(formats)
        key = (self.fn, self.statics, treedef, tuple(leaves))
        if key not in _JITTED:  # one jit per program and placement: its trace is shared (plan's, generate's)
            fn = functools.wraps(self.fn)(functools.partial(self.fn.__wrapped__, **self.settings))
            _JITTED[key] = jax.jit(fn, in_shardings=formats)
        with jax.set_mesh(self.mesh):
            # Lowered from shapes: an argument given in a layout XLA is to choose cannot be a placed array.
            shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.args)
            return _JITTED[key].lower(*shapes)

    def _key(self):
        leaves, treedef = jax.tree.flatten(self.args)
        return (self.fn, treedef, tuple((x.shape, str(x.dtype), x.sharding) for x in leaves), self.statics)

    def compile(self):
        """AOT-compiled once per (program, shapes, shardings, settings), so timings exclude compiles."""
        key = self._key()
        if key not in _COMPILED:
            _COMPILED[key] = compile_lowered(self.lower(), self.platform)
        return _COMPILED[key]

    def run(self) -> tuple[Any, float, float]:
        """(outputs as numpy on every process, run seconds, compile seconds: until every
        process has compiled, the slowest one's). The run
        happens under a transfer guard: a silent host<->device copy inside it fails.

        The timed run starts on every process together: each compiles at its own pace (on
        a pod one host may load the program from its compilation cache while another
        compiles it for minutes), so all wait at a barrier first; otherwise this host's
        first collective would wait for the slowest one inside the timed region. The first
        run of a compiled program is an untimed warm-up (loading the executable onto the
        devices, first allocations), so ms/token is the steady state on every process; it
        runs the same program with a budget of one token, so it costs a prefill and one
        loop, not a second generation."""
        if any(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(self.args)):
            raise ValueError("this program was built from abstract prompts or params (ShapeDtypeStructs): it can be "
                             "lowered and compiled, not run")
        start = time.perf_counter()
        compiled = self.compile()
        distributed.barrier("specjax: programs compiled")
        # Counted through the barrier: the seconds until every process holds the program,
        # so worker 0's figure shows a host that recompiles while worker 0 loads its cache.
        compile_seconds = time.perf_counter() - start
        key = self._key()
        args = laid_out(self.args, compiled.input_formats[0])
        # The warm-up's budget is placed before the guard: its transfer is the only one.
        warm_up = WARM_UP and key not in _WARMED
        one = distributed.put(np.ones(1, np.int32), sharding.replicated(self.mesh)) if warm_up else None
        with jax.set_mesh(self.mesh):
            with jax.transfer_guard("disallow"):
                if warm_up:
                    jax.block_until_ready(compiled(*args[:-1], one))
                    _WARMED.add(key)
                start = time.perf_counter()
                out = compiled(*args)
                jax.block_until_ready(out)
            seconds = time.perf_counter() - start
        return distributed.fetch(out), seconds, compile_seconds


def laid_out(args, formats):
    """`args` in the layouts of `formats` (a compiled program's `input_formats[0]`): an array
    placed in another layout (a draft weight where XLA chose one for it, `Program.formats`)
    is copied into the chosen one, on its devices; every other array is passed as it is."""
    def one(x, want):
        if want is None or want.layout is None or x.format.layout == want.layout:
            return x
        return jax.device_put(x, want)
    return jax.tree.map(one, args, formats)


def fingerprint(compiled) -> str:
    """A short hash of a compiled program's HLO text: equal programs, equal fingerprints."""
    return hashlib.sha256(compiled.as_text().encode()).hexdigest()[:16]


def mesh_of(lm: LM) -> jax.sharding.Mesh:
    return jax.tree.leaves(lm.params)[0].sharding.mesh


def warping_of(sampling: SamplingConfig, kernels: Kernels = DEFAULT_KERNELS) -> Warp:
    return Warp(float(sampling.temperature), int(sampling.top_k), float(sampling.top_p), kernels)


def check_models(target: LM, draft: LM | Heads | None) -> None:
    if not isinstance(target, LM):
        raise UsageError(f"target: expected a specjax LM (specjax.init_lm, specjax.load_lm), got "
                         f"{type(target).__name__}")
    if draft is None or isinstance(draft, Heads):  # heads are checked against the target by their drafter
        return
    if not isinstance(draft, LM):
        raise UsageError(f"draft: expected a specjax LM, draft heads (specjax.heads) or None (ArS), got "
                         f"{type(draft).__name__}")
    if draft.cfg.vocab_size != target.cfg.vocab_size:
        raise UsageError(f"the draft's vocabulary has {draft.cfg.vocab_size} tokens and the target's "
                         f"{target.cfg.vocab_size}: speculative sampling needs one shared vocabulary")


def check_datastore(datastore, vocab_size: int) -> None:
    if datastore is None:
        return
    if not isinstance(datastore, Datastore):
        raise UsageError(f"datastore: expected a specjax Datastore (Datastore.load / Datastore.build), got "
                         f"{type(datastore).__name__}")
    datastore.check(vocab_size)


def build(target: LM, draft: LM | None, prompts, sampling: SamplingConfig, seed: int = 0,
          pad_to: int = PAD_TO, names: Sequence[str] | None = None, datastore: Datastore | None = None) -> Program:
    """Validate everything, bucket and place the prompts: the program that generates
    continuations of `prompts` with SpS (the drafter sampling.drafter names: a draft
    model, a lookup, or both) or ArS (drafter 'model' and draft=None).

    `prompts` a `jax.ShapeDtypeStruct` [B, W] (`plan`): B prompts of W tokens whose ids
    are not known. Every argument of the program is then a sharded ShapeDtypeStruct, as
    the params of `model.abstract_lm` are: it can be lowered and compiled, not run, and
    building it touches no device (a compile-only client, such as XLA:TPU's without a
    TPU, has none to touch)."""
    sampling.validate()
    check_models(target, draft)
    check_datastore(datastore, target.cfg.vocab_size)
    seed = check_seed(seed)
    abstract = isinstance(prompts, jax.ShapeDtypeStruct)
    if abstract:
        if len(prompts.shape) != 2 or min(prompts.shape) < 1 or prompts.dtype != jnp.int32:
            raise UsageError(f"prompts: an abstract batch must be int32 [rows, tokens] with both at least 1, "
                             f"got {prompts.dtype}{list(prompts.shape)}")
        prompts = [[0] * prompts.shape[1]] * prompts.shape[0]  # their lengths, for the checks and the buckets
    else:
        prompts = as_token_lists(prompts, names)
    kind = drafters.draft_kind(sampling.drafter)
    used = draft if kind else None  # ngram and retrieval ignore a draft given
    if kind == "model" and isinstance(used, Heads) or kind == "heads" and isinstance(used, LM):
        raise UsageError(f"drafter={sampling.drafter!r} draws from {'a draft model' if kind == 'model' else 'draft heads'}"
                         f", and the draft given is {'draft heads' if kind == 'model' else 'a model'}")
    context = context_of(target, used if isinstance(used, LM) else None)
    check_prompts(prompts, target.cfg.vocab_size, context, sampling.max_new_tokens, names)
    if any(i >= target.cfg.vocab_size for i in sampling.stop_ids):
        raise UsageError(f"eos_id={sampling.eos_id}: outside the vocabulary (a row would never stop on it); "
                         f"allowed are token ids 0..{target.cfg.vocab_size - 1}, or -1 to never stop early")
    speculative = used is not None or kind is None
    lookahead = sampling.lookahead if speculative else 1
    if lookahead >= context:
        raise UsageError(f"lookahead={lookahead}: must be below the model's context of {context} tokens")
    if speculative and sampling.num_drafts > target.cfg.vocab_size:
        raise UsageError(f"num_drafts={sampling.num_drafts}: must be at most the vocabulary's "
                         f"{target.cfg.vocab_size} tokens")
    mesh = mesh_of(target)
    target = target.packed()  # where the CPU kernel runs (the drafter packs its own draft)
    drafter = drafters.make(sampling, target, draft, datastore, mesh)
    width = bucket(max(len(p) for p in prompts), pad_to)
    size = cache_size(width, sampling.max_new_tokens, lookahead)
    padded = np.zeros((len(prompts), width), np.int32)
    for i, prompt in enumerate(prompts):
        padded[i, :len(prompt)] = prompt
    lens = np.array([len(p) for p in prompts], np.int32)
    words = np.array([seed & 0xFFFFFFFF, seed >> 32], np.uint32)
    warping = warping_of(sampling, target.kernels)
    place = (lambda a, where: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where)) if abstract else distributed.put
    args = (place(padded, sharding.named(mesh, ("batch", None), padded.shape)),
            place(lens, sharding.named(mesh, ("batch",), lens.shape)),
            place(warping.values(), sharding.replicated(mesh)),
            place(words, sharding.replicated(mesh)),
            place(np.array([sampling.max_new_tokens], np.int32), sharding.replicated(mesh)))
    warping = warping.static()  # the program's key: one compiled loop for every temperature > 0 and top-p < 1
    statics = dict(eos_id=-1 if sampling.eos_id is None else sampling.eos_id, size=size)  # None: no stop ids here
    if drafter is not None:
        settings = Settings(lookahead, warping, sampling.verify, sampling.num_drafts,
                            sampling.tree_nodes if sampling.draft_tree == "dynamic" else 0, sampling.pass_width)
        fn, args, mode, statics = sps_program, (target, drafter) + args, "sps", dict(statics, settings=settings)
    else:
        fn, args, mode, statics = ars_program, (target,) + args, "ars", dict(statics, warping=warping)
    return Program(fn, args, tuple(sorted(statics.items(), key=operator.itemgetter(0))), mesh, len(prompts),
                   width, size, mode, tuple(int(n) for n in lens), sampling)
