"""The fused SpS loop: greedy SpS == greedy ArS token for token in float32 (in bf16: the first
tokens, with the agreement reported), one while loop with no host callbacks and the Megatron
all-reduce count per loop, seeds, stopping, NaN errors."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import model
from specjax.decode import program
from specjax.config import SamplingConfig, load_config
from specjax.analysis.hlo import HloProgram
from specjax.decode.retrieval_index import Datastore
from conftest import mesh_for
from models import RAGGED, cache_copies, fused_loop_collectives, tiny_pairs

@pytest.fixture(scope="module")
def pairs(tiny):
    return tiny_pairs(tiny)


@pytest.mark.parametrize("mesh_name", ["1x1", "1x8"])
def test_greedy_sps_equals_greedy_ars(pairs, mesh_name):
    target, draft = pairs[mesh_name]
    greedy = SamplingConfig(temperature=0, lookahead=4, max_new_tokens=256)
    ars = specjax.generate(target, None, RAGGED, greedy)
    sps = specjax.generate(target, draft, RAGGED, greedy)
    assert [len(t) for t in ars.tokens] == [256] * len(RAGGED)
    assert sps.tokens == ars.tokens
    assert sps.accepted.sum() > 0  # some loops really emitted accepted draft tokens


def test_draft_weights_take_the_layout_the_compiler_chooses(pairs):
    """The SpS program takes the draft's weights in the layout XLA chooses (`Layout.AUTO`:
    on XLA:TPU it spared v5p a copy of Llama-3.2-1B's q, k and v inside the program), and
    a run hands it weights placed in any other layout relaid once: a draft whose every
    matrix is stored transposed samples the same tokens as the draft as placed, in either
    order (before, the program compiled for the first draft's layouts refused the other's)."""
    from jax.experimental.layout import Format, Layout
    target, draft = pairs["1x8"]
    transposed = jax.tree.map(lambda x: jax.device_put(x, Format(Layout(tuple(range(x.ndim))[::-1]), x.sharding))
                              if x.ndim >= 2 else x, draft)
    assert any(x.format.layout != y.format.layout for x, y in zip(jax.tree.leaves(draft), jax.tree.leaves(transposed)))
    greedy = SamplingConfig(temperature=0, lookahead=4, max_new_tokens=32)
    prog = program.build(target, transposed, RAGGED, greedy)
    taken = [f for f in jax.tree.leaves(prog.formats()[1], is_leaf=lambda x: isinstance(x, Format))
             if isinstance(f, Format)]
    assert taken and all(f.layout == Layout.AUTO for f in taken)
    assert specjax.generate(target, transposed, RAGGED, greedy).tokens == specjax.generate(target, draft, RAGGED,
                                                                                           greedy).tokens
    # An EAGLE drafter holds the target's own arrays (its embedding and unembedding): those
    # keep the target's placement (a layout of their own would copy the target's weights).
    from specjax.config import HeadsConfig
    from specjax.heads import init_heads
    heads = init_heads(HeadsConfig(kind="eagle3", init_seed=3), target.cfg, mesh_for("1x8"), random=True)
    prog = program.build(target, heads, RAGGED, dataclasses.replace(greedy, drafter="eagle3"))
    ours = {id(x) for x in jax.tree.leaves(prog.args[0])}
    held = [(id(x) in ours, f) for x, f in zip(jax.tree.leaves(prog.args[1]), jax.tree.leaves(
        prog.formats()[1], is_leaf=lambda f: isinstance(f, (Format, jax.sharding.Sharding))))]
    assert any(mine for mine, _ in held) and any(isinstance(f, Format) for _, f in held)
    assert not any(mine and isinstance(f, Format) for mine, f in held)


def test_greedy_rule_is_what_the_loop_verifies_with(pairs, patch):
    """The control of the test above: with `verify.accept_greedy` swapped for a rule that
    keeps every draft equal to the target's argmax (not only the leading run), greedy SpS
    no longer equals greedy ArS, so the equality checks the rule the loop runs at T = 0."""
    from specjax.decode import verify
    from test_greedy_verify import every_matching_draft

    target, draft = pairs["1x1"]
    greedy = SamplingConfig(temperature=0, lookahead=4, max_new_tokens=64)
    ars = specjax.generate(target, None, RAGGED, greedy)
    patch([(verify, "accept_greedy", every_matching_draft)])
    assert specjax.generate(target, draft, RAGGED, greedy).tokens != ars.tokens


# Every mode beyond the paper: block verification, adaptive K (the greedy rule reads the
# draft's plain softmax), prompt lookup, the datastore, and hybrid (with and without one).
MODES = {"block": dict(verify="block"), "adaptive": dict(draft_confidence=0.2),
         "ngram": dict(drafter="ngram"), "retrieval": dict(drafter="retrieval"),
         "hybrid": dict(drafter="hybrid", draft_confidence=0.2), "hybrid_datastore": dict(drafter="hybrid")}


@pytest.fixture(scope="module")
def greedy_reference(pairs):
    """Greedy ArS tokens of RAGGED, and a datastore built from other rows' greedy output
    (prompts shifted by one token), so retrieval proposes often but not always right."""
    target, _ = pairs["1x1"]
    greedy = SamplingConfig(temperature=0, lookahead=4, max_new_tokens=48, verify="tokenwise")
    ars = specjax.generate(target, None, RAGGED, greedy)
    other = specjax.generate(target, None, [[t + 1 for t in p] for p in RAGGED], greedy)
    stream = np.concatenate([np.array(p + t) for p, t in zip(RAGGED, other.tokens)])
    return greedy, ars, Datastore.build(stream, vocab_size=target.cfg.vocab_size, ngram=3, min_count=1)


@pytest.mark.parametrize("mesh_name", ["1x1", "1x8"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_greedy_equals_greedy_ars_in_every_mode(pairs, greedy_reference, mesh_name, mode):
    target, draft = pairs[mesh_name]
    greedy, ars, store = greedy_reference
    settings = MODES[mode]
    sps = specjax.generate(target, draft, RAGGED, dataclasses.replace(greedy, **settings),
                           datastore=store if mode in ("retrieval", "hybrid_datastore") else None)
    assert sps.tokens == ars.tokens
    summary = sps.summary()
    if settings.get("drafter", "model") != "model":
        lookup = "ngram" if mode != "retrieval" else "retrieval"
        assert summary["accepted_by"][lookup] > 0  # proposals happened and were accepted
    if mode == "hybrid_datastore":
        assert summary["accepted_by"]["retrieval"] > 0
    if settings.get("draft_confidence"):
        assert summary["drafted_histogram"][greedy.lookahead] < sum(sps.loops)  # some rows stopped early


def test_lookup_loops_without_a_proposal_are_one_greedy_step(pairs, greedy_reference):
    """At batch 1 a loop whose lookup found nothing scores the pending token alone (the
    other branch of a `lax.cond`); the tokens are still greedy ArS's."""
    target, _ = pairs["1x1"]
    greedy, ars, _ = greedy_reference
    for i in (0, 2):
        sps = specjax.generate(target, None, [RAGGED[i]], dataclasses.replace(greedy, drafter="ngram"))
        assert sps.tokens[0] == ars.tokens[i]
        assert sps.summary()["drafted_histogram"][0] > 0 and sps.summary()["accepted_by"]["ngram"] > 0


