"""`docker-compose up` as users start it, on images built on this machine, through the faults a deployment meets.

One compose project (its own name, network, volumes and loopback ports) plays one run of the tiny MiniHack config,
shortened by an override file (fewer and smaller steps, short warm starts), and goes through, in order:

1. `up`: Kafka, PostgreSQL, topic-init and every worker kind as containers; the actor trains;
2. crashes: `docker kill --signal SIGQUIT` the rollout, the extractor and the actor trainer containers (tini passes
   it on, the worker dies without cleaning up) and SIGKILL the extractor trainer's worker process from the host
   (what the kernel's OOM killer does): the restart policy brings each back and the actor trains on;
3. `up --scale rollout=2`: a second rollout worker with its own address joins the rollout group;
4. `docker network disconnect` cuts the second rollout worker off for 30 s: the group's coordinator hands all of
   crl.tasks to the first; reconnected, the second holds partitions again. While the second container starts and
   while the cut lasts after the partitions moved, the scheduler is frozen (`docker pause`), so these waits cost the
   run no steps; thawed, it goes on from where it stopped (it reads its partitions by assignment, in no group) and
   the actor trains on;
5. `docker-compose stop kafka`, then `start`: the workers carry on;
6. `docker-compose down` (volumes kept), then `up`: the run continues from the log, the database and the volumes;
7. the scheduler exits 0 after `RunFinished`, the workers drain; every step exactly once, nothing dead-lettered,
   `crl replay bank` and `crl replay train` match and `crl audit sql` reads the archive, each run in a container on
   the volumes, as a user would.

A phase that fails stops the scenario; the tests of later phases then fail naming it. Everything the project made is
removed at the end (containers, network, volumes); the images stay for the next session (layer cache).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from run_checks import assert_every_step_exactly_once

from infra.admin import existing_partition_counts
from infra.broker_process import free_loopback_port
from infra.images.build import LOCAL_ENV, BuiltImage, Docker
from infra.kafka import KafkaSettings, make_admin
from pipeline.audit.views import Audit
from pipeline.run.processes import last_metrics
from workers import WORKERS

# The first test's setup builds the images where none is cached (17 minutes on two AVX2 cores, the worker image 10 of
# them) and then plays the whole scenario (15-20 minutes there): 1800 s was not enough for both.
pytestmark = [pytest.mark.compose, pytest.mark.timeout(3000)]

ROOT = Path(__file__).resolve().parents[2]
# ~1.3 s a step alone. The waits that need no work pass with the scheduler frozen, so every phase falls early in the
# run: down and up came at actor version 11 of 39 alone (at 47 of 69 without the pauses).
STEPS = 40
GROUPS = 2  # groups of 4: 8 episodes a step
EPISODES = GROUPS * 4
RUN_ID = "compose-test"
TRAINED = re.compile(r"-> version (\d+)")
SETTINGS = {
    "CRL_SCHEDULER__STEPS": str(STEPS),
    "CRL_SCHEDULER__EVAL_EVERY": "0",
    "CRL_ACTOR_TRAINER__WARMUP_STEPS": "1",
    "CRL_ACTOR_TRAINER__GROUP_SIZE": "4",
    "CRL_ACTOR_TRAINER__GROUPS_PER_STEP": str(GROUPS),
    # Short warm starts: this tier tests the deployment, not what the models learn; the extractor's still parses
    # some of its answers, so the bank gets experiences.
    "CRL_ACTOR_TRAINER__WARM_START__STEPS": "40",
    "CRL_EXTRACTOR_TRAINER__WARM_START__STEPS": "200",
    "CRL_RUNNER__METRICS_INTERVAL_S": "2",
}


@dataclass
class Stack:
    """One compose project and what its phases left to check."""

    project: str
    override: Path
    env: dict[str, str]
    docker: Docker
    kafka_port: int
    phases: dict[str, dict[str, Any]] = field(default_factory=dict)
    failure: str | None = None

    def compose(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
        command = ["docker-compose", "--project-name", self.project, "--env-file", str(LOCAL_ENV),
                   "--file", str(ROOT / "docker-compose.yml"), "--file", str(self.override), *args]
        result = subprocess.run(command, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"docker-compose {' '.join(args)} exited {result.returncode}:\n"
                                 f"{(result.stdout + result.stderr)[-4000:]}")
        return result

    def up(self, *args: str) -> None:
        self.compose("up", "--detach", "--no-build", *args)

    def container(self, service: str, index: int = 1) -> str:
        return f"{self.project}_{service}_{index}"

    def inspect(self, container: str) -> dict[str, Any]:
        return json.loads(self.docker.run("inspect", container, quiet=True))[0]

    def logs(self, container: str) -> str:
        result = subprocess.run([self.docker.binary, "logs", container], capture_output=True, text=True)
        return result.stdout + result.stderr

    def trained_on(self, after: str, timeout: float = 300, newest: int | None = None) -> int:
        """Wait for the actor to publish a version newer than `newest` (default: the newest now); the run must
        still be going."""
        newest = max(self.versions(), default=-1) if newest is None else newest
        scheduler = self.container("scheduler")

        def newer() -> int | None:
            versions = self.versions()
            if max(versions, default=-1) > newest:
                return max(versions)
            if not self.inspect(scheduler)["State"]["Running"]:
                raise AssertionError(f"the run finished before a version was trained {after} (raise STEPS)")
            return None

        return wait_until(newer, f"a version trained {after}", timeout=timeout)

    def versions(self) -> list[int]:
        """The actor versions the actor trainer has published, from its logs (every container of the service)."""
        text = "".join(self.logs(name) for name in self.containers("actor-trainer", every=True))
        return [int(match) for match in TRAINED.findall(text)]

    def containers(self, service: str, every: bool = False) -> list[str]:
        args = ["ps", "--quiet"] + (["--all"] if every else []) + [
            "--filter", f"label=com.docker.compose.project={self.project}",
            "--filter", f"label=com.docker.compose.service={service}"]
        return [self.inspect(cid)["Name"].lstrip("/") for cid in self.docker.run(*args, quiet=True).split()]

    def volume(self, name: str) -> Path:
        return Path(self.docker.run("volume", "inspect", "--format", "{{.Mountpoint}}", f"{self.project}_{name}",
                                    quiet=True).strip())

    @property
    def run_dir(self) -> Path:
        """The run directory on the host: the `runs` volume's folder of this run (read by root)."""
        return self.volume("runs") / RUN_ID

    def crl(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
        """`crl ARGS` in a one-off container of the worker image, on the stack's network and volumes."""
        return self.compose("run", "--rm", "--no-deps", "-T", "archiver", *args, timeout=timeout, check=False)

    def phase(self, name: str) -> dict[str, Any]:
        if name not in self.phases:
            pytest.fail(f"phase {name!r} did not run: {self.failure or 'an earlier test failed'}")
        return self.phases[name]


def wait_until(condition: Callable[[], Any], what: str, timeout: float = 300, every: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def _override(path: Path) -> Path:
    services = {service: {"environment": SETTINGS}
                for service in [*(key.replace("_", "-") for key in WORKERS), "topic-init"]}
    path.write_text(yaml.safe_dump({"services": services}))
    return path


def _rollout_group(stack: Stack) -> dict[str, set[int]]:
    """Who holds which crl.tasks partitions in the rollout group, by member host address, as its coordinator says
    (empty while the group rebalances)."""
    admin = make_admin(KafkaSettings(bootstrap_servers=f"127.0.0.1:{stack.kafka_port}"))
    try:
        group = admin.describe_groups(["crl-rollout"])["crl-rollout"]
        if group["group_state"] != "Stable":
            return {}
        return {member["client_host"].lstrip("/"): {p for assigned in (member.get("member_assignment") or {})
                                                     .get("assigned_partitions", [])
                                                     if assigned["topic"] == "crl.tasks"
                                                     for p in assigned["partitions"]}
                for member in group["members"]}
    finally:
        admin.close()


def _address(stack: Stack, container: str) -> str:
    networks = stack.inspect(container)["NetworkSettings"]["Networks"]
    return networks[f"{stack.project}_default"]["IPAddress"]


def _restarted(stack: Stack, container: str, before: int) -> bool:
    state = stack.inspect(container)
    return state["RestartCount"] > before and state["State"]["Running"]


def _child_of(pid: int) -> int:
    """The process whose parent is `pid` (the worker under the container's tini)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            return int(stat.parent.name)
    raise AssertionError(f"process {pid} has no child")


def _drained(run_dir: Path, since: float) -> bool:
    """Every worker that is writing metrics wrote two lines after `since`, both without lag (the supervisor's rule)."""
    live = [path.stem for path in (run_dir / "metrics").glob("*.jsonl") if path.stat().st_mtime > time.time() - 15]
    if not live:
        return False
    for instance in live:
        lines = [line for line in last_metrics(run_dir, instance) if line["t"] > since]
        if len(lines) < 2 or any(line.get("lag") for line in lines):
            return False
    return True


def _play(stack: Stack) -> None:
    # 1. up: every service; topic-init exits 0 and the workers start; the actor trains.
    started = time.monotonic()
    stack.up()
    wait_until(lambda: stack.versions(), "the actor's first trained version", timeout=900)
    stack.phases["up"] = {"seconds": time.monotonic() - started,
                          "topic-init": stack.inspect(stack.container("topic-init"))["State"]["ExitCode"]}

    # 2. crashes, all at once: the restart policy brings each worker back, and the run goes on.
    killed = {service: stack.container(service) for service in ("rollout", "extractor", "actor-trainer",
                                                                "extractor-trainer")}
    before = {service: stack.inspect(name)["RestartCount"] for service, name in killed.items()}
    for service in ("rollout", "extractor", "actor-trainer"):
        stack.docker.run("kill", "--signal", "SIGQUIT", killed[service], quiet=True)
    worker_pid = _child_of(stack.inspect(killed["extractor-trainer"])["State"]["Pid"])
    os.kill(worker_pid, signal.SIGKILL)
    restarts = {service: wait_until(lambda name=name, count=before[service]: _restarted(stack, name, count)
                                    and stack.inspect(name)["RestartCount"], f"{name} restarted", timeout=180)
                for service, name in killed.items()}
    stack.phases["crashes"] = {"version": stack.trained_on("after the crashes"), "restarts": restarts}

    # 3. a second rollout worker, with its own address, in the rollout group. The scheduler is frozen (`docker
    #    pause`: its processes stop where they are; it reads its partitions by assignment, so no group notices)
    #    while the container starts and joins, so the wait costs the run no steps; thawed, the actor trains on.
    scheduler = stack.container("scheduler")
    stack.docker.run("pause", scheduler, quiet=True)
    stack.up("--scale", "rollout=2")
    first, second = stack.container("rollout", 1), stack.container("rollout", 2)
    addresses = {_address(stack, first), _address(stack, second)}
    both = wait_until(lambda: (g := _rollout_group(stack)) and set(g) == addresses and all(g.values()) and g,
                      "both rollout workers holding crl.tasks partitions", timeout=180)
    stack.docker.run("unpause", scheduler, quiet=True)
    stack.phases["scaled"] = {"addresses": sorted(addresses), "group": both,
                              "version": stack.trained_on("by two rollout workers")}

    # 4. the second rollout worker off the network for 30 s, then back.
    network = f"{stack.project}_default"
    cut = time.monotonic()
    stack.docker.run("network", "disconnect", network, second, quiet=True)
    first_address = _address(stack, first)
    partitions = existing_partition_counts_of(stack, "crl.tasks")
    alone = wait_until(lambda: (g := _rollout_group(stack)) and set(g) == {first_address}
                       and g[first_address] == set(range(partitions)) and g,
                       "the first rollout worker holding every crl.tasks partition", timeout=60)
    moved_after = time.monotonic() - cut
    # The partitions moved while tasks flowed; the rest of the cut and the rejoin pass with the scheduler frozen.
    stack.docker.run("pause", scheduler, quiet=True)
    time.sleep(max(0.0, 30 - (time.monotonic() - cut)))
    stack.docker.run("network", "connect", network, second, quiet=True)
    addresses = {first_address, _address(stack, second)}
    back = wait_until(lambda: (g := _rollout_group(stack)) and set(g) == addresses and all(g.values()) and g,
                      "both rollout workers holding partitions after the reconnect", timeout=180)
    stack.docker.run("unpause", scheduler, quiet=True)
    stack.phases["network cut"] = {"alone": alone, "moved_after_s": moved_after, "back": back,
                                   "second_restarts": stack.inspect(second)["RestartCount"],
                                   "version": stack.trained_on("after the reconnect")}

    # 5. Kafka stopped and started: the workers reconnect and the run trains on.
    stack.compose("stop", "kafka")
    time.sleep(5)
    stack.compose("start", "kafka")
    stack.phases["kafka restarted"] = {"version": stack.trained_on("after Kafka's restart")}

    # 6. down (the volumes stay) and up: the run continues where it was.
    before = max(stack.versions())
    stack.compose("down")
    stack.up()
    # The trainer's container is a new one: every version in its log was trained after the up.
    after = stack.trained_on("after down and up", newest=-1)
    stack.phases["down and up"] = {"before": before, "after": after}

    # 7. the run completes: the scheduler exits 0; then every worker drains.
    state = wait_until(lambda: (s := stack.inspect(scheduler)["State"]) and not s["Running"] and s,
                       "the scheduler's exit after RunFinished", timeout=1200, every=2)
    finished_at = time.time()
    wait_until(lambda: _drained(stack.run_dir, finished_at), "every worker drained", timeout=300, every=2)
    stack.phases["completed"] = {"scheduler_exit": state["ExitCode"], "seconds": time.monotonic() - started,
                                 "scheduler_log": stack.logs(scheduler)[-3000:],
                                 "versions at each phase": {name: phase.get("version", phase.get("after"))
                                                            for name, phase in stack.phases.items()}}


def existing_partition_counts_of(stack: Stack, topic: str) -> int:
    admin = make_admin(KafkaSettings(bootstrap_servers=f"127.0.0.1:{stack.kafka_port}"))
    try:
        return existing_partition_counts(admin)[topic]
    finally:
        admin.close()


@pytest.fixture(scope="module")
def stack(local_images: dict[str, BuiltImage], docker_engine: Docker,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("compose")
    kafka_port = free_loopback_port()
    env = {key: value for key, value in os.environ.items() if not key.startswith("CRL_")}
    env.update({"CRL_RUN_ID": RUN_ID, "CRL_KAFKA_PORT": str(kafka_port), "CRL_POSTGRES_PORT": str(free_loopback_port()),
                "CRL_TENSORBOARD_PORT": str(free_loopback_port()), "DOCKER_BUILDKIT": "0"})
    stack = Stack(f"crltest{os.getpid()}", _override(root / "override.yml"), env, docker_engine, kafka_port)
    try:
        try:
            _play(stack)
        except (AssertionError, subprocess.SubprocessError, OSError, KeyError, ValueError) as exc:
            subprocess.run([stack.docker.binary, "unpause", stack.container("scheduler")], capture_output=True)
            logs = stack.compose("logs", "--no-color", "--tail", "60", timeout=120, check=False)
            stack.failure = f"{type(exc).__name__}: {exc}\n{(logs.stdout + logs.stderr)[-15000:]}"
        yield stack
    finally:
        stack.compose("down", "--volumes", "--remove-orphans", timeout=300, check=False)


def test_compose_up_starts_every_service_and_topic_init_exits_0(stack, local_images, report_measurement):
    for image in local_images.values():
        report_measurement(f"compose {image.line()}")
    phase = stack.phase("up")
    assert phase["topic-init"] == 0
    for service in ("kafka", "postgres", "tensorboard", *(key.replace("_", "-") for key in WORKERS)):
        assert stack.containers(service, every=True), f"no {service} container"


def test_killed_workers_are_restarted_by_the_policy_and_the_run_goes_on(stack):
    phase = stack.phase("crashes")
    assert set(phase["restarts"]) == {"rollout", "extractor", "actor-trainer", "extractor-trainer"}
    assert all(count >= 1 for count in phase["restarts"].values()), phase


def test_a_scaled_rollout_worker_has_its_own_address_and_partitions(stack):
    phase = stack.phase("scaled")
    assert len(phase["addresses"]) == 2
    held = list(phase["group"].values())
    assert all(held) and not set.intersection(*held), phase


def test_a_rollout_worker_cut_off_loses_its_partitions_and_gets_them_back(stack):
    phase = stack.phase("network cut")
    assert len(phase["alone"]) == 1 and phase["moved_after_s"] < 30, phase
    assert len(phase["back"]) == 2 and all(phase["back"].values()), phase


def test_the_run_outlives_a_kafka_restart_and_down_then_up(stack):
    stack.phase("kafka restarted")
    phase = stack.phase("down and up")
    assert phase["after"] > phase["before"]


def test_the_run_completes_with_every_step_exactly_once(stack, report_measurement):
    phase = stack.phase("completed")
    assert phase["scheduler_exit"] == 0, phase["scheduler_log"]
    episodes = STEPS * EPISODES
    with Audit(stack.run_dir) as audit:
        def rows(sql: str) -> list[tuple]:
            return audit.query(sql)[1]

        assert ("completed",) in rows("SELECT status FROM run_finished")
        assert_every_step_exactly_once(audit, STEPS, EPISODES)
        assert rows("SELECT count(*) FROM experience_added")[0][0] >= 1
        played = rows(f"SELECT count(*) FROM read_parquet('{stack.run_dir / 'archive'}/*/*.parquet') "
                      "WHERE kind = 'TrajectoryCompleted'")[0][0]
    report_measurement(f"compose stack: {phase['seconds']:.0f} s from up to drained, {played - episodes} of "
                       f"{episodes} episodes played again through 4 crashes, a scale-out, a 30 s network cut, a "
                       f"Kafka restart and down/up; actor versions at each phase "
                       f"{phase['versions at each phase']} of {STEPS - 1}; partitions moved "
                       f"{stack.phases['network cut']['moved_after_s']:.1f} s after the network cut")


def test_both_replays_match_and_audit_sql_reads_the_archive_from_the_volumes(stack):
    stack.phase("completed")
    run_dir = f"/data/runs/{RUN_ID}"
    bank = stack.crl("replay", "bank", run_dir)
    assert bank.returncode == 0, bank.stdout + bank.stderr
    assert "live SQL bank" in bank.stdout and "NO" not in bank.stdout, bank.stdout
    train = stack.crl("replay", "train", run_dir)
    assert train.returncode == 0, train.stdout + train.stderr
    assert f"actor: {STEPS - 1} steps replayed, every weight hash matches" in train.stdout, train.stdout
    assert re.search(r"extractor: [1-9]\d* steps replayed, every weight hash matches", train.stdout), train.stdout
    sql = stack.crl("audit", "sql", run_dir, "SELECT count(*) AS trajectories FROM trajectory_completed")
    assert sql.returncode == 0, sql.stdout + sql.stderr
    assert str(STEPS * EPISODES) in sql.stdout, sql.stdout
