"""testcontainers, which the project's users name, on the images built on this machine: the Apache Kafka tier's
container path of tests/conftest.py (the one a machine without Java takes) and PostgreSQL's testcontainers module,
with `crl topics create` and `crl doctor` run against both (limits, topics, a round trip of every event kind, the
SQL layer), and the SQL layer's migrations on that PostgreSQL."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.db import current_revision, make_engine, migrate
from infra.images.build import BuiltImage

pytestmark = pytest.mark.compose

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def kafka_in_container(local_images: dict[str, BuiltImage], apache_kafka_in_container) -> Iterator[str]:
    with apache_kafka_in_container(local_images["kafka"].tag) as bootstrap:
        yield bootstrap


@pytest.fixture(scope="module")
def postgres_in_container(local_images: dict[str, BuiltImage]) -> Iterator[str]:
    from testcontainers.community.postgres import PostgresContainer

    with PostgresContainer(local_images["postgres"].tag, username="crl", password="crl", dbname="crl",
                           driver="psycopg") as postgres:
        yield postgres.get_connection_url()


def _crl(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_crl_doctor_passes_on_kafka_and_postgres_started_by_testcontainers(kafka_in_container, postgres_in_container,
                                                                           tmp_path):
    env = {key: value for key, value in os.environ.items() if not key.startswith("CRL_")}
    env.update({"HF_HUB_OFFLINE": "1", "COLUMNS": "200", "CRL_KAFKA__BOOTSTRAP_SERVERS": kafka_in_container,
                "CRL_DB__URL": postgres_in_container, "CRL_RUN_DIR": str(tmp_path / "run")})
    created = _crl("topics", "create", env=env)
    assert created.returncode == 0, created.stdout + created.stderr
    doctor = _crl("doctor", env=env)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert re.search(r"\b\d+ passed, 0 failed", doctor.stdout), doctor.stdout
    assert "Kafka at " + kafka_in_container in doctor.stdout
    assert re.search(r"SQL CRL_DB__URL\s+│ ok\s+│ postgresql 15", doctor.stdout), doctor.stdout


def test_the_sql_layer_migrates_on_postgres_started_by_testcontainers(postgres_in_container):
    engine = make_engine(postgres_in_container)
    try:
        assert current_revision(engine) is None
        revision = migrate(engine)
        assert current_revision(engine) == revision and migrate(engine) == revision  # idempotent
    finally:
        engine.dispose()
