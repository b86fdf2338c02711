#!/usr/bin/env bash
# The paper's setup: Chinchilla 70B + the 4B draft on 16 TPU chips (default a v4-32 slice:
# 4 hosts x 4 chips), one JAX process per host joined by jax.distributed.initialize().
#
#   launch/tpu_pod.sh                      # create (or reuse) the slice, install, sample, fetch the output
#   DRY_RUN=1 launch/tpu_pod.sh            # print the gcloud commands instead of running them
#   STEPS=run launch/tpu_pod.sh -- --mode=sps --max_new_tokens=256      # only step 'run', extra sample flags
#   STEPS=delete launch/tpu_pod.sh         # give the slice back
#   GENERATION=v5e launch/tpu_pod.sh       # 16 v5e chips instead (v4 | v5e | v5p | v6e)
#
# GENERATION picks the defaults of ACCELERATOR, RUNTIME and ZONE (each can be set too):
#   v4   v4-32         tpu-ubuntu2204-base   us-central2-b   (16 chips, 4 hosts)
#   v5e  v5litepod-16  v2-alpha-tpuv5-lite   us-west4-a      (16 chips, 4 hosts; 16 GiB each:
#                                                             `python -m specjax.plan --chip=v5e` first)
#   v5p  v5p-32        v2-alpha-tpuv5        us-east5-a      (16 chips, 4 hosts)
#   v6e  v6e-16        v2-alpha-tpuv6e       us-east5-a      (16 chips, 4 hosts)
#
# Steps (STEPS, space-separated, default "create install run fetch"):
#   create   reuse $TPU_NAME if it exists in $ZONE, else create a $ACCELERATOR TPU VM slice;
#   install  copy this checkout (git archive of HEAD plus uncommitted tracked changes) to
#            every worker (--worker=all); there, install uv, a Python $PYTHON_VERSION with it
#            (the stock TPU images ship Python 3.10, and jax 0.10 needs >= 3.11) and a
#            venv with specjax, its gs:// support (the 'gcs' extra: gcsfs) and jax[tpu] in
#            ONE resolve, jax pinned as setup.py pins it (or ==$JAX_VERSION), so the libtpu
#            that jax[tpu] chooses and the jax the package needs cannot drift apart;
#   run      on every worker, free the TPU first (kill whatever still holds /dev/accel*
#            (v4) or /dev/vfio/* (v5e and later), e.g. a run interrupted with Ctrl-C, and
#            remove /tmp/libtpu_lockfile: otherwise that worker fails with "TPU in use"
#            and the others wait in jax.distributed.initialize until it times out), then
#            run `python -m specjax.sample --config=$CONFIG ...` on all workers at once:
#            random weights, or with CHECKPOINT (and DRAFT_CHECKPOINT) the checkpoint
#            directories, which must be one path every worker sees (gs://bucket/...: a 70B
#            checkpoint does not fit a worker's disk, and orbax restores on every host);
#            SPECJAX_DISTRIBUTED=auto makes specjax.distributed.maybe_initialize() call
#            jax.distributed.initialize() (coordinator and ids from the TPU metadata);
#            JAX_COMPILATION_CACHE_DIR=$COMPILATION_CACHE, by default gs://BUCKET/specjax_xla_cache
#            when the weights are in gs://BUCKET (JAX writes the cache from process 0
#            only: a per-host directory would leave the other hosts recompiling each rerun);
#            process 0 writes $REMOTE_OUTPUT, the others stay quiet;
#   fetch    copy $REMOTE_OUTPUT from worker 0 to $OUTPUT;
#   delete   delete the slice.
# Without weights: random ones (Chinchilla's are not public); the timings (ms/token ArS
# vs SpS) are what that run is for, and `python -m specjax.plan --config=$CONFIG
# --chip=$GENERATION` predicts them. Real weights, in directories every worker can read:
# HF_TARGET / HF_DRAFT (Hugging Face), GGUF_TARGET / GGUF_DRAFT (GGUF files: a local
# path on every worker, as they are memory-mapped), or CHECKPOINT / DRAFT_CHECKPOINT (specjax's),
#   CONFIG=llama3_70b_1b HF_TARGET=gs://B/Llama-3.1-70B HF_DRAFT=gs://B/Llama-3.2-1B launch/tpu_pod.sh
set -euo pipefail
cd "$(dirname "$0")/.."

