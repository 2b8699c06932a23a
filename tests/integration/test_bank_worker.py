"""The bank worker against a real broker and real SQL: kill it mid-stream, restart, compare with a clean rebuild."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kafka import KafkaProducer
from worker_processes import _stop

from infra.db import DbSettings, database_url, make_engine, migrate
from infra.postgres import PostgresCluster, PostgresClusterError
from pipeline.bank.replay import replay
from pipeline.bank.snapshots import newest_snapshot, read_snapshot, snapshots_root
from pipeline.bank.store import BankStore
from pipeline.bank.synthetic import synthetic_op_log
from pipeline.settings import Settings
from schemas.codec import decode, encode
from schemas.topics import BANK_SNAPSHOTS, EXPERIENCE_OPS_TOPIC

pytestmark = pytest.mark.integration

CRL = [sys.executable, "-m", "pipeline.cli"]


def _bank_process(bootstrap: str, run_dir: Path, log: Path, **extra: str) -> subprocess.Popen:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("CRL_")},
        "CRL_KAFKA__BOOTSTRAP_SERVERS": bootstrap,
        "CRL_RUN_DIR": str(run_dir),
        "CRL_RUN_ID": "synthetic",  # the run synthetic_op_log stamps its ops with: a bank applies only its run's
        "CRL_BANK__SNAPSHOT_EVERY": "100",
        "CRL_RUNNER__POLL_TIMEOUT_MS": "50",
        "CRL_KAFKA__MAX_POLL_RECORDS": "40",  # small batches: many commit points to be killed between
        **extra,
    }
    return subprocess.Popen([*CRL, "worker", "bank", "--instance", "bank-kill"], env=env, stdout=log.open("ab"),
                            stderr=subprocess.STDOUT)


def _store(run_dir: Path, url: str | None = None) -> BankStore:
    engine = make_engine(database_url(DbSettings(url=url), run_dir))
    migrate(engine)
    return BankStore(engine)


def test_bank_killed_mid_batch_and_restarted_matches_a_clean_rebuild(kafka_bootstrap, tmp_path):
    ops = synthetic_op_log(1200, seed=7)
    clean = replay(enumerate(ops)).state
    log = tmp_path / "bank.out"
    bank = _bank_process(kafka_bootstrap, tmp_path, log)
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, linger_ms=5)
    kills = []
    store = _store(tmp_path)
    try:
        for offset, op in enumerate(ops):
            producer.send(EXPERIENCE_OPS_TOPIC.name, key=EXPERIENCE_OPS_TOPIC.key_bytes(op), value=encode(op))
            if offset in (499, 899):
                producer.flush()
                # Kill once the worker is mid-stream: past a snapshot, with SQL ahead of it, not yet at the end.
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    position = store.position(EXPERIENCE_OPS_TOPIC.name, 0)
                    snapshot = newest_snapshot(snapshots_root(tmp_path))
                    if snapshot is not None and position is not None and position.next_offset > int(snapshot.name):
                        break
                    time.sleep(0.02)
                bank.send_signal(signal.SIGKILL)  # no flush, no commit
                bank.wait(timeout=10)
                kills.append(store.position(EXPERIENCE_OPS_TOPIC.name, 0).next_offset)
                bank = _bank_process(kafka_bootstrap, tmp_path, log)
        producer.flush()
        assert len(kills) == 2 and all(0 < k < len(ops) for k in kills), kills
        deadline = time.monotonic() + 90
        position = None
        while time.monotonic() < deadline:
            position = store.position(EXPERIENCE_OPS_TOPIC.name, 0)
            if position is not None and position.next_offset >= len(ops):
                break
            time.sleep(0.3)
        assert position is not None and position.next_offset == len(ops), (position, log.read_text()[-2000:])
        assert position.state_hash == clean.state_hash()
        assert (position.applied, position.duplicates, position.rejected) == (
            clean.applied, clean.duplicates, clean.rejected)
        # The SQL rows agree with the clean state too, and rebuild to the same hash.
        assert store.load_state().state_hash() == clean.state_hash()
        # Every snapshot on disk is internally consistent and equals the clean replay at its offset.
        snapshot = newest_snapshot(snapshots_root(tmp_path))
        state, manifest = read_snapshot(snapshot)
        assert state.state_hash() == replay(enumerate(ops[: manifest.next_offset])).state.state_hash()
        # A BankReplica in another process (from the newest snapshot, then the tail) sees the same bank.
        script = (
            "import sys; from pathlib import Path; from infra.kafka import KafkaSettings; "
            "from pipeline.bank.replica import BankReplica; from pipeline.runtime.log import KafkaLog; "
            "from schemas.topics import EXPERIENCE_OPS_TOPIC; "
            "log = KafkaLog(KafkaSettings(bootstrap_servers=sys.argv[1])); "
            "r = BankReplica(log.follow, log.log_id(EXPERIENCE_OPS_TOPIC), Path(sys.argv[2])).start(); "
            "assert r.wait_caught_up(60), 'replica never caught up'; "
            "print(r.offset, r.state_hash(), len(r.index or ())); r.stop()"
        )
        seen = subprocess.run([sys.executable, "-c", script, kafka_bootstrap, str(tmp_path)], capture_output=True,
                              text=True, timeout=120)
        assert seen.returncode == 0, seen.stderr[-2000:]
        offset, replica_hash, indexed = seen.stdout.split()
        assert (int(offset), replica_hash) == (len(ops), clean.state_hash())
        assert int(indexed) == sum(1 for _ in clean.active())
        # `crl replay bank --from-kafka` reproduces the live hash.
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("CRL_")},
               "CRL_KAFKA__BOOTSTRAP_SERVERS": kafka_bootstrap, "COLUMNS": "200"}
        replayed = subprocess.run([*CRL, "replay", "bank", str(tmp_path), "--from-kafka"], capture_output=True,
                                  text=True, env=env, timeout=120)
        assert replayed.returncode == 0, replayed.stdout + replayed.stderr
        assert f"state_hash {clean.state_hash()}" in replayed.stdout
        assert f"ops {len(ops)} applied {clean.applied} duplicates {clean.duplicates} rejected {clean.rejected}" \
            in replayed.stdout
    finally:
        producer.close()
        _stop(bank)
    assert bank.returncode == 0, log.read_text()[-3000:]


def _project_synthetic_ops(bootstrap: str, run_dir: Path, run_id: str, count: int, *, seed: int,
                           snapshot_every: int) -> tuple[list, Settings]:
    """`count` synthetic ops on crl.experience-ops, projected by a bank worker until it has read them all."""
    from infra.kafka import KafkaSettings
    from pipeline.bank.settings import BankSettings
    from pipeline.runtime.launch import build_runner
    from pipeline.runtime.runner import Limits
    from pipeline.runtime.settings import RunnerSettings
    from workers.bank import BankProjection

    ops = synthetic_op_log(count, seed=seed, run_id=run_id)
    producer = KafkaProducer(bootstrap_servers=bootstrap)
    for op in ops:
        producer.send(EXPERIENCE_OPS_TOPIC.name, key=EXPERIENCE_OPS_TOPIC.key_bytes(op), value=encode(op))
    producer.close()
    settings = Settings(run_dir=run_dir, run_id=run_id, kafka=KafkaSettings(bootstrap_servers=bootstrap),
                        runner=RunnerSettings(poll_timeout_ms=50), bank=BankSettings(snapshot_every=snapshot_every))
    build_runner(BankProjection, settings, instance="bank-0", limits=Limits(max_events=len(ops), timeout_s=60)).run()
    return ops, settings


def test_bank_publishes_snapshot_events_that_match_their_manifests(kafka_bootstrap, tmp_path):
    from kafka import TopicPartition

    from infra.kafka import KafkaSettings, make_consumer

    ops, _ = _project_synthetic_ops(kafka_bootstrap, tmp_path, "bank-it", 250, seed=3, snapshot_every=100)
    consumer = make_consumer(KafkaSettings(bootstrap_servers=kafka_bootstrap))
    consumer.assign([TopicPartition(BANK_SNAPSHOTS.name, 0)])
    consumer.seek_to_beginning()
    events = []
    deadline = time.monotonic() + 10
    while len(events) < 2 and time.monotonic() < deadline:
        for batch in consumer.poll(timeout_ms=200).values():
            events += [decode(BANK_SNAPSHOTS, record.value) for record in batch]
    consumer.close()
    assert [event.next_offset for event in events] == [100, 200]
    for event in events:
        state, manifest = read_snapshot(Path(event.uri.removeprefix("file://")))
        assert (manifest.state_hash, manifest.next_offset) == (event.state_hash, event.next_offset)
        assert state.state_hash() == replay(enumerate(ops[: event.next_offset])).state.state_hash()


def test_replay_bank_from_the_archive_matches_and_a_tampered_bank_fails(kafka_bootstrap, tmp_path):
    from sqlalchemy import text

    from pipeline.runtime.launch import build_runner
    from pipeline.runtime.runner import Limits
    from workers.archiver import Archiver

    ops, settings = _project_synthetic_ops(kafka_bootstrap, tmp_path, "replay-it", 300, seed=11, snapshot_every=120)
    # The archiver also reads the two BankSnapshotWritten events the bank published.
    build_runner(Archiver, settings, instance="archiver-0", limits=Limits(max_events=len(ops) + 2, timeout_s=60)).run()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRL_")} | {"COLUMNS": "200"}
    good = subprocess.run([*CRL, "replay", "bank", str(tmp_path)], capture_output=True, text=True, env=env,
                          timeout=120)
    clean = replay(enumerate(ops)).state
    assert good.returncode == 0, good.stdout + good.stderr
    assert f"ops {len(ops)} applied {clean.applied} duplicates {clean.duplicates} rejected {clean.rejected} " \
           f"state_hash {clean.state_hash()}" in good.stdout
    assert "live SQL bank" in good.stdout and "snapshot 000000000240" in good.stdout
    shown = subprocess.run([*CRL, "bank", "show", str(tmp_path)], capture_output=True, text=True, env=env, timeout=60)
    assert shown.returncode == 0 and f"bank at offset {len(ops)}" in shown.stdout
    one = next(e for e in clean.experiences.values() if e.version > 1)
    detail = subprocess.run([*CRL, "bank", "show", str(tmp_path), one.experience_id], capture_output=True,
                            text=True, env=env, timeout=60)
    assert detail.returncode == 0 and f"version {one.version}" in detail.stdout
    assert all(version.op_id in detail.stdout for version in one.history)
    # Tamper with the live bank: the replay must notice.
    engine = make_engine(database_url(DbSettings(), tmp_path))
    with engine.begin() as connection:
        connection.execute(text("UPDATE bank_position SET state_hash = :h"), {"h": "0" * 64})
    bad = subprocess.run([*CRL, "replay", "bank", str(tmp_path)], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 1
    assert f"mismatch: live SQL bank at offset {len(ops)}" in bad.stderr


def test_served_experiences_are_counted_once_per_trajectory(kafka_bootstrap, tmp_path):
    from infra.kafka import KafkaSettings
    from pipeline.runtime.launch import build_runner
    from pipeline.runtime.runner import Limits
    from pipeline.runtime.settings import RunnerSettings
    from pipeline.settings import Settings
    from schemas.examples import example_events
    from schemas.topics import TRAJECTORIES
    from schemas.trajectories import ExperienceRef, TrajectoryCompleted
    from workers.bank import BankProjection

    ops = synthetic_op_log(60, seed=21, run_id="count-it")
    state = replay(enumerate(ops)).state
    first, second = list(state.active())[:2]
    template = next(e for e in example_events("count-it") if isinstance(e, TrajectoryCompleted))

    def guided(trajectory_id: str, *served) -> TrajectoryCompleted:
        refs = tuple(ExperienceRef(experience_id=e.experience_id, version=e.version, generation_id=e.generation_id)
                     for e in served)
        return template.model_copy(update={"trajectory_id": trajectory_id, "retrieved": refs})

    trajectories = [guided("t1", first), guided("t2", first, second), guided("t3", second)]
    trajectories.append(trajectories[1].model_copy(update={"event_id": __import__("uuid").uuid4()}))  # re-published
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap)
    for op in ops:
        producer.send(EXPERIENCE_OPS_TOPIC.name, key=EXPERIENCE_OPS_TOPIC.key_bytes(op), value=encode(op))
    for trajectory in trajectories:
        producer.send(TRAJECTORIES.name, key=TRAJECTORIES.key_bytes(trajectory), value=encode(trajectory))
    producer.close()
    settings = Settings(run_dir=tmp_path, run_id="count-it", kafka=KafkaSettings(bootstrap_servers=kafka_bootstrap),
                        runner=RunnerSettings(poll_timeout_ms=50))
    total = len(ops) + len(trajectories)
    build_runner(BankProjection, settings, instance="bank-0", limits=Limits(max_events=total, timeout_s=60)).run()
    store = _store(tmp_path)
    counts = (store.experience(first.experience_id)["retrievals"], store.experience(second.experience_id)["retrievals"])
    assert counts == (2, 2)
    # A restart re-applies the op log from its newest snapshot (none yet: offset 0) but reads no trajectory again
    # (their positions were committed after the served rows); the counts stay.
    again = build_runner(BankProjection, settings, instance="bank-1", limits=Limits(timeout_s=1.5)).run()
    assert again.events_in == len(ops)
    assert (store.experience(first.experience_id)["retrievals"],
            store.experience(second.experience_id)["retrievals"]) == (2, 2)
    assert store.position(EXPERIENCE_OPS_TOPIC.name, 0).state_hash == state.state_hash()


def test_extractor_training_steps_count_per_experience(kafka_bootstrap, tmp_path):
    from infra.kafka import KafkaSettings
    from pipeline.runtime.launch import build_runner
    from pipeline.runtime.runner import Limits
    from pipeline.runtime.settings import RunnerSettings
    from pipeline.settings import Settings
    from schemas.examples import example_events
    from schemas.topics import EXTRACTIONS, TRAIN_STEPS
    from workers.bank import BankProjection

    ops = synthetic_op_log(40, seed=4, run_id="train-it")
    state = replay(enumerate(ops)).state
    target = next(state.active())
    examples = {e.kind: e for e in example_events("train-it")}
    extraction = examples["ExtractionGenerated"].model_copy(update={"generation_id": target.generation_id})
    other = examples["ExtractionGenerated"].model_copy(update={"generation_id": "gen-unrelated",
                                                               "event_id": __import__("uuid").uuid4()})
    steps = [examples["TrainStepCompleted"].model_copy(update={
        "role": "extractor", "step": step, "event_id": __import__("uuid").uuid4(),
        "batch_event_ids": (str(extraction.event_id), str(other.event_id))}) for step in (1, 2)]
    actor_step = examples["TrainStepCompleted"].model_copy(update={
        "step": 9, "batch_event_ids": (str(extraction.event_id),)})  # role actor: not an extractor step
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap)
    for event in [*ops, extraction, other, *steps, actor_step]:
        topic = {"ExtractionGenerated": EXTRACTIONS, "TrainStepCompleted": TRAIN_STEPS}.get(event.kind,
                                                                                           EXPERIENCE_OPS_TOPIC)
        producer.send(topic.name, key=topic.key_bytes(event), value=encode(event))
    producer.close()
    settings = Settings(run_dir=tmp_path, run_id="train-it", kafka=KafkaSettings(bootstrap_servers=kafka_bootstrap),
                        runner=RunnerSettings(poll_timeout_ms=50))
    total = len(ops) + 5
    build_runner(BankProjection, settings, instance="bank-0", limits=Limits(max_events=total, timeout_s=60)).run()
    row = _store(tmp_path).experience(target.experience_id)
    assert (row["trainings"], row["last_trained_step"]) == (2, 2)


def test_the_bank_worker_rides_out_its_postgresql_being_stopped_and_started_mid_run(kafka_bootstrap, tmp_path):
    # A PostgreSQL of this test's own (initdb in a temporary directory): stopping it touches no other server.
    try:
        cluster = PostgresCluster.temporary()
    except PostgresClusterError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"no PostgreSQL for the outage test: {exc}")
        pytest.skip(f"no PostgreSQL for the outage test: {exc}")
    ops = synthetic_op_log(900, seed=5)
    clean = replay(enumerate(ops)).state
    log = tmp_path / "bank.out"
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, linger_ms=5)
    bank = None
    try:
        cluster.start()
        url = cluster.create_database("bank")
        store = _store(tmp_path, url)
        bank = _bank_process(kafka_bootstrap, tmp_path, log, CRL_DB__URL=url, CRL_RUNNER__RETRY_BACKOFF_MAX_S="0.5")

        def position() -> int:
            stored = store.position(EXPERIENCE_OPS_TOPIC.name, 0)
            return stored.next_offset if stored is not None else 0

        for op in ops[:300]:
            producer.send(EXPERIENCE_OPS_TOPIC.name, key=EXPERIENCE_OPS_TOPIC.key_bytes(op), value=encode(op))
        producer.flush()
        deadline = time.monotonic() + 60
        while position() < 100 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert position() >= 100, log.read_text()[-3000:]
        store.engine.dispose()
        cluster.stop()  # mid-run: the worker is still applying the first 300 ops
        for op in ops[300:]:
            producer.send(EXPERIENCE_OPS_TOPIC.name, key=EXPERIENCE_OPS_TOPIC.key_bytes(op), value=encode(op))
        producer.flush()
        time.sleep(6)  # down for 6 s: several failed flushes, each retried with backoff
        assert bank.poll() is None, log.read_text()[-3000:]
        cluster.start()
        deadline = time.monotonic() + 90
        while position() < len(ops) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert bank.poll() is None, log.read_text()[-3000:]
        stored = store.position(EXPERIENCE_OPS_TOPIC.name, 0)
        assert stored is not None and stored.next_offset == len(ops), log.read_text()[-3000:]
        # position and rows were written together: the stored rows hash to the recorded position, which is the
        # clean rebuild's
        assert stored.state_hash == clean.state_hash() == store.load_state().state_hash()
        assert (stored.applied, stored.duplicates, stored.rejected) == (clean.applied, clean.duplicates,
                                                                        clean.rejected)
        output = log.read_text()
        assert "state flush retry" in output and "the database is unavailable" in output, output[-3000:]
        assert "state flush succeeded after" in (tmp_path / "logs" / "bank-kill.log").read_text()
    finally:
        producer.close()
        if bank is not None:
            bank.send_signal(signal.SIGTERM)
            try:
                bank.wait(timeout=20)
            except subprocess.TimeoutExpired:
                bank.kill()
        cluster.remove()
    assert bank.returncode == 0, log.read_text()[-3000:]
