# shellcheck shell=bash
# shellcheck disable=SC2034  # the variables set here are read by the scripts that source it
# Shared settings, flag parsing and command runner for the Cloud TPU VM scripts.
#
# Sourced by create.sh, setup.sh, run.sh, logs.sh, status.sh and delete.sh; not run alone.
# Every setting comes from an environment variable and can be overridden by a flag:
#
#   KLEAR_TPU_PROJECT   --project=ID             GCP project                      (required)
#   KLEAR_TPU_ZONE      --zone=ZONE              e.g. us-east5-a                  (required)
#   KLEAR_TPU_NAME      --name=NAME              TPU VM / queued-resource name    (required)
#   KLEAR_TPU_TYPE      --accelerator-type=T     e.g. v5p-64, v6e-64      (required by create)
#   KLEAR_TPU_BUCKET    --bucket=NAME            gs:// bucket, without gs://      (optional)
#   KLEAR_TPU_RUNTIME   --runtime-version=V      default chosen from the accelerator type
#   KLEAR_TPU_SPOT      --spot | --on-demand     1 = Spot VMs, 0 = on-demand (default 0)
#   KLEAR_TPU_QUEUED    --queued | --no-queued   1 = queued resource (default 0)
#   KLEAR_TPU_VALID_UNTIL --valid-until-duration=D  queued only: give up after D (e.g. 6h)
#   KLEAR_TPU_REPO      --repo=SRC               'local' (copy this working tree) or a
#                                                git URL to clone on every worker (default local)
#   KLEAR_TPU_REF       --ref=REF                git branch/tag/commit to check out (git only)
#   KLEAR_TPU_DIR       --remote-dir=DIR         code dir on workers, relative to $HOME
#                                                (default klear_jax)
#   KLEAR_TPU_PYTHON    --python=EXE             python on the workers (default python3.11)
#   KLEAR_TPU_RUN       --run=NAME               job name for log/pid files (default main)
#   KLEAR_TPU_PORT      --coordinator-port=P     port of the JAX coordination service on
#                                                worker 0 (default 8482, JAX's on Cloud TPU)
#   KLEAR_TPU_DRY_RUN   --dry-run                1 = print the commands, run nothing
#
# In dry-run mode every command that would run is printed on its own line, shell-quoted
# (the same quoting as Python's shlex.join), and nothing is executed.

set -euo pipefail

KLEAR_TPU_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

KLEAR_TPU_PROJECT="${KLEAR_TPU_PROJECT:-}"
KLEAR_TPU_ZONE="${KLEAR_TPU_ZONE:-}"
KLEAR_TPU_NAME="${KLEAR_TPU_NAME:-}"
KLEAR_TPU_TYPE="${KLEAR_TPU_TYPE:-}"
KLEAR_TPU_BUCKET="${KLEAR_TPU_BUCKET:-}"
KLEAR_TPU_RUNTIME="${KLEAR_TPU_RUNTIME:-}"
KLEAR_TPU_SPOT="${KLEAR_TPU_SPOT:-0}"
KLEAR_TPU_QUEUED="${KLEAR_TPU_QUEUED:-0}"
KLEAR_TPU_VALID_UNTIL="${KLEAR_TPU_VALID_UNTIL:-}"
KLEAR_TPU_REPO="${KLEAR_TPU_REPO:-local}"
KLEAR_TPU_REF="${KLEAR_TPU_REF:-}"
KLEAR_TPU_DIR="${KLEAR_TPU_DIR:-klear_jax}"
KLEAR_TPU_PYTHON="${KLEAR_TPU_PYTHON:-python3.11}"
KLEAR_TPU_RUN="${KLEAR_TPU_RUN:-main}"
KLEAR_TPU_PORT="${KLEAR_TPU_PORT:-8482}"
KLEAR_TPU_DRY_RUN="${KLEAR_TPU_DRY_RUN:-0}"

