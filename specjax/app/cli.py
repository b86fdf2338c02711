"""What every entry point shares: `--config=NAME` with `--config.a.b=value` overrides,
flag checks, the compile-cache policy, and ONE mapping from failures to exit codes:

    UsageError (bad input of any kind)        one line on stderr, exit 2
    RunError (a failure while running)        one line on stderr, exit 1
    FloatingPointError (NonFiniteLogitsError,
      a diverged training run)                one line on stderr, exit 1
    Ctrl-C                                    "interrupted", exit 130
    Stopped (a signal, state saved)           its message, exit 130 / 143

    def define_flags(): cli.define_config_flag("mini"); flags.DEFINE_...
    def main(argv): config = cli.config(); ...
    if __name__ == "__main__": define_flags(); cli.run(main)

Flags are defined only when a module runs as the program, so two entry points imported
in one process do not clash.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
from typing import Callable, Optional

from absl import app, flags, logging

from specjax.config import (DRAFT_TREES, DRAFTERS, PASS_WIDTHS, QUANTIZATIONS, VERIFY_RULES, Config, MeshConfig,
                            SamplingConfig, UsageError, cache_dir, load_config)

FLAGS = flags.FLAGS
_OVERRIDES: list[str] = []
_SWEPT: set[str] = set()  # the sampling flags this command defined as lists


class RunError(RuntimeError):
    """A run failed for a reason outside the inputs (a full disk, a failed subprocess)."""


class Stopped(Exception):
    """A run stopped by a signal after saving its state (training the mini pair on first
    use): the message goes to stderr and the entry point exits with the signal's code."""

    def __init__(self, message: str, signal_name: str):
        super().__init__(message)
        self.code = {"SIGINT": 130, "SIGTERM": 143}[signal_name]


def define_weight_flags(*, init: bool = True, self_draft_list: bool = False) -> None:
    """Where the weights come from (`locate.Sources`): one group, the same names, types and
    help in every command that loads models. `self_draft_list`: --self_draft takes a
    comma-separated list to compare (bench), each item as the single value elsewhere."""
    if init:
        flags.DEFINE_enum("init", "checkpoint", ["checkpoint", "random"],
                          "random: random weights (speed measurements before a checkpoint exists).")
    flags.DEFINE_string("checkpoint", None, "Target checkpoint directory (default: where "
                        "`python -m specjax.train --config=<target config>` writes).")
    flags.DEFINE_string("draft_checkpoint", None, "Draft checkpoint directory (default: where the draft "
                        "config's training writes).")
    flags.DEFINE_string("hf_target", None, "Hugging Face model directory (config.json, safetensors, tokenizer) "
                        "holding the target: Llama or Mistral architecture; the config still gives dtypes, mesh "
                        "and sampling settings.")
    flags.DEFINE_string("hf_draft", None, "Hugging Face model directory holding the draft (same tokenizer as "
                        "the target; not needed for --mode=ars).")
    flags.DEFINE_string("gguf_target", None, "GGUF file (llama.cpp's format: llama architecture, any GGML type, "
                        "tokenizer in its metadata) holding the target, instead of --hf_target.")
    flags.DEFINE_string("gguf_draft", None, "GGUF file holding the draft (same tokenizer as the target).")
    one = ("layers:N: the draft is the target's own first N layers with its final norm and unembedding, sharing "
           "the target's weights; int8: the target's int8 copy; int8+layers:N: both (no draft file; instead of "
           "--hf_draft, --gguf_draft or --draft_checkpoint).")
    flags.DEFINE_string("self_draft", None, ("Comma-separated self-drafts to compare, e.g. layers:1,layers:2; each "
                                             + one) if self_draft_list else one)


# --------------------------------------------------------------------------- sampling flags

