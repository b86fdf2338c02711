#!/usr/bin/env bash
# One process, N fake CPU devices (default 8): the sharded code path on a laptop.
#
#   launch/cpu_mesh.sh                                   # tiny, random weights, SpS and ArS on a 1x8 mesh
#   launch/cpu_mesh.sh -m specjax.sample --config=tiny --init=random --mesh=2x4 --prompt_tokens=1,2,3
#   DEVICES=16 launch/cpu_mesh.sh -m specjax.plan --config=chinchilla_70b   # (plan sets its own devices)
#
# Arguments are passed to `python`. XLA_FLAGS must hold the device count before JAX
# starts its CPU backend, which is why this is a wrapper and not a flag.
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICES=${DEVICES:-8}
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
if [ $# -eq 0 ]; then
  set -- -m specjax.sample --config=tiny --init=random --mesh=1x8 --mode=both \
    --prompt_tokens=1,2,3 --prompt_tokens=4,5,6,7,8 --max_new_tokens=16
fi
export JAX_PLATFORMS=cpu
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=$DEVICES"
exec "$PYTHON" "$@"
