"""What torch's idle CPU threads cost when processes share the cores: spinning (OpenMP's default) against sleeping
(`OMP_WAIT_POLICY=PASSIVE`, what `crl run` gives its workers), measured side by side in one run.

    .venv/bin/python benchmarks/idle_threads.py --quick   # the generation beside busy processes (~2 minutes)
    .venv/bin/python benchmarks/idle_threads.py           # and a 3-step SmolLM2 `crl run` under each (~12 minutes)

Each measurement runs in processes of its own started with the policy in their environment (OpenMP reads it when
torch loads), on `--threads` torch threads (2):
- generation: SmolLM2-135M-Instruct's bfloat16 copy generating 32 tokens for 8 prompts of ~540 tokens, alone and
  beside `--busy` (2) processes that run SmolLM2-sized matmuls on as many threads with short pauses between them (as
  a trainer or a generating worker does). `gen_wall_s_<policy>_<alone|busy>` and `gen_cpu_s_<policy>_<alone|busy>`:
  the wall time and the CPU time of the generating process (a spinning thread's wait counts as CPU time).
- without `--quick`: `loop_step_s_<policy>` (`benchmarks/smol.py`'s: one step of a 3-step
  `crl run configs/smol-minihack-room.yaml`, warm starts cached), `run_wall_s_<policy>` and `run_cpu_s_<policy>` (the
  whole run, the CPU time of every process it started).
- the ratios `gen_busy_wall_ratio` and `gen_busy_cpu_ratio` (spinning / sleeping, beside the busy processes) and,
  without `--quick`, `loop_step_ratio` and `run_cpu_ratio`: above 1, sleeping is the faster.

The policies are `spin` (`GOMP_SPINCOUNT=300000`, libgomp's default: a thread spins a while before it sleeps) and
`passive` (`OMP_WAIT_POLICY=PASSIVE`). Nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

POLICIES: dict[str, dict[str, str]] = {"spin": {"GOMP_SPINCOUNT": "300000"}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}}
"""The environment of each policy. `spin` names libgomp's own default spin count (300,000 where no wait policy is
set) rather than leaving it unset, since `crl run` gives its workers `PASSIVE` where neither variable is set."""


def _environment(policy: str) -> dict[str, str]:
    """This process's environment with `policy`'s OpenMP wait settings and nothing else of OpenMP's waiting."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(POLICIES[policy])
    env["HF_HUB_OFFLINE"] = "1"
    return env


def busy(threads: int, seconds: float) -> None:
    """A process that keeps `threads` torch threads working on SmolLM2-sized matmuls, pausing 2 ms between bursts."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(512, 576), torch.randn(576, 1536)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(20):
            a @ b
        time.sleep(0.002)


def generation(threads: int, busy_processes: int) -> dict[str, float]:
    """Wall and CPU time of one batch-8, 32-token generation, beside `busy_processes` busy processes."""
    import torch

    from pipeline.models.base import SamplingParams
    from pipeline.models.settings import ModelSettings
    from pipeline.rl.trainer import initial_policy

    torch.set_num_threads(threads)
    policy = initial_policy(ModelSettings(preset="smollm2-135m-instruct")).for_generation("bfloat16")
    prompt = policy.encode("Observation: a long corridor with walls on both sides and a door at its end. " * 40)
    policy.generate([prompt] * 2, SamplingParams(max_new_tokens=2), seeds=[0, 1])  # warm-up
    others = [subprocess.Popen([sys.executable, __file__, "--busy-worker", str(threads)], env=os.environ.copy())
              for _ in range(busy_processes)]
    try:
        time.sleep(2.0 if others else 0.0)
        cpu, started = time.process_time(), time.perf_counter()
        policy.generate([prompt] * 8, SamplingParams(max_new_tokens=32), seeds=range(8))
        return {"wall_s": time.perf_counter() - started, "cpu_s": time.process_time() - cpu,
                "prompt_tokens": float(len(prompt))}
    finally:
        for other in others:
            other.kill()
            other.wait()


def _in_process(policy: str, *args: str) -> dict[str, float]:
    result = subprocess.run([sys.executable, __file__, *args], env=_environment(policy), capture_output=True,
                            text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(args)} under {policy} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def loop(policy: str, run_dir: Path) -> dict[str, float]:
    """`benchmarks/smol.py`'s loop step, and the whole run's wall and CPU time, under `policy`."""
    import smol

    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(_environment(policy))  # smol.loop_step_s starts `crl run` with this process's environment
    try:
        before, started = os.times(), time.perf_counter()
        step = smol.loop_step_s("bfloat16", run_dir)
        after = os.times()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    cpu = (after.children_user + after.children_system) - (before.children_user + before.children_system)
    return {"loop_step_s": step, "run_wall_s": time.perf_counter() - started, "run_cpu_s": cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the generation measurements only (~2 minutes)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of every process (2)")
    parser.add_argument("--busy", type=int, default=2, help="busy processes beside the generation (2)")
    parser.add_argument("--busy-worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--generation", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.busy_worker is not None:
        busy(args.busy_worker, seconds=600)
        return
    if args.generation is not None:
        print(json.dumps(generation(args.threads, args.generation)))
        return
    results: dict[str, float] = {}
    for policy in POLICIES:
        for name, count in (("alone", 0), ("busy", args.busy)):
            measured = _in_process(policy, "--threads", str(args.threads), "--generation", str(count))
            results[f"gen_wall_s_{policy}_{name}"] = measured["wall_s"]
            results[f"gen_cpu_s_{policy}_{name}"] = measured["cpu_s"]
            for key in (f"gen_wall_s_{policy}_{name}", f"gen_cpu_s_{policy}_{name}"):
                print(f"{key}={results[key]:.2f}", flush=True)
    print(f"gen_busy_wall_ratio={results['gen_wall_s_spin_busy'] / results['gen_wall_s_passive_busy']:.2f}")
    print(f"gen_busy_cpu_ratio={results['gen_cpu_s_spin_busy'] / results['gen_cpu_s_passive_busy']:.2f}")
    if args.quick:
        print("loop_step_ratio=skipped (--quick)")
        return
    with tempfile.TemporaryDirectory() as scratch:
        for policy in POLICIES:
            for name, value in loop(policy, Path(scratch) / policy).items():
                results[f"{name}_{policy}"] = value
                print(f"{name}_{policy}={value:.1f}", flush=True)
    print(f"loop_step_ratio={results['loop_step_s_spin'] / results['loop_step_s_passive']:.2f}")
    print(f"run_cpu_ratio={results['run_cpu_s_spin'] / results['run_cpu_s_passive']:.2f}")
    print(f"threads={args.threads}")


if __name__ == "__main__":
    main()
