#!/usr/bin/env bash
# Proves that the remote cache serves a clean machine: starts BuildGrid on loopback, packages the
# tiny CI checkpoint (tokenization + training, all cached processes) with remote cache writes into
# one empty local store, then again into another empty local store, and fails unless the
# training was served from the remote cache rather than rerun (--stats-log, process log).
set -euo pipefail
cd "$(dirname "$0")/.."

TARGET="experiments:ci_tiny"
TRAINING="Training checkpoints/ci_tiny@"
# One venv per pinned requirements file: editing the pins installs afresh.
BUILDGRID_PINS="$(sha256sum .ci/buildgrid-requirements.txt | cut -c1-12)"
BUILDGRID_VENV="${KILN_BUILDGRID_VENV:-${HOME}/.cache/kiln/buildgrid-${BUILDGRID_PINS}}"
WORK="$(mktemp -d)"
trap 'kill "${BGD_PID:-}" 2>/dev/null || true; [[ -n "${KILN_KEEP_CACHE_CHECK:-}" ]] || rm -rf "${WORK}"' EXIT

say() { echo "remote_cache_check: [${SECONDS} s] $*"; }  # seconds since the check started

find_python311() {
  local candidate
  for candidate in "${PYENV_ROOT:-${HOME}/.pyenv}"/versions/3.11*/bin/python3.11 \
    /usr/bin/python3.11 "$(command -v python3.11 || true)"; do
    [[ -x "${candidate}" ]] && "${candidate}" -c 'import sys' 2>/dev/null && { echo "${candidate}"; return; }
  done
  echo "remote_cache_check: BuildGrid 0.1.21 needs CPython 3.11; none found." >&2
  exit 1
}

if [[ ! -x "${BUILDGRID_VENV}/bin/bgd" ]]; then
  say "installing BuildGrid (.ci/buildgrid-requirements.txt) into ${BUILDGRID_VENV}"
  rm -rf "${BUILDGRID_VENV}"
  "$(find_python311)" -m venv "${BUILDGRID_VENV}"
  PIP_CONFIG_FILE=/dev/null "${BUILDGRID_VENV}/bin/pip" install --quiet \
    -r .ci/buildgrid-requirements.txt
fi

PORT="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
sed -e "s|@PORT@|${PORT}|" -e "s|@STORAGE@|${WORK}/cas|" .ci/buildgrid.yml >"${WORK}/buildgrid.yml"
"${BUILDGRID_VENV}/bin/bgd" server start "${WORK}/buildgrid.yml" >"${WORK}/bgd.log" 2>&1 &
BGD_PID=$!
for _ in $(seq 60); do
  python3 -c "import socket; socket.create_connection(('127.0.0.1', ${PORT}), 1)" 2>/dev/null && break
  sleep 0.5
done

pants_with_remote_cache() {
  local store="$1"
  shift
  ./pants --no-pantsd --pants-config-files="['pants.toml','pants.remote-cache.toml']" \
    --remote-store-address="grpc://127.0.0.1:${PORT}" --local-store-dir="${store}" \
    --stats-log "$@"
}

say "packaging ${TARGET} with remote cache writes"
pants_with_remote_cache "${WORK}/store-writer" package "${TARGET}" >"${WORK}/writer.log" 2>&1 ||
  { cat "${WORK}/writer.log"; exit 1; }
say "packaging it again from an empty local store"
pants_with_remote_cache "${WORK}/store-reader" package "${TARGET}" >"${WORK}/reader.log" 2>&1 ||
  { cat "${WORK}/reader.log"; exit 1; }

counter() { grep -E "^\s+$1: [0-9]+" "${WORK}/reader.log" | awk '{print $2}' | tail -1; }
served="$(counter remote_cache_requests_cached)"
executed="$(counter local_execution_requests)"
say "remote cache hits ${served:-0}, local executions ${executed:-0}"
# With a remote cache Pants starts a process while it looks the key up and cancels it on a hit:
# only a "Completed" training line means it ran.
if [[ "${served:-0}" -lt 1 ]] || grep -q "Completed: ${TRAINING}" "${WORK}/reader.log"; then
  echo "remote_cache_check: FAILED: the checkpoint was not served from the remote cache" >&2
  cat "${WORK}/reader.log" "${WORK}/bgd.log" >&2
  exit 1
fi
[[ -f dist/checkpoints/ci_tiny/2026.11.29/STATUS ]] ||
  { echo "remote_cache_check: FAILED: no packaged checkpoint in dist/" >&2; exit 1; }
say "OK"
