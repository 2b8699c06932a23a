"""A replicated Apache Kafka cluster on this machine: N KRaft nodes, each a broker and a voter of the controller quorum.

    with ApacheKafkaCluster(data_dir=run_dir / "kafka", log_path=run_dir / "logs" / "broker.log", brokers=3) as c:
        print(c.bootstrap_servers)          # every node's address, comma-separated

`crl stack up --broker kafka --brokers 3` and `crl run ... --brokers 3` start one. Every node is an
`ApacheKafkaBroker` with its own storage (`data_dir/node-<id>/`) and log (`broker-<id>.log` beside `log_path`), all
formatted with one cluster id (kept in `data_dir/cluster.json`). With three nodes, internal topics and the topics
`crl topics create` makes get three replicas and `min.insync.replicas=2` (`replication_policy`), so one node can die
(SIGKILL) and every write with `acks=all` still lands on two: the run carries on with no restart.

The cluster counts as running while a majority of its nodes runs (the quorum that elects a controller); stopping
it stops every node at once.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import ClassVar, Self

from infra.apache_kafka import DEFAULT_JVM, KAFKA_VERSION, ApacheKafkaBroker, KafkaJvm, new_cluster_id
from infra.broker_process import free_loopback_port
from infra.errors import BrokerError
from infra.service import LocalService

DEGRADED_STOP_S = 8.0
"""Grace period of a node's stop once another node has died."""


class ApacheKafkaCluster(LocalService):
    """`brokers` Apache Kafka KRaft nodes as child JVMs on loopback, their logs in `data_dir` (durable)."""

    kind: ClassVar[str] = "kafka"
    durable: ClassVar[bool] = True

    def __init__(
        self,
        *,
        data_dir: Path,
        brokers: int,
        log_path: Path | None = None,
        port: int | None = None,
        jvm: KafkaJvm = DEFAULT_JVM,
        start_timeout_s: float = 90.0,
    ) -> None:
        if brokers < 2:
            raise BrokerError(f"a cluster has at least 2 brokers, not {brokers} (one broker: ApacheKafkaBroker)")
        self.data_dir = data_dir
        self.brokers = brokers
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        self.start_seconds: float | None = None
        self.description = f"Apache Kafka {KAFKA_VERSION} ({brokers} brokers)"
        cluster_id = self._cluster_id()
        ports = self._ports(port)
        voters = {node: controller for node, (_, controller) in ports.items()}
        self.nodes = [
            ApacheKafkaBroker(
                data_dir=data_dir / f"node-{node}", log_path=self._node_log(node), port=broker_port, jvm=jvm,
                start_timeout_s=start_timeout_s,
                node_id=node, cluster_id=cluster_id, controller_port=controller, voters=voters)
            for node, (broker_port, controller) in ports.items()
        ]

    def _node_log(self, node: int) -> Path | None:
        return None if self.log_path is None else self.log_path.with_name(f"{self.log_path.stem}-{node}.log")

    def _cluster_id(self) -> str:
        """The cluster id every node is formatted with, kept beside them; a directory formatted for another number of
        nodes is refused (its quorum has other voters)."""
        path = self.data_dir / "cluster.json"
        if path.exists():
            recorded = json.loads(path.read_text())
            if recorded["brokers"] != self.brokers:
                raise BrokerError(f"{self.data_dir} holds a cluster of {recorded['brokers']} brokers, not "
                                  f"{self.brokers}: start it with --brokers {recorded['brokers']} or use another "
                                  "run directory")
            return str(recorded["cluster_id"])
        cluster_id = new_cluster_id()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"cluster_id": cluster_id, "brokers": self.brokers}))
        return cluster_id

    def _ports(self, first_port: int | None) -> dict[int, tuple[int, int]]:
        """node id -> (broker port, controller port): the last start's where they are free, else new distinct ones."""
        taken: set[int] = set()
        ports: dict[int, tuple[int, int]] = {}
        for node in range(1, self.brokers + 1):
            remembered = ApacheKafkaBroker.remembered_ports(self.data_dir / f"node-{node}")
            pair = (remembered.get("port"), remembered.get("controller_port"))
            if node == 1 and first_port is not None:
                pair = (first_port, pair[1])
            chosen = []
            for candidate in pair:
                while candidate is None or candidate in taken:
                    candidate = free_loopback_port()
                taken.add(candidate)
                chosen.append(candidate)
            ports[node] = (chosen[0], chosen[1])
        return ports

    # -- what the run and the stack use, as of one broker ------------------------------------------------------------

    @property
    def bootstrap_servers(self) -> str:
        return ",".join(node.bootstrap_servers for node in self.nodes)

    @property
    def port(self) -> int:
        return self.nodes[0].port

    @property
    def pid(self) -> int | None:
        return self.nodes[0].pid

    @property
    def pids(self) -> dict[int, int | None]:
        """node id -> pid of its JVM (None while it is not running)."""
        return {node.node_id: node.pid for node in self.nodes}

    def is_running(self) -> bool:
        """Whether a majority of the nodes runs: enough to elect a controller and keep serving."""
        return sum(node.is_running() for node in self.nodes) > self.brokers // 2

    def resident_memory_bytes(self) -> int | None:
        sizes = [size for node in self.nodes if (size := node.resident_memory_bytes()) is not None]
        return sum(sizes) if sizes else None

    def start(self) -> Self:
        """Launch every node, then wait until each answers (a node answers only once the quorum has formed)."""
        began = time.monotonic()
        try:
            for node in self.nodes:
                if not node.is_running():
                    node.launch()
            for node in self.nodes:
                node.wait_until_ready(began)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - began
        return self

    def stop(self, timeout_s: float | None = None) -> None:
        """SIGTERM to every node at once (SIGKILL after the grace period); safe to call twice.

        With every node up the controlled shutdowns take ~6 s. Once a node is gone, the last survivors lose the
        quorum while they stop and wait for a controller that cannot come: they get `DEGRADED_STOP_S`, then SIGKILL
        (which loses nothing acknowledged: the records are in the page cache of two nodes)."""
        if timeout_s is None and not all(node.is_running() for node in self.nodes):
            timeout_s = DEGRADED_STOP_S
        with ThreadPoolExecutor(max_workers=len(self.nodes)) as pool:
            list(pool.map(lambda node: node.stop(timeout_s), self.nodes))

    def kill(self) -> None:
        for node in self.nodes:
            node.kill()

