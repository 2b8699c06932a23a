"""Checks that docker-compose.yml and infra/Dockerfile stay deployable and in step with the code.

- `docker-compose config -q` accepts the compose file (Debian's docker-compose 1.29 validates it without a Docker
  engine); skipped when the binary is missing, except under CI=true where that is a failure;
- every image is pinned (the defaults of its `${VARIABLE:-default}`), and `infra/images/local.env` names a local
  image for each variable, as `python -m infra.images.build` tags them;
- Kafka has a healthcheck and topic auto-creation off; workers wait for a healthy Kafka and for topic-init, which
  runs `crl topics create`;
- the compose broker, the embedded Apache Kafka (`infra/apache_kafka.py`) and the client settings agree: the same
  Kafka release, the same broker settings, and a group session timeout that a stock broker accepts;
- the worker services (command `worker ...`) are exactly the keys of `workers.WORKERS`, service name = key with
  `_` replaced by `-`;
- workers restart on failure only (the scheduler exits 0 after its run), under tini, with the run directory per
  `CRL_RUN_ID` and the user's cache on volumes whose folders the image creates for its user;
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
from infra.images.build import VARIABLE_OF, local_tags, read_env_file
from infra.kafka import KafkaSettings
from workers import WORKERS

REPO_ROOT = Path(__file__).resolve().parents[3]
COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
DOCKERFILE = REPO_ROOT / "infra" / "Dockerfile"
PYPROJECT = REPO_ROOT / "pyproject.toml"


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    return yaml.safe_load(COMPOSE_FILE.read_text())["services"]


VARIABLE = re.compile(r"\$\{(\w+):-([^}]*)\}")


def _default(value: str) -> str:
    """`value` as docker-compose reads it with no variable set: every `${NAME:-default}` replaced by its default."""
    return VARIABLE.sub(lambda match: match.group(2), value)


def _variables(value: str) -> dict[str, str]:
    return dict(VARIABLE.findall(value))


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
        if "image" in service and _image_tag(_default(service["image"])) in (None, "latest")
    }
    assert not unpinned, f"images without a tag or tagged latest: {unpinned}"
    assert all("image" in service or "build" in service for service in services.values())


def test_kafka_has_a_healthcheck_and_no_topic_auto_creation(services: dict[str, dict[str, Any]]) -> None:
    kafka = services["kafka"]
    assert "kafka-broker-api-versions.sh" in " ".join(kafka["healthcheck"]["test"])
    assert _environment(kafka)["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"


def test_compose_kafka_and_the_embedded_apache_kafka_agree(services: dict[str, dict[str, Any]]) -> None:
    kafka = services["kafka"]
    assert _default(kafka["image"]) == f"apache/kafka:{KAFKA_VERSION}"
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
    build_args = dict(arguments.split("=", 1)
                      for keyword, arguments in instructions if keyword == "ARG" and "=" in arguments)
    base_images = [re.sub(r"\$\{(\w+)\}", lambda match: build_args[match.group(1)], arguments.split()[0])
                   for keyword, arguments in instructions if keyword == "FROM"]
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


def test_every_image_has_a_variable_and_a_local_build(services: dict[str, dict[str, Any]]) -> None:
    """Official images by default; `infra/images/local.env` (what `python -m infra.images.build` tags) for each."""
    local = read_env_file()
    built = local_tags()
    variables = {}
    for name, service in services.items():
        if name == "kafka-ui":  # only under the `ui` profile: an image from a registry, nothing depends on it
            assert service["profiles"] == ["ui"]
            continue
        found = _variables(service["image"])
        assert len(found) == 1, f"{name}: image {service['image']!r} is not one ${{VARIABLE:-default}}"
        variables.update(found)
        for arg in (service.get("build") or {}).get("args", {}).values():
            variables.update(_variables(str(arg)))
    assert set(variables) - {"CRL_TORCH_INDEX_URL"} <= set(local), f"not in local.env: {set(variables) - set(local)}"
    for name, variable in VARIABLE_OF.items():
        assert local[variable] == built[name]
    assert variables["CRL_KAFKA_IMAGE"] == f"apache/kafka:{KAFKA_VERSION}"
    assert local["CRL_KAFKA_IMAGE"].endswith(f":{KAFKA_VERSION}")
    assert variables["CRL_PYTHON_IMAGE"] == "python:3.11-slim-bookworm"


def test_workers_restart_on_failure_under_tini_with_a_run_directory_per_run_id(
        services: dict[str, dict[str, Any]]) -> None:
    for name, service in _worker_services(services).items():
        assert service["restart"] == "on-failure", f"{name}: a finished scheduler exits 0 and must stay down"
        assert service["init"] is True, f"{name}: tini passes `docker kill --signal` on to the worker"
        assert [volume.split(":")[1] for volume in service["volumes"]] == \
            ["/data/runs", "/home/crl/.cache/complementary-rl"], name
        environment = _environment(service)
        assert environment["CRL_RUN_DIR"] == "/data/runs/${CRL_RUN_ID:-default}"
        assert environment["CRL_RUN_ID"] == "${CRL_RUN_ID:-default}"
    dockerfile = DOCKERFILE.read_text()
    assert "mkdir -p /data/runs /home/crl/.cache/complementary-rl" in dockerfile
    assert "chown -R crl:crl /data /home/crl/.cache" in dockerfile
