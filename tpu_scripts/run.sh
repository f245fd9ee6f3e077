#!/usr/bin/env bash
# Run one command on every worker of a TPU VM slice at once, logging per worker.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<USAGE
Usage: tpu_scripts/run.sh [--background] [--worker=all|N|N-M] [flags] -- COMMAND [ARGS...]

Runs COMMAND on every worker of KLEAR_TPU_NAME simultaneously (a multi-host JAX job
must start on all hosts), inside ~/KLEAR_TPU_DIR with its .venv active. COMMAND's
words are passed through quoted, exactly as given here. Each worker appends its
output to ~/KLEAR_TPU_DIR/logs/RUN.worker<N>.log (RUN = KLEAR_TPU_RUN, default main).
On a multi-host slice each worker exports, from its metadata server, the settings of
klear_jax.sharding.initialize_distributed: KLEAR_COORDINATOR=<worker 0 address>:PORT
(KLEAR_TPU_PORT, default 8482), KLEAR_NUM_PROCESSES=<workers>, KLEAR_PROCESS_ID=<N>.
With --dry-run, after the gcloud command, one '# worker N: ...' line per worker shows
the command that worker runs (all workers when KLEAR_TPU_TYPE is known).

  (default)      foreground: output of all workers streams here (tee to the log file);
                 the job ends if this ssh session ends
  --background   nohup: the job survives disconnects; its pid goes to logs/RUN.pid
                 (delete.sh sends it SIGTERM). Follow it with tpu_scripts/logs.sh --follow.
  --worker=W     target workers (default all)

Example:
  tpu_scripts/run.sh --background -- python -m klear_jax.rl \\
    --config=configs/gppo_math_qwen3_8b.py \\
    --config.workdir="gs://\$KLEAR_TPU_BUCKET/runs/\$KLEAR_TPU_NAME"

$COMMON_USAGE
USAGE
}

background=0
workers=all
cmd=()
while (($#)); do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --background) background=1; shift ;;
    --worker=*) workers="${1#*=}"; shift ;;
    --) shift; cmd=("$@"); break ;;
    *)
      parse_common_flag "$@"
      ((CONSUMED)) || die "unknown argument '$1' (put the command after --; see --help)"
      shift "$CONSUMED"
      ;;
  esac
done
validate_settings
require KLEAR_TPU_PROJECT KLEAR_TPU_ZONE KLEAR_TPU_NAME
((${#cmd[@]})) || die "no command given: tpu_scripts/run.sh [flags] -- COMMAND [ARGS...]"
[[ "$workers" =~ ^(all|[0-9]+([-,][0-9]+)*)$ ]] || die "--worker must be all, N, N-M or N,M, got '$workers'"

run_name="$KLEAR_TPU_RUN"
job="$(shjoin "${cmd[@]}")"
# shellcheck disable=SC2016  # $W, $? and $! expand on the worker
prefix="cd $(shquote "$KLEAR_TPU_DIR") && mkdir -p logs && . .venv/bin/activate && $WORKER_ID_SNIPPET && $(multihost_snippet)"
log="logs/$run_name.worker\$W.log"
pidfile="logs/$run_name.pid"
hosts="\${KLEAR_COORDINATOR:+KLEAR_COORDINATOR=\$KLEAR_COORDINATOR KLEAR_NUM_PROCESSES=\$KLEAR_NUM_PROCESSES KLEAR_PROCESS_ID=\$KLEAR_PROCESS_ID }"
header="echo \"=== \$(date -u +%FT%TZ) $run_name on worker \$W: $hosts\"$(shquote "$job") >> $log"
if [[ "$background" == 1 ]]; then
  busy="if [ -f $pidfile ] && kill -0 \"\$(cat $pidfile)\" 2>/dev/null; then echo \"run $run_name is already running on worker \$W (pid \$(cat $pidfile))\" >&2; exit 1; fi"
  remote="$prefix && { $busy; } && $header && { nohup bash -c $(shquote "exec $job") >> $log 2>&1 < /dev/null & echo \$! > $pidfile; } && echo \"worker \$W: started pid \$(cat $pidfile), log ~/$KLEAR_TPU_DIR/$log\""
else
  remote="set -o pipefail && $prefix && $header && { $job; } 2>&1 | tee -a $log"
fi
on_workers "$workers" "$remote"

# Dry run: the command each worker runs, with the multi-host settings it exports (in
# ~/KLEAR_TPU_DIR with .venv active; output appended to logs/RUN.worker<N>.log).
if [[ "$KLEAR_TPU_DRY_RUN" == 1 ]]; then
  n=$(hosts_of_type "$KLEAR_TPU_TYPE" 2>/dev/null) || n=""
  ids=()
  if [[ "$workers" != all ]]; then
    IFS=, read -ra parts <<<"$workers"
    for p in "${parts[@]}"; do
      for ((w = ${p%-*}; w <= ${p#*-}; w++)); do ids+=("$w"); done
    done
  elif [[ -n "$n" ]]; then
    for ((w = 0; w < n; w++)); do ids+=("$w"); done
  else
    ids=("<N>")  # the worker count is not known here without KLEAR_TPU_TYPE
  fi
  for w in "${ids[@]}"; do
    envs=""
    if [[ "$n" != 1 ]]; then
      envs="KLEAR_COORDINATOR=$(shquote "<worker 0 address>:$KLEAR_TPU_PORT") KLEAR_NUM_PROCESSES=$(shquote "${n:-<workers>}") KLEAR_PROCESS_ID=$(shquote "$w") "
    fi
    printf '# worker %s: %s%s\n' "$w" "$envs" "$job"
  done
fi
