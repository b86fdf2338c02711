"""`plan --compiler=tpu`: THE programs compiled by XLA:TPU through libtpu's compile-only
client, and the HLO reading it rests on.

Without libtpu (the default suite needs none):
* the loop finder on both compilers' HLO of tiny's SpS program (fixtures made once by
  tests/fixtures/make_hlo_fixtures.py): XLA:TPU's program holds a second while loop (the
  draft scan) and writes no trip counts, XLA:CPU's writes them; both give Megatron's
  all-reduces per loop;
* bytes read from HBM and FLOPs of a hand-written XLA:TPU step (a copy into on-chip
  memory, a layer sliced out of a stacked weight, a counted loop);
* building a program for `plan` touches no device (no array is made, nothing is
  transferred), and such a program refuses to run;
* `--compiler=tpu` refuses in one line without libtpu (hidden from the run), and a mesh
  no slice forms.
With libtpu (slow): tiny's SpS and ArS for a 4-chip v4 slice fit, the loop is found in
the TPU HLO, and the costed target steps read their weights and cache once.
"""
import dataclasses
import gzip
import json
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import kv_heads
from specjax.analysis import compile as compile_lib, hlo, tpu
from specjax.config import load_config
from specjax.heads import abstract_heads
from specjax.model import abstract_lm
from clitools import assert_one_line, cli_env
from conftest import mesh_for
from models import random_lm

REPO = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "hlo"
K = 4  # tiny's lookahead


def _fixture(compiler: str) -> hlo.HloProgram:
    with gzip.open(FIXTURES / f"tiny_sps_{compiler}.hlo.gz", "rt") as f:
        return hlo.HloProgram(f.read())


def _by_shape(summary: dict, kind: str) -> dict:
    """{shape without leading unit axes (XLA:CPU keeps them, XLA:TPU drops them): count}."""
    return {re.sub(r"\[(1,)+", "[", m["shape"]): m["count"] for m in summary.get(kind, {}).get("messages", [])}


@pytest.mark.parametrize("compiler", ["cpu", "tpu"])
def test_loop_finder_counts_megatron_all_reduces_in_both_compilers_hlo(compiler):
    """tiny (target 2 layers, d_model 32; draft 1 layer, d_model 16) on 1x4, K=4: per loop
    the target's scoring pass has 2 all-reduces per layer + the embedding lookup over
    K+1 rows, each of the K draft steps 2 + 1 (the first over 2 rows); the logits of each
    distribution are gathered once, in an all-gather on both compilers."""
    program = _fixture(compiler)
    loops = [(c, line) for c in program.computations for _, _, op, line in program.instructions(c) if op == "while"]
    counted = [program.trip_count(c, line) for c, line in loops]
    if compiler == "tpu":
        assert not any('"known_trip_count"' in line for _, line in loops)  # XLA:TPU writes none
        assert counted.count(K - 1) == 1 and counted.count(None) == 1  # the draft scan, the generation loop
    per_loop, outside = program.loop_and_outside()
    loop = hlo.summarize(per_loop)
    reduces = _by_shape(loop, "all-reduce")
    assert reduces["f32[5,32]"] == 2 * 2 + 1
    assert reduces["f32[2,16]"] == 2 * 1 + 1 and reduces["f32[16]"] == (K - 1) * (2 * 1 + 1)
    gathers = _by_shape(loop, "all-gather")  # vocab 32 over 4 devices: shards of 8, each padded to 128 lanes
    assert gathers == {"f32[4,128]": K, "f32[5,4,128]": 1}
    assert sum(e["count"] for e in loop.values()) == 2 * 2 + 1 + K * 3 + K + 1
    assert sum(e["count"] for e in hlo.summarize(outside).values()) >= 2 * 2 + 1  # the prefills


