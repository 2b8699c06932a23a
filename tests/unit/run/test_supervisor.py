"""`crl run`'s pure parts: which workers an arm starts, what the live view counts, when a run has drained."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from rich.console import Console

from pipeline.actor.settings import SchedulerSettings
from pipeline.errors import ConfigError
from pipeline.rl.settings import ActorTrainerSettings
from pipeline.run.plan import check_run_dir, start_order, worker_command, worker_plan
from pipeline.run.processes import last_metrics
from pipeline.run.progress import RunProgress
from pipeline.run.security import worker_bus
from pipeline.run.supervisor import RunSupervisor
from pipeline.runtime.launch import load_worker_registry
from pipeline.runtime.runner import Worker
from pipeline.settings import LaunchSettings, Settings
from pipeline.tracking.settings import TrackerSettings
from schemas.arrays import EmbeddingVector
from schemas.base import Producer
from schemas.experiences import ExperienceAdded, ExperienceRefined
from schemas.topics import TASKS, TRAIN_STEPS, TRAJECTORIES

PRODUCER = Producer(worker="extractor", instance="extractor-0")


def _settings(tmp_path: Path, arm: str = "complementary", **launch: int) -> Settings:
    return Settings(run_dir=tmp_path / "run", scheduler=SchedulerSettings(arm=arm),  # type: ignore[arg-type]
                    launch=LaunchSettings(**launch))


def test_every_arm_with_a_bank_starts_every_worker_kind_consumers_first(tmp_path):
    plan = worker_plan(_settings(tmp_path, rollout_workers=2, extractor_workers=3))
    assert plan == [("archiver", "archiver-0"), ("tracker", "tracker-0"), ("bank", "bank-0"),
                    ("extractor_trainer", "extractor_trainer-0"),
                    ("extractor", "extractor-0"), ("extractor", "extractor-1"), ("extractor", "extractor-2"),
                    ("actor_trainer", "actor_trainer-0"), ("rollout", "rollout-0"),
                    ("rollout", "rollout-1"), ("scheduler", "scheduler-0")]
    for arm in ("static_extractor", "exp_only", "frozen"):
        assert [kind for kind, _ in worker_plan(_settings(tmp_path, arm))] == \
            ["archiver", "tracker", "bank", "extractor_trainer", "extractor", "actor_trainer", "rollout", "scheduler"]


def test_the_grpo_arm_has_no_bank_and_no_extractor(tmp_path):
    assert [kind for kind, _ in worker_plan(_settings(tmp_path, "grpo"))] == \
        ["archiver", "tracker", "actor_trainer", "rollout", "scheduler"]


def test_the_tracker_is_left_out_when_the_settings_turn_it_off(tmp_path):
    settings = _settings(tmp_path).model_copy(update={"tracker": TrackerSettings(enabled=False)})
    assert "tracker" not in [kind for kind, _ in worker_plan(settings)]


def _kind(name: str, consumes=(), produces=(), **declared) -> type[Worker]:
    return type(name, (Worker,), {"name": name, "consumes": consumes, "produces": produces, **declared})


def test_the_plan_follows_what_each_kind_declares(tmp_path):
    registry = {
        "clock": _kind("clock", consumes=(TRAJECTORIES,), produces=(TASKS,), clock=True),
        "player": _kind("player", consumes=(TASKS,), produces=(TRAJECTORIES,), instances="rollout_workers"),
        "scorer": _kind("scorer", consumes=(TRAJECTORIES,), produces=(TRAIN_STEPS,)),
        "auditor": _kind("auditor", consumes=(TRAIN_STEPS, TASKS)),
        "banked": _kind("banked", consumes=(TASKS,), arms=frozenset({"complementary"})),
    }
    assert start_order(registry) == ["auditor", "scorer", "player", "banked", "clock"]
    assert worker_plan(_settings(tmp_path, "grpo", rollout_workers=2), registry) == [
        ("auditor", "auditor-0"), ("scorer", "scorer-0"), ("player", "player-0"), ("player", "player-1"),
        ("clock", "clock-0")]


def test_a_trainer_with_several_ranks_starts_under_torchrun(tmp_path):
    registry = load_worker_registry()
    config = tmp_path / "run" / "config.yaml"
    settings = _settings(tmp_path).model_copy(update={"actor_trainer": ActorTrainerSettings(ranks=3)})
    worker = ["-m", "pipeline.cli", "--config", str(config), "--log-level", "warning", "worker"]
    assert worker_command(registry["actor_trainer"], settings, "actor_trainer-0", config) == [
        "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", *worker, "actor_trainer",
        "--instance", "actor_trainer-0"]
    # extractor_trainer.ranks is 1 by default, and a kind that does not train has no ranks at all
    assert worker_command(registry["extractor_trainer"], settings, "extractor_trainer-0", config) == [
        *worker, "extractor_trainer", "--instance", "extractor_trainer-0"]
    assert worker_command(registry["rollout"], settings, "rollout-1", config) == [*worker, "rollout", "--instance",
                                                                                   "rollout-1"]


def test_a_plan_that_cannot_be_ordered_names_the_problem(tmp_path):
    cycle = {"a": _kind("a", consumes=(TASKS,), produces=(TRAJECTORIES,)),
             "b": _kind("b", consumes=(TRAJECTORIES,), produces=(TASKS,))}
    with pytest.raises(ConfigError, match=r"cycle.*'a': \['b'\].*'b': \['a'\]"):
        start_order(cycle)
    with pytest.raises(ConfigError, match="more than one worker kind declares itself the run's clock"):
        start_order({"a": _kind("a", clock=True), "b": _kind("b", clock=True)})
    with pytest.raises(ConfigError, match=r"launch.gpus, which is not a launch setting"):
        worker_plan(_settings(tmp_path), {"a": _kind("a", instances="gpus")})


def _added(experience_id: str, offset_text: str = "lesson") -> ExperienceAdded:
    return ExperienceAdded(run_id="r", producer=PRODUCER, op_id=f"{experience_id}-op", experience_id=experience_id,
                           task_family="minihack-room", text=offset_text,
                           key=EmbeddingVector.from_array("m", [1.0, 0.0]), generation_id="g",
                           extractor_version=0, source_trajectory_ids=("t",))


def test_the_live_view_applies_ops_with_the_banks_rules():
    progress = RunProgress("r")
    progress.add(_added("a"), 0)
    progress.add(_added("b"), 1)
    progress.add(ExperienceRefined(run_id="r", producer=PRODUCER, op_id="x", experience_id="a", expected_version=1,
                                   text="better", generation_id="g2", extractor_version=0), 2)
    stale = ExperienceRefined(run_id="r", producer=PRODUCER, op_id="y", experience_id="a", expected_version=1,
                              text="stale", generation_id="g3", extractor_version=0)
    progress.add(stale, 3)
    progress.add(_added("other-run").model_copy(update={"run_id": "someone-else"}), 4)
    assert progress.bank_size == 2
    assert dict(progress.ops) == {"added": 2, "refined": 1, "rejected": 1}


def test_last_metrics_reads_the_tail_of_a_worker_file(tmp_path):
    path = tmp_path / "metrics" / "w-0.jsonl"
    path.parent.mkdir()
    assert last_metrics(tmp_path, "w-0") == []
    path.write_text("".join(json.dumps({"t": i, "lag": {}}) + "\n" for i in range(5000)) + '{"t": 99')
    assert [line["t"] for line in last_metrics(tmp_path, "w-0", 3)] == [4998, 4999]  # the partial line is skipped


def test_a_run_is_drained_once_quiet_and_every_live_worker_reported_twice_without_lag(tmp_path):
    settings = _settings(tmp_path, "grpo")
    supervisor = RunSupervisor(settings, Console(file=io.StringIO()))
    sleepers = []
    try:
        for worker in supervisor.workers:
            worker.process = subprocess.Popen(["sleep", "30"])
            sleepers.append(worker.process)
        supervisor.workers[-1].process.kill()  # the scheduler has exited: it does not count
        supervisor.workers[-1].process.wait()
        now = time.time()
        supervisor.progress.last_record = now
        assert not supervisor.drained(), "a record just arrived"
        supervisor.progress.last_record = now - 10
        metrics = settings.run_dir / "metrics"
        metrics.mkdir(parents=True)
        for worker in supervisor.workers[:-1]:
            lines = [{"t": now - 5, "lag": {}}, {"t": now - 4, "lag": {}}]
            (metrics / f"{worker.instance}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        assert supervisor.drained()
        with (metrics / "rollout-0.jsonl").open("a") as handle:
            handle.write(json.dumps({"t": now - 3, "lag": {"crl.tasks[0]": 2}}) + "\n")
        assert not supervisor.drained(), "the rollout worker still has records to read"
        (metrics / "archiver-0.jsonl").write_text(json.dumps({"t": now - 3, "lag": {}}) + "\n")
        with (metrics / "rollout-0.jsonl").open("a") as handle:
            handle.write(json.dumps({"t": now - 2, "lag": {}}) + "\n" + json.dumps({"t": now - 1, "lag": {}}) + "\n")
        assert not supervisor.drained(), "the archiver reported only once since the last record"
    finally:
        for process in sleepers:
            process.kill()
            process.wait()


def test_a_run_starts_in_an_empty_directory(tmp_path):
    check_run_dir(tmp_path / "new")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "archive").mkdir()
    with pytest.raises(ConfigError, match="not empty"):
        check_run_dir(tmp_path / "used")


def test_workers_read_the_run_config_and_nothing_from_the_environment(tmp_path, monkeypatch):
    """`crl run` hands its workers their settings in one file, RUN_DIR/config.yaml, and no CRL_* variable."""
    monkeypatch.setenv("CRL_SCHEDULER__STEPS", "99")
    monkeypatch.setenv("HOME", str(tmp_path))
    settings = Settings(config=Path(__file__).resolve().parents[3] / "configs" / "tiny-minihack-room.yaml",
                        run_dir=tmp_path / "run", scheduler={"steps": 3},
                        kafka={"bootstrap_servers": "127.0.0.1:9", "sasl_mechanism": "PLAIN",
                               "sasl_plain_username": "crl", "sasl_plain_password": "s3cret"})
    supervisor = RunSupervisor(settings, Console(file=io.StringIO()))
    settings.run_dir.mkdir()
    supervisor._write_run_config()
    path = settings.run_dir / "config.yaml"
    assert path.stat().st_mode & 0o777 == 0o600  # it holds the SASL password in the clear
    monkeypatch.delenv("CRL_SCHEDULER__STEPS")
    child = Settings(config=path)
    assert child.scheduler.steps == 3 and child.runner.metrics_interval_s == 1.0
    assert child.run_dir == settings.run_dir.resolve() and child.run_id == "run"
    assert child.kafka.sasl_plain_password.get_secret_value() == "s3cret"  # type: ignore[union-attr]
    assert child.actor_trainer == settings.actor_trainer and child.envs == settings.envs
    environment = supervisor._environment("rollout")
    assert not [name for name in environment if name.startswith("CRL_")]
    assert environment["HOME"] == str(tmp_path) and environment["HF_HUB_OFFLINE"] == "1"


@pytest.mark.skipif(shutil.which("openssl") is None and os.environ.get("CI") != "true",
                   reason="the secured bus needs `openssl` (on CI its absence fails the test)")
def test_on_a_secured_bus_each_worker_gets_its_own_login_and_the_run_config_none(tmp_path):
    """The admin's login stays with `crl run`; a worker process logs in as its kind, through its environment only."""
    settings = Settings(config=Path(__file__).resolve().parents[3] / "configs" / "tiny-minihack-room.yaml",
                        run_dir=tmp_path / "run", broker={"kind": "kafka", "security": "sasl_ssl"})
    supervisor = RunSupervisor(settings, Console(file=io.StringIO()))
    settings.run_dir.mkdir()
    supervisor.bus = worker_bus(settings.run_dir, supervisor.registry)
    supervisor.settings = settings.model_copy(update={"kafka": supervisor.bus.client_settings(
        settings.with_bootstrap("127.0.0.1:9").kafka)})
    supervisor._write_run_config()
    written = (settings.run_dir / "config.yaml").read_text()
    assert not [password for password in supervisor.bus.passwords.values() if password in written]
    child = Settings(config=settings.run_dir / "config.yaml")
    assert child.kafka.security_protocol == "SASL_SSL" and child.kafka.sasl_plain_username is None
    assert child.kafka.ssl_cafile == str(supervisor.bus.ca_file.resolve())
    environment = supervisor._environment("rollout")
    assert environment["CRL_KAFKA__SASL_PLAIN_USERNAME"] == "crl-rollout"
    assert environment["CRL_KAFKA__SASL_PLAIN_PASSWORD"] == supervisor.bus.password("crl-rollout")
    assert supervisor._environment("bank")["CRL_KAFKA__SASL_PLAIN_USERNAME"] == "crl-bank"


