#!/bin/bash
# Train resilient_jax on every worker (host) of a Cloud TPU VM slice, one process per host.
#
# Usage: TPU_NAME=my-slice ZONE=us-east5-a WORKDIR=/mnt/shared/runs/gpt \
#          launch/tpu/train.sh [--config.KEY=VALUE ...]
# Run it from any machine with gcloud; see usage() for all settings. Arguments are passed to
# launch.train unchanged. The workers find each other through JAX's TPU VM detection
# (jax.distributed.initialize() with no arguments reads the worker list and this worker's index
# from the VM metadata; the coordinator is worker 0, port 8482). Each host's process drives all
# its chips and holds DP*PP / HOSTS workers of TP chips each (tensor parallelism inside the host):
# DP * PP * TP must equal HOSTS * CHIPS_PER_HOST, the slice's shape (launch/CLUSTERS.md); the
# script checks that before it starts anything.
#
# If process 0 (the coordination service) is lost, the other processes exit with code 5 and this
# script starts the run again on all workers (up to MAX_RESTARTS times); it resumes from the
# survivors' local copies of the last committed step (WORKDIR/local) or the newest checkpoint in
# WORKDIR/checkpoints, so WORKDIR must be a shared mount (e.g. Filestore or a
# gcsfuse bucket) with the same path on every worker.
set -euo pipefail

