#!/bin/sh
# Initialise an empty PGDATA from POSTGRES_USER / POSTGRES_PASSWORD / POSTGRES_DB, then run postgres, as the
# official image's entrypoint does for the settings the harnessrl chart uses.
set -eu
if [ "${1#-}" != "$1" ]; then set -- postgres "$@"; fi
if [ "$1" = postgres ] && [ "$(id -u)" = 0 ]; then
  # As root (a plain `docker run`), own the data and run as postgres, as the official image does with gosu.
  mkdir -p "$PGDATA" /var/run/postgresql && chown postgres:postgres "$PGDATA" && chmod 700 "$PGDATA"
  exec setpriv --reuid=postgres --regid=postgres --init-groups "$0" "$@"
fi
if [ "$1" = postgres ] && [ ! -s "$PGDATA/PG_VERSION" ]; then
  : "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD must be set: the database listens on the network}"
  user="${POSTGRES_USER:-postgres}"
  mkdir -p "$PGDATA" && chmod 700 "$PGDATA"
  pwfile=$(mktemp)
  printf '%s' "$POSTGRES_PASSWORD" > "$pwfile"
  # UTF8, as the official image makes it: under the C locale initdb picks SQL_ASCII, and psycopg then hands
  # SQLAlchemy bytes for text (its server-version check fails on them).
  initdb -D "$PGDATA" -U "$user" --pwfile="$pwfile" --encoding=UTF8 --locale=C.UTF-8 \
    --auth-local=trust --auth-host=scram-sha-256 >/dev/null
  rm -f "$pwfile"
  echo "listen_addresses = '*'" >> "$PGDATA/postgresql.conf"
  echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
  db="${POSTGRES_DB:-$user}"
  if [ "$db" != postgres ]; then
    pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
    psql -v ON_ERROR_STOP=1 -U "$user" -d postgres -c "CREATE DATABASE \"$db\"" >/dev/null
    pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
  fi
  echo "docker-entrypoint: initialised $PGDATA (database $db, user $user)"
fi
if [ "$1" = postgres ]; then shift; exec postgres -D "$PGDATA" "$@"; fi
exec "$@"
