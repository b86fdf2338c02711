#!/usr/bin/env bash
# What a CPU cannot measure, on one GPU (a few minutes on an H200): the machine's read
# bandwidth, one cached forward of the float and the int8/int4 models (XLA's dots, no CPU
# kernels) for an unscanned model (mini_target, f32) and a scanned one (draft_4b, 4.3B
# bf16, random weights), each program's compiled temporaries (a float copy of a quantized
# weight kept per run shows there), and ArS vs SpS with the target's own first layers
# and its int8 copy as drafts, and an int8 target with the first-layers draft.
#
#     bash launch/gpu_decode.sh OUT_DIR
#
# Uses the python3 on the PATH with its own jax (a CUDA build); specjax from this
# checkout (PYTHONPATH), nothing installed. Each step's output is also written under
# OUT_DIR as it runs, so an interrupted run keeps what it measured.
set -uo pipefail
if [ $# -ne 1 ]; then echo "usage: bash launch/gpu_decode.sh OUT_DIR" >&2; exit 2; fi
mkdir -p "$1" && out=$(cd "$1" && pwd) || exit 2
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} SPECJAX_KERNELS=0 PYTHONUNBUFFERED=1
step() { local name=$1; shift; echo "== $name: $*"; local t0=$SECONDS; "$@" 2>&1 | grep -v 'W[0-9]\{4\} \|I[0-9]\{4\} ' | tee "$out/$name.txt"; echo "   ($((SECONDS - t0)) s)"; }

step device bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv; python3 -c "import jax, flax; print(\"jax\", jax.__version__, \"flax\", flax.__version__, jax.devices())"'
step mini_target python3 launch/forward_cost.py --config=mini_target --tokens=1,5 --cache=512 \
    --quantize=none,int8,int4 --kernels=off --steps=32 --repeats=10 --bandwidth_mb=4096
step draft_4b python3 launch/forward_cost.py --config=draft_4b --tokens=1,5 --cache=512 \
    --quantize=none,int8,int4 --kernels=off --steps=16 --repeats=5 --bandwidth_mb=0
step bench_self_drafts python3 -m specjax.bench --config=draft_4b --init=random --config.mesh.model=1 \
    --self_draft=layers:2,int8 --lookahead=2,4 --num_prompts=2 --max_new_tokens=64 --repeats=5 \
    --json="$out/bench_self_drafts.json"
step bench_int8_target python3 -m specjax.bench --config=draft_4b --init=random --config.mesh.model=1 \
    --quantize=int8 --self_draft=layers:2 --lookahead=2 --num_prompts=2 --max_new_tokens=64 --repeats=5 \
    --json="$out/bench_int8_target.json"
