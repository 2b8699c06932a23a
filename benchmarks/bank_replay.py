"""Bank replay throughput vs raw USearch adds of the same vectors, measured side by side in one run.

    python benchmarks/bank_replay.py --quick     # 50k ops, under a minute
    python benchmarks/bank_replay.py             # 100k and 1M ops (20+ minutes on 2 cores, ~3 GB)
    python benchmarks/bank_replay.py --ops 100000  # any sizes

A synthetic op log (`pipeline.bank.synthetic`: adds, refines, merges, retires, stale refines and re-published ops,
384-d embedding-like keys) is encoded to wire bytes first. The replay then does what `crl replay bank` does: decode
every record and apply it to the state machine, with the garbage collector paused; then build the index once from the
final active vectors in canonical order (HNSW above 10,000 per family, the families' graphs side by side). The
baseline adds every key vector of the log (one per add and merge op) to one USearch cosine index with the bank
index's graph settings (i8, connectivity 16, expansion_add 128), single-threaded, in one batch call.

Prints per size (`ops_100000_...`) and, for the largest size run:
- `replay_ops_per_s`: ops per second of the whole replay (decode + apply + index build);
- `replay_apply_ops_per_s`: the same without decoding (the projection's own cost);
- `raw_adds_per_s`: vectors per second of the raw USearch adds;
- `replay_vs_raw_ratio`: replay_ops_per_s / raw_adds_per_s (target >= 0.5; replay >= 30,000 ops/s).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from usearch.index import Index

from pipeline.bank.index import ExperienceIndex
from pipeline.bank.replay import collector_paused
from pipeline.bank.state import BankState
from pipeline.bank.synthetic import iter_synthetic_ops
from schemas.codec import decode, encode
from schemas.topics import EXPERIENCE_OPS_TOPIC


def measure(count: int) -> dict[str, float]:
    wire: list[bytes] = []
    vectors: list[np.ndarray] = []
    for op in iter_synthetic_ops(count, seed=count):
        wire.append(encode(op))
        if op.kind in ("ExperienceAdded", "ExperienceMerged"):
            vectors.append(np.asarray(op.key.data, dtype=np.float32))

    state = BankState()
    decode_s = apply_s = 0.0
    with collector_paused():  # as `crl replay bank` runs (pipeline.bank.replay.replay)
        for offset, data in enumerate(wire):
            started = time.perf_counter()
            op = decode(EXPERIENCE_OPS_TOPIC, data)
            decoded = time.perf_counter()
            state.apply(op, offset)  # type: ignore[arg-type]
            apply_s += time.perf_counter() - decoded
            decode_s += decoded - started
        started = time.perf_counter()
        index = ExperienceIndex.build(((e.experience_id, e.task_family, e.key) for e in state.active()),
                                      dim=state.key_dim or 384)
        index_s = time.perf_counter() - started

    matrix = np.stack(vectors)
    raw = Index(ndim=matrix.shape[1], metric="cos", dtype=index.graph_dtype, connectivity=index.connectivity,
                expansion_add=index.expansion_add)  # the bank index's own graph settings
    started = time.perf_counter()
    raw.add(np.arange(len(matrix), dtype=np.uint64), matrix, threads=1)
    raw_s = time.perf_counter() - started

    replay_ops_per_s = len(wire) / (decode_s + apply_s + index_s)
    raw_adds_per_s = len(matrix) / raw_s
    return {
        "ops": len(wire),
        "applied": state.applied,
        "duplicates": state.duplicates,
        "rejected": state.rejected,
        "active": len(index),
        "index_modes": ",".join(sorted(set(index.mode.values()))),
        "decode_s": decode_s,
        "apply_s": apply_s,
        "index_build_s": index_s,
        "replay_ops_per_s": replay_ops_per_s,
        "replay_apply_ops_per_s": len(wire) / (apply_s + index_s),
        "raw_adds": len(matrix),
        "raw_adds_per_s": raw_adds_per_s,
        "replay_vs_raw_ratio": replay_ops_per_s / raw_adds_per_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="50k ops only (under a minute)")
    parser.add_argument("--ops", type=int, nargs="+", metavar="N", help="log sizes to run (default 100k and 1M)")
    args = parser.parse_args()
    sizes = args.ops or ([50_000] if args.quick else [100_000, 1_000_000])
    results = {}
    for size in sizes:
        results[size] = measure(size)
        for name, value in results[size].items():
            text = f"{value:.3f}" if isinstance(value, float) else str(value)
            print(f"ops_{size}_{name}={text}", flush=True)
    largest = results[sizes[-1]]
    for name in ("replay_ops_per_s", "replay_apply_ops_per_s", "raw_adds_per_s", "replay_vs_raw_ratio"):
        print(f"{name}={largest[name]:.2f}")


if __name__ == "__main__":
    main()
