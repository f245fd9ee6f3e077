#!/usr/bin/env bash
# Show the state of a TPU VM slice (and its queued resource), optionally of the job on it.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<USAGE
Usage: tpu_scripts/status.sh [--jobs] [flags]

Describes the queued resource KLEAR_TPU_NAME (with --queued; its state goes
WAITING_FOR_RESOURCES -> PROVISIONING -> ACTIVE) and the TPU VM KLEAR_TPU_NAME
(state READY once it can run jobs; PREEMPTED for a reclaimed Spot slice).
  --jobs   also ask every worker whether run KLEAR_TPU_RUN is alive, with its last log lines

$COMMON_USAGE
USAGE
}

jobs=0
while (($#)); do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --jobs) jobs=1; shift ;;
    *)
      parse_common_flag "$@"
      ((CONSUMED)) || die "unknown argument '$1' (see --help)"
      shift "$CONSUMED"
      ;;
  esac
done
validate_settings
require KLEAR_TPU_PROJECT KLEAR_TPU_ZONE KLEAR_TPU_NAME
tpu_location_flags

if [[ "$KLEAR_TPU_QUEUED" == 1 ]]; then
  run gcloud compute tpus queued-resources describe "$KLEAR_TPU_NAME" "${LOCATION_FLAGS[@]}"
  # The node only exists once the queued request is provisioned.
  run gcloud compute tpus tpu-vm describe "$KLEAR_TPU_NAME" "${LOCATION_FLAGS[@]}" \
    || echo "(no TPU VM $KLEAR_TPU_NAME yet)" >&2
else
  run gcloud compute tpus tpu-vm describe "$KLEAR_TPU_NAME" "${LOCATION_FLAGS[@]}"
fi
if [[ "$jobs" == 1 ]]; then
  d="$(shquote "$KLEAR_TPU_DIR")"
  pidfile="$d/logs/$KLEAR_TPU_RUN.pid"
  # shellcheck disable=SC2016  # expanded on the worker
  on_workers all "$WORKER_ID_SNIPPET && if [ -f $pidfile ] && kill -0 \"\$(cat $pidfile)\" 2>/dev/null; then echo \"worker \$W: $KLEAR_TPU_RUN running (pid \$(cat $pidfile))\"; else echo \"worker \$W: $KLEAR_TPU_RUN not running\"; fi && tail -n 3 $d/logs/$KLEAR_TPU_RUN.worker*.log 2>/dev/null || true"
fi
