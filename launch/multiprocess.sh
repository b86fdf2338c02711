#!/usr/bin/env bash
# Several JAX processes on this machine, joined with jax.distributed.initialize over
# 127.0.0.1 (CPU collectives via gloo): the multi-host code path without a pod.
#
#   launch/multiprocess.sh                         # greedy tokens of `tiny`, 2 processes x 4 devices, mesh 2x4
#   launch/multiprocess.sh launch/greedy_tokens.py --config=tiny --mesh=1x8
#   NUM_PROCESSES=2 LOCAL_DEVICES=4 launch/multiprocess.sh -m specjax.sample --config=tiny --init=random \
#       --mesh=1x8 --prompt_tokens=1,2,3 --max_new_tokens=16
#
# Arguments after the script name are passed to `python` in every process. Each process
# gets SPECJAX_COORDINATOR / SPECJAX_NUM_PROCESSES / SPECJAX_PROCESS_ID (read by
# specjax.distributed.maybe_initialize) and LOCAL_DEVICES fake CPU devices. Process i
# logs to $LOG_DIR/process_i.log; process 0 also streams to this terminal. Exits with
# the first non-zero status.
set -euo pipefail
cd "$(dirname "$0")/.."

NUM_PROCESSES=${NUM_PROCESSES:-2}
LOCAL_DEVICES=${LOCAL_DEVICES:-4}
PORT=${PORT:-$(( 20000 + RANDOM % 20000 ))}
LOG_DIR=${LOG_DIR:-$(mktemp -d)}
mkdir -p "$LOG_DIR"
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
if [ $# -eq 0 ]; then
  set -- launch/greedy_tokens.py --config=tiny --mesh=2x4
fi

pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; }
trap cleanup EXIT INT TERM

for (( i = 0; i < NUM_PROCESSES; i++ )); do
  SPECJAX_COORDINATOR=127.0.0.1:$PORT SPECJAX_NUM_PROCESSES=$NUM_PROCESSES SPECJAX_PROCESS_ID=$i \
  JAX_PLATFORMS=cpu XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=$LOCAL_DEVICES" \
    "$PYTHON" "$@" > "$LOG_DIR/process_$i.log" 2>&1 &
  pids+=($!)
done
echo "started $NUM_PROCESSES processes (pids ${pids[*]}), coordinator 127.0.0.1:$PORT, logs in $LOG_DIR" >&2
tail -n +1 -f "$LOG_DIR/process_0.log" --pid="${pids[0]}" &
tailer=$!

status=0
for (( i = 0; i < NUM_PROCESSES; i++ )); do
  rc=0
  wait "${pids[$i]}" || rc=$?
  if [ $rc -ne 0 ]; then
    echo "process $i exited with status $rc; its log: $LOG_DIR/process_$i.log" >&2
    tail -n 20 "$LOG_DIR/process_$i.log" >&2
    [ $status -eq 0 ] && status=$rc
    cleanup  # the others would wait for the dead one forever
  fi
done
wait "$tailer" 2>/dev/null || true
pids=()
exit $status
