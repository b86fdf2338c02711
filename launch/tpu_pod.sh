#!/usr/bin/env bash
# The paper's setup: Chinchilla 70B + the 4B draft on 16 TPU v4 chips (a v4-32 slice:
# 4 hosts x 4 chips), one JAX process per host joined by jax.distributed.initialize().
#
#   launch/tpu_pod.sh                      # create (or reuse) the slice, install, sample, fetch the output
#   DRY_RUN=1 launch/tpu_pod.sh            # print the gcloud commands instead of running them
#   STEPS=run launch/tpu_pod.sh -- --mode=sps --max_new_tokens=256      # only step 'run', extra sample flags
#   STEPS=delete launch/tpu_pod.sh         # give the slice back
#
# Steps (STEPS, space-separated, default "create install run fetch"):
#   create   reuse $TPU_NAME if it exists in $ZONE, else create a $ACCELERATOR TPU VM slice;
#   install  copy this checkout (git archive of HEAD plus uncommitted tracked changes) to
#            every worker (--worker=all) and pip-install it with jax[tpu]==$JAX_VERSION;
#   run      run `python -m specjax.sample --config=$CONFIG --init=random ...` on all workers
#            at once; SPECJAX_DISTRIBUTED=auto makes specjax.distributed.maybe_initialize()
#            call jax.distributed.initialize() (coordinator and ids from the TPU metadata);
#            process 0 writes $REMOTE_OUTPUT, the others stay quiet;
#   fetch    copy $REMOTE_OUTPUT from worker 0 to $OUTPUT;
#   delete   delete the slice.
# Random weights: Chinchilla's are not public. The timings (ms/token ArS vs SpS) are what
# this run is for; `python -m specjax.plan --config=chinchilla_70b` predicts them.
# Real weights: HF_TARGET / HF_DRAFT name Hugging Face directories that every worker can
# read (gs://... needs gcsfs: `pip install 'etils[epath-gcs]'`, or a copy on each host),
#   CONFIG=llama3_70b_1b HF_TARGET=gs://B/Llama-3.1-70B HF_DRAFT=gs://B/Llama-3.2-1B launch/tpu_pod.sh
set -euo pipefail
cd "$(dirname "$0")/.."

TPU_NAME=${TPU_NAME:-specjax-v4-32}
ZONE=${ZONE:-us-central2-b}                  # where v4 lives
ACCELERATOR=${ACCELERATOR:-v4-32}            # 16 chips (32 TensorCores)
RUNTIME=${RUNTIME:-tpu-ubuntu2204-base}
PROJECT=${PROJECT:-}
SPOT=${SPOT:-0}                               # 1: --spot (cheaper, preemptible)
CONFIG=${CONFIG:-chinchilla_70b}
JAX_VERSION=${JAX_VERSION:-$( (.venv/bin/python -c 'import jax; print(jax.__version__)' 2>/dev/null) || echo 0.10.2)}
STEPS=${STEPS:-create install run fetch}
REMOTE_DIR=${REMOTE_DIR:-specjax}
REMOTE_OUTPUT=${REMOTE_OUTPUT:-/tmp/specjax_${CONFIG}.jsonl}
OUTPUT=${OUTPUT:-${CONFIG}_tpu_pod.jsonl}
DRY_RUN=${DRY_RUN:-0}

# Sample flags (specjax.sample): a 128-token prompt of fixed ids, 128 new tokens, both loops.
PROMPT=$(seq -s, 1 128)
WEIGHTS=(--init=random)
if [ -n "${HF_TARGET:-}" ]; then WEIGHTS=(--hf_target="$HF_TARGET" ${HF_DRAFT:+--hf_draft="$HF_DRAFT"}); fi
SAMPLE_FLAGS=(--config="$CONFIG" "${WEIGHTS[@]}" --mode=both --prompt_tokens="$PROMPT"
              --max_new_tokens=128 --output="$REMOTE_OUTPUT")
if [ "${1:-}" = "--" ]; then shift; fi
SAMPLE_FLAGS+=("$@")

gc() {  # gcloud, or its command line under DRY_RUN=1
  local args=(gcloud "$@")
  [ -n "$PROJECT" ] && args+=(--project="$PROJECT")
  if [ "$DRY_RUN" = 1 ]; then printf '%q ' "${args[@]}"; echo; else "${args[@]}"; fi
}
on_all() { gc compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all --command="$1"; }

step_create() {
  if [ "$DRY_RUN" != 1 ] && gcloud compute tpus tpu-vm describe "$TPU_NAME" --zone="$ZONE" \
       ${PROJECT:+--project="$PROJECT"} >/dev/null 2>&1; then
    echo "reusing TPU VM $TPU_NAME in $ZONE" >&2
    return
  fi
  gc compute tpus tpu-vm create "$TPU_NAME" --zone="$ZONE" --accelerator-type="$ACCELERATOR" \
    --version="$RUNTIME" $( [ "$SPOT" = 1 ] && echo --spot )
}

step_install() {
  local tarball
  tarball=$(mktemp -t specjax.XXXXXX).tar.gz
  # HEAD plus uncommitted changes to tracked files (`git stash create` commits them
  # without touching the working tree or the stash list; it prints nothing when clean).
  local rev
  rev=$(git stash create 2>/dev/null || true)
  git archive --format=tar.gz -o "$tarball" "${rev:-HEAD}"
  gc compute tpus tpu-vm scp "$tarball" "$TPU_NAME":specjax.tar.gz --zone="$ZONE" --worker=all
  on_all "set -e; rm -rf ~/$REMOTE_DIR; mkdir -p ~/$REMOTE_DIR; tar xzf ~/specjax.tar.gz -C ~/$REMOTE_DIR; \
cd ~/$REMOTE_DIR; python3 -m venv .venv; .venv/bin/pip install -q -U pip; \
.venv/bin/pip install -q 'jax[tpu]==$JAX_VERSION' -f https://storage.googleapis.com/jax-releases/libtpu_releases.html; \
.venv/bin/pip install -q -e .; .venv/bin/python -c 'import jax, specjax; print(\"specjax on jax\", jax.__version__)'"
  rm -f "$tarball"
}

step_run() {
  local flags
  flags=$(printf '%q ' "${SAMPLE_FLAGS[@]}")
  # All workers start the same command; jax.distributed.initialize() waits for all of them.
  on_all "cd ~/$REMOTE_DIR && SPECJAX_DISTRIBUTED=auto .venv/bin/python -m specjax.sample $flags"
}

step_fetch() {
  gc compute tpus tpu-vm scp "$TPU_NAME:$REMOTE_OUTPUT" "$OUTPUT" --zone="$ZONE" --worker=0
  [ "$DRY_RUN" = 1 ] || echo "wrote $OUTPUT" >&2
}

step_delete() { gc compute tpus tpu-vm delete "$TPU_NAME" --zone="$ZONE" --quiet; }

for step in $STEPS; do
  case "$step" in
    create|install|run|fetch|delete) echo "== $step" >&2; "step_$step" ;;
    *) echo "tpu_pod.sh: unknown step '$step' (create install run fetch delete)" >&2; exit 2 ;;
  esac
done
