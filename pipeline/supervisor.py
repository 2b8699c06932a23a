"""`crl run CONFIG`: one command that runs Complementary RL end to end on one machine.

    crl run configs/tiny-minihack-room.yaml                 # embedded broker, every worker, live progress, report
    crl run configs/tiny-minihack-room.yaml --steps 3 --arm grpo --run-dir runs/grpo-3

What it does, in order:
1. uses the Kafka named by `CRL_KAFKA__BOOTSTRAP_SERVERS`, or starts the embedded broker (`--broker tansu`, the
   default, memory-only; or `--broker kafka`, Apache Kafka with its log in `RUN_DIR/kafka/`) and writes
   `broker.json` into the run directory; creates every topic;
2. starts every worker the arm needs as a `crl worker` subprocess (`launch.rollout_workers` rollout and
   `launch.extractor_workers` extractor instances; the `grpo` arm has no bank, extractor or extractor trainer), each
   in its own session so a terminal Ctrl-C reaches only this process, each with its log under `logs/` (pids in
   `workers.json`);
3. follows every topic from offset 0 and shows the run live: step, success of guided and free episodes, evaluation,
   bank size (the op log applied with the bank's own rules), op mix, parse statuses, extractor reward, and per worker
   its state, restarts, events and lag (from the metrics every worker writes under `metrics/`);
4. restarts a worker that exits before the run is over (at most `launch.max_restarts` times each; then the run
   is stopped and marked failed);
5. after `RunFinished`, waits until the run has drained: no new record for a while, and every live worker has
   written two metrics lines since the last one, both with no lag (so the extractor has distilled the last
   trajectories, the trainers have seen them, the bank has applied every op and the archiver has read everything);
6. stops the workers with SIGTERM (each finishes its current event, flushes and commits), the archiver last, then
   the broker; writes the report (`crl report`) and prints the commands to look at the run.

Ctrl-C asks the scheduler to stop (`StopRequested`), then drains and stops as above, so everything that was
recorded is archived; a second Ctrl-C stops the workers without waiting for the drain (each still flushes and
commits what it has).
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
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from kafka import TopicPartition

from infra.admin import create_topics
from infra.broker import EmbeddedBroker, die_with_parent, embedded_broker
from infra.kafka import make_admin, make_consumer, make_producer
from pipeline.bank.state import Applied, BankState, Rejected
from pipeline.errors import ConfigError
from pipeline.settings import BROKER_FILE, Settings, write_broker_file
from schemas.base import Producer
from schemas.codec import EventDecodeError, decode, encode
from schemas.experiences import ExperienceAdded, ExperienceMerged, ExperienceRefined, ExperienceRetired
from schemas.extractions import ExtractionGenerated
from schemas.runs import RunFinished, RunStarted, StopRequested
from schemas.tasks import EpisodeAssigned
from schemas.topics import CONTROL, TOPICS
from schemas.training import PolicyPublished, TrainStepCompleted
from schemas.trajectories import TrajectoryCompleted

BANK_WORKERS = ("bank", "extractor", "extractor_trainer")
"""Workers only an arm with an experience bank needs (every arm but `grpo`)."""
START_ORDER = ("archiver", "bank", "actor_trainer", "extractor_trainer", "extractor", "rollout", "scheduler")
STOP_ORDER = ("scheduler", "rollout", "extractor", "extractor_trainer", "actor_trainer", "bank", "archiver")
QUIET_S = 3.0
"""A drained run has published nothing for at least this long."""


def worker_plan(settings: Settings) -> list[tuple[str, str]]:
    """(kind, instance) of every worker process the run needs, in start order."""
    counts = {"rollout": settings.launch.rollout_workers, "extractor": settings.launch.extractor_workers}
    plan = []
    for kind in START_ORDER:
        if settings.scheduler.arm == "grpo" and kind in BANK_WORKERS:
            continue
        plan += [(kind, f"{kind}-{i}") for i in range(counts.get(kind, 1))]
    return plan


# -- what the run has done so far -----------------------------------------------------------------------------------


@dataclass
class RunProgress:
    """Everything the live view shows, from the records of every topic (read from offset 0)."""

    run_id: str
    started: RunStarted | None = None
    finished: RunFinished | None = None
    step_issued: int = -1
    actor_version: int = 0
    extractor_version: int = 0
    train: dict[int, list[TrajectoryCompleted]] = field(default_factory=lambda: defaultdict(list))
    evaluation: dict[int, list[TrajectoryCompleted]] = field(default_factory=lambda: defaultdict(list))
    bank: BankState = field(default_factory=BankState)
    ops: Counter[str] = field(default_factory=Counter)
    parse: Counter[str] = field(default_factory=Counter)
    extractor_reward: float | None = None
    actor_loss: float | None = None
    records: int = 0
    last_record: float = field(default_factory=time.time)

    def add(self, event: object, offset: int) -> None:
        if getattr(event, "run_id", self.run_id) != self.run_id:
            return
        if isinstance(event, RunStarted):
            self.started = event
        elif isinstance(event, RunFinished):
            self.finished = event
        elif isinstance(event, EpisodeAssigned):
            self.step_issued = max(self.step_issued, event.step)
        elif isinstance(event, TrajectoryCompleted):
            (self.train if event.split == "train" else self.evaluation)[event.step].append(event)
        elif isinstance(event, ExtractionGenerated):
            self.parse[event.parse_status] += 1
        elif isinstance(event, ExperienceAdded | ExperienceRefined | ExperienceMerged | ExperienceRetired):
            outcome = self.bank.apply(event, offset)
            if isinstance(outcome, Applied):
                self.ops[event.kind.removeprefix("Experience").lower()] += 1
            elif isinstance(outcome, Rejected):
                self.ops["rejected"] += 1
        elif isinstance(event, PolicyPublished):
            if event.role == "actor":
                self.actor_version = max(self.actor_version, event.version)
            else:
                self.extractor_version = max(self.extractor_version, event.version)
        elif isinstance(event, TrainStepCompleted):
            if event.role == "extractor":
                self.extractor_reward = event.metrics.get("extractor/reward_mean")
            else:
                self.actor_loss = event.loss

    @staticmethod
    def _success(trajectories: list[TrajectoryCompleted], guided: bool) -> float | None:
        chosen = [t.success for t in trajectories if t.guided == guided]
        return sum(chosen) / len(chosen) if chosen else None

    def latest(self, table: dict[int, list[TrajectoryCompleted]]) -> tuple[int | None, float | None, float | None]:
        """(step, guided success, free success) of the newest step with episodes in `table`."""
        if not table:
            return None, None, None
        step = max(table)
        return step, self._success(table[step], True), self._success(table[step], False)

    @property
    def bank_size(self) -> int:
        return sum(1 for _ in self.bank.active())


class LogFollower:
    """Reads every partition of every topic from offset 0 in a thread and feeds `RunProgress`."""

    def __init__(self, settings: Settings, progress: RunProgress) -> None:
        self.settings = settings
        self.progress = progress
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="crl-run-follower", daemon=True)
        self.failure: BaseException | None = None

    def start(self) -> LogFollower:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _follow(self) -> None:
        consumer = make_consumer(self.settings.kafka, client_id="crl-run-follower")
        topics = {topic.name: topic for topic in TOPICS}
        try:
            partitions = [TopicPartition(t.name, p) for t in TOPICS for p in range(t.partitions)]
            consumer.assign(partitions)
            consumer.seek_to_beginning(*partitions)
            while not self._stop.is_set():
                for tp, records in consumer.poll(timeout_ms=200).items():
                    for record in records:
                        try:
                            event = decode(topics[tp.topic], record.value)
                        except EventDecodeError:
                            continue  # a dead letter's business, not the live view's
                        with self.lock:
                            self.progress.add(event, record.offset)
                            self.progress.records += 1
                            self.progress.last_record = time.time()
        except BaseException as exc:  # surfaced by the supervisor's loop
            self.failure = exc
        finally:
            consumer.close(autocommit=False)


# -- worker processes -----------------------------------------------------------------------------------------------


@dataclass
class WorkerProcess:
    kind: str
    instance: str
    process: subprocess.Popen | None = None
    restarts: int = 0

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


def last_metrics(run_dir: Path, instance: str, count: int = 2) -> list[dict]:
    """The last `count` metrics lines the worker wrote (`metrics/<instance>.jsonl`)."""
    path = run_dir / "metrics" / f"{instance}.jsonl"
    if not path.exists():
        return []
    with path.open("rb") as handle:
        size = handle.seek(0, os.SEEK_END)
        handle.seek(max(0, size - 16384))
        lines = handle.read().decode("utf-8", "replace").splitlines()
    if size > 16384:
        lines = lines[1:]  # the first line read may be a partial one
    parsed = []
    for line in lines[-count:]:
        try:
            parsed.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written right now
    return parsed


class RunFailed(RuntimeError):
    """A worker kept crashing, or the broker died."""


class RunSupervisor:
    """Starts the broker and the workers of one run, watches them, and stops everything in order."""

    def __init__(self, settings: Settings, config: Path, env_overrides: dict[str, str], console) -> None:  # type: ignore[no-untyped-def]
        self.settings = settings
        self.config = config
        self.env_overrides = env_overrides
        self.console = console
        self.run_dir = settings.run_dir
        self.run_id = settings.resolved_run_id
        self.broker: EmbeddedBroker | None = None
        self.workers = [WorkerProcess(kind, instance) for kind, instance in worker_plan(settings)]
        self.progress = RunProgress(self.run_id)
        self.follower: LogFollower | None = None
        self.interrupts = 0
        self.started = time.monotonic()
        self.stop_sent = False

    # -- lifecycle ------------------------------------------------------------------------------------------------

    def run(self) -> RunProgress:
        """Run to the end (or to a stop); returns what happened. Raises `RunFailed`."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._start_broker()
            self.follower = LogFollower(self.settings, self.progress).start()
            for worker in self.workers:
                self._spawn(worker)
            self._watch()
        finally:
            try:
                self._stop_workers()
            finally:
                if self.follower is not None:
                    self.follower.stop()
                if self.broker is not None:
                    self.broker.stop()
                    (self.run_dir / BROKER_FILE).unlink(missing_ok=True)
                for signum, handler in previous.items():
                    signal.signal(signum, handler)
        return self.progress

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.interrupts += 1

    def _start_broker(self) -> None:
        if not self.settings.kafka.bootstrap_servers:
            self.broker = embedded_broker(self.settings.broker, data_dir=self.run_dir / "kafka",
                                          log_path=self.run_dir / "logs" / "broker.log")
            with self.console.status(f"starting {self.broker.description}"):
                self.broker.start()
            self.console.print(f"broker {self.broker.description} at {self.broker.bootstrap_servers} "
                               f"(started in {self.broker.start_seconds:.1f}s)", highlight=False)
            self.settings = self.settings.with_bootstrap(self.broker.bootstrap_servers)
            write_broker_file(self.run_dir, self.broker.bootstrap_servers, self.broker.pid, self.broker.kind)
        admin = make_admin(self.settings.kafka, client_id="crl-run")
        try:
            create_topics(admin)
        finally:
            admin.close()

    def _environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "CRL_CONFIG"}  # CRL_* overrides reach the workers
        env.update(self.env_overrides)
        env.update({
            "CRL_CONFIG": str(self.config.resolve()),
            "CRL_RUN_DIR": str(self.run_dir.resolve()),
            "CRL_RUN_ID": self.run_id,
            "CRL_KAFKA__BOOTSTRAP_SERVERS": self.settings.kafka.bootstrap_servers or "",
            "CRL_RUNNER__METRICS_INTERVAL_S": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        })
        return env

    def _spawn(self, worker: WorkerProcess) -> None:
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        output = (logs / f"{worker.instance}.out").open("ab")
        try:
            worker.process = subprocess.Popen(
                [sys.executable, "-m", "pipeline.cli", "--log-level", "warning", "worker", worker.kind,
                 "--instance", worker.instance],
                env=self._environment(), stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
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
                    raise RunFailed(f"reading the log failed: {self.follower.failure}")
                if self.broker is not None and not self.broker.is_running():
                    raise RunFailed(f"the broker exited; see {self.run_dir / 'logs' / 'broker.log'}")
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
            if code is None or (finished and code == 0) or (worker.kind == "scheduler" and code == 0):
                continue  # running, or done with the run
            if worker.restarts >= self.settings.launch.max_restarts:
                if not self.stop_sent:
                    self._request_stop(f"{worker.instance} crashed {worker.restarts + 1} times")
                raise RunFailed(f"{worker.instance} exited with code {code} after {worker.restarts} restarts; "
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
        for kind in STOP_ORDER:
            group = [w for w in self.workers if w.kind == kind and w.running]
            for worker in group:
                worker.process.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
            for worker in group:
                try:
                    worker.process.wait(timeout=60)  # type: ignore[union-attr]
                except subprocess.TimeoutExpired:
                    self.console.print(f"[red]{worker.instance} did not stop in 60s; killed[/red]")
                    worker.process.kill()  # type: ignore[union-attr]
                    worker.process.wait()  # type: ignore[union-attr]

    # -- the view -------------------------------------------------------------------------------------------------

    def _numbers(self) -> dict[str, str]:
        p = self.progress
        with self.follower.lock if self.follower is not None else threading.Lock():
            train_step, guided, free = p.latest(p.train)
            eval_step, eval_guided, eval_free = p.latest(p.evaluation)
            numbers = {
                "step": f"{p.step_issued + 1}/{self.settings.scheduler.steps}",
                "train": _pair(train_step, guided, free),
                "eval": _pair(eval_step, eval_guided, eval_free),
                "bank": f"{p.bank_size} active",
                "ops": " ".join(f"{k} {v}" for k, v in sorted(p.ops.items())) or "-",
                "parse": " ".join(f"{k} {v}" for k, v in sorted(p.parse.items())) or "-",
                "versions": f"actor v{p.actor_version}, extractor v{p.extractor_version}",
                "extractor reward": "-" if p.extractor_reward is None else f"{p.extractor_reward:+.3f}",
            }
        return numbers

    def summary_line(self) -> str:
        elapsed = time.monotonic() - self.started
        numbers = self._numbers()
        return f"[{elapsed:5.0f}s] " + " | ".join(f"{k} {v}" for k, v in numbers.items())

    def view(self):  # type: ignore[no-untyped-def]
        from rich.console import Group
        from rich.table import Table

        elapsed = time.monotonic() - self.started
        run = Table.grid(padding=(0, 2))
        run.add_column(style="bold")
        run.add_column()
        run.add_row("run", f"{self.run_id}  arm {self.settings.scheduler.arm}  {elapsed:.0f}s  ({self.run_dir})")
        for key, value in self._numbers().items():
            run.add_row(key, value)
        workers = Table("worker", "pid", "state", "restarts", "in", "out", "lag", title=None)
        for worker in self.workers:
            metrics = last_metrics(self.run_dir, worker.instance, 1)
            last = metrics[-1] if metrics else {}
            code = worker.process.poll() if worker.process is not None else None
            state = "running" if code is None else f"exited {code}"
            workers.add_row(worker.instance, str(worker.process.pid if worker.process else "-"), state,
                            str(worker.restarts), str(last.get("events_in", "-")), str(last.get("events_out", "-")),
                            str(sum(last.get("lag", {}).values())) if last else "-")
        return Group(run, workers)


def _pair(step: int | None, guided: float | None, free: float | None) -> str:
    if step is None:
        return "-"

    def show(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    return f"step {step}: guided {show(guided)}, free {show(free)}"


def default_run_dir(config: Path) -> Path:
    return Path("runs") / f"{config.stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def check_run_dir(run_dir: Path) -> None:
    if run_dir.exists() and any(run_dir.iterdir()):
        raise ConfigError(f"run directory {run_dir} is not empty: a run starts from an empty directory; "
                          "pick another --run-dir")
