#!/usr/bin/env bash
# Table 1 and Figure 1 in miniature on this machine's CPU (benchmarks/table1.md, figure1.md):
# train the mini pair (and an LM-only draft to compare with the distilled one), then
# evaluate both tasks and sweep K. Every step resumes or is skipped when already done;
# results go to $OUT (default results/).
#
#   launch/table1_cpu.sh                # about 2 hours on 2 cores, most of it training
#   LIMIT=5 SAMPLES=1 launch/table1_cpu.sh   # a quick pass
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
OUT=${OUT:-results}
CKPT=${SPECJAX_CACHE:-$HOME/.cache/specjax}/checkpoints
HUMANEVAL_LIMIT=${LIMIT:-20}
XSUM_LIMIT=${XSUM_LIMIT:-32}
SAMPLES=${SAMPLES:-2}
mkdir -p "$OUT"

"$PYTHON" -m specjax.train --config=mini_target
"$PYTHON" -m specjax.train --config=mini_draft                      # distilled from mini_target
"$PYTHON" -m specjax.train --config=mini_draft --config.train.teacher= --workdir="$CKPT/mini_draft_lm"

# Table 1: HumanEval (runs model-written code: see docs/evaluating.md) and XSum format.
"$PYTHON" -m specjax.evaluate --task=humaneval --limit="$HUMANEVAL_LIMIT" --num_samples="$SAMPLES" \
  --pass_k=1,"$SAMPLES" --execute --output="$OUT/humaneval.json" | tee "$OUT/humaneval.txt"
"$PYTHON" -m specjax.evaluate --task=xsum --limit="$XSUM_LIMIT" --output="$OUT/xsum.json" | tee "$OUT/xsum.txt"
# The LM-only draft on the same prompts: what distillation buys in acceptance and speed.
"$PYTHON" -m specjax.evaluate --task=humaneval --limit="$HUMANEVAL_LIMIT" --num_samples=1 \
  --draft_checkpoint="$CKPT/mini_draft_lm" --output="$OUT/humaneval_lm_draft.json" | tee "$OUT/humaneval_lm_draft.txt"

# Figure 1: the K trade-off and batch scaling, one process.
"$PYTHON" -m specjax.bench --config=mini --lookahead=1,2,3,4,5,6,8 --batch_sizes=1,4,16 --num_prompts=4 \
  --json="$OUT/figure1.json" --plot="$OUT/figure1.png" | tee "$OUT/figure1.txt"

# Why the speedup is what it is: forward costs by tokens and cache size, the roofline,
# and one SpS loop body against its parts (benchmarks/figure1.md).
"$PYTHON" launch/forward_cost.py --config=mini_target --tokens=1,2,3,5 --cache=64,512,1024 | tee "$OUT/forward_cost_target.txt"
"$PYTHON" launch/forward_cost.py --config=mini_draft --tokens=1,2,5 --cache=64,1024 --bandwidth_mb=0 | tee "$OUT/forward_cost_draft.txt"
"$PYTHON" launch/loop_parts.py --config=mini --lookahead=4 | tee "$OUT/loop_parts.txt"