# Aliases of SamplingConfig's fields (`--lookahead=3` is `--config.sampling.lookahead=3`),
# defined here once for every command that samples: the field's type and help. A command
# that compares settings (bench) takes a comma-separated list in the fields it sweeps,
# each item one value as elsewhere; no command gives a flag of this group another meaning.
SAMPLING_FLAGS = {
    "lookahead": (int, "K, draft tokens per loop"),
    "temperature": (float, "0 = greedy"),
    "top_k": (int, "keep the k most likely tokens; 0 = off"),
    "top_p": (float, "nucleus sampling mass in (0, 1]; 1 = off"),
    "max_new_tokens": (int, "tokens to generate per sequence"),
    "verify": (VERIFY_RULES, "SpS acceptance rule: block (block verification, never worse) or tokenwise (the "
               "paper's); several chains are verified as a tree"),
    "drafter": (DRAFTERS, "who proposes: model (the draft model), ngram (prompt lookup in the row's own context), "
                "retrieval (--datastore), hybrid (ngram, else the datastore, else the model), medusa, eagle or "
                "eagle3 (draft heads on the target's features), parallel (a draft model with mask tokens: all K "
                "from one forward), hybrid_eagle3 (ngram, else the datastore, else the eagle3 heads)"),
    "ngram": (int, "longest context suffix the lookup drafters match"),
    "draft_confidence": (float, "in [0, 1): a row stops drafting after a draft distribution whose top "
                         "probability is below this (--lookahead is the most); 0 = fixed K"),
    "num_drafts": (int, "M draft chains per loop, scored as one tree and verified jointly (exact multi-draft "
                   "rejection sampling); 1 = one chain"),
    "draft_tree": (DRAFT_TREES, "chains (--num_drafts chains of --lookahead tokens) or dynamic (a tree of "
                   "--tree_nodes draft tokens at most --lookahead deep, grown where the drafter is confident; "
                   "drafter model, eagle or eagle3)"),
    "tree_nodes": (int, "N, a dynamic draft tree's draft tokens per loop (the target scores N + 1)"),
    "pass_width": (PASS_WIDTHS, "what one chain's scoring pass covers: full (K + 1 positions every loop) or "
                   "proposed (the pending token and the longest row's proposal; each width compiled once: faster "
                   "on a CPU where proposals vary in length: ngram, hybrids, --draft_confidence)"),
}


def define_sampling_flags(names=tuple(SAMPLING_FLAGS), sweep=(), defaults=None, unset="the config's") -> None:
    """The flags `names` of SAMPLING_FLAGS; those in `sweep` take a comma-separated list of
    values to compare. `defaults`: a command's own defaults; a flag without one keeps the
    `unset` value (the config's field, or e.g. evaluate's task's budget)."""
    defaults = defaults or {}
    _SWEPT.update(sweep)
    for name in names:
        kind, text = SAMPLING_FLAGS[name]
        default = defaults.get(name)
        text += f" (default: {unset})." if default is None else "."  # absl prints a default given
        if name in sweep:
            flags.DEFINE_string(name, None if default is None else str(default),
                                f"Comma-separated values to compare, each: {text}")
            continue
        text = text[0].upper() + text[1:]
        if kind is int:
            flags.DEFINE_integer(name, default, text)
        elif kind is float:
            flags.DEFINE_float(name, default, text)
        else:
            flags.DEFINE_enum(name, default, list(kind), text)


def sampling(base: SamplingConfig, skip=()) -> SamplingConfig:
    """`base` with the single-valued sampling flags that were given, but those in `skip`
    (which the command applies itself); not validated."""
    given = {name: FLAGS[name].value for name in SAMPLING_FLAGS
             if name in FLAGS and name not in _SWEPT and name not in skip and FLAGS[name].value is not None}
    out = dataclasses.replace(base, **given)
    if "draft_tree" not in _SWEPT:
        check_tree_nodes([out.draft_tree])
    if "verify" not in _SWEPT:
        check_verify(given.get("verify"), [(out.num_drafts, out.draft_tree)])
    return out


def check_verify(verify, shapes) -> None:
    """--verify (given as `verify`; None: not given) is refused where every run's
    (num_drafts, draft_tree) in `shapes` is verified as a tree: several chains and a
    dynamic tree take the tree rule whatever it says (it would be accepted and ignored)."""
    if verify is None or not shapes or not all(m > 1 or t == "dynamic" for m, t in shapes):
        return
    m, t = shapes[0]
    what = "a dynamic draft tree" if t == "dynamic" else f"--num_drafts={m} chains"
    raise UsageError(f"--verify={verify} picks one chain's acceptance rule, and {what} is verified as a tree "
                     "(recursive rejection over siblings): drop --verify, or draft one chain")


