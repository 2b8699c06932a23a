"""Rollout time with the experience machinery vs without: the same fixed batch of episodes played by the same tiny
actor, side by side in one process (paper: 0.98-1.00x; goal <= 1.02).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/rollout_overhead.py --quick   # 16 episodes x 10 turns, < 1 minute
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/rollout_overhead.py           # 64 episodes x 20 turns

The batch: G groups of K MiniHack Room (random 5x5) episodes, played with `EpisodePlayer` — the rollout worker's
engine, one batched generation per turn — by the tiny preset actor (untrained, so episodes mostly run to the turn
limit: every configuration plays the same number of turns). Configurations:
- `without`: every slot free, no retriever (the `grpo` arm);
- `with`: K/2 slots per group guided: the real all-MiniLM-L6-v2 encoder, a bank of N experiences (searched exactly,
  as below 10k), the guided episodes' retrieval queued at admission and served in the background (one batch: one
  encode, one search) while the free episodes play, each guided episode joining the batch once its experience is
  there, the experience in the prompt; meanwhile a thread applies `ExperienceAdded` ops to the same bank under its
  writer lock at `--ops-per-s` — what a concurrently running extractor does to a rollout process (its model runs
  elsewhere: on its own GPU in a deployment);
- `with_shared_cores`: `with`, plus a second process generating with a tiny extractor model nonstop on the same
  CPU cores — on a 2-core machine this measures core sharing, not the design, and is printed for honesty.
Each configuration runs `--repeats` times (default 7 with `--quick`, 5 otherwise) after a warm-up, `without` and
`with` back to back in alternating order, the shared-cores runs last. `overhead_ratio` is the median over the repeats
of each repeat's with / without ratio (the pair ran back to back, so slow spells of a shared machine hit both), the
wall times and shares are medians too. Fresh retrievers each run, so no query embedding is cached across runs.
torch runs `--threads` threads, 1 by default (the tiny configs' rollout workers run `generation.threads: 1`): with
2 on a loaded 2-core machine, OpenMP's team made the tiny actor's generation 5-20x slower at random, and a second
thread that had run torch (the retrieval thread) lifted that, so the ratio measured OpenMP, not retrieval.

Prints `name=value` lines: `overhead_ratio` (goal <= 1.05), `retrieval_blocked_share` (the time the playing loop
waited on retrieval because every episode in flight was waiting, over the `with` wall time; goal <= 0.01),
`overhead_ratio_shared_cores`, `env_steps_per_s` (the MiniHack adapter alone with its text rendering, random
actions), `rollout_env_steps_per_s` (env steps per second of the `without` batch, generation included), and what
lies behind them: wall times, env steps played (`env_steps_without` / `env_steps_with`: guided prompts are longer and
sample other actions, so the batches differ in work as well as in retrieval), the retrieval time of the batch (spent
on the background thread) and its share of the `with` wall time, how many guided episodes started after the first
generate call (`guided_late_starts`, `calls_late`: the generate calls they sat out) and retrievals that ran past
the wait (`retrieval_timeouts`, 0 unless the encoder stalls).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # see benchmarks/retrieval.py
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

ENV_ID = "MiniHack-Room-Random-5x5-v0"
FAMILY = "minihack-room"
DIM = 384


def progress(message: str) -> None:
    print(f"# {message}", file=sys.stderr, flush=True)


def build_bank(size: int):  # type: ignore[no-untyped-def]
    from pipeline.bank.synthetic import synthetic_bank

    return synthetic_bank(size, FAMILY, DIM, text="Tip {i}: head diagonally toward the > and stop.")


def assignments(groups: int, k: int, guided: bool, max_turns: int):  # type: ignore[no-untyped-def]
    from pipeline.envs.registry import task_pool
    from schemas.base import Producer
    from schemas.tasks import EpisodeAssigned

    producer = Producer(worker="benchmark", instance="benchmark-0")
    seeds = task_pool(ENV_ID, "train", groups, seed=0)
    return [(EpisodeAssigned(run_id="bench", producer=producer, step=1, split="train", env_id=ENV_ID,
                             task_family=FAMILY, seed=seeds[g], group_id=f"g{g}", slot=s, group_size=k,
                             guided=guided and s < k // 2, policy_version=0, max_turns=max_turns),
             ("crl.tasks", 0), g * k + s) for g in range(groups) for s in range(k)]


class OpStream:
    """Applies ExperienceAdded ops to the bank at a fixed rate in a thread, as the replica's tail would."""

    def __init__(self, bank, ops_per_s: float) -> None:  # type: ignore[no-untyped-def]
        self.bank, self.interval = bank, 1.0 / ops_per_s
        self.applied = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from pipeline.bank.synthetic import embedding_like
        from schemas.arrays import EmbeddingVector
        from schemas.base import Producer
        from schemas.experiences import ExperienceAdded

        producer = Producer(worker="extractor", instance="bench")
        rng = np.random.default_rng(7)
        while not self._stop.wait(self.interval):
            n = self.applied
            op = ExperienceAdded(
                run_id="bench", producer=producer, op_id=f"stream-{n}", experience_id=f"stream-exp-{n}",
                task_family=FAMILY, text=f"Streamed tip {n}.", generation_id=f"stream-gen-{n}", extractor_version=0,
                key=EmbeddingVector.from_array("all-MiniLM-L6-v2", embedding_like(rng, 1, DIM)[0]),
                source_trajectory_ids=(f"stream-traj-{n}",))
            self.bank.apply(op, self.bank.offset)
            self.applied += 1

    def __enter__(self) -> OpStream:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def extractor_load(stop) -> None:  # type: ignore[no-untyped-def]
    """A second process generating with a tiny extractor model until told to stop (CPU contention)."""
    import torch

    from pipeline.models import SamplingParams, TinyModelSettings, build_tiny

    torch.set_num_threads(1)
    extractor = build_tiny(TinyModelSettings(seed=1, corpus_episodes=4))
    prompt = "Goal: reach the staircase down\nOutcome: SUCCESS\nWrite lessons as ops.\n<answer>"
    calls = 0
    while not stop.is_set():
        extractor.generate([prompt] * 8, SamplingParams(max_new_tokens=32), seeds=range(8 * calls, 8 * calls + 8))
        calls += 1


