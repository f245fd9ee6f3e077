#!/usr/bin/env bash
# Stop the job on a TPU VM slice (SIGTERM, so it saves a checkpoint) and delete the slice.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<USAGE
Usage: tpu_scripts/delete.sh [--stop-only | --no-stop] [--grace=SECONDS] [flags]

  1. stop: on every worker, send SIGTERM to the background job of run KLEAR_TPU_RUN
     (pid in ~/KLEAR_TPU_DIR/logs/RUN.pid) and wait up to --grace seconds (default 300)
     for it to write its preemption checkpoint and exit
  2. delete: the TPU VM (gcloud compute tpus tpu-vm delete), or with --queued the queued
     resource together with its node (gcloud compute tpus queued-resources delete --force)

  --stop-only   step 1 only; the slice stays (and keeps billing)
  --no-stop     step 2 only (e.g. the slice was already preempted)

$COMMON_USAGE
USAGE
}

stop=1
delete=1
grace=300
while (($#)); do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --stop-only) delete=0; shift ;;
    --no-stop) stop=0; shift ;;
    --grace=*) grace="${1#*=}"; shift ;;
    *)
      parse_common_flag "$@"
      ((CONSUMED)) || die "unknown argument '$1' (see --help)"
      shift "$CONSUMED"
      ;;
  esac
done
validate_settings
require KLEAR_TPU_PROJECT KLEAR_TPU_ZONE KLEAR_TPU_NAME
((stop + delete)) || die "--stop-only and --no-stop together leave nothing to do"
[[ "$grace" =~ ^[0-9]+$ ]] || die "--grace must be a number of seconds, got '$grace'"
tpu_location_flags

if [[ "$stop" == 1 ]]; then
  pidfile="$(shquote "$KLEAR_TPU_DIR")/logs/$KLEAR_TPU_RUN.pid"
  # shellcheck disable=SC2016  # expanded on the worker
  stop_cmd="$WORKER_ID_SNIPPET && if [ -f $pidfile ] && kill -TERM \"\$(cat $pidfile)\" 2>/dev/null; then i=0; while kill -0 \"\$(cat $pidfile)\" 2>/dev/null && [ \$i -lt $grace ]; do sleep 1; i=\$((i+1)); done; if kill -0 \"\$(cat $pidfile)\" 2>/dev/null; then echo \"worker \$W: still running after ${grace}s\" >&2; exit 1; fi; echo \"worker \$W: stopped\"; else echo \"worker \$W: no running $KLEAR_TPU_RUN job\"; fi"
  if [[ "$delete" == 1 ]]; then
    # An unreachable (e.g. preempted) slice must not block its deletion.
    on_workers all "$stop_cmd" || echo "warning: stopping the job failed; deleting anyway" >&2
  else
    on_workers all "$stop_cmd"
  fi
fi
if [[ "$delete" == 1 ]]; then
  if [[ "$KLEAR_TPU_QUEUED" == 1 ]]; then
    run gcloud compute tpus queued-resources delete "$KLEAR_TPU_NAME" "${LOCATION_FLAGS[@]}" --force --quiet
  else
    run gcloud compute tpus tpu-vm delete "$KLEAR_TPU_NAME" "${LOCATION_FLAGS[@]}" --quiet
  fi
fi
