"""The compose stack's images, built on a machine that reaches no image registry: from Debian's packages, PyPI and
Maven Central only.

    python -m infra.images.build                    # every image; the Debian base only when it is missing
    python -m infra.images.build kafka postgres     # some of them (their base is built first where missing)
    docker-compose --env-file infra/images/local.env up -d

The images and their tags (`infra/images/local.env`, which docker-compose.yml reads through its image variables):
- `debian`: Debian bookworm, minbase, by `debootstrap` (root only) and `docker import`;
- `python`: bookworm's Python 3.11 on it (`infra/images/python/Dockerfile`), the stand-in for python:3.11-slim;
- `kafka`: Apache Kafka 4.1.1 from the jars `infra/apache_kafka.py` fetches and checks, on bookworm's OpenJDK 17
  (`infra/images/kafka/`), the stand-in for apache/kafka:4.1.1;
- `postgres`: bookworm's PostgreSQL 15 (`infra/images/postgres/`), the stand-in for the postgres image;
- `worker`: the project's image (`infra/Dockerfile`) on the `python` image.

Builds use the Docker engine's layer cache, so an unchanged rebuild takes seconds. pip inside the worker build trusts
the CA bundle in `infra/images/certs/ca-bundle.crt` when there is one: `--ca-bundle FILE` puts one there (by
default the bundle pip uses on this machine: `PIP_CERT`, `REQUESTS_CA_BUNDLE` or `SSL_CERT_FILE`, else the system's
bundle), for a proxy that re-signs TLS. torch comes from its CPU index where download.pytorch.org answers, else from
PyPI (the CUDA build, several GB larger). The legacy builder is used (`DOCKER_BUILDKIT=0`): it needs no buildx plugin.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from infra.apache_kafka import BROKER_FILES, install_kafka_jars
from infra.errors import PipelineError

IMAGES_DIR = Path(__file__).resolve().parent
REPO_ROOT = IMAGES_DIR.parents[1]
LOCAL_ENV = IMAGES_DIR / "local.env"
CA_BUNDLE = IMAGES_DIR / "certs" / "ca-bundle.crt"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PYPI_INDEX = "https://pypi.org/simple"
ORDER = ("debian", "python", "kafka", "postgres", "worker")
"""Every image, each after the one it is built on."""
BASE_OF = {"python": "debian", "kafka": "debian", "postgres": "debian", "worker": "python"}
VARIABLE_OF = {"debian": "CRL_DEBIAN_IMAGE", "python": "CRL_PYTHON_IMAGE", "kafka": "CRL_KAFKA_IMAGE",
               "postgres": "CRL_POSTGRES_IMAGE", "worker": "CRL_IMAGE"}


class ImageBuildError(PipelineError):
    """An image could not be built; the message says which and why."""


def read_env_file(path: Path = LOCAL_ENV) -> dict[str, str]:
    """`NAME=value` lines of a docker-compose env file (comments and blank lines skipped)."""
    values = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, value = line.partition("=")
            values[name.strip()] = value.strip()
    return values


def local_tags(path: Path = LOCAL_ENV) -> dict[str, str]:
    """image name (`ORDER`) -> the tag it is built under."""
    values = read_env_file(path)
    return {name: values[VARIABLE_OF[name]] for name in ORDER}


@dataclass(frozen=True)
class BuiltImage:
    name: str
    tag: str
    seconds: float
    size_bytes: int
    reused: bool
    """The image was there already and was not built (the Debian base unless `--rebuild-base`)."""

    def line(self) -> str:
        how = "kept" if self.reused else "built"
        return (f"image={self.name} tag={self.tag} {how}_s={self.seconds:.1f} "
                f"size_mb={self.size_bytes / 1e6:.0f}")


class Docker:
    """The docker CLI, with the legacy builder (no buildx plugin needed) and errors that name the command."""

    def __init__(self, binary: str | None = None, verbose: bool = False) -> None:
        found = binary or shutil.which("docker")
        if found is None:
            raise ImageBuildError("no docker command on PATH (Debian: apt-get install docker.io)")
        self.binary = found
        self.verbose = verbose
        self.env = {**os.environ, "DOCKER_BUILDKIT": "0"}

    def run(self, *args: str, stdin: bytes | None = None, quiet: bool = False) -> str:
        show = self.verbose and not quiet
        result = subprocess.run([self.binary, *args], input=stdin, env=self.env,
                                stdout=None if show else subprocess.PIPE, stderr=None if show else subprocess.PIPE)
        if result.returncode != 0:
            output = b"" if show else (result.stdout or b"") + (result.stderr or b"")
            raise ImageBuildError(f"docker {' '.join(args[:2])} failed (exit {result.returncode}):\n"
                                  f"{output.decode(errors='replace')[-3000:]}")
        return (result.stdout or b"").decode(errors="replace")

    def answers(self) -> str | None:
        """None when the engine answers, else why not."""
        result = subprocess.run([self.binary, "version", "--format", "{{.Server.Version}}"], env=self.env,
                                capture_output=True, text=True)
        return None if result.returncode == 0 else (result.stderr.strip() or "docker version failed")

    def exists(self, tag: str) -> bool:
        return subprocess.run([self.binary, "image", "inspect", tag], env=self.env,
                              capture_output=True).returncode == 0

    def size(self, tag: str) -> int:
        return int(self.run("image", "inspect", "--format", "{{.Size}}", tag, quiet=True).strip())

    def build(self, tag: str, context: Path, dockerfile: Path, build_args: dict[str, str]) -> None:
        args = ["build", "--network", "host", "--force-rm", "--tag", tag, "--file", str(dockerfile)]
        for key, value in build_args.items():
            args += ["--build-arg", f"{key}={value}"]
        self.run(*args, str(context))


def build_debian_base(docker: Docker, tag: str, mirror: str = DEBIAN_MIRROR) -> None:
    """Debian bookworm (minbase, with ca-certificates) by debootstrap, imported as `tag`."""
    if os.geteuid() != 0:
        raise ImageBuildError("the Debian base is made with debootstrap, which needs root: run this as root, or "
                              f"build {tag} elsewhere and `docker load` it")
    debootstrap = shutil.which("debootstrap") or ("/usr/sbin/debootstrap" if Path("/usr/sbin/debootstrap").exists()
                                                  else None)
    if debootstrap is None:
        raise ImageBuildError("debootstrap is not installed (apt-get install debootstrap)")
    with tempfile.TemporaryDirectory(prefix="crl-debian-", dir="/var/tmp") as scratch:
        root = Path(scratch) / "rootfs"
        result = subprocess.run([debootstrap, "--variant=minbase", "--include=ca-certificates", "bookworm",
                                 str(root), mirror], capture_output=True, text=True)
        if result.returncode != 0:
            raise ImageBuildError(f"debootstrap bookworm from {mirror} failed (exit {result.returncode}):\n"
                                  f"{(result.stdout + result.stderr)[-3000:]}")
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for path in (root / cache).glob("*"):
                if path.is_file():
                    path.unlink()
        tar = subprocess.run(["tar", "--numeric-owner", "-C", str(root), "-c", "."], capture_output=True,
                             check=True)
        docker.run("import", "--change", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                   "--change", "ENV LANG=C.UTF-8", "--change", 'CMD ["bash"]', "-", tag, stdin=tar.stdout,
                   quiet=True)


def stage_kafka_context(target: Path) -> Path:
    """infra/images/kafka with the broker's pinned jars in libs/ and its logging settings: a build context."""
    shutil.copytree(IMAGES_DIR / "kafka", target)
    libs = target / "libs"
    libs.mkdir()
    for jar in install_kafka_jars():
        shutil.copy2(jar, libs / jar.name)
    shutil.copy2(BROKER_FILES / "log4j2.properties", target / "log4j2.properties")
    return target


