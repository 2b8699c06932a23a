"""Alembic environment for the migrations in `infra/migrations/versions`.

From code, `infra.db.migrate(engine)` builds the config and hands its open connection over in
`config.attributes["connection"]`; this file then migrates on that connection inside the caller's transaction.

From the command line there is no `alembic.ini`; give Alembic the script location and the database with `-x url=...`
(run from the repository root, so that `infra` is importable):

    cat > /tmp/crl-alembic.ini <<'EOF'
    [alembic]
    script_location = infra/migrations
    prepend_sys_path = .
    path_separator = os
    EOF
    alembic -c /tmp/crl-alembic.ini -x url=sqlite:///runs/demo/crl.sqlite3 upgrade head
    alembic -c /tmp/crl-alembic.ini -x url=postgresql+psycopg://user@host:5432/db current
    alembic -c /tmp/crl-alembic.ini -x url=sqlite:///runs/demo/crl.sqlite3 upgrade head --sql   # print the SQL only

A URL given on the command line is opened with `infra.db.make_engine`, so SQLite gets the same WAL and busy-timeout
settings as the workers.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from infra.db import make_engine, metadata
from infra.errors import ConfigError

config = context.config
target_metadata = metadata


def _cli_url() -> str:
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option("sqlalchemy.url")
    if not url:
        raise ConfigError("no database given: pass `-x url=SQLALCHEMY_URL` to alembic, or call infra.db.migrate()")
    return url


def _migrate_on(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_offline() -> None:
    """Print the migration SQL for `-x url=...` instead of running it (`alembic ... --sql`)."""
    context.configure(url=_cli_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    """Migrate on the connection `infra.db.migrate` passed in, or on a new one to `-x url=...`."""
    connection = config.attributes.get("connection")
    if connection is not None:
        _migrate_on(connection)
        return
    engine = make_engine(_cli_url())
    try:
        with engine.connect() as cli_connection:
            _migrate_on(cli_connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
