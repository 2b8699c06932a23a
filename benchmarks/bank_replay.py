"""Bank replay throughput vs raw USearch adds of the same vectors, and the op log read fast vs decoded in full, all
measured side by side in one run.

    python benchmarks/bank_replay.py --quick     # 50k ops, about a minute
    python benchmarks/bank_replay.py             # 100k and 1M ops (20+ minutes on 2 cores, ~4 GB)
    python benchmarks/bank_replay.py --ops 100000  # any sizes

A synthetic op log (`pipeline.bank.synthetic`: adds, refines, merges, retires, stale refines and re-published ops,
384-d embedding-like keys) is encoded to wire bytes first, and the ops as generated are applied to a bank of their
own: the "live" bank, whose outcomes (applied, duplicate or rejected, op by op) and final state hash the replays must
reproduce. A replay does what `crl replay bank` does: `pipeline.bank.replay.replay` over the records read lazily,
with the garbage collector paused; then the index is built once from the final active vectors in canonical order
(HNSW above 10,000 per family, the families' graphs side by side). It runs twice over the same records:
- after: read by `read_op`, as `crl replay bank` and the bank replicas read them (canonical records by msgspec into
  the bank's own records, `pipeline.bank.op_records`; any other record by `decode_op`);
- before: every record decoded in full by `decode_op` (parse, upcast, pydantic validation), as they were read before.
A third pass over the same records times `decode_op`, `read_op` and applying apart, record by record (its per-record
timer calls are why it is not the headline figure). The baseline adds every key vector of the log (one per add and
merge op) to one USearch cosine index with the bank index's graph settings (i8, connectivity 16, expansion_add 128),
single-threaded, in one batch call. Times are wall-clock: on a shared machine, compare runs made side by side.

Prints per size N, as `ops_N_<name>=<value>`:
- `ops`, `applied`, `duplicates`, `rejected`: the log's size and the replay's counts;
- `active`, `index_modes`: active experiences after the replay and the index mode(s) their families got;
- `matches_live`: True when every pass ended at the live bank's state hash and the third pass (read by `read_op`)
  decided every op as it did (the run exits 1 otherwise);
- `wire_mb`: the encoded log held in memory;
- `replay_s`, `replay_before_s`: the replay, reading and applying together, after and before;
- `decode_s`, `read_s`, `apply_s`: the third pass's split (decode_op alone, read_op alone, BankState.apply alone);
- `decode_us_per_op`, `read_us_per_op`, `apply_us_per_op`: the same per op;
- `index_build_s`: building the index from the final state (after's; before's is built and timed the same way);
- `peak_rss_mb`: the process's peak resident memory during the after replay and its index build (Linux: the peak is
  reset just before; elsewhere the process's peak so far), the encoded log and the live bank's outcomes included;
- `replay_ops_per_s`, `replay_before_ops_per_s`: ops per second of the whole replay (replay_s + index_build_s);
- `replay_speedup`: replay_ops_per_s / replay_before_ops_per_s;
- `replay_cpu_ops_per_s`: the after replay per second of this thread's CPU time (the index build's own threads not
  counted): steadier than wall-clock on a machine other work shares;
- `replay_apply_ops_per_s`: the same without reading (apply_s + index_build_s: the projection's own cost);
- `raw_adds`, `raw_adds_per_s`: vectors added to the raw USearch index, and per second;
- `replay_vs_raw_ratio`: replay_ops_per_s / raw_adds_per_s.

Then, for the largest size run, without the prefix: `replay_ops_per_s` (target >= 100,000 at 50k ops),
`replay_before_ops_per_s`, `replay_speedup`, `replay_cpu_ops_per_s`, `replay_decode_us_per_op`,
`replay_read_us_per_op`, `replay_apply_us_per_op`, `replay_apply_ops_per_s`, `raw_adds_per_s`, `replay_vs_raw_ratio`
(target >= 0.5), and `replay_ops_per_s_N` and `replay_peak_rss_mb_N` with N the size.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from usearch.index import Index

from pipeline.bank.index import ExperienceIndex
from pipeline.bank.replay import collector_paused, replay
from pipeline.bank.state import Applied, BankOp, BankState, Duplicate, Outcome, decode_op, read_op
from pipeline.bank.synthetic import iter_synthetic_ops
from schemas.codec import encode

_OUTCOME_CODES = {Applied: b"a", Duplicate: b"d"}


def _code(outcome: Outcome) -> bytes:
    """One byte per op: a(pplied), d(uplicate) or r(ejected)."""
    return _OUTCOME_CODES.get(type(outcome), b"r")


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark of this process to its current RSS (Linux); False where that is not
    possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _peak_rss_mb() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux, the peak so far


def measure(count: int) -> dict[str, float | int | str | bool]:
    wire: list[bytes] = []
    keys: list[np.ndarray] = []
    live = BankState()  # the ops as generated, applied without the wire: what the replay must reproduce
    live_outcomes = bytearray()
    for offset, op in enumerate(iter_synthetic_ops(count, seed=count)):
        wire.append(encode(op))
        live_outcomes += _code(live.apply(op, offset))
        if op.kind in ("ExperienceAdded", "ExperienceMerged"):
            keys.append(op.key.float16())
    live_hash = live.state_hash()
    del live

    def timed_replay(read: Callable[[bytes], BankOp]) -> tuple[BankState, ExperienceIndex, float, float, float]:
        """One replay and index build over `wire`: (state, index, replay_s, index_s, this thread's CPU s)."""
        with collector_paused():  # as `crl replay bank` runs (pipeline.bank.replay.replay pauses it too)
            started, cpu_started = time.perf_counter(), time.thread_time()
            state = replay((offset, read(data)) for offset, data in enumerate(wire)).state
            replay_s = time.perf_counter() - started
            started = time.perf_counter()
            index = ExperienceIndex.build(((e.experience_id, e.task_family, e.key) for e in state.active()),
                                          dim=state.key_dim or 384)
            index_s = time.perf_counter() - started
            return state, index, replay_s, index_s, time.thread_time() - cpu_started

    before_state, before_index, before_replay_s, before_index_s, _ = timed_replay(decode_op)
    before_hash = before_state.state_hash()
    del before_state, before_index
    _reset_peak_rss()
    state, index, replay_s, index_s, replay_cpu_s = timed_replay(read_op)
    peak_rss_mb = _peak_rss_mb()
    replay_hash = state.state_hash()
    counts = (state.applied, state.duplicates, state.rejected)
    active = len(index)
    index_modes = ",".join(sorted(set(index.mode.values())))
    graph = {"dtype": index.graph_dtype, "connectivity": index.connectivity, "expansion_add": index.expansion_add}
    del state, index

    split = BankState()  # the third pass: decode_op, read_op and apply timed apart, outcomes kept
    outcomes = bytearray()
    decode_s = read_s = apply_s = 0.0
    with collector_paused():
        for offset, data in enumerate(wire):
            started = time.perf_counter()
            decode_op(data)
            decoded = time.perf_counter()
            bank_op = read_op(data)
            was_read = time.perf_counter()
            outcome = split.apply(bank_op, offset)
            apply_s += time.perf_counter() - was_read
            read_s += was_read - decoded
            decode_s += decoded - started
            outcomes += _code(outcome)
    matches_live = (replay_hash == live_hash and before_hash == live_hash and split.state_hash() == live_hash
                    and outcomes == live_outcomes)
    del split

    matrix = np.stack(keys).astype(np.float32)
    del keys
    raw = Index(ndim=matrix.shape[1], metric="cos", **graph)  # the bank index's own graph settings
    started = time.perf_counter()
    raw.add(np.arange(len(matrix), dtype=np.uint64), matrix, threads=1)
    raw_s = time.perf_counter() - started

    ops = len(wire)
    replay_ops_per_s = ops / (replay_s + index_s)
    replay_before_ops_per_s = ops / (before_replay_s + before_index_s)
    raw_adds_per_s = len(matrix) / raw_s
    return {
        "ops": ops,
        "applied": counts[0],
        "duplicates": counts[1],
        "rejected": counts[2],
        "active": active,
        "index_modes": index_modes,
        "matches_live": matches_live,
        "wire_mb": sum(map(len, wire)) / 2**20,
        "replay_s": replay_s,
        "replay_before_s": before_replay_s,
        "decode_s": decode_s,
        "read_s": read_s,
        "apply_s": apply_s,
        "decode_us_per_op": decode_s / ops * 1e6,
        "read_us_per_op": read_s / ops * 1e6,
        "apply_us_per_op": apply_s / ops * 1e6,
        "index_build_s": index_s,
        "peak_rss_mb": peak_rss_mb,
        "replay_ops_per_s": replay_ops_per_s,
        "replay_before_ops_per_s": replay_before_ops_per_s,
        "replay_speedup": replay_ops_per_s / replay_before_ops_per_s,
        "replay_cpu_ops_per_s": ops / replay_cpu_s,
        "replay_apply_ops_per_s": ops / (apply_s + index_s),
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
    for name in ("replay_ops_per_s", "replay_before_ops_per_s", "replay_speedup", "replay_cpu_ops_per_s",
                 "decode_us_per_op", "read_us_per_op", "apply_us_per_op", "replay_apply_ops_per_s", "raw_adds_per_s",
                 "replay_vs_raw_ratio"):
        print(f"{name if name.startswith(('replay', 'raw')) else 'replay_' + name}={largest[name]:.2f}")
    print(f"replay_ops_per_s_{sizes[-1]}={largest['replay_ops_per_s']:.2f}")
    print(f"replay_peak_rss_mb_{sizes[-1]}={largest['peak_rss_mb']:.1f}")
    if not all(result["matches_live"] for result in results.values()):
        print("replay does not match the live bank", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
