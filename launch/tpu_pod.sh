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
#            every worker (--worker=all); there, install uv, a Python $PYTHON_VERSION with it
#            (the stock TPU images ship Python 3.10, and jax 0.10 needs >= 3.11) and a
#            venv with jax[tpu]==$JAX_VERSION and specjax;
#   run      run `python -m specjax.sample --config=$CONFIG ...` on all workers at once:
#            random weights, or with CHECKPOINT (and DRAFT_CHECKPOINT) the checkpoint
#            directories, which must be one path every worker sees (gs://bucket/...: a 70B
#            checkpoint does not fit a worker's disk, and orbax restores on every host);
#            SPECJAX_DISTRIBUTED=auto makes specjax.distributed.maybe_initialize() call
#            jax.distributed.initialize() (coordinator and ids from the TPU metadata);
#            process 0 writes $REMOTE_OUTPUT, the others stay quiet;
#   fetch    copy $REMOTE_OUTPUT from worker 0 to $OUTPUT;
#   delete   delete the slice.
# Without weights: random ones (Chinchilla's are not public); the timings (ms/token ArS
# vs SpS) are what that run is for, and `python -m specjax.plan --config=$CONFIG`
# predicts them. Real weights, in directories every worker can read (gs://... needs
# gcsfs for Hugging Face directories: `pip install 'etils[epath-gcs]'`; orbax reads gs://
# itself): HF_TARGET / HF_DRAFT (Hugging Face), GGUF_TARGET / GGUF_DRAFT (GGUF files: a local
# path on every worker, as they are memory-mapped), or CHECKPOINT / DRAFT_CHECKPOINT (specjax's),
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
PYTHON_VERSION=${PYTHON_VERSION:-3.11}       # jax 0.10 needs >= 3.11; the TPU images have 3.10
CHECKPOINT=${CHECKPOINT:-}                   # e.g. gs://bucket/chinchilla_70b (seen by every worker)
DRAFT_CHECKPOINT=${DRAFT_CHECKPOINT:-}
JAX_VERSION=${JAX_VERSION:-$( (.venv/bin/python -c 'import jax; print(jax.__version__)' 2>/dev/null) || echo 0.10.2)}
STEPS=${STEPS:-create install run fetch}
REMOTE_DIR=${REMOTE_DIR:-specjax}
REMOTE_OUTPUT=${REMOTE_OUTPUT:-/tmp/specjax_${CONFIG}.jsonl}
OUTPUT=${OUTPUT:-${CONFIG}_tpu_pod.jsonl}
DRY_RUN=${DRY_RUN:-0}

# Sample flags (specjax.sample): a 128-token prompt of fixed ids, 128 new tokens, both loops.
PROMPT=$(seq -s, 1 128)
WEIGHTS=(--init=random)
if [ -n "${HF_TARGET:-}" ]; then
  WEIGHTS=(--hf_target="$HF_TARGET" ${HF_DRAFT:+--hf_draft="$HF_DRAFT"})
elif [ -n "${GGUF_TARGET:-}" ]; then
  WEIGHTS=(--gguf_target="$GGUF_TARGET" ${GGUF_DRAFT:+--gguf_draft="$GGUF_DRAFT"})
elif [ -n "$CHECKPOINT" ]; then
  WEIGHTS=(--checkpoint="$CHECKPOINT" ${DRAFT_CHECKPOINT:+--draft_checkpoint="$DRAFT_CHECKPOINT"})
fi
SAMPLE_FLAGS=(--config="$CONFIG" "${WEIGHTS[@]}" --mode=both --prompt_tokens="$PROMPT" --max_new_tokens=128
              --output="$REMOTE_OUTPUT")
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
  # uv brings its own Python build: no python3-venv package or PPA needed on the image.
  on_all "set -e; rm -rf ~/$REMOTE_DIR; mkdir -p ~/$REMOTE_DIR; tar xzf ~/specjax.tar.gz -C ~/$REMOTE_DIR; \
cd ~/$REMOTE_DIR; command -v uv >/dev/null || curl -LsSf https://astral.sh/uv/install.sh | sh; \
export PATH=\$HOME/.local/bin:\$PATH; uv venv --python $PYTHON_VERSION .venv; \
uv pip install --python .venv/bin/python 'jax[tpu]==$JAX_VERSION' -f https://storage.googleapis.com/jax-releases/libtpu_releases.html; \
uv pip install --python .venv/bin/python .; \
.venv/bin/python -c 'import sys, jax, specjax; print(\"specjax on jax\", jax.__version__, \"python\", sys.version.split()[0])'"
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
