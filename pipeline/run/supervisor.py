"""`crl run CONFIG`: one command that runs Complementary RL end to end on one machine.

    crl run configs/tiny-minihack-room.yaml                 # embedded broker, every worker, live progress, report
    crl run configs/tiny-minihack-room.yaml --steps 3 --arm grpo --run-dir runs/grpo-3

What it does, in order:
1. uses the Kafka named by `CRL_KAFKA__BOOTSTRAP_SERVERS`, or starts the embedded broker (`--broker tansu`, the
   default, memory-only; or `--broker kafka`, Apache Kafka with its log in `RUN_DIR/kafka/`) and writes
   `broker.json` into the run directory; creates every topic; with `--security sasl_ssl` the embedded Apache Kafka
   serves TLS and SCRAM logins only, `crl run` logs in as the admin and grants each worker kind's principal the ACLs
   of its declarations (`pipeline.run.security`), and each worker process logs in as its kind;
2. starts every worker kind of the `crl.workers` registry the arm needs as `crl worker` subprocesses, consumers
   first and the scheduler last (`pipeline.run.plan` derives the kinds, their order and their counts, such as
   `launch.rollout_workers`, from what each kind declares; the `grpo` arm has no bank, extractor or extractor
   trainer; a trainer with `ranks` above 1 runs under torchrun as that many data-parallel ranks), each in its own
   session so a terminal Ctrl-C reaches only this process, each with its log under
   `logs/` (pids in `workers.json`);
3. follows every topic from offset 0 and shows the run live: step, success of guided and free episodes, evaluation,
   bank size (the op log applied with the bank's own rules), op mix, parse statuses, extractor reward, and per worker
   its state, restarts, events and lag (from the metrics every worker writes under `metrics/`);
4. restarts a worker that exits before the run is over (at most `launch.max_restarts` times each; then the run
   is stopped and marked failed);
5. after `RunFinished`, waits until the run has drained: no new record for a while, and every live worker has
   written two metrics lines since the last one, both with no lag (so the extractor has distilled the last
   trajectories, the trainers have seen them, the bank has applied every op and the archiver has read everything);
6. stops the workers with SIGTERM in the reverse order (each finishes its current event, flushes and commits), the
   archiver last, then the broker; writes the report (`crl report`) and prints the commands to look at the run.

Ctrl-C asks the scheduler to stop (`StopRequested`), then drains and stops as above, so everything that was
recorded is archived; a second Ctrl-C stops the workers without waiting for the drain (each still flushes and
commits what it has).

`crl run --resume RUN_DIR` continues a run that was stopped (Ctrl-C), failed, or died (a crash, a kill). A log that
outlived the run is used as it is: the embedded Apache Kafka, restarted on `RUN_DIR/kafka` (same topics, ids and
offsets), or the external Kafka of `CRL_KAFKA__BOOTSTRAP_SERVERS`. The embedded Tansu keeps records in memory only,
so its log ended with it: a fresh Tansu is started and the archive is restored into it (`pipeline.run.restore`: every
archived record at its offset, the topic ids mapped to the old ones, the consumer groups' positions carried over).
Then it reads the run's settings from `RUN_DIR/config.yaml`, publishes `RunResumed` on `crl.control` (a stop before
it no longer stops the run), and starts the workers, which carry on from their positions and checkpoints; the
scheduler issues only what is missing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import yaml
from rich.console import Console, Group

from infra.admin import create_topics
from infra.broker import EmbeddedBroker, die_with_parent, embedded_broker, remove_broker_file, write_broker_file
from infra.db import database_url, make_engine, migrate
from infra.kafka import make_admin, make_producer
from infra.kafka_cluster import ApacheKafkaCluster
from infra.kafka_security import SecuredBus
from pipeline.actor.schedule import finished_id, scheduled_id
from pipeline.errors import ConfigError, RunFailedError
from pipeline.rl.settings import ActorTrainerSettings, ExtractorTrainerSettings
from pipeline.rl.versions import checkpoints_root, versions_in
from pipeline.run.plan import planned_kinds, worker_command, worker_plan
from pipeline.run.processes import WorkerProcess, last_metrics
from pipeline.run.progress import LogFollower, RunProgress
from pipeline.run.restore import commit_group_positions, restore_log
from pipeline.run.security import grant_worker_acls, worker_bus, worker_principal
from pipeline.run.view import live_view, numbers, summary_line
from pipeline.runtime.launch import load_worker_registry
from pipeline.runtime.log import KafkaLog, events_to_end
from pipeline.settings import Settings
from schemas.base import Producer, Role
from schemas.codec import encode
from schemas.runs import RunFinished, RunResumed, StopRequested
from schemas.topics import CONTROL, RUNS

RUN_CONFIG = "config.yaml"
"""The run's resolved settings in its run directory, read by every worker process of the run."""
LAUNCH_FILE = "launch.json"
"""How the run was launched: which embedded broker it started (none: an external Kafka), for `--resume`."""
QUIET_S = 3.0
"""A drained run has published nothing for at least this long."""
IDLE_THREADS = {"OMP_WAIT_POLICY": "PASSIVE"}
"""What each worker's OpenMP threads (torch's CPU threads) do when they run out of work: sleep, not spin. A run's
workers share the machine's cores (the SmolLM2 configs run four processes of two torch threads each on two cores),
and a thread spinning in one worker holds the core another worker's thread is waiting for (docs/benchmarks.md,
"Idle threads"). Applied where the environment names neither `OMP_WAIT_POLICY` nor `GOMP_SPINCOUNT`."""