def test_greedy_sps_equals_greedy_ars_with_a_good_draft(pairs):
    """With draft == target every draft is accepted (K+1 tokens per loop), which exercises
    the all-accepted path (bonus token, draft cache re-fed with the last two tokens)."""
    target, _ = pairs["1x1"]
    greedy = SamplingConfig(temperature=0, lookahead=3, max_new_tokens=64)
    ars = specjax.generate(target, None, RAGGED, greedy)
    sps = specjax.generate(target, target, RAGGED, greedy)
    assert sps.tokens == ars.tokens
    assert sps.acceptance_rate == 1.0
    assert sps.tokens_per_loop == pytest.approx(4.0, abs=0.1)


BF16_TOKENS, BF16_ACCEPTANCE = 64, 0.9


@pytest.mark.slow  # ~1 minute per encoding: bf16 compiles slowly on CPU
@pytest.mark.parametrize("pos_encoding", ["rope", "relative"])
def test_bf16_greedy_sps_and_ars_agree_on_the_first_tokens(pos_encoding):
    """Greedy SpS == ArS token for token is a float32 check (the tests above). In bf16
    the K+1-token scoring pass and the 1-token step round their matmuls differently, so
    a near-tie can flip an argmax and the two sequences part after a while: numerics,
    not a bug. mini_target's shape (random weights, a 4096-token vocabulary: near-ties
    happen) on a 1x8 mesh, drafting with itself so that every loop scores K+1 tokens and
    its acceptance measures the numerics alone. Asserted: every row's first token agrees
    (both come from the same prefill), and the draft == target acceptance is at least
    BF16_ACCEPTANCE (the scoring pass and the 1-token step disagree on at most 1 drafted
    token in 10; a wrong position or mask in the bf16 scoring pass disagrees on most).
    Where the rows part is printed, not asserted: it depends on the CPU (an Intel Xeon
    with AVX-512 BF16 parts one row 3 tokens in, where a Zen 5 kept 4 and more)."""
    cfg = dataclasses.replace(load_config("mini_target").target, param_dtype="bfloat16", compute_dtype="bfloat16",
                              pos_encoding=pos_encoding)
    lm = model.init_lm(cfg, mesh_for("1x8"))
    greedy = SamplingConfig(temperature=0, lookahead=4, max_new_tokens=BF16_TOKENS)
    ars = specjax.generate(lm, None, RAGGED, greedy).tokens
    sps = specjax.generate(lm, lm, RAGGED, greedy)
    common = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), BF16_TOKENS) for x, y in zip(ars, sps.tokens)]
    print(f"bf16 {pos_encoding}: greedy SpS vs ArS over {BF16_TOKENS} tokens, common prefix per row {common} "
          f"({sum(common) / (len(common) * BF16_TOKENS):.1%} of tokens before the first difference), "
          f"draft == target acceptance {sps.acceptance_rate:.3f}")
    assert all(len(t) == BF16_TOKENS for t in ars + sps.tokens)
    assert all(a[0] == b[0] for a, b in zip(ars, sps.tokens))
    assert sps.acceptance_rate >= BF16_ACCEPTANCE


