#!/usr/bin/env bash
# Train on every worker (host) of one Cloud TPU VM slice, one process per host.
# Usage: TPU_NAME=my-tpu ZONE=us-west4-a launch/tpu_vm.sh CONFIG WORKDIR [ao-mdm train flags...]
# Copies this checkout (tracked and untracked, not ignored files) to all workers, installs it
# with the [tpu] extra into ~/ao_mdm_venv and runs the same `ao-mdm train` on each; the
# coordinator, process count and id come from the TPU VM metadata server.
# Env: TPU_NAME, ZONE (required); PROJECT; PYTHON (Python 3.11 on the VMs, default python3.11);
#      COORDINATOR_PORT (default 8476); DETACH=1 keeps training after ssh exits (log in
#      ~/ao_mdm_train.log). WORKDIR must be shared by all hosts: a gs:// bucket.
set -euo pipefail

metadata() {
  curl -sf -H Metadata-Flavor:Google \
    "http://metadata.google.internal/computeMetadata/v1/instance/attributes/$1"
}

if [[ ${1:-} == --on-worker ]]; then  # this part runs on each TPU VM host
  shift
  cd "$(dirname "$0")/.."
  "${PYTHON:-python3.11}" -m venv ~/ao_mdm_venv
  ~/ao_mdm_venv/bin/pip install -q -e '.[tpu]'
  endpoints=$(metadata worker-network-endpoints)  # "host,..." or "name:id:ip,..."
  n=$(tr ',' '\n' <<< "$endpoints" | wc -l)
  flags=()
  if (( n > 1 )); then
    head=$(cut -d, -f1 <<< "$endpoints" | awk -F: '{print $NF}')
    flags=(--coordinator="$head:${COORDINATOR_PORT:-8476}" --num_processes="$n"
           --process_id="$(metadata agent-worker-number)")
  fi
  if [[ ${DETACH:-0} == 1 ]]; then
    nohup ~/ao_mdm_venv/bin/ao-mdm train "$@" "${flags[@]}" < /dev/null > ~/ao_mdm_train.log 2>&1 &
  else
    exec ~/ao_mdm_venv/bin/ao-mdm train "$@" "${flags[@]}"
  fi
  exit 0
fi

: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}"
if (( $# < 2 )); then
  echo "usage: TPU_NAME=... ZONE=... $0 CONFIG WORKDIR [ao-mdm train flags...]" >&2
  exit 2
fi
config=$1 workdir=$2
shift 2
gcloud_flags=(--zone="$ZONE" --worker=all)
[[ -n ${PROJECT:-} ]] && gcloud_flags+=(--project="$PROJECT")
cd "$(dirname "$0")/.."
tarball=$(mktemp /tmp/ao_mdm.XXXXXX.tar.gz)
trap 'rm -f "$tarball"' EXIT
git ls-files -z --cached --others --exclude-standard | tar czf "$tarball" --null -T -
gcloud compute tpus tpu-vm scp "$tarball" "$TPU_NAME:ao_mdm.tar.gz" "${gcloud_flags[@]}"
args=$(printf ' %q' --config="$config" --workdir="$workdir" "$@")
gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${gcloud_flags[@]}" --command="\
rm -rf ~/ao_mdm && mkdir ~/ao_mdm && tar xzf ~/ao_mdm.tar.gz -C ~/ao_mdm && \
PYTHON=${PYTHON:-python3.11} COORDINATOR_PORT=${COORDINATOR_PORT:-8476} DETACH=${DETACH:-0} \
bash ~/ao_mdm/launch/tpu_vm.sh --on-worker$args"
