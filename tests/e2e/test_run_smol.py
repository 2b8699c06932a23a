"""`crl run configs/smol-minihack-room.yaml` end to end: SmolLM2-135M-Instruct (the converted preset) as actor and
extractor, prompted through its chat template, LoRA adapters trained by both trainers, every worker a subprocess on
the embedded broker; then both replays. Three steps: step 0 fills the bank, steps 1 and 2 are guided and trained.
Step 1's guided episodes start as soon as step 0's episodes free their slots, before the extractor has distilled
them, so they are served nothing; step 2 is issued after the actor has trained on step 1, and its guided episodes are
served step 0's lessons. The warm starts are cached between runs (~/.cache/complementary-rl/warm-start), as for the
tiny config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from crl_process import assert_replays_match

from pipeline.audit.views import Audit

pytestmark = [pytest.mark.e2e, pytest.mark.pretrained, pytest.mark.timeout(3000)]

CRL = [sys.executable, "-m", "pipeline.cli"]
ROOT = Path(__file__).resolve().parents[2]
GROUP = 4


def _crl(*args: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CRL, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def smol_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    run_dir = tmp_path_factory.mktemp("e2e") / "smol"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRL_")}
    # An extractor step needs a buffer of generations with outcomes; two suffice for a two-step run. The warm-started
    # extractor's answers that parse are 25-45 tokens long: 64 new tokens keep every one of them and cut short only
    # the answers that run on, which do not parse at any length (the config allows 96). Groups of four (two guided,
    # two free) instead of the config's eight halve the actor's steps, the most of the run and of its replay on two
    # cores without bfloat16 (float32 there: minutes a step).
    env.update({"HF_HUB_OFFLINE": "1", "CRL_EXTRACTOR_TRAINER__BUFFER_SIZE": "2",
                "CRL_ACTOR_TRAINER__GROUP_SIZE": str(GROUP),
                "CRL_SCHEDULER__EVAL_EVERY": "0", "CRL_SCHEDULER__MERGE_EVERY": "0",
                "CRL_EXTRACTOR__GENERATION__MAX_NEW_TOKENS": "64"})
    result = _crl("run", "configs/smol-minihack-room.yaml", "--steps", "3", "--run-dir", str(run_dir), "--no-report",
                  env=env, timeout=2700)
    if result.returncode != 0:
        logs = "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted((run_dir / "logs").glob("*.log")))
        pytest.fail(f"crl run exited {result.returncode}:\n{(result.stdout + result.stderr)[-5000:]}\n{logs}")
    return run_dir, env


def test_smollm2_runs_the_whole_loop(smol_run):
    run_dir, _env = smol_run
    with Audit(run_dir) as audit:
        def one(sql: str) -> object:
            return audit.query(sql)[1][0][0]

        config = json.loads(one("SELECT config FROM run_started"))
        assert config["actor_trainer"]["model"]["preset"] == "smollm2-135m-instruct"
        assert config["actor_trainer"]["model"]["lora"]["rank"] > 0
        assert one("SELECT status FROM run_finished") == "completed"
        assert one("SELECT count(*) FROM trajectories WHERE split = 'train'") == 3 * GROUP
        assert one("SELECT count(*) FROM trajectories WHERE step = 2 AND guided AND served != '[]'") >= 1
        assert one("SELECT count(*) FROM experience_added") >= 1
        assert one("SELECT count(*) FROM train_steps WHERE role = 'actor'") == 2
        assert one("SELECT count(*) FROM train_steps WHERE role = 'extractor'") >= 1
    # Later versions are LoRA adapters on version 0.
    for role in ("actor", "extractor"):
        v1 = run_dir / "checkpoints" / role / "v000001"
        assert (v1 / "adapter.safetensors").is_file() and not (v1 / "model.safetensors").exists(), role


def test_both_replays_match(smol_run):
    run_dir, env = smol_run
    assert_replays_match(run_dir, env, 2, extractor=True, timeout=1800)
