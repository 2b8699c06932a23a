"""`crl` as a subprocess from the repository root, for the end-to-end tests: one command, or a whole run that fails
the test with the tail of its output and of every worker's log when it does not complete.

    result = crl("replay", "bank", str(run_dir), env=env)
    output = crl_run("configs/tiny-minihack-room.yaml", 4, run_dir, env)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CRL = [sys.executable, "-m", "pipeline.cli"]
ROOT = Path(__file__).resolve().parents[2]


def run_env(**settings: str) -> dict[str, str]:
    """This process's environment without its CRL_* variables (a run reads only its config and `settings`), offline
    (HF_HUB_OFFLINE=1), with `settings` added: what a run of an e2e test is started with."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRL_")}
    return {**env, "HF_HUB_OFFLINE": "1", **settings}


def crl(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CRL, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def crl_run(config: str, steps: int, run_dir: Path, env: dict[str, str], timeout: float = 1200) -> str:
    """`crl run CONFIG --steps STEPS --run-dir RUN_DIR`; its output (stdout and stderr)."""
    result = crl("run", config, "--steps", str(steps), "--run-dir", str(run_dir), env=env, timeout=timeout)
    output = result.stdout + result.stderr
    if result.returncode != 0:
        logs = "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted((run_dir / "logs").glob("*.log")))
        pytest.fail(f"crl run exited {result.returncode}:\n{output[-5000:]}\n{logs}")
    return output


def assert_replays_match(run_dir: Path, env: dict[str, str], actor_steps: int, *, extractor: bool = False,
                         snapshot: bool = False, timeout: float = 600) -> None:
    """`crl replay bank` rebuilds the live SQL bank (and, with `snapshot`, its snapshot) from the op log, and
    `crl replay train` reproduces every recorded weight hash of the actor's `actor_steps` steps (and, with
    `extractor`, of the extractor's steps)."""
    bank = crl("replay", "bank", str(run_dir), env=env, timeout=timeout)
    assert bank.returncode == 0, bank.stdout + bank.stderr
    assert "live SQL bank" in bank.stdout and "NO" not in bank.stdout, bank.stdout
    if snapshot:
        assert "snapshot" in bank.stdout, bank.stdout
    train = crl("replay", "train", str(run_dir), env=env, timeout=timeout)
    assert train.returncode == 0, train.stdout + train.stderr
    assert f"actor: {actor_steps} steps replayed, every weight hash matches" in train.stdout, train.stdout
    if extractor:
        assert "extractor:" in train.stdout and "every weight hash matches" in train.stdout.split("extractor:")[1], \
            train.stdout