STEP = """\
HloModule step

%fused_slice (param_0: bf16[4,64,128], param_1: s32[]) -> bf16[64,128] {
  %param_0 = bf16[4,64,128]{2,1,0:T(8,128)(2,1)} parameter(0)
  %param_1 = s32[]{:T(128)} parameter(1)
  %c0 = s32[]{:T(128)} constant(0)
  %ds = bf16[1,64,128]{2,1,0:T(8,128)(2,1)} dynamic-slice(%param_0, %param_1, %c0, %c0), dynamic_slice_sizes={1,64,128}
  ROOT %b = bf16[64,128]{1,0:T(8,128)(2,1)} bitcast(%ds)
}

%fused_dot (param_0: bf16[2,64], param_1: bf16[64,128]) -> bf16[2,128] {
  %param_0 = bf16[2,64]{1,0:T(2,128)(2,1)} parameter(0)
  %param_1 = bf16[64,128]{1,0:T(8,128)(2,1)S(1)} parameter(1)
  ROOT %conv = bf16[2,128]{1,0:T(2,128)(2,1)} convolution(%param_0, %param_1), dim_labels=bf_io->bf
}

%body (p: (s32[], bf16[2,64], bf16[4,64,128])) -> (s32[], bf16[2,64], bf16[4,64,128]) {
  %p = (s32[]{:T(128)}, bf16[2,64]{1,0:T(2,128)(2,1)}, bf16[4,64,128]{2,1,0:T(8,128)(2,1)}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  %x = bf16[2,64]{1,0:T(2,128)(2,1)} get-tuple-element(%p), index=1
  %w = bf16[4,64,128]{2,1,0:T(8,128)(2,1)} get-tuple-element(%p), index=2
  %layer = bf16[64,128]{1,0:T(8,128)(2,1)S(1)} fusion(%w, %i), kind=kLoop, calls=%fused_slice
  %one = s32[]{:T(128)} constant(1)
  %next = s32[]{:T(128)} add(%i, %one)
  ROOT %t = (s32[]{:T(128)}, bf16[2,64]{1,0:T(2,128)(2,1)}, bf16[4,64,128]{2,1,0:T(8,128)(2,1)}) tuple(%next, %x, %w)
}

%cond (p: (s32[], bf16[2,64], bf16[4,64,128])) -> pred[] {
  %p = (s32[]{:T(128)}, bf16[2,64]{1,0:T(2,128)(2,1)}, bf16[4,64,128]{2,1,0:T(8,128)(2,1)}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  %n = s32[]{:T(128)} constant(4)
  ROOT %lt = pred[]{:T(512)} compare(%n, %i), direction=GT
}

ENTRY %main (a: bf16[2,64], w: bf16[4,64,128], u: bf16[64,128]) -> bf16[2,128] {
  %a = bf16[2,64]{1,0:T(2,128)(2,1)} parameter(0)
  %w = bf16[4,64,128]{2,1,0:T(8,128)(2,1)} parameter(1)
  %u = bf16[64,128]{1,0:T(8,128)(2,1)} parameter(2)
  %cs = (bf16[64,128]{1,0:T(8,128)(2,1)S(1)}, bf16[64,128]{1,0:T(8,128)(2,1)}, u32[]{:S(2)}) copy-start(%u), cross_program_prefetch_index=0
  %cd = bf16[64,128]{1,0:T(8,128)(2,1)S(1)} copy-done(%cs)
  %zero = s32[]{:T(128)} constant(0)
  %c = s32[]{:T(128)} copy(%zero)
  %t = (s32[]{:T(128)}, bf16[2,64]{1,0:T(2,128)(2,1)}, bf16[4,64,128]{2,1,0:T(8,128)(2,1)}) tuple(%c, %a, %w)
  %loop = (s32[]{:T(128)}, bf16[2,64]{1,0:T(2,128)(2,1)}, bf16[4,64,128]{2,1,0:T(8,128)(2,1)}) while(%t), condition=%cond, body=%body
  ROOT %out = bf16[2,128]{1,0:T(2,128)(2,1)} fusion(%a, %cd), kind=kOutput, calls=%fused_dot
}
"""