def test_the_live_view_shows_each_family_of_a_mixture_at_the_newest_step():
    import threading

    from pipeline.run.view import numbers
    from schemas.trajectories import Timings, TrajectoryCompleted

    def episode(family: str, step: int, guided: bool, success: bool, split: str = "train") -> TrajectoryCompleted:
        return TrajectoryCompleted(
            run_id="r", producer=Producer(worker="t", instance="t"),
            trajectory_id=f"{family}-{step}-{guided}-{success}",
            assignment_event_id=f"{family}-{step}-{guided}-{success}-{split}", step=step, split=split,
            env_id=family, task_family=family, seed=1,
            group_id="g", slot=0, guided=guided, goal="g", turns=(), reward=float(success), success=success,
            num_actions=0, invalid_actions=0, truncated=False, policy_version=0,
            timings=Timings(generation_s=0, env_s=0, retrieval_s=0))

    progress = RunProgress("r")
    for event in (episode("twx-twc", 0, True, False), episode("twx-twc", 1, True, True),
                  episode("twx-twc", 1, False, False), episode("minihack-room", 1, False, True),
                  episode("twx-twc", 0, False, True, split="eval")):
        progress.add(event, 0)
    figures = numbers(progress, threading.Lock(), steps=4)
    assert figures["train by family"] == "minihack-room -/1.00 | twx-twc 1.00/0.00"
    assert "eval by family" not in figures  # one family in the newest evaluation: the eval line says it


def test_security_of_the_embedded_broker_is_refused_with_an_external_kafka(tmp_path):
    settings = Settings(config=Path(__file__).resolve().parents[3] / "configs" / "tiny-minihack-room.yaml",
                        run_dir=tmp_path / "run", broker={"kind": "kafka", "security": "sasl_ssl"},
                        kafka={"bootstrap_servers": "127.0.0.1:9"})
    supervisor = RunSupervisor(settings, Console(file=io.StringIO()))
    with pytest.raises(ConfigError, match="CRL_KAFKA__SASL_"):
        supervisor._start_broker()
    assert supervisor.bus is None and supervisor.broker is None


def test_the_workers_torch_threads_sleep_when_idle_unless_the_environment_says_otherwise(tmp_path, monkeypatch):
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    supervisor = RunSupervisor(_settings(tmp_path), Console(file=io.StringIO()))
    assert supervisor._environment("rollout")["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert supervisor._environment("rollout")["OMP_WAIT_POLICY"] == "ACTIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")
    environment = supervisor._environment("actor_trainer")
    assert "OMP_WAIT_POLICY" not in environment and environment["GOMP_SPINCOUNT"] == "10000"
