#!/bin/bash
# First start on an empty PGDATA: initdb with the superuser POSTGRES_USER and its POSTGRES_PASSWORD (scram-sha-256
# from any address), then the database POSTGRES_DB. Every start: exec the server (listening on every interface).
set -euo pipefail
: "${POSTGRES_USER:=postgres}"
: "${POSTGRES_DB:=$POSTGRES_USER}"
if [ -z "${POSTGRES_PASSWORD:-}" ]; then
  echo "POSTGRES_PASSWORD must be set (the server accepts password logins only)" >&2
  exit 1
fi

if [ ! -s "$PGDATA/PG_VERSION" ]; then
  password_file=$(mktemp)
  printf '%s\n' "$POSTGRES_PASSWORD" > "$password_file"
  initdb --username="$POSTGRES_USER" --pwfile="$password_file" --auth-local=trust --auth-host=scram-sha-256 \
         --encoding=UTF8 -D "$PGDATA" >/dev/null
  rm -f "$password_file"
  printf '%s\n' "host all all 0.0.0.0/0 scram-sha-256" "host all all ::/0 scram-sha-256" >> "$PGDATA/pg_hba.conf"
  if [ "$POSTGRES_DB" != "postgres" ]; then
    # Single-user mode: no server, no socket, nothing can connect before the database exists.
    echo "CREATE DATABASE \"$POSTGRES_DB\" OWNER \"$POSTGRES_USER\";" \
      | postgres --single -D "$PGDATA" -j postgres >/dev/null
  fi
  echo "initialised $PGDATA: user $POSTGRES_USER, database $POSTGRES_DB"
fi

if [ "${1:-}" = "postgres" ]; then
  shift
  exec postgres -D "$PGDATA" -c listen_addresses='*' "$@"
fi
exec "$@"