# (mesh, sampling): one chain and a tree of three, on one device (the CPU kernels) and
# eight; n-gram drafting, whose loops may propose nothing; and the pass as proposed.
NO_COPY = {"model": ("1x1", {}), "model_1x8": ("1x8", {}), "tree": ("1x1", dict(num_drafts=3)),
           "tree_1x8": ("1x8", dict(num_drafts=3)), "ngram": ("1x1", dict(drafter="ngram")),
           "ngram_pass_as_proposed": ("1x1", dict(drafter="ngram", pass_width="proposed")),
           "adaptive_pass_as_proposed_1x8": ("1x8", dict(draft_confidence=0.5, pass_width="proposed"))}


@pytest.mark.parametrize("case", list(NO_COPY))
def test_the_loop_never_copies_a_cache(pairs, case):
    """Rolling back a draft sets lengths; nothing copies a cache. No instruction that the
    generation loop runs (its body and everything it calls) copies a buffer of the
    target's or the draft's cache (`models.cache_copies`): each pass reads its cache and a
    commit writes into it in place. The pass as proposed (`speculative.score`) is a
    lax.switch that only reads the cache: a lax.cond around a pass that also wrote it
    made XLA copy k and v into and out of the conditional in every loop."""
    mesh_name, changes = NO_COPY[case]
    target, draft = pairs[mesh_name]
    sampling = SamplingConfig(temperature=0.8, lookahead=4, max_new_tokens=32, **changes)
    copies = cache_copies(program.build(target, draft, RAGGED, sampling, seed=0))
    assert not copies, copies


def test_a_pass_as_proposed_scores_the_pending_token_and_the_longest_proposal(pairs):
    """pass_width='proposed': a row alone in its batch has each loop's pass score its
    pending token and its own proposal (the n-gram lookup's: none in a loop whose lookup
    failed; the draft model's with draft_confidence: 1..K), so a run scores loops +
    proposed positions, where 'full' scores K + 1 a loop. The tokens are greedy ArS's,
    rows batched together on eight devices (each loop's pass as wide as its longest
    proposal, the switch's index reduced over the batch's shards) too."""
    greedy = SamplingConfig(temperature=0, lookahead=4, max_new_tokens=40)
    ars = specjax.generate(pairs["1x8"][0], None, RAGGED, greedy).tokens
    for changes in (dict(drafter="ngram"), dict(draft_confidence=0.5)):
        full = dataclasses.replace(greedy, **changes)
        proposed = dataclasses.replace(full, pass_width="proposed")
        batched = specjax.generate(*pairs["1x8"], RAGGED, proposed)
        assert batched.tokens == ars
        assert (batched.scored <= batched.loops * 5).all() and batched.scored.sum() < batched.loops.sum() * 5
        wide, narrow = (specjax.generate(*pairs["1x1"], RAGGED[1:2], s) for s in (full, proposed))
        assert wide.tokens == narrow.tokens == ars[1:2]
        assert wide.scored.sum() == wide.loops.sum() * 5
        assert narrow.scored.sum() == narrow.loops.sum() + narrow.proposed
        assert narrow.drafted[:, :4].sum() > 0  # loops that proposed fewer than K: narrower passes


