"""`crl stack up`: an embedded broker with every topic, until Ctrl-C."""

from __future__ import annotations

import signal
import threading
from typing import Annotated

import typer

from pipeline.cli.common import (
    BrokerOption,
    BrokersOption,
    RunDirOption,
    SecurityOption,
    console,
    current_settings,
    errors,
    fail,
    with_broker,
)

stack_app = typer.Typer(help="The embedded broker stack (no Docker needed).", no_args_is_help=True)


@stack_app.command("up")
def stack_up(
    run_dir: RunDirOption = None,
    port: Annotated[int | None, typer.Option(help="Loopback port for the broker (default: a free one).")] = None,
    broker_kind: BrokerOption = None,
    brokers: BrokersOption = None,
    security: SecurityOption = None,
) -> None:
    """Start the embedded broker, create every topic, print the bootstrap address, and run until Ctrl-C."""
    from infra.admin import create_topics
    from infra.broker import embedded_broker, remove_broker_file, write_broker_file
    from infra.kafka import make_admin
    from infra.kafka_cluster import ApacheKafkaCluster
    from pipeline.run.security import grant_worker_acls, worker_bus
    from pipeline.runtime.launch import load_worker_registry

    settings = with_broker(current_settings(run_dir), broker_kind, brokers, security)
    registry = load_worker_registry()
    bus = worker_bus(settings.run_dir, registry) if settings.broker.security != "none" else None
    broker = embedded_broker(settings.broker, data_dir=settings.run_dir / "kafka",
                             log_path=settings.run_dir / "logs" / "broker.log", port=port, security=bus)
    with errors.status(f"starting {broker.description}"):
        broker.start()
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        kafka = settings.with_bootstrap(broker.bootstrap_servers).kafka
        if bus is not None:
            kafka = bus.client_settings(kafka)
        admin = make_admin(kafka)
        try:
            create_topics(admin, replicas=settings.kafka.replication_factor,
                          min_insync=settings.kafka.min_insync_replicas)
        finally:
            admin.close()
        if bus is not None:
            granted = grant_worker_acls(kafka, registry)
            console.print(f"secured SASL_SSL, SCRAM-SHA-512: {granted} ACLs for the principals "
                          f"{', '.join(bus.principals)}; CA {bus.ca_file}, passwords in "
                          f"{bus.directory / 'credentials.json'}", highlight=False)
        write_broker_file(settings.run_dir, broker)
        memory = broker.resident_memory_bytes()
        if isinstance(broker, ApacheKafkaCluster):
            pids = ", ".join(str(pid) for pid in broker.pids.values())
            where = f"pids {pids}, started in {broker.start_seconds:.2f}s, {(memory or 0) / 2**20:.0f} MiB resident, " \
                    f"logs {settings.run_dir / 'logs' / 'broker-*.log'}"
        else:
            where = f"pid {broker.pid}, started in {broker.start_seconds:.2f}s, {(memory or 0) / 2**20:.0f} MiB " \
                    f"resident, log {broker.log_path}"
        console.print(f"broker  {broker.bootstrap_servers}  ({broker.description} {where})")
        console.print(f"topics  created; run dir {settings.run_dir}")
        console.print(f"use it: export CRL_KAFKA__BOOTSTRAP_SERVERS={broker.bootstrap_servers}"
                      f"   or pass --run-dir {settings.run_dir}")
        if broker.durable:
            console.print(f"Ctrl-C stops the broker; its log stays in {settings.run_dir / 'kafka'} and the same "
                          "command continues it.")
        else:
            console.print("Ctrl-C stops the broker (its records live in memory only; the archive keeps them).")
        while not stop.wait(0.5):
            if not broker.is_running():
                raise fail("the broker exited unexpectedly; see its log")
    finally:
        broker.stop()
        remove_broker_file(settings.run_dir)
    console.print("broker stopped")
