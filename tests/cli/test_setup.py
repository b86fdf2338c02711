"""The one run setup (`app.setup.prepare`): what the drafters declare they need is what
every command checks the flags against, before any file is read. A flag that names
weights no drafter of the run uses is refused rather than accepted and ignored; a value
a drafter does not honour is refused rather than dropped."""
from __future__ import annotations

import dataclasses

import pytest

from specjax.analysis import timing
from specjax.app import setup
from specjax.app.locate import Sources
from specjax.config import ConfigError, SamplingConfig, UsageError, load_config
from specjax.decode import drafters


@pytest.fixture(scope="module")
def tiny():
    return load_config("tiny")


def prepare(config, drafter_names, **kwargs):
    sources = kwargs.pop("sources", Sources(init="random"))
    return setup.prepare(setup.Request(config, config.sampling, tuple(drafter_names), sources=sources, **kwargs))


@pytest.mark.parametrize("names,sources,fragments", [
    ((), Sources(init="random", self_draft="layers:1"),
     ["--self_draft=layers:1 names a draft model", "--mode=ars", "model or hybrid"]),
    (("ngram",), Sources(init="random", self_draft="layers:1"),
     ["--self_draft=layers:1 names a draft model", "--drafter=ngram uses none"]),
    (("ngram",), Sources(init="random", hf_draft="/nowhere"), ["--hf_draft=/nowhere", "--drafter=ngram uses none"]),
    (("ngram",), Sources(gguf_target="/nowhere.gguf", gguf_draft="/other.gguf"),
     ["--gguf_draft=/other.gguf", "--drafter=ngram uses none"]),
    ((), Sources(draft_checkpoint="/nowhere"), ["--draft_checkpoint=/nowhere", "--mode=ars", "uses none"]),
    (("model", "medusa"), Sources(draft_checkpoint="/nowhere"), ["--draft_checkpoint=/nowhere", "ambiguous"]),
])
def test_draft_weights_no_drafter_uses_are_refused(tiny, names, sources, fragments):
    """Item 13 of the fourth hostile round: --self_draft / --hf_draft with a drafter that
    uses no draft model, or with ArS alone, were accepted and unused."""
    with pytest.raises(UsageError) as info:
        prepare(tiny, names, sources=sources)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_what_the_drafters_use_is_accepted(tiny):
    """The positive side of the same checks: each flag where a drafter of the run uses it."""
    run = prepare(tiny, ("model", "ngram"), sources=Sources(init="random", self_draft="layers:1"))
    assert run.draft_model and run.heads == () and [s.text for s in run.specs] == ["layers:1"]
    run = prepare(tiny, ("medusa", "eagle"))
    assert not run.draft_model and run.heads == ("eagle", "medusa")
    assert prepare(tiny, ()).models.keys() == {"target"}


def test_a_drafter_cap_on_k_is_checked_from_its_declaration(tiny):
    """Medusa declares K <= num_heads (`Drafter.max_lookahead`): refused up front, as plan
    planned K=4 for --lookahead=6 (item 6)."""
    heads = dataclasses.replace(tiny, heads=dataclasses.replace(tiny.heads_for("medusa"), num_heads=4))
    with pytest.raises(UsageError, match=r"--lookahead=6 with --drafter=medusa: it proposes at most 4 tokens"):
        setup.prepare(setup.Request(heads, dataclasses.replace(tiny.sampling, lookahead=6), ("medusa",),
                                    sources=Sources(init="random")))
    setup.prepare(setup.Request(heads, dataclasses.replace(tiny.sampling, lookahead=4), ("medusa",),
                                sources=Sources(init="random")))


@pytest.mark.parametrize("name", sorted(drafters.REGISTRY))
def test_draft_confidence_is_refused_where_the_drafter_has_no_adaptive_length(name):
    """Item 12: --draft_confidence with ngram or medusa was accepted and ignored (eagle's
    layer honours it since it stops on its own confidence)."""
    sampling = SamplingConfig(drafter=name, draft_confidence=0.5)
    if drafters.kind(name).adaptive:
        sampling.validate()
    else:
        with pytest.raises(ConfigError, match=f"draft_confidence=0.5 with drafter='{name}'"):
            sampling.validate()


@pytest.mark.parametrize("names,verify,confidences,num_drafts,fragments", [
    (["model", "ngram"], ["block"], [0.5], [1], ["--drafter=ngram: nothing to measure", "add 0"]),
    (["eagle", "medusa"], ["block"], [0.0], [2], ["--drafter=eagle: nothing to measure", "add 1"]),
    (["ngram"], ["block"], [0.0, 0.5], [1], ["--draft_confidence=0.5", "none of --drafter=ngram honours it"]),
    (["ngram", "model"], ["block"], [0.0], [1, 2], None),  # every value measured by some drafter
])
def test_bench_runs_every_variant_asked_for_or_refuses(tiny, names, verify, confidences, num_drafts, fragments):
    """Item 5: bench measured `model` only for --drafter=model,ngram --draft_confidence=0.5
    and medusa only for --drafter=eagle,medusa --num_drafts=2."""
    base = dataclasses.replace(tiny.sampling, lookahead=4)
    if fragments is None:
        out = timing.variants(base, names, verify, confidences, num_drafts)
        assert {v["drafter"] for v in out} == set(names)
        assert {v["num_drafts"] for v in out} == set(num_drafts)
        return
    with pytest.raises(UsageError) as info:
        timing.variants(base, names, verify, confidences, num_drafts)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