GENERATION=${GENERATION:-v4}
case "$GENERATION" in
  v4)  defaults=(v4-32 tpu-ubuntu2204-base us-central2-b) ;;
  v5e) defaults=(v5litepod-16 v2-alpha-tpuv5-lite us-west4-a) ;;
  v5p) defaults=(v5p-32 v2-alpha-tpuv5 us-east5-a) ;;
  v6e) defaults=(v6e-16 v2-alpha-tpuv6e us-east5-a) ;;
  *) echo "tpu_pod.sh: GENERATION=$GENERATION: allowed are v4, v5e, v5p, v6e" >&2; exit 2 ;;
esac
ACCELERATOR=${ACCELERATOR:-${defaults[0]}}
RUNTIME=${RUNTIME:-${defaults[1]}}
ZONE=${ZONE:-${defaults[2]}}
TPU_NAME=${TPU_NAME:-specjax-$ACCELERATOR}
PROJECT=${PROJECT:-}
SPOT=${SPOT:-0}                               # 1: --spot (cheaper, preemptible)
CONFIG=${CONFIG:-chinchilla_70b}
PYTHON_VERSION=${PYTHON_VERSION:-3.11}       # jax 0.10 needs >= 3.11; the TPU images have 3.10
CHECKPOINT=${CHECKPOINT:-}                   # e.g. gs://bucket/chinchilla_70b (seen by every worker)
DRAFT_CHECKPOINT=${DRAFT_CHECKPOINT:-}
# jax's version: setup.py's pin (e.g. >=0.10,<0.11), resolved with the package in one install.
JAX_SPEC=$( [ -n "${JAX_VERSION:-}" ] && echo "==$JAX_VERSION" || sed -n 's/^ *"jax\([<>=!~][^"]*\)".*/\1/p' setup.py | head -1)
[ -n "$JAX_SPEC" ] || { echo "tpu_pod.sh: no jax requirement found in setup.py" >&2; exit 2; }
STEPS=${STEPS:-create install run fetch}
REMOTE_DIR=${REMOTE_DIR:-specjax}
REMOTE_OUTPUT=${REMOTE_OUTPUT:-/tmp/specjax_${CONFIG}.jsonl}
OUTPUT=${OUTPUT:-${CONFIG}_tpu_pod.jsonl}
DRY_RUN=${DRY_RUN:-0}
# A compilation cache every worker reads: the bucket of the weights, when they are in one.
WEIGHTS_PATH=${HF_TARGET:-$CHECKPOINT}
case "$WEIGHTS_PATH" in
  gs://*) bucket=${WEIGHTS_PATH#gs://}; COMPILATION_CACHE=${COMPILATION_CACHE:-gs://${bucket%%/*}/specjax_xla_cache} ;;
  *) COMPILATION_CACHE=${COMPILATION_CACHE:-} ;;
esac

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
  local tmp tarball
  # The archive in a directory of its own: `mktemp` makes the file it names, and a
  # suffix added to that name would leave the empty file behind.
  tmp=$(mktemp -d -t specjax.XXXXXX)
  tarball=$tmp/specjax.tar.gz
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
uv pip install --python .venv/bin/python '.[gcs]' 'jax[tpu]$JAX_SPEC' -f https://storage.googleapis.com/jax-releases/libtpu_releases.html; \
.venv/bin/python -c 'import sys, importlib.metadata as m, jax, gcsfs, specjax; print(\"specjax on jax\", jax.__version__, \"libtpu\", m.version(\"libtpu\"), \"python\", sys.version.split()[0])'"
  rm -rf "$tmp"
}

# Free the TPU on a worker: end every process holding its device files (v4: /dev/accel*,
# v5e and later: /dev/vfio/*), wait for them to exit, and remove libtpu's lock file.
FREE_TPU='holders() { sudo lsof -t -w /dev/accel* /dev/vfio/[0-9]* 2>/dev/null | sort -u; };'
FREE_TPU+=' pids=$(holders); [ -z "$pids" ] || { echo "freeing the TPU from pids $pids" >&2; echo "$pids" | xargs sudo kill -9; };'
FREE_TPU+=' for i in $(seq 30); do [ -z "$(holders)" ] && break; sleep 1; done; sudo rm -f /tmp/libtpu_lockfile'

step_run() {
  local flags env=(SPECJAX_DISTRIBUTED=auto)
  flags=$(printf '%q ' "${SAMPLE_FLAGS[@]}")
  [ -n "$COMPILATION_CACHE" ] && env+=(JAX_COMPILATION_CACHE_DIR="$COMPILATION_CACHE")
  # All workers start the same command; jax.distributed.initialize() waits for all of them.
  on_all "$FREE_TPU; cd ~/$REMOTE_DIR && ${env[*]} .venv/bin/python -m specjax.sample $flags"
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
