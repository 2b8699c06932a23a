"""Are the warm starts robust? Both trainers' warm starts of a config, from an empty cache, for several model seeds
(`tiny.seed`) and thread counts, each held to its gate (`warm_start.gate`, `pipeline.rl.warm_gate`).

    python benchmarks/warm_start_gates.py              # tiny-dark-corridor.yaml, seeds 0-4, 1 and 2 threads
    python benchmarks/warm_start_gates.py --quick      # seeds 0 and 1, one thread
    python benchmarks/warm_start_gates.py --config configs/tiny-dark-corridor-extractor.yaml --seeds 5 --seed-base 10

A warm start whose skill only just appears (a phase change some seeds or float orders cross and others do not)
passes its gate on one machine and misses it on another; this runs each (seed, threads) pair as its own process
with its own empty cache directory, the trainer's thread count set to that number (float sums depend on it), up to
`--jobs` one-thread pairs side by side and two-thread pairs alone. Both trainers' model seeds are set to
`tiny.seed + SEED` of the config. Prints one line per pair and role (`gate_<role>_s<seed>_t<threads>=passed|MISSED`,
with every check and the seconds it took), then `gates_passed=<passed>/<pairs x roles>`; exits 1 if any gate missed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def one(config: Path, seed: int, threads: int, cache: Path) -> dict[str, dict[str, Any]]:
    """Warm-start both trainers of `config` with model seeds offset by `seed` and `threads` threads; their gates."""
    from pipeline.rl.policy_step import deterministic_torch
    from pipeline.rl.trainer import initial_policy
    from pipeline.rl.warm_start import warm_start_actor, warm_start_extractor
    from pipeline.settings import Settings

    settings = Settings(config=config)
    result: dict[str, dict[str, Any]] = {}
    for role in ("actor", "extractor"):
        trainer = settings.trainer(role)
        if trainer.warm_start.gate is None:
            continue
        model = trainer.model
        if model.tiny is not None:
            model = model.model_copy(update={"tiny": model.tiny.model_copy(update={"seed": model.tiny.seed + seed})})
        warm = trainer.warm_start.model_copy(update={"cache_dir": cache})
        deterministic_torch(threads)
        started = time.perf_counter()
        if role == "actor":
            _policy, stats = warm_start_actor(initial_policy(model), warm, settings.envs.tasks, settings.envs,
                                              settings.rollout, precision=model.precision)
        else:
            _policy, stats = warm_start_extractor(initial_policy(model), warm, settings.envs.tasks, settings.envs,
                                                  settings.extractor, merges=settings.scheduler.merge_every > 0,
                                                  precision=model.precision)
        result[role] = {"gate": stats["gate"], "passed": stats["gate_passed"],
                        "seconds": time.perf_counter() - started}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "tiny-dark-corridor.yaml")
    parser.add_argument("--seeds", type=int, default=5, help="Model seeds per thread count.")
    parser.add_argument("--seed-base", type=int, default=0, help="The first model seed offset.")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--jobs", type=int, default=2, help="One-thread pairs run side by side, at most this many.")
    parser.add_argument("--quick", action="store_true", help="Two seeds, one thread.")
    parser.add_argument("--one", type=int, nargs=2, metavar=("SEED", "THREADS"), help=argparse.SUPPRESS)
    parser.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.config, args.one[0], args.one[1], args.cache)))
        return
    if args.quick:
        args.seeds, args.threads = 2, [1]
    seeds = range(args.seed_base, args.seed_base + args.seeds)
    print(f"config={args.config}")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="warm-start-gates-") as scratch:

        def measure(pair: tuple[int, int]) -> tuple[tuple[int, int], dict[str, dict[str, Any]]]:
            seed, threads = pair
            done = subprocess.run(
                [sys.executable, __file__, "--config", str(args.config), "--one", str(seed), str(threads),
                 "--cache", str(Path(scratch) / f"s{seed}-t{threads}")],
                capture_output=True, text=True, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
            if done.returncode != 0:
                raise SystemExit(f"seed {seed}, {threads} threads failed:\n{done.stderr[-3000:]}")
            return pair, json.loads(done.stdout.strip().splitlines()[-1])

        passed = total = 0
        for threads in args.threads:
            with ThreadPoolExecutor(max_workers=max(1, args.jobs // threads)) as pool:
                for (seed, _), roles in pool.map(measure, [(seed, threads) for seed in seeds]):
                    for role, found in roles.items():
                        total += 1
                        passed += bool(found["passed"])
                        checks = ", ".join(f"{c['name'][4:]} {c['value']:.3f} ({c['samples']})"
                                           for c in found["gate"])
                        print(f"gate_{role}_s{seed}_t{threads}={'passed' if found['passed'] else 'MISSED'}  "
                              f"# {checks}; {found['seconds']:.0f}s", flush=True)
    print(f"gates_passed={passed}/{total}")
    print(f"benchmark_s={time.monotonic() - started:.0f}")
    if passed < total:
        sys.exit(1)


if __name__ == "__main__":
    main()
