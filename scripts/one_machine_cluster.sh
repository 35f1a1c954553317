#!/usr/bin/env bash
# A Ray cluster on this machine, to try Kiln's cluster path (docs/clusters.md, "A cluster on one
# machine"): Ray nodes on loopback, each with a home and a temporary folder of its own, and moto's
# S3 server on loopback standing in for the bucket.
#
#   scripts/one_machine_cluster.sh start      the bucket, the head (node a) and node b
#   scripts/one_machine_cluster.sh add NAME   one more node, joining the head
#   scripts/one_machine_cluster.sh stop       what start and add started, and nothing else
#
# Settings, from the environment [defaults]:
#   KILN_NODE_VENV    the node venv of "Start a cluster", with moto in it [~/kiln-node]
#   KILN_NODES        the nodes' folders and the bucket server's log [~/kiln-nodes]
#   KILN_GCS_PORT     the head's GCS [6379]
#   KILN_CLIENT_PORT  the head's Ray Client server, what Kiln submits to [10001]
#   KILN_S3_PORT      the S3 server [9000]
#   KILN_BUCKET       the bucket it makes [kiln-local]
#   KILN_RAY_ARGS     more `ray start` arguments for every node (--resources, --object-store-memory)
set -euo pipefail

venv="${KILN_NODE_VENV:-$HOME/kiln-node}"
nodes="${KILN_NODES:-$HOME/kiln-nodes}"
gcs_port="${KILN_GCS_PORT:-6379}"
client_port="${KILN_CLIENT_PORT:-10001}"
s3_port="${KILN_S3_PORT:-9000}"
bucket="${KILN_BUCKET:-kiln-local}"
# Ray's socket paths must stay under 108 bytes: a short folder in /tmp, named in $nodes.
ray_temp_file="${nodes}/ray-temp-dir"

fail() {
  echo "one_machine_cluster: $*" >&2
  exit 1
}

ray_temp_dir() {
  [[ -f "${ray_temp_file}" ]] || fail "no cluster started from ${nodes} (run: $0 start)"
  cat "${ray_temp_file}"
}

# One node: `ray start` with HOME and TMPDIR of its own under $nodes/NAME, on loopback, one CPU.
start_node() {
  local name="$1" temp_dir
  shift
  temp_dir="$(ray_temp_dir)"
  mkdir -p "${nodes}/${name}/home" "${nodes}/${name}/tmp"
  # shellcheck disable=SC2086  # KILN_RAY_ARGS is a list of arguments
  (cd "${nodes}/${name}/home" &&
    HOME="${nodes}/${name}/home" TMPDIR="${nodes}/${name}/tmp" RAY_TMPDIR="${temp_dir}" \
      RAY_USAGE_STATS_ENABLED=0 "${venv}/bin/ray" start "$@" --node-ip-address 127.0.0.1 \
      --num-cpus 1 --temp-dir "${temp_dir}" --disable-usage-stats ${KILN_RAY_ARGS:-} \
      >"${nodes}/${name}/ray-start.log" 2>&1) ||
    fail "node ${name} did not start; its log: ${nodes}/${name}/ray-start.log"
}

start_bucket() {
  "${venv}/bin/moto_server" -H 127.0.0.1 -p "${s3_port}" >"${nodes}/moto.log" 2>&1 &
  echo $! >"${nodes}/moto.pid"
  local endpoint="http://127.0.0.1:${s3_port}" tries=0
  until make_bucket "${endpoint}/${bucket}" 2>/dev/null; do
    ((++tries < 150)) || fail "no S3 server answered at ${endpoint}; its log: ${nodes}/moto.log"
    sleep 0.1
  done
}

# Whether something listens on 127.0.0.1:PORT.
answers() {
  "${venv}/bin/python" -c "import socket, sys
socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=1).close()" "$1" 2>/dev/null
}

# An unsigned PUT of the bucket's URL: moto takes it (a real S3 would not).
make_bucket() {
  "${venv}/bin/python" -c "import sys, urllib.request as r
r.urlopen(r.Request(sys.argv[1], method='PUT'), timeout=2)" "$1"
}

start() {
  [[ -x "${venv}/bin/ray" ]] || fail "no Ray in ${venv} (docs/clusters.md, \"Start a cluster\")"
  [[ -x "${venv}/bin/moto_server" ]] ||
    fail "no moto in ${venv}: ${venv}/bin/pip install 'moto[server]==5.2.5'"
  [[ ! -f "${ray_temp_file}" ]] || fail "a cluster runs from ${nodes} already (stop it: $0 stop)"
  local setting
  for setting in "KILN_S3_PORT=${s3_port}" "KILN_GCS_PORT=${gcs_port}" \
    "KILN_CLIENT_PORT=${client_port}"; do
    ! answers "${setting#*=}" ||
      fail "127.0.0.1:${setting#*=} is taken: choose another port with ${setting%=*}"
  done
  mkdir -p "${nodes}"
  mktemp -d /tmp/kray.XXXXXX >"${ray_temp_file}"
  start_bucket
  # gRPC's fork handlers off on the head: Ray Client's server forks a server per session.
  GRPC_ENABLE_FORK_SUPPORT=0 start_node a --head --port "${gcs_port}" \
    --ray-client-server-port "${client_port}" --include-dashboard false
  start_node b --address "127.0.0.1:${gcs_port}"
  cat <<EOF
A cluster of two nodes at ray://127.0.0.1:${client_port}, the bucket s3://${bucket} at
http://127.0.0.1:${s3_port}. In the shell that runs Kiln:
  export AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing AWS_DEFAULT_REGION=us-east-1 \\
      AWS_ENDPOINT_URL=http://127.0.0.1:${s3_port}
  ./pants --kiln-cluster=ray://127.0.0.1:${client_port} --kiln-prefix=s3://${bucket}/kiln \\
      run experiments:ci_tiny_2hosts
EOF
}

# The processes that name the cluster's Ray folder (nodes, workers, agents) or the venv (Ray
# Client's servers name only their Python): TERM, then KILL what is left after 3 s (a GCS and
# raylets given TERM take longer; nothing of theirs outlives the cluster).
stop() {
  local temp_dir
  temp_dir="$(ray_temp_dir)"
  if [[ -f "${nodes}/moto.pid" ]]; then
    kill "$(cat "${nodes}/moto.pid")" 2>/dev/null || true
    rm -f "${nodes}/moto.pid"
  fi
  local pattern="${temp_dir}|${venv}/bin/python" waited=0
  pkill -TERM -f -- "${pattern}" || true
  while pgrep -f -- "${pattern}" >/dev/null && ((waited++ < 30)); do sleep 0.1; done
  pkill -KILL -f -- "${pattern}" || true
  rm -rf "${temp_dir}" "${ray_temp_file}"
}

case "${1:-}" in
  start) start ;;
  add)
    [[ -n "${2:-}" ]] || fail "add needs a node name"
    start_node "$2" --address "127.0.0.1:${gcs_port}"
    ;;
  stop) stop ;;
  *) fail "usage: $0 start | add NAME | stop" ;;
esac