usage() {
  cat <<USAGE
Usage: TPU_NAME=NAME ZONE=ZONE WORKDIR=DIR $0 [--config.KEY=VALUE ...]

Runs 'python -m launch.train --config.distributed.enabled=true ...' on all workers of a TPU VM
slice through 'gcloud compute tpus tpu-vm ssh --worker=all', and runs it again while any worker
exits with code 5 (coordinator lost; the run resumes from WORKDIR/checkpoints).

Required:
  TPU_NAME      name of the TPU VM (slice)
  ZONE          its zone
  WORKDIR       run directory on storage shared by all workers, same path everywhere
Optional:
  PROJECT       gcloud project (default: gcloud's configured project)
  REPO_DIR      checkout on the workers, relative to the home directory or absolute
                (default: resilient_jax)
  REPO_URL      git URL to clone into REPO_DIR where it is missing (default: none)
  GIT_REF       commit/branch to check out before each start (default: leave as is)
  INSTALL       1: pip install the checkout and PIP_EXTRA before each start, 0: skip (default: 1)
  PIP_EXTRA     extra pip requirement (default: 'jax[tpu]>=0.10,<0.11')
  PYTHON        python on the workers (default: python3)
  CONFIG        config file, relative to REPO_DIR (default: configs/gpt_tiny.py)
  HOSTS         TPU VM hosts (workers) in the slice (default: 2, e.g. v4-16 or v5p-16)
  CHIPS_PER_HOST  chips each host drives (default: 4)
  DP, PP, TP    mesh; DP * PP * TP = HOSTS * CHIPS_PER_HOST (default: 2, 2, 2; TP chips per
                worker, which split its stage's blocks)
  CKPT_EVERY    steps between checkpoints (default: 50)
  HEARTBEAT_TIMEOUT_S  seconds until a silent process counts as dead (default: 10)
  MAX_RESTARTS  restarts after exit code 5 (default: 10)
  RESTART_DELAY_S      seconds to wait before a restart (default: 30)
  LOG_DIR       local directory for the output of each attempt (default: a new temp dir)
USAGE
}

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  usage
  exit 0
fi
missing=()
for var in TPU_NAME ZONE WORKDIR; do
  [[ -n "${!var:-}" ]] || missing+=("$var")
done
if ((${#missing[@]})); then
  usage >&2
  echo "error: set ${missing[*]}" >&2
  exit 2
fi

PROJECT="${PROJECT:-}"
REPO_DIR="${REPO_DIR:-resilient_jax}"
REPO_URL="${REPO_URL:-}"
GIT_REF="${GIT_REF:-}"
INSTALL="${INSTALL:-1}"
PIP_EXTRA="${PIP_EXTRA:-jax[tpu]>=0.10,<0.11}"
PYTHON="${PYTHON:-python3}"
CONFIG="${CONFIG:-configs/gpt_tiny.py}"
HOSTS="${HOSTS:-2}"
CHIPS_PER_HOST="${CHIPS_PER_HOST:-4}"
DP="${DP:-2}"
PP="${PP:-2}"
TP="${TP:-2}"
CKPT_EVERY="${CKPT_EVERY:-50}"
HEARTBEAT_TIMEOUT_S="${HEARTBEAT_TIMEOUT_S:-10}"
MAX_RESTARTS="${MAX_RESTARTS:-10}"
RESTART_DELAY_S="${RESTART_DELAY_S:-30}"
LOG_DIR="${LOG_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/resilient_jax_tpu.XXXXXX")}"
PIDFILE="${PIDFILE:-/tmp/resilient_jax_train.pid}"  # on each worker
EXIT_MARK="RESILIENT_JAX_EXIT"

if ((DP * PP * TP != HOSTS * CHIPS_PER_HOST)); then
  echo "error: DP * PP * TP = $DP * $PP * $TP must equal HOSTS * CHIPS_PER_HOST =" \
    "$HOSTS * $CHIPS_PER_HOST" \
    "(one process per host drives all its chips; see launch/CLUSTERS.md)" >&2
  exit 2
fi

train_args=(
  -m launch.train
  --config="$CONFIG"
  --workdir="$WORKDIR"
  --config.mesh.dp="$DP"
  --config.mesh.pp="$PP"
  --config.mesh.tp="$TP"
  --config.checkpoint.every_steps="$CKPT_EVERY"
  --config.distributed.enabled=true
  --config.distributed.heartbeat_timeout_s="$HEARTBEAT_TIMEOUT_S"
  "$@"
)

# The command each worker runs (POSIX sh, whatever the login shell). It prints one marker line
# with the trainer's exit code: gcloud itself only returns the first failing worker's code.
q() { printf '%q' "$1"; }
remote="set -u
if [ ! -d $(q "$REPO_DIR") ]; then"
if [[ -n "$REPO_URL" ]]; then
  remote+="
  git clone -q $(q "$REPO_URL") $(q "$REPO_DIR") || exit 1"
else
  remote+="
  echo \"no checkout at $(q "$REPO_DIR") on \$(hostname); set REPO_URL\" >&2; exit 1"
fi
remote+="
fi
cd $(q "$REPO_DIR") || exit 1"
if [[ -n "$GIT_REF" ]]; then
  remote+="
git fetch -q && git checkout -q $(q "$GIT_REF") || exit 1"
fi
if [[ "$INSTALL" == 1 ]]; then
  remote+="
$(q "$PYTHON") -m pip install -q -e . $(q "$PIP_EXTRA") || exit 1"
fi
remote+="
old=\$(cat $(q "$PIDFILE") 2>/dev/null || true)
if [ -n \"\$old\" ] && ps -p \"\$old\" -o args= 2>/dev/null | grep -q launch.train; then
  echo \"stopping trainer \$old left from an earlier attempt on \$(hostname)\" >&2
  kill \"\$old\"; sleep 5; kill -9 \"\$old\" 2>/dev/null || true
fi
$(q "$PYTHON")$(printf ' %q' "${train_args[@]}") &
pid=\$!
echo \"\$pid\" > $(q "$PIDFILE")
wait \"\$pid\"
rc=\$?
rm -f $(q "$PIDFILE")
echo \"$EXIT_MARK host=\$(hostname) rc=\$rc\"
exit \"\$rc\""

gcloud_args=(compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all)
if [[ -n "$PROJECT" ]]; then
  gcloud_args+=(--project "$PROJECT")
fi

mkdir -p "$LOG_DIR"
attempt=0
while true; do
  log="$LOG_DIR/attempt-$attempt.log"
  echo "attempt $attempt on $TPU_NAME (log: $log)" >&2
  set +e
  gcloud "${gcloud_args[@]}" --command "$remote" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  set -e
  if ! grep -Eq "^$EXIT_MARK .* rc=5\$" "$log"; then
    echo "finished: gcloud exit code $rc" >&2
    exit "$rc"
  fi
  if ((attempt >= MAX_RESTARTS)); then
    echo "coordinator lost (exit code 5) and MAX_RESTARTS=$MAX_RESTARTS reached; giving up" >&2
    exit 5
  fi
  attempt=$((attempt + 1))
  echo "coordinator lost (exit code 5): restart $attempt/$MAX_RESTARTS in ${RESTART_DELAY_S}s," \
    "resuming from $WORKDIR/checkpoints" >&2
  sleep "$RESTART_DELAY_S"
done