def test_traffic_counts_what_the_chip_reads_from_hbm():
    """The copy of `u` into on-chip memory (S(1)) reads its 16 KiB once, and the matmul
    that reads the copy reads no HBM; the loop (trip count 4 from `4 > i`, i from 0 by 1)
    reads one 16 KiB layer of `w` per iteration, not all of `w`; scalars count their
    4 bytes. FLOPs: the [2,64] x [64,128] matmul plus the loop's add and compare."""
    program = hlo.HloProgram(STEP)
    line = next(line for _, _, op, line in program.instructions("main") if op == "while")
    assert program.trip_count("main", line) == 4
    layer = 64 * 128 * 2
    per_iteration = (layer + 4) + 2 * 4 + 2 * 4  # the slice and i; add(i, 1); compare(4, i)
    expected = layer + 2 * 64 * 2 + 4 + 4 * per_iteration  # copy-start, the matmul's `a`, copy(0), the loop
    assert program.traffic() == hlo.Traffic(expected, 2 * 2 * 128 * 64 + 4 + 4)
    # Unfused, the slice is still a slice; a loop whose step is not 1 has no inferred count.
    assert program.trip_count("main", line.replace("body=%body", "body=%cond")) is None


PIECES = """\
HloModule pieces

%narrowing (param_0: f32[4,256,8]) -> bf16[256,8] {
  %param_0 = f32[4,256,8]{2,1,0:T(8,128)} parameter(0)
  %s = bf16[1,256,8]{2,1,0:T(8,128)(2,1)} slice(%param_0), slice={[1:2], [0:256], [0:8]}
  ROOT %b = bf16[256,8]{1,0:T(8,128)(2,1)} bitcast(%s)
}

%view (param_0: bf16[2000,8192]) -> bf16[2000,8192] {
  %param_0 = bf16[2000,8192]{1,0:T(8,128)(2,1)} parameter(0)
  ROOT %b = bf16[2000,8192]{1,0:T(8,128)(2,1)} bitcast(%param_0)
}

%relaid (param_0: s8[80,64,128]) -> s8[80,64,128] {
  %param_0 = s8[80,64,128]{2,1,0:T(32,128)(4,1)} parameter(0)
  ROOT %c = s8[80,64,128]{2,1,0:T(8,128)(4,1)} copy(%param_0)
}

%int8_layer (param_0: s8[80,64,128], param_1: s32[]) -> bf16[64,128] {
  %param_0 = s8[80,64,128]{2,1,0:T(32,128)(4,1)} parameter(0)
  %param_1 = s32[]{:T(128)S(6)} parameter(1)
  %r = s8[80,64,128]{2,1,0:T(8,128)(4,1)} fusion(%param_0), kind=kLoop, calls=%relaid
  %z = s32[]{:T(128)} constant(0)
  %ds = s8[1,64,128]{2,1,0:T(8,128)(4,1)} dynamic-slice(%r, %param_1, %z, %z), dynamic_slice_sizes={1,64,128}
  %f = bf16[1,64,128]{2,1,0:T(8,128)(2,1)} convert(%ds)
  ROOT %b = bf16[64,128]{1,0:T(8,128)(2,1)} bitcast(%f)
}

%lookup (param_0: bf16[2000,8192], param_1: pred[5,2000]) -> bf16[5,8192] {
  %param_0 = bf16[2000,8192]{1,0:T(8,128)(2,1)} parameter(0)
  %param_1 = pred[5,2000]{1,0:T(8,128)(4,1)} parameter(1)
  %v = bf16[2000,8192]{1,0:T(8,128)(2,1)} fusion(%param_0), kind=kLoop, calls=%view
  ROOT %e = bf16[5,8192]{1,0:T(8,128)(2,1)} convolution(%param_1, %v), dim_labels=bf_io->bf
}

ENTRY %main (x: bf16[5,8192,1], w: bf16[8192,4,128], t: bf16[2000,8192], c: f32[4,256,8], hot: pred[5,2000], codes: s8[80,64,128], i: s32[]) -> bf16[5,4,128] {
  %x = bf16[5,8192,1]{2,1,0:T(8,128)(2,1)} parameter(0)
  %w = bf16[8192,4,128]{2,1,0:T(4,128)(2,1)} parameter(1)
  %t = bf16[2000,8192]{1,0:T(8,128)(2,1)} parameter(2)
  %c = f32[4,256,8]{2,1,0:T(8,128)} parameter(3)
  %part = ((bf16[2000,8192]{1,0:T(8,128)(2,1)}), bf16[504,8192]{1,0:T(8,128)(2,1)}, u32[]{:S(2)}) slice-start(%t), slice={[0:504], [0:8192]}
  %done = bf16[504,8192]{1,0:T(8,128)(2,1)} slice-done(%part)
  %layer = bf16[256,8]{1,0:T(8,128)(2,1)} fusion(%c), kind=kLoop, calls=%narrowing
  %hot = pred[5,2000]{1,0:T(8,128)(4,1)S(1)} parameter(4)
  %rows = bf16[5,8192]{1,0:T(8,128)(2,1)} fusion(%t, %hot), kind=kOutput, calls=%lookup
  %codes = s8[80,64,128]{2,1,0:T(32,128)(4,1)} parameter(5)
  %i = s32[]{:T(128)S(6)} parameter(6)
  %one = bf16[64,128]{1,0:T(8,128)(2,1)} fusion(%codes, %i), kind=kLoop, calls=%int8_layer
  ROOT %q = bf16[5,4,128]{2,1,0:T(8,128)(2,1)} convolution(%x, %w), window={size=4 pad=3_3 rhs_reversal=1}, dim_labels=bf0_i0o->b0f
}
"""