@pytest.mark.parametrize("pos_encoding", ["rope", "relative"])
def test_the_prefill_costs_the_same_whatever_the_cache_size(tiny, pos_encoding):
    """The prompt attends to its own keys, not to the empty slots of the cache it fills:
    the compiled prefill's flops (XLA's cost analysis) for a cache of 64 slots and of 2048
    are the same (attending over the slots made them grow with the cache; with relative
    positions the one thing that grows is the cache's position table, W_r R for every slot,
    which the loop reads), and so are the keys and values it writes (bitwise) and the
    lengths; past the prompt the cache is zero."""
    from specjax.decode.state import prefill
    lm = model.init_lm(dataclasses.replace(tiny.target, pos_encoding=pos_encoding, max_seq_len=2048),
                       mesh_for("1x1"))
    prompts = jnp.asarray(np.array([[1, 2, 3, 4, 5, 6, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
                                    [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]], np.int32))
    lens = jnp.asarray(np.array([6, 16], np.int32))
    run = jax.jit(prefill, static_argnums=3)
    flops, caches = {}, {}
    with jax.set_mesh(mesh_for("1x1")):
        for size in (64, 2048):
            flops[size] = run.lower(lm, prompts, lens, size).compile().cost_analysis()["flops"]
            caches[size] = run(lm, prompts, lens, size)
    cfg = lm.cfg
    # The table's einsum, and the sinusoids it is made of: [S, D] values, at most one flop each.
    table, sinusoid = 2 * (2048 - 64) * cfg.d_model * cfg.num_heads * cfg.head_dim * cfg.num_layers, \
        (2048 - 64) * cfg.d_model
    grown = flops[2048] - flops[64] - (table if pos_encoding == "relative" else 0)
    assert abs(grown) <= (sinusoid if pos_encoding == "relative" else 1e-3 * flops[64]), (flops, table)
    small, large = caches[64], caches[2048]
    np.testing.assert_array_equal(np.asarray(large.k)[..., :64, :], np.asarray(small.k))
    np.testing.assert_array_equal(np.asarray(large.v)[..., :64, :], np.asarray(small.v))
    np.testing.assert_array_equal(np.asarray(large.lengths), [5, 15])
    assert not np.asarray(large.k)[..., 16:, :].any()


@pytest.mark.parametrize("mode", ["tokenwise", "block", "ngram", "hybrid_adaptive"])
def test_one_fused_while_loop_with_megatron_all_reduces(pairs, mode):
    """Block verification adds no all-reduce to a loop, n-gram drafting removes the
    draft's; adaptive and hybrid drafting keep the draft's count (its later steps sit in
    a `lax.cond`, whose branch runs at most once per step)."""
    target, draft = pairs["1x8"]
    K = 4
    settings = {"tokenwise": dict(verify="tokenwise"), "block": dict(verify="block"), "ngram": dict(drafter="ngram"),
                "hybrid_adaptive": dict(drafter="hybrid", draft_confidence=0.5)}[mode]
    sampling = SamplingConfig(temperature=0.8, top_p=0.9, lookahead=K, max_new_tokens=32, **settings)
    per_loop = fused_loop_collectives(program.build(target, draft, RAGGED, sampling, seed=0))

    def all_reduces(d_model):  # activation-sized: [B, T, d_model]
        return sum(n for c, n in per_loop.items()
                   if c.kind == "all-reduce" and c.shape.endswith(f",{d_model}]") and c.shape.count(",") == 2)

    # Megatron: 2 per layer, + 1 for the vocab-parallel embedding, per forward pass: the
    # draft runs K forwards per loop (a 2-token first step, then K-1 single steps), the
    # target ONE pass over K+1 tokens.
    assert all_reduces(target.cfg.d_model) == 2 * target.cfg.num_layers + 1
    draft_passes = 0 if mode == "ngram" else K
    assert all_reduces(draft.cfg.d_model) == draft_passes * (2 * draft.cfg.num_layers + 1)
    # And nothing else: warping, sampling, verification and the NaN/inf checks run on the
    # gathered (replicated) logits, so they add no all-reduce at all.
    total = sum(n for c, n in per_loop.items() if c.kind == "all-reduce")
    assert total == 2 * (target.cfg.num_layers + draft_passes * draft.cfg.num_layers) + draft_passes + 1


def test_ars_step_has_exactly_one_forward_of_all_reduces(pairs):
    target, _ = pairs["1x8"]
    sampling = SamplingConfig(temperature=0.8, top_p=0.9, max_new_tokens=32)
    per_step, _ = HloProgram(program.build(target, None, RAGGED, sampling).compile().as_text()).loop_and_outside()
    assert sum(n for c, n in per_step.items() if c.kind == "all-reduce") == 2 * target.cfg.num_layers + 1


def test_same_seed_same_tokens_across_meshes_and_different_seeds_differ(pairs):
    sampling = SamplingConfig(temperature=1.0, top_k=20, lookahead=3, max_new_tokens=24)
    one = specjax.generate(*pairs["1x1"], RAGGED, sampling, seed=5)
    again = specjax.generate(*pairs["1x1"], RAGGED, sampling, seed=5)
    sharded = specjax.generate(*pairs["1x8"], RAGGED, sampling, seed=5)
    other = specjax.generate(*pairs["1x1"], RAGGED, sampling, seed=6)
    assert one.tokens == again.tokens == sharded.tokens
    assert one.tokens != other.tokens


@pytest.mark.parametrize("mode", ["ars", "sps"])
def test_rows_stop_at_end_of_sequence_and_budget(pairs, mode):
    target, draft = pairs["1x1"]
    draft = draft if mode == "sps" else None
    greedy = SamplingConfig(temperature=0, lookahead=3, max_new_tokens=40)
    free = specjax.generate(target, draft, RAGGED, greedy).tokens
    eos = free[0][5]  # a token the first row is known to emit
    stopped = specjax.generate(target, draft, RAGGED, dataclasses.replace(greedy, eos_id=eos)).tokens
    for row, full in zip(stopped, free):
        expected = full[:full.index(eos) + 1] if eos in full else full
        assert row == expected
    short = specjax.generate(target, draft, RAGGED, dataclasses.replace(greedy, max_new_tokens=7)).tokens
    assert short == [row[:7] for row in free]


@pytest.mark.parametrize("mode", ["ars", "sps"])
def test_the_token_budget_is_an_argument_of_the_compiled_program(pairs, mode):
    """`Program.run` warms a compiled program up with a budget of one token (the last
    argument) instead of a whole second generation. The same compiled program, called with
    budgets 1 and 7, emits each row's first 1 and 7 tokens of its full 40-token run. Fails
    where the budget is a static setting (the call has one argument too many)."""
    from specjax import distributed, sharding
    target, draft = pairs["1x1"]
    greedy = SamplingConfig(temperature=0, lookahead=3, max_new_tokens=40)
    prog = program.build(target, draft if mode == "sps" else None, RAGGED, greedy, seed=0)
    free = specjax.generate(target, draft if mode == "sps" else None, RAGGED, greedy).tokens
    compiled = prog.compile()
    for budget in (1, 7):
        with jax.set_mesh(prog.mesh):
            tokens, length, _ = distributed.fetch(compiled(
                *prog.args[:-1], distributed.put(np.array([budget], np.int32), sharding.replicated(prog.mesh))))
        got = [tokens[i, n:length[i]].tolist() for i, n in enumerate(prog.prompt_lens)]
        assert got == [row[:budget] for row in free]


def test_nan_logits_raise_a_clear_error(pairs):
    target, draft = pairs["1x1"]
    broken = jax.tree.map(lambda x: x, target.params)
    broken["unembed"].value = broken["unembed"].value.at[0, 0].set(jnp.nan)
    bad = dataclasses.replace(target, params=broken)
    sampling = SamplingConfig(temperature=1.0, lookahead=2, max_new_tokens=8)
    for t, d in ((bad, draft), (bad, None), (target, dataclasses.replace(draft, params=jax.tree.map(
            lambda x: x * jnp.nan, draft.params)))):
        with pytest.raises(specjax.NonFiniteLogitsError, match="NaN or inf"):
            specjax.generate(t, d, RAGGED, sampling)
