"""The principals and ACLs of a secured bus (`CRL_BROKER__SECURITY=sasl_ssl`, `crl run --security sasl_ssl`).

Every worker kind of the `crl.workers` registry logs in as its own principal, `crl-<kind>` (the name its consumer
group has too), and may do only what its declarations say (`worker_grant`):

- Read and Describe the topics it `consumes` and `follows`, and the topics it `produces` (the scheduler and the
  trainers read back what they published to resume without publishing it twice);
- Write and Describe the topics it `produces`, and the dead-letter topic (the runner dead-letters bad input for
  every kind);
- Read its consumer group `crl-<kind>` (group-mode kinds; the others keep their positions in the run's database).

Nothing else: no topic creation, no other group, no cluster operation; a write to an undeclared topic fails with
`TopicAuthorizationFailedError`. `crl run` itself is the admin principal (a super user): it creates the topics,
grants these ACLs, and follows every topic for its live view.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from infra.kafka import KafkaSettings, make_admin
from infra.kafka_security import Grant, SecuredBus, grant_acls
from pipeline.runtime.launch import WorkerClass
from schemas.topics import DEAD_LETTERS

SECURITY_DIR = "security"
"""The secured bus's certificates and credentials in the run directory (0700)."""


def worker_principal(kind: str) -> str:
    """The SASL user name of worker kind `kind` (the same as its consumer group's id)."""
    return f"crl-{kind}"


def worker_grant(worker: WorkerClass) -> Grant:
    """What worker kind `worker` may do on the bus, from what it declares (see the module docstring)."""
    reads = [topic.name for topic in (*worker.consumes, *worker.follows, *worker.produces)]
    writes = [topic.name for topic in (*worker.produces, DEAD_LETTERS)]
    groups = [worker_principal(worker.name)] if worker.consumes and worker.consumption == "group" else []
    return Grant(worker_principal(worker.name), reads=list(dict.fromkeys(reads)), writes=list(dict.fromkeys(writes)),
                 groups=groups)


def worker_bus(run_dir: Path, registry: Mapping[str, WorkerClass]) -> SecuredBus:
    """The run's secured bus: certificates and a login for the admin and for every kind of `registry`, made on the
    first start of the run and read back on `--resume`."""
    return SecuredBus.create(run_dir / SECURITY_DIR, [worker_principal(kind) for kind in registry])


def grant_worker_acls(kafka: KafkaSettings, registry: Mapping[str, WorkerClass]) -> int:
    """Create every kind's ACLs with `kafka` (logged in as the admin). Returns the number of ACLs."""
    admin = make_admin(kafka, client_id="crl-acls")
    try:
        return grant_acls(admin, [worker_grant(worker) for worker in registry.values()])
    finally:
        admin.close()