class RunSupervisor:
    """Starts the broker and the workers of one run, watches them, and stops everything in order."""

    def __init__(self, settings: Settings, console: Console, resume: bool = False) -> None:
        self.resume = resume
        self.settings = settings
        self._warming_roles: tuple[str, ...] | None = None
        """The trainers that warm-start in this attempt (known before their first progress event; `_warming`)."""
        self.console = console
        self.run_dir = settings.run_dir
        self.run_id = settings.resolved_run_id
        self.broker: EmbeddedBroker | None = None
        self.bus: SecuredBus | None = None
        """The secured bus's logins and certificates (`broker.security` sasl_ssl): the admin's for this process,
        each worker kind's own for its processes."""
        registry = load_worker_registry()
        self.registry = registry
        self.kinds = planned_kinds(settings, registry)
        """The run's worker kinds in start order."""
        self.workers = [WorkerProcess(kind, instance) for kind, instance in worker_plan(settings, registry)]
        self.progress = RunProgress(self.run_id)
        self.follower: LogFollower | None = None
        self.interrupts = 0
        self.started = time.monotonic()
        self.stop_sent = False
        self.lost_nodes: set[int] = set()
        """Nodes of the embedded cluster found dead (each reported once)."""
        self.broker_lost = False
        """The embedded broker died: the workers cannot drain into it, so they get seconds, not a minute, to stop."""

    # -- lifecycle ------------------------------------------------------------------------------------------------

    def run(self) -> RunProgress:
        """Run to the end (or to a stop); returns what happened. Raises `RunFailedError`."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._start_broker()
            self._write_run_config()
            if self.resume:
                self._announce_resume()
            self.follower = LogFollower(self.settings, self.progress).start()
            for worker in self.workers:
                self._spawn(worker)
            try:
                self._watch()
            except RunFailedError as exc:  # a run that started and then failed can be continued
                raise RunFailedError(f"{exc}. {self.resume_hint()}") from exc
        finally:
            try:
                self._stop_workers()
            finally:
                if self.follower is not None:
                    self.follower.stop()
                if self.broker is not None:
                    self.broker.stop()
                    remove_broker_file(self.run_dir)
                for signum, handler in previous.items():
                    signal.signal(signum, handler)
        return self.progress

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.interrupts += 1

    def _watch_broker(self) -> None:
        """Fail the run when the embedded broker is gone; report each node a cluster loses (it carries on)."""
        assert self.broker is not None
        if isinstance(self.broker, ApacheKafkaCluster):
            for node in self.broker.nodes:
                if not node.is_running() and node.node_id not in self.lost_nodes:
                    self.lost_nodes.add(node.node_id)
                    alive = self.broker.brokers - len(self.lost_nodes)
                    self.console.print(f"broker node {node.node_id} exited (see {node.log_path}); the cluster "
                                       f"carries on with {alive} of {self.broker.brokers}", highlight=False)
        if not self.broker.is_running():
            self.broker_lost = True
            logs = self.run_dir / "logs" / ("broker-*.log" if isinstance(self.broker, ApacheKafkaCluster)
                                            else "broker.log")
            raise RunFailedError(f"the broker exited ({self.broker.description}); see {logs}")

    def _start_broker(self) -> None:
        launch = self.run_dir / LAUNCH_FILE
        if self.resume:
            if not launch.is_file():
                raise RunFailedError(f"{self.run_dir} has no {LAUNCH_FILE}: the run was started by a `crl run` that "
                                     "did not record which broker it used, so it cannot be resumed")
            launched = json.loads(launch.read_text())
            embedded = launched["embedded_broker"]
            if embedded is not None:
                self.settings = self.settings.model_copy(update={
                    "broker": self.settings.broker.model_copy(
                        update={"kind": embedded, "brokers": launched.get("brokers", 1)}),
                    "kafka": self.settings.kafka.model_copy(update={"bootstrap_servers": None})})
        if self.settings.kafka.bootstrap_servers and self.settings.broker.security != "none":
            raise ConfigError(f"broker security {self.settings.broker.security!r} secures the embedded broker, and "
                              "CRL_KAFKA__BOOTSTRAP_SERVERS names an external Kafka: its TLS and login are set "
                              "with CRL_KAFKA__SECURITY_PROTOCOL, CRL_KAFKA__SASL_* and CRL_KAFKA__SSL_* "
                              "(docs/deployment.md)")
        if not self.settings.kafka.bootstrap_servers:
            if self.settings.broker.security != "none":
                self.bus = worker_bus(self.run_dir, self.registry)
            self.broker = embedded_broker(self.settings.broker, data_dir=self.run_dir / "kafka",
                                          log_path=self.run_dir / "logs" / "broker.log", security=self.bus)
            with self.console.status(f"starting {self.broker.description}"):
                self.broker.start()
            self.console.print(f"broker {self.broker.description} at {self.broker.bootstrap_servers} "
                               f"(started in {self.broker.start_seconds:.1f}s)", highlight=False)
            self.settings = self.settings.with_bootstrap(self.broker.bootstrap_servers)
            if self.bus is not None:
                self.settings = self.settings.model_copy(
                    update={"kafka": self.bus.client_settings(self.settings.kafka)})
            write_broker_file(self.run_dir, self.broker)
        if not self.resume:
            launch.write_text(json.dumps({"embedded_broker": self.broker.kind if self.broker is not None else None,
                                          "brokers": self.settings.broker.brokers}))
        admin = make_admin(self.settings.kafka, client_id="crl-run")
        try:
            # Waits for every partition's leader (a restarted broker answers before).
            create_topics(admin, replicas=self.settings.kafka.replication_factor,
                          min_insync=self.settings.kafka.min_insync_replicas)
        finally:
            admin.close()
        if self.bus is not None:
            granted = grant_worker_acls(self.settings.kafka, self.registry)
            self.console.print(f"secured: TLS and SCRAM-SHA-512 logins, {granted} ACLs for {len(self.registry)} "
                               f"worker principals (credentials in {self.bus.directory})", highlight=False)
        if self.resume and self.broker is not None and self.broker.kind == "tansu":
            self._restore_log()

    def _restore_log(self) -> None:
        """Write the archived log into the fresh Tansu (same topics, partitions and offsets) and carry the run's
        positions over to it (`pipeline.run.restore`)."""
        engine = make_engine(database_url(self.settings.db, self.run_dir))
        try:
            migrate(engine)
            with self.console.status("restoring the log from the archive"):
                started = time.monotonic()
                restored = restore_log(self.run_dir, self.settings.kafka, engine,
                                       claim_check_bytes=self.settings.claim_check_bytes)
            self.settings = self.settings.model_copy(update={
                "kafka": self.settings.kafka.model_copy(update={"log_aliases": restored.aliases})})
            commit_group_positions(self.settings.kafka, restored.group_positions)
        finally:
            engine.dispose()
        notes = [f"{restored.from_dead_letters} from dead letters"] if restored.from_dead_letters else []
        if restored.bank_rebuilt:
            notes.append("the bank had read past the archive and rebuilds from offset 0")
        if restored.snapshots_dropped:
            notes.append(f"{restored.snapshots_dropped} bank snapshots past the archive removed")
        for role, versions in restored.checkpoints_dropped.items():
            notes.append(f"{role} versions {', '.join(map(str, versions))} were trained on records past the archive: "
                         "removed, to be trained again")
        self.console.print(f"restored {restored.records} records from the archive into the fresh broker in "
                           f"{time.monotonic() - started:.1f}s" + (f" ({'; '.join(notes)})" if notes else ""),
                           highlight=False)

    def _announce_resume(self) -> None:
        """Publish `RunResumed` for the next attempt, after reading how the previous one ended."""
        log_ = KafkaLog(self.settings.kafka, client_id="crl-run")
        ours = [e for topic in (RUNS, CONTROL) for e in events_to_end(log_, topic) if e.run_id == self.run_id]
        attempt = sum(1 for e in ours if isinstance(e, RunResumed))
        last = finished_id(self.run_id, attempt)
        ended = next((e for e in ours if isinstance(e, RunFinished) and e.event_id == last), None)
        if ended is not None and ended.status == "completed":
            raise RunFailedError(f"run {self.run_id} completed already ({ended.steps_completed} steps); "
                                 "nothing to resume")
        previous = ended.status if ended is not None else "interrupted"
        event = RunResumed(event_id=scheduled_id(self.run_id, f"resumed-{attempt + 1}"), run_id=self.run_id,
                           producer=Producer(worker="crl-run", instance=f"crl-run-{os.getpid()}"),
                           attempt=attempt + 1, previous_status=previous)
        producer = make_producer(self.settings.kafka, client_id="crl-run")
        try:
            producer.send(CONTROL.name, key=CONTROL.key_bytes(event), value=encode(event))
            producer.flush()
        finally:
            producer.close()
        self.progress.attempt = attempt + 1
        self.console.print(f"resuming run {self.run_id} (attempt {attempt + 1}; the previous one {previous})")

    def resume_hint(self) -> str:
        """How to continue this run."""
        return f"Continue it with: crl run --resume {self.run_dir}"

    @property
    def run_config(self) -> Path:
        return self.run_dir / RUN_CONFIG

    def _write_run_config(self) -> None:
        """RUN_DIR/config.yaml: the run's resolved settings, the one source every worker process reads. It holds
        credentials in the clear (a SASL password, a database URL), so only its owner may read it. On a secured bus
        it holds no login: each worker gets its own kind's through its environment (`_environment`)."""
        kafka = self.settings.kafka
        if self.bus is not None:
            kafka = kafka.model_copy(update={"sasl_plain_username": None, "sasl_plain_password": None})
        settings = self.settings.model_copy(update={
            "kafka": kafka,
            "run_dir": self.run_dir.resolve(), "run_id": self.run_id,
            # `crl run` watches the workers' metrics for its live view and its drain rule: every second.
            "runner": self.settings.runner.model_copy(update={"metrics_interval_s": 1.0}),
        })
        path = self.run_config
        tmp = path.with_suffix(".tmp")
        tmp.touch(mode=0o600)
        tmp.write_text(yaml.safe_dump(settings.run_config(), sort_keys=False))
        tmp.replace(path)

    def _environment(self, kind: str) -> dict[str, str]:
        """A worker's environment: no CRL_* variable, so RUN_DIR/config.yaml is all its settings, but for its kind's
        login on a secured bus (`CRL_KAFKA__SASL_PLAIN_USERNAME` / `..._PASSWORD`, never written to a file); torch's
        idle threads sleep (`IDLE_THREADS`)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("CRL_")}
        env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
        if not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(env):
            env.update(IDLE_THREADS)
        if self.bus is not None:
            env.update(self.bus.client_environment(worker_principal(kind)))
        return env

    def _spawn(self, worker: WorkerProcess) -> None:
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        output = (logs / f"{worker.instance}.out").open("ab")
        command = worker_command(self.kinds[worker.kind], self.settings, worker.instance, self.run_config.resolve())
        try:
            worker.process = subprocess.Popen(
                [sys.executable, *command],
                env=self._environment(worker.kind), stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=die_with_parent,
            )
        finally:
            output.close()
        self._write_process_table()

    def _write_process_table(self) -> None:
        """`workers.json`: every worker's kind, pid and restarts, for a person (or a test) who wants to poke one."""
        table = {w.instance: {"kind": w.kind, "pid": w.process.pid if w.process else None, "restarts": w.restarts}
                 for w in self.workers}
        path = self.run_dir / "workers.json"
        path.with_suffix(".tmp").write_text(json.dumps(table, indent=1))
        path.with_suffix(".tmp").replace(path)

    # -- watching -------------------------------------------------------------------------------------------------

    def _watch(self) -> None:
        from rich.live import Live

        interval = self.settings.launch.progress_interval_s
        live = Live(self.view(), console=self.console, refresh_per_second=2, transient=False,
                    redirect_stderr=False) if self.console.is_terminal else None
        last_line = 0.0
        drain_started: float | None = None
        try:
            if live is not None:
                live.start()
            while True:
                time.sleep(interval)
                if self.follower is not None and self.follower.failure is not None:
                    raise RunFailedError(f"reading the log failed: {self.follower.failure}")
                if self.broker is not None:
                    self._watch_broker()
                if self.interrupts == 1 and not self.stop_sent:
                    self._request_stop("interrupted (Ctrl-C)")
                if self.interrupts >= 2:
                    self.console.print("second interrupt: stopping the workers now")
                    return
                finished = self.progress.finished is not None
                self._check_workers(finished)
                if live is not None:
                    live.update(self.view())
                elif time.monotonic() - last_line > 10:
                    last_line = time.monotonic()
                    self.console.print(self.summary_line(), highlight=False, soft_wrap=True)
                if finished:
                    drain_started = drain_started or time.monotonic()
                    if self.drained():
                        return
                    if time.monotonic() - drain_started > self.settings.launch.drain_timeout_s:
                        self.console.print(f"[yellow]not drained after {self.settings.launch.drain_timeout_s:.0f}s;"
                                           " stopping anyway (each worker still commits what it has)[/yellow]")
                        return
        finally:
            if live is not None:
                live.update(self.view())
                live.stop()

    def _request_stop(self, reason: str) -> None:
        self.stop_sent = True
        self.console.print(f"stopping the run: {reason} (Ctrl-C again to stop without draining)")
        producer = make_producer(self.settings.kafka, client_id="crl-run")
        try:
            event = StopRequested(event_id=uuid.uuid4(), run_id=self.run_id,
                                  producer=Producer(worker="crl-run", instance=f"crl-run-{os.getpid()}"),
                                  reason=reason)
            producer.send(CONTROL.name, key=CONTROL.key_bytes(event), value=encode(event))
            producer.flush()
        finally:
            producer.close()

    def _check_workers(self, finished: bool) -> None:
        for worker in self.workers:
            code = worker.process.poll() if worker.process is not None else None
            if code is None or (finished and code == 0) or (self.kinds[worker.kind].clock and code == 0):
                continue  # running, or done with the run
            if worker.restarts >= self.settings.launch.max_restarts:
                if not self.stop_sent:
                    self._request_stop(f"{worker.instance} crashed {worker.restarts + 1} times")
                raise RunFailedError(f"{worker.instance} exited with code {code} after {worker.restarts} restarts; "
                                f"see {self.run_dir / 'logs' / (worker.instance + '.log')} and .out")
            worker.restarts += 1
            self.console.print(f"[yellow]{worker.instance} exited with code {code}; restart {worker.restarts} of "
                               f"{self.settings.launch.max_restarts}[/yellow]")
            self._spawn(worker)

    def drained(self) -> bool:
        """Nothing published for `QUIET_S`, and every live worker wrote two lag-free metrics lines since."""
        with self.follower.lock if self.follower is not None else threading.Lock():
            last_record = self.progress.last_record
        if time.time() - last_record < QUIET_S:
            return False
        for worker in self.workers:
            if not worker.running:
                continue
            lines = [line for line in last_metrics(self.run_dir, worker.instance) if line["t"] > last_record]
            if len(lines) < 2 or any(line.get("lag") for line in lines):
                return False
        return True

    def _stop_workers(self) -> None:
        for kind in reversed(self.kinds):
            group = [w for w in self.workers if w.kind == kind and w.running]
            for worker in group:
                worker.process.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
            for worker in group:
                wait_s = 5 if self.broker_lost else 60  # nothing to flush to without a broker; positions stay put
                try:
                    worker.process.wait(timeout=wait_s)  # type: ignore[union-attr]
                except subprocess.TimeoutExpired:
                    self.console.print(f"[red]{worker.instance} did not stop in {wait_s}s; killed[/red]")
                    worker.process.kill()  # type: ignore[union-attr]
                    worker.process.wait()  # type: ignore[union-attr]

    # -- the view -------------------------------------------------------------------------------------------------

    def _warming(self) -> tuple[str, ...]:
        """The trainers that will warm-start: theirs is configured and they have no version 0 yet."""
        trainers: tuple[tuple[Role, ActorTrainerSettings | ExtractorTrainerSettings], ...] = (
            ("actor", self.settings.actor_trainer),
            ("extractor", self.settings.extractor_trainer))
        return tuple(role for role, trainer in trainers
                     if trainer.warm_start.steps > 0 and (role == "actor" or self.settings.scheduler.arm != "grpo")
                     and not versions_in(checkpoints_root(self.settings.run_dir, role)))

    def _figures(self) -> dict[str, str]:
        lock = self.follower.lock if self.follower is not None else threading.Lock()
        if self._warming_roles is None:
            self._warming_roles = self._warming()
        return numbers(self.progress, lock, self.settings.scheduler.steps, self._warming_roles)

    def summary_line(self) -> str:
        return summary_line(self._figures(), self.started)

    def view(self) -> Group:
        return live_view(self._figures(), run_id=self.run_id, arm=self.settings.scheduler.arm, run_dir=self.run_dir,
                         started=self.started, workers=self.workers)