def test_traffic_of_what_xla_tpu_writes_for_matmuls_and_slices():
    """XLA:TPU writes a [5, 8192] x [8192, 4 x 128] matmul as a convolution whose 4-wide
    window overlaps the input at one tap per output (the rest is padding): its FLOPs are
    the matmul's. An async slice reads its rows, not the table; a slice that converts f32
    to bf16 reads the f32 elements; the matmul reads x and w whole, a one-hot lookup the
    whole table `t` through the view (a nested fusion) its convolution reads, and a fusion
    that relayouts a stacked int8 weight (a nested copy) before slicing one layer and
    converting it reads that layer: it computes only what its result needs."""
    program = hlo.HloProgram(PIECES)
    traffic = program.traffic()
    assert traffic.flops == 2 * 5 * 4 * 128 * 8192 + 2 * 5 * 8192 * 2000
    assert traffic.hbm_read == 504 * 8192 * 2 + 256 * 8 * 4 + 5 * 8192 * 2 + 8192 * 4 * 128 * 2 + 2000 * 8192 * 2 + 64 * 128


def test_generation_loop_is_the_outer_data_dependent_loop():
    """A data-dependent loop whose body holds the one counted loop: found; a second
    data-dependent loop beside it: refused, naming both."""
    text = STEP.replace("ROOT %lt = pred[]{:T(512)} compare(%n, %i), direction=GT",
                        "ROOT %lt = pred[]{:T(512)} compare(%n, %i), direction=NE")
    program = hlo.HloProgram(text)
    assert program.generation_loop()[0] == "loop"
    two = text.replace("  ROOT %out", "  %again = (s32[]{:T(128)}, bf16[2,64]{1,0:T(2,128)(2,1)}, "
                       "bf16[4,64,128]{2,1,0:T(8,128)(2,1)}) while(%t), condition=%cond, body=%body\n  ROOT %out")
    with pytest.raises(ValueError, match="loop.*again"):
        hlo.HloProgram(two).generation_loop()


