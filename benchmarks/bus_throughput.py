"""Event-backbone throughput, measured side by side in one run on both embedded brokers (Tansu, Apache Kafka).

    python benchmarks/bus_throughput.py --quick     # about 10 s
    python benchmarks/bus_throughput.py             # 10x the events
    python benchmarks/bus_throughput.py --brokers tansu   # one broker only

Prints `name=value` lines:
- `trajectory_bytes_base64`, `trajectory_bytes_json_lists`, `size_ratio_json_lists_over_base64`: one realistic
  trajectory (30 turns, 300 prompt + 8 response tokens each, 32k vocabulary) with compact base64 arrays vs the same
  as JSON lists;
- `encode_per_s`, `decode_per_s`: codec speed on that trajectory (decode includes full validation);
then per broker B (`tansu`, `kafka`), each on a fresh broker of its own:
- `broker_start_s_B`: from launch to answering metadata requests (Apache Kafka: storage format + JVM start; the jars
  are already cached), and `broker_rss_mib_B`: the broker's resident memory once the events below went through it;
- `produce_events_per_s_B`: small events published through the runner's Kafka output (encode + send + flush);
- `archiver_events_per_s_B`: events consumed, validated and archived to Parquet by the archiver worker;
- `archiver_over_produce_ratio_B`: how the consuming side keeps up with the producing side;
and, with both brokers, `produce_kafka_over_tansu` and `archiver_kafka_over_tansu` (ratios of the rates above).
A broker that cannot start here prints `broker_unavailable_B=<reason>` instead of its figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from infra.admin import create_topics
from infra.broker import BrokerError, BrokerSettings, embedded_broker
from infra.kafka import KafkaSettings, make_admin, make_producer
from pipeline.runtime.launch import build_runner
from pipeline.runtime.runner import Limits
from pipeline.runtime.settings import RunnerSettings
from pipeline.runtime.transport import KafkaOutput
from pipeline.settings import ArchiverSettings, Settings
from schemas.codec import decode, encode
from schemas.examples import example_events
from schemas.topics import TRAJECTORIES, topic_of
from schemas.trajectories import TrajectoryCompleted, Turn
from workers.archiver import Archiver


def realistic_trajectory() -> TrajectoryCompleted:
    """30 turns of 300 prompt and 8 response tokens from a 32k vocabulary, with log-probs as a sampler records them."""
    rng = np.random.default_rng(0)
    example = next(e for e in example_events("bench") if isinstance(e, TrajectoryCompleted))
    turns = tuple(
        Turn(observation=f"turn {i}: a wall to the north, the staircase down two squares south-east.",
             prompt_token_ids=tuple(rng.integers(0, 32000, 300).tolist()),
             response_token_ids=tuple(rng.integers(0, 32000, 8).tolist()),
             sampling_logprobs=tuple((-rng.exponential(0.7, 8)).tolist()),
             response_text="southeast", action="southeast", valid=True, reward=0.0)
        for i in range(30)
    )
    return example.model_copy(update={"turns": turns, "num_actions": 30})


def rate(count: int, seconds: float) -> float:
    return count / seconds if seconds > 0 else float("inf")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer events (about 10 s)")
    parser.add_argument("--brokers", nargs="+", choices=("tansu", "kafka"), default=["tansu", "kafka"],
                        help="which embedded brokers to measure (default: both, side by side)")
    args = parser.parse_args()
    codec_rounds = 200 if args.quick else 2000
    events_total = 5000 if args.quick else 50000

    trajectory = realistic_trajectory()
    wire = encode(trajectory)
    as_lists = json.dumps(trajectory.model_dump(mode="python"), default=str).encode()
    print(f"trajectory_bytes_base64={len(wire)}")
    print(f"trajectory_bytes_json_lists={len(as_lists)}")
    print(f"size_ratio_json_lists_over_base64={len(as_lists) / len(wire):.2f}")

    started = time.perf_counter()
    for _ in range(codec_rounds):
        encode(trajectory)
    print(f"encode_per_s={rate(codec_rounds, time.perf_counter() - started):.0f}")
    started = time.perf_counter()
    for _ in range(codec_rounds):
        decode(TRAJECTORIES, wire)
    print(f"decode_per_s={rate(codec_rounds, time.perf_counter() - started):.0f}")

    rates: dict[str, dict[str, float]] = {}
    for kind in args.brokers:
        try:
            rates[kind] = bus_rates(kind, events_total)
        except BrokerError as exc:
            print(f"broker_unavailable_{kind}={exc}")
    if {"tansu", "kafka"} <= set(rates):
        for name in ("produce", "archiver"):
            print(f"{name}_kafka_over_tansu={rates['kafka'][name] / rates['tansu'][name]:.2f}")


def bus_rates(kind: str, events_total: int) -> dict[str, float]:
    """Start broker `kind`, produce `events_total` small events, archive them; print and return the rates."""
    with tempfile.TemporaryDirectory(prefix="crl-bench-") as scratch:
        broker = embedded_broker(BrokerSettings(kind=kind), data_dir=Path(scratch) / "kafka",
                                 log_path=Path(scratch) / "broker.log")
        with broker:
            print(f"broker_start_s_{kind}={broker.start_seconds:.2f}")
            kafka = KafkaSettings(bootstrap_servers=broker.bootstrap_servers)
            admin = make_admin(kafka)
            create_topics(admin)
            admin.close()
            small = next(e for e in example_events("bench") if e.kind == "EpisodeAssigned")
            output = KafkaOutput(make_producer(kafka))
            topic = topic_of(small)
            started = time.perf_counter()
            for slot in range(events_total):
                event = small.model_copy(update={"group_id": f"g{slot % 64}"})
                output.send(topic.name, topic.key_bytes(event), encode(event), [])
            output.flush()
            produce_s = time.perf_counter() - started
            output.close()
            produce = rate(events_total, produce_s)
            print(f"produce_events_per_s_{kind}={produce:.0f}")

            settings = Settings(
                run_dir=Path(scratch) / "run", run_id="bench", kafka=kafka,
                runner=RunnerSettings(poll_timeout_ms=100, metrics_interval_s=3600),
                archiver=ArchiverSettings(flush_rows=5000, flush_interval_s=5.0),
            )
            runner = build_runner(Archiver, settings, instance="bench-archiver",
                                  limits=Limits(max_events=events_total, timeout_s=120))
            started = time.perf_counter()
            metrics = runner.run()
            archive_s = time.perf_counter() - started
            archived = rate(metrics.events_in, archive_s)
            print(f"archiver_events_{kind}={metrics.events_in}")
            print(f"archiver_events_per_s_{kind}={archived:.0f}")
            print(f"archiver_over_produce_ratio_{kind}={archived / produce:.2f}")
            print(f"broker_rss_mib_{kind}={(broker.resident_memory_bytes() or 0) / 2**20:.0f}")
    return {"produce": produce, "archiver": archived}


if __name__ == "__main__":
    main()
