"""Checks that docker-compose.yml and infra/Dockerfile stay deployable and in step with the code.

- `docker-compose config -q` accepts the compose file (Debian's docker-compose 1.29 validates it without a Docker
  engine); skipped when the binary is missing, except under CI=true where that is a failure;
- every image is pinned; Kafka has a healthcheck and topic auto-creation off; workers wait for a healthy Kafka and
  for topic-init, which runs `crl topics create`;
- the compose broker, the embedded Apache Kafka (`infra/apache_kafka.py`) and the client settings agree: the same
  Kafka release, the same broker settings, and a group session timeout that a stock broker accepts;
- the worker services (command `worker ...`) are exactly the keys of `workers.WORKERS`, service name = key with
  `_` replaced by `-`;
- the Dockerfile pins its base image and the same torch as pyproject.toml, and its entrypoint is `crl`.

Run: pytest tests/unit/infra/test_compose.py
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.apache_kafka import BROKER_POLICY, KAFKA_VERSION
from infra.kafka import KafkaSettings
from workers import WORKERS

REPO_ROOT = Path(__file__).resolve().parents[3]
COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
DOCKERFILE = REPO_ROOT / "infra" / "Dockerfile"
PYPROJECT = REPO_ROOT / "pyproject.toml"


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    return yaml.safe_load(COMPOSE_FILE.read_text())["services"]


def _command(service: dict[str, Any]) -> list[str]:
    command = service.get("command", [])
    return shlex.split(command) if isinstance(command, str) else [str(part) for part in command]


def _environment(service: dict[str, Any]) -> dict[str, Any]:
    environment = service.get("environment", {})
    if isinstance(environment, list):
        return dict(item.split("=", 1) for item in environment)
    return environment


def _worker_services(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {name: service for name, service in services.items() if _command(service)[:1] == ["worker"]}


def _image_tag(image: str) -> str | None:
    """The tag of `registry:port/name:tag` (None when untagged); a digest counts as a pin."""
    if "@sha256:" in image:
        return image.split("@", 1)[1]
    last_component = image.rsplit("/", 1)[-1]
    return last_component.split(":", 1)[1] if ":" in last_component else None


def _dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    instructions = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, arguments = line.partition(" ")
        instructions.append((keyword.upper(), arguments.strip()))
    return instructions


def test_docker_compose_config_is_valid() -> None:
    binary = shutil.which("docker-compose")
    if binary is None:
        reason = "docker-compose not installed (apt-get install docker-compose)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason}; CI must validate the compose file")
        pytest.skip(reason)
    result = subprocess.run(
        [binary, "-f", str(COMPOSE_FILE), "config", "-q"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


def test_every_image_is_pinned(services: dict[str, dict[str, Any]]) -> None:
    unpinned = {
        name: service["image"]
        for name, service in services.items()
        if "image" in service and _image_tag(service["image"]) in (None, "latest")
    }
    assert not unpinned, f"images without a tag or tagged latest: {unpinned}"
    assert all("image" in service or "build" in service for service in services.values())


def test_kafka_has_a_healthcheck_and_no_topic_auto_creation(services: dict[str, dict[str, Any]]) -> None:
    kafka = services["kafka"]
    assert "kafka-broker-api-versions.sh" in " ".join(kafka["healthcheck"]["test"])
    assert _environment(kafka)["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"


def test_compose_kafka_and_the_embedded_apache_kafka_agree(services: dict[str, dict[str, Any]]) -> None:
    kafka = services["kafka"]
    assert kafka["image"] == f"apache/kafka:{KAFKA_VERSION}"
    compose = {key.removeprefix("KAFKA_").lower().replace("_", "."): str(value)
               for key, value in _environment(kafka).items()}
    assert {key: compose.get(key) for key in BROKER_POLICY} == BROKER_POLICY


def test_client_sessions_fit_the_broker_limits_everywhere(services: dict[str, dict[str, Any]]) -> None:
    """Apache Kafka refuses group sessions outside [group.min.session.timeout.ms, group.max.session.timeout.ms]
    (6,000 and 1,800,000 ms unless configured); neither broker of this project changes them."""
    policies = [BROKER_POLICY, {key.removeprefix("KAFKA_").lower().replace("_", "."): str(value)
                                for key, value in _environment(services["kafka"]).items()}]
    client = KafkaSettings()
    for policy in policies:
        low = int(policy.get("group.min.session.timeout.ms", 6000))
        high = int(policy.get("group.max.session.timeout.ms", 1_800_000))
        assert low <= client.session_timeout_ms <= high
    assert client.heartbeat_interval_ms * 3 <= client.session_timeout_ms  # the usual ratio


def test_topic_init_creates_topics_once_kafka_is_healthy(services: dict[str, dict[str, Any]]) -> None:
    topic_init = services["topic-init"]
    assert _command(topic_init) == ["topics", "create"]
    assert topic_init["depends_on"]["kafka"]["condition"] == "service_healthy"
    assert topic_init["restart"] == "no"


def test_workers_wait_for_healthy_kafka_and_created_topics(services: dict[str, dict[str, Any]]) -> None:
    workers = _worker_services(services)
    assert workers, "no worker service in docker-compose.yml"
    for name, service in workers.items():
        depends_on = service["depends_on"]
        assert depends_on["kafka"]["condition"] == "service_healthy", name
        assert depends_on["topic-init"]["condition"] == "service_completed_successfully", name


def test_worker_services_match_the_worker_registry(services: dict[str, dict[str, Any]]) -> None:
    compose_keys = {}
    for name, service in _worker_services(services).items():
        key = name.replace("-", "_")
        assert _command(service) == ["worker", key], f"service {name!r} must run ['worker', {key!r}]"
        compose_keys[key] = name
    missing = sorted(set(WORKERS) - set(compose_keys))
    unknown = sorted(set(compose_keys) - set(WORKERS))
    assert not missing, f"WORKERS keys without a compose service: {missing}"
    assert not unknown, f"compose worker services not in WORKERS: {unknown} (known: {sorted(WORKERS)})"


def test_dockerfile_pins_base_image_and_torch() -> None:
    instructions = _dockerfile_instructions()
    base_images = [arguments.split()[0] for keyword, arguments in instructions if keyword == "FROM"]
    assert base_images, "infra/Dockerfile has no FROM"
    for image in base_images:
        assert _image_tag(image) not in (None, "latest"), image
    assert re.fullmatch(r"python:3\.11(\.\d+)?-slim-bookworm", base_images[-1]), base_images[-1]

    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    torch_pins = [dep for dep in dependencies if re.match(r"torch\s*==", dep)]
    assert torch_pins, "pyproject.toml must pin torch with =="
    torch_pin = torch_pins[0].replace(" ", "")
    assert torch_pin == "torch==2.13.0"
    installs = [arguments for keyword, arguments in instructions if keyword == "RUN" and "pip install" in arguments]
    assert any(torch_pin in arguments.split() for arguments in installs), f"no RUN pip install {torch_pin}"


def test_dockerfile_runs_crl_as_a_non_root_user() -> None:
    instructions = _dockerfile_instructions()
    entrypoints = [arguments for keyword, arguments in instructions if keyword == "ENTRYPOINT"]
    assert entrypoints and json.loads(entrypoints[-1]) == ["crl"]
    users = [arguments for keyword, arguments in instructions if keyword == "USER"]
    assert users and users[-1] not in ("root", "0")
