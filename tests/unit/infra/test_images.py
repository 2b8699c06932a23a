"""infra/images/build.py without a Docker engine: the env file, the CA bundle and the command line. The builds
themselves run in the compose tier (tests/compose), on a real engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.images import build
from infra.images.build import ORDER, VARIABLE_OF, ImageBuildError, local_tags, place_ca_bundle, read_env_file


def test_the_env_file_names_every_image_and_comments_are_skipped(tmp_path: Path) -> None:
    env = tmp_path / "local.env"
    env.write_text("# a comment\n\nCRL_IMAGE=me:dev\n CRL_KAFKA_IMAGE = k:1 \n")
    assert read_env_file(env) == {"CRL_IMAGE": "me:dev", "CRL_KAFKA_IMAGE": "k:1"}
    tags = local_tags()
    assert list(tags) == list(ORDER) and set(VARIABLE_OF) == set(ORDER)
    assert tags["worker"] == "complementary-rl:dev" and tags["kafka"] == "crl-local/kafka:4.1.1"


def test_each_image_is_built_after_the_one_it_is_built_on() -> None:
    for name, base in build.BASE_OF.items():
        assert ORDER.index(base) < ORDER.index(name)


def test_a_ca_bundle_must_hold_a_pem_certificate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "certs" / "ca-bundle.crt"
    target.parent.mkdir()
    monkeypatch.setattr(build, "CA_BUNDLE", target)
    with pytest.raises(ImageBuildError, match="is not a file"):
        place_ca_bundle(tmp_path / "missing.crt")
    not_pem = tmp_path / "not.crt"
    not_pem.write_text("hello")
    with pytest.raises(ImageBuildError, match="holds no PEM certificate"):
        place_ca_bundle(not_pem)
    pem = tmp_path / "ok.crt"
    pem.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    place_ca_bundle(pem)
    assert target.read_text() == pem.read_text()
    place_ca_bundle(None)
    assert not target.exists()


def test_an_unknown_image_is_refused_naming_the_images(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build.main(["kafak"])
    assert exited.value.code == 2
    assert "unknown images ['kafak']; the images are debian, python, kafka, postgres, worker" in capsys.readouterr().err
