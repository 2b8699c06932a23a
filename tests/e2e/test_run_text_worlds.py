"""`crl run` end to end on the text worlds: the tiny Coin Collector config and the paper-shaped 3-task mixture (MiniHack
Room + TextWorld Commonsense + CookingWorld), each on an embedded broker with every worker a process and the engines'
JVMs inside the rollout worker; then both replays must match, and the audit views and the report must show each
family's success."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from crl_process import assert_replays_match

from pipeline.audit.views import Audit
from pipeline.envs.jvm import engine_requirements

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

CRL = [sys.executable, "-m", "pipeline.cli"]
ROOT = Path(__file__).resolve().parents[2]
# Short warm starts: what is checked here is the loop and its replays, not competence (docs/benchmarks.md has that).
SHORT_WARM_STARTS = {"CRL_ACTOR_TRAINER__WARM_START__STEPS": "60", "CRL_ACTOR_TRAINER__WARM_START__EPISODES": "48",
                     "CRL_EXTRACTOR_TRAINER__WARM_START__STEPS": "120",
                     "CRL_EXTRACTOR_TRAINER__WARM_START__EPISODES": "32"}


def _crl(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CRL, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _run(run_dir: Path, config: str, steps: int, **settings: str) -> tuple[Path, dict[str, str], str]:
    if (missing := engine_requirements("textworld-express")) is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(missing)
        pytest.skip(missing)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRL_")}
    env.update({"HF_HUB_OFFLINE": "1", **SHORT_WARM_STARTS, **settings})
    result = _crl("run", config, "--steps", str(steps), "--run-dir", str(run_dir), env=env, timeout=1200)
    output = result.stdout + result.stderr
    if result.returncode != 0:
        logs = "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted((run_dir / "logs").glob("*.log")))
        pytest.fail(f"crl run exited {result.returncode}:\n{output[-5000:]}\n{logs}")
    return run_dir, env, output


@pytest.fixture(scope="module")
def coin_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str], str]:
    # Three steps of two groups of 8 (step 0 fills the bank, steps 1 and 2 are guided), a merge after step 1, and an
    # evaluation of 4 unseen and 2 recurring maps before training and at the last step.
    return _run(tmp_path_factory.mktemp("e2e") / "coin", "configs/tiny-textworld.yaml", 3,
                CRL_SCHEDULER__MERGE_EVERY="2", CRL_SCHEDULER__EVAL_EVERY="2", CRL_ACTOR_TRAINER__GROUPS_PER_STEP="2",
                CRL_ENVS__EVAL_TASKS_PER_ENV="4", CRL_ENVS__EVAL_RECURRING_PER_ENV="2")


@pytest.fixture(scope="module")
def mixture_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str], str]:
    # Two steps of one group per task (step 0 fills the bank, step 1 is guided), 2 unseen tasks per family evaluated
    # before training and at the last step.
    return _run(tmp_path_factory.mktemp("e2e") / "mixture", "configs/tiny-3task-text.yaml", 2,
                CRL_SCHEDULER__EVAL_EVERY="1", CRL_ENVS__EVAL_TASKS_PER_ENV="2")


def test_the_coin_collector_run_plays_distils_trains_and_replays(coin_run):
    run_dir, env, output = coin_run
    assert "completed" in output
    with Audit(run_dir) as audit:
        def one(sql: str) -> object:
            return audit.query(sql)[1][0][0]

        assert one("SELECT count(*) FROM trajectories WHERE split = 'train'") == 3 * 16
        assert one("SELECT count(*) FROM trajectories WHERE env_error IS NOT NULL") == 0
        assert one("SELECT count(DISTINCT task_family) FROM trajectories") == 1
        assert one("SELECT min(task_family) FROM trajectories") == "twx-coin"
        # the engine's own score is on every episode that took a valid action
        assert one("SELECT count(*) FROM trajectories WHERE score IS NULL AND invalid_actions < num_actions") == 0
        # what the episodes revealed reaches the bank: a lesson names the way to a coin or the rooms without one
        assert one("SELECT count(*) FROM trajectory_completed WHERE revealed::VARCHAR LIKE '%coin%'") > 0
        assert one("SELECT count(*) FROM experience_added") >= 1
        assert one("SELECT count(*) FROM trajectories WHERE split = 'train' AND step >= 1 AND guided") == 16
        assert one("SELECT count(*) FROM train_steps WHERE role = 'actor'") == 2
        rows = audit.query("SELECT split, sum(episodes) FROM family_success GROUP BY split ORDER BY split")[1]
        assert rows == [("eval", 2 * (4 + 2) * 2), ("train", 3 * 16)]
    assert_replays_match(run_dir, env, actor_steps=2)


def test_the_3task_mixture_shows_each_family_and_replays(mixture_run):
    run_dir, env, output = mixture_run
    assert "completed" in output
    assert "train by family " in output  # the summary line (no terminal) carries the live view's per-family line
    with Audit(run_dir) as audit:
        families = audit.query("SELECT task_family, split, sum(episodes) FROM family_success GROUP BY ALL "
                               "ORDER BY ALL")[1]
        config = json.loads(audit.query("SELECT config FROM run_started")[1][0][0])
    assert families == [(family, split, count) for family in ("minihack-room", "twx-cookingworld", "twx-twc")
                        for split, count in (("eval", 2 * 2 * 2), ("train", 2 * 8))]
    assert [task["env_id"] for task in config["envs"]["tasks"]] == [
        "MiniHack-Room-Random-5x5-v0", "TWX-TWC", "TWX-CookingWorld"]
    page = (run_dir / "report" / "report.html").read_text()
    section = page.split("<h2>Success per task family", 1)[1].split("</table>", 1)[0]
    assert all(f"<td>{family}</td>" in section for family in ("minihack-room", "twx-cookingworld", "twx-twc"))
    assert_replays_match(run_dir, env, actor_steps=1)