def play(policy, batch, retriever) -> dict[str, float]:  # type: ignore[no-untyped-def]
    from pipeline.actor.episodes import EpisodePlayer
    from pipeline.actor.settings import RolloutSettings
    from pipeline.envs.settings import EnvSettings
    from pipeline.models.settings import GenerationSettings
    from schemas.base import Producer

    player = EpisodePlayer(RolloutSettings(generation=GenerationSettings(max_new_tokens=6, micro_batch=64)),
                           EnvSettings(), run_id="bench", producer=Producer(worker="rollout", instance="bench"),
                           retriever=retriever, seed=0)
    player.policy, player.version = policy, 0
    started = time.perf_counter()
    player.start(batch)
    trajectories = player.play_to_end()
    wall = time.perf_counter() - started
    player.close()
    stats = player.stats
    return {"wall": wall, "env_steps": sum(t.num_actions for t in trajectories),
            "retrieval_s": player.background.busy_s, "blocked_s": stats.blocked_s,
            "late_starts": stats.late_starts, "calls_late": stats.calls_late, "timeouts": stats.timeouts,
            "served": sum(bool(t.retrieved) for t in trajectories if t.guided)}


def raw_env_steps_per_s(seconds: float) -> float:
    from pipeline.envs.registry import make_env
    from pipeline.envs.settings import EnvSettings

    env = make_env(ENV_ID, EnvSettings(), max_turns=100)
    rng = random.Random(0)
    steps, started, seed = 0, time.perf_counter(), 0
    while time.perf_counter() - started < seconds:
        env.reset(seed)
        seed += 1
        while not env.step(rng.choice(env.available_actions())).done:
            steps += 1
        steps += 1
    rate = steps / (time.perf_counter() - started)
    env.close()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 episodes x 10 turns, 7 repeats (about a minute)")
    parser.add_argument("--bank", type=int, default=None, help="experiences in the bank (default 1000 / 5000)")
    parser.add_argument("--ops-per-s", type=float, default=20.0, help="ops the concurrent extractor applies")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: as the tiny configs' rollout workers, generation.threads)")
    args = parser.parse_args()
    groups, k, max_turns = (4, 4, 10) if args.quick else (8, 8, 20)
    bank_size = args.bank or (1000 if args.quick else 5000)
    repeats = args.repeats or (7 if args.quick else 5)

    import torch

    from pipeline.bank.embeddings import load_sentence_encoder
    from pipeline.bank.retrieval import Retriever
    from pipeline.bank.settings import RetrievalSettings
    from pipeline.models import TinyModelSettings, build_tiny

    torch.set_num_threads(args.threads)
    progress("building the tiny actor, the encoder and the bank")
    policy = build_tiny(TinyModelSettings())
    policy.micro_batch_size = 64
    encoder = load_sentence_encoder("all-MiniLM-L6-v2")
    bank = build_bank(bank_size)
    free, guided = assignments(groups, k, False, max_turns), assignments(groups, k, True, max_turns)
    encoder.encode(["warm-up"], convert_to_numpy=True, normalize_embeddings=True)
    play(policy, free[:k], None)

    walls: dict[str, list[float]] = {"without": [], "with": [], "with_shared_cores": []}
    runs: list[dict[str, float]] = []
    env_steps = guided_steps = 0
    for repeat in range(repeats):
        progress(f"repeat {repeat + 1}/{repeats}")
        for name in (("without", "with") if repeat % 2 == 0 else ("with", "without")):  # alternate the order
            if name == "without":
                result = play(policy, free, None)
                env_steps = int(result["env_steps"])
            else:
                with OpStream(bank, args.ops_per_s):
                    result = play(policy, guided, Retriever(bank, encoder, RetrievalSettings()))
                guided_steps = int(result["env_steps"])
                runs.append(result)
            walls[name].append(result["wall"])
    # Last, so the extractor process cannot slow the other two configurations down.
    stop = multiprocessing.Event()
    load = multiprocessing.Process(target=extractor_load, args=(stop,), daemon=True)
    load.start()
    time.sleep(3.0)  # let it build its model and start generating
    for _ in range(repeats):
        with OpStream(bank, args.ops_per_s):
            result = play(policy, guided, Retriever(bank, encoder, RetrievalSettings()))
        walls["with_shared_cores"].append(result["wall"])
    stop.set()
    load.join(30)
    median = {name: float(np.median(values)) for name, values in walls.items()}
    ratios = [w / wo for w, wo in zip(walls["with"], walls["without"], strict=True)]
    print(f"episodes={groups * k}")
    print(f"max_turns={max_turns}")
    print(f"bank_experiences={bank_size}")
    print(f"repeats={repeats}")
    for name, value in median.items():
        print(f"wall_s_{name}={value:.3f}")
    print(f"env_steps_without={env_steps}")
    print(f"env_steps_with={guided_steps}")
    print(f"retrieval_s_per_batch={np.median([r['retrieval_s'] for r in runs]):.3f}")
    print(f"retrieval_share_of_with={np.median([r['retrieval_s'] / r['wall'] for r in runs]):.3f}")
    print(f"retrieval_blocked_share={np.median([r['blocked_s'] / r['wall'] for r in runs]):.4f}")
    print(f"guided_late_starts={np.median([r['late_starts'] for r in runs]):.0f}")
    print(f"calls_late={np.median([r['calls_late'] for r in runs]):.0f}")
    print(f"retrieval_timeouts={sum(r['timeouts'] for r in runs):.0f}")
    print(f"guided_served={np.median([r['served'] for r in runs]):.0f}")
    print(f"overhead_ratios={','.join(f'{r:.3f}' for r in ratios)}")
    print(f"overhead_ratio={np.median(ratios):.3f}")
    print(f"overhead_ratio_shared_cores={median['with_shared_cores'] / median['without']:.3f}")
    print(f"rollout_env_steps_per_s={env_steps / median['without']:.0f}")
    print(f"env_steps_per_s={raw_env_steps_per_s(3.0 if args.quick else 10.0):.0f}")


if __name__ == "__main__":
    main()
