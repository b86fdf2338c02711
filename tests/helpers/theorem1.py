"""What the Theorem-1 tests share: the enumerable models, the exact target distribution,
the chi-square test, the cases and one runner.

Setting: a `tiny` target (vocabulary 32) with sharpened logits and a draft that differs
from it (`make_models`), so acceptances and rejections are both frequent. The exact
joint distribution of the next 3 tokens is enumerated (32^3 cells) from full forward
passes of the target, with the same warping. A case draws N = 50,000 samples as one
batch (one compiled program). Test: chi-square goodness of fit, cells with expected
count < 5 pooled into one bin, significance level ALPHA = 0.001; any sample in a
zero-probability cell fails too. Negative controls draw N_NEGATIVE samples.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats as scipy_stats

import specjax
from specjax import kv_cache, model
from specjax.config import SamplingConfig
from specjax.decode import program, verify
from specjax.decode.warping import Warp, warp
from conftest import mesh_for

ALPHA = 1e-3
N = 50_000
N_NEGATIVE = 20_000  # controls use 2.5x fewer samples: rejecting even then shows ample power
V = 32
PROMPT = [3, 17, 5]
PROMPT_LONG = [9, 1, 22, 14, 7, 30, 2]
# Contexts whose suffixes recur, so the n-gram drafter proposes from the first loop on.
REPEATS = [[3, 17, 5, 3, 17], [9, 1, 22, 14, 9, 1, 22, 14, 9, 1]]


def sharpened(lm: model.LM, factor: float) -> model.LM:
    params = jax.tree.map(lambda x: x, lm.params)
    params["unembed"].value = params["unembed"].value * factor
    return dataclasses.replace(lm, params=params)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class ParityLM(model.LM):
    """A model that can only emit tokens of one parity (logit -1e9 elsewhere: probability
    exactly 0 in float32). Two of them with different parities have disjoint supports."""

    parity: int = 0

    def __call__(self, tokens, positions, cache, visible=None, features=False, prior=None):
        logits, fresh = super().__call__(tokens, positions, cache, visible, features, prior)
        return jnp.where(jnp.arange(V) % 2 == self.parity, logits, -1e9), fresh

    def tree_flatten(self):
        return (self.params,), (self.cfg, self.graphdef, self.kernels, self.parity)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(aux[0], aux[1], children[0], aux[2], aux[3])


def make_models(tiny, num_layers: int = 1):
    """Target: tiny with logits sharpened x3. Draft: the target with noise on its output
    layer, so p resembles q (acceptance ~0.5, like a trained draft) but is not equal."""
    # One layer and one kv head (MQA): XLA:CPU runs attention at batch 50k as one tiny
    # GEMM per (row, kv head), so this halves the cost of the 50k-row batches. Theorem 1
    # does not depend on the architecture. (`num_layers`: a drafter that reads several of
    # the target's layers, EAGLE-3's.)
    one_layer = dataclasses.replace(tiny.target, num_layers=num_layers, num_kv_heads=1)
    target = sharpened(model.init_lm(one_layer, mesh_for("1x1")), 3.0)
    params = jax.tree.map(lambda x: x, target.params)
    u = params["unembed"].value
    params["unembed"].value = u + 0.3 * u.std() * jax.random.normal(jax.random.key(7), u.shape)
    return target, dataclasses.replace(target, params=params)


def exact_joint(lm, prompt, w: Warp) -> np.ndarray:
    """P(x1, x2, x3 | prompt) by enumeration: one full forward over all 32^2 continuations."""
    pairs = np.stack(np.meshgrid(np.arange(V), np.arange(V), indexing="ij"), -1).reshape(-1, 2)
    seqs = np.concatenate([np.tile(prompt, (len(pairs), 1)), pairs], axis=1)
    B, T = seqs.shape
    logits, _ = jax.jit(lambda lm, t, p, c: lm(t, p, c))(
        lm, jnp.asarray(seqs), jnp.broadcast_to(jnp.arange(T), (B, T)), kv_cache.init_cache(lm.cfg, B, T))
    probs, bad = warp(logits[:, -3:], w)
    assert not bad.any()
    probs = np.asarray(probs, np.float64)  # [V*V, 3, V]
    q1 = probs[0, 0]
    q2 = probs[::V, 1]  # rows with x2 = 0: the distribution of x2 given x1
    q3 = probs[:, 2].reshape(V, V, V)
    return q1[:, None, None] * q2[:, :, None] * q3


def chi_square_pvalue(samples: np.ndarray, joint: np.ndarray) -> float:
    n = len(samples)
    observed = np.bincount(samples[:, 0] * V * V + samples[:, 1] * V + samples[:, 2], minlength=V ** 3)
    expected = joint.ravel() * n
    if observed[expected == 0].sum() > 0:
        return 0.0  # a token of probability zero was emitted
    big = expected >= 5
    o = np.append(observed[big], observed[~big].sum())
    e = np.append(expected[big], expected[~big].sum())
    keep = e > 0
    statistic = np.sum((o[keep] - e[keep]) ** 2 / e[keep])
    return float(scipy_stats.chi2.sf(statistic, keep.sum() - 1))


class Case(NamedTuple):
    temperature: float
    top_k: int
    top_p: float
    K: int
    kind: str  # 'pair' | 'ragged' | 'same' (p == q) | 'disjoint' (supports) | 'repeats' | 'mixed' (groups_of)
    verify: str = "tokenwise"
    drafter: str = "model"
    draft_confidence: float = 0.0
    datastore: str = ""  # which of the run's datastores to pass ('samples' for drafter='retrieval')
    prompts: str = ""  # prompts of another kind than `kind` (e.g. 'repeats' with kind 'same')
    num_drafts: int = 1  # M draft chains per loop (a tree when > 1)
    tree_nodes: int = 0  # N > 0: a dynamic draft tree of N nodes (draft_tree='dynamic') instead of chains
    pass_width: str = "full"  # 'proposed': the scoring pass as wide as the longest row's proposal


def groups_of(kind: str) -> list[list[int]]:
    """Prompt groups (interleaved rows of one batch); 'mixed': one whose suffix recurs and
    one whose suffix a datastore of its samples holds, so hybrid uses every drafter."""
    return {"ragged": [PROMPT, PROMPT_LONG], "repeats": REPEATS, "mixed": [REPEATS[1], PROMPT]}.get(kind, [PROMPT])


@contextlib.contextmanager
def optimised():
    """Programs compiled inside run at XLA's default LLVM optimisation level, not the
    suite's level 0 (conftest): they run 50,000 rows, where level 0's code costs more
    than its shorter compile saves."""
    before = program.CPU_COMPILER_OPTIONS
    program.CPU_COMPILER_OPTIONS = {**before, "xla_backend_optimization_level": 2}
    try:
        yield
    finally:
        program.CPU_COMPILER_OPTIONS = before


def run(models, case: Case, n: int = N, seed: int = 0, datastores=None):
    """(p-value, Bonferroni over the prompt groups; the Result) of one case."""
    target, draft = models
    if case.kind == "same":
        draft = target
    if case.kind == "disjoint":
        target = ParityLM(target.cfg, target.graphdef, target.params, parity=0)
        draft = ParityLM(draft.cfg, draft.graphdef, draft.params, parity=1)
    groups = groups_of(case.prompts or case.kind)
    prompts = [groups[i % len(groups)] for i in range(n)]  # interleaved: ragged rows in one batch
    sampling = SamplingConfig(temperature=case.temperature, top_k=case.top_k, top_p=case.top_p, lookahead=case.K,
                              max_new_tokens=3, verify=case.verify, drafter=case.drafter,
                              draft_confidence=case.draft_confidence, num_drafts=case.num_drafts,
                              draft_tree="dynamic" if case.tree_nodes else "chains", tree_nodes=case.tree_nodes or 8,
                              pass_width=case.pass_width)
    name = case.datastore or ("samples" if case.drafter == "retrieval" else "")
    with optimised():
        result = specjax.generate(target, draft, prompts, sampling, seed=seed, pad_to=8,  # short cache: cheaper
                                  datastore=datastores[name] if name else None)
    samples = np.array(result.tokens)
    w = Warp(case.temperature, case.top_k, case.top_p)
    pvalues = [chi_square_pvalue(samples[g::len(groups)], exact_joint(target, prompt, w))
               for g, prompt in enumerate(groups)]
    return min(pvalues) * len(groups), result


def assert_case_follows_the_target(models, case: Case, label: str):
    """One drafter's Theorem-1 case: the chi-square p-value above ALPHA, every token
    proposed by `case.drafter`, and some but not all proposals accepted (a case that
    accepts nothing, or everything, would not test the rejection step)."""
    pvalue, result = run(models, case, N)
    print(f"{case.drafter} {label}: p = {pvalue:.4f}, acceptance rate {result.acceptance_rate:.3f}")
    assert pvalue > ALPHA
    assert set(result.summary()["proposed_by"]) == {case.drafter}
    assert 0 < result.accepted.sum() < result.proposed


def swapper(monkeypatch):
    """swap([(module, name, value), ...]): replace functions the loop calls while it is
    traced; compiled programs are dropped before a swap (so it is traced in) and after the
    test (`undo`: so it never leaks into another). swap() with nothing to replace keeps
    them: the correct cases of a file share their compiled programs (a program is keyed on
    its shapes and static settings; temperature and top-p are traced)."""
    def swap(patches=()):
        for module, name, value in patches:
            monkeypatch.setattr(module, name, value)
            monkeypatch.swapped = True
        if patches:
            program._COMPILED.clear()
            jax.clear_caches()
    return swap


_accept_block = verify.accept_block  # the real one, for a wrong variant patched in its place


def peeks_at_target(key, x, p, q, length=None):
    """A negative control for adaptive draft lengths (patched over `verify.accept_block`):
    a length that looks at the target, the draft cut before the first token the target
    would not surely accept (q(x) < p(x))."""
    p_x = jnp.take_along_axis(p, x[..., None], axis=-1)[..., 0]
    q_x = jnp.take_along_axis(q[:, :x.shape[1]], x[..., None], axis=-1)[..., 0]
    sure = jnp.sum(jnp.cumprod(q_x >= p_x, axis=1), axis=1).astype(jnp.int32)
    return _accept_block(key, x, p, q, jnp.minimum(length, sure))


def undo(monkeypatch):
    monkeypatch.undo()
    if getattr(monkeypatch, "swapped", False):
        program._COMPILED.clear()
        jax.clear_caches()
