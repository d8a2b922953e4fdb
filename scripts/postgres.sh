#!/usr/bin/env bash
# Source this file: `start_postgres` starts a throwaway PostgreSQL cluster for the tests (installing Debian's
# postgresql when missing) and exports HARNESSRL_TEST_PG_URL; `stop_postgres` stops it and removes its files.
# HARNESSRL_PG_MAX_CONNECTIONS sets its max_connections (default 200; bench/db_connections.py: the chart's 500).
# A private cluster on its own port leaves any system cluster and its auth settings alone.

_pg_as_owner() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

start_postgres() {
  if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
    "$(dirname "${BASH_SOURCE[0]}")/apt-install.sh" postgresql || return 1
  fi
  local bin port
  bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  HARNESSRL_PG_DIR=$(mktemp -d /tmp/harnessrl-pg.XXXXXX)
  export HARNESSRL_PG_DIR HARNESSRL_PG_BIN="$bin"
  [ "$(id -u)" = 0 ] && chown postgres "$HARNESSRL_PG_DIR"
  _pg_as_owner "$bin/initdb" -D "$HARNESSRL_PG_DIR/data" --auth=trust -U postgres >"$HARNESSRL_PG_DIR/initdb.log" 2>&1 \
    || { cat "$HARNESSRL_PG_DIR/initdb.log" >&2; return 1; }
  _pg_as_owner "$bin/pg_ctl" -D "$HARNESSRL_PG_DIR/data" -l "$HARNESSRL_PG_DIR/server.log" -w \
    -o "-p $port -k $HARNESSRL_PG_DIR -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=${HARNESSRL_PG_MAX_CONNECTIONS:-200}" start >/dev/null \
    || { cat "$HARNESSRL_PG_DIR/server.log" >&2; return 1; }
  export HARNESSRL_TEST_PG_URL="postgresql+psycopg://postgres@127.0.0.1:$port/postgres"
  echo "PostgreSQL for tests: $HARNESSRL_TEST_PG_URL"
}

stop_postgres() {
  [ -n "${HARNESSRL_PG_DIR:-}" ] || return 0
  _pg_as_owner "$HARNESSRL_PG_BIN/pg_ctl" -D "$HARNESSRL_PG_DIR/data" -m fast -w stop >/dev/null 2>&1 || true
  rm -rf "$HARNESSRL_PG_DIR"
  unset HARNESSRL_PG_DIR
}