@pytest.mark.parametrize("mesh,drafter", [("1x1", "model"), ("1x8", "model"), ("1x8", "eagle")])
def test_building_a_plan_program_touches_no_device(mesh, drafter):
    """`plan` builds and lowers THE program from abstract params and abstract prompts: no
    array is created on any device and nothing crosses to one (a compile-only client has
    no device to place anything on). The same program refuses to run."""
    cfg = load_config("tiny")
    m = mesh_for(mesh)
    target = abstract_lm(kv_heads.for_mesh(cfg.target, m), m)
    draft = (abstract_lm(kv_heads.for_mesh(cfg.draft, m), m) if drafter == "model"
             else abstract_heads(cfg.heads_for("eagle"), cfg.target, m))
    sampling = dataclasses.replace(cfg.sampling, drafter=drafter)
    before = {id(a) for a in jax.live_arrays()}
    with jax.transfer_guard("disallow_explicit"):
        prog = compile_lib.planned(target, draft, sampling, batch=2, prompt_len=5, cache_len=64)
        prog.lower()
    made = [a.shape for a in jax.live_arrays() if id(a) not in before]
    assert made == []
    with pytest.raises(ValueError, match="compiled, not run"):
        prog.run()


def test_vocab_parallel_embedding_reads_its_rows_not_the_table():
    """The embedding lookup over a table split 8 ways by vocabulary (4096 x 32 float32:
    64 KiB per device): each device reads the rows of its own range (a few hundred bytes)
    and one all-reduce sums them; the values are the table's rows. (As a one-hot
    contraction every forward read the whole shard: XLA:TPU showed it, 125 MiB per chip
    and step for Llama-3.1-70B.)"""
    cfg = dataclasses.replace(load_config("tiny").target, vocab_size=4096)
    mesh = mesh_for("1x8")
    lm = random_lm(cfg, mesh, seed=0)
    tokens = jnp.asarray([[5, 4095, 512], [0, 1023, 2048]], jnp.int32)
    with jax.set_mesh(mesh):
        embed = jax.jit(lambda lm, t: lm.embed(t))
        got = np.asarray(embed(lm, tokens))
        program = hlo.HloProgram(embed.lower(lm, tokens).compile().as_text())
    np.testing.assert_array_equal(got, np.asarray(lm.params["embed"].value)[np.asarray(tokens)])
    shard = 4096 // 8 * 32 * 4
    assert program.traffic().hbm_read < shard // 8
    assert hlo.summarize(program.tally(program.entry))["all-reduce"]["count"] == 1