declare -A KLEAR_TPU_VALUE_FLAGS=(
  [--project]=KLEAR_TPU_PROJECT [--zone]=KLEAR_TPU_ZONE [--name]=KLEAR_TPU_NAME
  [--accelerator-type]=KLEAR_TPU_TYPE [--bucket]=KLEAR_TPU_BUCKET
  [--runtime-version]=KLEAR_TPU_RUNTIME [--valid-until-duration]=KLEAR_TPU_VALID_UNTIL
  [--repo]=KLEAR_TPU_REPO [--ref]=KLEAR_TPU_REF [--remote-dir]=KLEAR_TPU_DIR
  [--python]=KLEAR_TPU_PYTHON [--run]=KLEAR_TPU_RUN [--coordinator-port]=KLEAR_TPU_PORT
)

COMMON_USAGE='Common flags (each overrides the environment variable in brackets):
  --project=ID            GCP project                          [KLEAR_TPU_PROJECT]
  --zone=ZONE             zone, e.g. us-east5-a                [KLEAR_TPU_ZONE]
  --name=NAME             TPU VM (and queued resource) name    [KLEAR_TPU_NAME]
  --accelerator-type=T    e.g. v5p-64, v6e-64                  [KLEAR_TPU_TYPE]
  --bucket=NAME           GCS bucket, without gs://            [KLEAR_TPU_BUCKET]
  --runtime-version=V     TPU software version (default from the type) [KLEAR_TPU_RUNTIME]
  --spot | --on-demand    Spot VMs or on-demand (default)      [KLEAR_TPU_SPOT=1|0]
  --queued | --no-queued  go through a queued resource         [KLEAR_TPU_QUEUED=1|0]
  --valid-until-duration=D  queued: stop waiting after D, e.g. 6h [KLEAR_TPU_VALID_UNTIL]
  --repo=local|GIT_URL    code source for setup.sh (default local) [KLEAR_TPU_REPO]
  --ref=REF               git ref to check out (git source only) [KLEAR_TPU_REF]
  --remote-dir=DIR        code dir on workers, under home (default klear_jax) [KLEAR_TPU_DIR]
  --python=EXE            worker python (default python3.11)   [KLEAR_TPU_PYTHON]
  --run=NAME              job name for log and pid files (default main) [KLEAR_TPU_RUN]
  --coordinator-port=P    JAX coordination service port on worker 0 (default 8482) [KLEAR_TPU_PORT]
  --dry-run               print the commands, one per line, and run nothing [KLEAR_TPU_DRY_RUN=1]
  -h, --help              this help'

die() {
  echo "error: $*" >&2
  exit 2
}

# Quote one word exactly like Python's shlex.quote.
shquote() {
  local s="$1" safe='^[A-Za-z0-9_@%+=:,./-]+$' sq="'" esc="'\"'\"'"
  if [[ -z "$s" ]]; then
    printf "''"
  elif [[ "$s" =~ $safe ]]; then
    printf '%s' "$s"
  else
    printf "'%s'" "${s//$sq/$esc}"
  fi
}

# Quote and join words like Python's shlex.join.
shjoin() {
  local out="" word
  for word in "$@"; do
    out+="${out:+ }$(shquote "$word")"
  done
  printf '%s' "$out"
}

