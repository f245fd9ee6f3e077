#!/usr/bin/env bash
# Create a Cloud TPU VM slice: on-demand, Spot, or through a queued resource.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<USAGE
Usage: tpu_scripts/create.sh [flags]

Creates the TPU VM slice KLEAR_TPU_NAME of type KLEAR_TPU_TYPE:
  on-demand (default):  gcloud compute tpus tpu-vm create ...
  --spot:               the same with --spot (can be preempted at any time)
  --queued:             gcloud compute tpus queued-resources create ... --node-id=NAME
                        (waits in line for capacity; combine with --spot for queued Spot)
Watch a queued request with tpu_scripts/status.sh until its state is ACTIVE.

$COMMON_USAGE
USAGE
}

while (($#)); do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    *)
      parse_common_flag "$@"
      ((CONSUMED)) || die "unknown argument '$1' (see --help)"
      shift "$CONSUMED"
      ;;
  esac
done
validate_settings
require KLEAR_TPU_PROJECT KLEAR_TPU_ZONE KLEAR_TPU_NAME KLEAR_TPU_TYPE
version="$(runtime_version)"
tpu_location_flags

extra=()
[[ "$KLEAR_TPU_SPOT" == 1 ]] && extra+=(--spot)
if [[ "$KLEAR_TPU_QUEUED" == 1 ]]; then
  [[ -n "$KLEAR_TPU_VALID_UNTIL" ]] && extra+=("--valid-until-duration=$KLEAR_TPU_VALID_UNTIL")
  run gcloud compute tpus queued-resources create "$KLEAR_TPU_NAME" "${LOCATION_FLAGS[@]}" \
    "--node-id=$KLEAR_TPU_NAME" "--accelerator-type=$KLEAR_TPU_TYPE" \
    "--runtime-version=$version" "${extra[@]}"
else
  run gcloud compute tpus tpu-vm create "$KLEAR_TPU_NAME" "${LOCATION_FLAGS[@]}" \
    "--accelerator-type=$KLEAR_TPU_TYPE" "--version=$version" "${extra[@]}"
fi
