"""Fixtures for integration tests: real databases (the brokers are in tests/conftest.py)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, make_url, text
from sqlalchemy.exc import OperationalError

from infra.db import check_connection, make_engine
from infra.postgres import PostgresCluster, PostgresClusterError

# ---------------------------------------------------------------------------------------------------------------------
# Databases. `db_engine` runs a test once on a SQLite file and once on PostgreSQL, each empty (never migrated).
# PostgreSQL is a private cluster the session makes itself (initdb in a temporary directory, trust auth on 127.0.0.1,
# a free port; stopped at the end, and no other server is touched), or the server CRL_TEST_POSTGRES_URL names. Each
# test gets its own schema, dropped afterwards. Without PostgreSQL binaries the PostgreSQL half is skipped, except on
# CI (CI=true), which installs them and must fail instead.
# ---------------------------------------------------------------------------------------------------------------------


def _unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A PostgreSQL database for tests: a private cluster's `test` database, or CRL_TEST_POSTGRES_URL."""
    url = os.environ.get("CRL_TEST_POSTGRES_URL")
    if url:
        # A host that drops packets would otherwise hold the probe for libpq's default of forever.
        probe_url = make_url(url).update_query_dict({"connect_timeout": "5"})
        engine = make_engine(probe_url.render_as_string(hide_password=False))
        try:
            check_connection(engine)
        except OperationalError as exc:
            _unavailable(f"PostgreSQL at {make_url(url)!r} (CRL_TEST_POSTGRES_URL) is unreachable: {exc.orig}")
        finally:
            engine.dispose()
        yield url
        return
    try:
        cluster = PostgresCluster.temporary()
    except PostgresClusterError as exc:
        _unavailable(f"no PostgreSQL for the tests: {exc}")
    try:
        cluster.start()
        yield cluster.create_database("test")
    finally:
        cluster.remove()


@pytest.fixture
def postgresql_engine(postgres_url: str) -> Iterator[Engine]:
    """An engine whose every connection works in a fresh, empty schema `crl_test_<hex>`."""
    schema = f"crl_test_{uuid.uuid4().hex[:12]}"
    admin = make_engine(postgres_url)
    with admin.begin() as connection:
        connection.execute(text(f'CREATE SCHEMA "{schema}"'))
    # libpq `options` in the URL become connect arguments: every pooled connection starts in the test schema.
    scoped_url = make_url(postgres_url).update_query_dict({"options": f"-csearch_path={schema}"})
    engine = make_engine(scoped_url.render_as_string(hide_password=False))
    try:
        yield engine
    finally:
        engine.dispose()
        with admin.begin() as connection:
            connection.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture
def sqlite_path(tmp_path: Path) -> Path:
    """Where the test's SQLite database file goes; the directory does not exist yet."""
    return tmp_path / "run" / "crl.sqlite3"


@pytest.fixture
def sqlite_engine(sqlite_path: Path) -> Iterator[Engine]:
    """An engine on a new SQLite file in the test's temporary directory."""
    engine = make_engine(f"sqlite:///{sqlite_path}")
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_engine(request: pytest.FixtureRequest) -> Engine:
    """An empty database on each backend in turn: the same test runs on SQLite and on PostgreSQL."""
    return request.getfixturevalue(f"{request.param}_engine")


# ---------------------------------------------------------------------------------------------------------------------