def torch_index(timeout_s: float = 5.0) -> str:
    """torch's CPU index where it answers, else PyPI (whose Linux torch is the CUDA build)."""
    try:
        urllib.request.urlopen(f"{TORCH_CPU_INDEX}/torch/", timeout=timeout_s).close()
    except OSError as exc:
        print(f"{TORCH_CPU_INDEX} does not answer ({exc}): torch comes from PyPI, the CUDA build with its nvidia "
              "libraries (several GB more)", file=sys.stderr)
        return PYPI_INDEX
    return TORCH_CPU_INDEX


SYSTEM_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
"""Debian's bundle of the public CAs and the ones added locally (update-ca-certificates)."""


def default_ca_bundle() -> Path | None:
    """The CA bundle pip uses on this machine: PIP_CERT, REQUESTS_CA_BUNDLE or SSL_CERT_FILE where one names a file,
    else the system's bundle where there is one."""
    for variable in ("PIP_CERT", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE"):
        value = os.environ.get(variable)
        if value and Path(value).is_file():
            return Path(value)
    return SYSTEM_CA_BUNDLE if SYSTEM_CA_BUNDLE.is_file() else None


def place_ca_bundle(bundle: Path | None) -> None:
    """Put `bundle` where infra/Dockerfile looks for one; None removes what is there."""
    if bundle is None:
        CA_BUNDLE.unlink(missing_ok=True)
        return
    if not bundle.is_file():
        raise ImageBuildError(f"CA bundle {bundle} is not a file")
    if "BEGIN CERTIFICATE" not in bundle.read_text(errors="replace"):
        raise ImageBuildError(f"CA bundle {bundle} holds no PEM certificate")
    if bundle.resolve() != CA_BUNDLE.resolve():
        shutil.copyfile(bundle, CA_BUNDLE)


def build_images(names: Sequence[str], docker: Docker, *, tags: dict[str, str] | None = None,
                 rebuild_base: bool = False, mirror: str = DEBIAN_MIRROR,
                 torch_index_url: str | None = None) -> list[BuiltImage]:
    """Build `names` and what they are built on, in `ORDER`; the Debian base is kept when it exists."""
    tags = tags or local_tags()
    wanted: set[str] = set()
    for name in names:
        while name:
            wanted.add(name)
            name = BASE_OF.get(name, "")
    built = []
    for name in (n for n in ORDER if n in wanted):
        tag = tags[name]
        started = time.monotonic()
        reused = False
        if name == "debian":
            if docker.exists(tag) and not rebuild_base:
                reused = True
            else:
                build_debian_base(docker, tag, mirror)
        elif name == "worker":
            docker.build(tag, REPO_ROOT, REPO_ROOT / "infra" / "Dockerfile", {
                "BASE_IMAGE": tags["python"], "TORCH_INDEX_URL": torch_index_url or torch_index()})
        elif name == "kafka":
            with tempfile.TemporaryDirectory(prefix="crl-kafka-image-") as scratch:
                context = stage_kafka_context(Path(scratch) / "kafka")
                docker.build(tag, context, context / "Dockerfile", {"DEBIAN_IMAGE": tags["debian"]})
        else:
            context = IMAGES_DIR / name
            docker.build(tag, context, context / "Dockerfile", {"DEBIAN_IMAGE": tags["debian"]})
        image = BuiltImage(name, tag, time.monotonic() - started, docker.size(tag), reused)
        print(image.line(), flush=True)
        built.append(image)
    return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.images.build", description=__doc__.split("\n\n")[0])
    parser.add_argument("images", nargs="*", metavar="IMAGE", help=f"which images ({', '.join(ORDER)}); default: all")
    bundle = parser.add_mutually_exclusive_group()
    bundle.add_argument("--ca-bundle", type=Path, help="PEM bundle pip trusts inside the worker build (default: "
                        "the one PIP_CERT, REQUESTS_CA_BUNDLE or SSL_CERT_FILE names, else the system's bundle)")
    bundle.add_argument("--no-ca-bundle", action="store_true", help="no extra CA bundle in the worker build")
    parser.add_argument("--rebuild-base", action="store_true", help="debootstrap the Debian base again")
    parser.add_argument("--mirror", default=DEBIAN_MIRROR, help=f"Debian mirror for debootstrap ({DEBIAN_MIRROR})")
    parser.add_argument("--torch-index-url", help=f"where pip gets torch (default: {TORCH_CPU_INDEX} where it "
                        f"answers, else {PYPI_INDEX})")
    parser.add_argument("--verbose", action="store_true", help="show docker's build output")
    args = parser.parse_args(argv)
    if unknown := sorted(set(args.images) - set(ORDER)):
        parser.error(f"unknown images {unknown}; the images are {', '.join(ORDER)}")
    try:
        docker = Docker(verbose=args.verbose)
        if (why := docker.answers()) is not None:
            raise ImageBuildError(f"no Docker engine answers: {why}")
        names = args.images or list(ORDER)
        if "worker" in names:
            place_ca_bundle(None if args.no_ca_bundle else (args.ca_bundle or default_ca_bundle()))
        started = time.monotonic()
        build_images(names, docker, rebuild_base=args.rebuild_base, mirror=args.mirror,
                     torch_index_url=args.torch_index_url)
    except ImageBuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"total_s={time.monotonic() - started:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
