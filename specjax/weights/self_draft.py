"""A draft made of the target's own weights, at load time, with no second file.

`layers:N` is the target's first N layers with its own embedding, final norm and
unembedding: early exit (the lectures' "prophet" that every model has for free; Elhoushi
et al. 2024, LayerSkip, drafts the same way). It is a draft LM like any other, so every
verifier, hybrid drafting and several drafts work with it unchanged.

Held once in memory: the draft's params ARE the target's arrays, not copies. With
unrolled layers the draft's state holds the target's first N layer arrays; with
`scan_layers` (layers stacked along a leading axis) it holds the target's whole stacked
arrays and its forward runs the first N of them (`model.Transformer.__call__` indexes
the stack in its loop; a slice would copy the N layers). Where decoding packs weights
for the CPU kernel, the draft is made from the target's packed copy (`LM.packed`), so
the panels are shared too.

`int8` is the target's int8 copy (`LM.quantized`: symmetric per output channel, read
by the int8 few-row kernel): a quarter of the float target's bytes per token, with
logits close to the target's, so nearly every proposal is kept. `int4` is its int4 copy
(a scale and minimum per group of 32 inputs): about an eighth of the bytes, further from
the target. `w4a8` and `w8a8` (int4, or 8-bit codes per group of 32, times activations
rounded to int8: `kernels.formats`) multiply integers on CPU, the cheapest draft steps; a
draft's arithmetic is free to differ from the target's, since only the target's
probabilities decide what is kept. Of a target whose weights are int4 already (`--quantize=int4`,
a GGUF file's Q4/Q8 tensors as stored) an A8 draft is the target's own codes multiplying
int8 activations: new panels only. Unlike layers:N they are new memory. Forms join with '+': `int8+layers:N` is
the first N layers of the int8 copy. Command lines that sweep several self-drafts take
them as a comma-separated list of specs.
"""
from __future__ import annotations

import dataclasses
import re

import jax
from flax import nnx

from specjax.config import QUANTIZATIONS, UsageError
from specjax.kernels.formats import A8_KINDS, Grouped, is_quantized
from specjax.model import LM, SelfDraft, Transformer, Keys

FORMS = ("layers:N (the target's first N layers), int8, int4, w4a8 or w8a8 (its quantized copy), or both joined "
         "by '+' "
         "(int8+layers:N)")


@dataclasses.dataclass(frozen=True)
class Spec:
    """A parsed self-draft: `layers` the number of the target's layers it runs (None: all
    of them), `quantize` the format of its copy of the weights (None: the target's own)."""

    layers: int | None
    text: str
    quantize: str | None = None

    def check(self, num_layers: int, name: str = "--self_draft") -> "Spec":
        """Refuse N outside 1..num_layers-1 (N = num_layers would be the target itself)."""
        if self.layers is not None and not 1 <= self.layers < num_layers:
            allowed = f"1..{num_layers - 1}" if num_layers > 1 else "none: the target has one layer"
            raise UsageError(f"{name}={self.text!r}: layers:N needs N in {allowed} (the target has {num_layers} "
                             "layers)")
        return self


def parse(text: str, name: str = "--self_draft") -> Spec:
    """'layers:N' (forms joined by '+') -> Spec; UsageError in one line for anything else."""
    forms = [f.strip() for f in text.split("+")]
    if "," in text:
        raise UsageError(f"{name}={text!r}: one self-draft here; join forms with '+' (e.g. layers:2); "
                         "`bench --self_draft` compares a comma-separated list")
    layers = quantize = None
    for form in forms:
        if form in QUANTIZATIONS:
            if quantize is not None:
                raise UsageError(f"{name}={text!r}: a quantized form given twice; expected {FORMS}")
            quantize = form
            continue
        match = re.fullmatch(r"layers:([0-9]+)", form)  # not \d: it matches every script's digits
        if match is None or layers is not None:
            why = "layers given twice" if match is not None else f"unknown form {form!r}"
            raise UsageError(f"{name}={text!r}: {why}; expected {FORMS}")
        layers = int(match[1])
    return Spec(layers, text, quantize)


def check_quantize(spec: Spec | None, quantize: str | None, name: str = "--self_draft") -> None:
    """A quantized self-draft of a target quantized on load would be the target itself,
    but for an A8 draft of an int4 target (its own codes, multiplying int8 activations)."""
    if spec is not None and spec.quantize is not None and quantize is not None \
            and not (spec.quantize in A8_KINDS and quantize == "int4"):
        raise UsageError(f"{name}={spec.text!r} with --quantize={quantize}: the target is {quantize} already, "
                         f"so its {spec.quantize} copy is the target itself; drop one of them, or use layers:N")


def split_list(text: str, name: str = "--self_draft") -> list[str]:
    """'layers:1,layers:2' -> ['layers:1', 'layers:2'] (a sweep; each then `parse`d)."""
    items = [t.strip() for t in text.split(",")]
    if not all(items):
        raise UsageError(f"{name}={text!r}: expected comma-separated self-drafts, e.g. layers:1,layers:2")
    return items


def draft_config(target_cfg, spec: Spec | str):
    """The self-draft's ModelConfig: the target's with N layers (all of them for `int8`)."""
    spec = parse(spec) if isinstance(spec, str) else spec
    layers = spec.check(target_cfg.num_layers).layers
    return dataclasses.replace(target_cfg, num_layers=target_cfg.num_layers if layers is None else layers)


def self_draft(target: LM, spec: Spec | str) -> LM:
    """The draft LM `spec` names, made of `target`'s own arrays (see the module doc)."""
    spec = parse(spec) if isinstance(spec, str) else spec
    cfg = draft_config(target.cfg, spec)
    # Packed where decoding packs (the CPU kernel): the draft's projections are then the
    # target's packed weights, not a second packed copy of the first N layers. A quantized
    # form packs its own copy, once.
    if spec.quantize is not None and is_quantized(target.params) and not (
            spec.quantize in A8_KINDS and any(isinstance(w, Grouped) and w.activations == "float32"
                                              for w in jax.tree.leaves(target.params,
                                                                       is_leaf=lambda w: isinstance(w, Grouped)))):
        check_quantize(spec, spec.quantize)  # the target is quantized already: refused
    source = (target.quantized(spec.quantize) if spec.quantize is not None else target).packed()
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, Keys(0))))[0]
    state = jax.tree.map(lambda x: x, source.params)  # new Variables around the same arrays
    if not cfg.scan_layers:  # unrolled: layers 0..N-1 of the target's list
        state["layers"] = nnx.State({i: state["layers"][i] for i in range(cfg.num_layers)})
    return SelfDraft(cfg, graphdef, state, source.kernels)