# Parse one common flag at "$1" (value in "$1" as --flag=value or in "$2").
# Sets CONSUMED to the number of words used, 0 when "$1" is not a common flag.
parse_common_flag() {
  CONSUMED=0
  local flag="${1%%=*}"
  case "$1" in
    --spot) KLEAR_TPU_SPOT=1; CONSUMED=1; return ;;
    --on-demand) KLEAR_TPU_SPOT=0; CONSUMED=1; return ;;
    --queued) KLEAR_TPU_QUEUED=1; CONSUMED=1; return ;;
    --no-queued) KLEAR_TPU_QUEUED=0; CONSUMED=1; return ;;
    --dry-run) KLEAR_TPU_DRY_RUN=1; CONSUMED=1; return ;;
  esac
  [[ -n "${KLEAR_TPU_VALUE_FLAGS[$flag]+set}" ]] || return 0
  local var="${KLEAR_TPU_VALUE_FLAGS[$flag]}"
  if [[ "$1" == *=* ]]; then
    printf -v "$var" '%s' "${1#*=}"
    CONSUMED=1
  else
    [[ $# -ge 2 ]] || die "flag $flag needs a value ($var)"
    printf -v "$var" '%s' "$2"
    CONSUMED=2
  fi
}

# require VAR... : fail naming the first unset variable and its flag.
require() {
  local var flag f
  for var in "$@"; do
    if [[ -z "${!var}" ]]; then
      flag=""
      for f in "${!KLEAR_TPU_VALUE_FLAGS[@]}"; do
        [[ "${KLEAR_TPU_VALUE_FLAGS[$f]}" == "$var" ]] && flag="$f"
      done
      die "$var is not set (export $var=... or pass $flag=...)"
    fi
  done
}

# Check the settings that are set; called after flag parsing.
validate_settings() {
  local b
  for b in KLEAR_TPU_SPOT KLEAR_TPU_QUEUED KLEAR_TPU_DRY_RUN; do
    [[ "${!b}" == 0 || "${!b}" == 1 ]] || die "$b must be 0 or 1, got '${!b}'"
  done
  if [[ -n "$KLEAR_TPU_NAME" && ! "$KLEAR_TPU_NAME" =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ ]]; then
    die "KLEAR_TPU_NAME '$KLEAR_TPU_NAME' must be lowercase letters, digits and hyphens, starting with a letter"
  fi
  if [[ -n "$KLEAR_TPU_TYPE" && ! "$KLEAR_TPU_TYPE" =~ ^v[0-9][a-z0-9]*-[0-9]+$ ]]; then
    die "KLEAR_TPU_TYPE '$KLEAR_TPU_TYPE' is not an accelerator type like v5p-64 or v6e-64"
  fi
  if [[ -n "$KLEAR_TPU_BUCKET" && ! "$KLEAR_TPU_BUCKET" =~ ^[a-z0-9][-_.a-z0-9]*[a-z0-9]$ ]]; then
    die "KLEAR_TPU_BUCKET '$KLEAR_TPU_BUCKET' must be a bare bucket name (no gs:// and no path)"
  fi
  if [[ ! "$KLEAR_TPU_DIR" =~ ^[A-Za-z0-9_][A-Za-z0-9_./-]*$ || "$KLEAR_TPU_DIR" == *..* ]]; then
    die "KLEAR_TPU_DIR '$KLEAR_TPU_DIR' must be a plain path relative to the worker's \$HOME"
  fi
  if [[ ! "$KLEAR_TPU_RUN" =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]*$ ]]; then
    die "KLEAR_TPU_RUN '$KLEAR_TPU_RUN' may hold only letters, digits, '_', '.' and '-'"
  fi
  if [[ ! "$KLEAR_TPU_PORT" =~ ^[0-9]+$ ]] || ((KLEAR_TPU_PORT < 1 || KLEAR_TPU_PORT > 65535)); then
    die "KLEAR_TPU_PORT '$KLEAR_TPU_PORT' is not a TCP port number"
  fi
  if [[ -n "$KLEAR_TPU_VALID_UNTIL" && "$KLEAR_TPU_QUEUED" != 1 ]]; then
    die "KLEAR_TPU_VALID_UNTIL only applies to queued resources (set KLEAR_TPU_QUEUED=1)"
  fi
}

