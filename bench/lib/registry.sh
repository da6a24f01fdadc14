# shellcheck shell=bash
# Sourced by the bench scripts: Debian's docker-registry on 127.0.0.1.
#
#   registry_start DIR [accesslog]
#                        starts one on a free port, its storage, config and log
#                        in DIR (kept: a second start on the same DIR serves what
#                        was pushed before); sets registry_pid and registry
#                        (127.0.0.1:PORT). With `accesslog`, DIR/access.log gets
#                        a line per request (combined log format: the 10th
#                        field is the bytes of the response body), started anew
#   registry_stop        stops it; safe to call twice and from an EXIT trap
# shellcheck disable=SC2034 # read by the scripts that source this
registry_pid="" registry=""

registry_start() {
  local dir=$1 port access=true out=/dev/null
  if [ "${2:-}" = accesslog ]; then access=false out=$dir/access.log; fi
  command -v docker-registry >/dev/null || {
    echo "docker-registry not found (sudo ./setup.sh installs it)" >&2
    return 1
  }
  mkdir -p "$dir"
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  cat >"$dir/registry.yml" <<YML
version: 0.1
log:
  level: error
  accesslog:
    disabled: $access
storage:
  filesystem:
    rootdirectory: $dir/data
http:
  addr: 127.0.0.1:$port
YML
  # The access log goes to stdout, everything else to stderr.
  docker-registry serve "$dir/registry.yml" >"$out" 2>"$dir/registry.log" &
  registry_pid=$!
  for _ in $(seq 100); do
    if curl -sf "http://127.0.0.1:$port/v2/" >/dev/null; then break; fi
    sleep 0.1
  done
  curl -sf "http://127.0.0.1:$port/v2/" >/dev/null || {
    echo "docker-registry did not start (see $dir/registry.log)" >&2
    return 1
  }
  # shellcheck disable=SC2034
  registry=127.0.0.1:$port
}

registry_stop() {
  if [ -n "$registry_pid" ]; then
    kill "$registry_pid" 2>/dev/null || true
    wait "$registry_pid" 2>/dev/null || true
  fi
  registry_pid=""
}
