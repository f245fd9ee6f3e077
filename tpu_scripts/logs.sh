#!/usr/bin/env bash
# Collect (or follow) the per-worker logs that run.sh writes.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<USAGE
Usage: tpu_scripts/logs.sh [--out=DIR] [--tail=N] [--follow [--worker=N]] [--gcs] [flags]

Logs of run KLEAR_TPU_RUN (default main) live on each worker in
~/KLEAR_TPU_DIR/logs/RUN.worker<N>.log.
  (default)      copy every worker's log here: DIR/<worker>.log, DIR defaults to
                 tpu_logs/NAME/RUN (uses gcloud's per-worker --output-directory)
  --tail=N       only the last N lines of each log
  --follow       stream one worker's log (tail -F), worker 0 unless --worker=N
  --gcs          instead, have every worker upload its log to
                 gs://KLEAR_TPU_BUCKET/runs/NAME/logs/

$COMMON_USAGE
USAGE
}

out=""
tail_n=""
follow=0
gcs=0
worker=0
while (($#)); do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --out=*) out="${1#*=}"; shift ;;
    --tail=*) tail_n="${1#*=}"; shift ;;
    --follow) follow=1; shift ;;
    --worker=*) worker="${1#*=}"; shift ;;
    --gcs) gcs=1; shift ;;
    *)
      parse_common_flag "$@"
      ((CONSUMED)) || die "unknown argument '$1' (see --help)"
      shift "$CONSUMED"
      ;;
  esac
done
validate_settings
require KLEAR_TPU_PROJECT KLEAR_TPU_ZONE KLEAR_TPU_NAME
[[ -z "$tail_n" || "$tail_n" =~ ^[0-9]+$ ]] || die "--tail must be a number of lines, got '$tail_n'"
[[ "$worker" =~ ^[0-9]+$ ]] || die "--worker must be one worker number, got '$worker'"
((follow + gcs <= 1)) || die "--follow and --gcs do not combine"

logs="$(shquote "$KLEAR_TPU_DIR")/logs/$KLEAR_TPU_RUN.worker*.log"
if [[ "$follow" == 1 ]]; then
  on_workers "$worker" "tail -n ${tail_n:-100} -F $logs"
elif [[ "$gcs" == 1 ]]; then
  require KLEAR_TPU_BUCKET
  on_workers all "gcloud storage cp $logs $(shquote "gs://$KLEAR_TPU_BUCKET/runs/$KLEAR_TPU_NAME/logs/")"
else
  out="${out:-tpu_logs/$KLEAR_TPU_NAME/$KLEAR_TPU_RUN}"
  run mkdir -p "$out"
  if [[ -n "$tail_n" ]]; then
    on_workers all "tail -n $tail_n $logs" "--output-directory=$out"
  else
    on_workers all "cat $logs" "--output-directory=$out"
  fi
fi
