"""The compose tier: the Docker engine and the locally built images its tests share.

`docker_engine` is a Docker engine that answers: the one running, else `dockerd --iptables=false` started here (root
only; it leaves the host's firewall alone) and stopped at the end of the session. Without either the tier is skipped
with the reason, and fails instead on CI (`CI=true`). `local_images` builds every image of `infra/images/local.env`
once per session with `python -m infra.images.build`'s code: seconds when the engine's layer cache holds them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest

# testcontainers' reaper (Ryuk) is an image from a registry; each test here removes what it started.
os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")

from infra.images.build import (
    ORDER,
    BuiltImage,
    Docker,
    ImageBuildError,
    build_images,
    default_ca_bundle,
    local_tags,
    place_ca_bundle,
)


def _unavailable(reason: str) -> NoReturn:
    if os.environ.get("CI") == "true":
        pytest.fail(f"the compose tier cannot run here: {reason}")
    pytest.skip(f"the compose tier cannot run here: {reason}")


def _answers(docker: Docker) -> bool:
    return docker.answers() is None


@pytest.fixture(scope="session")
def docker_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Docker]:
    try:
        docker = Docker()
    except ImageBuildError as exc:
        _unavailable(str(exc))
    if _answers(docker):
        yield docker
        return
    dockerd = shutil.which("dockerd") or shutil.which("dockerd", path="/usr/sbin:/usr/bin")
    if dockerd is None or os.geteuid() != 0:
        _unavailable(f"no Docker engine answers ({docker.answers()}) and none can be started here "
                     f"({'no dockerd' if dockerd is None else 'dockerd needs root'})")
    log = tmp_path_factory.mktemp("dockerd") / "dockerd.log"
    with log.open("w") as out:
        daemon = subprocess.Popen([dockerd, "--iptables=false"], stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    deadline = time.monotonic() + 60
    while not _answers(docker):
        if daemon.poll() is not None or time.monotonic() > deadline:
            daemon.kill()
            pytest.fail(f"dockerd --iptables=false did not answer within 60 s:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    try:
        yield docker
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()


@pytest.fixture(scope="session")
def local_images(docker_engine: Docker) -> dict[str, BuiltImage]:
    """name -> every image of the stack, built (or found in the layer cache) on this machine."""
    if not Path("/etc/debian_version").exists() and not docker_engine.exists(local_tags()["debian"]):
        _unavailable("the Debian base is made with debootstrap, on a Debian host")
    place_ca_bundle(default_ca_bundle())
    try:
        return {image.name: image for image in build_images(ORDER, docker_engine)}
    except ImageBuildError as exc:
        pytest.fail(str(exc))
