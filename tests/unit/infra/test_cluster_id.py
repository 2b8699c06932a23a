"""The KRaft cluster id `crl` formats Apache Kafka's storage with: 22 URL-safe base64 characters that never start
with "-" (the storage tool's parser would read such an id as an option; a CI run failed on exactly that)."""

from __future__ import annotations

import base64
import uuid

from infra import apache_kafka
from infra.apache_kafka import new_cluster_id


def test_an_id_that_starts_with_a_dash_is_drawn_again(monkeypatch):
    draws = iter([uuid.UUID(bytes=b"\xfb" + b"\0" * 15), uuid.UUID(bytes=b"\x01" * 16)])
    assert base64.urlsafe_b64encode(b"\xfb" + b"\0" * 15).decode().startswith("-")
    monkeypatch.setattr(apache_kafka.uuid, "uuid4", lambda: next(draws))
    assert new_cluster_id() == base64.urlsafe_b64encode(b"\x01" * 16).decode().rstrip("=")


def test_cluster_ids_are_22_url_safe_characters():
    ids = [new_cluster_id() for _ in range(2000)]
    assert all(len(i) == 22 and not i.startswith("-") and set(i) <= set(
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_") for i in ids)
    assert len(set(ids)) == len(ids)
