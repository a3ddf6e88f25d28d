#!/usr/bin/env bash
# Start a throwaway PostgreSQL server for the distributed-search test and export its URL.
#
# Source it (`source .ci/postgres.sh`, as .ci/run does) to get SERVELAB_TEST_POSTGRES_URL in the
# calling shell, or run it to print the `export` line. Idempotent: a second call reuses the
# cluster under $SERVELAB_PG_DIR (default /tmp/servelab-pg) and starts it only if it is down.
# Installs the Debian `postgresql` package only when no server binaries are found. The server
# refuses to run as root, so as root the cluster belongs to the `postgres` user (created by the
# package) and every server command runs through runuser.

_servelab_pg_main() {
  local dir="${SERVELAB_PG_DIR:-/tmp/servelab-pg}"
  local data="$dir/data" db="servelab_test" bindir="" port="" as=()

  _servelab_pg_bindir() {
    local d
    for d in /usr/lib/postgresql/*/bin; do
      [ -x "$d/initdb" ] && [ -x "$d/pg_ctl" ] && [ -x "$d/postgres" ] && bindir="$d"
    done
    if [ -z "$bindir" ] && command -v pg_ctl >/dev/null && command -v initdb >/dev/null; then
      bindir="$(dirname "$(readlink -f "$(command -v pg_ctl)")")"
    fi
  }

  _servelab_pg_bindir
  if [ -z "$bindir" ]; then
    echo "postgres.sh: installing the postgresql package" >&2
    export DEBIAN_FRONTEND=noninteractive
    local log="${TMPDIR:-/tmp}/servelab-pg-apt.log"
    { apt-get update -qq && apt-get install -y -qq postgresql; } >"$log" 2>&1 \
      || { tail -n 20 "$log" >&2; echo "postgres.sh: apt-get failed (log: $log)" >&2; return 1; }
    _servelab_pg_bindir
    [ -n "$bindir" ] || { echo "postgres.sh: no initdb/pg_ctl after installing postgresql" >&2; return 1; }
  fi

  if [ "$(id -u)" = 0 ]; then
    id postgres >/dev/null 2>&1 || useradd --system --home-dir "$dir" --shell /bin/sh postgres
    as=(runuser -u postgres --)
    mkdir -p "$dir"
    chown postgres: "$dir"
  else
    mkdir -p "$dir"
  fi
  chmod 700 "$dir"

  if [ ! -f "$data/PG_VERSION" ]; then
    rm -rf "$data"
    "${as[@]}" "$bindir/initdb" -D "$data" -U postgres --auth=trust --no-sync -E UTF8 >"$dir/initdb.log" 2>&1 \
      || { cat "$dir/initdb.log" >&2; return 1; }
    # A free port, chosen once and kept in the cluster's config so later calls find the same server.
    port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
    cat >>"$data/postgresql.conf" <<EOF
listen_addresses = '127.0.0.1'
port = $port
unix_socket_directories = '$dir'
fsync = off
synchronous_commit = off
full_page_writes = off
max_connections = 200
EOF
  fi
  port="$(sed -n 's/^port = \([0-9]*\)$/\1/p' "$data/postgresql.conf" | tail -n 1)"

  if ! "${as[@]}" "$bindir/pg_ctl" -D "$data" status >/dev/null 2>&1; then
    "${as[@]}" "$bindir/pg_ctl" -D "$data" -l "$dir/server.log" -w -t 60 start >/dev/null \
      || { tail -n 20 "$dir/server.log" >&2; return 1; }
  fi
  local psql=("${as[@]}" "$bindir/psql" -h 127.0.0.1 -p "$port" -U postgres -d postgres -tAq)
  if [ "$("${psql[@]}" -c "SELECT 1 FROM pg_database WHERE datname = '$db'")" != 1 ]; then
    "${psql[@]}" -c "CREATE DATABASE $db" >/dev/null || return 1
  fi
  export SERVELAB_TEST_POSTGRES_URL="postgresql://postgres@127.0.0.1:$port/$db"
  echo "export SERVELAB_TEST_POSTGRES_URL=$SERVELAB_TEST_POSTGRES_URL"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -euo pipefail
  _servelab_pg_main
else
  _servelab_pg_main || echo "postgres.sh: no PostgreSQL server; the PostgreSQL search test will skip" >&2
fi
