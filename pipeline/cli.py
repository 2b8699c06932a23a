"""`crl`: the command line. Settings are read here, once; errors become exit codes here and nowhere else.

    crl stack up --run-dir runs/demo             # embedded broker + topics, until Ctrl-C
    crl worker archiver --run-dir runs/demo      # any worker kind of the WORKERS registry
    crl doctor --embedded                        # is everything here and working?
    crl audit sql runs/demo "SELECT kind, count(*) FROM events GROUP BY kind"
    crl replay train runs/demo                   # re-run every training step, compare weight hashes
"""

from __future__ import annotations

import csv
import json
import logging
import os
import signal
import sys
import threading
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from pipeline.errors import ConfigError, PipelineError
from pipeline.settings import Settings

console = Console()
errors = Console(stderr=True)

app = typer.Typer(
    help="Complementary RL on an event log: run the stack, run workers, audit runs.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
topics_app = typer.Typer(help="Create and inspect the registry's Kafka topics.", no_args_is_help=True)
stack_app = typer.Typer(help="The embedded broker stack (no Docker needed).", no_args_is_help=True)
audit_app = typer.Typer(help="Read-only DuckDB over a run's Parquet archive.", no_args_is_help=True)
replay_app = typer.Typer(help="Rebuild projections from the log and compare them with the live ones.",
                         no_args_is_help=True)
bank_app = typer.Typer(help="Inspect a run's experience bank.", no_args_is_help=True)
config_app = typer.Typer(help="Run configs: YAML files with the structure of the settings.", no_args_is_help=True)
envs_app = typer.Typer(help="The environment registry.", no_args_is_help=True)
app.add_typer(topics_app, name="topics")
app.add_typer(replay_app, name="replay")
app.add_typer(bank_app, name="bank")
app.add_typer(stack_app, name="stack")
app.add_typer(audit_app, name="audit")
app.add_typer(config_app, name="config")
app.add_typer(envs_app, name="envs")

RunDirOption = Annotated[
    Path | None, typer.Option("--run-dir", help="Run directory (default: CRL_RUN_DIR or runs/default).")
]


class _State:
    settings: Settings | None = None
    log_level: str = "warning"


def _configure_logging(level: str, log_file: Path | None = None) -> None:
    """Log to stderr at `level`; with `log_file`, also everything from INFO up into that file (the worker's log)."""
    formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s")
    console_handler = logging.StreamHandler(sys.stderr)
    console_handler.setLevel(level.upper())
    # kafka-python logs every failed connection attempt while it retries; the console shows our own summary of a
    # failure instead (the worker's log file keeps kafka-python's lines).
    console_handler.addFilter(lambda record: not record.name.startswith("kafka") or record.levelno >= logging.CRITICAL)
    handlers: list[logging.Handler] = [console_handler]
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(log_file)
        file_handler.setLevel(logging.INFO)
        handlers.append(file_handler)
    for handler in handlers:
        handler.setFormatter(formatter)
    root_level = min(console_handler.level, logging.INFO if log_file else console_handler.level)
    logging.basicConfig(level=root_level, handlers=handlers, force=True)
    # kafka-python is chatty at INFO (every connection); its warnings and errors still show.
    logging.getLogger("kafka").setLevel(max(logging.WARNING, root_level))


def _settings(run_dir: Path | None = None) -> Settings:
    settings = _State.settings
    assert settings is not None, "the app callback loads settings first"
    if run_dir is not None:
        settings = settings.model_copy(update={"run_dir": run_dir})
    return settings


def _fail(message: str, code: int = 1) -> typer.Exit:
    errors.print(f"[red]error:[/red] {message}")
    return typer.Exit(code)


class LogLevel(str, Enum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


@app.callback()
def _load(
    log_level: Annotated[LogLevel, typer.Option(help="Console logging level (worker log files always get info).")]
    = LogLevel.warning,
    config: Annotated[Path | None, typer.Option(
        help="Run config (YAML); same as CRL_CONFIG. CRL_* variables override it.")] = None,
) -> None:
    """Read settings from CRL_* environment variables (validated field by field)."""
    # Nothing may reach a model hub at run time; set before any Hugging Face library is imported.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    _State.log_level = log_level.value
    _configure_logging(log_level.value)
    if "CRL_TANSU_BIN" in os.environ:
        errors.print("[yellow]warning:[/yellow] CRL_TANSU_BIN is ignored; the setting is now CRL_BROKER__TANSU_BIN")
    try:
        _State.settings = Settings(config=config) if config is not None else Settings()
    except ConfigError as exc:
        errors.print(f"[red]invalid settings:[/red] {exc}")
        raise typer.Exit(2) from exc
    except ValidationError as exc:
        errors.print("[red]invalid settings:[/red]")
        for item in exc.errors(include_url=False):
            field = "CRL_" + "__".join(str(part) for part in item["loc"]).upper()
            errors.print(f"  {field}: {item['msg']}")
        raise typer.Exit(2) from exc


# -- topics ---------------------------------------------------------------------------------------------------------


@topics_app.command("create")
def topics_create(run_dir: RunDirOption = None) -> None:
    """Create every registry topic with its partition count (idempotent)."""
    from infra.admin import TopicMismatchError, create_topics
    from infra.kafka import make_admin

    admin = _admin(run_dir, make_admin)
    try:
        result = create_topics(admin)
    except TopicMismatchError as exc:
        raise _fail(str(exc)) from exc
    finally:
        admin.close()
    for name, outcome in result.items():
        console.print(f"{outcome:8} {name}")


@topics_app.command("list")
def topics_list(run_dir: RunDirOption = None) -> None:
    """List the topics on the broker, marking the registry's."""
    from infra.admin import existing_partition_counts
    from infra.kafka import make_admin
    from schemas.topics import TOPICS_BY_NAME

    admin = _admin(run_dir, make_admin)
    try:
        counts = existing_partition_counts(admin)
    finally:
        admin.close()
    for name in sorted(counts):
        marker = "registry" if name in TOPICS_BY_NAME else "other"
        console.print(f"{name:24} {counts[name]:3} partitions  {marker}")


@topics_app.command("describe")
def topics_describe(run_dir: RunDirOption = None) -> None:
    """Every registry topic: partitions (expected and actual), records, retention, event kinds."""
    from infra.admin import describe_topics
    from infra.kafka import make_admin, make_consumer

    settings = _settings(run_dir)
    admin = _admin(run_dir, make_admin)
    consumer = make_consumer(_kafka(settings), client_id="crl-describe")
    try:
        statuses = describe_topics(admin, consumer)
    finally:
        admin.close()
        consumer.close(autocommit=False)
    table = Table("topic", "partitions", "records", "retention", "events", "ok")
    for status in statuses:
        retention = "forever" if status.topic.retention_ms < 0 else f"{status.topic.retention_ms // 3_600_000} h"
        table.add_row(
            status.topic.name,
            f"{status.partitions}/{status.topic.partitions}",
            "-" if status.messages is None else str(status.messages),
            retention,
            ", ".join(status.topic.kinds),
            "[green]yes[/green]" if status.matches else "[red]no[/red]",
        )
    console.print(table)
    if not all(status.matches for status in statuses):
        raise typer.Exit(1)


def _kafka(settings: Settings) -> Any:
    try:
        return settings.resolve_kafka()
    except ConfigError as exc:
        raise _fail(str(exc), 2) from exc


def _admin(run_dir: Path | None, make_admin: Any) -> Any:
    from kafka.errors import KafkaError

    kafka = _kafka(_settings(run_dir))
    try:
        return make_admin(kafka)
    except KafkaError as exc:
        raise _fail(f"cannot reach Kafka at {kafka.bootstrap_servers}: {exc}") from exc


# -- stack ----------------------------------------------------------------------------------------------------------


class BrokerChoice(str, Enum):
    tansu = "tansu"
    kafka = "kafka"


BrokerOption = Annotated[BrokerChoice | None, typer.Option(
    "--broker", help="Embedded broker: tansu (memory-only, starts in ms) or kafka (Apache Kafka 4.1.1, Java 17, "
    "durable). Default: CRL_BROKER__KIND, else tansu.")]


def _with_broker(settings: Settings, broker: BrokerChoice | None) -> Settings:
    if broker is None:
        return settings
    return settings.model_copy(update={"broker": settings.broker.model_copy(update={"kind": broker.value})})


@stack_app.command("up")
def stack_up(
    run_dir: RunDirOption = None,
    port: Annotated[int | None, typer.Option(help="Loopback port for the broker (default: a free one).")] = None,
    broker_kind: BrokerOption = None,
) -> None:
    """Start the embedded broker, create every topic, print the bootstrap address, and run until Ctrl-C."""
    from infra.admin import create_topics
    from infra.broker import BrokerError, embedded_broker
    from infra.kafka import make_admin
    from pipeline.settings import BROKER_FILE, write_broker_file

    settings = _with_broker(_settings(run_dir), broker_kind)
    try:
        broker = embedded_broker(settings.broker, data_dir=settings.run_dir / "kafka",
                                 log_path=settings.run_dir / "logs" / "broker.log", port=port)
        with errors.status(f"starting {broker.description}"):
            broker.start()
    except BrokerError as exc:
        raise _fail(str(exc)) from exc
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        admin = make_admin(settings.with_bootstrap(broker.bootstrap_servers).kafka)
        try:
            create_topics(admin)
        finally:
            admin.close()
        write_broker_file(settings.run_dir, broker.bootstrap_servers, broker.pid, broker.kind)
        memory = broker.resident_memory_bytes()
        console.print(f"broker  {broker.bootstrap_servers}  ({broker.description} pid {broker.pid}, started in "
                      f"{broker.start_seconds:.2f}s, {(memory or 0) / 2**20:.0f} MiB resident, log {broker.log_path})")
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
                raise _fail("the broker exited unexpectedly; see its log")
    finally:
        broker.stop()
        (settings.run_dir / BROKER_FILE).unlink(missing_ok=True)
    console.print("broker stopped")


# -- workers --------------------------------------------------------------------------------------------------------


@app.command("worker")
def worker(
    name: Annotated[str, typer.Argument(help="Worker kind, a key of the WORKERS registry (e.g. archiver).")],
    run_dir: RunDirOption = None,
    instance: Annotated[str | None, typer.Option(help="Instance name (default: NAME-host-pid).")] = None,
    max_events: Annotated[int | None, typer.Option(help="Stop after this many input events.")] = None,
    timeout: Annotated[float | None, typer.Option(help="Stop after this many seconds.")] = None,
) -> None:
    """Run one worker until SIGTERM / Ctrl-C (it finishes the current event, flushes and commits first)."""
    from pipeline.launch import build_runner, default_instance, load_worker_registry
    from pipeline.runner import Limits

    settings = _settings(run_dir)
    try:
        registry = load_worker_registry()
    except ConfigError as exc:
        raise _fail(str(exc), 2) from exc
    if name not in registry:
        raise _fail(f"unknown worker {name!r}; known workers: {', '.join(sorted(registry))}", 2)
    instance = instance or default_instance(name)
    _configure_logging(_State.log_level, settings.run_dir / "logs" / f"{instance}.log")
    from kafka.errors import KafkaError

    try:
        runner = build_runner(registry[name], settings, instance=instance,
                              limits=Limits(max_events=max_events, timeout_s=timeout))
        runner.install_signal_handlers()
        with errors.status(f"{name}: starting") as status:
            runner.on_progress = lambda m: status.update(
                f"{name} ({instance}): in {m.events_in}  out {m.events_out}  dead letters {m.dead_letters}"
                f"  retries {m.retries}  commits {m.commits}  lag {sum(m.lag.values())}"
            )
            metrics = runner.run()
    except ConfigError as exc:
        raise _fail(str(exc), 2) from exc
    except PipelineError as exc:
        raise _fail(f"{type(exc).__name__}: {exc}") from exc
    except KafkaError as exc:
        raise _fail(f"Kafka at {settings.resolve_kafka().bootstrap_servers} failed: {type(exc).__name__}: {exc}"
                    " (is the broker running? `crl doctor` checks)") from exc
    console.print(f"{name} stopped ({runner.stop_reason or 'finished'}): {json.dumps(metrics.snapshot())}")


# -- run ------------------------------------------------------------------------------------------------------------


class ArmChoice(str, Enum):
    complementary = "complementary"
    grpo = "grpo"
    static_extractor = "static_extractor"
    exp_only = "exp_only"


@app.command("run")
def run(
    config: Annotated[Path, typer.Argument(help="Run config (YAML), e.g. configs/tiny-minihack-room.yaml.")],
    run_dir: RunDirOption = None,
    steps: Annotated[int | None, typer.Option(help="Override scheduler.steps (e.g. 3 for a smoke run).")] = None,
    arm: Annotated[ArmChoice | None, typer.Option(help="Override scheduler.arm (paper baselines).")] = None,
    report: Annotated[bool, typer.Option(help="Write the report (RUN_DIR/report) at the end.")] = True,
    broker_kind: BrokerOption = None,
) -> None:
    """Run Complementary RL end to end: broker, topics, every worker, live progress, drain, stop, report."""
    from kafka.errors import KafkaError

    from infra.broker import BrokerError
    from pipeline.supervisor import RunFailed, RunSupervisor, check_run_dir, default_run_dir

    overrides = {}
    if steps is not None:
        overrides["CRL_SCHEDULER__STEPS"] = str(steps)
    if arm is not None:
        overrides["CRL_SCHEDULER__ARM"] = arm.value
    if broker_kind is not None:
        overrides["CRL_BROKER__KIND"] = broker_kind.value
    chosen_dir = run_dir or (Path(os.environ["CRL_RUN_DIR"]) if "CRL_RUN_DIR" in os.environ
                             else default_run_dir(config))
    os.environ.update(overrides)  # this is the settings edge: the workers get the same overrides
    os.environ["CRL_RUN_DIR"] = str(chosen_dir)
    try:
        settings = Settings(config=config)
        check_run_dir(settings.run_dir)
    except ConfigError as exc:
        raise _fail(str(exc), 2) from exc
    except ValidationError as exc:
        raise _fail(f"invalid settings: {exc}", 2) from exc
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    _configure_logging(_State.log_level, settings.run_dir / "logs" / "crl-run.log")
    console.print(f"run {settings.resolved_run_id}: arm {settings.scheduler.arm}, {settings.scheduler.steps} steps, "
                  f"{', '.join(t.env_id for t in settings.scheduler.tasks)}; run dir {settings.run_dir}")
    supervisor = RunSupervisor(settings, config, overrides, console)
    try:
        progress = supervisor.run()
    except (RunFailed, BrokerError, KafkaError) as exc:
        raise _fail(f"run failed: {exc}") from exc
    finished = progress.finished
    status = finished.status if finished is not None else "interrupted"
    console.print(f"run {settings.resolved_run_id} {status}: {supervisor.summary_line()}", highlight=False,
                  soft_wrap=True)
    if report:
        from pipeline.report import summary_line, write_report

        written = write_report([settings.run_dir])
        for line in written.runs:
            console.print(summary_line(line), markup=False, highlight=False, soft_wrap=True)
        console.print(f"report: {written.html}")
    some = next((e.experience_id for e in progress.bank.experiences.values() if len(e.history) > 1), None) or \
        next(iter(progress.bank.experiences), "EXPERIENCE_ID")
    console.print("next:", highlight=False)
    bank_lines = [f"crl replay bank {settings.run_dir}", f"crl bank show {settings.run_dir}",
                  f"crl audit experience {settings.run_dir} {some}"] if settings.scheduler.arm != "grpo" else []
    for line in (*bank_lines, f"crl replay train {settings.run_dir}",
                 f"crl audit sql {settings.run_dir} \"SELECT step, guided, avg(success::INT) FROM trajectories "
                 "WHERE split = 'train' GROUP BY ALL ORDER BY ALL\"",
                 f"crl report {settings.run_dir} runs/OTHER --out runs/compare"):
        console.print(f"  {line}", markup=False, highlight=False, soft_wrap=True)
    if status != "completed":
        raise typer.Exit(130 if status == "interrupted" or supervisor.interrupts else 1)


# -- doctor ---------------------------------------------------------------------------------------------------------


@app.command("doctor")
def doctor(
    embedded: Annotated[bool, typer.Option("--embedded", help="Start a throwaway embedded broker to check.")] = False,
    run_dir: RunDirOption = None,
    broker_kind: BrokerOption = None,
) -> None:
    """Check broker, its limits, topics, a Kafka round trip of every event kind, SQL, embedding model and NLE; exit 1
    on any failure."""
    from pipeline.doctor import run_checks

    checks = run_checks(_with_broker(_settings(run_dir), broker_kind), embedded=embedded)
    table = Table("check", "result", "detail")
    for check in checks:
        table.add_row(check.name, "[green]ok[/green]" if check.ok else "[red]FAIL[/red]", check.detail)
    console.print(table)
    failed = [check for check in checks if not check.ok]
    console.print(f"{len(checks) - len(failed)} passed, {len(failed)} failed")
    if failed:
        raise typer.Exit(1)


# -- audit ----------------------------------------------------------------------------------------------------------


def _print_rows(columns: list[str], rows: list[tuple[Any, ...]], output: str) -> None:
    if output == "csv":
        writer = csv.writer(sys.stdout)
        writer.writerow(columns)
        writer.writerows(rows)
    elif output == "json":
        for row in rows:
            sys.stdout.write(json.dumps(dict(zip(columns, row, strict=True)), default=str) + "\n")
    else:
        table = Table(*columns)
        for row in rows:
            table.add_row(*("" if value is None else str(value) for value in row))
        console.print(table)
        console.print(f"{len(rows)} rows")


def _open_audit(run_dir: Path) -> Any:
    from pipeline.audit import Audit

    if not run_dir.is_dir():
        raise _fail(f"no run directory at {run_dir}", 2)
    return Audit(run_dir)


FormatOption = Annotated[str, typer.Option("--format", help="table, csv or json (one object per line).")]


@audit_app.command("sql")
def audit_sql(
    run_dir: Annotated[Path, typer.Argument(help="Run directory with an archive/ folder.")],
    sql: Annotated[str, typer.Argument(help="One SELECT over the views (`events`, `trajectory_completed`, ...).")],
    output: FormatOption = "table",
) -> None:
    """Run one read-only SQL statement over the run's archive. Views: events, one per event kind, trajectories,
    train_steps, policy_versions and the experience views."""
    from pipeline.audit import EXPERIENCE_VIEWS, RUN_VIEWS, Audit, AuditQueryError

    with _open_audit(run_dir) as audit:
        try:
            columns, rows = audit.query(sql)
        except AuditQueryError as exc:
            views = [*Audit.view_names(), *RUN_VIEWS, *EXPERIENCE_VIEWS]
            raise _fail(f"{exc}\nviews: {', '.join(views)}") from exc
    _print_rows(columns, rows, output)


@audit_app.command("events")
def audit_events(
    run_dir: Annotated[Path, typer.Argument(help="Run directory with an archive/ folder.")],
    kind: Annotated[str | None, typer.Option(help="Only this event kind, e.g. TrajectoryCompleted.")] = None,
    limit: Annotated[int, typer.Option(help="At most this many rows.")] = 20,
    output: FormatOption = "table",
) -> None:
    """Print archived events in time order (envelope, coordinates, start of the payload)."""
    from pipeline.audit import AuditQueryError

    with _open_audit(run_dir) as audit:
        try:
            columns, rows = audit.recent_events(kind, limit)
        except AuditQueryError as exc:
            raise _fail(str(exc)) from exc
    _print_rows(columns, rows, output)


@audit_app.command("experience", help=(
    "The whole history of one experience, from the archive alone (no bank database needed): every version's text "
    "with the op that wrote it (kind, op id, offset, generation, extractor version, source trajectories), the merges "
    "into and out of it, its retirement, how often it was served and how the episodes it guided went. The op log is "
    "replayed with the bank's own rules, so rejected and repeated ops do not show."
))
def audit_experience(
    run_dir: Annotated[Path, typer.Argument(help="Run directory with an archive/ folder.")],
    experience_id: Annotated[str, typer.Argument(help="Experience id, e.g. exp-1.")],
    episodes: Annotated[int, typer.Option(help="List at most this many of the episodes it guided (the latest).")]
    = 20,
) -> None:
    """The whole history of one experience, from the archive alone (no bank database needed)."""
    from rich.markup import escape

    with _open_audit(run_dir) as audit:
        record = audit.experience_record(experience_id)
        log_id = audit.op_log_id
    if record is None:
        if log_id is None:
            raise _fail(f"no experience {experience_id}: the archive of {run_dir} holds no experience ops")
        raise _fail(f"no experience {experience_id} in the archive of {run_dir} (op log {log_id})")

    def say(text: str) -> None:
        # Experience texts are free text: no markup, no wrapping inside them.
        console.print(text, markup=False, highlight=False, soft_wrap=True)

    state = record.state
    status = state["status"]
    if record.merged_into is not None:
        into = record.merged_into
        status += (f": merged into {into['merged_id']} at version {into['source_version']} by {into['op_id']}"
                   f" at offset {into['op_offset']}")
    elif state["retired_reason"] is not None:
        status += f": {state['retired_reason']}, by {state['retired_op_id']} at offset {state['retired_offset']}"
    say(f"{experience_id}  family {state['task_family']}  version {state['version']}  {status}")
    if record.merged_from:
        sources = ", ".join(f"{row['source_id']} v{row['source_version']}" for row in record.merged_from)
        say(f"merged from {sources} by {record.merged_from[0]['op_id']} at offset {record.merged_from[0]['op_offset']}")
    say(f"op log {log_id} (replayed from the archive)")

    console.print("\n[bold]versions[/bold]")
    for version in record.versions:
        sources = json.loads(version["source_trajectory_ids"])
        say(f"v{version['version']}  {version['op_kind']} {version['op_id']} at offset {version['op_offset']}  "
            f"generation {version['generation_id']} (extractor {version['extractor_version']})  "
            f"sources {', '.join(sources) if sources else '-'}  {version['occurred_at']:%Y-%m-%d %H:%M:%S}")
        say(f"    {version['text']}")

    console.print("\n[bold]episodes guided[/bold]")
    if not record.episodes:
        say("never served")
        return
    served = len(record.episodes)
    say(f"served {state['retrievals']} times: {record.successes} succeeded, {served - record.successes} failed "
        f"(success rate {record.success_rate:.1%}), mean reward {record.mean_reward:.3f}")
    for version in record.versions:
        guided = [row for row in record.episodes if row["version"] == version["version"]]
        if guided:
            wins = sum(1 for row in guided if row["success"])
            say(f"  v{version['version']} served {len(guided)} times, success rate {wins / len(guided):.1%}")
    shown = record.episodes[-episodes:] if episodes > 0 else []
    table = Table("trajectory", "step", "version", "success", "reward",
                  title=f"latest {len(shown)} of {served} episodes" if len(shown) < served else None)
    for row in shown:
        table.add_row(escape(row["trajectory_id"]), str(row["step"]), str(row["version"]),
                      "yes" if row["success"] else "no", f"{row['reward']:g}")
    console.print(table)


# -- bank -----------------------------------------------------------------------------------------------------------


def _bank_store(run_dir: Path) -> Any:
    from infra.db import database_url, make_engine, migrate
    from pipeline.bank.store import BankStore

    if not run_dir.is_dir():
        raise _fail(f"no run directory at {run_dir}", 2)
    engine = make_engine(database_url(_settings(run_dir).db, run_dir))
    migrate(engine)
    return BankStore(engine)


@replay_app.command("bank")
def replay_bank(
    run_dir: Annotated[Path, typer.Argument(help="Run directory (archive, SQL bank, snapshots).")],
    from_kafka: Annotated[bool, typer.Option("--from-kafka", help="Read the op log from Kafka, not the archive.")]
    = False,
    log_id: Annotated[str | None, typer.Option(help="Which archived op log (default: the live bank's).")] = None,
) -> None:
    """Rebuild the bank from offset 0 and compare its hash with the live SQL position and the newest snapshot."""
    from pipeline.bank.replay import Checkpoint, archived_logs, ops_from_archive, ops_from_kafka, replay
    from pipeline.bank.snapshots import restore_newest, snapshots_root
    from schemas.topics import EXPERIENCE_OPS_TOPIC

    store = _bank_store(run_dir)
    live = store.position(EXPERIENCE_OPS_TOPIC.name, 0)
    if from_kafka:
        from infra.admin import topic_ids
        from infra.kafka import make_admin

        kafka = _kafka(_settings(run_dir))
        admin = make_admin(kafka)
        try:
            chosen = topic_ids(admin, [EXPERIENCE_OPS_TOPIC.name])[EXPERIENCE_OPS_TOPIC.name]
        finally:
            admin.close()
        ops = ops_from_kafka(kafka)
        source = f"crl.experience-ops on Kafka (log {chosen})"
    else:
        logs = archived_logs(run_dir)
        chosen = log_id or (live.log_id if live else None) or (logs[0][0] if logs else None)
        if chosen is None:
            raise _fail(f"the archive of {run_dir} holds no experience ops", 1)
        ops = ops_from_archive(run_dir, chosen)
        source = f"the archive (log {chosen})"
    problems: list[str] = []
    checkpoints = []
    if live is not None and live.log_id == chosen:
        checkpoints.append(Checkpoint("live SQL bank", live.next_offset, live.state_hash))
        try:
            store.load_state()  # the stored rows themselves must hash to the recorded position
        except ValueError as exc:
            problems.append(f"live SQL rows: {exc}")
    elif live is not None:
        console.print(f"the live bank follows log {live.log_id}, not {chosen}: no comparison with it")
    restored = restore_newest(snapshots_root(run_dir), chosen)  # verified: file sha256s and the state hash
    if restored is not None:
        snapshot, snapshot_state = restored
        checkpoints.append(Checkpoint(f"snapshot {snapshot.name}", snapshot_state.next_offset,
                                      snapshot_state.state_hash()))
    result = replay(ops, checkpoints)
    state = result.state
    console.print(f"replayed {source}")
    console.print(f"ops {result.ops} applied {state.applied} duplicates {state.duplicates} "
                  f"rejected {state.rejected} state_hash {state.state_hash()}")
    table = Table("compared with", "offset", "recorded", "replay", "match")
    for checkpoint in checkpoints:
        replayed = result.hashes.get(checkpoint.name)
        table.add_row(checkpoint.name, str(checkpoint.next_offset), checkpoint.state_hash[:16],
                      (replayed or "log ended before")[:16],
                      "[green]yes[/green]" if replayed == checkpoint.state_hash else "[red]NO[/red]")
    if checkpoints:
        console.print(table)
    problems += result.mismatches(checkpoints)
    for problem in problems:
        errors.print(f"[red]mismatch:[/red] {problem}")
    if problems:
        raise typer.Exit(1)


class TrainRole(str, Enum):
    actor = "actor"
    extractor = "extractor"


@replay_app.command("train")
def replay_train(
    run_dir: Annotated[Path, typer.Argument(help="Run directory (archive and checkpoints).")],
    role: Annotated[TrainRole | None, typer.Option(help="Only this role (default: both).")] = None,
) -> None:
    """Re-run every recorded training step from the archive and the initial checkpoint; compare weight hashes."""
    from pipeline.training_replay import StepCheck, replay_training

    if not run_dir.is_dir():
        raise _fail(f"no run directory at {run_dir}", 2)
    failed = False
    for chosen in [role.value] if role is not None else ["actor", "extractor"]:
        table = Table("role", "step", "version", "recorded", "replay", "match")

        def row(check: StepCheck, chosen: str = chosen) -> None:
            table.add_row(chosen, str(check.step), str(check.version), check.recorded[:16], check.replayed[:16],
                          "[green]yes[/green]" if check.ok else "[red]NO[/red]")

        with console.status(f"replaying {chosen} steps"):
            report = replay_training(run_dir, chosen, on_step=row)  # type: ignore[arg-type]
        if report.checks:
            console.print(table)
        if report.ok:
            console.print(f"{chosen}: {len(report.checks)} steps replayed, every weight hash matches")
        elif not report.checks and report.problem and report.problem.startswith("no PolicyPublished") and role is None:
            console.print(f"{chosen}: nothing recorded ({report.problem})")
        else:
            errors.print(f"[red]mismatch:[/red] {chosen}: {report.problem}")
            failed = True
            break
    if failed:
        raise typer.Exit(1)


@bank_app.command("show")
def bank_show(
    run_dir: Annotated[Path, typer.Argument(help="Run directory.")],
    experience_id: Annotated[str | None, typer.Argument(help="One experience: every version and its op.")] = None,
    family: Annotated[str | None, typer.Option(help="Only this task family.")] = None,
    all_statuses: Annotated[bool, typer.Option("--all", help="Include retired experiences.")] = False,
) -> None:
    """List the bank's experiences, or show one with its whole version history."""
    store = _bank_store(run_dir)
    if experience_id is None:
        rows = store.experiences(status=None if all_statuses else "active", task_family=family)
        table = Table("experience", "family", "v", "status", "served", "trained", "text")
        for row in rows:
            table.add_row(row["experience_id"], row["task_family"], str(row["version"]), row["status"],
                          str(row["retrievals"]), str(row["trainings"]), row["text"][:90])
        console.print(table)
        position = store.position("crl.experience-ops", 0)
        if position is not None:
            console.print(f"{len(rows)} experiences; bank at offset {position.next_offset}, "
                          f"state_hash {position.state_hash}")
        return
    row = store.experience(experience_id)
    if row is None:
        raise _fail(f"no experience {experience_id} in {run_dir}", 1)
    console.print(f"[bold]{row['experience_id']}[/bold]  family {row['task_family']}  version {row['version']}  "
                  f"{row['status']}" + (f" ({row['retired_reason']}, merged into {row['merged_into']})"
                                        if row["merged_into"] else f" ({row['retired_reason']})"
                                        if row["retired_reason"] else ""))
    if row["parents"]:
        console.print(f"merged from {', '.join(row['parents'])}")
    console.print(f"served {row['retrievals']} times, trained {row['trainings']} times")
    table = Table("v", "op", "offset", "generation", "extractor", "sources", "text")
    for version in store.versions(experience_id):
        table.add_row(str(version["version"]), f"{version['op_kind']} {version['op_id']}", str(version["op_offset"]),
                      version["generation_id"], str(version["extractor_version"]),
                      ", ".join(version["source_trajectory_ids"]), version["text"])
    console.print(table)


# -- report ---------------------------------------------------------------------------------------------------------


@app.command("report")
def report(
    run_dirs: Annotated[list[Path], typer.Argument(help="Run directories; several overlay as lines per run and arm.")],
    out: Annotated[Path | None, typer.Option(
        "--out", help="Output directory (default: RUN_DIR/report for one run; required for several).")] = None,
) -> None:
    """Write report.html and PNG curves (success, actions, bank, extractor, retrieval) from the runs' archives."""
    from pipeline.report import summary_line, write_report

    for run_dir in run_dirs:
        if not run_dir.is_dir():
            raise _fail(f"no run directory at {run_dir}", 2)
    if out is None and len(run_dirs) > 1:
        raise _fail(f"{len(run_dirs)} runs need an output directory: pass --out DIR", 2)
    with console.status(f"reading {len(run_dirs)} run(s) and drawing"):
        written = write_report(run_dirs, out)
    for line in [*map(summary_line, written.runs), *(f"wrote {path}" for path in (written.html, *written.figures))]:
        console.print(line, markup=False, highlight=False, soft_wrap=True)


# -- config and envs ------------------------------------------------------------------------------------------------


@config_app.command("show")
def config_show(
    config: Annotated[Path | None, typer.Argument(help="Run config; default: --config / CRL_CONFIG.")] = None,
) -> None:
    """Print the resolved settings (the file, CRL_* overrides, defaults) as YAML, passwords masked."""
    import yaml

    from pipeline.provenance import resolved_config

    settings = _settings() if config is None else _config_settings(config)
    console.print(yaml.safe_dump(resolved_config(settings), sort_keys=False), end="", markup=False, highlight=False)


@config_app.command("check")
def config_check(configs: Annotated[list[Path], typer.Argument(help="Run config files.")]) -> None:
    """Validate run configs; exit 1 naming every invalid one and why."""
    failed = 0
    for path in configs:
        try:
            settings = _config_settings(path)
        except typer.Exit:
            failed += 1
            continue
        tasks = ", ".join(t.env_id for t in settings.scheduler.tasks)
        console.print(f"[green]ok[/green]      {path}  arm {settings.scheduler.arm}, {settings.scheduler.steps} steps, "
                      f"{tasks}")
    if failed:
        raise _fail(f"{failed} of {len(configs)} configs are invalid")


def _config_settings(path: Path) -> Settings:
    try:
        return Settings(config=path)
    except ConfigError as exc:
        errors.print(f"[red]invalid[/red] {path}: {exc}")
        raise typer.Exit(2) from exc
    except ValidationError as exc:
        errors.print(f"[red]invalid[/red] {path}:")
        for item in exc.errors(include_url=False):
            errors.print(f"  {'.'.join(str(part) for part in item['loc'])}: {item['msg']}")
        raise typer.Exit(2) from exc


@envs_app.command("list")
def envs_list() -> None:
    """Every env id with its task family, paper turn limit and whether it runs on this machine."""
    from pipeline.envs.registry import ENV_SPECS

    table = Table("env id", "task family", "max turns", "runs here")
    for spec in ENV_SPECS.values():
        table.add_row(spec.env_id, spec.task_family, str(spec.max_turns),
                      "yes" if spec.runs_here else "needs data/Docker")
    console.print(table)


@envs_app.command("show")
def envs_show(
    env_id: Annotated[str, typer.Argument(help="An env id of `crl envs list`.")],
    seed: Annotated[int, typer.Option(help="Task seed.")] = 0,
    actions: Annotated[list[str] | None, typer.Option("--action", help="Actions to play, in order.")] = None,
) -> None:
    """Reset an environment from a seed, play the given actions, and print what the agent sees at each turn."""
    from pipeline.envs.registry import make_env

    try:
        env = make_env(env_id, _settings().envs)
    except ConfigError as exc:
        raise _fail(str(exc), 2) from exc
    try:
        goal, observation = env.reset(seed)
        console.print(f"[bold]Goal:[/bold] {goal}", markup=True)
        console.print(observation, markup=False, highlight=False)
        for action in actions or []:
            outcome = env.step(action)
            console.print(f"[bold]> {action}[/bold]  valid {outcome.info.valid}, reward {outcome.reward}, "
                          f"done {outcome.done}, success {outcome.info.success}")
            console.print(outcome.observation, markup=False, highlight=False)
            if outcome.done:
                break
    finally:
        env.close()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