def check_tree_nodes(draft_trees) -> None:
    """--tree_nodes is refused where no dynamic tree uses it (it would be accepted and ignored)."""
    if "tree_nodes" in FLAGS and FLAGS.tree_nodes is not None and "dynamic" not in draft_trees:
        raise UsageError(f"--tree_nodes={FLAGS.tree_nodes} applies to a dynamic draft tree: add --draft_tree=dynamic "
                         "(or drop --tree_nodes)")


def swept(name: str, default) -> list:
    """The values a swept sampling flag compares ([default] when not given)."""
    text = FLAGS[name].value
    kind = SAMPLING_FLAGS[name][0]
    if kind is int:
        return [default] if text is None else int_list(name, text)
    if kind is float:
        return unit_interval_list(name, text, default)
    values = choices(name, text, default, kind)
    if name == "draft_tree":
        check_tree_nodes(values)
    return values


def sources():
    """The weight flags' `locate.Sources` (`define_weight_flags`)."""
    from specjax.app.locate import Sources
    return Sources(init=FLAGS.init if "init" in FLAGS else "checkpoint", checkpoint=FLAGS.checkpoint,
                   draft_checkpoint=FLAGS.draft_checkpoint, hf_target=FLAGS.hf_target, hf_draft=FLAGS.hf_draft,
                   gguf_target=FLAGS.gguf_target, gguf_draft=FLAGS.gguf_draft, self_draft=FLAGS.self_draft)


def define_chat_flag() -> None:
    flags.DEFINE_bool("chat", False, "Put each text prompt through the model's own chat template as a user message "
                      "(an instruct model given a plain prompt often ends at once); needs a tokenizer with one.")


def define_quantize_flag() -> None:
    kinds = "; ".join(f"{q.name} = {q.help}" for q in QUANTIZATIONS.values())
    flags.DEFINE_enum("quantize", "none", ["none", *QUANTIZATIONS], "Quantize the float weights on load (every "
                      f"projection, the unembedding and the embedding table): {kinds}. A GGUF file's quantized "
                      "tensors are taken as stored. The run samples the quantized model exactly. Applies to the "
                      "target and the draft.")


def quantize() -> Optional[str]:
    return None if FLAGS.quantize == "none" else FLAGS.quantize


def define_config_flag(default: str) -> None:
    flags.DEFINE_string("config", default, "Config name (specjax/configs/NAME.py) or path to a config file. "
                        "Override fields with --config.FIELD.SUB=VALUE, e.g. --config.sampling.lookahead=3.")


def _parse(argv: list[str]) -> list[str]:
    rest = [argv[0]]
    for arg in argv[1:]:
        if arg.startswith("--config."):
            _OVERRIDES.append(arg[len("--config."):])
        else:
            rest.append(arg)
    try:
        return FLAGS(rest)
    except flags.Error as e:
        fail(str(e))


def fail(message: str, code: int = 2) -> None:
    print(f"{sys.argv[0].rsplit('/', 1)[-1]}: error: {message}", file=sys.stderr)
    sys.exit(code)


def config() -> Config:
    """The run's Config: FLAGS.config plus the command line's overrides, validated."""
    return load_config(FLAGS.config, _OVERRIDES)


def run(main: Callable[[list[str]], None], extra_args_hint: str = "") -> None:
    """app.run(main) with the exit-code mapping above; positional arguments are refused."""
    def guarded(argv):
        try:
            if len(argv) > 1:
                raise UsageError(f"unexpected arguments {argv[1:]}" + (f"; {extra_args_hint}" if extra_args_hint else ""))
            if not FLAGS["verbosity"].present:
                logging.set_verbosity(logging.ERROR)  # library INFO/WARNING lines (no TPU, orbax) drown the output
            main(argv)
        except UsageError as e:
            fail(str(e))
        except (RunError, FloatingPointError) as e:
            fail(str(e), 1)
        except Stopped as e:
            print(str(e), file=sys.stderr)
            sys.exit(e.code)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            sys.exit(130)

    app.run(guarded, flags_parser=_parse)


