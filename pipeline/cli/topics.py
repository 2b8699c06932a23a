"""`crl topics create | list | describe`: the registry's Kafka topics."""

from __future__ import annotations

import typer

from pipeline.cli.common import (
    RunDirOption,
    broker_admin,
    console,
    current_settings,
    kafka_of,
)
from pipeline.cli.listing import Format, FormatOption, print_rows

topics_app = typer.Typer(help="Create and inspect the registry's Kafka topics.", no_args_is_help=True)


@topics_app.command("create")
def topics_create(run_dir: RunDirOption = None) -> None:
    """Create every registry topic with its partition count (idempotent)."""
    from infra.admin import create_topics

    kafka = current_settings(run_dir).kafka
    with broker_admin(run_dir) as admin:
        result = create_topics(admin, replicas=kafka.replication_factor, min_insync=kafka.min_insync_replicas)
    for name, outcome in result.items():
        console.print(f"{outcome:8} {name}")


@topics_app.command("list")
def topics_list(run_dir: RunDirOption = None, output: FormatOption = Format.table) -> None:
    """List the topics on the broker, marking the registry's (columns: topic, partitions, kind)."""
    from infra.admin import existing_partition_counts
    from schemas.topics import TOPICS_BY_NAME

    with broker_admin(run_dir) as admin:
        counts = existing_partition_counts(admin)
    print_rows(("topic", "partitions", "kind"), ((name, counts[name], "registry" if name in TOPICS_BY_NAME
                                                  else "other") for name in sorted(counts)), output)


@topics_app.command("describe")
def topics_describe(run_dir: RunDirOption = None, output: FormatOption = Format.table) -> None:
    """Every registry topic: partitions (expected and actual), records, retention, event kinds (columns: topic,
    partitions, records, retention, events, ok); exit 1 if any topic is not as the registry says."""
    from infra.admin import describe_topics
    from pipeline.runtime.log import KafkaLog

    with broker_admin(run_dir) as admin:
        statuses = describe_topics(admin)
    log = KafkaLog(kafka_of(current_settings(run_dir)), client_id="crl-describe")
    records = {status.topic.name: sum(log.end_offsets(status.topic).values()) for status in statuses
               if status.matches}
    rows = []
    for status in statuses:
        retention = "forever" if status.topic.retention_ms < 0 else f"{status.topic.retention_ms // 3_600_000} h"
        rows.append((status.topic.name, f"{status.partitions}/{status.topic.partitions}",
                     records.get(status.topic.name), retention, ", ".join(status.topic.kinds),
                     "yes" if status.matches else "no"))
    print_rows(("topic", "partitions", "records", "retention", "events", "ok"), rows, output)
    if not all(status.matches for status in statuses):
        raise typer.Exit(1)
