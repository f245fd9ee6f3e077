#!/usr/bin/env bash
# Set up every worker of a TPU VM slice: code, bubblewrap, a venv with the TPU requirements.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<USAGE
Usage: tpu_scripts/setup.sh [--code-only] [--no-check] [flags]

On every worker of KLEAR_TPU_NAME (all at once, --worker=all):
  1. code: KLEAR_TPU_REPO=local (default) packs this working tree (git-tracked and
     untracked-but-not-ignored files), copies it with 'gcloud compute tpus tpu-vm scp
     --worker=all' and unpacks it into ~/KLEAR_TPU_DIR; KLEAR_TPU_REPO=<git URL> clones
     it there (or fetches) and checks out KLEAR_TPU_REF (default origin/HEAD).
  2. apt-get install bubblewrap (the code-reward sandbox), git, KLEAR_TPU_PYTHON + venv.
  3. KLEAR_TPU_PYTHON -m venv .venv; pip install -r requirements-tpu.txt
     (requirements.txt plus jax[tpu], which brings libtpu).
  4. if KLEAR_TPU_BUCKET is set, check that the workers can list gs://KLEAR_TPU_BUCKET.
  5. print each worker's jax process index, local and global device counts.

  --code-only   only step 1 (re-sync code after an edit); the venv is kept
  --no-check    skip step 5

$COMMON_USAGE
USAGE
}

code_only=0
check=1
while (($#)); do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --code-only) code_only=1; shift ;;
    --no-check) check=0; shift ;;
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
dir="$KLEAR_TPU_DIR"
qdir="$(shquote "$dir")"
steps=()

if [[ "$KLEAR_TPU_REPO" == local ]]; then
  archive="${TMPDIR:-/tmp}/klear_jax-src-$KLEAR_TPU_NAME.tar.gz"
  remote_archive="klear_jax-src.tar.gz"
  list=(git -C "$KLEAR_TPU_ROOT" ls-files -z --cached --others --exclude-standard)
  pack=(tar -C "$KLEAR_TPU_ROOT" --null --ignore-failed-read -T - -czf "$archive")
  if [[ "$KLEAR_TPU_DRY_RUN" == 1 ]]; then
    echo "$(shjoin "${list[@]}") | $(shjoin "${pack[@]}")"
  else
    git -C "$KLEAR_TPU_ROOT" rev-parse --git-dir > /dev/null 2>&1 \
      || die "KLEAR_TPU_REPO=local needs $KLEAR_TPU_ROOT to be a git checkout"
    echo "+ $(shjoin "${list[@]}") | $(shjoin "${pack[@]}")" >&2
    "${list[@]}" | "${pack[@]}"
  fi
  run gcloud compute tpus tpu-vm scp "$archive" "$KLEAR_TPU_NAME:$remote_archive" \
    "${LOCATION_FLAGS[@]}" --worker=all
  steps+=("mkdir -p $qdir" "tar -xzf $remote_archive -C $qdir" "rm -f $remote_archive")
else
  ref="${KLEAR_TPU_REF:-origin/HEAD}"
  steps+=("{ [ -d $qdir/.git ] || git clone -q $(shquote "$KLEAR_TPU_REPO") $qdir; }"
    "git -C $qdir fetch -q --tags origin"
    "git -C $qdir checkout -q --detach $(shquote "$ref")")
fi

if [[ "$code_only" == 0 ]]; then
  py="$(shquote "$KLEAR_TPU_PYTHON")"
  packages="bubblewrap git"
  if [[ "$KLEAR_TPU_PYTHON" =~ ^python3\.[0-9]+$ ]]; then
    packages+=" $KLEAR_TPU_PYTHON $KLEAR_TPU_PYTHON-venv"
  fi
  apt="sudo DEBIAN_FRONTEND=noninteractive apt-get -q -o DPkg::Lock::Timeout=600"
  steps=("$apt update" "$apt install -y $packages" "${steps[@]}"
    "cd $qdir"
    "{ [ -x .venv/bin/python ] || $py -m venv .venv; }"
    ".venv/bin/python -m pip install -q --upgrade pip"
    ".venv/bin/python -m pip install -q -r requirements-tpu.txt"
    "bwrap --version")
  if [[ -n "$KLEAR_TPU_BUCKET" ]]; then
    steps+=("gcloud storage ls $(shquote "gs://$KLEAR_TPU_BUCKET") > /dev/null")
  fi
  if [[ "$check" == 1 ]]; then
    steps+=(".venv/bin/python -c 'import jax; print(\"process\", jax.process_index(), \"local devices\", jax.local_device_count(), \"global devices\", jax.device_count())'")
  fi
fi

remote=""
for step in "${steps[@]}"; do
  remote+="${remote:+ && }$step"
done
on_workers all "$remote"