# --------------------------------------------------------------------------- flag values


def positive(name: str, value: Optional[int], limit: Optional[int] = None) -> Optional[int]:
    """A positive-integer flag (None passes through: "not given"), at most `limit`."""
    if value is None:
        return None
    if value < 1:
        raise UsageError(f"--{name}={value}: must be a positive integer")
    if limit is not None and value > limit:
        raise UsageError(f"--{name}={value}: at most {limit} is allowed")
    return value


def seed(name: str, value: int) -> int:
    """A seed flag: any integer in [0, 2**63), each with its own random stream."""
    if not 0 <= value < 2 ** 63:
        raise UsageError(f"--{name}={value}: seeds are integers in [0, 2**63)")
    return value


def int_list(name: str, text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]: positive integers, at least one."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise UsageError(f"--{name}={text!r}: expected comma-separated positive integers, e.g. 1,2,4")
    return values


def choices(name: str, text: Optional[str], default: str, allowed) -> list[str]:
    """'a,b' -> ['a', 'b'], each one of `allowed` (None: [default])."""
    if text is None:
        return [default]
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values or any(v not in allowed for v in values):
        raise UsageError(f"--{name}={text!r}: expected comma-separated values from {', '.join(allowed)}")
    return values


def unit_interval_list(name: str, text: Optional[str], default: float) -> list[float]:
    """'0,0.4' -> [0.0, 0.4], each in [0, 1) (None: [default])."""
    if text is None:
        return [default]
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or not all(0 <= v < 1 for v in values):
        raise UsageError(f"--{name}={text!r}: expected comma-separated numbers in [0, 1), e.g. 0,0.4")
    return values


def finite(name: str, value: float, low: float = -math.inf, high: float = math.inf) -> float:
    if not (math.isfinite(value) and low <= value <= high):
        raise UsageError(f"--{name}={value}: must be a finite number in [{low}, {high}]")
    return value


def parse_mesh(value: Optional[str], default: MeshConfig) -> MeshConfig:
    """--mesh=DATAxMODEL, e.g. 1x8 or 2x4 (None: `default`)."""
    if value is None:
        return default
    match = re.fullmatch(r"\s*([0-9]+)\s*x\s*([0-9]+)\s*", value)  # not \d: it matches every script's digits
    if not match or int(match[1]) < 1 or int(match[2]) < 1:
        raise UsageError(f"--mesh={value!r}: expected DATAxMODEL with positive integers, e.g. 1x8 or 2x4")
    return MeshConfig(int(match[1]), int(match[2])).validate()


def mesh_size(mesh_cfg: MeshConfig, devices: int) -> tuple[int, int]:
    """(data, model) of a mesh config on `devices` devices (model=-1 takes the rest)."""
    return mesh_cfg.data, (mesh_cfg.model if mesh_cfg.model != -1 else max(1, devices // mesh_cfg.data))


def use_compilation_cache(workdir=None) -> None:
    """THE compile-cache policy of every entry point: keep compiled programs across runs
    (a second run starts in seconds) in cache_dir()/xla, unless $JAX_COMPILATION_CACHE_DIR
    names another place, or `workdir` (e.g. train's) is a cloud path: then in
    WORKDIR/xla_cache. JAX writes the cache from process 0 only, so on a pod a per-host
    directory leaves every other host recompiling on each rerun; a directory every host
    reads (gs://...) lets all of them load what process 0 wrote (launch/tpu_pod.sh sets
    $JAX_COMPILATION_CACHE_DIR to one in the bucket of the weights)."""
    import jax
    from specjax.config import check_remote_support, is_remote
    given = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if given:
        check_remote_support(given)
    elif workdir and is_remote(workdir):
        check_remote_support(workdir)
        jax.config.update("jax_compilation_cache_dir", str(workdir).rstrip("/") + "/xla_cache")
    else:
        jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