@pytest.mark.skipif(not tpu.available(), reason="libtpu is not installed (pip install -e '.[tpu]')")
def test_sampler_gathers_vocab_parallel_logits_with_one_all_gather_on_xla_tpu():
    """`warp` gathers chinchilla's vocab-parallel logits (32000 over 16 chips: 2000 a shard,
    not whole 128-lane tiles) in one all-gather on XLA:TPU, for rows of every rank. Gathered
    as they are, XLA:TPU wrote it as an all-reduce of a zero-filled copy of the row: 4 more
    all-reduces per chinchilla_70b loop than XLA:CPU's count, one per draft step."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from specjax import sharding
    from specjax.config import MeshConfig
    from specjax.decode import warping
    mesh = sharding.make_mesh(MeshConfig(1, 16), tpu.devices("v4", 1, 16))
    w = warping.Warp(0.8, 0, 0.95)
    for shape in ((1, 1, 32000), (1, 32000)):  # a draft model's step; EAGLE's and ArS's rows
        spec = P(*(None,) * (len(shape) - 1), "model")
        logits = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))
        with jax.set_mesh(mesh):
            text = jax.jit(lambda x: warping.sample(jax.random.key(0), warping.warp(x, w)[0])).lower(logits).compile()
        program = hlo.HloProgram(text.as_text())
        tally = hlo.summarize(program.tally(program.entry))
        assert "all-reduce" not in tally, shape
        assert tally["all-gather"]["count"] == 1, shape


@pytest.mark.skipif(not tpu.available(), reason="libtpu is not installed (pip install -e '.[tpu]')")
def test_nucleus_reads_its_distributions_from_hbm_once_on_xla_tpu():
    """top-p over Llama 3's 128,256-token distributions, compiled by XLA:TPU for one v5p
    chip, reads them from HBM about twice (the bisection's 31 passes once, the cut and its
    sum once), for one draft step's row and for a scoring pass's 5. As 31 passes over
    all rows at once, XLA:TPU read them from HBM every pass (34x for one row; 16 MiB a
    draft step of Llama-3.2-1B, its costed step 1.19x its weights and cache)."""
    import math
    from specjax.decode import warping
    from specjax.kernels import NONE
    device = tpu.devices("v5p", 1, 1)[0]
    for shape in ((1, 1, 128256), (1, 5, 128256)):
        probs = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device))
        text = jax.jit(lambda p: warping.nucleus(p, 0.95, NONE)).lower(probs).compile().as_text()
        assert hlo.HloProgram(text).traffic().hbm_read <= 5 * math.prod(shape) * 4, shape


@pytest.mark.skipif(not tpu.available(), reason="libtpu is not installed (pip install -e '.[tpu]')")
def test_xla_tpu_gives_chinchillas_programs_xla_cpus_collectives():
    """chinchilla_70b cut to 2 target layers and 1 draft layer, compiled by XLA:TPU for
    its v4 slice (16 chips): per SpS loop (K=4) 2 all-reduces per layer and forward + one
    per embedding lookup, and one all-gather of each distribution's logits, as XLA:CPU
    has; per ArS step of the target 2 x 2 + 1 all-reduces and one all-gather. XLA:TPU
    wrote each 2000-wide-shard gather as an all-reduce: 4 more per loop and one more per
    step (and, gathered along a major axis but unpadded, still one more per ArS step).
    The SpS program holds no relayout of the target's q, k, v."""
    from specjax import sharding
    from specjax.config import MeshConfig
    from specjax.decode import program as program_lib
    from specjax.kernels import NONE
    cfg = load_config("chinchilla_70b")
    target, draft = (dataclasses.replace(c, num_layers=n) for c, n in ((cfg.target, 2), (cfg.draft, 1)))
    mesh = sharding.make_mesh(MeshConfig(1, 16), tpu.devices("v4", 1, 16))
    t, d = (abstract_lm(kv_heads.for_mesh(c, mesh), mesh).with_kernels(NONE) for c in (target, draft))
    ars = dataclasses.replace(cfg.sampling, drafter="model")

    def compiled(draft, sampling) -> str:
        prog = compile_lib.planned(t, draft, sampling, 1, 16, 256)
        return program_lib.compile_lowered(prog.lower(), prog.platform).as_text()
    text = compiled(d, cfg.sampling)
    sps = compile_lib.summarize(hlo.HloProgram(text).loop_and_outside()[0])
    step = compile_lib.summarize(hlo.HloProgram(compiled(None, ars)).loop_and_outside()[0])
    assert sps["all-reduce"]["count"] == (2 * 2 + 1) + K * (2 * 1 + 1) and sps["all-gather"]["count"] == K + 1
    assert step["all-reduce"]["count"] == 2 * 2 + 1 and step["all-gather"]["count"] == 1
    # ... and the SpS program makes no copy of a q, k or v weight: stored [D, N, H], XLA:TPU
    # relaid the stacked weights out as [N, D, H] for the multi-token passes (1.9 GiB of
    # the 70B program's 2.7 GiB of temporaries per chip); heads-major, they are read as stored.
    stacked = sorted((2, t.cfg.num_heads // 16, t.cfg.d_model, t.cfg.head_dim))
    made = [(m.group(2), sorted(map(int, m.group(1).split(",")))) for m in
            re.finditer(r"= bf16\[([\d,]+)\]\{[^}]*\} ([\w-]+)\(", text)]
    moved = [op for op, dims in made if dims == stacked and op in ("copy", "transpose", "fusion")]
    assert not moved, moved


@pytest.mark.skipif(not tpu.available(), reason="libtpu is not installed (pip install -e '.[tpu]')")
@pytest.mark.slow  # the default set's time budget
def test_xla_tpu_reads_a_head_dim_64_drafts_weights_and_cache_as_stored_on_v5p():
    """llama3_70b_1b cut to 2 target layers and 2 draft layers, its SpS program compiled by
    XLA:TPU for a v5p slice (16 chips): the draft's q, k and v ([layers, heads, 2048, 64]
    per chip, head_dim 64 under one 128-lane tile) are read as stored, with no copy or
    transpose in the program. Held to the runtime's default layout (the program took the
    draft's weights as placed), XLA:TPU copied all three into a layout with head_dim
    minor: 32 MiB of the full model's SpS temporaries per chip, q's copy once per loop.
    The draft's cache ([2, 1, 1, S, 64] per chip) is held positions-minor, unpadded, and
    never copied: with head_dim minor it filled half of each lane tile and every draft
    forward copied it positions-minor for its attention (the full model: 8 MiB of padding
    and 2 x 4 MiB of copies per chip, SpS temporaries 1.16x what the program needs)."""
    from specjax import sharding
    from specjax.config import MeshConfig
    from specjax.decode import program as program_lib
    from specjax.kernels import NONE
    cfg = load_config("llama3_70b_1b")
    target, draft = (dataclasses.replace(c, num_layers=2) for c in (cfg.target, cfg.draft))
    mesh = sharding.make_mesh(MeshConfig(1, 16), tpu.devices("v5p", 1, 16))
    t, d = (abstract_lm(kv_heads.for_mesh(c, mesh), mesh).with_kernels(NONE) for c in (target, draft))
    prog = compile_lib.planned(t, d, cfg.sampling, 1, 16, 256)
    text = program_lib.compile_lowered(prog.lower(), prog.platform).as_text()
    # q's and (one head per chip) k's and v's stacked shapes; a wo [2, 2, 64, 2048] is
    # sliced a layer at a time into on-chip memory, as every weight in a layer scan is
    weights = [[2, n, d.cfg.d_model, d.cfg.head_dim] for n in (d.cfg.num_heads // 16, d.cfg.num_kv_heads // 16)]
    made = [(m.group(3), list(map(int, m.group(1).split(","))), m.group(2)) for m in
            re.finditer(r"= bf16\[([\d,]+)\]\{([^}]*)\} ([\w-]+)\(", text)]
    moved = [(op, dims) for op, dims, _ in made if dims in weights and op in ("copy", "transpose", "fusion")]
    assert not moved, moved
    cache = [(op, layout) for op, dims, layout in made if dims == [2, 1, 1, 256, d.cfg.head_dim]]  # 256 slots
    assert cache, "no draft cache [2, 1, 1, 256, 64] in the program"
    assert all(layout.startswith("3,4,") for _, layout in cache), sorted(set(cache))
    assert not [op for op, _ in cache if op in ("copy", "transpose")], sorted(set(cache))


# A run of plan in which libtpu cannot be imported, whether or not it is installed.
HIDE_LIBTPU = ("import importlib.abc, runpy, sys\n"
               "class Hide(importlib.abc.MetaPathFinder):\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] == 'libtpu':\n"
               "            raise ModuleNotFoundError(name)\n"
               "sys.meta_path.insert(0, Hide())\n"
               "sys.argv[0] = 'plan.py'\n"
               "runpy.run_module('specjax.plan', run_name='__main__', alter_sys=True)\n")


@pytest.mark.parametrize("args,fragments", [
    (["--mesh=1x16"], ["--compiler=tpu needs libtpu", "pip install 'specjax[tpu]'"]),
    (["--mesh=1x12"], ["--mesh=1x12", "12 v4 chips form no slice", "1, 2, 4, 8, 16, 32"]),
    (["--mesh=1x6", "--chip=v5e"], ["6 v5e chips", "1, 2, 4, 8, 16"])])
def test_tpu_compiler_refuses_without_libtpu_and_a_mesh_no_slice_forms(tmp_path, args, fragments):
    proc = subprocess.run([sys.executable, "-c", HIDE_LIBTPU, "--config=chinchilla_70b", "--compiler=tpu", *args,
                           f"--json={tmp_path / 'p.json'}"], cwd=REPO, env=cli_env(tmp_path),
                          capture_output=True, text=True, timeout=300)
    assert_one_line(proc, 2, fragments)
    assert not (tmp_path / "p.json").exists()


@pytest.mark.slow
@pytest.mark.skipif(not tpu.available(), reason="libtpu is not installed (pip install -e '.[tpu]')")
def test_plan_compiles_tiny_with_xla_tpu_and_costs_its_steps(tmp_path):
    """tiny's SpS, ArS and draft programs for a v4 slice of 4 chips, compiled by XLA:TPU:
    they fit, the loop is found in the TPU HLO with Megatron's all-reduces, and each
    costed step of the target (its ArS step, the SpS scoring pass) reads from HBM within
    15% of its weights and the cache it attends (tiny's weights are kilobytes; XLA keeps
    the draft's on chip across its K steps, so only the target's steps are bounded)."""
    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, "-m", "specjax.plan", "--config=tiny", "--mesh=1x4", "--compiler=tpu",
                           "--cache_len=256", f"--json={out}"], cwd=REPO, env=cli_env(tmp_path),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [f"wrote {out}"]  # libtpu's start-up says nothing
    report = json.loads(out.read_text())
    programs = report["programs"]
    assert set(programs) == {"sps", "ars_target", "ars_draft"}
    for p in programs.values():
        assert p["compiler"] == "tpu" and p["fits"]
        assert 0 < p["memory"]["total"] == p["memory"]["arguments"] + p["memory"]["temporaries"] \
            + p["memory"]["outputs"] - p["memory"]["aliased"]
        # XLA:TPU's peak of live bytes, and what the program needs: tiny's caches (rotary: no
        # table) and the 128-token prompt's keys and values, 1.5 x a cache of 256 slots
        assert p["memory"]["peak"] >= p["memory"]["arguments"] + p["memory"]["outputs"]
        assert p["memory"]["peak_temporaries"] == p["memory"]["peak"] - p["memory"]["arguments"] - p["memory"]["outputs"]
    models = report["models"]
    caches = {"sps": ("target", "draft"), "ars_target": ("target",), "ars_draft": ("draft",)}
    for name, held in caches.items():
        assert programs[name]["memory"]["need"] == pytest.approx(1.5 * sum(models[m]["cache_bytes_per_device"]
                                                                           for m in held))
    assert _by_shape(programs["sps"]["collectives_per_loop"], "all-reduce")["f32[5,32]"] == 2 * 2 + 1
    # Per loop and per step, XLA:CPU's collectives: 2 all-reduces per layer and forward + the
    # embedding lookup, and an all-gather of each distribution's logits (K draft steps, the target's).
    sps = programs["sps"]["collectives_per_loop"]
    assert sps["all-reduce"]["count"] == 2 * 2 + 1 + K * (2 * 1 + 1) and sps["all-gather"]["count"] == K + 1
    step = programs["ars_target"]["collectives_per_step"]
    assert step["all-reduce"]["count"] == 2 * 2 + 1 and step["all-gather"]["count"] == 1
    for program, step in (("ars_target", "step"), ("sps", "score")):
        cost = programs[program]["steps"][step]
        assert 0.9 <= cost["bytes_ratio"] <= 1.15, (program, step, cost)
        assert cost["bytes_accessed"] < cost["xla"]["bytes accessed"]  # XLA's own count, in and out of on-chip memory
        assert cost["estimated_seconds"] > 0 and cost["flops"] > 0
    assert set(programs["sps"]["steps"]) == {"loop", "score", "propose"}
    assert report["estimate"]["ars"]["ms_per_token"] > 0 and report["estimate"]["sps"]["loop_ms"] > 0