# The TPU software version: KLEAR_TPU_RUNTIME, else the documented one for the generation.
runtime_version() {
  if [[ -n "$KLEAR_TPU_RUNTIME" ]]; then
    printf '%s' "$KLEAR_TPU_RUNTIME"
    return
  fi
  case "$KLEAR_TPU_TYPE" in
    v4-*) printf 'tpu-ubuntu2204-base' ;;
    v5litepod-*) printf 'v2-alpha-tpuv5-lite' ;;
    v5p-*) printf 'v2-alpha-tpuv5' ;;
    v6e-*) printf 'v2-alpha-tpuv6e' ;;
    *) die "no default runtime version for KLEAR_TPU_TYPE '$KLEAR_TPU_TYPE'; set KLEAR_TPU_RUNTIME" ;;
  esac
}

# run CMD...: print (dry run) or echo to stderr and execute.
run() {
  if [[ "$KLEAR_TPU_DRY_RUN" == 1 ]]; then
    shjoin "$@"
    printf '\n'
  else
    echo "+ $(shjoin "$@")" >&2
    "$@"
  fi
}

# Flags naming the TPU for every gcloud compute tpus call.
tpu_location_flags() {
  LOCATION_FLAGS=("--project=$KLEAR_TPU_PROJECT" "--zone=$KLEAR_TPU_ZONE")
}

# on_workers WORKERS REMOTE_SHELL_COMMAND [extra gcloud flags...]
on_workers() {
  local workers="$1" remote="$2"
  shift 2
  tpu_location_flags
  run gcloud compute tpus tpu-vm ssh "$KLEAR_TPU_NAME" "${LOCATION_FLAGS[@]}" \
    "--worker=$workers" "--command=$remote" "$@"
}

# Shell snippet, run on a worker, that sets W to its 0-based worker number.
# shellcheck disable=SC2016  # expanded on the worker, not here
WORKER_ID_SNIPPET='W=$(curl -sf -H Metadata-Flavor:Google http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number || hostname)'

# The number of TPU VM hosts (workers) of an accelerator type: v4-N / v5p-N count TensorCores
# (2 per chip, 4 chips per host), v5litepod-N / v6e-N count chips (up to 8 on one host, else
# 4 per host). Fails for other types.
hosts_of_type() {
  local gen="${1%-*}" n="${1##*-}"
  [[ "$n" =~ ^[0-9]+$ ]] || return 1
  case "$gen" in
    v4 | v5p) printf '%s' $((n > 8 ? n / 8 : 1)) ;;
    v5litepod | v6e) printf '%s' $((n > 8 ? n / 4 : 1)) ;;
    *) return 1 ;;
  esac
}

# Shell snippet, run on a worker after WORKER_ID_SNIPPET: the multi-host settings of
# klear_jax.sharding.initialize_distributed, from the metadata server as JAX's own Cloud TPU
# detection reads them: KLEAR_PROCESS_ID = the worker number, KLEAR_NUM_PROCESSES = the number
# of worker-network-endpoints, KLEAR_COORDINATOR = the first endpoint's address (worker 0;
# endpoints read "name:id:ip" or "host") and KLEAR_TPU_PORT. Values already set in the
# environment win; on a single-host slice nothing is exported.
# shellcheck disable=SC2016  # expanded on the worker, not here
MULTIHOST_SNIPPET='if E=$(curl -sf -H Metadata-Flavor:Google http://metadata.google.internal/computeMetadata/v1/instance/attributes/worker-network-endpoints) && [ "${E#*,}" != "$E" ]; then C=${E%%,*}; export KLEAR_COORDINATOR="${KLEAR_COORDINATOR:-${C##*:}:__PORT__}" KLEAR_NUM_PROCESSES="${KLEAR_NUM_PROCESSES:-$(($(printf %s "$E" | tr -cd , | wc -c) + 1))}" KLEAR_PROCESS_ID="${KLEAR_PROCESS_ID:-$W}"; fi'

# multihost_snippet: MULTIHOST_SNIPPET with the coordinator port filled in.
multihost_snippet() {
  printf '%s' "${MULTIHOST_SNIPPET//__PORT__/$KLEAR_TPU_PORT}"
}
